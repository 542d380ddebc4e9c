"""Multi-host start-up, agreement across processes, and the watch of the other processes.

Start-up: `initialize()` reads the job's layout from the environment (`infjax/runtime/clusters.py`: SLURM's
srun, Open MPI's mpirun, TPU pods, `INFJAX_COORDINATOR`, or one process), gives `jax.distributed.initialize` the
devices this process owns, once, before any device is used, and logs one start-up line on every process: the
cluster, process i of N, its local devices and the global count. What cannot work stops there in one line
naming the change to make (exit status 2), before any work.

One job: processes that meet at one coordinator must be one job. Process 0 claims the coordinator's port first
(`infjax/runtime/ports.py`); once connected, every process compares what must be alike (`job_identity`: the
config and workdir, the launch id, the process count) and its device count, and all refuse with the same line
naming what differs.

Waiting: a line every minute or so (a quarter of the timeout when that is shorter) with the time waited, the
timeout and what this process can tell (`Waiting`). INFJAX_INIT_TIMEOUT (seconds, default 30 min: the hosts of
a large job start minutes apart) ends the wait with one infjax line and exit status 3, before the runtime's own
abort.

A process that stops: the others say so in one line rather than wait in a collective for it. `all_or_none` ends
the start-up of every process when one could not start; `lost_process` recognises the error a collective raises
when another process is gone; `PeerWatch` ends this process when a peer has given no sign of life for
INFJAX_PEER_TIMEOUT seconds (default 60; each process writes a counter into the coordination service every few
seconds), before JAX's own heartbeat timeout would abort it with a C++ dump, in a line naming what to resume from
(`on_lost`). `leave` ends a process without the runtime's shutdown, which would wait for the lost process and
abort. CPU processes exchange collectives through gloo.
"""
from __future__ import annotations

import atexit
import collections
import contextlib
import json
import logging
import os
import re
import sys
import threading
import time

import jax
import numpy as np
from jax._src import cloud_tpu_init, distributed as jax_distributed   # what JAX found and connected

from infjax import errors
from infjax.runtime import clusters, cpu as runtime_cpu, platform, ports

log = logging.getLogger("infjax.distributed")

DEFAULT_TIMEOUT_S = 1800
DEFAULT_PEER_TIMEOUT_S = 60
JAX_MIN_HEARTBEAT_S = 100         # JAX's default heartbeat timeout; infjax's own peer timeout stays below it
EXIT_NOT_STARTED = errors.RunStopped.exit_code


MAX_TIMEOUT_S = 7 * 24 * 3600    # a week: more is a slip of the keyboard, and JAX takes its timeouts as C++ ints


def _seconds(env, key: str, default: int) -> int:
    text = env.get(key)
    if text is None:
        return default
    m = re.fullmatch(r"\s*([0-9]+)\s*", text)
    if m is None or not 1 <= int(m.group(1)) <= MAX_TIMEOUT_S:
        raise clusters.ClusterError(f"{key}={text!r}: expected a whole number of seconds from 1 to {MAX_TIMEOUT_S} "
                                    f"(7 days)")
    return int(m.group(1))


def on_cloud_tpu_vm() -> bool:
    """Whether JAX found a Cloud TPU VM (libtpu and TPU chips) when it was imported."""
    return bool(getattr(cloud_tpu_init, "running_in_cloud_tpu_vm", False))


def _ranges(ids) -> str:
    """[0, 1, 2, 3, 8] -> "0-3,8"."""
    ids, out = sorted(ids), []
    for i in ids:
        if out and out[-1][1] == i - 1:
            out[-1][1] = i
        else:
            out.append([i, i])
    return ",".join(f"{a}-{b}" if b > a else f"{a}" for a, b in out)


def _kinds(devices) -> str:
    """"8 x NVIDIA H100 80GB HBM3", or several kinds joined by commas."""
    return ", ".join(f"{n} x {k}" for k, n in collections.Counter(d.device_kind for d in devices).items())


