"""Where a run's records go: metrics.jsonl always, TensorBoard event files and a Weights & Biases run when
`log.writers` lists them.

The training loop hands every record to `Writers.write` in one call: a logged step
(`{"step", "loss", "learning_rate", ...}`), an evaluation (`{"step", "eval": {set: metrics}}`) or a
warning (`{"step", "warning", ...}`). metrics.jsonl is the run's record (resume trims it, tests and
tools read it): a failure to write it stops the run like any other failed write. The other writers are
views of the same records: one that fails (a full disk, an unwritable folder, a missing package) logs
one warning naming itself and is dropped, and training goes on. Only process 0 writes.
"""
from __future__ import annotations

import json
import logging
import math
import re

from infjax.runtime import storage
from infjax.training.workdir import MetricsLog

log = logging.getLogger("infjax.writers")

WRITERS = ("jsonl", "tensorboard", "wandb")   # the names log.writers may list
TENSORBOARD_DIR = "tensorboard"
WANDB_MODES = ("", "online", "offline", "disabled")   # log.wandb_mode ("": WANDB_MODE, else wandb's default)


def writer_names(spec: str) -> list[str]:
    return [s.strip() for s in spec.split(",") if s.strip()]


def _tag(name: str) -> str:
    """A set's or metric's name as one TensorBoard tag component, in the characters TensorBoard allows
    (letters, digits, _ . -): `ndcg@10` -> `ndcg_10`, a path's slashes would nest it into groups."""
    return re.sub(r"[^\w.-]", "_", name)


def scalars(record: dict) -> dict[str, float]:
    """The numbers of a record as TensorBoard tags: train/<key> for a logged step, eval/<set>/<metric>
    for an evaluation; a warning has none (it is in the log and metrics.jsonl)."""
    def number(v) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

    if "warning" in record:
        return {}
    if "eval" in record:
        return {f"eval/{_tag(spec)}/{_tag(name)}": float(v) for spec, metrics in record["eval"].items()
                for name, v in metrics.items() if number(v)}
    return {f"train/{k}": float(v) for k, v in record.items() if k != "step" and number(v)}


class TensorBoard:
    """Event files under WORKDIR/tensorboard (tensorboardX: no TensorFlow needed). A resumed run hides
    the events its predecessor wrote after the checkpoint (TensorBoard's purge step), so each step shows once."""

    name = "tensorboard"

    def __init__(self, workdir: str, config_json: dict, start: int):
        from tensorboardX import SummaryWriter

        self._writer = SummaryWriter(logdir=storage.join(workdir, TENSORBOARD_DIR), flush_secs=30,
                                     purge_step=start + 1 if start else None)
        self._writer.add_text("config", "```\n" + json.dumps(config_json, indent=2) + "\n```", start)

    def write(self, record: dict) -> None:
        for tag, value in scalars(record).items():
            self._writer.add_scalar(tag, value, record["step"])

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandB:
    """A Weights & Biases run (`log.wandb_*` keys): the same tags as TensorBoard in its history, at the
    record's step, and the resolved config as the run's config. Offline mode (`log.wandb_mode=offline` or
    WANDB_MODE=offline) writes the run under WORKDIR/wandb/ for `wandb sync`; a gs:// workdir cannot hold
    it, so wandb's own directory (WANDB_DIR, else the current one) does. Each start of the process is one
    W&B run: a resumed training is a new run whose history begins after its checkpoint."""

    name = "wandb"

    def __init__(self, workdir: str, config_json: dict, start: int):
        import wandb

        opts = config_json.get("log", {})
        if storage.is_remote(workdir):
            directory = None
            log.info("log.writers: wandb keeps its run folder in WANDB_DIR or the current directory, not in %s",
                     workdir)
        else:
            directory = workdir
        name = opts.get("wandb_name") or workdir.rstrip("/").rsplit("/", 1)[-1]
        self._run = wandb.init(project=opts.get("wandb_project") or None, entity=opts.get("wandb_entity") or None,
                               name=name + (f"-from-{start}" if start else ""), dir=directory,
                               mode=opts.get("wandb_mode") or None, config=config_json,
                               settings=wandb.Settings(console="off", silent=True), reinit="create_new")
        self._last = -1

    def write(self, record: dict) -> None:
        values = scalars(record)
        if values:
            if record["step"] < self._last:      # W&B keeps one increasing step; it would drop these silently
                raise ValueError(f"step {record['step']} comes after step {self._last}; W&B steps only increase")
            self._run.log(values, step=record["step"])
            self._last = record["step"]

    def flush(self) -> None:
        pass                                     # wandb writes its own files in the background

    def close(self) -> None:
        self._run.finish()


VIEWS = {"tensorboard": TensorBoard, "wandb": WandB}
assert set(VIEWS) | {"jsonl"} == set(WRITERS)


class Writers:
    """metrics.jsonl plus the views `names` asks for; the interface of `MetricsLog` (start, write, flush)."""

    def __init__(self, workdir: str, names: list[str], config_json: dict, enabled: bool = True):
        self.jsonl = MetricsLog(workdir, enabled=enabled)
        self.workdir, self.config_json, self.enabled = workdir, config_json, enabled
        self.names = [n for n in names if n != "jsonl"]
        self.views = []

    def _guard(self, name: str, what: str, call) -> bool:
        try:
            call()
            return True
        except Exception as e:  # noqa: BLE001 - a view must never stop training
            log.warning("log.writers: the %s writer failed to %s (%s: %s); it is switched off, training goes on",
                        name, what, type(e).__name__, e)
            return False

    def _each(self, what: str, method: str, *args) -> None:
        for view in list(self.views):
            if not self._guard(view.name, what, lambda: getattr(view, method)(*args)):
                self.views.remove(view)

    def start(self, step: int) -> None:
        """The run begins after `step` (0: fresh): metrics.jsonl trimmed, the views opened (not before, so a
        run refused while restoring leaves nothing behind)."""
        self.jsonl.start(step)
        for name in self.names if self.enabled else ():
            self._guard(name, "open", lambda name=name: self.views.append(
                VIEWS[name](self.workdir, self.config_json, step)))

    def write(self, record: dict) -> None:
        self.jsonl.write(record)
        self.view(record)

    def view(self, record: dict) -> None:
        """`record` to the views only (e.g. the evaluations before and after training, kept in eval.json)."""
        self._each("write", "write", record)

    def flush(self) -> None:
        self.jsonl.flush()
        self._each("flush", "flush")

    def close(self) -> None:
        self.jsonl.flush()
        self._each("close", "close")
        self.views = []
