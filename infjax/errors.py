"""What can go wrong for a user, and how every entry point reports it.

Two kinds of failure reach a command line:

- `UserError`: input that cannot work (a flag, a config key, a data file or
  row, a run folder). The message names the thing to change. Exit status 2.
- `RunStopped`: a run that started and had to stop for a cause the user must
  look at (a non-finite step under train.nonfinite=stop, a full disk). The
  message says what is kept (the last good checkpoint). Exit status 3.

Every error class of the package that describes bad input derives from
`UserError`, so an entry point needs one handler, `reported(prog)`: one line
on stderr, the exit status, no traceback. Anything else is a bug and keeps its
traceback. Ctrl-C exits 130 with one line; SIGTERM (SIGHUP) inside `sigterm_raises` (an export) exits 143
(129) with one line, once the interrupted code has cleaned up.

This module imports nothing of infjax: every layer may raise its errors.
"""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import sys
import threading


class UserError(Exception):
    """Input that cannot work; the message names the flag, key, file, row or field to change."""

    exit_code = 2


class ConfigError(UserError, ValueError):
    """A config value that cannot work; the message names the key (config.a.b=value)."""


class RunStopped(Exception):
    """A started run stopped for a cause the user must look at; the message says what was kept."""

    exit_code = 3


class Terminated(BaseException):
    """SIGTERM or SIGHUP inside `sigterm_raises`: raised where the program is, so that its cleanup runs.

    Its cleanup (a temporary folder) runs as it does for Ctrl-C. A BaseException, as KeyboardInterrupt is, so that no
    `except Exception` of a library swallows it. Exit status 128 + the signal (143, 129), as for a process the signal
    ends."""

    exit_code = 128 + signal.SIGTERM

    def __init__(self, message: str = "", signum: int = signal.SIGTERM):
        super().__init__(message)
        self.signum, self.exit_code = signum, 128 + signum


STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)     # a scheduler's stop; a closed terminal or SSH session
# The terminal's signals: one the process was started ignoring stays ignored (`catch`), as Python keeps SIGINT.
TERMINAL_SIGNALS = (signal.SIGHUP, signal.SIGINT)


def catch(signals, handler) -> dict:
    """Install `handler` for each of `signals` (main thread only) and return the handlers it replaced, to put back.

    A terminal signal (SIGHUP, SIGINT) that is ignored stays ignored: `nohup` ignores SIGHUP so that a run outlives its
    terminal, and a shell starts a background job with SIGINT ignored so that Ctrl-C spares it. SIGTERM is always
    caught: it is how a scheduler stops a job."""
    return {sig: signal.signal(sig, handler) for sig in signals
            if not (sig in TERMINAL_SIGNALS and signal.getsignal(sig) is signal.SIG_IGN)}


# Built-in errors whose message already names the path (FileNotFoundError: [Errno 2] ...: 'x').
_PATH_ERRORS = (FileNotFoundError, FileExistsError, PermissionError, NotADirectoryError, IsADirectoryError)
DEVICE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EFBIG, errno.EROFS)
EXIT_INTERRUPTED = 130


FULL_DISK = (errno.ENOSPC, errno.EDQUOT)     # a full disk, a full quota


def full_disk(error: BaseException) -> OSError | None:
    """The OSError of a full disk or quota behind `error` (itself, its cause or context), else None."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in FULL_DISK:
            return error
        error = error.__cause__ or error.__context__
    return None


def byte_size(n: float) -> str:
    """`n` bytes in the binary unit that shows it: "512 bytes", "4.08 MiB", "1.23 GiB", "215 GiB"."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            value = n / scale
            return f"{value:.3g} {unit}" if abs(value) < 1000 else f"{value:.0f} {unit}"
    return f"{int(n)} bytes"


def current_folder_gone() -> str | None:
    """The error line when the current folder no longer exists (deleted or moved under the running command:
    every relative path, and libraries that resolve one at import, fail with a bare `[Errno 2]`), else None."""
    try:
        os.getcwd()
        return None
    except FileNotFoundError:
        where = os.environ.get("PWD", "")         # the shell's name for it; not named where it is stale (exists)
        named = os.path.isabs(where) and not os.path.exists(where)
        return (f"the current folder{f' {where}' if named else ''} no longer exists (deleted or moved "
                f"while the command ran in it): cd to a folder that exists and run the command again")


def describe(error: BaseException) -> str:
    """The one-line (or few-line) message of `error` as a user sees it."""
    if isinstance(error, FileNotFoundError) and not os.path.isabs(str(error.filename or "")):
        gone = current_folder_gone()
        if gone:
            return f"{error.filename}: {gone}" if error.filename else gone
    if isinstance(error, OSError) and error.errno == errno.ENOSPC:
        where = f" writing {error.filename}" if error.filename else ""
        return f"no space left on the device{where}: {error.strerror or error}"
    if isinstance(error, _PATH_ERRORS) and error.strerror and error.filename:
        return f"{error.filename}: {error.strerror}"
    return str(error) or type(error).__name__


