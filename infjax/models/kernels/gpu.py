"""Attention on NVIDIA GPUs: cuDNN's fused flash attention on packed rows, and a Pallas GPU flash kernel.

- ``cudnn``: JAX's cuDNN fused attention (the custom call behind ``jax.nn.dot_product_attention(...,
  implementation="cudnn")``), called through JAX's private module ``jax._src.cudnn.fused_attention_stablehlo``
  because only it takes the per-segment lengths and offsets of packed rows (the public function takes one
  length per row). Each text of a row is a segment of its own, so attention costs each text its own length
  squared, padding nothing; no [T, T] tensor exists in either direction. Applies to bfloat16/float16, head
  sizes that are multiples of 8 up to 128 (256 from Hopper on), with segments, causal masks and a causal
  sliding window (cuDNN's window looks back only); packed rows need compute capability 9.0 (Hopper) or
  later. The private module is checked when first used (`cudnn_api_error`); if it moved or changed, the
  choice falls back to the Pallas kernel with one warning naming why, and
  tests/models/test_kernel_gpu.py fails so that the change is seen.
- ``pallas``: `gpu_flash.flash_attention`, a Pallas (Triton) flash attention over key ranges (segment,
  causal, two-sided local window) with grouped-query heads and block skipping, for what cuDNN does not
  take: float32, ModernBERT's two-sided local window, head sizes or GPUs that cuDNN refuses. Run per device
  under `shard_map` in a sharded step.

Off a GPU neither can run natively: tests run the Pallas kernel in interpret mode and check the
conversion to cuDNN's packed arguments as a pure function; `python -m infjax.bench accelerator` checks
both against the reference on a GPU.
"""
from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp

from infjax.models.kernels import gpu_flash, sharded
from infjax.models.kernels.masks import key_ranges

try:   # private: the only JAX entry to cuDNN's packed (ragged) attention; checked by cudnn_api_error()
    from jax._src.cudnn import fused_attention_stablehlo as _cudnn
    _IMPORT_ERROR = None
except ImportError as err:          # pragma: no cover - depends on the JAX version
    _cudnn, _IMPORT_ERROR = None, f"{type(err).__name__}: {err}"

CUDNN_PARAMETERS = ("q_seqlen", "kv_seqlen", "q_offsets", "kv_offsets", "mask_type", "qkv_layout",
                    "sliding_window_length", "scale")
CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)
ROW_MULTIPLE = 64    # packed row lengths on GPU: a multiple of the Pallas kernel's largest block


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


@functools.lru_cache(maxsize=None)
def cudnn_api_error() -> str | None:
    """Why JAX's private cuDNN attention module cannot be used as this code calls it (None: it can)."""
    if _cudnn is None:
        return f"jax._src.cudnn.fused_attention_stablehlo does not import ({_IMPORT_ERROR})"
    fn = getattr(_cudnn, "dot_product_attention", None)
    if fn is None:
        return f"jax {jax.__version__}: fused_attention_stablehlo has no dot_product_attention"
    missing = [p for p in CUDNN_PARAMETERS if p not in inspect.signature(fn).parameters]
    masks = [m for m in ("PADDING", "PADDING_CAUSAL") if not hasattr(getattr(_cudnn, "MaskType", None), m)]
    if missing or masks:
        return (f"jax {jax.__version__}: cuDNN attention lacks parameters {missing} / mask types {masks} "
                "that infjax passes")
    return None


def compute_capability() -> tuple[int, int] | None:
    """(major, minor) of the first GPU, None off GPU."""
    if not on_gpu():
        return None
    return tuple(int(x) for x in jax.devices()[0].compute_capability.split("."))[:2]


