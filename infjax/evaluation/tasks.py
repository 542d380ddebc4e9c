"""Scoring a model on one evaluation task: rerank (FollowIR), retrieve (full corpus), score.

A model enters as two functions: `embed_pairs(instructions, queries)` for the
instruction-aware queries (`template_pairs(embed_query, fmt)` for one-text
models, Interaction II's pair embedder otherwise) and `embed_passage(texts)`;
both return L2-normalized float32 embeddings [N, d]. The same functions serve
`infjax.evaluate` and evaluation during training, so the two cannot disagree.
"""
from __future__ import annotations

import functools
import json

import numpy as np

from infjax import errors
from infjax.data.tokenize import TextFormat
from infjax.data.types import FollowIRSplit
from infjax.evaluation import datasets
from infjax.evaluation.datasets import DataError, FollowIRTask, RetrievalTask
from infjax.evaluation.metrics import p_mrr, p_mrr_per_query, trec_metrics
from infjax.inference.embedders import EmbedFn, PairEmbedFn
from infjax.inference.search import search

Run = dict[str, dict[str, float]]          # {query id: {doc id: score}}


class NonFiniteEmbeddings(errors.RunStopped):
    """The model gave NaN or infinite embeddings: no score computed from them may reach a metric."""


def finite(embeddings, ids: list[str], what: str):
    """`embeddings` [N, d] unchanged when every value is finite; else NonFiniteEmbeddings naming the count and
    the first ids (a text past the position table, broken weights, an overflow in bfloat16)."""
    embeddings = np.asarray(embeddings)
    bad = ~np.isfinite(embeddings).all(axis=1)
    if bad.any():
        first = [ids[i] for i in np.flatnonzero(bad)[:3]]
        raise NonFiniteEmbeddings(f"{what}: {int(bad.sum())} of {len(ids)} embeddings are not finite (NaN or "
                                  f"inf; first ids {first}); no metric is computed from them")
    return embeddings


def template_pairs(embed_query: EmbedFn, fmt: TextFormat) -> PairEmbedFn:
    """Interaction I: (instructions, queries) -> embed_query(fmt.query(instruction, query))."""
    return lambda ins, qs: embed_query([fmt.query(i, q) for i, q in zip(ins, qs)])


def recording(embed_pairs: PairEmbedFn, embed_passage: EmbedFn, memo: dict) -> tuple[PairEmbedFn, EmbedFn]:
    """The two encoders, each call's embeddings also kept in `memo` (keyed by its texts) for `cut_to`."""
    def kept(fn, key, *texts):
        out = fn(*texts)
        memo[(key, *(tuple(t) for t in texts))] = np.asarray(out, np.float32)
        return out
    return (lambda ins, qs: kept(embed_pairs, "pairs", ins, qs)), (lambda texts: kept(embed_passage, "p", texts))


def cut_to(dim: int, embed_pairs: PairEmbedFn, embed_passage: EmbedFn, memo: dict) -> tuple[PairEmbedFn, EmbedFn]:
    """The two encoders with each embedding cut to its first `dim` coordinates and L2-normalized again (a
    Matryoshka dimension, as training cuts it), read from `memo` (`recording`) where the texts were encoded."""
    def cut(fn, key, *texts):
        whole = memo.get((key, *(tuple(t) for t in texts)))
        x = (np.asarray(fn(*texts), np.float32) if whole is None else whole)[:, :dim]
        return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)
    return (lambda ins, qs: cut(embed_pairs, "pairs", ins, qs)), (lambda texts: cut(embed_passage, "p", texts))


def rerank(split: FollowIRSplit, embed_pairs: PairEmbedFn, embed_passage: EmbedFn, fmt: TextFormat
           ) -> tuple[Run, Run]:
    """Each query's own candidate pool scored by cosine, under the original and the changed instruction."""
    qids = sorted(split.queries)
    doc_ids = sorted(split.corpus)
    docs = finite(embed_passage([fmt.passage(split.corpus[d]) for d in doc_ids]), doc_ids, "passages")
    row = {d: i for i, d in enumerate(doc_ids)}
    runs = []
    for instructions in (split.instructions_og, split.instructions_changed):
        queries = finite(embed_pairs([instructions[q] for q in qids], [split.queries[q] for q in qids]), qids,
                         "queries")
        run = {}
        for qi, q in enumerate(qids):
            pool = split.candidates[q]
            s = docs[[row[d] for d in pool]] @ queries[qi]
            run[q] = {d: float(v) for d, v in zip(pool, s)}
        runs.append(run)
    return runs[0], runs[1]


