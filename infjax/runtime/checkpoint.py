"""Orbax checkpoints (current `args=` API): train state, data position and resolved config.

WORKDIR/checkpoints/<step>/{state, data, config}; WORKDIR may be an object-store URL
(training/storage.py). Orbax writes a step into a temporary folder and renames it
when complete (on gs://, where there is no rename, it writes COMMIT_FILE last), so a
save that was cut off is never listed as a step. Saves are asynchronous by default:
training goes on while the arrays are written; `close()` waits for the last one. Each save logs one line
when it is complete, with its duration and the part of it that held training up.
"""
from __future__ import annotations

import contextlib

import logging
import os
import shutil
import time
import uuid

import jax
import numpy as np
import orbax.checkpoint as ocp

from infjax import errors
from infjax.errors import UserError
from infjax.runtime import distributed, storage

log = logging.getLogger("infjax.checkpoint")


class CheckpointReadError(UserError, RuntimeError):
    """A checkpoint step exists but cannot be read; the message names its folder."""


def _one_line(error: BaseException) -> str:
    """The first line of an error (TensorStore's messages run to 20 lines), with its type.

    Orbax wraps a failed array read in an exception whose text is the array's whole TensorStore spec: the error inside
    it (which names the array, the file and what is wrong) is the one given."""
    if "TensorStore details" in str(error):
        inner = error
        while inner.__cause__ is not None or inner.__context__ is not None:
            inner = inner.__cause__ or inner.__context__
        error = inner
    first = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
    return f"{type(error).__name__}: {first[:400]}"


BEST_KEY = "best"       # the data position's record of checkpoint.keep_best: {"metric", "step", "value"}
COMMIT_FILE = "commit_success.txt"   # on gs://, Orbax marks a finished step with this file instead of a rename


def _finished(directory: str, name: str) -> bool:
    step_dir = storage.join(directory, name)
    if directory.startswith("gs://"):
        return storage.exists(storage.join(step_dir, COMMIT_FILE))
    return storage.isdir(step_dir)


def finished_steps(directory: str) -> list[int]:
    """The steps in a checkpoints folder whose save finished: locally a step folder exists only once
    complete (Orbax renames it into place); on gs:// a step folder is complete once it holds COMMIT_FILE."""
    return sorted(int(n) for n in storage.listdir(directory) if n.isdigit() and _finished(directory, n))


def abstract_like(tree, sharding_tree=None):
    """ShapeDtypeStructs carrying the target shardings, for restoring onto a mesh."""
    if sharding_tree is None:
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, sharding_tree)


def check_writable(workdir: str, needed_bytes: int = 0) -> None:
    """Create `workdir` and prove it writable with a probe file; refuse if one checkpoint cannot fit
    (object stores: a probe object; they have no free-space limit to check)."""
    if storage.is_remote(workdir):
        probe = storage.join(workdir, f".write-probe-{uuid.uuid4().hex}")
        try:
            storage.write_text(probe, "ok")
            storage.rmtree(probe)
        except Exception as e:  # noqa: BLE001 - gcsfs / s3fs raise their own types
            raise PermissionError(f"--workdir={workdir} is not writable: {type(e).__name__}: {e}") from None
        return
    try:
        os.makedirs(workdir, exist_ok=True)
        probe = os.path.join(workdir, f".write-probe-{uuid.uuid4().hex}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise PermissionError(f"--workdir={workdir} is not writable: {e.strerror or e}") from None
    free = free_bytes(workdir)
    if needed_bytes and free < needed_bytes:
        raise OSError(f"--workdir={workdir}: {errors.byte_size(free)} free, but one checkpoint needs about "
                      f"{errors.byte_size(needed_bytes)}")


def free_bytes(workdir: str) -> float:
    """Free bytes on the disk holding `workdir` (an object store: unlimited)."""
    if storage.is_remote(workdir):
        return float("inf")
    return shutil.disk_usage(workdir).free


def state_bytes(abstract_state) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract_state))


