"""Fused segment attention on XLA:CPU: a C++ kernel (``cpu_attention.cc``) called through the XLA FFI.

XLA:CPU has no fused attention: the explicit path writes [B, N, T, T] scores,
their exponentials and, in the backward, their gradients to memory one pass
at a time, and computes every score of a packed row, across segments too.
This kernel takes a few query rows at a time over the key range of their own
segment, keeps their scores in cache, and recomputes them in the backward
from the log-sum-exp (flash attention's scheme). Keys outside a row's segment
(other texts of a packed row, padding) cost nothing.

The kernel is compiled on first use with the machine's C++ compiler (``$CXX``,
else ``c++``; ``-O3 -march=native``) against jaxlib's FFI headers, into a
cache folder (``$INFJAX_KERNEL_CACHE``, else ``$XDG_CACHE_HOME/infjax/kernels``,
else ``~/.cache/infjax/kernels``) keyed by the source, the compiler, jaxlib
and the CPU's instruction sets; a second process reuses the file. Where it
cannot be built (no compiler), ``available()`` says why and the attention
function falls back to the explicit XLA path.

Supported: float32, head sizes 16/32/64/128, grouped-query heads, and every
mask of ``attention.attention`` (segments, causal, local window), each a
contiguous key range per query (``key_ranges``). A query row with no key
(padding, segment 0) gets a zero output and no gradient.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from infjax.models.kernels.masks import key_ranges

HEAD_SIZES = (16, 32, 64, 128)
_SOURCE = pathlib.Path(__file__).with_name("cpu_attention.cc")
_FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno", "-ffp-contract=fast")
_FORWARD, _BACKWARD = "infjax_attention_forward", "infjax_attention_backward"

log = logging.getLogger(__name__)


def cache_dir() -> pathlib.Path:
    if os.environ.get("INFJAX_KERNEL_CACHE"):
        return pathlib.Path(os.environ["INFJAX_KERNEL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "infjax" / "kernels"


def _cpu_features() -> str:
    """The CPU's instruction-set flags: a library built with -march=native must not run on a CPU without them."""
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() + platform.machine()


def _build() -> pathlib.Path:
    """Path of the compiled library, compiling it first if the cache does not hold this build."""
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if not compiler:
        raise RuntimeError("no C++ compiler found (set $CXX, or install g++)")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256("\0".join([_SOURCE.read_text(), version, " ".join(_FLAGS), jaxlib.__version__,
                                    _cpu_features()]).encode()).hexdigest()[:16]
    target = cache_dir() / f"cpu_attention-{key}.so"
    if target.exists():
        damage = _damage(target)
        if damage is None:
            return target
        log.warning("the cached CPU attention kernel %s is damaged (%s); building it again", target, damage)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise RuntimeError(f"cannot create the kernel cache {target.parent} ({err}); set $INFJAX_KERNEL_CACHE "
                           "to a writable folder") from err
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.stem + ".", suffix=".tmp")
    os.close(fd)
    try:
        result = subprocess.run([compiler, *_FLAGS, "-I", jax.ffi.include_dir(), str(_SOURCE), "-o", tmp],
                                capture_output=True, text=True)
        if result.returncode:
            raise RuntimeError(f"{compiler} failed to build {_SOURCE.name}:\n{result.stderr[-2000:]}")
        record = _digest_path(target)
        record_tmp = f"{tmp}.sha256"
        pathlib.Path(record_tmp).write_text(_digest(pathlib.Path(tmp)))
        os.replace(record_tmp, record)   # the record first: a library in the cache always has one
        os.replace(tmp, target)          # atomic: a concurrent process sees no file or a whole one
    finally:
        for leftover in (tmp, f"{tmp}.sha256"):
            if os.path.exists(leftover):
                os.unlink(leftover)
    log.info("compiled the CPU attention kernel into %s", target)
    return target


def _digest_path(library: pathlib.Path) -> pathlib.Path:
    return library.with_name(library.name + ".sha256")


def _digest(library: pathlib.Path) -> str:
    data = library.read_bytes()
    return f"{len(data)} {hashlib.sha256(data).hexdigest()}\n"


def _damage(library: pathlib.Path) -> str | None:
    """Why the cached library cannot be loaded safely (a truncated file crashes ctypes with a bus error), or
    None when its size and SHA-256 are those recorded when it was built."""
    try:
        recorded = _digest_path(library).read_text()
    except OSError:
        return "no record of its size and hash"
    try:
        actual = _digest(library)
    except OSError as err:
        return f"unreadable: {err}"
    if actual != recorded:
        return f"size and SHA-256 {actual.strip()!r}, built as {recorded.strip()!r}"
    return None


