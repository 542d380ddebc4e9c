"""Where a step's time goes: a `jax.profiler` trace of a few steps, summarised by kernel.

    summary = profile.profile_steps(step, state, batches, folder)      # runs and traces the steps
    summary["top"]             # the kernels that took the most device time, per step
    summary["kernel_share"]    # the kernels' time against the step's wall time

JAX writes the trace in the Chrome trace-event format (`perfetto_trace.json.gz`): "X" events with a name, a
start and a duration in microseconds, on threads of processes named by metadata events. A GPU's kernels are
the events of its "/device:GPU:N" process on its stream threads, a TPU's the events of "/device:TPU:N" on its
"XLA Ops" thread; a CPU has no device process, and its kernels are the thunks XLA:CPU runs on its client
threads (the runtime's own bookkeeping spans, named "Class::Method" or "end: ...", are not kernels). Kernel time
summed over streams that overlap can exceed the wall time; a share well below 1 is time the device waited
(launches, host work, synchronisation).
"""
from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import time

import jax

TOP = 15
# Threads of a device process that hold spans, not kernels (they would count each kernel twice).
_SPAN_THREADS = re.compile(r"XLA Modules|Steps|XLA TraceMe|Framework|Source|Launch Stats|Host", re.IGNORECASE)
_KERNEL_THREADS = re.compile(r"Stream|XLA Ops|Ops", re.IGNORECASE)
_CPU_THREADS = re.compile(r"XLA|PjRt|Eigen", re.IGNORECASE)
_BOOKKEEPING = re.compile(r"::|^end: |^\$")


def read_trace(folder: str) -> list[dict]:
    """The events of the newest trace JAX wrote under `folder` (its perfetto_trace.json.gz)."""
    paths = sorted(glob.glob(os.path.join(folder, "**", "perfetto_trace.json.gz"), recursive=True)
                   + glob.glob(os.path.join(folder, "**", "*.trace.json.gz"), recursive=True), key=os.path.getmtime)
    if not paths:
        raise FileNotFoundError(f"{folder}: no trace (perfetto_trace.json.gz) written")
    with gzip.open(paths[-1], "rt", encoding="utf-8") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def kernel_events(events: list[dict]) -> tuple[str, list[dict]]:
    """(where the kernels ran: "gpu", "tpu" or "cpu", the kernel events)."""
    processes = {e["pid"]: e.get("args", {}).get("name", "") for e in events
                 if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): e.get("args", {}).get("name", "") for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    devices = {pid: name for pid, name in processes.items() if name.startswith("/device:")}
    if devices:
        kind = "tpu" if any("TPU" in n for n in devices.values()) else "gpu"

        def is_kernel(e):
            thread = threads.get((e["pid"], e.get("tid")), "")
            return (e["pid"] in devices and not _SPAN_THREADS.search(thread)
                    and (bool(_KERNEL_THREADS.search(thread)) or not thread))
        return kind, [e for e in spans if is_kernel(e)]
    return "cpu", [e for e in spans if _CPU_THREADS.search(threads.get((e["pid"], e.get("tid")), ""))
                   and not _BOOKKEEPING.search(e["name"])]


def summarize(events: list[dict], steps: int, wall_s: float, top: int = TOP) -> dict:
    """The kernels of `steps` traced steps of `wall_s` seconds each (median): the `top` by time per step, their
    count per step, and the sum of every kernel's time against the wall time."""
    kind, kernels = kernel_events(events)
    total: collections.Counter = collections.Counter()
    count: collections.Counter = collections.Counter()
    for e in kernels:
        total[e["name"]] += float(e["dur"])
        count[e["name"]] += 1
    kernel_s = sum(total.values()) / 1e6 / steps
    rows = [{"name": name, "ms_per_step": us / 1e3 / steps, "calls_per_step": count[name] / steps,
             "share_of_kernel_time": us / 1e6 / steps / kernel_s if kernel_s else 0.0}
            for name, us in total.most_common(top)]
    return {"device": kind, "steps": steps, "wall_ms_per_step": wall_s * 1e3, "kernel_ms_per_step": kernel_s * 1e3,
            "kernels_per_step": len(kernels) / steps, "distinct_kernels": len(total),
            "kernel_share": kernel_s / wall_s if wall_s else None, "top": rows}


def profile_steps(step, state, batches: list, folder: str, shape=lambda b: None) -> tuple[object, dict]:
    """Run `step(state, batch)` on each batch under `jax.profiler.trace`; returns (new state, trace summary).

    The steps are compiled and warm already; the trace goes into `folder`, and the summary is `summarize` of it. `step`
    may be a dict of compiled steps keyed by `shape(batch)`."""
    pick = (lambda b: step[shape(b)]) if isinstance(step, dict) else (lambda b: step)
    times = []
    with jax.profiler.trace(folder, create_perfetto_trace=True):
        for b in batches:
            t0 = time.perf_counter()
            state, metrics = pick(b)(state, b)
            jax.block_until_ready((state, metrics))
            times.append(time.perf_counter() - t0)
    times.sort()
    return state, summarize(read_trace(folder), len(batches), times[len(times) // 2])


def table(summary: dict, top: int = TOP) -> str:
    """The summary as text lines: one per kernel, then the sum against the wall time."""
    lines = [f"  {r['ms_per_step']:9.3f} ms {r['calls_per_step']:7.1f} x  {r['name'][:100]}"
             for r in summary["top"][:top]]
    share = summary["kernel_share"]
    lines.append(f"  kernels {summary['kernel_ms_per_step']:.1f} ms of a {summary['wall_ms_per_step']:.1f} ms step"
                 + (f" ({100 * share:.0f}%)" if share is not None else "")
                 + f", {summary['kernels_per_step']:.0f} kernel runs per step ({summary['device']})")
    return "\n".join(lines)
