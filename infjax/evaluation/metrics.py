"""Retrieval metrics: p-MRR (docs/method.md §5.2) and trec_eval measures through pytrec_eval.

A run is {query id: {doc id: score}}; qrels are {query id: {doc id: grade}}.
"""
from __future__ import annotations

import numpy as np

# Our metric names -> pytrec_eval measure names.
TREC_MEASURES = {
    "map@1000": "map_cut_1000", "map@100": "map_cut_100",
    "ndcg@5": "ndcg_cut_5", "ndcg@10": "ndcg_cut_10",
    "recall@100": "recall_100", "mrr": "recip_rank",
}


def ranks(run: dict[str, float]) -> dict[str, int]:
    """1-based ranks by descending score; equal scores are ordered by doc id."""
    order = sorted(run, key=lambda d: (-run[d], d))
    return {d: i + 1 for i, d in enumerate(order)}


def rank_change_score(rank_og: int, rank_new: int) -> float:
    """Per-document p-MRR term: > 0 when the document moved down, < 0 when it moved up."""
    if rank_og >= rank_new:
        return rank_new / rank_og - 1.0
    return 1.0 - rank_og / rank_new


def changed_documents(og: dict[str, int], new: dict[str, int]) -> list[str]:
    """One query's documents whose relevance differs between its original and changed qrels, sorted."""
    return [d for d in sorted(set(og) | set(new)) if og.get(d, 0) != new.get(d, 0)]


def p_mrr_per_query(run_og: dict[str, dict[str, float]], run_new: dict[str, dict[str, float]],
                    qrels_og: dict[str, dict[str, int]], qrels_new: dict[str, dict[str, int]]) -> dict[str, float]:
    """Per-query p-MRR terms (x100): {query id: mean rank-change score over its changed documents}.

    For each query, over the documents whose relevance differs between the
    original and changed qrels: the mean of `rank_change_score`; a document
    missing from a run gets rank |run| + 1. Queries with no such document are
    left out.
    """
    per_query = {}
    for qid in sorted(qrels_og):
        changed = changed_documents(qrels_og[qid], qrels_new.get(qid, {}))
        if not changed:
            continue
        r_og, r_new = ranks(run_og.get(qid, {})), ranks(run_new.get(qid, {}))
        miss_og, miss_new = len(r_og) + 1, len(r_new) + 1
        per_query[qid] = 100.0 * float(np.mean([rank_change_score(r_og.get(d, miss_og), r_new.get(d, miss_new))
                                                for d in changed]))
    return per_query


def p_mrr(run_og: dict[str, dict[str, float]], run_new: dict[str, dict[str, float]],
          qrels_og: dict[str, dict[str, int]], qrels_new: dict[str, dict[str, int]]) -> float:
    """Pairwise MRR (FollowIR), x100: the mean over queries of `p_mrr_per_query`."""
    per_query = p_mrr_per_query(run_og, run_new, qrels_og, qrels_new)
    if not per_query:
        raise ValueError("p-MRR: no query has a document whose relevance differs between the two qrels")
    return float(np.mean(list(per_query.values())))


def trec_metrics(qrels: dict[str, dict[str, int]], run: dict[str, dict[str, float]],
                 metrics: tuple[str, ...] = ("ndcg@10",)) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """Mean and per-query values of `metrics` (keys of TREC_MEASURES) through pytrec_eval."""
    import pytrec_eval

    unknown = [m for m in metrics if m not in TREC_MEASURES]
    if unknown:
        raise ValueError(f"unknown metrics {unknown}; choose from {sorted(TREC_MEASURES)}")
    measures = {TREC_MEASURES[m].rsplit("_", 1)[0] if TREC_MEASURES[m][-1].isdigit() else TREC_MEASURES[m]
                for m in metrics}
    evaluator = pytrec_eval.RelevanceEvaluator(qrels, measures)
    per_query_raw = evaluator.evaluate({q: {d: float(s) for d, s in docs.items()} for q, docs in run.items()})
    per_query = {q: {m: vals[TREC_MEASURES[m]] for m in metrics} for q, vals in per_query_raw.items()}
    means = {m: float(np.mean([v[m] for v in per_query.values()])) if per_query else 0.0 for m in metrics}
    return means, per_query
