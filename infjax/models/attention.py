"""The one attention function of every backbone: segment ids, optional causal and local-window masks.

A row of a batch holds one text (padded batches: segment ids are the padding
mask, 1 on real tokens, 0 on padding) or several (packed batches: 1, 2, ...
per text, 0 on the unused tail). A token attends to the tokens of its own
segment only, and additionally

- ``causal``: to those not after it (decoders), and
- ``window``: to those at most ``window`` positions away (ModernBERT's local
  layers, where HF's ``sliding_window`` is ``local_attention // 2``).

Implementations (``impl``), one module per platform under ``models/kernels``:

| impl | platform | what |
| --- | --- | --- |
| ``explicit`` | any | the reference: flash-style in plain XLA ops, blockwise from 512 tokens (kernels/reference.py) |
| ``xla`` | any | ``jax.nn.dot_product_attention`` with a [T, T] mask: the naive baseline, only when asked for |
| ``kernel`` | CPU | the fused C++ kernel through the XLA FFI, per segment (kernels/cpu.py) |
| ``cudnn`` | GPU | cuDNN's packed flash attention, per segment; bf16/fp16, Hopper+ (kernels/gpu.py) |
| ``pallas`` | GPU | a Pallas (Triton) flash kernel over key ranges with block skipping (kernels/gpu_flash.py) |
| ``splash`` | TPU | the Pallas TPU splash kernel under shard_map (kernels/tpu.py) |

``"auto"`` (the default; the environment variable ``INFJAX_ATTENTION`` may name
another) takes, for each call, the first of the platform's candidates that
takes the inputs: CPU ``kernel``; GPU ``cudnn``, then ``pallas``; TPU
``splash``; then ``explicit``. An implementation named explicitly that cannot
take the inputs falls back the same way. Attention dropout (training with a
checkpoint's dropout) always takes ``explicit``, which keeps [T, T]
probabilities for the backward pass: a warning says so on accelerators. Each
distinct choice is logged once, with the reason for every candidate passed
over (a warning when an accelerator falls back to ``explicit``).

Under a sharded step the per-device kernels need to know how the rows are split, and cuDNN how many
texts a row can hold: the encoder sets both around its call with `options` (trace-time settings, like
a mesh context; the row bound comes with the batch: 1 for padded rows, the packed batch's `segments`
width for packed ones). `options(report=False)` silences the choice log (shape-only model inits).
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import os
import re
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from infjax.errors import ConfigError
from infjax.models import kernels, remat
from infjax.models.kernels import cpu, gpu, reference, tpu
from infjax.models.kernels.masks import segment_positions  # noqa: F401 (the models import it from here)

IMPLS = ("auto", "explicit", "xla", "kernel", "cudnn", "pallas", "splash")
ENV = "INFJAX_ATTENTION"     # environment override of "auto"
CANDIDATES = {"cpu": ("kernel",), "gpu": ("cudnn", "pallas"), "tpu": ("splash",)}
PER_TEXT = ("kernel", "cudnn", "pallas")      # implementations whose cost is per text, not per row
# what packed row lengths must be a multiple of for each (cuDNN: that of the Pallas kernel it may fall back to)
ROW_MULTIPLES = {"cudnn": gpu.ROW_MULTIPLE, "pallas": gpu.ROW_MULTIPLE, "splash": tpu.ROW_MULTIPLE}

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Options:
    sharding: Any = None               # NamedSharding of the [B, T, H] activations (rows over the batch axes)
    max_segments: int | None = None    # at most this many texts in one row (None: unknown, T)
    report: bool = True                # log the choice (off for shape-only inits, which compute nothing)


_OPTIONS: contextvars.ContextVar[Options] = contextvars.ContextVar("infjax_attention_options", default=Options())


@contextlib.contextmanager
def options(sharding=None, max_segments: int | None = None, report: bool = True):
    """Trace-time settings of the attention calls made inside the block (see the module docstring)."""
    token = _OPTIONS.set(Options(sharding, max_segments, report))
    try:
        yield
    finally:
        _OPTIONS.reset(token)


class Choice(NamedTuple):
    impl: str          # the implementation that runs
    reason: str        # why: the candidates passed over, or that it was asked for
    degraded: bool = False   # a better kernel was passed over for a defect of the installed software: warn


def requested(impl: str = "auto") -> str:
    """`impl` validated, with "auto" replaced by $INFJAX_ATTENTION when that is set."""
    if impl not in IMPLS:
        raise ConfigError(f"attention impl {impl!r} is not one of {IMPLS}")
    if impl == "auto":
        impl = os.environ.get(ENV, "auto") or "auto"
        if impl not in IMPLS:
            raise ConfigError(f"environment variable {ENV}={impl!r}: choose one of {IMPLS} (or unset it)")
    return impl


def unsupported(impl: str, q, k, *, causal: bool = False, window=None, opts: Options | None = None) -> str | None:
    """Why `impl` cannot take these inputs on this platform (None: it can). q and k may be abstract."""
    opts = opts or _OPTIONS.get()
    if impl in ("explicit", "xla"):
        return None
    if impl == "kernel":
        if kernels.platform() != "cpu":
            return "the C++ kernel runs on CPU only"
        if not cpu.supports(q, k):
            return f"takes float32 and head sizes {cpu.HEAD_SIZES}, not {q.dtype} x {q.shape[-1]}"
        return None if cpu.available() else "could not be built (see the warning above)"
    if impl == "cudnn":
        return gpu.cudnn_unsupported(q, k, causal, window)
    if impl == "pallas":
        return gpu.flash_unsupported(q, k, opts.sharding)
    if impl == "splash":
        return tpu.unsupported(q, k, causal, window, opts.sharding)
    raise ValueError(f"attention impl {impl!r} is not one of {IMPLS}")


DROPOUT_REASON = "attention dropout is on: the explicit path keeps [T, T] probabilities for the backward pass"


def choose(q, k, *, causal: bool = False, window=None, dropout: bool = False, impl: str = "auto") -> Choice:
    """The implementation `attention` runs for these inputs, and why."""
    impl = requested(impl)
    if dropout:
        return Choice("explicit", DROPOUT_REASON)
    platform = kernels.platform()
    candidates = CANDIDATES.get(platform, ()) if impl == "auto" else (impl,)
    passed, degraded = [], False
    for name in candidates:
        why = unsupported(name, q, k, causal=causal, window=window)
        if why is None:
            how = f"auto on {platform}" if impl == "auto" else "asked for"
            return Choice(name, "; ".join([how] + passed), degraded)
        passed.append(f"{name}: {why}")
        # cuDNN refused for the installed JAX's grouped-query defect, not for what the inputs are
        degraded |= name == "cudnn" and k.shape[2] != q.shape[2] and why == gpu.gqa_offsets_error()
    if not passed:
        return Choice("explicit", f"auto on {platform}" if impl == "auto" else "asked for")
    return Choice("explicit", "; ".join(passed), degraded)


_WARNED: set[str] = set()      # fallback reasons already warned about
_REPORTED: set[str] = set()
_RECORD: contextvars.ContextVar[list | None] = contextvars.ContextVar("infjax_attention_record", default=None)


class Call(NamedTuple):
    """One attention call as traced: its inputs' shapes and what ran."""
    choice: Choice
    shape: tuple                # q [B, T, N, D]
    kv_heads: int
    dtype: str
    causal: bool
    window: Any                 # an int, "traced" (scanned layers) or None
    max_segments: int | None


