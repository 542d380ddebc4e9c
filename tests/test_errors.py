"""infjax/errors.py: the one-line report of every entry point, and its streams after a closed terminal."""
import logging
import os
import subprocess
import sys

from infjax import errors
from tests.helpers.paths import ROOT


def test_report_sorts_user_errors_from_bugs(capsys):
    assert errors.report("prog", errors.ConfigError("config.x=1: bad")) == 2
    assert errors.report("prog", OSError(28, "No space left on device", "/ckpt/x")) == 3
    assert errors.report("prog", KeyboardInterrupt()) == 130
    assert errors.report("prog", FileNotFoundError(2, "No such file or directory", "/d.jsonl")) == 2
    assert errors.report("prog", ZeroDivisionError("bug")) is None
    err = capsys.readouterr().err.splitlines()
    assert err == ["prog: error: config.x=1: bad",
                   "prog: error: no space left on the device writing /ckpt/x: No space left on device",
                   "prog: error: interrupted (Ctrl-C)",
                   "prog: error: /d.jsonl: No such file or directory"]


def test_follow_on_errors_of_a_failed_save_are_counted_not_printed(capsys):
    """tensorstore's late callbacks into Orbax's closed loop (unraisable, one per pending write) become one count;
    Orbax's own error lines keep their message and lose their traceback; anything else is shown as before."""
    import types

    def unraisable(message):
        return types.SimpleNamespace(exc_type=RuntimeError, exc_value=RuntimeError(message), exc_traceback=None,
                                     err_msg=None, object=None)

    shown = []
    previous, sys.unraisablehook = sys.unraisablehook, shown.append
    try:
        with errors.closed_loop_callbacks_counted("prog"):
            for _ in range(3):
                sys.unraisablehook(unraisable("Event loop is closed"))
            sys.unraisablehook(unraisable("something else"))
    finally:
        sys.unraisablehook = previous
    assert [str(u.exc_value) for u in shown] == ["something else"]
    assert "prog: warning: 3 storage callbacks arrived after the checkpoint writer closed" in capsys.readouterr().err

    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(logging.Formatter().format(record))
    logger = logging.getLogger("absl")
    logger.addHandler(handler)
    try:
        with errors.library_errors_one_line():
            for path in ("/site-packages/orbax/checkpoint/future.py", "/work/infjax/train.py"):
                try:
                    raise ValueError("OUT_OF_RANGE: write failed")
                except ValueError:
                    logger.handle(logger.makeRecord("absl", logging.ERROR, path, 1, "failed: %s",
                                                    ("x",), sys.exc_info()))
    finally:
        logger.removeHandler(handler)
    assert records[0] == "failed: x"                                   # Orbax's line, without its traceback
    assert records[1].startswith("failed: x\nTraceback") and "OUT_OF_RANGE" in records[1]   # ours keep theirs


HUNG_UP_CHILD = """
import os, signal, sys, time
from infjax import errors
os.close(os.open(os.ttyname(0), os.O_RDWR))     # a session leader opening its terminal: its controlling terminal
gone = []
signal.signal(signal.SIGHUP, lambda *a: gone.extend(errors.drop_hung_up_streams()))
print("ready", flush=True)
deadline = time.monotonic() + 20
while not gone and time.monotonic() < deadline:
    time.sleep(0.01)
print("after the hang-up", flush=True)             # on the dead terminal: an I/O error
sys.stderr.write("and on stderr\\n")
sys.stderr.flush()
open(sys.argv[1], "w").write(repr(gone))
"""


def test_a_closed_terminal_sends_the_last_lines_to_dev_null_not_to_an_io_error(tmp_path):
    """After SIGHUP from a closed terminal every write to it fails (EIO): export's one line then ended it with a
    traceback and exit 1. `drop_hung_up_streams` points both streams at /dev/null; the program goes on."""
    import pty

    master, slave = pty.openpty()
    result = tmp_path / "gone.txt"
    child = subprocess.Popen([sys.executable, "-c", HUNG_UP_CHILD, str(result)], stdin=slave, stdout=slave,
                             stderr=slave, start_new_session=True, env={**os.environ, "PYTHONPATH": ROOT})
    os.close(slave)
    seen = b""
    while b"ready" not in seen:
        seen += os.read(master, 1024)
    os.close(master)                           # the terminal hangs up: the kernel sends SIGHUP to its session
    assert child.wait(timeout=30) == 0
    assert result.read_text() == "[1, 2]"
