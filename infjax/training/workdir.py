"""The run folder's own files besides checkpoints: the lock that keeps one run per workdir, and metrics.jsonl.

Only process 0 touches them (one writer per file); the other processes get
no-op objects, so callers need no rank checks. On an object-store workdir
(gs://, s3://) there is no lock (object stores have no flock: one run per
workdir is then the user's to keep), and metrics.jsonl, which cannot be
appended to, is rewritten whole at every checkpoint and at the end of the run.
"""
from __future__ import annotations

import datetime
import json
import logging
import os

from infjax.errors import UserError
from infjax.runtime import storage
from infjax.runtime.folder_lock import LOCK_FILE, FolderBusy, FolderLock

log = logging.getLogger("infjax.workdir")

METRICS_FILE = "metrics.jsonl"


WorkdirBusy = FolderBusy         # another live run holds the workdir's lock


class WorkdirLock(FolderLock):
    """The run's lock on WORKDIR/.infjax.lock (runtime/folder_lock.py) for the lifetime of a run.

    A second run on the workdir is refused naming the holder; a lock left by a run that died is reported and taken
    over; a workdir this lock created and that holds nothing else on release is removed. Before anything is opened,
    none of the run's own files may be a symbolic link (`refuse_links`)."""

    def __init__(self, workdir: str, enabled: bool = True):
        super().__init__(workdir, flag="--workdir", holder="run", enabled=enabled)
        self.workdir = workdir

    def remote_note(self) -> str:
        return f"--workdir={self.workdir} is on an object store: no lock; run one training per workdir"

    def refuse_links(self) -> None:
        refuse_links(self.workdir)


RUN_FILES = (LOCK_FILE, METRICS_FILE, "eval.json")    # the files of a run folder infjax writes in place


def refuse_links(workdir: str) -> None:
    """A run's own files must not be symbolic links: refused, naming the link and its target.

    Opening one to write (the lock is truncated, metrics.jsonl appended to) would change the file it points to,
    whatever it is. Refused before anything in the folder is opened. (Folders given as links, checkpoints/ on another
    disk, are used.)"""
    for name in RUN_FILES:
        path = os.path.join(workdir, name)
        if os.path.islink(path):
            raise UserError(f"{path} is a symbolic link (to {os.readlink(path)}); infjax writes that file of a run "
                            f"folder itself and does not follow links there: remove the link, or choose another "
                            f"--workdir")


class MetricsLog:
    """WORKDIR/metrics.jsonl: one JSON object per logged step or evaluation, each step once.

    `start(step)` prepares the file for a run that begins after `step`: a fresh
    run (step 0) never appends to an earlier run's file (that file is renamed
    metrics.jsonl.<time>.old and kept); a resumed run drops the records written
    after its checkpoint's step (they are written again as the steps re-run).

    Locally every record is appended at once. On an object store the records are
    kept in memory and the object is rewritten by `flush()`, which the trainer
    calls at every checkpoint and at the end: a kill loses only records of steps
    after the last checkpoint, which the resumed run computes and writes again.
    """

    def __init__(self, workdir: str, enabled: bool = True):
        self.enabled = enabled
        self.path = storage.join(workdir, METRICS_FILE)
        self.remote = storage.is_remote(workdir)
        self._lines: list[str] = []          # object store: the file's content
        self._dirty = False

    def start(self, step: int) -> None:
        if not self.enabled or not storage.exists(self.path):
            return
        if step == 0:
            stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
            aside = f"{self.path}.{stamp}.old"
            storage.rename(self.path, aside)
            log.warning("%s belonged to an earlier run without checkpoints; kept as %s", self.path, aside)
            return
        kept, dropped, damaged = [], 0, []
        for number, line in enumerate(storage.read_text(self.path).splitlines(keepends=True), 1):
            if not line.strip():
                continue
            try:
                record_step = json.loads(line).get("step", 0)
            except (ValueError, AttributeError):   # cut off by a kill, or edited: kept aside, never deleted
                damaged.append((number, line if line.endswith("\n") else line + "\n"))
                continue
            if record_step <= step:
                kept.append(line if line.endswith("\n") else line + "\n")
            else:
                dropped += 1
        if self.remote:
            self._lines = kept
        if damaged:
            stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
            aside = f"{self.path}.{stamp}.damaged"
            storage.write_text(aside, "".join(f"line {n}: {text}" for n, text in damaged))
            log.warning("%s: line(s) %s are not JSON records (a line cut off by a kill, or an edit); moved to %s",
                        self.path, [n for n, _ in damaged], aside)
        if dropped or damaged:
            storage.write_text(self.path, "".join(kept))
        if dropped:
            log.info("%s: dropped %d record(s) of steps after %d (the resumed steps write them again)",
                     self.path, dropped, step)

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        line = json.dumps(record) + "\n"
        if self.remote:
            self._lines.append(line)
            self._dirty = True
            return
        try:                            # never through a link (see refuse_links): O_NOFOLLOW
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            with os.fdopen(fd, "a", encoding="utf-8") as f:
                f.write(line)
        except OSError as e:            # a full disk: the message names the file (write() errors name none)
            raise OSError(e.errno, e.strerror, self.path) from e

    def flush(self) -> None:
        """Object store: rewrite the object with every record so far (locally records are already written)."""
        if self.enabled and self.remote and self._dirty:
            storage.write_text(self.path, "".join(self._lines))
            self._dirty = False
