"""What a query attends to, as the kernels need it: boolean masks, key ranges, positions inside a segment.

A row holds one text (padded batches: segment ids 1 on real tokens, 0 on
padding) or several (packed batches: 1, 2, ... per text, 0 on the unused
tail). A token attends to the tokens of its own segment, and additionally
only to those not after it (``causal``) and to those at most ``window``
positions away (``window``). Segments are contiguous runs of a row, so every
query's keys form one contiguous range: ``key_ranges`` gives it, and the
fused kernels (CPU, Pallas GPU) work on those ranges.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def segment_mask(segment_ids: jax.Array, *, causal: bool = False, window: int | None = None) -> jax.Array:
    """Boolean mask [B, 1, T, T] (True = attend) of segment ids [B, T]."""
    seg = segment_ids
    mask = (seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] > 0)
    idx = jnp.arange(seg.shape[1])
    if causal:
        mask = mask & (idx[None, :] <= idx[:, None])[None]
    if window is not None:
        mask = mask & (jnp.abs(idx[:, None] - idx[None, :]) <= window)[None]
    return mask[:, None]


def segment_positions(segment_ids: jax.Array) -> jax.Array:
    """Position of each token inside its segment [B, T] int32 (0 at a segment's first token).

    A padded row ``1 1 1 0 0`` gives ``0 1 2 0 1``; a left-padded one
    ``0 0 1 1 1`` gives ``0 1 0 1 2``; a packed one ``1 1 2 2 2 0`` gives
    ``0 1 0 1 2 0``. Real tokens always count from 0, as in an unpadded text.
    """
    t = segment_ids.shape[1]
    idx = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), segment_ids.shape)
    starts = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool),
                              segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    return idx - jax.lax.cummax(jnp.where(starts, idx, 0), axis=1)


def key_ranges(segment_ids: jax.Array, causal: bool, window: jax.Array | int | None) -> tuple[jax.Array, jax.Array]:
    """First and one-past-last key [B, T] int32 that each query attends to.

    That is its segment, cut to the keys not after it (`causal`) and to those at most `window` positions away (`window`
    may be a traced scalar, < 0 meaning none). Padding (segment 0) gets the empty range [0, 0)."""
    b, t = segment_ids.shape
    idx = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    new = jnp.concatenate([jnp.ones((b, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    last = jnp.concatenate([segment_ids[:, 1:] != segment_ids[:, :-1], jnp.ones((b, 1), bool)], axis=1)
    lo = jax.lax.cummax(jnp.where(new, idx, 0), axis=1)
    hi = jax.lax.cummin(jnp.where(last, idx + 1, t), axis=1, reverse=True)
    if causal:
        hi = jnp.minimum(hi, idx + 1)
    if window is not None:
        window = jnp.asarray(window, jnp.int32)
        lo = jnp.where(window >= 0, jnp.maximum(lo, idx - window), lo)
        hi = jnp.where(window >= 0, jnp.minimum(hi, idx + window + 1), hi)
    real = segment_ids > 0
    return jnp.where(real, lo, 0).astype(jnp.int32), jnp.where(real, hi, 0).astype(jnp.int32)