def _minutes(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    return f"{seconds // 60} min" + (f" {seconds % 60} s" if seconds % 60 else "")


class Waiting:
    """The lines of a process waiting in `jax.distributed.initialize` for the others (what it can tell)."""

    def __init__(self, layout: clusters.Layout, timeout: int, probe=ports.answers):
        self.layout, self.timeout, self.probe = layout, timeout, probe
        self.interval = max(1.0, min(60.0, timeout / 4))

    def _where(self) -> str:
        lay = self.layout
        if lay.jax_detects:
            return "JAX finds the coordinator itself and does not say which processes have connected"
        if lay.process_id == 0:
            others = "whether process 1 has" if lay.num_processes == 2 else \
                f"which of the other {lay.num_processes - 1} have"
            return f"this process hosts the coordinator on {lay.coordinator}; JAX does not say {others} connected"
        state = "answers" if self.probe(lay.coordinator) else "does not answer yet"
        return f"process 0's coordinator at {lay.coordinator} {state}"

    def _who(self) -> str:
        lay = self.layout
        if lay.jax_detects:
            return "this process"
        return f"process {lay.process_id} of {lay.num_processes}"

    def progress(self, waited: float) -> str:
        return (f"{self._who()} has waited {_minutes(waited)} of INFJAX_INIT_TIMEOUT={_minutes(self.timeout)} for "
                f"the other processes of the job; {self._where()}")

    def timed_out(self) -> str:
        lay = self.layout
        if lay.jax_detects:
            missing = "not every process of the job connected"
        elif lay.process_id == 0:
            others = "process 1" if lay.num_processes == 2 else \
                f"some of processes 1-{lay.num_processes - 1} (JAX does not say which)"
            missing = f"{others} never connected to this process's coordinator on {lay.coordinator}"
        elif self.probe(lay.coordinator):
            missing = f"process 0's coordinator at {lay.coordinator} answers, but not every process connected"
        else:
            missing = f"process 0 never answered at {lay.coordinator}"
        return (f"{self._who()} gave up after INFJAX_INIT_TIMEOUT={_minutes(self.timeout)}: {missing}. Check that "
                f"every process of the job was started (srun/mpirun/launch scripts start all of them; their logs "
                f"say why one stopped), that they agree on the coordinator and reach it, and raise "
                f"INFJAX_INIT_TIMEOUT if hosts start minutes apart")


@contextlib.contextmanager
def _visible_wait(waiting: Waiting, clock=time.monotonic):
    """Inside: `jax.distributed.initialize`, its wait made visible and bounded.

    A line every `waiting.interval` s; at the timeout, one line and exit status 3 (before the runtime's own
    timeout, which aborts with a C++ dump).
    """
    done = threading.Event()
    start = clock()

    def watch():
        while not done.wait(max(0.1, min(waiting.interval, waiting.timeout - (clock() - start)))):
            waited = clock() - start
            if waited >= waiting.timeout:
                _stop_now(waiting.timed_out(), EXIT_NOT_STARTED)
                return
            log.warning("%s", waiting.progress(waited))

    thread = threading.Thread(target=watch, name="infjax-start-up", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()


def initialize(env=None, job: dict | None = None) -> dict:
    """Join this process's job (if it is one) and log the start-up line; returns the process and device counts.

    `job`: what every process of one job has alike (infjax.train: the resolved config and the workdir; default:
    the command line's arguments). Raises ClusterError (exit status 2, one line) where the environment describes
    a job that cannot start, or where the processes that met are not one job.
    """
    env = os.environ if env is None else env
    timeout = _seconds(env, "INFJAX_INIT_TIMEOUT", DEFAULT_TIMEOUT_S)
    peer_timeout = _seconds(env, "INFJAX_PEER_TIMEOUT", DEFAULT_PEER_TIMEOUT_S)
    layout = clusters.layout(env, on_cloud_tpu_vm())
    identity = job_identity(layout, job)
    if layout.distributed and not jax.distributed.is_initialized():
        runtime_cpu.use_collectives(env)
        ports.claim_coordinator_port(layout, identity, env, stop=_stop_now)
        with _visible_wait(Waiting(layout, timeout)):
            ports.await_own_coordinator(layout, identity, env, timeout)
            # JAX's own timeouts lie beyond infjax's, so that infjax's line comes first
            jax.distributed.initialize(initialization_timeout=timeout + 120,
                                       heartbeat_timeout_seconds=max(JAX_MIN_HEARTBEAT_S, peer_timeout + 60),
                                       **layout.jax_arguments())
        ports.started()
    info = dict(process_index=jax.process_index(), process_count=jax.process_count(),
                local_devices=jax.local_device_count(), global_devices=jax.device_count(),
                platform=platform.name(), cluster=layout.describe())
    if jax.process_count() > 1 and jax.distributed.is_initialized():
        agree_on_job(layout, identity, timeout)          # before any collective: unequal devices would break it
    with all_or_none("at start-up"):
        check_allocation(layout, jax.local_device_count())
    log.info("%s", start_up_line(layout))
    if jax.process_count() > 1 and jax.distributed.is_initialized():
        _watch_peers(peer_timeout)
    return info


# ---- one job is one job: what the processes that met have alike -----------------------------------------

_PROCESS_COUNT = {"INFJAX_COORDINATOR": "INFJAX_NUM_PROCESSES", "SLURM": "SLURM_NTASKS",
                  "Open MPI": "OMPI_COMM_WORLD_SIZE"}


def job_identity(layout: clusters.Layout, job: dict | None) -> dict:
    """What every process of this job must have alike: `job` (or the command line), the launcher's id of the job
    where it gives one, and the process count this process was given."""
    identity = dict(job) if job is not None else {"arguments": sys.argv[1:]}
    if layout.launch:
        identity["launch"] = layout.launch
    if layout.num_processes is not None:
        identity[_PROCESS_COUNT.get(layout.kind, "process count")] = layout.num_processes
    return identity


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _who_has(values: dict[int, object]) -> str:
    """{0: "a", 1: "b", 2: "a"} -> "process 0, 2: 'a'; process 1: 'b'"."""
    groups: dict[str, list[int]] = {}
    for p, v in sorted(values.items()):
        groups.setdefault(json.dumps(v, sort_keys=True, default=str), []).append(p)
    parts = []
    for text, ps in groups.items():
        shown = repr(json.loads(text))
        parts.append(f"process {', '.join(map(str, ps))}: {shown[:80] + '...' if len(shown) > 80 else shown}")
    return "; ".join(parts)


def disagreement(identities: dict[int, dict], layout: clusters.Layout) -> str | None:
    """The line that refuses processes which met at one coordinator but do not have `job_identity` alike (two
    jobs on one port, or processes started with other flags); None where they agree."""
    flat = {p: _flat(i) for p, i in identities.items()}
    keys = sorted(set().union(*flat.values()), key=lambda k: (not k.startswith(("launch", "workdir")), k))
    differ = [k for k in keys
              if len({json.dumps(f.get(k, "<unset>"), sort_keys=True, default=str) for f in flat.values()}) > 1]
    if not differ:
        return None
    shown = [f"{k} ({_who_has({p: f.get(k, '<unset>') for p, f in flat.items()})})" for k in differ[:3]]
    more = f" and {len(differ) - 3} more" if len(differ) > 3 else ""
    at = f" at {layout.coordinator}" if layout.coordinator else ""
    return (f"the {len(identities)} processes that met at the coordinator{at} are not one job: they differ in "
            f"{', '.join(shown)}{more}. Either two jobs share the coordinator's port: {ports.port_fix(layout)}; or the "
            f"processes of one job were started with different flags or variables: start every process of a job "
            f"with the same config, workdir and process count")


def unequal_devices(counts: dict[int, int], layout: clusters.Layout) -> str | None:
    """The line that refuses processes with unequal local device counts (every process builds an equal slice of
    each batch); None where all have the same."""
    if len(set(counts.values())) <= 1:
        return None
    groups: dict[int, list[int]] = {}
    for p, n in sorted(counts.items()):
        groups.setdefault(n, []).append(p)
    said = "; ".join(f"process {', '.join(map(str, ps))} {'has' if len(ps) == 1 else 'have'} {n} device(s)"
                     + (" each" if len(ps) > 1 else "") for n, ps in groups.items())
    fix = {"SLURM": "the same number of tasks on every node (--ntasks-per-node, not --ntasks alone) and of GPUs per "
                    "node, or --gpus-per-task",
           "Open MPI": "the same number of ranks on every node (--npernode) and of GPUs per node",
           "INFJAX_COORDINATOR": "the same number of devices to every process (CUDA_VISIBLE_DEVICES, "
                                 "JAX_LOCAL_DEVICE_IDS; launch/local.sh: INFJAX_LOCAL_DEVICES)"}.get(
        layout.kind, "hosts with the same number of devices")
    return (f"the processes of this job have unequal device counts ({said}); every process takes an equal slice of "
            f"each batch, so each needs the same number of devices: give {fix}")


def agree_on_job(layout: clusters.Layout, identity: dict, timeout: int) -> None:
    """Right after connecting, before any collective: every process posts its identity and device count in the
    coordination service and reads everyone's; all reach the same verdict and refuse with the same line."""
    client = getattr(jax_distributed.global_state, "client", None)
    if client is None:
        return
    me, n = jax.process_index(), jax.process_count()
    mine = {"job": identity, "devices": jax.local_device_count()}
    try:
        client.key_value_set(f"infjax/start/{me}", json.dumps(mine, sort_keys=True, default=str))
        client.wait_at_barrier("infjax/start", min(timeout, 2**31 // 1000 - 1) * 1000)
        records = {int(k.rsplit("/", 1)[1]): json.loads(v) for k, v in client.key_value_dir_get("infjax/start/")}
    except Exception as e:  # noqa: BLE001 - the runtime's error is reported in one line
        first = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
        raise ProcessStopped(f"not every process of the job reached the start-up check within INFJAX_INIT_TIMEOUT="
                             f"{_minutes(timeout)} (one stopped: its log says why): {first[:200]}") from None
    if sorted(records) != list(range(n)):
        raise ProcessStopped(f"the start-up check found processes {sorted(records)} of {n}")
    line = disagreement({p: r["job"] for p, r in records.items()}, layout) or \
        unequal_devices({p: r["devices"] for p, r in records.items()}, layout)
    if line:
        raise clusters.ClusterError(line)


def check_allocation(layout: clusters.Layout, local_devices: int) -> None:
    """Stop where the scheduler gave this process more or fewer GPUs than JAX shows it."""
    if layout.allocated is None or layout.allocated == local_devices:
        return
    kinds = _kinds(jax.local_devices())
    if platform.name() == "cpu":
        fix = ("JAX runs on the CPU here: install JAX for CUDA (pip install -e \".[gpu]\"); for a CPU rehearsal, "
               f"--xla_force_host_platform_device_count={layout.allocated} in XLA_FLAGS")
    else:
        fix = ("check CUDA_VISIBLE_DEVICES and JAX_LOCAL_DEVICE_IDS, and that the launch gives each task the GPUs "
               "it names (launch/slurm_gpu.sbatch, launch/slurm_gpu_per_task.sbatch)")
    ids = f", JAX given local_device_ids {_ranges(layout.local_device_ids)}" if layout.local_device_ids else ""
    raise clusters.ClusterError(f"{layout.describe()} gave this process {layout.allocated} GPU(s) "
                                f"({layout.allocation}{ids}) but JAX shows {local_devices} local device(s) "
                                f"({kinds}): {fix}")


def start_up_line(layout: clusters.Layout) -> str:
    """The start-up line: the cluster, process i of N, the coordinator, this process's devices, the count.

    E.g. "start-up: SLURM (srun, 1 task per node): process 1 of 2 (coordinator node1:61442); local devices
    8-15 (8 x NVIDIA H100 80GB HBM3; JAX given local_device_ids 0-7 of CUDA_VISIBLE_DEVICES=0,...,7); 16
    devices in all (gpu)".
    """
    local = jax.local_devices()
    kinds = _kinds(local)
    given = ""
    if layout.local_device_ids is not None:
        given = f"; JAX given local_device_ids {_ranges(layout.local_device_ids)}"
        if layout.allocation.startswith(clusters.CUDA_VISIBLE):
            given += f" of {layout.allocation}"
        elif layout.allocation:
            given += f" ({layout.allocation})"
    coordinator = ""
    if jax.process_count() > 1:
        address = getattr(jax_distributed.global_state, "coordinator_address", None)
        coordinator = f" (coordinator {address})" if address else ""
    return (f"start-up: {layout.describe()}: process {jax.process_index()} of {jax.process_count()}{coordinator}; "
            f"local devices {_ranges(d.id for d in local)} ({kinds}{given}); {jax.device_count()} devices in all "
            f"({platform.name()})")


def _gathered(value, dtype) -> np.ndarray:
    """`value` of every process, in process order (every process must call at the same point)."""
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(np.asarray([value], dtype))


def max_over_processes(value: int) -> int:
    """The largest `value` over all processes: an agreement (every process must call it at the same point
    of the program, e.g. once per training step). One process: `value` itself, with no communication."""
    if jax.process_count() == 1:
        return int(value)
    return int(np.max(_gathered(value, np.int32)))


def sum_over_processes(value: float) -> float:
    """The sum of `value` over all processes (float32 on the wire: for rates and counts where 7 significant
    digits are enough); the same calling rule as `max_over_processes`. One process: `value` itself."""
    if jax.process_count() == 1:
        return float(value)
    return float(np.sum(_gathered(value, np.float32), dtype=np.float64))


def barrier(name: str) -> None:
    """Wait until every process reaches the barrier `name` (nothing to do for one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


class ProcessStopped(errors.UserError):
    """Another process of the job could not start (its own log says why): this one stops too, before training."""


class ProcessLost(errors.RunStopped):
    """Another process of the job stopped (killed, crashed) while this one ran: it cannot go on alone."""


@contextlib.contextmanager
def all_or_none(what: str):
    """Inside: what every process does alone before its first collective; all go on, or all stop.

    Inside is what each process does alone (checking its config, reading its files). At the end every process
    learns whether all got through: one that failed reports its own error; the others raise ProcessStopped
    naming it, rather than waiting for it in their first collective (a timeout many minutes later). One
    process: nothing to agree.
    """
    if jax.process_count() == 1:
        yield
        return
    try:
        yield
    except BaseException:
        _gathered(1, np.int32)           # tell the others, then report this process's own error
        raise
    failed = np.flatnonzero(_gathered(0, np.int32)).tolist()
    if failed:
        raise ProcessStopped(f"process {', '.join(map(str, failed))} of {jax.process_count()} stopped {what} (its "
                             f"log says why), so this process stops too; nothing was started")


_LOST = ("gloo", "connection reset", "connection closed", "connection refused", "broken pipe", "heartbeat",
         "unavailable", "deadline_exceeded", "barrier", "coordination service", "task is set to error")


def lost_process(error: BaseException) -> str | None:
    """The first line of a runtime error that says another process of the job is gone (a collective or a
    barrier whose peer closed its connection or stopped answering), else None (one process: always None)."""
    if jax.process_count() == 1:
        return None
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, jax.errors.JaxRuntimeError):
            text = str(error)
            if any(marker in text.lower() for marker in _LOST):
                return next((line.strip() for line in text.splitlines() if line.strip()), type(error).__name__)
        error = error.__cause__ or error.__context__
    return None


# ---- one way out, and the watcher of the other processes ------------------------------------------------

_leaving = threading.Lock()       # held by the first thread that ends the process: one last line, not two
_explain = [lambda cause: f"another process of this job stopped ({cause}), so this one stops too"]
_watcher: list = []


def on_lost(explain) -> None:
    """`explain(cause)` -> the line to end with when the watcher finds another process gone (e.g. naming the
    last complete checkpoint)."""
    _explain[0] = explain


def leave(code: int) -> None:
    """End this process now with exit status `code`, its output flushed, without the runtime's shutdown:
    that shutdown waits at a barrier for every process, and with one gone it aborts with a C++ dump."""
    if not _leaving.acquire(blocking=False):      # another thread is already ending the process
        threading.Event().wait()
    _exit(code)


def _exit(code: int) -> None:
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _stop_now(line: str, code: int) -> None:
    """From a watcher thread: log `line` as this process's last and end it (unless another thread is)."""
    if not _leaving.acquire(blocking=False):
        return
    log.error("%s", line)
    _exit(code)


class PeerWatch:
    """The watch of the other processes: `lost(cause)` is called once when one of them is gone.

    Every `beat` s, writes this process's counter into the coordination service and reads the others': a
    process whose counter has not moved for `silent_after` s (and that did not finish) is gone, as is the
    coordination service when it stops answering for that long.
    """

    PREFIX = "infjax/alive/"

    def __init__(self, client, me: int, n: int, silent_after: float, lost, beat: float | None = None,
                 clock=time.monotonic):
        self.client, self.me, self.n, self.lost, self.clock = client, me, n, lost, clock
        self.silent_after = silent_after
        self.beat = beat if beat is not None else max(0.5, min(10.0, silent_after / 6))
        self.stopped = threading.Event()
        now = clock()
        self.last_change = {p: now for p in range(n) if p != me}
        self.values: dict[int, str] = {}
        self.failing_since: float | None = None
        self.count = 0

    def check(self) -> str | None:
        """One beat: write, read, judge. Returns the cause when a peer or the service is gone, else None."""
        now = self.clock()
        self.count += 1
        try:
            self.client.key_value_set(f"{self.PREFIX}{self.me}", str(self.count), allow_overwrite=True)
            values = {k[len(self.PREFIX):]: v for k, v in self.client.key_value_dir_get(self.PREFIX)}
        except Exception as e:  # noqa: BLE001 - the service itself is unreachable: judged by how long
            self.failing_since = self.failing_since if self.failing_since is not None else now
            if now - self.failing_since > self.silent_after:
                first = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
                return (f"the coordination service on process 0 has not answered for {_minutes(self.silent_after)}: "
                        f"{first.strip()[:200]}")
            return None
        self.failing_since = None
        silent = []
        for p in self.last_change:
            value = values.get(str(p))
            if value == "done":
                continue
            if value != self.values.get(p):
                self.values[p] = value
                self.last_change[p] = now
            elif now - self.last_change[p] > self.silent_after:
                silent.append(p)
        if silent:
            return (f"process {', '.join(map(str, silent))} of {self.n} gave no sign of life for "
                    f"{_minutes(self.silent_after)}")
        return None

    def run(self) -> None:
        while not self.stopped.wait(self.beat):
            cause = self.check()
            if cause is not None and not self.stopped.is_set():
                self.lost(cause)
                return

    def finish(self) -> None:
        """This process is done: the others stop watching it."""
        self.stopped.set()
        with contextlib.suppress(Exception):
            self.client.key_value_set(f"{self.PREFIX}{self.me}", "done", allow_overwrite=True)


def _watch_peers(silent_after: int) -> None:
    client = getattr(jax_distributed.global_state, "client", None)
    if client is None or _watcher:
        return
    watch = PeerWatch(client, jax.process_index(), jax.process_count(), silent_after,
                      lambda cause: _stop_now(_explain[0](cause), ProcessLost.exit_code))
    _watcher.append(watch)
    threading.Thread(target=watch.run, name="infjax-peers", daemon=True).start()
    atexit.register(watch.stopped.set)   # runs before JAX's shutdown (registered at import, so later)


def finished() -> None:
    """This process has done its part of the job (call at a normal end): the other processes stop watching
    it, so that one that still writes (process 0: eval.json) does not take its quiet for a loss."""
    for watch in _watcher:
        watch.finish()
