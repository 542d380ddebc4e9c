"""Instruction-aware query embeddings under Interaction II (cross-attention), for evaluation.

The instruction and the query are encoded apart and combined by the
interaction head, as in training; batches have a fixed shape and are sharded
over the mesh's batch axes.
"""
from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh

from infjax.data.tokenize import TextFormat, Tokenizer
from infjax.models import interaction
from infjax.models.encoder import Encoder, query_params
from infjax.training.mesh import batch_sharding, put, replicated


class CrossAttentionQueryEmbedder:
    """(instructions, queries) -> iq embeddings [N, d] through the interaction head."""

    def __init__(self, encoder: Encoder, mesh: Mesh, tokenizer: Tokenizer, fmt: TextFormat, batch_size: int):
        n_shards = mesh.shape["data"] * mesh.shape["fsdp"]
        self.batch_size = -(-batch_size // n_shards) * n_shards
        self.tokenizer, self.fmt = tokenizer, fmt

        def embed(params, i_ids, i_mask, q_ids, q_mask):
            qp = query_params(params)
            i_vec = encoder(qp, i_ids, i_mask)
            return interaction.iq_embeddings(params["interaction"], i_vec, encoder.hidden(qp, q_ids, q_mask), q_mask)

        self._rows = batch_sharding(mesh)
        # Inputs come as global arrays (params as the caller holds them, rows through `put`): no in_shardings.
        self._fn = jax.jit(embed, out_shardings=replicated(mesh))

    def __call__(self, params, instructions: list[str], queries: list[str], max_len: int) -> np.ndarray:
        if len(instructions) != len(queries):
            raise ValueError(f"{len(instructions)} instructions but {len(queries)} queries")
        out = []
        for start in range(0, len(queries), self.batch_size):
            ins = [self.fmt.alone(t) for t in instructions[start:start + self.batch_size]]
            qs = [self.fmt.alone(t) for t in queries[start:start + self.batch_size]]
            n = len(qs)
            pad = [""] * (self.batch_size - n)
            i_ids, i_mask = self.tokenizer(ins + pad, max_len)
            q_ids, q_mask = self.tokenizer(qs + pad, max_len)
            q_mask[n:, 0] = 1                      # padding rows: one attended token, no NaN
            inputs = put((i_ids, i_mask, q_ids, q_mask), self._rows)   # each process: its devices' rows
            out.append(np.asarray(self._fn(params, *inputs))[:n])
        return np.concatenate(out) if out else np.zeros((0, 0), np.float32)
