"""Flash attention over packed rows for GPUs: a Pallas kernel lowered through Triton.

What it computes: for each row ``b``, query head ``n`` and query position ``t``,
``out[b, t, n] = softmax_j(q[b, t, n] . k[b, j, n // G] / sqrt(D)) @ v[b, j, n // G]``
over the keys ``lo[b, t] <= j < hi[b, t]`` only (``G = N // K`` query heads
share a key/value head: grouped-query attention). The ranges come from
``masks.key_ranges`` (a query's segment, cut by ``causal`` and by a two-sided
``window``); a query whose range is empty (padding, segment 0) gets a zero
output and passes no gradient.

Layout: q ``[B, T, N, D]``, k/v ``[B, T, K, D]`` as the backbones hold them (no
transposes), lo/hi ``[B, T]`` int32. Scores, the online softmax and every
accumulation are float32 (``preferred_element_type``); inputs are float32,
bfloat16 or float16 and the output has q's dtype. Exponentials are base 2 (the
scores are scaled by ``log2(e) / sqrt(D)``), so the saved log-sum-exp
(``[B, N, T]`` float32) is in base 2; empty rows store a large negative value.

Kernels (``jax.custom_vjp``):

- forward, grid (query block, row, query head): loops over key blocks with
  the online softmax, writes the output and the log-sum-exp;
- backward: ``delta = rowsum(dO * O)`` in XLA (one fused elementwise pass),
  then a dK/dV kernel, grid (key block, row, kv head), that loops over the
  query blocks and, inside, over the ``G`` query heads of its kv head, so the
  group's gradients are accumulated in-kernel (float32) and written once per kv
  head (no ``[B, T, N, D]`` dK/dV and no sum over the group afterwards); and a
  dQ kernel, grid (query block, row, query head), that loops over key blocks.

No ``[T, T]`` array exists, forward or backward.

Block skipping: before each call, XLA reduces lo/hi to per-block loop bounds
(``block_bounds``, int32 ``[B, T // block]``): query block ``i`` visits only the
key blocks meeting ``[min lo, max hi)`` over its non-empty queries, and key
block ``j`` (dK/dV) only the query blocks from the first to the last whose
span covers it. Queries with an empty range do not widen the bounds; a block
of padding does no work. A packed row thus costs about the sum of its texts'
squared lengths (rounded to blocks), not ``T**2``; a local window costs about
``T * (2 * window + block)``. Inside a visited block, each query row masks
with ``lo <= key < hi`` (masked scores are a large negative finite value and
their probabilities are forced to 0, so a row without keys gives 0, not NaN).

Limits (``supports`` says which one an input breaks): self-attention (q and k
of the same rows and length), D a power of two in [16, 256], ``N % K == 0``,
dtypes float32/bfloat16/float16, and ``T`` a multiple of 16. Blocks are powers
of two in [16, 64] (``blocks_for``): the requested size (64 by default),
halved until it divides ``T``, so short rows take smaller blocks. Float32 dots
use the GPU's default precision (TF32 on Ampere/Hopper, as XLA's default).

Testing: on CPU the kernels run in Pallas interpret mode only
(``interpret=True``, tests/models/test_gpu_flash.py, against a dense masked
reference); their Triton lowering and speed are checked on a GPU by
``python -m infjax.bench accelerator``.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

try:  # Triton's compiler parameters; absent or renamed in some JAX versions (interpret mode needs none)
    from jax.experimental.pallas import triton as _plgpu
except ImportError:  # pragma: no cover
    _plgpu = None

DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
MIN_BLOCK, MAX_BLOCK = 16, 64
MAX_HEAD_DIM = 256
_NEG = -0.7 * float(jnp.finfo(jnp.float32).max)  # masked score: far below any real one, finite (no inf - inf)
_LOG2E = math.log2(math.e)


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def blocks_for(t: int, block: int = MAX_BLOCK) -> int | None:
    """Block size the kernels use along a row of length ``t`` when asked for ``block``.

    ``block`` (a power of two in [16, 64]) halved until it divides ``t`` (64 for T = 128, 512, ...; 32 for T = 32 or
    96; 16 for T = 16 or 48); None where even 16 does not divide ``t`` (or ``block`` is not such a power of two)."""
    if not (_power_of_two(block) and MIN_BLOCK <= block <= MAX_BLOCK) or t <= 0:
        return None
    while block > MIN_BLOCK and t % block:
        block //= 2
    return block if t % block == 0 else None


def supports(q, k, block_q: int = MAX_BLOCK, block_k: int = MAX_BLOCK) -> str | None:
    """None when the kernel takes queries ``q`` [B, T, N, D] and keys ``k`` [B, T, K, D] (any object with
    .shape and .dtype), else a short reason why not."""
    if len(q.shape) != 4 or len(k.shape) != 4:
        return f"q and k must be [B, T, heads, D], got shapes {tuple(q.shape)} and {tuple(k.shape)}"
    b, t, n, d = q.shape
    for x in (q, k):
        if not any(jnp.dtype(x.dtype) == jnp.dtype(ok) for ok in DTYPES):
            return f"dtype {jnp.dtype(x.dtype).name}"
    if jnp.dtype(k.dtype) != jnp.dtype(q.dtype):
        return f"q is {jnp.dtype(q.dtype).name} but k is {jnp.dtype(k.dtype).name}"
    if (k.shape[0], k.shape[1], k.shape[3]) != (b, t, d):
        return f"k {tuple(k.shape)} does not match q {tuple(q.shape)} in rows, length or head size"
    if n % k.shape[2]:
        return f"{n} query heads are not a multiple of {k.shape[2]} kv heads"
    if not _power_of_two(d):
        return f"head size {d} is not a power of two"
    if not MIN_BLOCK <= d <= MAX_HEAD_DIM:
        return f"head size {d} is outside [{MIN_BLOCK}, {MAX_HEAD_DIM}]"
    for name, block in (("block_q", block_q), ("block_k", block_k)):
        if not (_power_of_two(block) and MIN_BLOCK <= block <= MAX_BLOCK):
            return f"{name} {block} is not a power of two in [{MIN_BLOCK}, {MAX_BLOCK}]"
    if blocks_for(t) is None:
        return f"row length {t} is not a multiple of {MIN_BLOCK}"
    return None


def block_bounds(lo: jax.Array, hi: jax.Array, block_q: int, block_k: int):
    """Loop bounds of the kernels, from the key ranges lo/hi [B, T] (int32 arrays, all four):

    - ``kb_lo, kb_hi`` [B, T // block_q]: query block i visits key blocks kb_lo <= j < kb_hi, the blocks meeting
      [min lo, max hi) over its queries with a non-empty range (0, 0 where it has none);
    - ``qb_lo, qb_hi`` [B, T // block_k]: key block j (dK/dV) visits query blocks qb_lo <= i < qb_hi, from the
      first to the last query block whose key-block span [kb_lo, kb_hi) contains j (0, 0 where none does).
    """
    b, t = lo.shape
    nq, nk = t // block_q, t // block_k
    lo = jnp.clip(lo.astype(jnp.int32), 0, t)
    hi = jnp.clip(hi.astype(jnp.int32), 0, t)
    live = hi > lo                                                       # empty ranges must not widen a block
    first = jnp.where(live, lo, t).reshape(b, nq, block_q).min(-1)
    last = jnp.where(live, hi, 0).reshape(b, nq, block_q).max(-1)
    any_live = live.reshape(b, nq, block_q).any(-1)
    kb_lo = jnp.where(any_live, first // block_k, 0)
    kb_hi = jnp.where(any_live, (last + block_k - 1) // block_k, 0)
    j = jnp.arange(nk, dtype=jnp.int32)
    i = jnp.arange(nq, dtype=jnp.int32)
    visits = (kb_lo[:, :, None] <= j) & (j < kb_hi[:, :, None])           # [B, nq, nk]: blocks, not tokens
    any_q = visits.any(1)
    qb_lo = jnp.where(any_q, jnp.where(visits, i[:, None], nq).min(1), 0)
    qb_hi = jnp.where(any_q, jnp.where(visits, i[:, None] + 1, 0).max(1), 0)
    return (kb_lo.astype(jnp.int32), kb_hi.astype(jnp.int32), qb_lo.astype(jnp.int32),
            qb_hi.astype(jnp.int32))


# ---------------------------------------------------------------------------------------------- kernels

def _dot(a, b, *, trans_a: bool = False, trans_b: bool = False):
    """2-D a @ b (optionally transposed operands) accumulated in float32."""
    dims = (((0,) if trans_a else (1,), (1,) if trans_b else (0,)), ((), ()))
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _in_range(lo, hi, k_start, block_k):
    """[block_q, block_k] bool: key k_start + c lies in [lo[r], hi[r]) (lo/hi: [block_q, 1], a query block's)."""
    keys = k_start + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
    return (keys >= lo) & (keys < hi)


def _forward_kernel(kb_lo_ref, kb_hi_ref, lo_ref, hi_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, block_k, scale):
    block_q = q_ref.shape[0]
    q = q_ref[...]                                                       # [block_q, D]
    lo = lo_ref[...][:, None]
    hi = hi_ref[...][:, None]

    def body(j, carry):
        acc, m, l = carry
        k_start = j * block_k
        k = k_ref[pl.ds(k_start, block_k), :]
        v = v_ref[pl.ds(k_start, block_k), :]
        mask = _in_range(lo, hi, k_start, block_k)
        s = jnp.where(mask, _dot(q, k, trans_b=True) * scale, _NEG)      # base-2 scores
        m_next = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.where(mask, jnp.exp2(s - m_next[:, None]), 0.0)          # 0, not 1, where a row has no key yet
        correction = jnp.exp2(m - m_next)
        l = l * correction + jnp.sum(p, axis=1)
        acc = acc * correction[:, None] + _dot(p.astype(v.dtype), v)
        return acc, m_next, l

    carry = (jnp.zeros(q.shape, jnp.float32), jnp.full((block_q,), _NEG, jnp.float32),
             jnp.zeros((block_q,), jnp.float32))
    acc, m, l = lax.fori_loop(kb_lo_ref[()], kb_hi_ref[()], body, carry)
    some = l > 0.0
    l_safe = jnp.where(some, l, 1.0)                                     # rows without a key: acc is 0, out 0
    o_ref[...] = (acc / l_safe[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(some, m + jnp.log2(l_safe), _NEG)


def _dq_kernel(kb_lo_ref, kb_hi_ref, lo_ref, hi_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, *,
               block_k, scale, sm_scale):
    q = q_ref[...]
    do = do_ref[...]
    lo = lo_ref[...][:, None]
    hi = hi_ref[...][:, None]
    lse = lse_ref[...][:, None]
    delta = delta_ref[...][:, None]

    def body(j, dq):
        k_start = j * block_k
        k = k_ref[pl.ds(k_start, block_k), :]
        v = v_ref[pl.ds(k_start, block_k), :]
        mask = _in_range(lo, hi, k_start, block_k)
        p = jnp.exp2(jnp.where(mask, _dot(q, k, trans_b=True) * scale - lse, _NEG))   # exact 0 where masked
        ds = p * (_dot(do, v, trans_b=True) - delta)
        return dq + _dot(ds.astype(k.dtype), k)

    dq = lax.fori_loop(kb_lo_ref[()], kb_hi_ref[()], body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * sm_scale).astype(dq_ref.dtype)


def _dkv_kernel(qb_lo_ref, qb_hi_ref, lo_ref, hi_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref,
                dk_ref, dv_ref, *, block_q, block_k, groups, scale, sm_scale):
    # q_ref/do_ref: [T, G, D] (the G query heads of this kv head); lse_ref/delta_ref: [G, T].
    k_start = pl.program_id(0) * block_k
    k = k_ref[...]                                                       # [block_k, D]
    v = v_ref[...]
    first = qb_lo_ref[()]

    def body(step, carry):
        dk, dv = carry
        if groups == 1:
            block, g = step, 0
        else:                                                            # query block major, head minor
            block, g = lax.div(step, groups), lax.rem(step, groups)
        q_start = (first + block) * block_q
        rows = pl.ds(q_start, block_q)
        q = q_ref[rows, g, :]
        do = do_ref[rows, g, :]
        lse = lse_ref[g, rows][:, None]
        delta = delta_ref[g, rows][:, None]
        mask = _in_range(lo_ref[rows][:, None], hi_ref[rows][:, None], k_start, block_k)
        p = jnp.exp2(jnp.where(mask, _dot(q, k, trans_b=True) * scale - lse, _NEG))   # [block_q, block_k]
        dv = dv + _dot(p.astype(do.dtype), do, trans_a=True)
        ds = p * (_dot(do, v, trans_b=True) - delta)
        dk = dk + _dot(ds.astype(q.dtype), q, trans_a=True)
        return dk, dv

    steps = (qb_hi_ref[()] - first) * groups
    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = lax.fori_loop(0, steps, body, (zeros, zeros))
    dk_ref[...] = (dk * sm_scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


# ---------------------------------------------------------------------------------------------- calls

def _compiler_params(head_dim: int, num_stages: int):
    cls = None
    if _plgpu is not None:
        cls = getattr(_plgpu, "CompilerParams", None) or getattr(_plgpu, "TritonCompilerParams", None)
    if cls is None:
        return None
    return cls(num_warps=4 if head_dim <= 64 else 8, num_stages=num_stages)


def _call(kernel, *, grid, in_specs, out_specs, out_shape, head_dim, interpret, name, num_stages=2):
    params = _compiler_params(head_dim, num_stages)
    extra = {} if params is None else {"compiler_params": params}
    return pl.pallas_call(kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
                          interpret=interpret, name=name, **extra)


def _scales(d: int):
    sm_scale = d ** -0.5
    return sm_scale, sm_scale * _LOG2E


def _forward(q, k, v, lo, hi, bounds, block_q, block_k, interpret):
    b, t, n, d = q.shape
    groups = n // k.shape[2]
    kb_lo, kb_hi = bounds[:2]
    sm_scale, scale = _scales(d)
    per_block = pl.BlockSpec((None, None), lambda i, r, h: (r, i))
    ranges = pl.BlockSpec((None, block_q), lambda i, r, h: (r, i))
    q_block = pl.BlockSpec((None, block_q, None, d), lambda i, r, h: (r, i, h, 0))
    kv_row = pl.BlockSpec((None, t, None, d), lambda i, r, h: (r, 0, lax.div(h, groups), 0))
    kernel = functools.partial(_forward_kernel, block_k=block_k, scale=scale)
    return _call(
        kernel, grid=(t // block_q, b, n),
        in_specs=[per_block, per_block, ranges, ranges, q_block, kv_row, kv_row],
        out_specs=[q_block, pl.BlockSpec((None, None, block_q), lambda i, r, h: (r, h, i))],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, n, t), jnp.float32)],
        head_dim=d, interpret=interpret, name="infjax_flash_forward",
    )(kb_lo, kb_hi, lo, hi, q, k, v)


def _backward(q, k, v, lo, hi, bounds, out, lse, d_out, block_q, block_k, interpret):
    b, t, n, d = q.shape
    kv_heads = k.shape[2]
    groups = n // kv_heads
    kb_lo, kb_hi, qb_lo, qb_hi = bounds
    sm_scale, scale = _scales(d)
    # The preprocess: delta = rowsum(dO * O), [B, N, T] float32, one fused XLA pass.
    delta = jnp.einsum("btnd,btnd->bnt", d_out.astype(jnp.float32), out.astype(jnp.float32))
    d_out = d_out.astype(q.dtype)

    row = pl.BlockSpec((None, t), lambda i, r, h: (r, 0))
    per_block = pl.BlockSpec((None, None), lambda i, r, h: (r, i))

    # dK, dV: one program per (key block, row, kv head), looping over query blocks x the group's query heads.
    group_rows = pl.BlockSpec((None, t, groups, d), lambda j, r, h: (r, 0, h, 0))
    group_stats = pl.BlockSpec((None, groups, t), lambda j, r, h: (r, h, 0))
    k_block = pl.BlockSpec((None, block_k, None, d), lambda j, r, h: (r, j, h, 0))
    kernel = functools.partial(_dkv_kernel, block_q=block_q, block_k=block_k, groups=groups, scale=scale,
                               sm_scale=sm_scale)
    dk, dv = _call(
        kernel, grid=(t // block_k, b, kv_heads),
        in_specs=[per_block, per_block, row, row, group_rows, k_block, k_block, group_rows, group_stats,
                  group_stats],
        out_specs=[k_block, k_block],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        head_dim=d, interpret=interpret, name="infjax_flash_dkv",
    )(qb_lo, qb_hi, lo, hi, q, k, v, d_out, lse, delta)

    # dQ: one program per (query block, row, query head), looping over key blocks.
    q_block = pl.BlockSpec((None, block_q, None, d), lambda i, r, h: (r, i, h, 0))
    stats = pl.BlockSpec((None, None, block_q), lambda i, r, h: (r, h, i))
    kv_row = pl.BlockSpec((None, t, None, d), lambda i, r, h: (r, 0, lax.div(h, groups), 0))
    ranges = pl.BlockSpec((None, block_q), lambda i, r, h: (r, i))
    kernel = functools.partial(_dq_kernel, block_k=block_k, scale=scale, sm_scale=sm_scale)
    dq = _call(
        kernel, grid=(t // block_q, b, n),
        in_specs=[per_block, per_block, ranges, ranges, q_block, kv_row, kv_row, q_block, stats, stats],
        out_specs=q_block,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        head_dim=d, interpret=interpret, name="infjax_flash_dq",
    )(kb_lo, kb_hi, lo, hi, q, k, v, d_out, lse, delta)
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _flash(q, k, v, lo, hi, block_q, block_k, interpret):
    bounds = block_bounds(lo, hi, block_q, block_k)
    return _forward(q, k, v, lo, hi, bounds, block_q, block_k, interpret)[0]


def _flash_fwd(q, k, v, lo, hi, block_q, block_k, interpret):
    bounds = block_bounds(lo, hi, block_q, block_k)
    out, lse = _forward(q, k, v, lo, hi, bounds, block_q, block_k, interpret)
    return out, (q, k, v, lo, hi, bounds, out, lse)


def _flash_bwd(block_q, block_k, interpret, res, d_out):
    q, k, v, lo, hi, bounds, out, lse = res
    dq, dk, dv = _backward(q, k, v, lo, hi, bounds, out, lse, d_out, block_q, block_k, interpret)
    return dq, dk, dv, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, lo: jax.Array, hi: jax.Array, *,
                    block_q: int = MAX_BLOCK, block_k: int = MAX_BLOCK, interpret: bool = False) -> jax.Array:
    """Attention of q [B, T, N, D] over k/v [B, T, K, D] (N % K == 0), each query over a range of keys.

    Query t of row b sees the keys lo[b, t] <= j < hi[b, t] ([B, T] int32; an empty range gives a zero output). Scale
    D**-0.5. Output [B, T, N, D] in q's dtype; differentiable in q, k, v. Blocks: ``blocks_for(T, block_q)`` and
    ``blocks_for(T, block_k)``. ``interpret=True`` runs the kernels in Pallas' interpreter (any backend). Raises
    ValueError with ``supports``' reason on inputs the kernel does not take."""
    reason = supports(q, k, block_q, block_k)
    if reason is None and (v.shape != k.shape or jnp.dtype(v.dtype) != jnp.dtype(k.dtype)):
        reason = f"v {tuple(v.shape)} {jnp.dtype(v.dtype).name} differs from k {tuple(k.shape)} " \
                 f"{jnp.dtype(k.dtype).name}"
    if reason is None and (lo.shape != q.shape[:2] or hi.shape != q.shape[:2]):
        reason = f"lo/hi must be [B, T] = {tuple(q.shape[:2])}, got {tuple(lo.shape)} and {tuple(hi.shape)}"
    if reason is not None:
        raise ValueError(f"flash attention does not take these inputs: {reason}")
    t = q.shape[1]
    return _flash(q, k, v, lo.astype(jnp.int32), hi.astype(jnp.int32), blocks_for(t, block_q),
                  blocks_for(t, block_k), interpret)
