"""The portable attention paths, plain XLA ops on any platform: "explicit" (the reference) and "xla".

- ``explicit``: scores in float32 over [B, N, T, S] in the head-major layout,
  normalised after the value product. Both directions keep only the output
  and the log-sum-exp (the backward recomputes the scores, as flash attention
  does). Rows of ``BLOCKWISE_FROM`` tokens or more are processed in query
  blocks of ``BLOCK`` rows, one block's scores at a time, so the temporaries
  grow with T x block, not T x T: at [18, 512] (MiniLM, 12 heads) forward and
  backward hold 183 instead of 676 MiB, at the same speed or faster; at
  T = 256 one pass is faster, so shorter rows take it. With attention
  dropout it is plain autodiff over the dropped probabilities. On XLA:CPU it
  is 2.4x faster than ``xla`` at [64, 128] (MiniLM shapes; the einsum layouts
  of the generic path transpose the scores). A padding query (segment 0)
  attends to nothing; its output is a uniform average (no NaN) that no
  pooling ever reads.
- ``xla``: ``jax.nn.dot_product_attention`` with the boolean [B, 1, T, T]
  mask and ``implementation="xla"``: the scores and the mask are materialised
  in both directions. Only when asked for; kept as the naive baseline that
  ``python -m infjax.bench accelerator`` compares against.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from infjax.models import precision
from infjax.models.kernels.masks import segment_mask

BLOCK = 128                  # query rows per block of the explicit path's blockwise form
BLOCKWISE_FROM = 512         # rows at least this long take the blockwise form (shorter: one pass)


def xla_attention(q, k, v, segment_ids, *, causal: bool = False, window=None) -> jax.Array:
    """``jax.nn.dot_product_attention`` over the whole row with the boolean segment mask."""
    mask = segment_mask(segment_ids, causal=causal, window=window)
    return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")


def explicit_attention(q, k, v, segment_ids, *, causal: bool = False, window=None, dropout=None,
                       block: int | None = None) -> jax.Array:
    """The reference: q [B, T, N, D], k/v [B, T, K, D] -> [B, T, N, D] (see the module docstring).

    ``window`` may be a traced scalar (< 0: none). ``block``: query rows per block; default ``BLOCK``
    for rows of ``BLOCKWISE_FROM`` tokens or more, else the whole row."""
    groups = q.shape[2] // k.shape[2]
    if groups > 1:
        k, v = precision.repeat(k, groups, axis=2), precision.repeat(v, groups, axis=2)   # float32 sums back
    qh, kh, vh = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))      # [B, N, T, D]
    t = q.shape[1]
    if block is None:
        block = BLOCK if t >= BLOCKWISE_FROM else t
    window_arg = jnp.asarray(-1 if window is None else window)
    if dropout is not None:
        out = _explicit(qh, kh, vh, segment_ids, jnp.arange(t), causal, window, dropout)
    elif t <= block or t % block:
        out = _fused(qh, kh, vh, segment_ids, window_arg, causal, window is not None)
    else:
        out = _blockwise(qh, kh, vh, segment_ids, window_arg, causal, window is not None, block)
    return jnp.swapaxes(out, 1, 2)


def _mask(segment_ids, q_index, k_index, causal, window):
    """[B, 1, T', S] of query rows q_index (None: all rows); `window` None or < 0 means none (it may be a
    traced scalar)."""
    if q_index is None:
        q_seg, q_index = segment_ids, jnp.arange(segment_ids.shape[1])
    else:
        q_seg = jnp.take(segment_ids, q_index, axis=1)
    mask = (q_seg[:, :, None] == segment_ids[:, None, :]) & (segment_ids[:, None, :] > 0)
    if causal:
        mask = mask & (k_index[None, :] <= q_index[:, None])[None]
    if window is not None:
        near = jnp.abs(q_index[:, None] - k_index[None, :]) <= window
        mask = mask & (near | (window < 0))[None]
    return mask[:, None]


def _bias(mask):
    """0 where attended, -1e30 elsewhere, added to the scores.

    XLA:CPU runs an added bias ~1.4x faster than a select over the broadcast mask (MiniLM, [8, 12, 128, 128]). A masked
    score becomes -1e30 exactly in float32, so a row with no attended key stays a uniform average, as before."""
    return jnp.where(mask, 0.0, -1e30).astype(jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _fused(qh, kh, vh, segment_ids, window, causal, windowed):
    """Attention with a hand-written backward that keeps only the output and the log-sum-exp.

    The scores are recomputed, as flash attention does; one pass over the scores per direction. `windowed` (static)
    says whether `window` (a scalar, maybe traced) applies at all."""
    return _fused_fwd(qh, kh, vh, segment_ids, window, causal, windowed)[0]


def _scores(qh, kh, segment_ids, window, causal, windowed, start=None):
    """Masked scores [B, N, T', S] float32 of queries qh [B, N, T', D] over all keys: the whole row, or
    (`start`) the query rows start .. start + T' of one block."""
    scores = jnp.matmul(qh, jnp.swapaxes(kh, -1, -2), preferred_element_type=jnp.float32) * qh.shape[-1] ** -0.5
    q_index = None if start is None else start + jnp.arange(qh.shape[2])
    mask = _mask(segment_ids, q_index, jnp.arange(kh.shape[2]), causal, window if windowed else None)
    return scores + _bias(mask)


def _softmax_values(scores, vh, dtype):
    """softmax(scores) @ vh, normalised after the product, in `dtype`; and the log-sum-exp of the scores."""
    top = jnp.max(scores, axis=-1, keepdims=True)
    weights = jnp.exp(scores - top)
    total = jnp.sum(weights, axis=-1, keepdims=True)
    out = jnp.matmul(weights.astype(vh.dtype), vh, preferred_element_type=jnp.float32) / total
    return out.astype(dtype), top + jnp.log(total)


