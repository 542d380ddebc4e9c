"""infjax/evaluation/tasks.py: scoring tasks, as infjax.evaluate and the trainer's evaluation do."""
import numpy as np
import pytest

from infjax.data.tokenize import TextFormat
from infjax.evaluation import datasets as eval_data, tasks as eval_tasks
from tests.helpers.evaluation import fake_embed, write_beir, write_followir


def test_evaluate_during_training_on_specs(tmp_path):
    beir = write_beir(str(tmp_path / "toy"))
    fir = write_followir(str(tmp_path / "news21-instructions"))
    specs = [f"beir:{beir}", f"followir:{fir}", "synthetic:seed=7,num_queries=3,pool_size=8"]
    out = eval_tasks.evaluate_specs(specs, eval_tasks.template_pairs(fake_embed, TextFormat()), fake_embed, TextFormat())
    assert set(out) == set(specs)
    assert set(out[specs[0]]) == {"ndcg@10", "map@100", "recall@100", "mrr", "main"}
    assert out[specs[1]]["main"] == out[specs[1]]["ndcg@5"]
    assert out[specs[1]] == pytest.approx(out[specs[2]])               # the same queries, two loaders
    again = eval_tasks.evaluate_specs(specs, eval_tasks.template_pairs(fake_embed, TextFormat()), fake_embed, TextFormat())
    assert again == out


@pytest.mark.parametrize("side", ["passages", "queries"])
def test_a_non_finite_embedding_never_reaches_a_metric(tmp_path, side):
    task = eval_data.load(f"beir:{write_beir(str(tmp_path / 'toy'))}")[0]

    def poisoned(embed):
        def f(*texts):
            out = np.array(embed(*texts), np.float32)
            out[-1, 0] = np.nan
            return out
        return f

    pairs = eval_tasks.template_pairs(fake_embed, TextFormat())
    embed_pairs, embed_passage = (pairs, poisoned(fake_embed)) if side == "passages" else (poisoned(pairs),
                                                                                          fake_embed)
    with pytest.raises(eval_tasks.NonFiniteEmbeddings, match=rf"{side}: 1 of \d+ embeddings are not finite"):
        eval_tasks.evaluate_task(task, embed_pairs, embed_passage, TextFormat(), top_k=10)
