"""p-MRR on hand-computed cases; trec metrics through pytrec_eval."""
import numpy as np
import pytest

from infjax.evaluation.metrics import p_mrr, p_mrr_per_query, rank_change_score, ranks, trec_metrics


def test_ranks_break_ties_by_doc_id():
    assert ranks({"b": 1.0, "a": 1.0, "c": 2.0}) == {"c": 1, "a": 2, "b": 3}


def test_rank_change_score_signs():
    assert rank_change_score(2, 4) == pytest.approx(0.5)       # moved down: 1 - 2/4
    assert rank_change_score(4, 2) == pytest.approx(-0.5)      # moved up: 2/4 - 1
    assert rank_change_score(3, 3) == 0.0


QRELS_OG = {"q": {"d1": 1, "d2": 1, "d3": 0}}
QRELS_NEW = {"q": {"d1": 1, "d2": 0, "d3": 0}}     # only d2 changes


def test_p_mrr_improvement():
    og = {"q": {"d1": 0.9, "d2": 0.8, "d3": 0.1}}  # d2 at rank 2
    new = {"q": {"d1": 0.9, "d2": 0.0, "d3": 0.1}}  # d2 at rank 3
    assert p_mrr(og, new, QRELS_OG, QRELS_NEW) == pytest.approx(100 * (1 - 2 / 3))


def test_p_mrr_degradation():
    og = {"q": {"d1": 0.9, "d2": 0.8, "d3": 0.1}}  # rank 2
    new = {"q": {"d1": 0.5, "d2": 0.8, "d3": 0.1}}  # rank 1
    assert p_mrr(og, new, QRELS_OG, QRELS_NEW) == pytest.approx(100 * (1 / 2 - 1))


def test_p_mrr_ties_broken_by_doc_id():
    og = {"q": {"d1": 0.5, "d2": 0.5, "d3": 0.5}}  # d1, d2, d3 -> d2 at rank 2
    new = {"q": {"d1": 0.5, "d2": 0.5, "d3": 0.9}}  # d3, d1, d2 -> d2 at rank 3
    assert p_mrr(og, new, QRELS_OG, QRELS_NEW) == pytest.approx(100 * (1 - 2 / 3))


def test_p_mrr_missing_document_gets_rank_len_plus_one():
    og = {"q": {"d1": 0.9, "d2": 0.8, "d3": 0.1}}  # d2 at rank 2
    new = {"q": {"d1": 0.9, "d3": 0.1}}             # d2 missing -> rank 3
    assert p_mrr(og, new, QRELS_OG, QRELS_NEW) == pytest.approx(100 * (1 - 2 / 3))


def test_p_mrr_averages_per_query_then_over_queries():
    qrels_og = {"a": {"x": 1, "y": 1}, "b": {"x": 1}}
    qrels_new = {"a": {"x": 0, "y": 0}, "b": {"x": 0}}
    og = {"a": {"x": 2.0, "y": 1.0, "z": 0.0}, "b": {"x": 1.0, "w": 0.0}}
    new = {"a": {"x": 0.0, "y": 1.0, "z": 2.0}, "b": {"x": 1.0, "w": 0.0}}
    # a: x 1->3 (+2/3), y 2->2 (0): mean 1/3;  b: x 1->1 (0).  Overall (1/3 + 0) / 2.
    assert p_mrr(og, new, qrels_og, qrels_new) == pytest.approx(100 / 6)
    assert p_mrr_per_query(og, new, qrels_og, qrels_new) == pytest.approx({"a": 100 / 3, "b": 0.0})


def test_p_mrr_without_changed_documents_raises():
    with pytest.raises(ValueError, match="no query"):
        p_mrr({}, {}, QRELS_OG, QRELS_OG)


def test_trec_metrics_known_values():
    qrels = {"q": {"d1": 1, "d3": 1}}
    run = {"q": {"d1": 0.3, "d2": 0.9, "d3": 0.1}}   # ranking d2, d1, d3
    means, per_query = trec_metrics(qrels, run, ("map@1000", "ndcg@5", "mrr", "recall@100"))
    assert means["map@1000"] == pytest.approx((1 / 2 + 2 / 3) / 2)
    idcg = 1 + 1 / 1.5849625007211562
    assert means["ndcg@5"] == pytest.approx((1 / 1.5849625007211562 + 1 / 2) / idcg)
    assert means["mrr"] == pytest.approx(0.5)
    assert means["recall@100"] == pytest.approx(1.0)
    assert per_query["q"]["mrr"] == pytest.approx(0.5)


def test_unknown_metric_is_refused():
    with pytest.raises(ValueError, match="unknown metrics"):
        trec_metrics({"q": {"d": 1}}, {"q": {"d": 1.0}}, ("ndcg@7",))


def test_map_and_ndcg_equal_pytrec_eval_on_a_fixture():
    import pytrec_eval

    rng = np.random.default_rng(0)
    docs = [f"d{i}" for i in range(30)]
    qrels = {f"q{j}": {d: int(rng.integers(0, 3)) for d in rng.choice(docs, 8, replace=False)} for j in range(6)}
    qrels["q_allzero"] = {"d1": 0, "d2": 0}
    run = {q: {d: float(rng.integers(0, 5)) for d in docs} for q in qrels}      # integer scores: many ties
    means, per_query = trec_metrics(qrels, run, ("map@1000", "map@100", "ndcg@5", "ndcg@10", "recall@100", "mrr"))
    ref = pytrec_eval.RelevanceEvaluator(qrels, {"map_cut", "ndcg_cut", "recall", "recip_rank"}).evaluate(run)
    names = {"map@1000": "map_cut_1000", "map@100": "map_cut_100", "ndcg@5": "ndcg_cut_5",
             "ndcg@10": "ndcg_cut_10", "recall@100": "recall_100", "mrr": "recip_rank"}
    for ours, theirs in names.items():
        assert means[ours] == pytest.approx(np.mean([ref[q][theirs] for q in qrels]))
        for q in qrels:
            assert per_query[q][ours] == pytest.approx(ref[q][theirs])
