"""Where a run's records go: metrics.jsonl always, and the views that `log.writers` lists.

The views: TensorBoard event files and a Weights & Biases run.

The training loop hands every record to `Writers.write` in one call: a logged step
(`{"step", "loss", "learning_rate", ...}`), an evaluation (`{"step", "eval": {set: metrics}}`) or a
warning (`{"step", "warning", ...}`). metrics.jsonl is the run's record (resume trims it, tests and
tools read it): a failure to write it stops the run like any other failed write. The other writers are
views of the same records: one that fails (a full disk, an unwritable folder, a missing package) logs
one warning naming itself and is dropped, and training goes on. Each view runs in a thread of its own, so
the step never waits on it: a view that stops taking records (its disk is full and its library blocks, a
network that does not answer) is switched off as one that fails is, after STALL_S, and the end of the run
waits for a view at most CLOSE_S. Only process 0 writes.
"""
from __future__ import annotations

import json
import logging
import math
import queue
import re
import threading
import time

from infjax.runtime import storage
from infjax.training.workdir import MetricsLog

log = logging.getLogger("infjax.writers")

WRITERS = ("jsonl", "tensorboard", "wandb")   # the names log.writers may list
TENSORBOARD_DIR = "tensorboard"
WANDB_MODES = ("", "online", "offline", "disabled")   # log.wandb_mode ("": WANDB_MODE, else wandb's default)
STALL_S = 60.0       # a view that has not taken a record for this long is switched off (it blocks)
CLOSE_S = 30.0       # the end of a run waits this long for a view to write what it holds and close


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

    def abandon(self) -> None:
        """Switched off while blocked: tensorboardX's exit hook would close it, waiting for ever on the writer
        thread that died (a full disk); mark its files closed so that the process can exit."""
        for writer in [self._writer.file_writer, *self._writer.all_writers.values()]:
            if writer is not None:
                writer.event_writer._closed = True     # noqa: SLF001 - what its close() checks first


class WandB:
    """A Weights & Biases run (`log.wandb_*` keys).

    Its history has the same tags as TensorBoard, at the record's step, and the resolved config is the run's config.
    Offline mode (`log.wandb_mode=offline` or WANDB_MODE=offline) writes the run under WORKDIR/wandb/ for `wandb sync`;
    a gs:// workdir cannot hold it, so wandb's own directory (WANDB_DIR, else the current one) does. Each start of the
    process is one W&B run: a resumed training is a new run whose history begins after its checkpoint."""

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


class Detached:
    """A view driven by a thread of its own: `send` queues a call and returns at once, whatever the view does.

    The view is opened in that thread too (W&B's start can wait on its network). A call that raises ends the
    thread with that error (`failure`); a thread that has held a call for STALL_S without finishing it is
    `stalled` (its library blocks: a writer thread of its own died on a full disk, a network that does not
    answer). The owner switches off a view in either state; its thread, a daemon, is left behind."""

    def __init__(self, name: str, opener):
        self.name = name
        self.failure: tuple[str, BaseException] | None = None
        self.view = None                            # once opened
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._busy_since: float | None = None       # when the call it is in began; None while it waits
        self._what = "open"
        self._thread = threading.Thread(target=self._serve, args=(opener,), name=f"infjax-{name}-writer",
                                        daemon=True)
        self._thread.start()

    def _serve(self, opener) -> None:
        self._busy_since = time.monotonic()
        try:
            view = self.view = opener()
            while True:
                self._busy_since = None
                what, method, args = self._calls.get()
                self._busy_since, self._what = time.monotonic(), what
                getattr(view, method)(*args)
                if method == "close":
                    return
        except Exception as e:  # noqa: BLE001 - a view must never stop training: reported by the owner
            self.failure = (self._what, e)
        finally:
            self._busy_since = None

    def send(self, what: str, method: str, *args) -> None:
        self._calls.put((what, method, args))

    def stalled(self) -> str | None:
        """What it has been blocked in for more than STALL_S ("write", "open", ...), else None."""
        since = self._busy_since
        if since is not None and time.monotonic() - since > STALL_S and self._thread.is_alive():
            return self._what
        return None

    def abandon(self) -> None:
        """Left behind: the view lets the process exit without closing it (`abandon`, where it has one)."""
        if self.view is not None and hasattr(self.view, "abandon"):
            try:
                self.view.abandon()
            except Exception:  # noqa: BLE001, S110 - a view's internals; nothing more can be done
                pass

    def join(self, timeout: float) -> bool:
        """Whether the thread ended within `timeout` seconds."""
        self._thread.join(timeout)
        return not self._thread.is_alive()


class Writers:
    """metrics.jsonl plus the views `names` asks for; the interface of `MetricsLog` (start, write, flush)."""

    def __init__(self, workdir: str, names: list[str], config_json: dict, enabled: bool = True):
        self.jsonl = MetricsLog(workdir, enabled=enabled)
        self.workdir, self.config_json, self.enabled = workdir, config_json, enabled
        self.names = [n for n in names if n != "jsonl"]
        self.views: list[Detached] = []

    def _drop(self, view: Detached, why: str, closing: bool = False, blocked: bool = False) -> None:
        """Switch `view` off; one that is `blocked` is also abandoned (its library's exit hook would wait on it)."""
        log.warning("log.writers: the %s writer %s; %s", view.name, why,
                    "it is left behind" if closing else "it is switched off, training goes on")
        if blocked:
            view.abandon()
        self.views.remove(view)

    def _check(self) -> None:
        """Switch off every view that failed or stalled, one warning each."""
        for view in list(self.views):
            if view.failure is not None:
                what, e = view.failure
                self._drop(view, f"failed to {what} ({type(e).__name__}: {e})")
            elif view.stalled():
                self._drop(view, f"has been blocked in {view.stalled()} for more than {STALL_S:g} s", blocked=True)

    def _each(self, what: str, method: str, *args) -> None:
        self._check()
        for view in self.views:
            view.send(what, method, *args)

    def start(self, step: int) -> None:
        """The run begins after `step` (0: fresh): metrics.jsonl trimmed, the views opened (not before, so a
        run refused while restoring leaves nothing behind)."""
        self.jsonl.start(step)
        for name in self.names if self.enabled else ():
            self.views.append(Detached(name, lambda name=name: VIEWS[name](self.workdir, self.config_json, step)))

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
        """Write what the views hold and close them, waiting at most CLOSE_S in all."""
        self.jsonl.flush()
        self._each("close", "close")
        deadline = time.monotonic() + CLOSE_S
        for view in list(self.views):
            if not view.join(max(0.0, deadline - time.monotonic())):
                self._drop(view, f"did not close within {CLOSE_S:g} s", closing=True, blocked=True)
        self._check()                          # the views that failed to write or close
        self.views = []
