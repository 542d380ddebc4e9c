"""Attention on NVIDIA GPUs: cuDNN's fused flash attention on packed rows, and a Pallas GPU flash kernel.

- ``cudnn``: JAX's cuDNN fused attention (the custom call behind ``jax.nn.dot_product_attention(...,
  implementation="cudnn")``), called through JAX's private module ``jax._src.cudnn.fused_attention_stablehlo``
  because only it takes the per-segment lengths and offsets of packed rows (the public function takes one
  length per row, i.e. right padding). Each text of a row is a segment of its own, so attention costs each
  text its own length squared; no [T, T] tensor exists in either direction. Applies to bfloat16/float16,
  head sizes that are multiples of 8 up to 128 (256 from Hopper on), segments, causal masks and a causal
  sliding window (cuDNN's window looks back only); packed rows need compute capability 9.0 (Hopper) or later
  and cuDNN 9.0 or later.

  How infjax calls it, and why:

  * Every run of padding is a sequence of its own for cuDNN, beside the texts (`packed_arguments`), and q,
    k and v are zeroed at padding before the call. So cuDNN writes every token of its output: padding
    attends to padding only, over zero values, which gives exactly 0 there; no masking of the output is
    needed afterwards (a masked copy of every layer's output would stay alive for the backward pass beside
    cuDNN's own: +7% of the BERT-base step's memory). The gradients of q, k and v are exactly 0 at padding
    through the zeroing, whatever cuDNN's backward leaves there.
  * Every call passes at least 2 sequence slots per row (``MIN_SEGMENTS``). JAX hands the offsets to cuDNN
    only when a row may hold more than one sequence; with one slot it drops them and cuDNN takes the first
    ``length`` tokens of a row as the real ones, which is wrong for a left-padded decoder row (its text
    ends the row). Slots that hold nothing (-1) are removed by JAX before the call.
  * The slot count is the batch's (`segment_slots`): packed batches carry the most texts any row holds
    (bucketed to a power of two, data/packing.py), padded batches hold one text per row; two slots more
    take the padding before and after. cuDNN keeps float32 softmax statistics of [B * slots, heads, T] per
    layer for the backward pass, so the count is never left at T.
  * Grouped-query heads (fewer kv heads than query heads) are refused where the installed JAX scales the
    key offsets by the query head count (jax < 0.11.1, jax-ml/jax#39521: keys of the wrong tokens, no
    error). `gqa_offsets_error` probes JAX's own function, not its version number.
  * The private module is checked when first used (`cudnn_api_error`); if it moved or changed, the choice
    falls back to the Pallas kernel with one warning naming why, and tests/models/test_kernel_gpu_tpu.py
    fails so that the change is seen. Arguments are passed by name.

- ``pallas``: `gpu_flash.flash_attention`, a Pallas (Triton) flash attention over key ranges (segment,
  causal, two-sided local window) with grouped-query heads and block skipping, for what cuDNN does not
  take: float32, ModernBERT's two-sided local window, head sizes or GPUs that cuDNN refuses. Run per device
  under `shard_map` in a sharded step. Lowered natively on a GPU target, in Pallas interpret mode on CPU
  (the tests); refused on other accelerators (a TPU would run the interpreter).

Off a GPU neither runs natively: tests run the Pallas kernel in interpret mode, check the conversion to
cuDNN's packed arguments through JAX's own argument fix-up, and compile whole train steps for a
compile-only H100 (tests/accelerators/); `python -m infjax.bench accelerator` checks both against the
reference on a GPU.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from infjax.models.kernels import gpu_flash, sharded, target
from infjax.models.kernels.masks import key_ranges

try:   # private: the only JAX entry to cuDNN's packed (ragged) attention; checked by cudnn_api_error()
    from jax._src.cudnn import fused_attention_stablehlo as _cudnn
    _IMPORT_ERROR = None
except ImportError as err:          # pragma: no cover - depends on the JAX version
    _cudnn, _IMPORT_ERROR = None, f"{type(err).__name__}: {err}"

CUDNN_PARAMETERS = ("query", "key", "value", "bias", "mask", "q_seqlen", "kv_seqlen", "q_offsets", "kv_offsets",
                    "mask_type", "qkv_layout", "sliding_window_length", "scale")
CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)
CUDNN_MIN_VERSION = 90000         # packed (ragged) attention: cuDNN 9.0
CUDNN_MIN_VERSION_CC_10_3 = 91100  # compute capability 10.3: cuDNN 9.11 (JAX raises below it)
MIN_SEGMENTS = 2     # segment slots per row passed to cuDNN: JAX drops the offsets of rows with fewer
ROW_MULTIPLE = 64    # packed row lengths on GPU: a multiple of the Pallas kernel's largest block
TRITON_DEPRECATION = "jax-pallas-triton"    # JAX's id of the deprecation of its Pallas Triton backend (jax 0.12)
TRITON_MESSAGE = "The Pallas Triton backend is deprecated"

log = logging.getLogger(__name__)


def on_gpu() -> bool:
    return target.platform() == "gpu"


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
    helpers = [h for h in ("_fix_seqlen_offsets", "get_max_seg_per_batch", "check_compute_capability",
                           "is_cuda_compute_capability_equal", "check_cudnn_version") if not hasattr(_cudnn, h)]
    if missing or masks or helpers:
        return (f"jax {jax.__version__}: cuDNN attention lacks parameters {missing} / mask types {masks} / "
                f"functions {helpers} that infjax uses")
    return None


@functools.lru_cache(maxsize=None)
def gqa_offsets_error() -> str | None:
    """Why cuDNN's packed path cannot take grouped-query heads with the installed JAX (None: it can).

    Probes JAX's own argument fix-up on a tiny concrete case (runs on any backend): one row of 4 tokens,
    2 query heads and 1 kv head of size 8, segments at tokens 0 and 2. The kv offset of the second segment
    must be 2 tokens x 1 kv head x 8 = 16 elements; jax < 0.11.1 gives 32 (the query heads' stride)."""
    if cudnn_api_error():
        return cudnn_api_error()
    q = jax.ShapeDtypeStruct((1, 4, 2, 8), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, 4, 1, 8), jnp.bfloat16)
    try:      # on the CPU, whatever devices a program is being compiled for (kernels.targeting)
        with jax.default_device(jax.devices("cpu")[0]), jax.ensure_compile_time_eval():
            seqlen, offsets = jnp.asarray([[2, 2]], jnp.int32), jnp.asarray([[0, 2, -1]], jnp.int32)
            _, _, _, kv_offsets = _cudnn._fix_seqlen_offsets(seqlen, seqlen, offsets, offsets, q, k)
        got = int(np.asarray(kv_offsets).reshape(-1)[1])
    except Exception as err:          # noqa: BLE001 - an unreadable fix-up is as bad as a wrong one
        return f"jax {jax.__version__}: cuDNN's packed offsets could not be checked ({type(err).__name__}: {err})"
    if got != 16:
        return (f"jax {jax.__version__} scales cuDNN's packed key offsets by the query heads, not the kv heads "
                "(grouped-query attention would read the wrong keys; fixed in jax 0.11.1, which needs Python "
                "3.12: pip install 'jax>=0.11.1')")
    return None


