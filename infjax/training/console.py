"""The trainer's console: a progress bar on a terminal, plain log lines elsewhere, never both on one line.

The step line (`Tally`: loss, rates, the data wait) and the data lines (texts cut at their max length) are
written here too, from what the loop counts as it goes.

On an interactive stderr the loop shows a tqdm bar, and while it is shown every console log handler
writes through `tqdm.write`, which clears the bar, writes the record on its own line and redraws the bar
below it. On anything else (a CI log, a SLURM output file, a pipe) there is no bar, hence no carriage
returns: the `log_every` lines are the progress.
"""
from __future__ import annotations

import contextlib
import logging
import sys
import time

import jax
import numpy as np
from tqdm.auto import tqdm

from infjax.data.batches import real_tokens
from infjax.runtime import distributed

log = logging.getLogger("infjax.train")      # the lines of the training run


def interactive(stream=None) -> bool:
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):      # no isatty, or a closed stream
        return False


class _AboveTheBar:
    """A stream for log handlers: each write goes above the progress bar."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> int:
        tqdm.write(text, file=self.stream, end="")
        return len(text)

    def flush(self) -> None:
        self.stream.flush()


def console_handlers() -> list[logging.StreamHandler]:
    """The root logger's handlers that write to stdout or stderr (absl's handler wraps one)."""
    found = []
    for handler in logging.getLogger().handlers:
        for h in (handler, getattr(handler, "python_handler", None)):     # absl.logging.ABSLHandler
            if isinstance(h, logging.StreamHandler) and getattr(h, "stream", None) in (sys.stdout, sys.stderr):
                found.append(h)
    return found


@contextlib.contextmanager
def progress(iterable, start: int, total: int, desc: str = "train", enabled: bool = True):
    """`iterable` with a bar and the log records above it (interactive stderr and `enabled`), else as is."""
    if not enabled or not interactive():
        yield iterable
        return
    bar = tqdm(iterable, initial=start, total=total, desc=desc, dynamic_ncols=True, file=sys.stderr)
    handlers = [(h, h.stream) for h in console_handlers()]
    for h, stream in handlers:
        h.setStream(_AboveTheBar(stream))
    try:
        yield bar
    finally:
        for h, stream in handlers:
            h.setStream(stream)
        bar.close()


class Tally:
    """What the loop counts for its log lines, and the lines.

    Rows, real tokens and the data wait since the last step line (`step_line`); texts and texts cut at their
    max length over the run (`data_line`); a grown shape's warning, once.
    """

    def __init__(self, build):
        self.build = build
        self.texts: dict[str, int] = {}
        self.cut: dict[str, int] = {}
        self.grown: set[str] = set()
        self.rows = self.tokens = self.skipped_logged = 0
        self.since, self.waited = time.perf_counter(), 0.0
        self.source: str | None = None                       # a one-source mixture: the last step's source
        self.source_losses: dict[str, list[float]] = {}      # ... and each source's logged losses

    def add(self, info: dict, host_batch: dict) -> None:
        """One step's batch: its texts and cut texts (`info` of the step stream), rows and real tokens."""
        for side, n in info["texts"].items():
            self.texts[side] = self.texts.get(side, 0) + n
        for side, n in info["cut"].items():
            self.cut[side] = self.cut.get(side, 0) + n
        if info["grown"] is not None and info["grown"] not in self.grown:
            log.warning("%s", info["grown"])
            self.grown.add(info["grown"])
        self.tokens += real_tokens(host_batch)    # this process's rows, counted on the host: no device sync
        self.rows += self.build.global_rows
        self.source = info.get("source")

    def step_line(self, done: int, steps: int, metrics: dict, skipped, waited: float) -> dict:
        """Log the line of step `done` and return its metrics.jsonl record (host floats, with the rates).

        `skipped`: the state's count of skipped steps; `waited`: the step stream's wait for data so far. Every
        process calls this at the same steps (the real-token rate is summed over processes).
        """
        metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
        metrics["skipped_steps"] = int(skipped)
        now = time.perf_counter()
        metrics["examples_per_s"] = self.rows / (now - self.since)
        metrics["real_tokens_per_s"] = distributed.sum_over_processes(self.tokens) / (now - self.since)
        metrics["data_wait_share"] = (waited - self.waited) / (now - self.since)
        self.since, self.rows, self.tokens, self.waited = now, 0, 0, waited
        source = ""
        if self.source is not None:             # the logged loss is the last step's, of this source
            metrics["source"] = self.source
            self.source_losses.setdefault(self.source, []).append(metrics["loss"])
            source = f" ({self.source})"
        log.info("step %d/%d  loss %.4f%s  lr %.2e  grad_norm %.3f  %.1f examples/s  %.0f real tokens/s  "
                 "data wait %.0f%%", done, steps, metrics["loss"], source, metrics["learning_rate"],
                 metrics["grad_norm"], metrics["examples_per_s"], metrics["real_tokens_per_s"],
                 100 * metrics["data_wait_share"])
        if metrics["skipped_steps"] > self.skipped_logged:
            log.warning("%d step(s) skipped so far for a non-finite loss or gradient", metrics["skipped_steps"])
            self.skipped_logged = metrics["skipped_steps"]
        return metrics

    def data_line(self, start: int, built: int, waited: float) -> None:
        """The run's last data line: the wait for the `built` steps after `start`, and the texts cut."""
        if not built:
            return
        whose = "texts" if jax.process_count() == 1 else "this process's texts"
        cuts = ", ".join(f"{side} {self.cut[side]} of {self.texts[side]} "
                         f"({100 * self.cut[side] / max(self.texts[side], 1):.1f}%, at "
                         f"{self.build.max_len(side)} tokens)" for side in sorted(self.cut))
        log.info("data: steps %d-%d waited %.1f s for their batches in all%s", start + 1, start + built,
                 waited, f"; {whose} cut at their max length: {cuts}" if cuts else "")
        summary = getattr(self.build.step_texts.plan, "summary", None)
        if summary is not None:                 # a mixture: what each source got, against its weight
            means = "; ".join(f"{s} {np.mean(v):.4f} over {len(v)}" for s, v in sorted(self.source_losses.items()))
            log.info("%s%s", summary(start, start + built), f"; mean logged loss per source: {means}" if means else "")


CUT_SIDES = {"q": ("queries", "query"), "i": ("instructions", "query"), "qo": ("queries", "query"),
             "p": ("passages", "passage")}


def describe_data_cuts(cuts: dict[str, tuple[int, int]], data) -> str:
    """The line of `BatchBuilder.data_cuts`: the texts of each side cut at its max length.

    E.g. "data: texts cut at their max length: 0 of 96 queries at data.query_max_len=256 tokens, 12 of 96
    passages (12.5%) at data.passage_max_len=512 tokens".
    """
    def side(name: str) -> str:
        (cut, n), (texts, key) = cuts[name], CUT_SIDES[name]
        share = f" ({100 * cut / n:.1f}%)" if cut and n else ""
        return f"{cut} of {n} {texts}{share} at data.{key}_max_len={data[f'{key}_max_len']} tokens"
    return "data: texts cut at their max length: " + ", ".join(side(s) for s in CUT_SIDES if s in cuts)
