"""Llama (3.2) and Qwen2 (2.5) decoders as embedding backbones, in Flax linen.

One module computes both HF ``LlamaModel`` and ``Qwen2Model`` (pre-norm
blocks, RMSNorm, RoPE in the rotate-half layout, grouped-query attention,
SwiGLU MLP, final norm). The families differ by data, not by code paths:
Qwen2 has biases on the q/k/v projections (``qkv_bias``); Llama 3.2 uses the
"llama3" RoPE frequency schedule (``rope``). Tied or untied LM heads do not
matter to an encoder: the head is not part of this module.

Attention is causal plus a key-padding mask; inputs are left-padded and
position ids count from 0 at each text's first token, so a left-padded or
packed sequence gets the same hidden states as the unpadded one. Parameters::

    embed_tokens/embedding                              [V, H]
    layer_{i}/input_layernorm/scale                     [H]
    layer_{i}/self_attn/q_proj/{kernel [H, N*D], bias}  (bias only with qkv_bias)
    layer_{i}/self_attn/{k_proj,v_proj}/{kernel [H, K*D], bias}
    layer_{i}/self_attn/o_proj/kernel                   [N*D, H]
    layer_{i}/post_attention_layernorm/scale            [H]
    layer_{i}/mlp/{gate_proj,up_proj}/kernel [H, I], mlp/down_proj/kernel [I, H]
    norm/scale                                          [H]

With ``scan_layers=True`` the ``layer_{i}`` subtrees are stacked into one
``layers`` subtree with a leading layer axis (see ``layers.stack_layers``).
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Iterator, Mapping

import flax.linen as nn
import jax.numpy as jnp

from infjax.models import layers as L, precision
from infjax.models.attention import attention, segment_positions
from infjax.models.hf.names import NameMap

MODEL_TYPES = ("llama", "qwen2")
# HF class of the bare model (what an export's config.json names as architecture).
ARCHITECTURES = {"llama": "LlamaModel", "qwen2": "Qwen2Model"}
_REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """Architecture of a Llama / Qwen2 decoder (HF field names where they exist)."""

    model_type: str = "llama"
    vocab_size: int = 128256
    hidden_size: int = 2048
    intermediate_size: int = 8192
    num_hidden_layers: int = 16
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 64
    rms_norm_eps: float = 1e-5
    hidden_act: str = "silu"
    qkv_bias: bool = False             # Qwen2: biases on q/k/v (never on o_proj)
    attention_dropout: float = 0.0
    rope: L.RopeConfig = L.RopeConfig(theta=500000.0)
    tie_word_embeddings: bool = False  # informational: the LM head is not part of the encoder
    lora: Any = None                   # a models.lora.LoraSpec: adapters on the projections it names (not HF's)

    def __post_init__(self):
        L.activation(self.hidden_act)
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"model_type={self.model_type!r} is not a decoder family; expected one of {MODEL_TYPES}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any], source: str = "config.json") -> "DecoderConfig":
        """Build from an HF Llama / Qwen2 ``config.json`` dict; ValueError names what is not supported."""
        model_type = d.get("model_type")
        if model_type not in MODEL_TYPES:
            raise ValueError(f"{source}: model_type={model_type!r} is not a Llama/Qwen2 config "
                             f"(expected one of {list(MODEL_TYPES)})")
        missing = [k for k in _REQUIRED_KEYS if k not in d]
        if missing:
            raise ValueError(f"{source}: missing required key(s) {missing} for a {model_type} config")
        if model_type == "llama":
            for key in ("attention_bias", "mlp_bias"):
                if d.get(key):
                    raise ValueError(f"{source}: {key}=true is not supported for llama (Llama 3.2 has none)")
            qkv_bias = False
        else:
            qkv_bias = True
            sliding = d.get("use_sliding_window") or "sliding_attention" in (d.get("layer_types") or [])
            if sliding:
                raise ValueError(f"{source}: use_sliding_window / sliding_attention layers are not supported "
                                 "for qwen2 (Qwen2.5 checkpoints do not use them)")
        heads = int(d["num_attention_heads"])
        rope_params = d.get("rope_parameters") or d.get("rope_scaling")
        rope_key = "rope_parameters" if d.get("rope_parameters") else "rope_scaling"
        try:
            return cls(
                model_type=model_type,
                vocab_size=int(d["vocab_size"]),
                hidden_size=int(d["hidden_size"]),
                intermediate_size=int(d["intermediate_size"]),
                num_hidden_layers=int(d["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(d.get("head_dim") or int(d["hidden_size"]) // heads),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                hidden_act=str(d.get("hidden_act", "silu")),
                qkv_bias=qkv_bias,
                attention_dropout=float(d.get("attention_dropout") or 0.0),
                rope=L.RopeConfig.from_hf(rope_params, d.get("rope_theta", 10000.0), source, rope_key),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            )
        except (TypeError, ValueError) as e:
            if str(e).startswith(source):
                raise
            raise ValueError(f"{source}: invalid {model_type} config: {e}") from e


class DecoderAttention(nn.Module):
    """Grouped-query self attention with RoPE; q/k/v biases per ``config.qkv_bias``."""

    config: DecoderConfig
    deterministic: bool = True
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, cos, sin, segment_ids, cache=None):
        """Self attention of x [B, T, H].

        With a key/value `cache` (generation: an object whose ``attend(q, k, v)`` stores the new keys/values and
        attends over all cached ones, returning ``(context, cache)``), returns ``(output, cache)`` and ignores
        `segment_ids`."""
        cfg = self.config
        b, t, _ = x.shape
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype, lora=cfg.lora)
        q = L.dense(cfg.num_attention_heads * cfg.head_dim, "q_proj", use_bias=cfg.qkv_bias, role="q", **kw)(x)
        k = L.dense(cfg.num_key_value_heads * cfg.head_dim, "k_proj", use_bias=cfg.qkv_bias, role="k", **kw)(x)
        v = L.dense(cfg.num_key_value_heads * cfg.head_dim, "v_proj", use_bias=cfg.qkv_bias, role="v", **kw)(x)
        q = L.apply_rope(q.reshape(b, t, cfg.num_attention_heads, cfg.head_dim), cos, sin)
        k = L.apply_rope(k.reshape(b, t, cfg.num_key_value_heads, cfg.head_dim), cos, sin)
        v = v.reshape(b, t, cfg.num_key_value_heads, cfg.head_dim)
        if cache is not None:
            ctx, cache = cache.attend(q, k, v)
        else:
            drop = None if self.deterministic or cfg.attention_dropout == 0.0 else nn.Dropout(cfg.attention_dropout)
            ctx = attention(q, k, v, segment_ids, causal=True, dropout=drop)
        out = L.dense(cfg.hidden_size, "o_proj", use_bias=False, role="o", **kw)(ctx.reshape(b, t, -1))
        return out if cache is None else (out, cache)


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)); x and the norms in `residual_dtype` (None: the
    compute dtype; models/precision.py), the projections, attention and MLP in `dtype`."""

    config: DecoderConfig
    deterministic: bool = True
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    residual_dtype: Any = None

    @nn.compact
    def __call__(self, x, cos, sin, segment_ids, cache=None):
        """The block on x [B, T, H]; with a key/value `cache` (see `DecoderAttention`) returns (x, cache)."""
        cfg = self.config
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        norm = dict(dtype=self.residual_dtype or self.dtype, param_dtype=self.param_dtype)
        h = L.RMSNorm(cfg.rms_norm_eps, name="input_layernorm", **norm)(x)
        attn = DecoderAttention(cfg, self.deterministic, name="self_attn", **kw)(h, cos, sin, segment_ids, cache)
        if cache is not None:
            attn, cache = attn
        x = precision.add(x, attn)
        h = L.RMSNorm(cfg.rms_norm_eps, name="post_attention_layernorm", **norm)(x)
        x = precision.add(x, L.GatedMLP(cfg.intermediate_size, cfg.hidden_act, name="mlp", lora=cfg.lora, **kw)(h))
        return x if cache is None else (x, cache)


