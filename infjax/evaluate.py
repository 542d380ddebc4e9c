"""Evaluate a model on FollowIR, MAIR, BRIGHT, a BEIR folder or the synthetic split.

    python -m infjax.evaluate --model=runs/x --dataset=followir:robust04 --out=eval/robust04
    python -m infjax.evaluate --model=runs/x --step 300 --dataset=synthetic
    python -m infjax.evaluate --model=intfloat/e5-base-v2 --query_prefix="query: " --passage_prefix="passage: " \\
        --dataset=beir:/data/scifact --out=eval/e5-scifact --cache_dir=~/.cache/infjax-emb
    python -m infjax.evaluate --model=exported/ --dataset=mair:CliniDS_2016
    python -m infjax.evaluate --model=runs/x --dataset=bright:biology

--model: an infjax run directory (latest step, or --step), a sentence-transformers
folder (modules.json; encoded by sentence-transformers on torch), or a HF
checkpoint (hub id, local folder, or embedded:all-MiniLM-L6-v2; encoded by
infjax with --pooling/--query_template/--query_prefix/--passage_prefix).
--dataset: KIND:PATH_OR_ID (see infjax/eval_data.py for the kinds and layouts).

Metrics (pytrec_eval): FollowIR and synthetic: MAP@1000 and nDCG@5 of the
original-instruction run against the original qrels (the main score is
MAP@1000 for Robust04/Core17, nDCG@5 for News21) and p-MRR (x100); MAIR and
BRIGHT: nDCG@10; BEIR: nDCG@10, MAP@100, Recall@100, MRR. Retrieval is
exact search over the whole corpus (infjax/search.py); FollowIR reranks each
query's pool.

--out DIR writes summary.json ({metric: value}; the mean over splits for a
MAIR task with several), meta.json (model, dataset, sizes, per-split
scores, timings), per_query.json and TREC run files (run.trec, or run.og.trec
and run.changed.trec for FollowIR; run.<split>.trec per MAIR split). A user
error (missing file, field, judgment reference, bad flag) exits with status 2
and a message naming it.

Several processes (`launch/local.sh N infjax.evaluate ...`, a SLURM job or a
TPU pod) evaluate as one: every process reads the data and the model, each
feeds its own devices' share of every encoder batch and search block, the
results are gathered on every process, and only process 0 prints and writes
--out and the embedding cache.
"""
from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import re
import sys
import time

import jax
import numpy as np

from infjax import eval_data
from infjax.data.tokenize import TextFormat
from infjax.eval_data import DataError, FollowIRTask, RetrievalTask
from infjax.followir import PairEmbedFn, rerank_pairs
from infjax.inference import EmbedFn, EmbeddingCache
from infjax.metrics import p_mrr_per_query, trec_metrics
from infjax.training import distributed

log = logging.getLogger("infjax.evaluate")

Run = dict[str, dict[str, float]]


# --------------------------------------------------------------------------
# Scoring one task
# --------------------------------------------------------------------------


def template_pairs(embed_query: EmbedFn, fmt: TextFormat) -> PairEmbedFn:
    """Interaction I: (instructions, queries) -> embed_query(fmt.query(instruction, query))."""
    return lambda ins, qs: embed_query([fmt.query(i, q) for i, q in zip(ins, qs)])


def retrieve(task: RetrievalTask, embed_pairs: PairEmbedFn, embed_passage: EmbedFn, fmt: TextFormat,
             top_k: int = 1000, mesh=None, block_size: int = 65536, progress: bool = False) -> Run:
    """{query id: {doc id: score}}: the top_k documents of the whole corpus for every judged query."""
    from infjax.search import search

    doc_ids = sorted(task.corpus)
    qids = sorted(task.qrels)
    docs = embed_passage([fmt.passage(task.corpus[d]) for d in doc_ids])
    queries = embed_pairs([task.instructions.get(q, "") for q in qids], [task.queries[q] for q in qids])
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
    pq = p_mrr_per_query(run_og, run_new, split.qrels_og, split.qrels_changed)
    if not pq:
        raise DataError(f"{task.name}: no query has a document whose relevance differs between the original "
                        f"and the changed qrels, so p-MRR is undefined")
    means["p_mrr"] = float(np.mean(list(pq.values())))
    for q, v in pq.items():
        per_query.setdefault(q, {})["p_mrr"] = v
    return means, per_query


