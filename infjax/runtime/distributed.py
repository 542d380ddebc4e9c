"""Multi-host start-up: one call to `jax.distributed.initialize`, before any device is used.

`initialize()` reads the job's layout from the environment (`infjax/runtime/clusters.py`: SLURM's srun, Open
MPI's mpirun, TPU pods, `INFJAX_COORDINATOR`, or one process), gives JAX the devices this process owns, and logs
one start-up line on every process: the cluster, process i of N, its local devices and the global count. What
cannot work stops there in one line naming the change to make (exit status 2), before any work.

Waiting for the other processes is visible: a line every minute or so (a quarter of the timeout when that is
shorter) with the time waited, the timeout and what this process can tell (whether process 0's coordinator
answers). INFJAX_INIT_TIMEOUT (seconds, default 30 min: the hosts of a large job start minutes apart) ends the
wait with one infjax line and exit status 3, before the runtime's own abort.

When one process stops, the others must say so in one line rather than wait in a collective for it:
`all_or_none` ends the start-up of every process when one of them could not start, `lost_process` recognises
the error a collective raises when another process is gone, and a watcher thread ends this process when a peer
has given no sign of life for INFJAX_PEER_TIMEOUT seconds (default 60; each process writes a counter into the
coordination service every few seconds), before JAX's own heartbeat timeout would abort it with a C++ dump. The
line names what to resume from (`on_lost`). `leave` ends a process without the runtime's shutdown, which would
wait for the lost process and abort. CPU processes exchange collectives through gloo.
"""
from __future__ import annotations

import atexit
import collections
import contextlib
import logging
import os
import socket
import sys
import threading
import time

import jax
import numpy as np
from jax._src import cloud_tpu_init, distributed as jax_distributed   # what JAX found and connected

from infjax import errors
from infjax.runtime import clusters, cpu as runtime_cpu, platform

log = logging.getLogger("infjax.distributed")

DEFAULT_TIMEOUT_S = 1800
DEFAULT_PEER_TIMEOUT_S = 60
JAX_MIN_HEARTBEAT_S = 100         # JAX's default heartbeat timeout; infjax's own peer timeout stays below it
EXIT_NOT_STARTED = errors.RunStopped.exit_code


def _seconds(env, key: str, default: int) -> int:
    text = env.get(key, str(default))
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise clusters.ClusterError(f"{key}={text!r}: expected a whole number of seconds >= 1")
    return value


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


def _answers(address: str, timeout: float = 2.0) -> bool:
    """Whether something accepts TCP connections at host:port."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


def _minutes(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    return f"{seconds // 60} min" + (f" {seconds % 60} s" if seconds % 60 else "")


class Waiting:
    """The lines of a process waiting in `jax.distributed.initialize` for the others (what it can tell)."""

    def __init__(self, layout: clusters.Layout, timeout: int, probe=_answers):
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
    """Inside: `jax.distributed.initialize`. A line every `waiting.interval` s; at the timeout, one line and
    exit status 3 (before the runtime's own timeout, which aborts with a C++ dump)."""
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


def initialize(env=None) -> dict:
    """Join this process's job (if it is one) and log the start-up line; returns the process and device counts.
    Raises ClusterError (exit status 2, one line) where the environment describes a job that cannot start."""
    env = os.environ if env is None else env
    timeout = _seconds(env, "INFJAX_INIT_TIMEOUT", DEFAULT_TIMEOUT_S)
    peer_timeout = _seconds(env, "INFJAX_PEER_TIMEOUT", DEFAULT_PEER_TIMEOUT_S)
    layout = clusters.layout(env, on_cloud_tpu_vm())
    if layout.distributed and not jax.distributed.is_initialized():
        runtime_cpu.use_collectives(env)
        with _visible_wait(Waiting(layout, timeout)):
            # JAX's own timeouts lie beyond infjax's, so that infjax's line comes first
            jax.distributed.initialize(initialization_timeout=timeout + 120,
                                       heartbeat_timeout_seconds=max(JAX_MIN_HEARTBEAT_S, peer_timeout + 60),
                                       **layout.jax_arguments())
    info = dict(process_index=jax.process_index(), process_count=jax.process_count(),
                local_devices=jax.local_device_count(), global_devices=jax.device_count(),
                platform=platform.name(), cluster=layout.describe())
    with all_or_none("at start-up"):
        check_allocation(layout, jax.local_device_count())
    log.info("%s", start_up_line(layout))
    if jax.process_count() > 1 and jax.distributed.is_initialized():
        _watch_peers(peer_timeout)
    return info


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
    """E.g. "start-up: SLURM (srun, 1 task per node): process 1 of 2 (coordinator node1:61442); local devices
    8-15 (8 x NVIDIA H100 80GB HBM3; JAX given local_device_ids 0-7 of CUDA_VISIBLE_DEVICES=0,...,7); 16
    devices in all (gpu)"."""
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
    """Inside: what every process does alone before its first collective (checking its config, reading its
    files). At the end every process learns whether all got through: one that failed reports its own error;
    the others raise ProcessStopped naming it, rather than waiting for it in their first collective (a
    timeout many minutes later). One process: nothing to agree."""
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
    """Every `beat` s, writes this process's counter into the coordination service and reads the others':
    a process whose counter has not moved for `silent_after` s (and that did not finish) is gone, as is the
    coordination service when it stops answering for that long. `lost(cause)` is then called once."""

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
