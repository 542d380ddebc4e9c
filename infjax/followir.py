"""FollowIR-style evaluation: rerank each query's pool under both instructions, then score."""
from __future__ import annotations

from typing import Callable

import numpy as np

from infjax.data.synthetic import FollowIRSplit
from infjax.data.tokenize import TextFormat
from infjax.metrics import p_mrr, trec_metrics

EmbedFn = Callable[[list[str]], np.ndarray]   # texts -> normalized embeddings [N, d]
PairEmbedFn = Callable[[list[str], list[str]], np.ndarray]   # (instructions, queries) -> iq embeddings


def rerank(split: FollowIRSplit, embed_query: EmbedFn, embed_passage: EmbedFn, fmt: TextFormat
           ) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
    """Runs {qid: {doc id: cosine}} under the original and under the changed instruction,
    the instruction-aware query being one text (Interaction I: the template)."""
    def embed_pairs(instructions, queries):
        return embed_query([fmt.query(i, q) for i, q in zip(instructions, queries)])
    return rerank_pairs(split, embed_pairs, embed_passage, fmt)


def rerank_pairs(split: FollowIRSplit, embed_pairs: PairEmbedFn, embed_passage: EmbedFn, fmt: TextFormat
                 ) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
    """Like `rerank`, for any way of embedding (instruction, query) pairs (e.g. Interaction II)."""
    qids = sorted(split.queries)
    doc_ids = sorted(split.corpus)
    docs = embed_passage([fmt.passage(split.corpus[d]) for d in doc_ids])
    row = {d: i for i, d in enumerate(doc_ids)}
    runs = []
    for instructions in (split.instructions_og, split.instructions_changed):
        queries = embed_pairs([instructions[q] for q in qids], [split.queries[q] for q in qids])
        run = {}
        for qi, q in enumerate(qids):
            pool = split.candidates[q]
            s = docs[[row[d] for d in pool]] @ queries[qi]
            run[q] = {d: float(v) for d, v in zip(pool, s)}
        runs.append(run)
    return runs[0], runs[1]


def followir_metrics(split: FollowIRSplit, run_og, run_new, ndcg_at: str = "ndcg@5") -> dict[str, float]:
    """p-MRR (x100) between the two runs, and nDCG of the original run against the original qrels."""
    means, _ = trec_metrics(split.qrels_og, run_og, (ndcg_at,))
    return {"p_mrr": p_mrr(run_og, run_new, split.qrels_og, split.qrels_changed), ndcg_at: means[ndcg_at]}