@functools.lru_cache(maxsize=None)
def _load() -> bool:
    """Builds and registers the kernel once per process; whether it is ready (if not, logs why, once)."""
    import ctypes
    try:
        library = ctypes.CDLL(str(_build()))
    except (OSError, RuntimeError, subprocess.SubprocessError) as err:
        log.warning("the CPU attention kernel is unavailable, attention takes the explicit XLA path: %s", err)
        return False
    jax.ffi.register_ffi_target(_FORWARD, jax.ffi.pycapsule(library.InfjaxAttentionForward), platform="cpu")
    jax.ffi.register_ffi_target(_BACKWARD, jax.ffi.pycapsule(library.InfjaxAttentionBackward), platform="cpu")
    return True


def available() -> bool:
    """Whether the kernel is built and registered (building it on the first call; logs why not, once)."""
    return _load()


def takes(head_dim: int, dtype) -> bool:
    """Whether the kernel takes inputs of this head size and dtype (float32, a supported head size)."""
    return jnp.dtype(dtype) == jnp.float32 and head_dim in HEAD_SIZES


def supports(q: jax.Array, k: jax.Array) -> bool:
    """Whether the kernel takes these inputs."""
    return q.dtype == k.dtype and takes(q.shape[-1], q.dtype)




def _batch_partitioned(fn, rule: str):
    """`fn` (an FFI call whose operands and results all lead with the batch) under `custom_partitioning`.

    A batch-sharded operand stays sharded and each device runs the kernel on its own rows (without this, XLA gathers
    the whole batch onto every device); every other dimension is replicated."""
    from jax.experimental.custom_partitioning import custom_partitioning
    from jax.sharding import NamedSharding, PartitionSpec

    wrapped = custom_partitioning(fn)

    def batch_sharding(mesh, shape):
        spec = getattr(shape.sharding, "spec", None)
        return NamedSharding(mesh, PartitionSpec(spec[0] if spec else None))

    def infer(mesh, arg_shapes, result_shape):
        results = result_shape if isinstance(result_shape, (tuple, list)) else (result_shape,)
        return tuple(batch_sharding(mesh, arg_shapes[0]) for _ in results)

    def partition(mesh, arg_shapes, result_shape):
        sharding = batch_sharding(mesh, arg_shapes[0])
        return mesh, fn, infer(mesh, arg_shapes, result_shape), (sharding,) * len(arg_shapes)

    factors = rule.replace(",", " ").replace("->", " ").split()
    others = [f for i, f in enumerate(factors) if f != "b" and f not in factors[:i]]    # in order, as Shardy wants
    wrapped.def_partition(partition=partition, infer_sharding_from_operands=infer, sharding_rule=rule,
                          need_replication_factors=tuple(others))
    return wrapped


def _forward_call(q, k, v, lo, hi):
    b, t, n, _ = q.shape
    return tuple(jax.ffi.ffi_call(_FORWARD, (jax.ShapeDtypeStruct(q.shape, q.dtype),
                                             jax.ShapeDtypeStruct((b, n, t), jnp.float32)),
                                  vmap_method="sequential")(q, k, v, lo, hi))


def _backward_call(q, k, v, lo, hi, out, lse, d_out):
    return tuple(jax.ffi.ffi_call(_BACKWARD, (jax.ShapeDtypeStruct(q.shape, q.dtype),
                                              jax.ShapeDtypeStruct(k.shape, k.dtype),
                                              jax.ShapeDtypeStruct(v.shape, v.dtype)),
                                  vmap_method="sequential")(q, k, v, lo, hi, out, lse, d_out))


_forward_sharded = _batch_partitioned(_forward_call, "b t n d, b t k d, b t k d, b t, b t -> b t n d, b n t")
_backward_sharded = _batch_partitioned(
    _backward_call, "b t n d, b t k d, b t k d, b t, b t, b t n d, b n t, b t n d -> b t n d, b t k d, b t k d")


@jax.custom_vjp
def _attention(q, k, v, lo, hi):
    return _forward(q, k, v, lo, hi)[0]


def _forward(q, k, v, lo, hi):
    out, lse = _forward_sharded(q, k, v, lo, hi)
    return out, (q, k, v, lo, hi, out, lse)


def _backward(res, d_out):
    d_q, d_k, d_v = _backward_sharded(*res, d_out)
    zero = np.zeros(res[3].shape, jax.dtypes.float0)
    return d_q, d_k, d_v, zero, zero


_attention.defvjp(_forward, _backward)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *, causal: bool = False,
              window: jax.Array | int | None = None) -> jax.Array:
    """Segment attention q [B, T, N, D], k/v [B, T, K, D] -> [B, T, N, D] through the kernel (which must be
    `available()` and `supports` the inputs)."""
    lo, hi = key_ranges(segment_ids, causal, window)
    return _attention(q, k, v, lo, hi)
