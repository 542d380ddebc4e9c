"""Attention on TPU: the Pallas TPU splash-attention kernel, run per device under `shard_map`.

Splash attention takes segment ids and a static mask (full, causal, or a local window around the
diagonal) and skips the key blocks that the static mask empties. Row lengths must be multiples of 128
(the TPU's lane width, `ROW_MULTIPLE`): packed rows on TPU are chosen that way. Blocks are the largest of
512, 256 and 128 that divides the row (`block_for`; 512 as maxtext and levanter use). Grouped-query heads
go to the kernel as they are (it maps each query head to its kv head). A padding token (segment 0) attends
to the other padding tokens of its row; its output is set to zero, as no pooling reads it.

On CPU the kernel runs in Pallas interpret mode, which is how the tests check its numbers; compiled for a
TPU target (tests/accelerators/, `python -m infjax.bench compile --target=v5e-4`) libtpu's Mosaic compiler
checks its lowering. On a GPU it is refused (it would only run interpreted).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from infjax.models.kernels import sharded, target

BLOCK = 128          # the smallest query/key block (the TPU's lanes): row lengths must be multiples of it
BLOCKS = (512, 256, 128)   # tried in order: the largest that divides the row
ROW_MULTIPLE = BLOCK


def on_tpu() -> bool:
    return target.platform() == "tpu"


def block_for(t: int) -> int:
    """The splash block of rows of `t` tokens (a multiple of BLOCK)."""
    return next(b for b in BLOCKS if t % b == 0)


def unsupported(q, k, causal: bool, window, sharding) -> str | None:
    """Why splash cannot take these inputs (None: it can)."""
    if target.platform() not in ("tpu", "cpu"):
        return f"splash does not run on {target.platform()} (only interpreted, very slowly)"
    t = q.shape[1]
    if t % BLOCK:
        return f"row length {t} is not a multiple of splash's block of {BLOCK}"
    if q.shape[2] % k.shape[2]:
        return f"{q.shape[2]} query heads are not a multiple of {k.shape[2]} kv heads"
    if window is not None and not isinstance(window, int):
        return "the local window is a traced value (scanned layers), splash needs a static mask"
    found = sharded.specs(sharding, q.shape[0], (q.shape[2], k.shape[2]))
    if isinstance(found, str):
        return found
    return None


@functools.lru_cache(maxsize=None)
def _kernel(t: int, heads: int, causal: bool, window: int | None, interpret: bool):
    """A splash kernel for one row [heads, t, d] (built once per shape and mask)."""
    # Imported here: the Pallas TPU ops load only when splash is used.
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel_lib
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask_lib
    if window is not None:
        base = mask_lib.LocalMask((t, t), (window, 0 if causal else window), offset=0)
    else:
        base = mask_lib.CausalMask((t, t)) if causal else mask_lib.FullMask((t, t))
    b = block_for(t)
    sizes = kernel_lib.BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b, block_kv_dkv=b,
                                  block_kv_dkv_compute=b, block_q_dq=b, block_kv_dq=b)
    # The kernel's block tables are arrays: made concrete, so that a kernel built inside a trace (a jitted
    # step, shard_map) and cached holds constants, not that trace's values.
    with jax.ensure_compile_time_eval():
        kernel = kernel_lib.make_splash_mha_single_device(mask_lib.MultiHeadMask([base] * heads),
                                                          block_sizes=sizes, interpret=interpret)
    return kernel, kernel_lib.SegmentIds


def _local(q, k, v, segment_ids, causal, window):
    """Splash on one device's rows: q [b, T, N, D], k/v [b, T, K, D] (N a multiple of K)."""
    _, t, n, d = q.shape
    kernel, segments = _kernel(t, n, causal, window, not on_tpu())
    qh, kh, vh = (jnp.swapaxes(x, 1, 2) for x in (q * d ** -0.5, k, v))        # [b, N, T, D]
    one_row = lambda qr, kr, vr, sr: kernel(qr, kr, vr, segment_ids=segments(q=sr, kv=sr))  # noqa: E731
    out = jnp.swapaxes(jax.vmap(one_row)(qh, kh, vh, segment_ids), 1, 2).astype(q.dtype)
    return jnp.where((segment_ids > 0)[:, :, None, None], out, 0).astype(q.dtype)


def attention(q, k, v, segment_ids, *, causal: bool = False, window: int | None = None, sharding=None):
    """Segment attention through splash (inputs must pass `unsupported`), per device under `sharding`."""
    return sharded.per_shard(functools.partial(_local, causal=causal, window=window), sharding,
                             q, k, v, segment_ids)
