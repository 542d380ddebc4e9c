"""Bi-encoder towers: backbone -> pooling -> L2 normalization, and loading from a config.

Parameters are {"shared": tree} (one theta for passages and
instruction-queries, the default) or {"query": tree, "passage": tree}.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from infjax.models import hf_io
from infjax.models.pooling import l2_normalize, pool

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class Encoder:
    """A backbone module plus its pooling; call it as a pure function of params."""

    module: object             # a flax.linen module: apply({"params": p}, ids, mask, deterministic=...)
    pooling: str               # mean | cls | last

    def __call__(self, params, ids: jax.Array, mask: jax.Array, dropout_rng: jax.Array | None = None) -> jax.Array:
        """L2-normalized float32 embeddings [N, d] of token ids [N, L]."""
        rngs = {"dropout": dropout_rng} if dropout_rng is not None else None
        hidden = self.module.apply({"params": params}, ids, mask, deterministic=dropout_rng is None, rngs=rngs)
        return l2_normalize(pool(hidden.astype(jnp.float32), mask, self.pooling))


def query_params(params: dict):
    return params["shared"] if "shared" in params else params["query"]


def passage_params(params: dict):
    return params["shared"] if "shared" in params else params["passage"]


def checkpoint_path(name: str) -> str:
    """A local folder for `model.checkpoint`: the embedded MiniLM, a folder, or a hub download."""
    from infjax.config import EMBEDDED

    if name == EMBEDDED:
        return hf_io.embedded_minilm_path()
    return hf_io.resolve_checkpoint(name)


def load_encoder(model_config) -> tuple[Encoder, dict, str]:
    """(encoder, params, local checkpoint folder) for the `config.model` section."""
    path = checkpoint_path(model_config.checkpoint)
    module, backbone, _, path = hf_io.load_bert(path, dtype=DTYPES[model_config.dtype])
    params = {"shared": backbone} if model_config.shared_encoder else \
        {"query": backbone, "passage": jax.tree.map(lambda x: x.copy(), backbone)}
    return Encoder(module, model_config.pooling), params, path
