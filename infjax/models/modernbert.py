"""ModernBERT encoder in Flax linen (computes HF ``transformers.ModernBertModel``).

Differences from BERT: token embeddings only, followed by a bias-free
LayerNorm; pre-norm blocks (layer 0 has no attention norm); fused ``Wqkv``
projection; RoPE (rotate-half) with one theta for global layers and another
for local ones; global and local (sliding-window, ``|i - j| <= local_attention
// 2``) attention alternating per ``layer_types``; GeGLU MLP with one fused
``Wi`` (first half through the activation, second half the gate); no biases;
a final LayerNorm. Inputs are right-padded or packed (segment ids); positions count from 0 in each text.
Parameters::

    embeddings/tok_embeddings/embedding     [V, H]
    embeddings/norm/scale                   [H]
    layer_{i}/attn_norm/scale               [H]      (i > 0)
    layer_{i}/attn/Wqkv/kernel              [H, 3H]
    layer_{i}/attn/Wo/kernel                [H, H]
    layer_{i}/mlp_norm/scale                [H]
    layer_{i}/mlp/Wi/kernel                 [H, 2I]
    layer_{i}/mlp/Wo/kernel                 [I, H]
    final_norm/scale                        [H]

With ``scan_layers=True`` layers 1..N-1 are stacked under ``layers`` (layer 0
stays unrolled: it has no attention norm); the global/local choice then
becomes a scanned boolean that selects the mask and the rotary tables.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Iterator, Mapping

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from infjax.models import layers as L, precision
from infjax.models.attention import attention, segment_positions
from infjax.models.hf.names import NameMap

ARCHITECTURE = "ModernBertModel"
LAYER_TYPES = ("full_attention", "sliding_attention")
_REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


@dataclasses.dataclass(frozen=True)
class ModernBertConfig:
    """Architecture of a ModernBERT encoder (HF field names where they exist)."""

    vocab_size: int = 50368
    hidden_size: int = 768
    intermediate_size: int = 1152
    num_hidden_layers: int = 22
    num_attention_heads: int = 12
    norm_eps: float = 1e-5
    hidden_activation: str = "gelu"
    layer_types: tuple[str, ...] = tuple("full_attention" if i % 3 == 0 else "sliding_attention" for i in range(22))
    global_rope_theta: float = 160000.0
    local_rope_theta: float = 10000.0
    local_attention: int = 128           # total window; a token sees |i - j| <= local_attention // 2
    embedding_dropout: float = 0.0
    attention_dropout: float = 0.0       # on the attention probabilities and after Wo
    mlp_dropout: float = 0.0
    lora: Any = None                     # a models.lora.LoraSpec: adapters on the projections it names (not HF's)

    def __post_init__(self):
        L.activation(self.hidden_activation, key="hidden_activation")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size={self.hidden_size} is not divisible by "
                             f"num_attention_heads={self.num_attention_heads}")
        if len(self.layer_types) != self.num_hidden_layers or not set(self.layer_types) <= set(LAYER_TYPES):
            raise ValueError(f"layer_types={list(self.layer_types)} must list {self.num_hidden_layers} entries "
                             f"from {list(LAYER_TYPES)}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def window(self) -> int:
        """Half window of the local layers (HF ``config.sliding_window``)."""
        return self.local_attention // 2

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any], source: str = "config.json") -> "ModernBertConfig":
        """Build from an HF ModernBERT ``config.json`` (old ``global_rope_theta`` style or new ``rope_parameters``)."""
        if d.get("model_type") != "modernbert":
            raise ValueError(f"{source}: model_type={d.get('model_type')!r} is not a ModernBERT config "
                             "(expected 'modernbert')")
        missing = [k for k in _REQUIRED_KEYS if k not in d]
        if missing:
            raise ValueError(f"{source}: missing required key(s) {missing} for a ModernBERT config")
        for key in ("norm_bias", "attention_bias", "mlp_bias"):
            if d.get(key):
                raise ValueError(f"{source}: {key}=true is not supported (ModernBERT-base has no biases)")
        n = int(d["num_hidden_layers"])
        layer_types = d.get("layer_types")
        if layer_types is None:
            every = int(d.get("global_attn_every_n_layers", 3))
            layer_types = ["sliding_attention" if i % every else "full_attention" for i in range(n)]
        rope = d.get("rope_parameters") or {}
        thetas = {}
        for kind, old_key, default in (("full_attention", "global_rope_theta", 160000.0),
                                       ("sliding_attention", "local_rope_theta", 10000.0)):
            params = rope.get(kind) or {}
            r = L.RopeConfig.from_hf(params, d.get(old_key, default), source, f"rope_parameters.{kind}")
            if r.rope_type != "default":
                raise ValueError(f"{source}: rope_parameters.{kind} rope_type={r.rope_type!r} is not supported "
                                 "for ModernBERT (only 'default')")
            thetas[kind] = r.theta
        try:
            return cls(
                vocab_size=int(d["vocab_size"]),
                hidden_size=int(d["hidden_size"]),
                intermediate_size=int(d["intermediate_size"]),
                num_hidden_layers=n,
                num_attention_heads=int(d["num_attention_heads"]),
                norm_eps=float(d.get("norm_eps", 1e-5)),
                hidden_activation=str(d.get("hidden_activation", "gelu")),
                layer_types=tuple(layer_types),
                global_rope_theta=thetas["full_attention"],
                local_rope_theta=thetas["sliding_attention"],
                local_attention=int(d.get("local_attention", 128)),
                embedding_dropout=float(d.get("embedding_dropout") or 0.0),
                attention_dropout=float(d.get("attention_dropout") or 0.0),
                mlp_dropout=float(d.get("mlp_dropout") or 0.0),
            )
        except (TypeError, ValueError) as e:
            raise ValueError(f"{source}: invalid ModernBERT config: {e}") from e


class ModernBertEmbeddings(nn.Module):
    """Token embeddings -> LayerNorm (no bias) -> dropout."""

    config: ModernBertConfig
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, input_ids, deterministic: bool):
        cfg = self.config
        x = precision.Embed(cfg.vocab_size, cfg.hidden_size, embedding_init=nn.initializers.normal(stddev=0.02),
                     dtype=self.dtype, param_dtype=self.param_dtype, name="tok_embeddings")(input_ids)
        x = L.layer_norm(cfg.norm_eps, "norm", dtype=self.dtype, param_dtype=self.param_dtype)(x)
        return nn.Dropout(cfg.embedding_dropout)(x, deterministic=deterministic)


class ModernBertAttention(nn.Module):
    """Fused-QKV self attention with RoPE inside segments; `window` None (global) or the local half window."""

    config: ModernBertConfig
    deterministic: bool = True
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, cos, sin, segment_ids, window):
        cfg = self.config
        b, t, _ = x.shape
        kw = dict(use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype, lora=cfg.lora)
        qkv = L.dense(3 * cfg.hidden_size, "Wqkv", role="qkv", **kw)(x).reshape(b, t, 3, cfg.num_attention_heads, cfg.head_dim)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        q, k = L.apply_rope(q, cos, sin), L.apply_rope(k, cos, sin)
        train_drop = not self.deterministic and cfg.attention_dropout > 0.0
        ctx = attention(q, k, v, segment_ids, window=window,
                        dropout=nn.Dropout(cfg.attention_dropout) if train_drop else None)
        out = L.dense(cfg.hidden_size, "Wo", role="o", **kw)(ctx.reshape(b, t, cfg.hidden_size))
        return nn.Dropout(cfg.attention_dropout)(out, deterministic=self.deterministic)


class ModernBertMLP(nn.Module):
    """GeGLU: ``Wo(act(input) * gate)`` with ``input, gate = split(Wi(x))``."""

    config: ModernBertConfig
    deterministic: bool = True
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        cfg = self.config
        kw = dict(use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype, lora=cfg.lora)
        a, gate = jnp.split(L.dense(2 * cfg.intermediate_size, "Wi", role="gate_up", **kw)(x), 2, axis=-1)
        h = L.gated(L.ACTIVATIONS[cfg.hidden_activation], a, gate)
        h = nn.Dropout(cfg.mlp_dropout)(h, deterministic=self.deterministic)
        return L.dense(cfg.hidden_size, "Wo", role="down", **kw)(h)


class ModernBertLayer(nn.Module):
    """Pre-norm block; ``first`` (layer 0) has no attention norm. x and the norms in `residual_dtype` (None: the
    compute dtype; models/precision.py), the projections, attention and MLP in `dtype`."""

    config: ModernBertConfig
    first: bool = False
    deterministic: bool = True
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    residual_dtype: Any = None

    @nn.compact
    def __call__(self, x, cos, sin, segment_ids, window):
        cfg = self.config
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        norm = dict(dtype=self.residual_dtype or self.dtype, param_dtype=self.param_dtype)
        h = x if self.first else L.layer_norm(cfg.norm_eps, "attn_norm", **norm)(x)
        x = precision.add(x, ModernBertAttention(cfg, self.deterministic, name="attn", **kw)(h, cos, sin, segment_ids,
                                                                                              window))
        h = L.layer_norm(cfg.norm_eps, "mlp_norm", **norm)(x)
        return precision.add(x, ModernBertMLP(cfg, self.deterministic, name="mlp", **kw)(h))


def _select(is_global, cos_g, sin_g, cos_l, sin_l, segment_ids, window):
    """Rotary tables, segment ids and window of a global (True) or local layer; static bool or traced scalar.

    A global layer has no window; traced (scanned layers), it gets a window no distance reaches.
    """
    if isinstance(is_global, (bool, np.bool_)):
        return (cos_g, sin_g, segment_ids, None) if is_global else (cos_l, sin_l, segment_ids, window)
    return (jnp.where(is_global, cos_g, cos_l), jnp.where(is_global, sin_g, sin_l), segment_ids,
            jnp.where(is_global, segment_ids.shape[1], window))


class ModernBertModel(nn.Module):
    """ModernBERT encoder returning the final-normed hidden states [B, L, H].

    Attributes:
      config: architecture.
      dtype: compute dtype (e.g. ``jnp.bfloat16``); parameters stay ``param_dtype``.
      residual: the residual stream's dtype under a lower-precision `dtype`: "float32" (as torch.autocast)
        or "compute" (models/precision.py).
      remat: what each layer keeps for the backward pass and what it recomputes: a policy of
        models/remat.py (none, dots, dots_except_mlp, offload, full; True/False = full/none).
      scan_layers: run layers 1..N-1 with ``nn.scan`` (parameters stacked under ``layers``).

    ``attention_mask`` [B, L] holds segment ids (a padding mask, or 1, 2, ... per packed text);
    positions restart at 0 in each segment and the local window never crosses one.
    """

    config: ModernBertConfig
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    residual: str = "float32"
    remat: Any = "none"
    scan_layers: bool = False
    activation_sharding: Any = None    # of the [B, L, H] activations between layers (layers.run_layers)

    @nn.compact
    def __call__(self, input_ids, attention_mask=None, deterministic: bool = True):
        cfg = self.config
        if attention_mask is None:
            attention_mask = jnp.ones_like(input_ids)
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        stream = precision.residual_dtype(self.dtype, self.residual)
        x = ModernBertEmbeddings(cfg, name="embeddings", dtype=stream, param_dtype=self.param_dtype)(
            input_ids, deterministic)
        positions = segment_positions(attention_mask)
        cos_g, sin_g = L.rope_cos_sin(positions, L.rope_inv_freq(cfg.head_dim, L.RopeConfig(cfg.global_rope_theta)))
        cos_l, sin_l = L.rope_cos_sin(positions, L.rope_inv_freq(cfg.head_dim, L.RopeConfig(cfg.local_rope_theta)))
        shared = (cos_g, sin_g, cos_l, sin_l, attention_mask, cfg.window)
        is_global = [kind == "full_attention" for kind in cfg.layer_types]
        layer_kwargs = dict(config=cfg, deterministic=deterministic, residual_dtype=stream, **kw)
        x = L.run_layers(ModernBertLayer, {**layer_kwargs, "first": True}, x, is_global[:1], shared,
                         first=0, remat=self.remat, scan=False, select=_select, sharding=self.activation_sharding)
        if cfg.num_hidden_layers > 1:
            x = L.run_layers(ModernBertLayer, layer_kwargs, x, is_global[1:], shared, first=1,
                             remat=self.remat, scan=self.scan_layers, select=_select,
                             sharding=self.activation_sharding)
        return L.layer_norm(cfg.norm_eps, "final_norm", dtype=stream, param_dtype=self.param_dtype)(x)


def hf_names(config: ModernBertConfig) -> Iterator[tuple[str, tuple[str, ...], bool]]:
    """``(hf_name, flax_path, transpose)`` for every tensor of HF ``ModernBertModel`` (``Wqkv`` and ``Wi``
    stay fused; layer 0 has no attention norm)."""
    yield "embeddings.tok_embeddings.weight", ("embeddings", "tok_embeddings", "embedding"), False
    yield "embeddings.norm.weight", ("embeddings", "norm", "scale"), False
    for i in range(config.num_hidden_layers):
        hf, fx = f"layers.{i}.", (f"layer_{i}",)
        if i > 0:
            yield hf + "attn_norm.weight", fx + ("attn_norm", "scale"), False
        yield hf + "attn.Wqkv.weight", fx + ("attn", "Wqkv", "kernel"), True
        yield hf + "attn.Wo.weight", fx + ("attn", "Wo", "kernel"), True
        yield hf + "mlp_norm.weight", fx + ("mlp_norm", "scale"), False
        yield hf + "mlp.Wi.weight", fx + ("mlp", "Wi", "kernel"), True
        yield hf + "mlp.Wo.weight", fx + ("mlp", "Wo", "kernel"), True
    yield "final_norm.weight", ("final_norm", "scale"), False


# ModernBertForMaskedLM (answerdotai/ModernBERT-base) prefixes "model."; its MLM head and decoder and any
# classifier head are not part of the encoder. Layers 1..N-1 are the scanned ones.
HF_NAMES = NameMap("ModernBERT", hf_names, ModernBertModel, prefixes=("model.",),
                   ignorable=re.compile(r"^(head|decoder|classifier)\."), scanned_from=1)
