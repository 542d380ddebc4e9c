"""Evaluate a model on FollowIR, MAIR, BRIGHT, a BEIR folder or the synthetic split.

    python -m infjax.evaluate --model=runs/x --dataset=followir:robust04 --out=eval/robust04
    python -m infjax.evaluate --model=runs/x --step 300 --dataset=synthetic
    python -m infjax.evaluate --model=intfloat/e5-base-v2 --query_prefix="query: " --passage_prefix="passage: " \\
        --dataset=beir:/data/scifact --out=eval/e5-scifact --cache_dir=~/.cache/infjax-emb
    python -m infjax.evaluate --model=exported/ --dataset=mair:CliniDS_2016
    python -m infjax.evaluate --model=runs/x --dataset=bright:biology

--model: an infjax run directory (latest step, or --step; --base_checkpoint
when its base checkpoint moved), a sentence-transformers folder (modules.json;
encoded by sentence-transformers on torch; an export of separate encoders,
query/ and passage/, too; an export with an Interaction II head is encoded by
infjax with the head), or a HF checkpoint (hub id, local folder, or
embedded:all-MiniLM-L6-v2; encoded by infjax with
--pooling/--query_template/--query_prefix/--passage_prefix).
--dataset: KIND:PATH_OR_ID (docs/evaluation.md lists the kinds and their layouts).

Metrics (pytrec_eval): FollowIR and synthetic: MAP@1000 and nDCG@5 of the
original-instruction run against the original qrels (the main score is
MAP@1000 for Robust04/Core17, nDCG@5 for News21) and p-MRR (x100); MAIR and
BRIGHT: nDCG@10; BEIR: nDCG@10, MAP@100, Recall@100, MRR. Retrieval is
exact search over the whole corpus (infjax/inference/search.py); FollowIR reranks each
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

import functools
import json
import logging
import os
import sys
import time

if __name__ == "__main__":   # glibc reads its tunables once, at start: restart before the heavy imports
    from infjax.runtime.cpu import restart_with_huge_pages
    restart_with_huge_pages()

import jax
from absl import flags

from infjax import cli, errors
from infjax.evaluation import datasets
from infjax.evaluation.datasets import DataError
from infjax.evaluation.tasks import cut_to, evaluate_task, mean_summary, recording, template_pairs
from infjax.evaluation.trec import write_outputs
from infjax.inference.cache import EmbeddingCache
from infjax.inference.embedders import EmbedFn, PairEmbedFn
from infjax.inference.sources import load_model
from infjax.models import attention
from infjax.runtime import distributed, platform, storage
from infjax.runtime.restore import parse_step
from infjax.runtime.folder_lock import LOCK_FILE, FolderLock

log = logging.getLogger("infjax.evaluate")

# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------


PROG = "python -m infjax.evaluate"


def define_flags(fv: flags.FlagValues) -> None:
    """Every flag of `python -m infjax.evaluate`, into `fv`."""
    s, i = functools.partial(flags.DEFINE_string, flag_values=fv), functools.partial(flags.DEFINE_integer,
                                                                                      flag_values=fv)
    e, b = functools.partial(flags.DEFINE_enum, flag_values=fv), functools.partial(flags.DEFINE_bool, flag_values=fv)
    s("model", None, "run directory, sentence-transformers folder, or HF checkpoint")
    s("dataset", None, "KIND:PATH_OR_ID, KIND in " + ", ".join(datasets.KINDS))
    s("out", None, "write summary.json, meta.json, per_query.json and TREC runs here")
    s("step", None, "checkpoint step of a run directory, or best (the one checkpoint.keep_best kept; default: "
                    "latest)")
    s("dims", "", "comma-separated Matryoshka dimensions: every metric also for embeddings cut to each and "
                  "normalized again (e.g. 384,64; default: the whole embedding only)")
    s("base_checkpoint", None, "a run directory's base checkpoint (its model.checkpoint: a folder or hub id) where "
                               "it is now, when it moved since the run was trained")
    e("model_type", "auto", ["auto", "run", "sentence_transformers", "hf"],
      "how to read --model (auto: run dir > folder with modules.json > HF checkpoint)")
    i("batch_size", 64, "texts per encoder call")
    s("cache_dir", None, "on-disk embedding cache (keyed by model, step, dataset, side and a hash of the texts)")
    s("hub_cache_dir", None, "where hub datasets are downloaded (default: HF cache)")
    e("pooling", None, ["mean", "cls", "last"],
      "HF checkpoints: pooling (default: the folder's sentence-transformers pooling, else mean)")
    s("query_template", None, 'default "{query} {instruction}"')
    s("query_prefix", None, 'e.g. "query: " for e5')
    s("passage_prefix", None, 'e.g. "passage: " for e5')
    i("query_max_len", None, "tokens (default: the run's; a sentence-transformers folder's max_seq_length; else 256)")
    i("passage_max_len", None, "tokens (default: the run's; a sentence-transformers folder's max_seq_length; "
                               "else 512)")
    e("dtype", "float32", ["float32", "bfloat16"], "HF checkpoints: compute dtype")
    i("top_k", 1000, "documents retrieved per query (full-corpus datasets)")
    i("block_size", 65536, "corpus rows per search block")
    s("split", None, "qrels split of FollowIR / BEIR (default test)")
    s("instruction", "", "instruction for datasets without per-query ones (BEIR, BRIGHT)")
    b("bright_long_documents", False, "BRIGHT: long_documents and gold_ids_long")
    b("lenient_qrels", False, "drop judgments of documents not in the corpus")
    b("no_progress", False, "no progress bars")
    b("overwrite", False, "replace what --out holds (an earlier evaluation of the same --model and --dataset is "
      "replaced without it)")


def parse_flags(argv: list[str]) -> flags.FlagValues:
    """The parsed flags; `--help` prints them all and exits 0, a bad one is one line and exit 2."""
    return cli.parse(PROG, define_flags, argv, doc=__doc__, required=("model", "dataset"),
                     may_be_empty=("query_template", "query_prefix", "passage_prefix"))


def cached_encoders(model, cache: EmbeddingCache | None, dataset: str) -> tuple[PairEmbedFn, EmbedFn]:
    """The model's (pair encoder, passage encoder), read through `cache` when there is one.

    The cache keys on the encoder's input texts: formatted query texts for
    one-text models, the (instruction, query) pairs for pair models. Each
    entry keeps how many of its texts were cut (`model.cuts`).
    """
    if cache is None:
        return model.pair_encoder(), model.embed_passage
    key, cuts = model.key(), model.cuts or {}
    ep = cache.wrap(model.embed_passage, key, model.step, dataset, "passage", cuts.get("passage"))
    if model.embed_pairs is None:
        return template_pairs(cache.wrap(model.embed_query, key, model.step, dataset, "query", cuts.get("query")),
                              model.fmt), ep
    return cache.wrap_pairs(model.embed_pairs, key, model.step, dataset, cuts=cuts.get("query")), ep


def truncation(model) -> dict | None:
    """How many of the task just evaluated's encoder inputs the maximum lengths cut, or None.

    {"query_max_len", "queries", "queries_cut", "passage_max_len", "passages", "passages_cut"}, counted by the encoders
    as they tokenized them (`model.cuts`, reset before each task; a count is None where some of its texts came from a
    cache entry that kept none), or None when the model does not count them. A cut text scores lower for a reason that
    is not the model's: the log says it for every evaluation."""
    if model.cuts is None:
        return None
    q, p = model.cuts["query"], model.cuts["passage"]
    return {"query_max_len": q.max_len, "queries": q.texts, "queries_cut": q.cut_count,
            "passage_max_len": p.max_len, "passages": p.texts, "passages_cut": p.cut_count}


