"""The best checkpoint by an evaluation metric (checkpoint.keep_best), kept beside the newest ones.

`checkpoint.keep_best = "<eval set>/<metric>"` (for example "synthetic/p_mrr", or "lee/main" for a canary) names
a metric the run evaluates every eval.every steps; higher is better. After each evaluation `BestCheckpoint.offer`
says whether the step beat every earlier one; the loop then saves that step (if it would not anyway) and the
checkpoint manager keeps it through rotation (runtime/checkpoint.py, `Checkpoints.keep`). Which step is best,
and its value, travel with every checkpoint's data position, so a resumed run goes on from the same best, and
`infjax.export --step=best` finds it.
"""
from __future__ import annotations

import dataclasses
import math

from infjax.errors import ConfigError
from infjax.runtime.checkpoint import BEST_KEY as RECORD_KEY    # its entry in each checkpoint's data position


def parse(text: str) -> tuple[str, str] | None:
    """checkpoint.keep_best as (eval set, metric), None when empty; ValueError when it is not SET/METRIC."""
    if not text:
        return None
    spec, _, metric = text.rpartition("/")
    if not spec or not metric:
        raise ValueError("must be <eval set>/<metric>, e.g. synthetic/p_mrr (or \"\" to keep none)")
    return spec, metric


@dataclasses.dataclass
class BestCheckpoint:
    """The step with the highest value of one evaluation metric so far (None before the first evaluation)."""

    spec: str                         # the evaluated set, as eval.sets / eval.canary name it
    metric: str                       # one of its metrics, as eval.json and metrics.jsonl name them
    step: int | None = None
    value: float | None = None

    @classmethod
    def of_config(cls, config) -> "BestCheckpoint | None":
        parsed = parse(config.checkpoint.keep_best)
        return None if parsed is None else cls(*parsed)

    @property
    def name(self) -> str:
        return f"{self.spec}/{self.metric}"

    def offer(self, step: int, scores: dict[str, dict[str, float]]) -> bool:
        """Whether the evaluation of `step` (`scores`: set -> metric -> value) is the best so far (ties: earlier)."""
        metrics = scores.get(self.spec)
        if metrics is None or self.metric not in metrics:
            have = sorted(metrics) if metrics is not None else sorted(scores)
            what = "metric" if metrics is not None else "eval set"
            raise ConfigError(f"config.checkpoint.keep_best={self.name!r}: the evaluation at step {step} has no "
                              f"{what} {self.metric if metrics is not None else self.spec!r}; it has {have}")
        value = float(metrics[self.metric])
        if not math.isfinite(value) or (self.value is not None and value <= self.value):
            return False
        self.step, self.value = step, value
        return True

    def record(self) -> dict:
        """What each checkpoint's data position holds of it."""
        return {"metric": self.name, "step": self.step, "value": self.value}

    def restore(self, record: dict | None) -> None:
        """Go on from a resumed checkpoint's record (none, or another metric's: start afresh)."""
        if record and record.get("metric") == self.name and record.get("step") is not None:
            self.step, self.value = int(record["step"]), float(record["value"])

    def describe(self, step_dir: str) -> str:
        if self.step is None:
            return f"best checkpoint by {self.name}: none (no evaluation gave a finite value)"
        return (f"best checkpoint by {self.name}: step {self.step} ({self.value:.4f}), {step_dir}; export it with "
                f"--step=best")
