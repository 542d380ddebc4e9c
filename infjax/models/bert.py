"""A pure-functional BERT encoder in Flax linen.

The module computes the same function as Hugging Face ``transformers.BertModel``
(post-LayerNorm BERT with absolute position embeddings) and returns the last
hidden states. Parameters are a plain nested dict whose layout is deliberately
regular so that the Hugging Face name map at the end of this file (``HF_NAMES``) is a
simple table::

    embeddings/word_embeddings/embedding          [V, H]
    embeddings/position_embeddings/embedding      [P, H]
    embeddings/token_type_embeddings/embedding    [T, H]
    embeddings/LayerNorm/{scale,bias}             [H]
    layer_{i}/attention/{query,key,value,output}/{kernel [H, H], bias [H]}
    layer_{i}/attention_LayerNorm/{scale,bias}    [H]
    layer_{i}/intermediate/{kernel [H, I], bias [I]}
    layer_{i}/output/{kernel [I, H], bias [H]}
    layer_{i}/output_LayerNorm/{scale,bias}       [H]

With ``scan_layers=True`` the ``layer_{i}`` subtrees are stacked into one
``layers`` subtree with a leading layer axis (see ``layers.stack_layers``),
as for the other families. Attention, Linear layers, LayerNorm, activations
and the layer loop are the shared ones of :mod:`infjax.models.layers`.

Usage::

    module = BertModel(config)
    hidden = module.apply({"params": params}, input_ids, attention_mask)
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

# Keys a Hugging Face BERT config.json must carry (everything else has the
# same default as transformers.BertConfig).
_REQUIRED_KEYS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
)


@dataclasses.dataclass(frozen=True)
class BertConfig:
    """Architecture hyper-parameters of a BERT encoder (HF field names)."""

    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    pad_token_id: int = 0
    lora: Any = None                   # a models.lora.LoraSpec: adapters on the projections it names (not HF's)

    def __post_init__(self):
        L.activation(self.hidden_act, source="BertConfig")
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"BertConfig.hidden_size={self.hidden_size} is not divisible by "
                f"num_attention_heads={self.num_attention_heads}"
            )

    @property
    def head_dim(self) -> int:
        """Size of one attention head."""
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any], source: str = "config.json") -> "BertConfig":
        """Build a config from a Hugging Face ``config.json`` dict.

        ``source`` names the file in error messages. Raises ``ValueError`` when
        the config is not a BERT config, lacks a required key, or asks for a
        feature this encoder does not implement.
        """
        model_type = d.get("model_type", "bert")
        if model_type != "bert":
            raise ValueError(
                f"{source}: model_type={model_type!r} is not supported by the infjax "
                "BERT encoder (expected 'bert')"
            )
        missing = [k for k in _REQUIRED_KEYS if k not in d]
        if missing:
            raise ValueError(f"{source}: missing required key(s) {missing} for a BERT config")
        position_type = d.get("position_embedding_type", "absolute")
        if position_type != "absolute":
            raise ValueError(
                f"{source}: position_embedding_type={position_type!r} is not supported "
                "(only 'absolute')"
            )
        L.activation(d.get("hidden_act", cls.hidden_act), source)
        present = {
            f.name: d[f.name] for f in dataclasses.fields(cls)
            if f.name in d and d[f.name] is not None and f.name != "lora"
        }
        try:
            return cls(**_coerce_types(present))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{source}: invalid BERT config: {e}") from e


def _coerce_types(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Cast config values to the dataclass field types (ints stay ints, etc.)."""
    casts = {"int": int, "float": float, "str": str}
    out = {}
    for field in dataclasses.fields(BertConfig):
        if field.name in kwargs:
            type_name = field.type if isinstance(field.type, str) else field.type.__name__
            out[field.name] = casts[type_name](kwargs[field.name])
    return out


