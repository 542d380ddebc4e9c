"""Gradient caching (docs/method.md §6.2): a global batch larger than one encoder pass can hold.

1. Encode every encoder input in chunks of `chunk_size` rows under `lax.map`, outside any
   differentiation, so no activation outlives its chunk.
2. Compute the loss on ALL the outputs of the global batch (every objective, instruction
   negatives iq_neg [R, K, d] included; under Interaction II the cached pieces are the
   instruction vectors, the query token states and the passages, and the interaction head
   is differentiated here) and its gradient w.r.t. those outputs.
3. Re-encode chunk by chunk under `lax.scan`, pulling each chunk's output gradient back
   through `jax.vjp`, and sum the parameter gradients.

Chunks are strided across the batch shards: rows [N] -> [N/n, n] -> swapaxes -> [n, N/n], so
chunk c holds rows c, c+n, c+2n, ...; with the leading dimension split over the devices, every
chunk takes chunk_size/devices rows from each device (a contiguous reshape would put a whole
chunk on few devices). Outputs are put back in row order by the inverse reshape. Packed sides
(data.packing) arrive with each chunk packed apart on the host ([S, C, ...], the same strided
texts per chunk), so a chunk's pass encodes only its own packed rows.

Without dropout the loss and gradients equal the plain step's to float32 rounding. With dropout
each chunk draws its own mask (fold_in of the pass's key with the chunk index), the same mask in
both passes, so the result is a correct gradient of a differently-masked forward pass.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from infjax import losses
from infjax.models import lora
from infjax.models.encoder import Encoder
from infjax.training import embed
from infjax.runtime.mesh import BATCH_AXES


def to_chunks(x: jax.Array, n_chunks: int, mesh: Mesh | None = None) -> jax.Array:
    """[N, ...] -> [n_chunks, N / n_chunks, ...], chunk c = rows c, c + n_chunks, ... (strided)."""
    out = x.reshape(-1, n_chunks, *x.shape[1:]).swapaxes(0, 1)
    if mesh is not None:
        out = jax.lax.with_sharding_constraint(out, NamedSharding(mesh, P(None, BATCH_AXES)))
    return out


def from_chunks(x: jax.Array, mesh: Mesh | None = None) -> jax.Array:
    """Inverse of `to_chunks`: [n_chunks, M, ...] -> [n_chunks * M, ...] in the original row order."""
    out = x.swapaxes(0, 1).reshape(-1, *x.shape[2:])
    if mesh is not None:
        out = jax.lax.with_sharding_constraint(out, NamedSharding(mesh, P(BATCH_AXES)))
    return out


def packed_chunks(x: jax.Array, mesh: Mesh | None = None) -> jax.Array:
    """A packed array [S, C, ...] (data/packing.py) -> [C, S, ...]: chunk c of every batch shard together.

    Chunk c of a shard holds its texts c, c + C, ..., so an encoder pass over chunk c returns the rows
    that `to_chunks` puts in chunk c, in the same order, and `from_chunks` restores the row order.
    """
    out = x.swapaxes(0, 1)
    if mesh is not None:
        out = jax.lax.with_sharding_constraint(out, NamedSharding(mesh, P(None, BATCH_AXES)))
    return out


def _chunk_keys(key, n_chunks: int):
    if key is None:
        return None
    return jax.vmap(lambda c: jax.random.fold_in(key, c))(jnp.arange(n_chunks))


def make_grad_fn(encoder: Encoder, objective: losses.Objective, chunk_size: int, dropout: bool = False,
                 mesh: Mesh | None = None):
    """grad_fn(params, batch, rng, frozen={}) -> ((loss, metrics), grads), like value_and_grad of the plain loss
    (`frozen`: LoRA's base weights, which complete the model and are not differentiated)."""

    def grad_fn(params, batch, rng, frozen=None):
        frozen = frozen or {}
        keys = list(jax.random.split(rng, 3)) if dropout and rng is not None else [None] * 3
        calls = embed.encoder_calls(encoder, batch)
        chunked = {}
        for name, (fn, ids, mask, k) in calls.items():
            if mask is None:                 # packed side: each chunk was packed apart, [S, C, ...]
                n_chunks = ids["first"].shape[1]
                ids = jax.tree.map(lambda x: packed_chunks(x, mesh), ids)
            else:
                n = ids.shape[0]
                if n % chunk_size:
                    raise ValueError(f"config.train.chunk_size={chunk_size} does not divide the {n} rows of "
                                     f"encoder input {name!r}")
                n_chunks = n // chunk_size
                ids, mask = to_chunks(ids, n_chunks, mesh), to_chunks(mask, n_chunks, mesh)
            chunked[name] = (fn, ids, mask, _chunk_keys(keys[k], n_chunks), n_chunks)

        # 1. All outputs, chunk by chunk, with no activations kept.
        constant = lora.combine(jax.lax.stop_gradient(params), frozen)
        outputs = {}
        for name, (fn, ids, mask, ks, _) in chunked.items():
            def encode(xs, fn=fn):
                i, m, key = xs
                return fn(constant, i, m, key)
            outputs[name] = from_chunks(jax.lax.map(encode, (ids, mask, ks)), mesh)

        # 2. The loss on the whole global batch; gradients w.r.t. the outputs (and the head).
        def loss_of_outputs(params, outputs):
            embeddings = embed.assemble(params, outputs, batch, objective)
            return losses.contrastive_loss(objective, **embeddings)

        (loss, metrics), (grads, cotangents) = jax.value_and_grad(loss_of_outputs, argnums=(0, 1), has_aux=True)(
            params, outputs)

        # 3. Re-encode chunk by chunk, pulling the output gradients back to the parameters.
        for name, (fn, ids, mask, ks, n_chunks) in chunked.items():
            cot = to_chunks(cotangents[name], n_chunks, mesh)

            def accumulate(acc, xs, fn=fn):
                i, m, key, c = xs
                _, pull = jax.vjp(lambda p: fn(lora.combine(p, frozen), i, m, key), params)
                return jax.tree.map(jnp.add, acc, pull(c)[0]), None

            grads, _ = jax.lax.scan(accumulate, grads, (ids, mask, ks, cot))
        return (loss, metrics), grads

    return grad_fn
