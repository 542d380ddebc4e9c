"""A pure-functional BERT encoder in Flax linen.

The module computes the same function as Hugging Face ``transformers.BertModel``
(post-LayerNorm BERT with absolute position embeddings) and returns the last
hidden states. Parameters are a plain nested dict whose layout is deliberately
regular so that the Hugging Face name map in :mod:`infjax.models.hf_io` is a
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

Usage::

    module = BertModel(config)
    hidden = module.apply({"params": params}, input_ids, attention_mask)
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp

# Hugging Face activation names -> JAX functions. "gelu" is the exact erf GELU
# (what HF's ACT2FN["gelu"] computes); the two tanh variants are the
# approximation used by GPT-2 style checkpoints.
_ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "relu": jax.nn.relu,
}

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

    def __post_init__(self):
        if self.hidden_act not in _ACTIVATIONS:
            raise ValueError(
                f"BertConfig.hidden_act={self.hidden_act!r} is not supported; "
                f"expected one of {sorted(_ACTIVATIONS)}"
            )
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
        hidden_act = d.get("hidden_act", cls.hidden_act)
        if not isinstance(hidden_act, str) or hidden_act not in _ACTIVATIONS:
            raise ValueError(
                f"{source}: hidden_act={hidden_act!r} is not supported; expected one of "
                f"{sorted(_ACTIVATIONS)}"
            )
        present = {
            f.name: d[f.name] for f in dataclasses.fields(cls)
            if f.name in d and d[f.name] is not None
        }
        try:
            return cls(**_coerce_types(present))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{source}: invalid BERT config: {e}") from e

    def to_hf_dict(self) -> dict[str, Any]:
        """The Hugging Face ``config.json`` dict describing this architecture."""
        d = dataclasses.asdict(self)
        d.update(
            model_type="bert",
            architectures=["BertModel"],
            position_embedding_type="absolute",
        )
        return d


def _coerce_types(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Cast config values to the dataclass field types (ints stay ints, etc.)."""
    casts = {"int": int, "float": float, "str": str}
    out = {}
    for field in dataclasses.fields(BertConfig):
        if field.name in kwargs:
            type_name = field.type if isinstance(field.type, str) else field.type.__name__
            out[field.name] = casts[type_name](kwargs[field.name])
    return out


def attention_mask_to_bool(attention_mask: jax.Array) -> jax.Array:
    """[B, L] padding mask (1 = real token) -> boolean key mask [B, 1, 1, L]."""
    return (attention_mask > 0)[:, None, None, :]


class BertEmbeddings(nn.Module):
    """Word + absolute position + token type embeddings, then LayerNorm."""

    config: BertConfig
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, input_ids, token_type_ids, deterministic: bool):
        cfg = self.config
        seq_len = input_ids.shape[-1]
        if seq_len > cfg.max_position_embeddings:
            raise ValueError(
                f"sequence length {seq_len} exceeds max_position_embeddings="
                f"{cfg.max_position_embeddings}"
            )
        init = nn.initializers.normal(stddev=0.02)

        def embed(name, num):
            return nn.Embed(
                num, cfg.hidden_size, embedding_init=init,
                dtype=self.dtype, param_dtype=self.param_dtype, name=name,
            )

        positions = jnp.arange(seq_len)[None, :]
        x = (
            embed("word_embeddings", cfg.vocab_size)(input_ids)
            + embed("position_embeddings", cfg.max_position_embeddings)(positions)
            + embed("token_type_embeddings", cfg.type_vocab_size)(token_type_ids)
        )
        x = nn.LayerNorm(
            epsilon=cfg.layer_norm_eps, dtype=self.dtype, param_dtype=self.param_dtype,
            name="LayerNorm",
        )(x)
        return nn.Dropout(cfg.hidden_dropout_prob)(x, deterministic=deterministic)


class BertSelfAttention(nn.Module):
    """Multi-head self attention with its output projection (no LayerNorm)."""

    config: BertConfig
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, key_mask, deterministic: bool):
        cfg = self.config
        batch, seq_len, _ = x.shape

        def dense(name):
            return nn.Dense(
                cfg.hidden_size, dtype=self.dtype, param_dtype=self.param_dtype,
                kernel_init=nn.initializers.normal(stddev=0.02), name=name,
            )

        def heads(t):
            return t.reshape(batch, seq_len, cfg.num_attention_heads, cfg.head_dim)

        q = heads(dense("query")(x))
        k = heads(dense("key")(x))
        v = heads(dense("value")(x))
        drop = cfg.attention_probs_dropout_prob
        if deterministic or drop == 0.0:
            ctx = jax.nn.dot_product_attention(q, k, v, mask=key_mask)
        else:
            ctx = _attention_with_dropout(q, k, v, key_mask, nn.Dropout(drop))
        ctx = ctx.reshape(batch, seq_len, cfg.hidden_size)
        return dense("output")(ctx)


def _attention_with_dropout(q, k, v, key_mask, dropout: nn.Dropout):
    """Explicit softmax attention with dropout on the probabilities (training)."""
    scale = q.shape[-1] ** -0.5
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) * scale
    logits = jnp.where(key_mask, logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1).astype(q.dtype)
    probs = dropout(probs, deterministic=False)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


class BertLayer(nn.Module):
    """One post-LayerNorm transformer block."""

    config: BertConfig
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, key_mask, deterministic: bool):
        cfg = self.config
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        dense_init = nn.initializers.normal(stddev=0.02)

        def layer_norm(name):
            return nn.LayerNorm(epsilon=cfg.layer_norm_eps, name=name, **kw)

        def dropout(t):
            return nn.Dropout(cfg.hidden_dropout_prob)(t, deterministic=deterministic)

        attn = BertSelfAttention(cfg, name="attention", **kw)(x, key_mask, deterministic)
        x = layer_norm("attention_LayerNorm")(x + dropout(attn))
        h = nn.Dense(cfg.intermediate_size, kernel_init=dense_init, name="intermediate", **kw)(x)
        h = _ACTIVATIONS[cfg.hidden_act](h)
        h = nn.Dense(cfg.hidden_size, kernel_init=dense_init, name="output", **kw)(h)
        return layer_norm("output_LayerNorm")(x + dropout(h))


class BertModel(nn.Module):
    """BERT encoder returning the last hidden states [B, L, H].

    Attributes:
      config: architecture.
      dtype: compute dtype (e.g. ``jnp.bfloat16``); the output has this dtype.
      param_dtype: dtype of the parameters (float32).
      remat: recompute each layer's activations in the backward pass
        (gradient checkpointing); does not change the parameter tree.
    """

    config: BertConfig
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    remat: bool = False

    @nn.compact
    def __call__(self, input_ids, attention_mask=None, token_type_ids=None, deterministic: bool = True):
        if attention_mask is None:
            attention_mask = jnp.ones_like(input_ids)
        if token_type_ids is None:
            token_type_ids = jnp.zeros_like(input_ids)
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        x = BertEmbeddings(self.config, name="embeddings", **kw)(input_ids, token_type_ids, deterministic)
        key_mask = attention_mask_to_bool(attention_mask)
        # static_argnums counts `self` as argument 0: (self, x, key_mask, deterministic).
        layer_cls = nn.remat(BertLayer, static_argnums=(3,)) if self.remat else BertLayer
        for i in range(self.config.num_hidden_layers):
            x = layer_cls(self.config, name=f"layer_{i}", **kw)(x, key_mask, deterministic)
        return x
