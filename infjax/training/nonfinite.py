"""Non-finite steps: stopping at the first one (train.nonfinite=stop), and the end-of-run count of skipped ones.

The step never applies a non-finite loss, gradient or update (training/step.py); it reports a `finite` flag
and counts the steps it skipped in the state. What the run does about them is decided here.
"""
from __future__ import annotations

import logging

from infjax import errors

log = logging.getLogger("infjax.train")      # the lines of the training run


class NonFiniteError(errors.RunStopped):
    """A step produced a non-finite loss, gradient or update under train.nonfinite='stop'."""


class MostStepsSkipped(errors.RunStopped):
    """More of the run's steps than train.max_skipped allows were skipped as non-finite: it did not train."""


class FiniteCheck:
    """train.nonfinite=stop: each step's `finite` flag, read one step late, so the host never waits on a step.

    A step's flag is read once the next step is queued (or before a log line, an evaluation or a
    checkpoint: `check`), so the host never waits on the step it just dispatched. Otherwise nothing is read.
    """

    def __init__(self, stop: bool, plan, ckpts):
        self.stop, self.plan, self.ckpts = stop, plan, ckpts
        self.unchecked: list = []          # (step, its `finite` flag on the device)

    def queue(self, step: int, metrics: dict) -> None:
        """After step `step` is dispatched: check the previous one (it ran before), keep this one's flag."""
        if self.stop:
            self.check()
            self.unchecked.append((step, metrics["finite"]))

    def check(self) -> None:
        """Raise NonFiniteError naming the first queued step that was not finite (its epoch, batch, records)."""
        for checked_step, finite in self.unchecked:
            if not bool(finite):
                pos = self.plan.position(checked_step)
                raise NonFiniteError(
                    f"non-finite loss, gradient or updated parameters at step {checked_step} (epoch {pos['epoch']}, "
                    f"batch {pos['offset']} of the epoch, records {self.plan.record_indices(checked_step).tolist()}); "
                    f"the parameters were not updated. Latest checkpoint: {self.ckpts.latest_step()}. "
                    f"--config.train.nonfinite=skip skips such steps instead.")
        self.unchecked.clear()


def summarize_skipped(config, start: int, end: int, skipped: int, checkpoint_dir: str, stopped: bool) -> None:
    """The end-of-run line on non-finite steps: how many of this run's steps (start+1..end) were skipped.

    A finished run that skipped more than train.max_skipped of them did not train, whatever its last line
    says: it stops with MostStepsSkipped (exit status 3), its last checkpoint kept as it is. A run stopped by a
    signal only reports (its resume goes on).
    """
    trained = end - start
    if trained <= 0:
        return
    share = skipped / trained
    line = (f"steps {start + 1}-{end}: {skipped} of {trained} skipped as non-finite (loss, gradient or update NaN "
            f"or inf; the parameters were not updated by them)")
    if stopped or share <= config.train.max_skipped:
        (log.warning if skipped else log.info)("%s", line)
        return
    raise MostStepsSkipped(
        f"{line}: {share:.0%} of the run, more than train.max_skipped={config.train.max_skipped:g}, so the model "
        f"did not train. Checkpoint {checkpoint_dir} is kept as it is. Lower train.learning_rate (now "
        f"{config.train.learning_rate:g}) and start again; --config.train.nonfinite=stop stops at the first such step")