class DecoderModel(nn.Module):
    """Llama / Qwen2 decoder returning the final-normed hidden states [B, L, H].

    Attributes:
      config: architecture.
      dtype: compute dtype (e.g. ``jnp.bfloat16``); parameters stay ``param_dtype``.
      residual: the residual stream's dtype under a lower-precision `dtype`: "float32" (as torch.autocast)
        or "compute" (models/precision.py).
      remat: what each layer keeps for the backward pass and what it recomputes: a policy of
        models/remat.py (none, dots, dots_except_mlp, offload, full; True/False = full/none).
      scan_layers: run the blocks with ``nn.scan`` (parameters stacked under ``layers``).

    ``attention_mask`` [B, L] holds segment ids: a (left) padding mask, or 1, 2, ... per packed
    text; attention is causal inside a segment and positions restart at 0 in each.
    """

    config: DecoderConfig
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    residual: str = "float32"
    remat: Any = "none"
    scan_layers: bool = False
    activation_sharding: Any = None    # of the [B, L, H] activations between layers (layers.run_layers)

    @nn.compact
    def __call__(self, input_ids, attention_mask=None, deterministic: bool = True, position_ids=None):
        cfg = self.config
        stream = precision.residual_dtype(self.dtype, self.residual)
        if attention_mask is None:
            attention_mask = jnp.ones_like(input_ids)
        if position_ids is None:
            position_ids = segment_positions(attention_mask)
        x = precision.Embed(cfg.vocab_size, cfg.hidden_size, embedding_init=nn.initializers.normal(stddev=0.02),
                     dtype=stream, param_dtype=self.param_dtype, name="embed_tokens")(input_ids)
        cos, sin = L.rope_cos_sin(position_ids, L.rope_inv_freq(cfg.head_dim, cfg.rope))
        layer_kwargs = dict(config=cfg, deterministic=deterministic, dtype=self.dtype, param_dtype=self.param_dtype,
                            residual_dtype=stream)
        x = L.run_layers(DecoderLayer, layer_kwargs, x, [0] * cfg.num_hidden_layers,
                         (cos, sin, attention_mask), first=0,
                         remat=self.remat, scan=self.scan_layers, sharding=self.activation_sharding)
        return L.RMSNorm(cfg.rms_norm_eps, dtype=stream, param_dtype=self.param_dtype, name="norm")(x)