def cudnn_unsupported(q, k, causal: bool, window) -> str | None:
    """Why cuDNN's packed attention cannot take these inputs here (None: it can)."""
    error = cudnn_api_error()
    if error:
        return error
    if not any(q.dtype == d for d in CUDNN_DTYPES):
        return f"cuDNN flash attention takes bfloat16/float16, not {q.dtype}"
    if window is not None and not isinstance(window, int):
        return "the local window is a traced value (scanned layers)"
    if window is not None and not causal:
        return "cuDNN's sliding window looks back only; this layer's window is two-sided"
    capability = compute_capability()
    if capability is None:
        return "no GPU"
    d = q.shape[-1]
    limit = 256 if capability >= (9, 0) else 128
    if d % 8 or d > limit:
        return f"head size {d}: cuDNN takes multiples of 8 up to {limit} on compute capability {capability}"
    if capability < (9, 0):
        return f"packed rows in cuDNN need compute capability 9.0 (Hopper) or later, this GPU has {capability}"
    try:
        _cudnn.check_cudnn_version()
    except Exception as err:          # noqa: BLE001 - cuDNN missing or unreadable: say so, fall back
        return f"cuDNN not usable: {err}"
    return None


def packed_arguments(segment_ids: jax.Array, max_segments: int) -> tuple[jax.Array, jax.Array]:
    """cuDNN's packed-row arguments of segment ids [B, T]: the length of each segment [B, M] and the offset of
    its first token in the row [B, M + 1], M = `max_segments`, each row's segments in order and the unused
    entries -1 (JAX's convention for fewer segments than M). A segment is a run of one nonzero id; padding
    (id 0) belongs to none. A row must not hold more than M segments (the caller's bound: texts per shard)."""
    b, t = segment_ids.shape
    seg = segment_ids
    before = jnp.concatenate([jnp.zeros((b, 1), seg.dtype), seg[:, :-1]], axis=1)
    start = (seg > 0) & (seg != before)
    rank = jnp.cumsum(start, axis=1, dtype=jnp.int32) - 1               # the segment each token belongs to
    # One-hot over the M slots ([B, T, M] booleans) rather than a scatter: row-local, so a batch split over
    # devices stays split.
    member = (seg > 0)[:, :, None] & (rank[:, :, None] == jnp.arange(max_segments, dtype=jnp.int32))
    first = member & start[:, :, None]
    found = jnp.any(first, axis=1)
    offsets = jnp.where(found, jnp.sum(first * jnp.arange(t, dtype=jnp.int32)[None, :, None], axis=1,
                                       dtype=jnp.int32), -1)
    lengths = jnp.where(found, jnp.sum(member, axis=1, dtype=jnp.int32), -1)
    return lengths, jnp.concatenate([offsets, jnp.full((b, 1), -1, jnp.int32)], axis=1)


def cudnn_attention(q, k, v, segment_ids, *, causal: bool = False, window: int | None = None,
                    max_segments: int | None = None) -> jax.Array:
    """Segment attention through cuDNN's packed flash attention (inputs must pass `cudnn_unsupported`).
    `max_segments`: at most this many segments in a row (default T). Padding tokens get a zero output."""
    lengths, offsets = packed_arguments(segment_ids, max_segments or segment_ids.shape[1])
    mask = _cudnn.MaskType.PADDING_CAUSAL if causal else _cudnn.MaskType.PADDING
    out = _cudnn.dot_product_attention(q, k, v, None, None, lengths, lengths, offsets, offsets,
                                       scale=q.shape[-1] ** -0.5, mask_type=mask, qkv_layout="BTNH",
                                       sliding_window_length=None if window is None else window + 1)
    return jnp.where((segment_ids > 0)[:, :, None, None], out, 0).astype(q.dtype)


def flash_unsupported(q, k, sharding) -> str | None:
    """Why the Pallas GPU flash kernel cannot take these inputs (None: it can)."""
    found = sharded.specs(sharding, q.shape[0], (q.shape[2], k.shape[2]))
    if isinstance(found, str):
        return found
    return gpu_flash.supports(q, k)


def flash_attention(q, k, v, segment_ids, *, causal: bool = False, window=None, sharding=None) -> jax.Array:
    """Segment attention through the Pallas GPU flash kernel (inputs must pass `flash_unsupported`), per
    device under `sharding`; Pallas interpret mode off a GPU."""
    def local(q, k, v, segment_ids, *window_arg):
        lo, hi = key_ranges(segment_ids, causal, window_arg[0] if window_arg else None)
        return gpu_flash.flash_attention(q, k, v, lo, hi, interpret=not on_gpu())

    extra = () if window is None else (jnp.asarray(window, jnp.int32),)
    return sharded.per_shard(local, sharding, q, k, v, segment_ids, *extra)
