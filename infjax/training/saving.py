"""Saving a run's checkpoints, and the one line a run that stops leaves: the checkpoint to resume from.

A save that cannot be made (too little free disk, a failed write, this one's or the previous asynchronous
one's) stops the run with `CheckpointSaveError` naming the last complete checkpoint (`last_complete`). A
collective whose peer process is gone becomes `ProcessLost`, named the same way (`lost_process_stops`).
"""
from __future__ import annotations

import contextlib
import logging

import jax

from infjax import errors
from infjax.runtime import checkpoint, distributed
from infjax.training import state as state_lib

log = logging.getLogger("infjax.train")      # the lines of the training run


class CheckpointSaveError(errors.RunStopped):
    """A checkpoint could not be written (e.g. the disk is full); the message names the last complete one."""


def save_checkpoint(ckpts: checkpoint.Checkpoints, step: int, state, position: dict, config_json: dict) -> None:
    """Save `step` (asynchronously by default), or stop the run naming the last complete checkpoint.

    Too little free disk for one more checkpoint, or a failed write (this one's or the previous asynchronous
    one's), stops the run with one message naming the last complete checkpoint.
    """
    try:
        ckpts.finish()     # the previous save must land before free space means anything (Orbax waits anyway)
    except Exception as e:  # noqa: BLE001 - it failed: say so, with its own message
        raise _save_failed(ckpts, ckpts.pending, e) from e
    state = state_lib.savable(state)      # LoRA: the adapters and their moments; the base is its own checkpoint
    needed, free = checkpoint.state_bytes(state), checkpoint.free_bytes(ckpts.directory)
    if free < needed:
        raise CheckpointSaveError(
            f"cannot save checkpoint {step} in {ckpts.directory}: {errors.byte_size(free)} free on its disk, one "
            f"checkpoint needs about {errors.byte_size(needed)}; {last_complete(ckpts, ' once there is room')}")
    try:
        ckpts.save(step, state, position, config_json)
    except Exception as e:  # noqa: BLE001 - Orbax wraps I/O errors in its own types
        raise _save_failed(ckpts, step, e) from e      # the previous save landed in finish(): the error is step's


def poll_saves(ckpts: checkpoint.Checkpoints) -> None:
    """Between steps: stop the run now if a background save failed (not at the next save)."""
    try:
        ckpts.poll()
    except Exception as e:  # noqa: BLE001
        raise _save_failed(ckpts, ckpts.pending, e) from e


def close_checkpoints(ckpts: checkpoint.Checkpoints, quiet: bool = False) -> None:
    """Wait for the last asynchronous save and close the manager (idempotent).

    `quiet`: an error is already on its way up (only log a failed save).
    """
    try:
        ckpts.close()
    except Exception as e:  # noqa: BLE001
        if not quiet:
            raise _save_failed(ckpts, ckpts.pending, e) from e
        log.error("%s", _save_failed(ckpts, ckpts.pending, e))


def _save_failed(ckpts: checkpoint.Checkpoints, step: int | None, error: Exception) -> errors.RunStopped:
    lost = distributed.lost_process(error)
    if lost is not None:            # another process is gone: closing the manager would wait for it
        return lost_error(ckpts, f"while checkpoint {step} was saved: {lost}")
    cause = error
    while cause.__cause__ is not None or cause.__context__ is not None:   # Orbax wraps the OSError
        if isinstance(cause, OSError):
            break
        cause = cause.__cause__ or cause.__context__
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)   # the failed writes' orphaned futures, at exit
    try:
        ckpts.close()         # let the background writers stop before their folders are removed
    except Exception:  # noqa: BLE001, S110 - the same failure, reported here
        pass
    removed = ckpts.remove_partial() if jax.process_index() == 0 else []
    return CheckpointSaveError(
        f"saving checkpoint{f' {step}' if step is not None else ''} in {ckpts.directory} failed: "
        f"{errors.describe(cause)}"
        + (f"; removed its unfinished folder(s) {removed}" if removed else "")
        + f"; {last_complete(ckpts, ' once there is room')}")


@contextlib.contextmanager
def lost_process_stops(ckpts: checkpoint.Checkpoints):
    """Inside: a collective or barrier whose peer process is gone raises one line, ProcessLost.

    The error of a collective or barrier whose peer is gone (killed, crashed) becomes ProcessLost naming the
    last complete checkpoint (not a traceback, then a C++ dump at exit).
    """
    try:
        yield
    except distributed.ProcessLost:
        raise
    except Exception as e:  # noqa: BLE001 - only a lost process is reworded; anything else goes up as it is
        cause = distributed.lost_process(e)
        if cause is None:
            raise
        raise lost_error(ckpts, cause) from e


def lost_error(ckpts: checkpoint.Checkpoints, cause: str) -> distributed.ProcessLost:
    """The error of this process when another one of the job stopped (`cause`)."""
    return distributed.ProcessLost(f"another process of this job stopped ({cause}), so this one stops too; "
                                   f"{last_complete(ckpts)}")


def last_complete(ckpts: checkpoint.Checkpoints, when: str = "") -> str:
    """Which checkpoint a run that stops leaves to resume from, read from the files (no collective)."""
    last = ckpts.complete_steps()
    if not last:
        return "no checkpoint of this run is complete"
    return (f"the last complete checkpoint is {ckpts.step_dir(last[-1])} (resume from it with "
            f"--config.resume=True{when})")