class BertEmbeddings(nn.Module):
    """Word + absolute position + token type embeddings, then LayerNorm.

    Lookups sum their gradients in float32 (models/precision.py); without token type ids (every token of type 0, as
    infjax's inputs are) row 0 of the token-type table is broadcast: its gradient is a reduction, not a scatter-add of
    every token onto one row."""

    config: BertConfig
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, input_ids, token_type_ids, positions, deterministic: bool):
        cfg = self.config
        init = nn.initializers.normal(stddev=0.02)

        def embed(name, num):
            return precision.Embed(
                num, cfg.hidden_size, embedding_init=init,
                dtype=self.dtype, param_dtype=self.param_dtype, name=name,
            )

        token_types = embed("token_type_embeddings", cfg.type_vocab_size)
        x = (
            embed("word_embeddings", cfg.vocab_size)(input_ids)
            + embed("position_embeddings", cfg.max_position_embeddings)(positions)
            + (token_types.row(0, input_ids.shape) if token_type_ids is None else token_types(token_type_ids))
        )
        x = L.layer_norm(cfg.layer_norm_eps, "LayerNorm", use_bias=True, two_pass_variance=False,
                         dtype=self.dtype, param_dtype=self.param_dtype)(x)
        return nn.Dropout(cfg.hidden_dropout_prob)(x, deterministic=deterministic)


class BertSelfAttention(nn.Module):
    """Multi-head self attention with its output projection (no LayerNorm).

    ``deterministic`` is an attribute (not a call argument) so that the layer
    stack can be rematerialised and scanned by ``layers.run_layers``.
    """

    config: BertConfig
    deterministic: bool = True
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, segment_ids):
        cfg = self.config
        b, t, _ = x.shape
        kw = dict(use_bias=True, dtype=self.dtype, param_dtype=self.param_dtype, lora=cfg.lora)
        q, k, v = (
            L.dense(cfg.hidden_size, name, role=role, **kw)(x).reshape(b, t, cfg.num_attention_heads, cfg.head_dim)
            for name, role in (("query", "q"), ("key", "k"), ("value", "v"))
        )
        drop = cfg.attention_probs_dropout_prob
        ctx = attention(q, k, v, segment_ids, dropout=None if self.deterministic or drop == 0.0 else nn.Dropout(drop))
        return L.dense(cfg.hidden_size, "output", role="o", **kw)(ctx.reshape(b, t, cfg.hidden_size))


class BertLayer(nn.Module):
    """One post-LayerNorm transformer block: LN(x + attn(x)), then LN(x + mlp(x)); x and the norms in
    `residual_dtype` (None: the compute dtype; models/precision.py), the projections and attention in `dtype`."""

    config: BertConfig
    deterministic: bool = True
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    residual_dtype: Any = None

    @nn.compact
    def __call__(self, x, segment_ids):
        cfg = self.config
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)

        def layer_norm(name):
            return L.layer_norm(cfg.layer_norm_eps, name, use_bias=True, two_pass_variance=False,
                                dtype=self.residual_dtype or self.dtype, param_dtype=self.param_dtype)

        def dropout(h):
            return nn.Dropout(cfg.hidden_dropout_prob)(h, deterministic=self.deterministic)

        attn = BertSelfAttention(cfg, self.deterministic, name="attention", **kw)(x, segment_ids)
        x = layer_norm("attention_LayerNorm")(precision.add(x, dropout(attn)))
        h = L.dense(cfg.intermediate_size, "intermediate", use_bias=True, lora=cfg.lora, role="up", **kw)(x)
        h = L.dense(cfg.hidden_size, "output", use_bias=True, lora=cfg.lora, role="down", **kw)(
            L.activation(cfg.hidden_act)(h))
        return layer_norm("output_LayerNorm")(precision.add(x, dropout(h)))