@contextlib.contextmanager
def recorded():
    """Collect every attention call traced inside the block (a list of `Call`, in trace order): what the
    compiled program runs, e.g. for `python -m infjax.bench compile`."""
    calls: list[Call] = []
    token = _RECORD.set(calls)
    try:
        yield calls
    finally:
        _RECORD.reset(token)


def _report(choice: Choice, q, causal, window, impl: str) -> None:
    """Log each distinct choice once per process (a warning where an accelerator or a request fell back)."""
    mask = "causal" if causal else "bidirectional"
    if window is not None:
        mask += f", window {window if isinstance(window, int) else '(per layer)'}"
    message = (f"attention: {choice.impl} for rows of {q.shape[1]} tokens, {q.shape[2]} heads of {q.shape[3]}, "
               f"{jnp.dtype(q.dtype).name}, {mask} ({choice.reason})")
    if message in _REPORTED or not _OPTIONS.get().report:
        return
    _REPORTED.add(message)
    fell_back = choice.impl == "explicit" and ":" in choice.reason     # (dropout's reason has one too)
    accelerator = kernels.platform() != "cpu"
    kind = re.sub(r"\d+", "N", choice.reason)      # the reason, whatever the shape
    warn = (choice.degraded or fell_back and (accelerator or requested(impl) != "auto")) and kind not in _WARNED
    if warn:                        # once per reason: the other shapes that fall back for it are INFO lines
        _WARNED.add(kind)
    log.log(logging.WARNING if warn else logging.INFO, message)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *, causal: bool = False,
              window: int | jax.Array | None = None, dropout: nn.Dropout | None = None, impl: str = "auto",
              block: int | None = None) -> jax.Array:
    """Scaled dot-product self attention inside segments: q [B, T, N, D], k/v [B, T, K, D] -> [B, T, N, D].

    N must be a multiple of K (grouped-query attention: query head ``n`` uses
    key/value head ``n // (N // K)``, HF's ``repeat_kv``). ``window`` may be a
    traced scalar (scanned layers; < 0 or >= T: none). ``dropout`` (a
    training-time module) drops attention probabilities. ``block``: query
    rows per block of the explicit path.
    """
    choice = choose(q, k, causal=causal, window=window, dropout=dropout is not None, impl=impl)
    _report(choice, q, causal, window, impl)
    opts = _OPTIONS.get()
    record = _RECORD.get()
    if record is not None and opts.report:        # (not the shape-only inits: they compute nothing)
        record.append(Call(choice, tuple(q.shape), k.shape[2], jnp.dtype(q.dtype).name, causal,
                           window if window is None or isinstance(window, int) else "traced", opts.max_segments))
    return remat.tag(_attend(choice, opts, q, k, v, segment_ids, causal, window, dropout, block), remat.CONTEXT)


