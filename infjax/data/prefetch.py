"""Prefetch: the steps of a run assembled ahead of the loop, in background workers, and the loop's waits timed.

The loader is grain's (the JAX ecosystem's, maxtext's): a `MapDataset` over the
step numbers, mapped by `BatchBuilder.assemble`. Random access by step fits the
batches: each is a pure function of (seed, step), so any worker builds any
step, a resume starts at its step, and the batches are the same whoever built
them (tests/data/test_prefetch.py). grain keeps the order of the steps, bounds
what is built ahead, and re-raises a worker's error in the loop.

Where: `data.step_workers` worker processes (spawned, not forked: this process
runs JAX's threads; each maps the token store's files again), or 0: one
background thread of this process, enough where a step costs the host little
(the GIL is shared with the loop, which mostly waits for the device). -1
(auto) measures what a step costs to build here and takes as many processes
as build a step every `THREAD_MS` (at most the cores less one), or the thread
where that is fewer than two. `data.prefetch` steps are built ahead at most
(their arrays held in memory). A worker's arrays come back pickled through
grain's queue rather than in shared memory: a batch is a few MB, and on
this project's 2-core benchmark machine that waited less (2026-11-28, when
the pipeline was written, commit 1677518; its timings are not in the
repository); a segment queued as the stream closes cannot outlive it either.

`StepStream` yields (step, batch, info) and adds up the time the loop spent
waiting for them (`waited`): the step lines' "data wait" share.
"""
from __future__ import annotations

import dataclasses
import gc
import logging
import math
import os
import signal
import threading
import time

import numpy as np

from infjax.data.batches import BatchBuilder
from infjax.data.token_store import cores

log = logging.getLogger("infjax.data")

THREAD_MS = 10.0      # a step that costs the host less than this to build is built by one thread (auto)
SHARED_MEMORY_NEVER = 1 << 62     # grain's min_shm_size: no array is that large


@dataclasses.dataclass(frozen=True)
class Assemble:
    """step -> (step, this process's batch, what the loop reports of it): the map of the step dataset."""

    build: BatchBuilder

    def __call__(self, step: int):
        batch, info = self.build.assemble(int(step))
        return int(step), batch, info


def _quiet_worker(index: int, count: int) -> None:
    """A worker process leaves signals to the loop's process, ends with it, and turns the tokenizer's threads off.

    The loop's process stops the run, then the workers; the cores are left to the other workers."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)       # a closed terminal signals the whole process group
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    threading.Thread(target=_exit_with, args=(os.getppid(),), daemon=True, name="infjax-parent-watch").start()


def _exit_with(parent: int, poll_s: float = 1.0) -> None:
    """End this worker once `parent` is gone (killed with -9, it stops no worker: they would outlive it)."""
    while os.getppid() == parent:
        time.sleep(poll_s)
    os._exit(0)


def step_cost(build: BatchBuilder, steps: list[int]) -> float:
    """Seconds this process takes to build one step (the median over `steps`)."""
    times = []
    for step in steps:
        t0 = time.perf_counter()
        build.assemble(step)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def choose_workers(build: BatchBuilder, requested: int, start: int, stop: int) -> tuple[int, str]:
    """(worker processes, why): `requested` when >= 0, else from what a step costs to build here."""
    if requested >= 0:
        return requested, f"data.step_workers={requested}"
    sample = list(range(start, min(stop, start + 4)))
    if not sample:
        return 0, "nothing to build"
    if len(sample) > 1:          # the first step pays for what the others find ready (caches, the files' pages)
        build.assemble(sample.pop(0))
    cost = step_cost(build, sample) * 1e3
    workers = min(math.ceil(cost / THREAD_MS), cores() - 1)
    if workers < 2:              # one process would do no more than the thread, and pay for the copies
        return 0, (f"a step costs {cost:.1f} ms to build here" + (f", under {THREAD_MS:g} ms" if cost < THREAD_MS
                                                                  else f"; {cores()} cores"))
    return workers, f"a step costs {cost:.1f} ms to build here; {cores()} cores"


class StepStream:
    """The batches of steps start .. stop-1 in order, built ahead by grain.

    `waited` is the time spent in `next` (the loop waiting for data), `built` the steps received. Close it (or
    use it as a context manager) to stop the workers."""

    def __init__(self, build: BatchBuilder, start: int, stop: int, workers: int = 0, ahead: int = 2):
        import grain
        from absl import flags

        if not flags.FLAGS.is_parsed():      # grain reads its options from absl's flags: their defaults here
            flags.FLAGS.mark_as_parsed()

        self.start, self.stop, self.workers, self.ahead = start, stop, workers, max(1, ahead)
        dataset = grain.MapDataset.range(start, stop).map(Assemble(build))
        if workers == 0:
            self._dataset = dataset.to_iter_dataset(grain.ReadOptions(num_threads=1,
                                                                      prefetch_buffer_size=self.ahead))
        else:
            per_worker = max(1, math.ceil(self.ahead / workers))
            local = dataset.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=1))
            # Arrays come back pickled through grain's queue, not in shared memory: a batch is a few MB, and a
            # segment a worker had queued when the stream closes would outlive it (a warning at exit).
            local = grain.experimental.WithOptionsIterDataset(
                local, grain.experimental.DatasetOptions(min_shm_size=SHARED_MEMORY_NEVER))
            self._dataset = local.mp_prefetch(
                grain.MultiprocessingOptions(num_workers=workers, per_worker_buffer_size=per_worker),
                worker_init_fn=_quiet_worker)
        self._iterator = None
        self.waited, self.built = 0.0, 0

    def __iter__(self):
        if self._iterator is None:
            self._iterator = iter(self._dataset)
        return self

    def __next__(self):
        t0 = time.perf_counter()
        try:
            item = next(self._iterator if self._iterator is not None else iter(self))
        finally:
            self.waited += time.perf_counter() - t0
        self.built += 1
        return item

    def close(self) -> None:
        """Stop the workers and drop what grain still holds."""
        close = getattr(self._iterator, "close", None)
        if close is not None:
            close()
        self._iterator = self._dataset = None
        gc.collect()

    def __enter__(self):
        return iter(self)

    def __exit__(self, *exc):
        self.close()
        return False

    def describe(self) -> str:
        where = ("a background thread" if self.workers == 0 else
                 f"{self.workers} worker process{'es' if self.workers > 1 else ''}")
        return f"steps {self.start + 1}-{self.stop} assembled ahead by {where}, at most {self.ahead} ahead"