def compute_capability() -> tuple[int, int] | None:
    """(major, minor) of the first target GPU (target.devices()), None off GPU or where it is not CUDA's."""
    if not on_gpu():
        return None
    text = getattr(target.devices()[0], "compute_capability", None)
    try:
        return tuple(int(x) for x in str(text).split("."))[:2]
    except ValueError:               # ROCm: "gfx90a" and the like
        return None


def cudnn_version() -> int | None:
    """cuDNN's version number (e.g. 92801 for 9.28.1), None where it is missing or unreadable."""
    try:
        return int(_cudnn.check_cudnn_version())
    except Exception:                 # noqa: BLE001 - no cuDNN (ROCm, a CPU-only jaxlib): treated as absent
        return None


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
    if not on_gpu():
        return "no GPU"
    capability = compute_capability()
    if capability is None:
        return "not a CUDA GPU (cuDNN attention needs one)"
    d = q.shape[-1]
    limit = 256 if capability >= (9, 0) else 128
    if d % 8 or d > limit:
        return f"head size {d}: cuDNN takes multiples of 8 up to {limit} on compute capability {capability}"
    if capability < (9, 0):
        return f"packed rows in cuDNN need compute capability 9.0 (Hopper) or later, this GPU has {capability}"
    version = cudnn_version()
    if version is None:
        return "cuDNN not found"
    needed = CUDNN_MIN_VERSION_CC_10_3 if capability == (10, 3) else CUDNN_MIN_VERSION
    if version < needed:
        return f"cuDNN {version} is older than {needed}, the oldest that takes packed rows on {capability}"
    if k.shape[2] != q.shape[2]:
        return gqa_offsets_error()
    return None


