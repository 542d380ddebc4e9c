"""Stopping a run on a signal: the flag a signal sets, the step at which every process stops, the bounded wait.

SIGTERM / SIGINT / SIGHUP set a flag (`Preemption`); the loop finishes its step, saves a checkpoint and returns.
With several processes `agreed_stop` turns a signal on any of them into one step at which all stop. A run that
does not get back to its loop within train.stop_grace_s exits, naming where it was held (`held_at`).
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import traceback

import jax

from infjax import errors
from infjax.runtime import checkpoint, distributed

log = logging.getLogger("infjax.train")      # the lines of the training run


class Preemption:
    """SIGTERM / SIGINT / SIGHUP set a flag; the loop finishes its step, saves a checkpoint and returns.

    SIGHUP is a closed terminal or SSH session: the standard streams it took away (where every write now
    fails) are sent to /dev/null first (`errors.drop_hung_up_streams`). A run started under `nohup` (SIGHUP
    ignored) or as a shell's background job (SIGINT ignored) keeps that signal ignored (`errors.catch`).

    The flag is this process's: with several processes, `agreed_stop` turns a signal on any of them into
    one step at which all stop. The signal also starts a clock: a run that has not left this block
    `grace_s` seconds later (held in a write, a save or a wait that does not end) exits without its
    checkpoint, status 128 + the signal, with one line saying where it was held and `expired()`'s text
    (the checkpoint to resume from); the clock runs until `disarm()`, through the last save after the loop.
    A second signal inside the block exits the same way at once.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

    def __init__(self, grace_s: float = 0.0, expired=lambda: ""):
        self.received: str | None = None
        self.grace_s, self._expired = grace_s, expired
        self._previous = {}
        self._left = threading.Event()
        self._main = threading.main_thread().ident

    def _handle(self, signum, frame):
        if signum == signal.SIGHUP:
            errors.drop_hung_up_streams()
        if self.received is not None:
            self._exit(signum, f"stopped by a second {signal.Signals(signum).name}", frame)
        self.received = signal.Signals(signum).name
        if self.grace_s > 0:
            threading.Thread(target=self._watch, args=(signum,), name="infjax-stop-watch", daemon=True).start()

    def _watch(self, signum: int) -> None:
        if not self._left.wait(self.grace_s):
            self._exit(signum, f"stopped by {signal.Signals(signum).name}, but the run did not reach its checkpoint "
                               f"within train.stop_grace_s={self.grace_s:g} s")

    def _exit(self, signum: int, why: str, frame=None) -> None:
        log.error("%s (held %s); exiting without saving; %s", why, held_at(self._main, frame), self._expired())
        for handler in logging.getLogger().handlers + log.handlers:
            handler.flush()
        os._exit(128 + signum)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = errors.catch(self.SIGNALS, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
        if self.received is None:
            self.disarm()
        return False        # after a signal the clock runs on: the save and the close after the loop are bounded

    def disarm(self) -> None:
        """The run is over (it returns or raises): the clock of a signal stops."""
        self._left.set()


def held_at(thread_id: int, frame=None) -> str:
    """Where thread `thread_id` is now (or `frame`, where a signal handler interrupted it).

    Its innermost call and, when that is a library's, infjax's call into it.
    """
    frame = frame or sys._current_frames().get(thread_id)   # noqa: SLF001 - the documented way to see a thread
    if frame is None:
        return "nowhere (the thread ended)"
    stack = traceback.extract_stack(frame)

    def short(f) -> str:
        path = f.filename.replace("\\", "/")
        if "/site-packages/" in path:
            path = path.rsplit("/site-packages/", 1)[1]
        elif "/infjax/" in path:
            path = "infjax/" + path.rsplit("/infjax/", 1)[1]
        else:
            path = os.path.basename(path)
        return f"{f.name} ({path}:{f.lineno})"

    inner = stack[-1]
    ours = next((f for f in reversed(stack) if "/infjax/" in f.filename.replace("\\", "/")), None)
    return f"in {short(inner)}" + (f", called from {short(ours)}" if ours is not None and ours is not inner else "")


def agreed_stop(received: str | None, step: int, ckpts: checkpoint.Checkpoints) -> str | None:
    """Whether every process stops after `step`: the name of the signal, or "preemption", else None.

    The signal received by any process (all processes agree, so they save the same checkpoint and exit
    together), or "preemption" when JAX's preemption notice reached its sync point. Every process calls this
    after every step.
    """
    if jax.process_count() == 1:
        return received
    code = distributed.max_over_processes(int(signal.Signals[received]) if received else 0)
    if code:
        return signal.Signals(code).name
    return "preemption" if ckpts.reached_preemption(step) else None
