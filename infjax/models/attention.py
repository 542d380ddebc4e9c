"""The one attention function of every backbone: segment ids, optional causal and local-window masks.

A row of a batch holds one text (padded batches: segment ids are the padding
mask, 1 on real tokens, 0 on padding) or several (packed batches: 1, 2, ...
per text, 0 on the unused tail). A token attends to the tokens of its own
segment only, and additionally

- ``causal``: to those not after it (decoders), and
- ``window``: to those at most ``window`` positions away (ModernBERT's local
  layers, where HF's ``sliding_window`` is ``local_attention // 2``).

Segments are contiguous runs of a row, so "positions away" is the index
distance. A padding token (segment 0) attends to nothing; its output is a
uniform average (no NaN) that no pooling ever reads.

Implementations (``impl``; "auto" picks by platform, unless the environment
variable ``INFJAX_ATTENTION`` names one of them):

- ``"kernel"`` (CPU): a fused C++ kernel through the XLA FFI
  (``cpu_attention``), compiled on first use; float32, head sizes 16, 32, 64
  and 128, no attention dropout. It computes only the keys of each query's
  own segment and keeps a few rows' scores in cache at a time: one MiniLM
  layer's forward + backward over a 64/256 step's packed passages ([34, 256],
  12 heads of 32) takes ~90 ms against ~300 ms on the explicit path (torch's
  fused CPU attention: ~110 ms). "auto" takes it on CPU whenever it applies
  and could be built; otherwise the explicit path. Padding tokens (segment 0)
  get a zero output.
- ``"xla"``: ``jax.nn.dot_product_attention`` with the boolean mask (GPU, TPU).
- ``"explicit"``: scores in float32 over [B, N, T, S] in the head-major
  layout, normalised after the value product. On XLA:CPU this is 2.4x faster
  than ``"xla"`` at [64, 128] (MiniLM shapes; the einsum layouts of the
  generic path transpose the scores). Both directions keep only the output
  and the log-sum-exp (the backward recomputes the scores, as flash
  attention does). Rows of ``BLOCKWISE_FROM`` tokens or more are processed
  in query blocks of ``BLOCK`` rows, one block's scores at a time, so the
  temporaries grow with T x block, not T x T: at [18, 512] (MiniLM, 12
  heads) forward and backward hold 183 instead of 676 MiB, at the same speed
  or faster; at T = 256 one pass is faster, so shorter rows take it.
- ``"splash"``: the Pallas TPU splash-attention kernel (segment ids, causal
  and local masks; blocks that a mask empties are skipped), run in Pallas
  interpret mode off TPU, which is how it is tested here. T must be a
  multiple of 128. Opt-in for now: "auto" does not pick it, because the
  kernel must be wrapped in ``shard_map`` over the batch axes under a
  sharded step, and that has not been run on a TPU. Padding tokens (segment
  0) attend each other instead of nothing; no pooling reads them.
"""
from __future__ import annotations

import functools
import os
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from infjax.models import cpu_attention

IMPLS = ("auto", "xla", "explicit", "kernel", "splash")
ENV = "INFJAX_ATTENTION"     # environment override of "auto"
BLOCK = 128                  # query rows per block of the explicit path's blockwise form
BLOCKWISE_FROM = 512         # rows at least this long take the blockwise form (shorter: one pass)


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


def resolve_impl(impl: str) -> str:
    """`impl`, or for "auto" the platform's choice ("kernel" stands for "kernel where it applies" on CPU)."""
    if impl not in IMPLS:
        raise ValueError(f"attention impl {impl!r} is not one of {IMPLS}")
    if impl == "auto":
        impl = os.environ.get(ENV, "auto") or "auto"
        if impl not in IMPLS:
            raise ValueError(f"${ENV}={impl!r} is not one of {IMPLS}")
    if impl != "auto":
        return impl
    if jax.default_backend() != "cpu":
        return "xla"
    return "kernel" if cpu_attention.available() else "explicit"


def costs_per_text(head_dim: int, dtype: Any, dropout: bool = False) -> bool:
    """Whether `attention` (impl "auto") computes only each text's own keys for these inputs, so that a packed
    row's attention costs the sum of its texts' squared lengths, not its own squared length: true of the CPU
    kernel. The other paths compute the whole row ("splash" skips fully masked blocks only), as does any
    path with attention dropout (`dropout`: the run applies the checkpoint's dropout)."""
    return (not dropout and resolve_impl("auto") == "kernel" and cpu_attention.takes(head_dim, dtype)
            and cpu_attention.available())


def attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *, causal: bool = False,
              window: int | None = None, dropout: nn.Dropout | None = None, impl: str = "auto",
              block: int | None = None) -> jax.Array:
    """Scaled dot-product self attention inside segments: q [B, T, N, D], k/v [B, T, K, D] -> [B, T, N, D].

    N must be a multiple of K (grouped-query attention: query head ``n`` uses
    key/value head ``n // (N // K)``, HF's ``repeat_kv``). ``dropout`` (a
    training-time module) drops attention probabilities; it always takes the
    explicit path. ``block`` (explicit path): query rows per block; default ``BLOCK`` for rows of
    ``BLOCKWISE_FROM`` tokens or more, else the whole row.
    """
    impl = resolve_impl(impl)
    if impl == "kernel" and dropout is None and cpu_attention.supports(q, k):
        if not cpu_attention.available():
            raise RuntimeError("attention impl 'kernel': the CPU attention kernel could not be built (see the "
                               "warning above)")
        return cpu_attention.attention(q, k, v, segment_ids, causal=causal, window=window)
    if impl == "splash" and dropout is None:
        return _splash(q, k, v, segment_ids, causal, window)
    if impl == "xla" and dropout is None:
        mask = segment_mask(segment_ids, causal=causal, window=window)
        return jax.nn.dot_product_attention(q, k, v, mask=mask)
    groups = q.shape[2] // k.shape[2]
    if groups > 1:
        k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
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
    """0 where attended, -1e30 elsewhere, added to the scores: XLA:CPU runs an added bias ~1.4x faster
    than a select over the broadcast mask (MiniLM, [8, 12, 128, 128]). A masked score becomes -1e30
    exactly in float32, so a row with no attended key stays a uniform average, as before."""
    return jnp.where(mask, 0.0, -1e30).astype(jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _fused(qh, kh, vh, segment_ids, window, causal, windowed):
    """Attention with a hand-written backward that keeps only the output and the log-sum-exp
    (the scores are recomputed), as flash attention does; one pass over the scores per direction.
    `windowed` (static) says whether `window` (a scalar, maybe traced) applies at all."""
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


SPLASH_BLOCK = 128           # query/key block of the splash kernel (T must be a multiple)


@functools.lru_cache(maxsize=None)
def _splash_kernel(t: int, heads: int, causal: bool, window: int | None, interpret: bool):
    """A splash-attention kernel for [heads, t, d] inputs (built once per shape and mask)."""
    # Imported here: the Pallas TPU ops load only when splash is asked for.
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel_lib
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask_lib
    if window is not None:
        base = mask_lib.LocalMask((t, t), (window, 0 if causal else window), offset=0)
    else:
        base = mask_lib.CausalMask((t, t)) if causal else mask_lib.FullMask((t, t))
    b = min(SPLASH_BLOCK, t)
    sizes = kernel_lib.BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b, block_kv_dkv=b,
                                  block_kv_dkv_compute=b, block_q_dq=b, block_kv_dq=b)
    return kernel_lib.make_splash_mha_single_device(mask_lib.MultiHeadMask([base] * heads), block_sizes=sizes,
                                                    interpret=interpret), kernel_lib.SegmentIds


def _splash(q, k, v, segment_ids, causal, window):
    b, t, n, d = q.shape
    if t % SPLASH_BLOCK:
        raise ValueError(f"splash attention needs a row length that is a multiple of {SPLASH_BLOCK}, got {t}")
    groups = n // k.shape[2]
    if groups > 1:
        k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    kernel, segments = _splash_kernel(t, n, causal, window, jax.default_backend() != "tpu")
    qh, kh, vh = (jnp.swapaxes(x, 1, 2) for x in (q * d ** -0.5, k, v))        # [B, N, T, D]
    one_row = lambda qr, kr, vr, sr: kernel(qr, kr, vr, segment_ids=segments(q=sr, kv=sr))  # noqa: E731
    out = jax.vmap(one_row)(qh, kh, vh, segment_ids)
    return jnp.swapaxes(out, 1, 2).astype(q.dtype)