def packed_arguments(segment_ids: jax.Array, max_segments: int) -> tuple[jax.Array, jax.Array]:
    """cuDNN's packed-row arguments of segment ids [B, T]: each sequence's length [B, M] and offset [B, M + 1].

    The length of each sequence [B, M] and the offset of its first token in the row [B, M + 1], M = `max_segments`,
    each row's sequences in order and the unused entries -1 (JAX's convention for fewer sequences than M). A sequence
    is a run of one id, padding (0) included: a left-padded row is two, the padding and the text that starts at its
    offset. A row must not hold more than M runs (the caller's bound, `segment_slots`)."""
    b, t = segment_ids.shape
    seg = segment_ids
    before = jnp.concatenate([jnp.full((b, 1), -1, seg.dtype), seg[:, :-1]], axis=1)
    start = seg != before
    rank = jnp.cumsum(start, axis=1, dtype=jnp.int32) - 1               # the run each token belongs to
    # One-hot over the M slots ([B, T, M] booleans) rather than a scatter: row-local, so a batch split over
    # devices stays split.
    member = rank[:, :, None] == jnp.arange(max_segments, dtype=jnp.int32)
    first = member & start[:, :, None]
    found = jnp.any(first, axis=1)
    offsets = jnp.where(found, jnp.sum(first * jnp.arange(t, dtype=jnp.int32)[None, :, None], axis=1,
                                       dtype=jnp.int32), -1)
    lengths = jnp.where(found, jnp.sum(member, axis=1, dtype=jnp.int32), -1)
    return lengths, jnp.concatenate([offsets, jnp.full((b, 1), -1, jnp.int32)], axis=1)


def segment_slots(max_segments: int | None, length: int) -> int:
    """The sequence slots per row that cuDNN gets: the caller's bound on texts, and 2 for the padding around them.

    The bound on texts may be None: unknown, every token could start one: the row length. The 2 are for the padding
    before and after them; never more than the row length, never fewer than MIN_SEGMENTS (module doc)."""
    return max(MIN_SEGMENTS, min((max_segments or length) + 2, length))


def cudnn_attention(q, k, v, segment_ids, *, causal: bool = False, window: int | None = None,
                    max_segments: int | None = None) -> jax.Array:
    """Segment attention through cuDNN's packed flash attention (inputs must pass `cudnn_unsupported`).

    `max_segments`: at most this many texts in a row (None: T, the safe bound of a caller that does not know its batch;
    the encoder always knows). Padding tokens get a zero output and a zero gradient (module doc)."""
    real = (segment_ids > 0)[:, :, None, None]
    q, k, v = (jnp.where(real, x, jnp.zeros((), x.dtype)) for x in (q, k, v))
    lengths, offsets = packed_arguments(segment_ids, segment_slots(max_segments, segment_ids.shape[1]))
    mask = _cudnn.MaskType.PADDING_CAUSAL if causal else _cudnn.MaskType.PADDING
    out = _cudnn.dot_product_attention(query=q, key=k, value=v, q_seqlen=lengths, kv_seqlen=lengths,
                                       q_offsets=offsets, kv_offsets=offsets, scale=q.shape[-1] ** -0.5,
                                       mask_type=mask, qkv_layout="BTNH",
                                       sliding_window_length=None if window is None else window + 1)
    return out.astype(q.dtype)


