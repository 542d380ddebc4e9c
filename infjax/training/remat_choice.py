"""`model.remat=auto`: the least recompute whose compiled train step fits the device.

It takes the first of `remat.RECOMPUTE_ORDER` (none, dots, dots_except_mlp, full: least recompute first) whose
train step, compiled for the run's widest batch, has a peak memory per device (arguments, temporaries and
outputs of the compiled step, what `bench compile` reports) within ``(1 - MARGIN)`` of the device's memory.
Each policy keeps less than the one before, so they are compiled from `full` back until one does not fit
(`choose`). The chosen policy's compiled program is the one the run uses for that batch shape: nothing compiles
twice.

MARGIN = 10%: the compiled peak is what the device holds while the step runs (measured against the allocator's
peak: equal within 1% on an H200, docs/benchmarks.md), but a run also holds what is outside the step: the next
batch being put on the devices, the evaluation's encode programs between steps (their own temporaries beside
the train state), cuDNN's workspace (sized on the device, not in a compile) and the allocator's fragmentation.
On an 80 GB H100 the margin is 8 GB, a few times what those need at the paper's shapes.

Every process of a job must compile the same program: each chooses for its own devices, then all take the most
recompute any of them needs.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import Callable

import jax

from infjax.models import remat as remat_lib
from infjax.runtime import distributed

log = logging.getLogger("infjax")

MARGIN = 0.10


@dataclasses.dataclass
class Tried:
    policy: str
    peak: int | None            # bytes per device; None where the compiler refused (e.g. TPU HBM exceeded)
    refused: str | None
    step: Callable | None = None
    compiled: object | None = None


@dataclasses.dataclass
class Choice:
    policy: str
    tried: list[Tried]
    capacity: int
    line: str

    @property
    def chosen(self) -> Tried:
        return next(t for t in self.tried if t.policy == self.policy)


def device_memory(device) -> int:
    """Bytes that one device's allocator may hold (`memory_stats()["bytes_limit"]`: on a GPU, JAX's memory
    fraction of it); a CPU device has no such limit and gets the host's RAM divided among its local devices."""
    stats = None
    try:
        stats = device.memory_stats()
    except Exception:    # noqa: BLE001 - a platform without memory statistics
        stats = None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(ram // max(jax.local_device_count(), 1))


def capacity(memory_gb: float, device) -> int:
    """`model.remat_memory_gb` in bytes, or the device's own when it is 0."""
    return int(memory_gb * 1e9) if memory_gb else device_memory(device)


def size(b: int | float) -> str:
    """Bytes with at least two significant digits: 38.7 GB, 0.52 GB, 4.1 MB, 917 kB, 12 B."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= 0.1 * scale or unit == "kB" and b >= scale:
            value = b / scale
            return f"{value:.{1 if value >= 1 else 2}f} {unit}"
    return f"{int(b)} B"


def _gb(b: int | None) -> str:
    return "refused by the compiler" if b is None else size(b)


def fits(tried: Tried, capacity_bytes: int) -> bool:
    return tried.refused is None and tried.peak is not None and tried.peak <= (1 - MARGIN) * capacity_bytes


def choose(compile_policy: Callable[[str], Tried], capacity_bytes: int,
           policies: tuple[str, ...] = remat_lib.RECOMPUTE_ORDER, agree: Callable[[int], int] | None = None) -> Choice:
    """The first of `policies` whose step, compiled by `compile_policy`, fits `capacity_bytes` less MARGIN.

    The policies come least recompute first, each keeping less than the one before. They are compiled from the last
    (the least memory) back until one does not fit: the policies a large model needs are found in a compile or two, and
    a program far over the memory (which XLA's own rematerialisation works long on) is compiled at most once. None
    fitting, the last is taken and the line says so: the run may still fail to allocate. `agree(index) -> index` makes
    every process take the same (default: the most recompute any process needs)."""
    agree = agree or distributed.max_over_processes
    tried: dict[int, Tried] = {}
    index = len(policies) - 1
    for i in range(len(policies) - 1, -1, -1):
        tried[i] = compile_policy(policies[i])
        if not fits(tried[i], capacity_bytes):
            break
        index = i
    index = int(agree(index))
    if index not in tried:                    # (the most recompute any process needs: this one compiled it)
        tried[index] = compile_policy(policies[index])
    chosen = tried[index]
    over = [tried[i] for i in sorted(tried) if i < index]
    others = "; ".join(f"{t.policy} needs {_gb(t.peak) if t.refused is None else 'more (' + t.refused[:80] + ')'}"
                       for t in over)
    limit = f"{size(capacity_bytes)} less {MARGIN:.0%}"
    line = f"remat: {chosen.policy} (peak {_gb(chosen.peak)} of {limit}" + (f"; {others})" if others else ")")
    if not fits(chosen, capacity_bytes):
        line += ": no policy fits; the step may fail to allocate (fewer rows per device, fsdp or LoRA need less)"
    return Choice(chosen.policy, [tried[i] for i in sorted(tried)], capacity_bytes, line)


class Precompiled:
    """A jitted step that runs `compiled` for the batch shape it was compiled for (the widest, which `auto`
    compiled to choose), and compiles the others as jit does."""

    def __init__(self, step, compiled, example_batch, policy: str, line: str = ""):
        self._step, self._compiled, self.policy, self.line = step, compiled, policy, line
        self._key = _shapes(example_batch)

    def compiled_for(self, batch):
        """The program compiled for `batch`'s shape, if it is the one `auto` compiled; else None."""
        return self._compiled if _shapes(batch) == self._key else None

    def __call__(self, state, batch):
        compiled = self.compiled_for(batch)
        return compiled(state, batch) if compiled is not None else self._step(state, batch)

    def __getattr__(self, name):              # lower, trace, ...: the jitted step's
        return getattr(self._step, name)


def _shapes(batch) -> tuple:
    return tuple((tuple(x.shape), str(x.dtype)) for x in jax.tree.leaves(batch))