def hf_names(config: DecoderConfig) -> Iterator[tuple[str, tuple[str, ...], bool]]:
    """``(hf_name, flax_path, transpose)`` for every tensor of HF ``LlamaModel`` / ``Qwen2Model``. RoPE
    needs no permutation: the module uses HF's rotate-half layout."""
    yield "embed_tokens.weight", ("embed_tokens", "embedding"), False
    for i in range(config.num_hidden_layers):
        hf, fx = f"layers.{i}.", (f"layer_{i}",)
        yield hf + "input_layernorm.weight", fx + ("input_layernorm", "scale"), False
        for proj in ("q_proj", "k_proj", "v_proj"):
            yield hf + f"self_attn.{proj}.weight", fx + ("self_attn", proj, "kernel"), True
            if config.qkv_bias:
                yield hf + f"self_attn.{proj}.bias", fx + ("self_attn", proj, "bias"), False
        yield hf + "self_attn.o_proj.weight", fx + ("self_attn", "o_proj", "kernel"), True
        yield hf + "post_attention_layernorm.weight", fx + ("post_attention_layernorm", "scale"), False
        for proj in ("gate_proj", "up_proj", "down_proj"):
            yield hf + f"mlp.{proj}.weight", fx + ("mlp", proj, "kernel"), True
    yield "norm.weight", ("norm", "scale"), False


# *ForCausalLM checkpoints prefix "model."; the LM head (tied or not) is not part of an encoder, and old
# checkpoints carry stale rotary buffers.
HF_NAMES = NameMap(lambda config: config.model_type, hf_names, DecoderModel, prefixes=("model.",),
                   ignorable=re.compile(r"^lm_head\.weight$|(^|\.)rotary_emb\.inv_freq$"))