@contextlib.contextmanager
def answering_for(device):
    """Inside the block, JAX's cuDNN attention checks answer for `device`, a (compile-only) CUDA device.

    The checks (compute capability) are asked of the local backend at trace time; this is for compiling for a GPU that
    is not here (`kernels.targeting`). Nothing else changes."""
    if _cudnn is None or cudnn_api_error():
        yield
        return
    current = tuple(int(x) for x in device.compute_capability.split("."))

    def at_least(capability):
        return current >= tuple(int(x) for x in capability.split("."))

    def equal(capability):
        return current == tuple(int(x) for x in capability.split("."))

    saved = _cudnn.check_compute_capability, _cudnn.is_cuda_compute_capability_equal
    _cudnn.check_compute_capability, _cudnn.is_cuda_compute_capability_equal = at_least, equal
    try:
        yield
    finally:
        _cudnn.check_compute_capability, _cudnn.is_cuda_compute_capability_equal = saved


def triton_status() -> str | None:
    """What the installed JAX says of the Pallas Triton backend the Pallas GPU kernel is built on: None (nothing),
    "deprecated" (it warns at every lowering, jax 0.12) or "removed" (JAX raises instead: accelerated)."""
    try:
        from jax._src import deprecations
    except ImportError:              # pragma: no cover - depends on the JAX version
        return None
    if TRITON_DEPRECATION not in getattr(deprecations, "_registered_deprecations", {}):
        return None
    return "removed" if deprecations.is_accelerated(TRITON_DEPRECATION) else "deprecated"


@functools.lru_cache(maxsize=None)
def note_triton_deprecation() -> None:
    """Once per process: one line saying that JAX deprecates the backend of the Pallas GPU kernel, instead of
    JAX's warning at each of its lowerings (three per layer and side). docs/attention.md says what replaces it."""
    if triton_status() != "deprecated":
        return
    warnings.filterwarnings("ignore", message=TRITON_MESSAGE, category=DeprecationWarning)
    log.warning("attention: the Pallas GPU kernel is built on JAX's Pallas Triton backend, which jax %s "
                "deprecates (it still runs; see docs/attention.md for what replaces it)", jax.__version__)


def flash_unsupported(q, k, sharding) -> str | None:
    """Why the Pallas GPU flash kernel cannot take these inputs (None: it can)."""
    if target.platform() not in ("gpu", "cpu"):
        return f"the Pallas GPU kernel does not run on {target.platform()} (only interpreted, very slowly)"
    if on_gpu() and triton_status() == "removed":
        return f"jax {jax.__version__} has removed the Pallas Triton backend that the Pallas GPU kernel is built on"
    found = sharded.specs(sharding, q.shape[0], (q.shape[2], k.shape[2]))
    if isinstance(found, str):
        return found
    return gpu_flash.supports(q, k)


def flash_attention(q, k, v, segment_ids, *, causal: bool = False, window=None, sharding=None) -> jax.Array:
    """Segment attention through the Pallas GPU flash kernel (inputs must pass `flash_unsupported`), per
    device under `sharding`; Pallas interpret mode off a GPU."""
    interpret = not on_gpu()
    if not interpret:
        note_triton_deprecation()

    def local(q, k, v, segment_ids, *window_arg):
        lo, hi = key_ranges(segment_ids, causal, window_arg[0] if window_arg else None)
        return gpu_flash.flash_attention(q, k, v, lo, hi, interpret=interpret)

    extra = () if window is None else (jnp.asarray(window, jnp.int32),)
    return sharded.per_shard(local, sharding, q, k, v, segment_ids, *extra)