class _NewestAndKept:
    """Orbax's rotation (a `PreservationPolicy`): the newest `n` checkpoints, and the steps in `kept` whatever
    their age."""

    def __init__(self, n: int):
        self.newest = ocp.checkpoint_managers.LatestN(n=n)
        self.kept: set[int] = set()

    def should_preserve(self, checkpoints, *, context):
        newest = self.newest.should_preserve(checkpoints, context=context)
        return [keep or info.step in self.kept for keep, info in zip(newest, checkpoints)]


class Checkpoints:
    def __init__(self, workdir: str, max_to_keep: int = 3, async_save: bool = True):
        self.directory = storage.join(storage.absolute(workdir), "checkpoints")
        self._policy = _NewestAndKept(max_to_keep)
        self._closed = False
        self.pending: int | None = None      # the latest step whose save was started
        self._unreported: tuple[int, float, float] | None = None   # (step, start, seconds save() blocked)
        self.async_save = async_save
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(preservation_policy=self._policy, create=True,
                                                 enable_async_checkpointing=async_save),
        )

    def keep(self, step: int | None) -> None:
        """Keep `step` through rotation (checkpoint.keep_best), instead of the step kept before."""
        self._policy.kept = set() if step is None else {step}

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def step_dir(self, step: int) -> str:
        return storage.join(self.directory, str(step))

    def save(self, step: int, state, data_position: dict, config: dict) -> None:
        """Start saving `step` (in the background with async_save). Orbax first waits for the previous
        save, so an error raised here may be that one's: `pending` names the step whose save is open."""
        if self._unreported is not None:       # the previous save is still open: Orbax would wait for it first
            waited = time.perf_counter()
            with self._failed_unreported():
                self.manager.wait_until_finished()
            self._report(held_up=time.perf_counter() - waited)
        start = time.perf_counter()
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=ocp.args.JsonSave(data_position),
            config=ocp.args.JsonSave(config),
        ), force=True)
        self.pending = step
        self._unreported = (step, start, time.perf_counter() - start)
        if not self.async_save:                   # the save is complete when save() returns
            self._report()

    def poll(self) -> None:
        """Between steps: raise the error of a background save that failed, else log the one that finished
        (its duration is then known to within a step). Cheap: no wait, no communication."""
        with self._failed_unreported():
            self.manager.check_for_errors()
            if self._unreported is None or self.manager.is_saving_in_progress():
                return
            self.manager.check_for_errors()        # it may have failed between the two calls
            self.manager.wait_until_finished()     # no wait now; raises what its last step (the rename) raised
        self._report()

    def finish(self) -> None:
        """Wait for the open background save (if any) and log it; raises its error if it failed."""
        waited = time.perf_counter()
        with self._failed_unreported():
            self.manager.wait_until_finished()
            self.manager.check_for_errors()
        if self._unreported is not None:
            self._report(held_up=time.perf_counter() - waited)

    @contextlib.contextmanager
    def _failed_unreported(self):
        """Inside: an error is the open save's failure, so that save is never to be logged as saved (Orbax raises
        a failure once: a later wait, closing the manager after the failure, would find nothing wrong)."""
        try:
            yield
        except BaseException:
            self._unreported = None
            raise

    def _report(self, held_up: float = 0.0) -> None:
        """Log the open save as complete; `held_up`: seconds the loop has just waited for its end."""
        step, start, blocked = self._unreported
        self._unreported = None
        log.info("checkpoint %d saved in %.1f s (%.1f s of it holding training up)", step,
                 time.perf_counter() - start, blocked + held_up)

    def saved_config(self, step: int) -> dict:
        try:
            return self.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]
        except Exception as e:   # noqa: BLE001 - any failure means the checkpoint cannot be used
            raise CheckpointReadError(f"checkpoint {self.step_dir(step)} cannot be read (config): "
                                      f"{_one_line(e)}") from e

    def saved_data_position(self, step: int) -> dict:
        """The data position saved with `step` (epoch, offset, data fingerprint), without reading the state."""
        try:
            return self.manager.restore(step, args=ocp.args.Composite(data=ocp.args.JsonRestore()))["data"]
        except Exception as e:   # noqa: BLE001
            raise CheckpointReadError(f"checkpoint {self.step_dir(step)} cannot be read (data position): "
                                      f"{_one_line(e)}") from e

    def complete_steps(self) -> list[int]:
        """Steps whose save finished (see `finished_steps`)."""
        return finished_steps(self.directory)

    def remove_partial(self) -> list[str]:
        """Delete the folders of saves that did not finish (temporary folders; on gs://, step folders
        without COMMIT_FILE); returns their names. Only when no save is under way."""
        partial = [n for n in storage.listdir(self.directory) if ".orbax-checkpoint-tmp" in n
                   or (n.isdigit() and not _finished(self.directory, n))]
        for name in partial:
            try:
                storage.rmtree(storage.join(self.directory, name))
            except OSError:
                pass
        return partial

    def restore(self, step: int, abstract_state) -> tuple[object, dict]:
        """The state at `step`, laid out as `abstract_state`'s shardings say, and the data position."""
        try:
            out = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state),
                data=ocp.args.JsonRestore(),
            ))
        except Exception as e:   # noqa: BLE001
            raise CheckpointReadError(f"checkpoint {self.step_dir(step)} cannot be read: "
                                      f"{_one_line(e)}") from e
        return out["state"], out["data"]

    def restore_params(self, step: int, abstract_params, on_host: bool = False):
        """Only the parameters of the state saved at `step` (an Orbax partial restore: the optimizer moments
        are not read), shaped, typed and sharded as `abstract_params` says, or host numpy arrays (`on_host`)."""
        if on_host:
            restore_args = jax.tree.map(lambda x: ocp.RestoreArgs(restore_type=np.ndarray, dtype=x.dtype),
                                        abstract_params)
        else:
            restore_args = ocp.checkpoint_utils.construct_restore_args(abstract_params)
        try:
            out = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
                item={"params": abstract_params}, restore_args={"params": restore_args}, partial_restore=True)))
        except Exception as e:   # noqa: BLE001
            raise CheckpointReadError(f"checkpoint {self.step_dir(step)} cannot be read (parameters): "
                                      f"{_one_line(e)}") from e
        return out["state"]["params"]

    def restore_newest_readable(self, abstract_state, fallback: bool, check_config=None) -> tuple[int, object, dict]:
        """Restore the latest step; if it is unreadable, raise, or with `fallback` try older ones.

        `check_config(step, saved_config)` runs before a step's state is read and may raise."""
        steps = self.steps()
        if not steps:
            raise FileNotFoundError(f"{self.directory} holds no checkpoint to resume from")
        errors = []
        for step in reversed(steps):
            try:
                if check_config is not None:
                    check_config(step, self.saved_config(step))
                state, position = self.restore(step, abstract_state)
            except CheckpointReadError as e:
                if not fallback:
                    raise CheckpointReadError(f"{e}; pass --config.checkpoint.fallback=True to resume from the "
                                              f"newest readable checkpoint instead.") from e
                log.warning("%s; trying an older checkpoint", e)
                errors.append(str(e))
                continue
            if errors:
                self._set_aside([s for s in steps if s > step])
                log.warning("resuming from step %d: %d newer checkpoint(s) could not be read and were renamed "
                            "*.unreadable (kept, not deleted)", step, len(errors))
            return step, state, position
        raise CheckpointReadError("no readable checkpoint in " + self.directory + ":\n" + "\n".join(errors))

    def _set_aside(self, steps: list[int]) -> None:
        """Rename unreadable step folders out of the manager's view so that those steps can be saved again."""
        if jax.process_index() == 0:
            for step in steps:
                storage.rename(self.step_dir(step), f"{self.step_dir(step)}.unreadable-{uuid.uuid4().hex[:8]}")
        distributed.barrier("infjax: unreadable checkpoints set aside")   # no process reloads before the rename
        self.manager.reload()

    def reached_preemption(self, step: int) -> bool:
        """Multi-host: whether all hosts agree a preemption signal arrived (Orbax's sync point)."""
        return bool(self.manager.reached_preemption(step))

    def close(self) -> None:
        """Wait for the last asynchronous save, then close; a second call does nothing."""
        if self._closed:
            return
        self._closed = True
        try:
            self.finish()
        finally:
            self.manager.close()