def describe_truncation(name: str, cut: dict) -> str:
    """The log line of `truncation`.

    "NAME: 0 of 3 queries cut at 256 tokens, 12 of 3000 passages cut at 512 tokens"; "an unknown number of" for
    a side some of whose texts were not counted (a line above says why)."""
    def side(texts: str, n: int, k: int | None, max_len: int) -> str:
        return f"{'an unknown number' if k is None else k} of {n} {texts} cut at {max_len} tokens"
    return (f"{name}: {side('queries', cut['queries'], cut['queries_cut'], cut['query_max_len'])}, "
            f"{side('passages', cut['passages'], cut['passages_cut'], cut['passage_max_len'])}")


def pool_coverage(task) -> dict:
    """FollowIR: the judged relevant documents each query's pool leaves out; {} for the other tasks.

    {"relevant_outside_pool": {query id: count}} over the queries with any (they lower that query's scores)."""
    if isinstance(task, datasets.FollowIRTask):
        return {"relevant_outside_pool": dict(task.relevant_outside_pool)}
    return {}


def check_out(out: str, args) -> bool:
    """Whether `out` holds files to replace.

    Those are an earlier evaluation of the same --model and --dataset, or anything with --overwrite. Any other
    non-empty folder is refused before the work starts."""
    if not storage.exists(out) or not held_files(out):
        return False
    try:
        meta = json.loads(storage.read_text(storage.join(out, "meta.json")))
        earlier = (meta.get("model"), meta.get("dataset"))
    except (OSError, ValueError, AttributeError):
        earlier = None
    if earlier == (args.model, args.dataset) or args.overwrite:
        return True
    held = (f"an evaluation of --model={earlier[0]} on --dataset={earlier[1]}" if earlier else
            f"other files ({held_files(out)[:5]})")
    raise DataError(f"--out={args.out} already holds {held}; choose another folder, or pass --overwrite to replace "
                    f"its content")


