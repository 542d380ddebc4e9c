"""The trainer's console: a progress bar on a terminal, plain log lines elsewhere, never both on one line.

On an interactive stderr the loop shows a tqdm bar, and while it is shown every console log handler
writes through `tqdm.write`, which clears the bar, writes the record on its own line and redraws the bar
below it. On anything else (a CI log, a SLURM output file, a pipe) there is no bar, hence no carriage
returns: the `log_every` lines are the progress.
"""
from __future__ import annotations

import contextlib
import logging
import sys

from tqdm.auto import tqdm


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