def exit_code(error: BaseException) -> int | None:
    """The exit status for an error an entry point reports in one line; None for a bug (keep the traceback)."""
    if isinstance(error, (UserError, RunStopped, Terminated)):
        return error.exit_code
    if isinstance(error, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    if isinstance(error, OSError):
        # A full disk or a failing device stops a run; any other OSError (a missing or unreadable file, a
        # library's "cannot load ..." message) is about the input.
        return RunStopped.exit_code if error.errno in DEVICE_ERRNOS else UserError.exit_code
    return None


def report(prog: str, error: BaseException, log=None) -> int | None:
    """Print `error` as one line and return its exit status; None (nothing printed) for a bug.

    The library coroutines a reported error left pending stay quiet as the process exits
    (`_orphaned_library_coroutine`).

    `log` (a logging.Logger) is used instead of stderr when given, so the line carries the time stamp and prefix of the
    run's other lines.
    """
    code = exit_code(error)
    if code is None:
        return None
    _quiet_orphaned_coroutines()
    message = "interrupted (Ctrl-C)" if isinstance(error, KeyboardInterrupt) else describe(error)
    if log is not None:
        log.error("%s", message)
    else:
        print(f"{prog}: error: {message}", file=sys.stderr)
    return code


def drop_hung_up_streams() -> list[int]:
    """Point stdout and stderr at /dev/null where their terminal is gone; returns the file descriptors redirected.

    After SIGHUP from a closed terminal or SSH session every write to it fails with an I/O error, which would end the
    program before its cleanup or save. A live terminal or a log file is kept."""
    gone = []
    for fd in (1, 2):
        try:
            os.write(fd, b"")
        except OSError:
            gone.append(fd)
    if gone:
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            for fd in gone:
                os.dup2(null, fd)
        finally:
            os.close(null)
    return gone


@contextlib.contextmanager
def sigterm_raises(what: str):
    """Inside: SIGTERM or SIGHUP raises `Terminated` in the main thread, so that the code it interrupts cleans up.

    The error is Terminated("terminated (SIGTERM) `what`", or SIGHUP); the code it interrupts cleans up on its way out
    (nothing else happens in other threads, or outside the block). Under `nohup` SIGHUP stays ignored (`catch`)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):   # noqa: ARG001
        if signum == signal.SIGHUP:
            drop_hung_up_streams()
        raise Terminated(f"terminated ({signal.Signals(signum).name}) {what}", signum)

    previous = catch(STOP_SIGNALS, handler)
    try:
        yield
    finally:
        for sig, handler_before in previous.items():
            signal.signal(sig, handler_before)


@contextlib.contextmanager
def sigterm_held():
    """Inside: SIGTERM and SIGHUP wait (blocked) until the block is done, for a few steps that must not be cut
    apart (renaming a finished folder into place); a signal that arrived meanwhile is delivered at the end."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, set(STOP_SIGNALS))
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, set(STOP_SIGNALS))


def _closed_loop_callback(unraisable) -> bool:
    """An exception raised by a storage callback after Orbax closed its asyncio loop.

    When a checkpoint write fails (disk full, file too large), tensorstore still completes each pending
    chunk write and calls back into the loop Orbax has already closed; every call ends as an unraisable
    `RuntimeError: Event loop is closed` (hundreds of tracebacks, all consequences of the one failure
    that the run reports)."""
    return (unraisable.exc_type is RuntimeError and str(unraisable.exc_value) == "Event loop is closed"
            and unraisable.object is None)


@contextlib.contextmanager
def closed_loop_callbacks_counted(prog: str, log=None):
    """Inside: the follow-on errors of `_closed_loop_callback` are counted, not printed; one line at the end."""
    previous, count = sys.unraisablehook, 0

    def hook(unraisable):
        nonlocal count
        if _closed_loop_callback(unraisable):
            count += 1
        else:
            previous(unraisable)

    sys.unraisablehook = hook
    try:
        yield
    finally:
        sys.unraisablehook = previous
        if count:
            message = (f"{count} storage callbacks arrived after the checkpoint writer closed its event loop "
                       "(follow-on errors of a failed write; not shown)")
            if log is not None:
                log.warning("%s", message)
            else:
                print(f"{prog}: warning: {message}", file=sys.stderr)


class _LibraryErrorsOneLine(logging.Filter):
    """Orbax logs every failure of its background save threads with a traceback of its own internals, then
    raises the same error to the run, which reports it in one line: keep Orbax's lines, drop their traces."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and "/orbax/" in record.pathname.replace("\\", "/"):
            record.exc_info, record.exc_text = None, None
        return True


@contextlib.contextmanager
def library_errors_one_line():
    one_line = _LibraryErrorsOneLine()
    loggers = [logging.getLogger("absl"), logging.getLogger()]      # Orbax logs through absl's logger
    for logger in loggers:
        logger.addFilter(one_line)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(one_line)


def _orphaned_library_coroutine(unraisable) -> bool:
    """Whether `unraisable` is a storage library's coroutine finalized with an error already reported.

    A coroutine of a storage library (Orbax's array reads and writes) finalized with the error of an operation that
    already failed and was reported: when one array of a checkpoint cannot be read, each of the other pending reads
    ends this way as the process exits (a traceback with a TensorStore spec each, thousands of lines after the one that
    says what happened)."""
    code = getattr(unraisable.object, "cr_code", None)
    path = code.co_filename.replace("\\", "/") if code is not None else ""
    return "/orbax/" in path or "/tensorstore/" in path


def _quiet_orphaned_coroutines() -> None:
    """From now until the process exits, `_orphaned_library_coroutine` and `_closed_loop_callback` errors (the
    follow-on errors of one already reported) are not printed."""
    previous = sys.unraisablehook
    if getattr(previous, "quiets_orphaned_coroutines", False):
        return

    def hook(unraisable):
        if not (_orphaned_library_coroutine(unraisable) or _closed_loop_callback(unraisable)):
            previous(unraisable)

    hook.quiets_orphaned_coroutines = True
    sys.unraisablehook = hook


@contextlib.contextmanager
def reported(prog: str, log=None):
    """The body of an entry point: a reportable error becomes one line and SystemExit(status)."""
    try:
        with closed_loop_callbacks_counted(prog, log), library_errors_one_line():
            yield
    except (Exception, KeyboardInterrupt, Terminated) as e:   # noqa: BLE001 - report() sorts errors from bugs
        code = report(prog, e, log)
        if code is None:
            raise
        raise SystemExit(code) from None