class BertModel(nn.Module):
    """BERT encoder returning the last hidden states [B, L, H].

    Attributes:
      config: architecture.
      dtype: compute dtype (e.g. ``jnp.bfloat16``).
      param_dtype: dtype of the parameters (float32).
      residual: the residual stream's dtype (and the output's) under a lower-precision `dtype`: "float32" (as
        torch.autocast) or "compute" (models/precision.py).
      remat: what each layer keeps for the backward pass and what it recomputes: a policy of
        models/remat.py (none, dots, dots_except_mlp, offload, full; True/False = full/none).
        (gradient checkpointing); does not change the parameter tree.
      scan_layers: run the layers with ``nn.scan`` (parameters stacked under
        ``layers`` with a leading layer axis).

    ``attention_mask`` [B, L] holds segment ids: a padding mask (1 real, 0
    padding) or a packed row (1, 2, ... one per text, 0 on the tail); each
    text attends only to itself and its positions start at 0.
    """

    config: BertConfig
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    residual: str = "float32"
    remat: Any = "none"
    scan_layers: bool = False
    activation_sharding: Any = None    # of the [B, L, H] activations between layers (layers.run_layers)

    @nn.compact
    def __call__(self, input_ids, attention_mask=None, token_type_ids=None, deterministic: bool = True):
        cfg = self.config
        if attention_mask is None:
            attention_mask = jnp.ones_like(input_ids)
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        stream = precision.residual_dtype(self.dtype, self.residual)
        # the lookups, their sum and its LayerNorm are the stream's start: in its dtype
        x = BertEmbeddings(cfg, name="embeddings", dtype=stream, param_dtype=self.param_dtype)(
            input_ids, token_type_ids, segment_positions(attention_mask), deterministic)
        layer_kwargs = dict(config=cfg, deterministic=deterministic, residual_dtype=stream, **kw)
        return L.run_layers(BertLayer, layer_kwargs, x, [0] * cfg.num_hidden_layers,
                            (attention_mask,), first=0,
                            remat=self.remat, scan=self.scan_layers, sharding=self.activation_sharding)


def hf_names(config: BertConfig) -> Iterator[tuple[str, tuple[str, ...], bool]]:
    """``(hf_name, flax_path, transpose)`` for every tensor of HF ``BertModel``."""
    emb = ("embeddings",)
    yield "embeddings.word_embeddings.weight", emb + ("word_embeddings", "embedding"), False
    yield "embeddings.position_embeddings.weight", emb + ("position_embeddings", "embedding"), False
    yield "embeddings.token_type_embeddings.weight", emb + ("token_type_embeddings", "embedding"), False
    yield "embeddings.LayerNorm.weight", emb + ("LayerNorm", "scale"), False
    yield "embeddings.LayerNorm.bias", emb + ("LayerNorm", "bias"), False
    for i in range(config.num_hidden_layers):
        hf = f"encoder.layer.{i}."
        fx = (f"layer_{i}",)
        linears = {
            "attention.self.query": fx + ("attention", "query"),
            "attention.self.key": fx + ("attention", "key"),
            "attention.self.value": fx + ("attention", "value"),
            "attention.output.dense": fx + ("attention", "output"),
            "intermediate.dense": fx + ("intermediate",),
            "output.dense": fx + ("output",),
        }
        for hf_mod, fx_mod in linears.items():
            yield hf + hf_mod + ".weight", fx_mod + ("kernel",), True
            yield hf + hf_mod + ".bias", fx_mod + ("bias",), False
        norms = {
            "attention.output.LayerNorm": fx + ("attention_LayerNorm",),
            "output.LayerNorm": fx + ("output_LayerNorm",),
        }
        for hf_mod, fx_mod in norms.items():
            yield hf + hf_mod + ".weight", fx_mod + ("scale",), False
            yield hf + hf_mod + ".bias", fx_mod + ("bias",), False


# Task checkpoints (BertForMaskedLM, ...) prefix "bert."; their pooler / MLM heads and the position_ids
# buffer carry nothing an encoder uses.
HF_NAMES = NameMap("BERT", hf_names, BertModel, prefixes=("bert.",),
                   ignorable=re.compile(r"^(pooler\.|cls\.|embeddings\.position_ids$)"))