def held_files(out: str) -> list[str]:
    """What `out` holds besides the lock of the evaluation writing there, sorted."""
    return sorted(name for name in storage.listdir(out) if name != LOCK_FILE)


def clear_out(out: str) -> None:
    """Remove what `out` holds except the lock file this evaluation holds.

    With the file gone, a second evaluation could create and take a new lock while this one still writes."""
    for name in held_files(out):
        path = storage.join(out, name)
        if not storage.is_remote(path) and os.path.islink(path):
            os.remove(path)                 # the link, never what it points to
        else:
            storage.rmtree(path)


def check_folder_flag(flag: str, folder: str | None) -> None:
    """Refuse a folder flag (--out, --cache_dir) that cannot hold the output, before any data or model is read.

    That is one that names a file, or a place that cannot be written (a read-only file system, a path under a
    file)."""
    if not folder:
        return
    path = folder if storage.is_remote(folder) else os.path.expanduser(folder)
    if storage.exists(path) and not storage.isdir(path):
        raise DataError(f"{flag}={folder} exists and is not a folder")
    why = storage.unwritable(path)
    if why:
        raise DataError(f"{flag}={folder}: cannot write there: {why}")


def dims_flag(text: str) -> list[int]:
    """--dims as a list of positive whole numbers; DataError (one line, exit 2) otherwise."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not all(x.isdigit() and int(x) > 0 for x in items):
        raise DataError(f"--dims={text}: expected positive whole numbers, comma-separated (e.g. 384,64)")
    return list(dict.fromkeys(int(x) for x in items))


def run_evaluation(args: flags.FlagValues) -> dict:
    """Load the model and dataset of `args`, evaluate, print, write; returns {"summary", "meta", "results"}."""
    attention.requested()      # the $INFJAX_ATTENTION switch, refused before anything is read
    if args.top_k < 10:
        raise DataError(f"--top_k={args.top_k}: must be >= 10 (nDCG@10)")
    if args.block_size < 1:
        raise DataError(f"--block_size={args.block_size}: must be >= 1")
    kind = datasets.parse_spec(args.dataset)[0]
    out = storage.absolute(args.out) if args.out and storage.is_remote(args.out) else \
        (os.path.expanduser(args.out) if args.out else None)
    for flag, folder in (("--out", args.out), ("--cache_dir", args.cache_dir)):   # before the (slow) evaluation
        check_folder_flag(flag, folder)
    # one evaluation per --out: a second one started meanwhile is refused (process 0 writes --out)
    with FolderLock(out or "", holder="evaluation", enabled=out is not None and jax.process_index() == 0):
        return _evaluate(args, kind, out)


def _evaluate(args: flags.FlagValues, kind: str, out: str | None) -> dict:
    replace = out is not None and check_out(out, args)

    def load_data(synthetic_defaults=None):
        return datasets.load(args.dataset, split=args.split, instruction=args.instruction,
                              lenient_qrels=args.lenient_qrels, long_documents=args.bright_long_documents,
                              synthetic_defaults=synthetic_defaults, hub_cache_dir=args.hub_cache_dir)

    dims = dims_flag(args.dims)
    t0 = time.perf_counter()
    # Read the data first (a bad file fails in seconds), except the synthetic split, whose defaults are the run's.
    tasks = None if kind == "synthetic" else load_data()
    t_data = time.perf_counter()
    model = load_model(args.model, model_type=args.model_type, step=parse_step(args.step),
                       batch_size=args.batch_size,
                       pooling=args.pooling, query_template=args.query_template, query_prefix=args.query_prefix,
                       passage_prefix=args.passage_prefix, query_max_len=args.query_max_len,
                       passage_max_len=args.passage_max_len, dtype=args.dtype, progress=not args.no_progress,
                       base_checkpoint=args.base_checkpoint)
    t_model = time.perf_counter()
    if tasks is None:
        tasks = load_data(model.synthetic)
    t_data2 = time.perf_counter()
    cache = EmbeddingCache(storage.absolute(args.cache_dir)) if args.cache_dir else None
    results = []
    cuts = {}
    by_dim = {d: [] for d in dims}
    for task in tasks:
        model.reset_cuts()
        pairs, ep = cached_encoders(model, cache, f"{args.dataset}|{task.name}")
        memo: dict = {}
        results.append(evaluate_task(task, *(recording(pairs, ep, memo) if dims else (pairs, ep)), model.fmt,
                                     top_k=args.top_k, block_size=args.block_size, progress=not args.no_progress))
        for d in dims:                       # each Matryoshka cut, from the same encoder calls
            by_dim[d].append(evaluate_task(task, *cut_to(d, pairs, ep, memo), model.fmt, top_k=args.top_k,
                                           block_size=args.block_size, progress=False))
        cut = cuts[task.name] = truncation(model)
        if cut is not None:
            log.info("%s", describe_truncation(task.name, cut))
    t_eval = time.perf_counter()
    summary = mean_summary(results)
    dim_summaries = {str(d): mean_summary(r) for d, r in by_dim.items()}
    meta = {**model.describe(), "dataset": args.dataset, "main_metric": results[0]["main_metric"],
            "tasks": [{"name": r["name"], "num_queries": len(r["per_query"]), **r["summary"],
                       "queries_left_out": len(r["left_out"]), "queries_left_out_ids": r["left_out"],
                       "queries_without_text": len(r["without_text"]), "queries_without_text_ids": r["without_text"],
                       "truncation": cuts.get(r["name"]), **pool_coverage(task)} for task, r in zip(tasks, results)],
            "seconds": {"load_data": (t_data - t0) + (t_data2 - t_model), "load_model": t_model - t_data,
                        "evaluate": t_eval - t_data2}, **({"dims": dim_summaries} if dims else {})}
    if jax.process_index() != 0:         # several processes computed the same results; one reports them
        return {"summary": summary, "meta": meta, "results": results}
    step = f" step {model.step}" if model.step is not None else ""
    print(f"{args.dataset}  ({model.kind} {args.model}{step})")
    for r in results if len(results) > 1 else []:
        print(f"  {r['name']}: " + "  ".join(f"{k} {v:.4f}" for k, v in r["summary"].items()))
    for k, v in summary.items():
        print(f"{k:>12s}  {v:.4f}{'   (main)' if k == results[0]['main_metric'] else ''}")
    for d, dim_summary in dim_summaries.items():
        print(f"  cut to {d} dims: " + "  ".join(f"{k} {v:.4f}" for k, v in dim_summary.items()))
    for r in results:
        judged = len(r["left_out"]) + len(r["without_text"]) + len(r["per_query"])
        if r["without_text"]:
            print(f"  {r['name']}: {len(r['without_text'])} of {judged} judged queries left out of the means: no "
                  f"visible text (empty, spaces or invisible characters only)")
        if r["left_out"]:
            print(f"  {r['name']}: {len(r['left_out'])} of {judged} judged "
                  f"queries left out of the means: no relevant document in the qrels (only grade-0 judgments)")
    if args.out:
        if replace:                     # the earlier evaluation goes only now that this one is complete
            clear_out(out)
        write_outputs(out, summary, meta, results)
        print(f"wrote {args.out}/summary.json")
    return {"summary": summary, "meta": meta, "results": results}


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit status (2 on a user error, with the message on stderr)."""
    cli.setup_logging(quiet=("jax", "absl", "httpx", "sentence_transformers"), replace=argv is None)
    args = parse_flags(sys.argv[1:] if argv is None else argv)
    platform.choose()              # before JAX starts its backends: the CPU where a plugin has no hardware
    try:
        distributed.initialize()   # multi-host (launch/local.sh N infjax.evaluate ...); a no-op for one process
        if jax.process_index() != 0:
            logging.getLogger("infjax").setLevel(logging.WARNING)
        run_evaluation(args)
        distributed.finished()
    except (Exception, KeyboardInterrupt) as e:    # noqa: BLE001 - report() re-raises what is a bug
        code = errors.report("infjax.evaluate", e)
        if code is None:
            raise
        return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