def retrieve(task: RetrievalTask, embed_pairs: PairEmbedFn, embed_passage: EmbedFn, fmt: TextFormat,
             top_k: int = 1000, mesh=None, block_size: int = 65536, progress: bool = False) -> Run:
    """The top_k documents of the whole corpus for every judged query (exact search)."""
    doc_ids = sorted(task.corpus)
    qids = sorted(task.qrels)
    docs = finite(embed_passage([fmt.passage(task.corpus[d]) for d in doc_ids]), doc_ids, "passages")
    queries = finite(embed_pairs([task.instructions.get(q, "") for q in qids], [task.queries[q] for q in qids]),
                     qids, "queries")
    # Ask for a few more than top_k so that dropping excluded / identical ids still leaves top_k.
    extra = max((len(v) for v in task.excluded.values()), default=0) + int(task.skip_identical_ids)
    scores, idx = search(queries, docs, top_k + extra, mesh=mesh, block_size=block_size, progress=progress)
    run: Run = {}
    for qi, q in enumerate(qids):
        drop = task.excluded.get(q, frozenset()) | ({q} if task.skip_identical_ids else set())
        hits = [(doc_ids[i], float(s)) for s, i in zip(scores[qi], idx[qi]) if doc_ids[i] not in drop]
        run[q] = dict(hits[:top_k])
    return run


def score_followir(task: FollowIRTask, run_og: Run, run_new: Run
                   ) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """map@1000 / ndcg@5 of the original run (original qrels) and p-MRR (x100), mean and per query."""
    split = task.split
    means, per_query = trec_metrics(split.qrels_og, run_og, task.metrics)
    try:
        means["p_mrr"] = p_mrr(run_og, run_new, split.qrels_og, split.qrels_changed)
    except ValueError as e:
        raise DataError(f"{task.name}: {e}, so it is undefined") from None
    pq = p_mrr_per_query(run_og, run_new, split.qrels_og, split.qrels_changed)
    for q, v in pq.items():
        per_query.setdefault(q, {})["p_mrr"] = v
    return means, per_query


def evaluate_task(task: datasets.Task, embed_pairs: PairEmbedFn, embed_passage: EmbedFn, fmt: TextFormat, *,
                  top_k: int = 1000, mesh=None, block_size: int = 65536, progress: bool = False) -> dict:
    """Evaluate one task: its summary, per-query scores and runs, and the queries left out of the means.

    Returns {"name", "main_metric", "summary", "per_query", "runs": {label: run}, "left_out": [query ids],
    "without_text": [query ids]}; `left_out`: the judged queries without a relevant document
    (`datasets.with_relevant`), `without_text`: those whose text has no visible character (`datasets.with_text`),
    neither in the means."""
    if isinstance(task, FollowIRTask):
        run_og, run_new = rerank(task.split, embed_pairs, embed_passage, fmt)
        summary, per_query = score_followir(task, run_og, run_new)
        runs = {"og": run_og, "changed": run_new}
    else:
        run = retrieve(task, embed_pairs, embed_passage, fmt, top_k, mesh, block_size, progress)
        summary, per_query = trec_metrics(task.qrels, run, task.metrics)
        runs = {"": run}
    return {"name": task.name, "main_metric": task.main_metric, "summary": summary, "per_query": per_query,
            "runs": runs, "left_out": list(getattr(task, "without_relevant", ())),
            "without_text": list(getattr(task, "without_text", ()))}


def mean_summary(results: list[dict]) -> dict[str, float]:
    """The unweighted mean over tasks (MAIR splits) of each metric."""
    keys = list(results[0]["summary"])
    return {k: float(np.mean([r["summary"][k] for r in results])) for k in keys}


# --------------------------------------------------------------------------
# Datasets named by spec strings, loaded once per process (training evaluates them every N steps)
# --------------------------------------------------------------------------


@functools.lru_cache(maxsize=16)
def _load_cached(spec: str, split: str | None, instruction: str, synthetic_key: str | None) -> tuple:
    defaults = json.loads(synthetic_key) if synthetic_key else None
    return tuple(datasets.load(spec, split=split, instruction=instruction, synthetic_defaults=defaults))


def _synthetic_key(synthetic_defaults: dict | None) -> str | None:
    return json.dumps(synthetic_defaults, sort_keys=True) if synthetic_defaults else None


def preload(specs: list[str], *, split: str | None = None, instruction: str = "",
            synthetic_defaults: dict | None = None) -> None:
    """Load (and keep) the datasets of `specs` now, so that a bad file fails before training starts."""
    for spec in specs:
        _load_cached(spec, split, instruction, _synthetic_key(synthetic_defaults))


def evaluate_specs(specs: list[str], embed_pairs: PairEmbedFn, embed_passage: EmbedFn, fmt: TextFormat, *,
                   top_k: int = 100, split: str | None = None, instruction: str = "",
                   synthetic_defaults: dict | None = None, mesh=None) -> dict[str, dict[str, float]]:
    """{spec: {metric: value, "main": main score}} for each dataset spec (e.g. "beir:/data/scifact").

    Datasets are loaded once per process and kept (an lru cache keyed by
    spec), so calling this every N steps costs only the encoding and the
    search. `synthetic_defaults` (a run's data.synthetic) fills the unset keys
    of a `synthetic` spec. top_k defaults to 100 (enough for nDCG@10, MAP@100
    and Recall@100; FollowIR pools are always reranked whole). Raises
    DataError on a bad spec or file.
    """
    out = {}
    for spec in specs:
        tasks = _load_cached(spec, split, instruction, _synthetic_key(synthetic_defaults))
        results = [evaluate_task(t, embed_pairs, embed_passage, fmt, top_k=top_k, mesh=mesh) for t in tasks]
        summary = mean_summary(results)
        summary["main"] = summary[results[0]["main_metric"]]
        out[spec] = summary
    return out
