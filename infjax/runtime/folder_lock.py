"""One writer per output folder: an exclusive `flock` on FOLDER/.infjax.lock for as long as a program writes there.

Training holds it on its workdir (training/workdir.py), evaluation and curation on their --out. A second
process given the same folder is refused in one line that names the holder (pid, host, start time) and the
flag to change. The kernel drops a flock when its process dies, however it dies, so a lock file that still
names a holder but can be locked was left by a process that ended without releasing it: it is reported and
taken over. A clean release empties the file (it is kept: removing it would let a process that opened it
meanwhile and one that creates it anew both hold "the" lock). A folder the lock created and that holds
nothing else on release is removed, so a program refused before it wrote anything leaves no folder behind.
On an object store (gs://, s3://) there is no flock: there is no lock, and one writer per folder is the
user's to keep.
"""
from __future__ import annotations

import datetime
import errno
import fcntl
import json
import logging
import os
import socket

from infjax.errors import UserError
from infjax.runtime import storage

log = logging.getLogger("infjax.lock")

LOCK_FILE = ".infjax.lock"


class FolderBusy(UserError):
    """Another live process holds the folder's lock."""


class FolderLock:
    """The lock of `folder` (a context manager).

    `flag` (--out, --workdir) and `holder` (an evaluation, a run) name the folder and what holds it in the messages.
    Disabled (`enabled=False`, e.g. on processes other than 0 of a multi-process job, which write nothing there) it
    does nothing."""

    def __init__(self, folder: str, *, flag: str = "--out", holder: str = "process", enabled: bool = True):
        self.folder, self.flag, self.holder, self.enabled = folder, flag, holder, enabled
        self.path = os.path.join(folder, LOCK_FILE)
        self._fd: int | None = None
        self._created = False

    def remote_note(self) -> str:
        return (f"{self.flag}={self.folder} is on an object store: no lock; run one {self.holder} per folder "
                f"yourself")

    def refuse_links(self) -> None:
        """The lock file must not be a symbolic link (opening it truncates it): refused, naming the target."""
        if os.path.islink(self.path):
            raise UserError(f"{self.path} is a symbolic link (to {os.readlink(self.path)}); infjax writes that "
                            f"file itself and does not follow links there: remove the link, or choose another "
                            f"{self.flag}")

    def __enter__(self) -> "FolderLock":
        if not self.enabled:
            return self
        if storage.is_remote(self.folder):
            log.info("%s", self.remote_note())
            return self
        if os.path.exists(self.folder) and not os.path.isdir(self.folder):
            raise UserError(f"{self.flag}={self.folder} exists and is not a folder")
        self._created = not os.path.exists(self.folder)
        self.refuse_links()
        try:
            os.makedirs(self.folder, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            if e.errno == errno.ELOOP:       # a link planted after the check above
                self.refuse_links()
            raise PermissionError(f"{self.flag}={self.folder} is not writable: {e.strerror or e}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = _read(fd)
            os.close(fd)
            raise FolderBusy(f"{self.flag}={self.folder} is in use by another {self.holder} ({_describe(holder)}); "
                             f"wait for it to end or choose another {self.flag}") from None
        stale = _read(fd)
        if stale:
            log.warning("%s: taking over the lock of a %s that ended without releasing it (%s)", self.path,
                        self.holder, _describe(stale))
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                  "started": datetime.datetime.now().isoformat(timespec="seconds")}).encode(), 0)
        os.fsync(fd)
        self._fd = fd
        return self

    def __exit__(self, *exc) -> bool:
        if self._fd is None:
            return False
        os.ftruncate(self._fd, 0)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None
        if self._created and os.listdir(self.folder) == [LOCK_FILE]:
            os.remove(self.path)
            os.rmdir(self.folder)
        return False


def _read(fd: int) -> dict:
    try:
        data = os.pread(fd, 4096, 0)
        return json.loads(data) if data.strip() else {}
    except (OSError, ValueError):
        return {"unreadable": True}


def _describe(holder: dict) -> str:
    if not holder:
        return "holder unknown"
    if holder.get("unreadable"):
        return "lock file unreadable"
    return f"pid {holder.get('pid')} on host {holder.get('host')}, started {holder.get('started')}"