def _fused_fwd(qh, kh, vh, segment_ids, window, causal, windowed):
    out, lse = _softmax_values(_scores(qh, kh, segment_ids, window, causal, windowed), vh, qh.dtype)
    return out, (qh, kh, vh, segment_ids, window, out, lse)


def _delta(d_out, out):
    """rowsum(dO * O) [..., T, 1] float32, the softmax backward's correction term."""
    return jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1, keepdims=True)


def _grads(probs, qh, kh, vh, d_out, delta):
    """float32 (dQ, dK, dV) of queries qh over keys kh / values vh, from their attention probabilities
    [B, N, T', S] and the output gradient d_out [B, N, T', D]."""
    d_out32 = d_out.astype(jnp.float32)
    d_v = jnp.matmul(jnp.swapaxes(probs, -1, -2), d_out32)
    d_probs = jnp.matmul(d_out32, jnp.swapaxes(vh, -1, -2).astype(jnp.float32))
    d_scores = probs * (d_probs - delta) * qh.shape[-1] ** -0.5
    d_q = jnp.matmul(d_scores, kh.astype(jnp.float32))
    d_k = jnp.matmul(jnp.swapaxes(d_scores, -1, -2), qh.astype(jnp.float32))
    return d_q, d_k, d_v


def _fused_bwd(causal, windowed, res, d_out):
    qh, kh, vh, segment_ids, window, out, lse = res
    probs = jnp.exp(_scores(qh, kh, segment_ids, window, causal, windowed) - lse)            # [B, N, T, S] float32
    d_q, d_k, d_v = _grads(probs, qh, kh, vh, d_out, _delta(d_out, out))
    return (d_q.astype(qh.dtype), d_k.astype(kh.dtype), d_v.astype(vh.dtype), None, None)


_fused.defvjp(_fused_fwd, _fused_bwd)


def _explicit(qh, kh, vh, segment_ids, q_index, causal, window, dropout: Any = None):
    """Attention of query rows `q_index` (qh [B, N, T', D]) over all keys (kh, vh [B, N, S, D])."""
    scale = qh.shape[-1] ** -0.5
    scores = jnp.matmul(qh, jnp.swapaxes(kh, -1, -2), preferred_element_type=jnp.float32) * scale
    scores = scores + _bias(_mask(segment_ids, q_index, jnp.arange(kh.shape[2]), causal, window))
    scores = scores - jax.lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True))
    weights = jnp.exp(scores)
    total = jnp.sum(weights, axis=-1, keepdims=True)
    if dropout is not None:
        probs = dropout((weights / total).astype(qh.dtype), deterministic=False)
        return jnp.matmul(probs, vh)
    out = jnp.matmul(weights.astype(vh.dtype), vh, preferred_element_type=jnp.float32) / total
    return out.astype(qh.dtype)


def _query_blocks(x, block):
    """[B, N, T, ...] -> [T / block, B, N, block, ...]."""
    b, n, t = x.shape[:3]
    return jnp.moveaxis(x.reshape((b, n, t // block, block) + x.shape[3:]), 2, 0)


def _unblock(x):
    """Inverse of `_query_blocks`."""
    blocks, b, n, block = x.shape[:4]
    return jnp.moveaxis(x, 0, 2).reshape((b, n, blocks * block) + x.shape[4:])


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _blockwise(qh, kh, vh, segment_ids, window, causal, windowed, block):
    """`_fused` one block of `block` query rows at a time (forward: `lax.map`; backward: a scan that
    adds up the key and value gradients), so one block's scores are alive at a time."""
    return _blockwise_fwd(qh, kh, vh, segment_ids, window, causal, windowed, block)[0]


def _blockwise_fwd(qh, kh, vh, segment_ids, window, causal, windowed, block):
    def one(xs):
        q_block, start = xs
        return _softmax_values(_scores(q_block, kh, segment_ids, window, causal, windowed, start), vh,
                               qh.dtype)

    starts = jnp.arange(qh.shape[2] // block) * block
    out, lse = jax.lax.map(one, (_query_blocks(qh, block), starts))
    out, lse = _unblock(out), _unblock(lse)
    return out, (qh, kh, vh, segment_ids, window, out, lse)


def _blockwise_bwd(causal, windowed, block, res, d_out):
    qh, kh, vh, segment_ids, window, out, lse = res

    def one(carry, xs):
        d_k, d_v = carry
        q_block, d_out_block, lse_block, delta_block, start = xs
        probs = jnp.exp(_scores(q_block, kh, segment_ids, window, causal, windowed, start) - lse_block)
        d_q_block, d_k_part, d_v_part = _grads(probs, q_block, kh, vh, d_out_block, delta_block)
        return (d_k + d_k_part, d_v + d_v_part), d_q_block.astype(qh.dtype)

    starts = jnp.arange(qh.shape[2] // block) * block
    xs = (_query_blocks(qh, block), _query_blocks(d_out, block), _query_blocks(lse, block),
          _query_blocks(_delta(d_out, out), block), starts)
    zeros = jnp.zeros(kh.shape, jnp.float32), jnp.zeros(vh.shape, jnp.float32)
    (d_k, d_v), d_q = jax.lax.scan(one, zeros, xs)
    return _unblock(d_q), d_k.astype(kh.dtype), d_v.astype(vh.dtype), None, None


_blockwise.defvjp(_blockwise_fwd, _blockwise_bwd)
