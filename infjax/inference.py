"""Encoding lists of texts with a trained encoder: jitted, sharded over the mesh's batch axes."""
from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh

from infjax.data.tokenize import Tokenizer
from infjax.models.encoder import Encoder
from infjax.training.mesh import batch_sharding, replicated


class TextEmbedder:
    """texts -> L2-normalized float32 embeddings [N, d], in fixed-shape batches."""

    def __init__(self, encoder: Encoder, mesh: Mesh, tokenizer: Tokenizer, batch_size: int):
        n_shards = mesh.shape["data"] * mesh.shape["fsdp"]
        self.batch_size = -(-batch_size // n_shards) * n_shards    # a multiple of the batch shards
        self.tokenizer, self.mesh = tokenizer, mesh
        self._fn = jax.jit(encoder, in_shardings=(replicated(mesh), batch_sharding(mesh), batch_sharding(mesh)),
                           out_shardings=replicated(mesh))

    def __call__(self, params, texts: list[str], max_len: int) -> np.ndarray:
        out = []
        for start in range(0, len(texts), self.batch_size):
            chunk = list(texts[start:start + self.batch_size])
            n = len(chunk)
            chunk += [""] * (self.batch_size - n)                   # static shape: pad the last batch
            ids, mask = self.tokenizer(chunk, max_len)
            out.append(np.asarray(self._fn(params, ids, mask))[:n])
        return np.concatenate(out) if out else np.zeros((0, 0), np.float32)