def evaluate_task(task, embed_pairs: PairEmbedFn, embed_passage: EmbedFn, fmt: TextFormat, *, top_k: int = 1000,
                  mesh=None, block_size: int = 65536, progress: bool = False) -> dict:
    """{"name", "main_metric", "summary", "per_query", "runs": {label: run}} for one task.

    embed_pairs: (instructions, queries) -> instruction-aware query embeddings
    (`template_pairs(embed_query, fmt)` for one-text models); embed_passage:
    passage texts (prefix applied) -> embeddings.
    """
    if isinstance(task, FollowIRTask):
        run_og, run_new = rerank_pairs(task.split, embed_pairs, embed_passage, fmt)
        summary, per_query = score_followir(task, run_og, run_new)
        runs = {"og": run_og, "changed": run_new}
    else:
        run = retrieve(task, embed_pairs, embed_passage, fmt, top_k, mesh, block_size, progress)
        summary, per_query = trec_metrics(task.qrels, run, task.metrics)
        runs = {"": run}
    return {"name": task.name, "main_metric": task.main_metric, "summary": summary, "per_query": per_query,
            "runs": runs}


def mean_summary(results: list[dict]) -> dict[str, float]:
    """The unweighted mean over tasks (MAIR splits) of each metric."""
    keys = list(results[0]["summary"])
    return {k: float(np.mean([r["summary"][k] for r in results])) for k in keys}


# --------------------------------------------------------------------------
# In-training evaluation
# --------------------------------------------------------------------------


@functools.lru_cache(maxsize=16)
def _load_cached(spec: str, split: str | None, instruction: str, synthetic_key: str | None) -> tuple:
    defaults = json.loads(synthetic_key) if synthetic_key else None
    return tuple(eval_data.load(spec, split=split, instruction=instruction, synthetic_defaults=defaults))


def preload(specs: list[str], *, split: str | None = None, instruction: str = "",
            synthetic_defaults: dict | None = None) -> None:
    """Load (and keep) the datasets of `specs` now, so that a bad file fails before training starts."""
    key = json.dumps(synthetic_defaults, sort_keys=True) if synthetic_defaults else None
    for spec in specs:
        _load_cached(spec, split, instruction, key)


def evaluate_during_training(specs: list[str], embed_query: EmbedFn, embed_passage: EmbedFn, fmt: TextFormat, *,
                             embed_pairs: PairEmbedFn | None = None, top_k: int = 100, split: str | None = None,
                             instruction: str = "", synthetic_defaults: dict | None = None,
                             mesh=None) -> dict[str, dict[str, float]]:
    """{spec: {metric: value, "main": main score}} for each dataset spec (e.g. "beir:/data/scifact").

    embed_query / embed_passage map final texts to L2-normalized float32
    embeddings [N, d] (in the trainer: TextEmbedder with the current
    params); fmt is the run's TextFormat; queries are embed_query(fmt.query(
    instruction, query)), or embed_pairs(instructions, queries) when given
    (Interaction II: CrossAttentionQueryEmbedder). Datasets are loaded once per
    process and kept (an lru cache keyed by spec), so calling this every N
    steps costs only the encoding and the search. top_k defaults to 100
    (enough for nDCG@10, MAP@100 and Recall@100; FollowIR pools are always
    reranked whole). Raises DataError on a bad spec or file.
    """
    key = json.dumps(synthetic_defaults, sort_keys=True) if synthetic_defaults else None
    pairs = embed_pairs or template_pairs(embed_query, fmt)
    out = {}
    for spec in specs:
        tasks = _load_cached(spec, split, instruction, key)
        results = [evaluate_task(t, pairs, embed_passage, fmt, top_k=top_k, mesh=mesh) for t in tasks]
        summary = mean_summary(results)
        summary["main"] = summary[results[0]["main_metric"]]
        out[spec] = summary
    return out


# --------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------


def write_trec_run(path: str, run: Run, tag: str) -> None:
    """TREC format `qid Q0 docid rank score tag`, ranked by score then doc id (as metrics.ranks)."""
    with open(path, "w", encoding="utf-8") as f:
        for q in sorted(run):
            for rank, (d, s) in enumerate(sorted(run[q].items(), key=lambda x: (-x[1], x[0])), 1):
                f.write(f"{q} Q0 {d} {rank} {s:.6f} {tag}\n")


