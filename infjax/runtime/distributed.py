"""Multi-host start-up: one call to `jax.distributed.initialize`, before any device is used.

- TPU pods and SLURM jobs: JAX detects the cluster itself (coordinator, process count and id).
- Elsewhere: INFJAX_COORDINATOR=host:port, INFJAX_NUM_PROCESSES, INFJAX_PROCESS_ID
  (e.g. launch/local.sh runs N CPU processes over 127.0.0.1).
- Otherwise: a single process; nothing to do.

The initialization timeout is long (default 30 min, INFJAX_INIT_TIMEOUT seconds) because the
hosts of a large job start minutes apart. CPU processes exchange collectives through gloo.

When one process stops, the others must say so in one line rather than wait in a collective for it:
`all_or_none` ends the start-up of every process when one of them could not start, and `lost_process`
recognises the error a collective raises when another process is gone (`leave` then ends this one
without the runtime's shutdown, which would wait for the lost process and abort with a C++ dump).
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys

import jax
import numpy as np

from infjax import errors
from infjax.runtime import cpu as runtime_cpu, platform

log = logging.getLogger("infjax.distributed")

DEFAULT_TIMEOUT_S = 1800


def _cluster_detected(env) -> bool:
    slurm = int(env.get("SLURM_NTASKS", env.get("SLURM_NPROCS", "1")) or 1) > 1 and "SLURM_JOB_ID" in env
    tpu_pod = len([h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]) > 1
    return slurm or tpu_pod


def initialize(env=None) -> dict:
    """Start the multi-process runtime if this is one; returns and logs the process and device counts."""
    env = os.environ if env is None else env
    timeout = int(env.get("INFJAX_INIT_TIMEOUT", DEFAULT_TIMEOUT_S))
    if "INFJAX_COORDINATOR" in env:
        kwargs = dict(coordinator_address=env["INFJAX_COORDINATOR"],
                      num_processes=int(env["INFJAX_NUM_PROCESSES"]), process_id=int(env["INFJAX_PROCESS_ID"]))
    elif _cluster_detected(env):
        kwargs = {}
    else:
        kwargs = None
    if kwargs is not None and not jax.distributed.is_initialized():
        runtime_cpu.use_collectives(env)
        jax.distributed.initialize(initialization_timeout=timeout, **kwargs)
    info = dict(process_index=jax.process_index(), process_count=jax.process_count(),
                local_devices=jax.local_device_count(), global_devices=jax.device_count(),
                platform=platform.name())
    log.info("process %(process_index)d of %(process_count)d: %(local_devices)d local devices, "
             "%(global_devices)d global devices (%(platform)s)", info)
    return info


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


def leave(code: int) -> None:
    """End this process now with exit status `code`, its output flushed, without the runtime's shutdown:
    that shutdown waits at a barrier for every process, and with one gone it aborts with a C++ dump."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)