def _attend(choice: Choice, opts, q, k, v, segment_ids, causal, window, dropout, block) -> jax.Array:
    if choice.impl == "kernel":
        return cpu.attention(q, k, v, segment_ids, causal=causal, window=window)
    if choice.impl == "cudnn":
        return gpu.cudnn_attention(q, k, v, segment_ids, causal=causal, window=window,
                                   max_segments=opts.max_segments)
    if choice.impl == "pallas":
        return gpu.flash_attention(q, k, v, segment_ids, causal=causal, window=window, sharding=opts.sharding)
    if choice.impl == "splash":
        return tpu.attention(q, k, v, segment_ids, causal=causal, window=window, sharding=opts.sharding)
    if choice.impl == "xla":
        return reference.xla_attention(q, k, v, segment_ids, causal=causal, window=window)
    return reference.explicit_attention(q, k, v, segment_ids, causal=causal, window=window, dropout=dropout,
                                        block=block)


def _probe(head_dim: int, dtype: Any, length: int = 512, heads: int = 1):
    return jax.ShapeDtypeStruct((1, length, heads, head_dim), jnp.dtype(dtype))


def costs_per_text(head_dim: int, dtype: Any, dropout: bool = False) -> bool:
    """Whether `attention` (impl "auto") computes only each text's own keys for these inputs.

    If so, a packed row's attention costs the sum of its texts' squared lengths, not its own squared length: true of
    the CPU kernel, cuDNN's packed attention and the Pallas GPU kernel (which skips other texts' key blocks). Splash
    and the XLA paths compute the whole row, as does any path with attention dropout (`dropout`: the run applies the
    checkpoint's dropout)."""
    probe = _probe(head_dim, dtype)
    return choose(probe, probe, dropout=dropout).impl in PER_TEXT


def row_multiple(head_dim: int, dtype: Any, dropout: bool = False) -> int | None:
    """What packed row lengths must be a multiple of for the platform's fused attention (TPU splash: its
    block of 128; GPU: the Pallas kernel's block of 64), None where nothing is required."""
    probe = _probe(head_dim, dtype)
    return ROW_MULTIPLES.get(choose(probe, probe, dropout=dropout).impl)