def read_trec_run(path: str) -> Run:
    run: Run = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            q, _, d, _, s, _ = line.split()
            run.setdefault(q, {})[d] = float(s)
    return run


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_") or "split"


def write_outputs(out: str, summary: dict, meta: dict, results: list[dict]) -> None:
    os.makedirs(out, exist_ok=True)
    if not os.access(out, os.W_OK):
        raise PermissionError(f"--out={out} is not writable")
    with open(os.path.join(out, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2)
    with open(os.path.join(out, "meta.json"), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=2)
    several = len(results) > 1
    per_query = {r["name"]: r["per_query"] for r in results} if several else results[0]["per_query"]
    with open(os.path.join(out, "per_query.json"), "w", encoding="utf-8") as f:
        json.dump(per_query, f, indent=1, sort_keys=True)
    tag = _slug(os.path.basename(os.path.normpath(meta["model"])))[-40:] or "infjax"
    for r in results:
        for label, run in r["runs"].items():
            parts = ["run"] + ([_slug(r["name"])] if several else []) + ([label] if label else []) + ["trec"]
            write_trec_run(os.path.join(out, ".".join(parts)), run, tag)


# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m infjax.evaluate", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="run directory, sentence-transformers folder, or HF checkpoint")
    p.add_argument("--dataset", required=True, help="KIND:PATH_OR_ID, KIND in " + ", ".join(eval_data.KINDS))
    p.add_argument("--out", default=None, help="write summary.json, meta.json, per_query.json and TREC runs here")
    p.add_argument("--step", type=int, default=None, help="checkpoint step of a run directory (default: latest)")
    p.add_argument("--model_type", default="auto", choices=("auto", "run", "sentence_transformers", "hf"),
                   help="how to read --model (auto: run dir > folder with modules.json > HF checkpoint)")
    p.add_argument("--batch_size", type=int, default=64, help="texts per encoder call")
    p.add_argument("--cache_dir", default=None, help="on-disk embedding cache (keyed by model, step, dataset, "
                                                      "side and a hash of the texts)")
    p.add_argument("--hub_cache_dir", default=None, help="where hub datasets are downloaded (default: HF cache)")
    p.add_argument("--pooling", default=None, choices=("mean", "cls", "last"),
                   help="HF checkpoints: pooling (default: the folder's sentence-transformers pooling, else mean)")
    p.add_argument("--query_template", default=None, help='default "{query} {instruction}"')
    p.add_argument("--query_prefix", default=None, help='e.g. "query: " for e5')
    p.add_argument("--passage_prefix", default=None, help='e.g. "passage: " for e5')
    p.add_argument("--query_max_len", type=int, default=None, help="tokens (default: the run's; a sentence-transformers folder's "
                                                                   "max_seq_length; else 256)")
    p.add_argument("--passage_max_len", type=int, default=None, help="tokens (default: the run's; a sentence-transformers "
                                                                     "folder's max_seq_length; else 512)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="HF checkpoints: compute dtype")
    p.add_argument("--top_k", type=int, default=1000, help="documents retrieved per query (full-corpus datasets)")
    p.add_argument("--block_size", type=int, default=65536, help="corpus rows per search block")
    p.add_argument("--split", default=None, help="qrels split of FollowIR / BEIR (default test)")
    p.add_argument("--instruction", default="", help="instruction for datasets without per-query ones (BEIR, BRIGHT)")
    p.add_argument("--bright_long_documents", action="store_true", help="BRIGHT: long_documents and gold_ids_long")
    p.add_argument("--lenient_qrels", action="store_true", help="drop judgments of documents not in the corpus")
    p.add_argument("--no_progress", action="store_true", help="no progress bars")
    return p


def cached_encoders(model, cache: EmbeddingCache | None, dataset: str) -> tuple[PairEmbedFn, EmbedFn]:
    """The model's (pair encoder, passage encoder), read through `cache` when there is one.

    The cache keys on the encoder's input texts: formatted query texts for
    one-text models, `instruction + "\\x1f" + query` for pair models.
    """
    if cache is None:
        return model.pair_encoder(), model.embed_passage
    key = model.cache_key or model.name
    ep = cache.wrap(model.embed_passage, key, model.step, dataset, "passage")
    if model.embed_pairs is None:
        return template_pairs(cache.wrap(model.embed_query, key, model.step, dataset, "query"), model.fmt), ep
    packed = cache.wrap(lambda items: model.embed_pairs(*zip(*(x.split("\x1f", 1) for x in items))),
                        key, model.step, dataset, "query-pairs")
    return (lambda ins, qs: packed([f"{i}\x1f{q}" for i, q in zip(ins, qs)])), ep


def run_evaluation(args: argparse.Namespace) -> dict:
    """Load the model and dataset of `args`, evaluate, print, write; returns {"summary", "meta", "results"}."""
    from infjax.model_sources import load_model

    if args.top_k < 10:
        raise DataError(f"--top_k={args.top_k}: must be >= 10 (nDCG@10)")
    if args.block_size < 1:
        raise DataError(f"--block_size={args.block_size}: must be >= 1")
    kind = eval_data.parse_spec(args.dataset)[0]

    def load_data(synthetic_defaults=None):
        return eval_data.load(args.dataset, split=args.split, instruction=args.instruction,
                              lenient_qrels=args.lenient_qrels, long_documents=args.bright_long_documents,
                              synthetic_defaults=synthetic_defaults, hub_cache_dir=args.hub_cache_dir)

    t0 = time.perf_counter()
    # Read the data first (a bad file fails in seconds), except the synthetic split, whose defaults are the run's.
    tasks = None if kind == "synthetic" else load_data()
    t_data = time.perf_counter()
    model = load_model(args.model, model_type=args.model_type, step=args.step, batch_size=args.batch_size,
                       pooling=args.pooling, query_template=args.query_template, query_prefix=args.query_prefix,
                       passage_prefix=args.passage_prefix, query_max_len=args.query_max_len,
                       passage_max_len=args.passage_max_len, dtype=args.dtype, progress=not args.no_progress)
    t_model = time.perf_counter()
    if tasks is None:
        tasks = load_data(model.synthetic)
    t_data2 = time.perf_counter()
    cache = EmbeddingCache(os.path.expanduser(args.cache_dir)) if args.cache_dir else None
    results = []
    for task in tasks:
        pairs, ep = cached_encoders(model, cache, f"{args.dataset}|{task.name}")
        results.append(evaluate_task(task, pairs, ep, model.fmt, top_k=args.top_k, block_size=args.block_size,
                                     progress=not args.no_progress))
    t_eval = time.perf_counter()
    summary = mean_summary(results)
    meta = {**model.describe(), "dataset": args.dataset, "main_metric": results[0]["main_metric"],
            "tasks": [{"name": r["name"], "num_queries": len(r["per_query"]), **r["summary"]} for r in results],
            "seconds": {"load_data": (t_data - t0) + (t_data2 - t_model), "load_model": t_model - t_data,
                        "evaluate": t_eval - t_data2}}
    if jax.process_index() != 0:         # several processes computed the same results; one reports them
        return {"summary": summary, "meta": meta, "results": results}
    step = f" step {model.step}" if model.step is not None else ""
    print(f"{args.dataset}  ({model.kind} {args.model}{step})")
    for r in results if len(results) > 1 else []:
        print(f"  {r['name']}: " + "  ".join(f"{k} {v:.4f}" for k, v in r["summary"].items()))
    for k, v in summary.items():
        print(f"{k:>12s}  {v:.4f}{'   (main)' if k == results[0]['main_metric'] else ''}")
    if args.out:
        write_outputs(os.path.expanduser(args.out), summary, meta, results)
        print(f"wrote {args.out}/summary.json")
    return {"summary": summary, "meta": meta, "results": results}


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit status (2 on a user error, with the message on stderr)."""
    from infjax.model_sources import ModelSourceError
    from infjax.models.hf_io import CheckpointNotFound

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for noisy in ("jax", "absl", "httpx", "sentence_transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    args = build_parser().parse_args(argv)
    distributed.initialize()       # multi-host (launch/local.sh N infjax.evaluate ...); a no-op for one process
    if jax.process_index() != 0:
        logging.getLogger("infjax").setLevel(logging.WARNING)
    try:
        run_evaluation(args)
    except (DataError, ModelSourceError, CheckpointNotFound, FileNotFoundError, PermissionError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
