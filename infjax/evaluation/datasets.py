"""Evaluation datasets: FollowIR, MAIR, BRIGHT, the BEIR folder layout and the synthetic split.

A dataset is named by a spec string `KIND:LOCATION[#SUBSET]`:

    followir:jhu-clsp/robust04-instructions   (or robust04 | news21 | core17, or a local folder)
    mair:CliniDS_2016                         (hub task name, or a local task folder)
    bright:biology                            (hub domain; bright:/local/BRIGHT#biology for a local copy)
    beir:/data/scifact[#test]                 (corpus.jsonl, queries.jsonl, qrels/<split>.tsv)
    synthetic[:seed=0,num_queries=45,pool_size=24]
    lee[:distractors=300]                     (general-retrieval canaries: infjax.evaluation.canary)
    docstrings[:packages=numpy+scipy,limit=600]

Layouts (local folders mirror the hub repositories file for file):

* FollowIR (`jhu-clsp/{robust04,news21,core17}-instructions`): `corpus.jsonl`
  (`_id`, `title`, `text`), `queries.jsonl` (`_id`, `text`, `instruction_og`,
  `instruction_changed`, ...), `qrels_og/<split>.jsonl|tsv` and
  `qrels_changed/<split>.jsonl|tsv` (`query-id`, `corpus-id`, `score`),
  `top_ranked.jsonl` (`qid`, `pid`: each query's candidate pool).
* MAIR (`MAIR-Bench/MAIR-Queries` and `MAIR-Bench/MAIR-Docs`, one folder per
  task): `<task>/queries.jsonl` (`qid`, `instruction`, `query`, `labels`: a
  list of `{id, score}`) and `<task>/docs.jsonl` (`id`, `doc`); tasks with
  several splits have `<name>_queries.jsonl` next to `<name>_docs.jsonl`. A
  local task folder holds both files, or mirrors the hub as
  `.../MAIR-Queries/<task>/` beside `.../MAIR-Docs/<task>/`.
* BRIGHT (`xlangai/BRIGHT`): `examples/<domain>-*.parquet` (`id`, `query`,
  `gold_ids`, `gold_ids_long`, `excluded_ids`), `documents/<domain>-*.parquet`
  and `long_documents/<domain>-*.parquet` (`id`, `content`). Excluded ids are
  removed from that query's ranking, as BRIGHT's own scorer does.
* BEIR: `corpus.jsonl` (`_id`, `text`, optional `title`), `queries.jsonl`
  (`_id`, `text`, optional `instruction`), `qrels/<split>.tsv` (header
  `query-id corpus-id score`). As BEIR does, a document whose id equals the
  query id is left out of that query's ranking.

Passages with a title are encoded as `title + " " + text` (the BEIR/MTEB
convention). Only judged queries are evaluated: of every set only those with
visible text (`with_text`), and of the full-corpus sets (BEIR, MAIR) only those
with a relevant document (`with_relevant`). A missing file or field, or a
judgment naming an unknown query or document, raises `DataError` naming the
file, line and id (`lenient_qrels=True` drops judgments of unknown documents
instead and logs how many).
"""
from __future__ import annotations

import glob
import json
import logging
import math
import os
from typing import Iterable

from infjax.data import synthetic, text_files
from infjax.data.inf_ir import visible
from infjax.data.types import FollowIRSplit
from infjax.evaluation import canary
from infjax.evaluation.types import (BEIR_METRICS, DataError, FollowIRTask,  # noqa: F401
                                     RetrievalTask, Task, spec_options)

log = logging.getLogger("infjax.eval_data")

KINDS = ("followir", "mair", "bright", "beir", "synthetic", "lee", "docstrings")
FOLLOWIR_HUB = {
    "robust04": "jhu-clsp/robust04-instructions",
    "news21": "jhu-clsp/news21-instructions",
    "core17": "jhu-clsp/core17-instructions",
}
MAIR_QUERIES_HUB, MAIR_DOCS_HUB = "MAIR-Bench/MAIR-Queries", "MAIR-Bench/MAIR-Docs"
BRIGHT_HUB = "xlangai/BRIGHT"
BRIGHT_DOMAINS = ("biology", "earth_science", "economics", "psychology", "robotics", "stackoverflow",
                  "sustainable_living", "leetcode", "pony", "aops", "theoremqa_theorems", "theoremqa_questions")


# --------------------------------------------------------------------------
# Spec strings
# --------------------------------------------------------------------------


def parse_spec(spec: str) -> tuple[str, str, str]:
    """`KIND:LOCATION[#SUBSET]` -> (kind, location, subset)."""
    kind, _, rest = spec.partition(":")
    if kind not in KINDS:
        raise DataError(f"--dataset={spec!r}: unknown kind {kind!r}; write KIND:PATH_OR_ID with KIND in {list(KINDS)}")
    location, _, subset = rest.partition("#")
    if not location and kind not in ("synthetic", "lee", "docstrings"):
        raise DataError(f"--dataset={spec!r}: {kind} needs a location, e.g. {kind}:PATH_OR_ID")
    return kind, location, subset


def load(spec: str, *, split: str | None = None, instruction: str = "", lenient_qrels: bool = False,
         long_documents: bool = False, synthetic_defaults: dict | None = None,
         hub_cache_dir: str | None = None) -> list[Task]:
    """The task(s) a spec names (several for a MAIR task with more than one split).

    `split` picks the qrels split of FollowIR (default test) and BEIR (default
    test, or the only one; `beir:DIR#SPLIT` too); `instruction` is the
    instruction of datasets without per-query instructions (BRIGHT, BEIR).
    """
    kind, location, subset = parse_spec(spec)
    if kind == "followir":
        return [load_followir(location, split=split or "test", lenient_qrels=lenient_qrels,
                              hub_cache_dir=hub_cache_dir)]
    if kind == "synthetic":
        return [load_synthetic(location, synthetic_defaults)]
    if kind == "lee":
        return [canary.load_lee(location)]
    if kind == "docstrings":
        return [canary.load_docstrings(location)]
    if kind == "beir":
        return [load_beir(location, split=subset or split, instruction=instruction, lenient_qrels=lenient_qrels)]
    if kind == "mair":
        return load_mair(location, lenient_qrels=lenient_qrels, hub_cache_dir=hub_cache_dir)
    return [load_bright(location, subset, instruction=instruction, long_documents=long_documents,
                        lenient_qrels=lenient_qrels, hub_cache_dir=hub_cache_dir)]


# --------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------


def _require_file(path: str, what: str) -> str:
    if not os.path.isfile(path):
        raise DataError(f"{path}: file not found ({what})")
    return path


def _first_existing(paths: Iterable[str], what: str) -> str:
    paths = list(paths)
    for p in paths:
        if os.path.isfile(p):
            return p
    raise DataError(f"{' or '.join(paths)}: file not found ({what})")


def read_rows(path: str) -> Iterable[tuple[int, dict]]:
    """(line or row number, record) of a .jsonl, .json, .parquet, .tsv or .csv file. Bytes that are not
    UTF-8 are a DataError naming the file, line and byte (as training data reports them)."""
    try:
        yield from _read_rows(path)
    except UnicodeDecodeError:
        raise DataError(text_files.describe_not_utf8(path)) from None


def _read_rows(path: str) -> Iterable[tuple[int, dict]]:
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        for i, row in enumerate(pq.read_table(path).to_pylist()):
            yield i + 1, row
    elif path.endswith(".jsonl"):
        with open(path, encoding="utf-8") as f:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{i}: not valid JSON ({e.msg})") from None
                if not isinstance(row, dict):
                    raise DataError(f"{path}:{i}: expected a JSON object, got {type(row).__name__}")
                yield i, row
    elif path.endswith(".json"):
        with open(path, encoding="utf-8") as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}: not valid JSON ({e.msg})") from None
        if not isinstance(data, list):
            raise DataError(f"{path}: expected a JSON list of objects")
        yield from enumerate(data, 1)
    elif path.endswith((".tsv", ".csv")):
        import csv

        with open(path, encoding="utf-8", newline="") as f:
            reader = csv.reader(f, delimiter="\t" if path.endswith(".tsv") else ",")
            header = None
            for i, cells in enumerate(reader, 1):
                if not cells:
                    continue
                if header is None:
                    header = cells
                    continue
                if len(cells) != len(header):
                    raise DataError(f"{path}:{i}: {len(cells)} columns, the header {header} has {len(header)}")
                yield i, dict(zip(header, cells))
    else:
        raise DataError(f"{path}: unsupported file type (use .jsonl, .json, .parquet, .tsv or .csv)")


def _field(row: dict, name: str, path: str, line: int, types=(str,)):
    if name not in row or row[name] is None:
        raise DataError(f"{path}:{line}: missing field {name!r} (fields: {sorted(row)})")
    value = row[name]
    if types and not isinstance(value, types):
        raise DataError(f"{path}:{line}: field {name!r} must be {' or '.join(t.__name__ for t in types)}, "
                        f"got {type(value).__name__}")
    return value


def _doc_text(row: dict, text_field: str, path: str, line: int) -> str:
    text = _field(row, text_field, path, line)
    title = row.get("title") or ""
    return f"{title} {text}".strip() if title else text.strip()


def _grade(value, path: str, line: int, field: str) -> int:
    """A relevance grade: an integer (written 2, "2" or 2.0); anything else is refused, never truncated."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise DataError(f"{path}:{line}: field {field!r} must be an integer relevance grade, got {value!r}") from None
    if not math.isfinite(number) or number != int(number):
        raise DataError(f"{path}:{line}: field {field!r} must be an integer relevance grade, got {value!r}")
    return int(number)


def _first_time(seen: dict[str, tuple[str, int]], key: str, path: str, line: int, what: str) -> None:
    """Refuse an id that a file (or a set of shards) gives twice: the later text or judgments would silently
    replace or join the first. `seen` maps each id to where it was first given."""
    if key in seen:
        first_path, first_line = seen[key]
        where = f"line {first_line}" if first_path == path else f"{first_path}:{first_line}"
        raise DataError(f"{path}:{line}: {what} id {key!r} appears again (first at {where}); ids must be unique")
    seen[key] = (path, line)


def read_corpus(path: str, id_field: str = "_id", text_field: str = "text") -> dict[str, str]:
    corpus, seen = {}, {}
    for line, row in read_rows(_require_file(path, "corpus")):
        did = str(_field(row, id_field, path, line, (str, int)))
        _first_time(seen, did, path, line, "document")
        corpus[did] = _doc_text(row, text_field, path, line)
    if not corpus:
        raise DataError(f"{path}: the corpus is empty")
    return corpus


def read_qrels(path: str) -> list[tuple[int, str, str, int]]:
    """(line, query id, doc id, grade) from a qrels .tsv (BEIR header) or .jsonl file."""
    out = []
    for line, row in read_rows(_require_file(path, "qrels")):
        qid = str(_field(row, "query-id", path, line, (str, int)))
        did = str(_field(row, "corpus-id", path, line, (str, int)))
        out.append((line, qid, did, _grade(_field(row, "score", path, line, ()), path, line, "score")))
    return out


def _qrels_dict(entries, path: str, queries, corpus, lenient: bool) -> dict[str, dict[str, int]]:
    """Check every judgment's query and document ids; returns {qid: {did: grade}}."""
    qrels: dict[str, dict[str, int]] = {}
    lines: dict[tuple[str, str], int] = {}
    dropped = repeated = 0
    for line, qid, did, grade in entries:
        if qid not in queries:
            raise DataError(f"{path}:{line}: query id {qid!r} is not in the queries file")
        if did not in corpus:
            if lenient:
                dropped += 1
                continue
            raise DataError(f"{path}:{line}: document id {did!r} (query {qid!r}) is not in the corpus; fix the "
                            f"qrels, or drop judgments of unknown documents with infjax.evaluate --lenient_qrels "
                            f"(training's eval.sets takes judged documents only)")
        judged = qrels.setdefault(qid, {})
        if did in judged:
            first, grade_before = lines[(qid, did)], judged[did]
            if grade != grade_before:
                raise DataError(f"{path}:{line}: query {qid!r} judges document {did!r} again with grade {grade} "
                                f"(grade {grade_before} at line {first}); keep one judgment per pair")
            repeated += 1
            continue
        lines[(qid, did)] = line
        judged[did] = grade
    if repeated:
        log.warning("%s: %d judgments repeat an earlier one with the same grade (counted once)", path, repeated)
    if dropped:
        log.warning("%s: dropped %d judgments of documents not in the corpus (--lenient_qrels)", path, dropped)
    if not qrels:
        raise DataError(f"{path}: no judgments")
    return qrels


Qrels = dict[str, dict[str, int]]


def _leave_out(qrels: Qrels, keep, path: str, what: str, none: str, why: str) -> tuple[Qrels, tuple[str, ...]]:
    """(the judged queries that `keep(query id)` keeps, the sorted ids of the others).

    Warns, counting the others ("... judged queries `why` and are left out of the means"); a DataError "none of the N
    judged queries of `what` `none`" when none is kept."""
    kept = {q: judged for q, judged in qrels.items() if keep(q)}
    left_out = tuple(sorted(set(qrels) - set(kept)))
    if not kept:
        raise DataError(f"{path}: none of the {len(qrels)} judged queries of {what} {none}")
    if left_out:
        log.warning("%s: %d of %d judged queries %s and are left out of the means (first: %s)", what, len(left_out),
                    len(qrels), why, ", ".join(left_out[:3]))
    return kept, left_out


def with_relevant(qrels: Qrels, path: str, what: str) -> tuple[Qrels, tuple[str, ...]]:
    """(the judged queries that have a relevant document, the ids of those that have none).

    A query whose judgments are all 0 scores 0 in every measure whatever the ranking: averaged in, it only lowers the
    mean, by the share of such queries. Such queries are left out, counted in a warning here and in the results; a set
    where none can score is a DataError."""
    return _leave_out(qrels, lambda q: any(g > 0 for g in qrels[q].values()), path, what,
                      "has a relevant document (a judgment with a grade above 0), so no measure can be computed; are "
                      "these the right qrels?", "have no relevant document (only grade-0 judgments)")


def with_text(queries: dict[str, str], qrels: Qrels, path: str, what: str) -> tuple[Qrels, tuple[str, ...]]:
    """(the judged queries whose text has a character a reader sees, the ids of those whose text has none).

    A text without one is empty, spaces, or invisible characters only, a zero-width space (`inf_ir.visible`, the test
    training applies to its fields). Such a query asks for nothing, and its ranking says nothing of the model: it is
    left out of the means and counted, in a warning here and in the results, as queries without a relevant document
    are; a set where no query has text is a DataError."""
    return _leave_out(qrels, lambda q: visible(queries[q]), path, what,
                      "has visible text (each is empty, spaces or invisible characters only); are these the right "
                      "files?", "have no visible text (empty, spaces or invisible characters only)")


# --------------------------------------------------------------------------
# Hub downloads (snapshots of dataset repositories, read by the local loaders)
# --------------------------------------------------------------------------


def looks_like_path(location: str) -> bool:
    return location.startswith(("/", ".", "~")) or location.count("/") > 1 or os.path.exists(location)


def hub_snapshot(repo_id: str, allow_patterns: list[str], cache_dir: str | None = None) -> str:
    """A local copy of (part of) a hub dataset repository."""
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(repo_id=repo_id, repo_type="dataset", allow_patterns=allow_patterns,
                                 cache_dir=cache_dir)
    except Exception as e:  # offline, unknown repo, network, auth ...
        first = next((ln for ln in str(e).splitlines() if ln.strip()), "")
        raise DataError(f"dataset {repo_id!r} ({', '.join(allow_patterns)}) could not be fetched from the "
                        f"Hugging Face Hub ({type(e).__name__}: {first}); download it elsewhere and pass the "
                        f"local folder instead") from e


# --------------------------------------------------------------------------
# FollowIR
# --------------------------------------------------------------------------


def followir_main_metric(name: str) -> str:
    """nDCG@5 for News21, MAP@1000 for Robust04 and Core17 (FollowIR, docs/method.md §5.1)."""
    return "ndcg@5" if "news21" in name.lower() else "map@1000"


def _split_file(folder: str, stem: str, what: str) -> str:
    return _first_existing([os.path.join(folder, stem + ext) for ext in (".jsonl", ".tsv")], what)


def load_followir_dir(folder: str, split: str = "test", lenient_qrels: bool = False,
                      name: str | None = None) -> FollowIRTask:
    """A FollowIR folder in the hub layout -> FollowIRTask (corpus cut to the pooled documents)."""
    corpus_path = os.path.join(folder, "corpus.jsonl")
    queries_path = _require_file(os.path.join(folder, "queries.jsonl"), "queries")
    og_path = _split_file(os.path.join(folder, "qrels_og"), split, f"original qrels, split {split!r}")
    new_path = _split_file(os.path.join(folder, "qrels_changed"), split, f"changed qrels, split {split!r}")
    pools_path = _require_file(os.path.join(folder, "top_ranked.jsonl"), "candidate pools")
    corpus = read_corpus(corpus_path)
    queries, ins_og, ins_new, seen = {}, {}, {}, {}
    for line, row in read_rows(queries_path):
        qid = str(_field(row, "_id", queries_path, line, (str, int)))
        _first_time(seen, qid, queries_path, line, "query")
        queries[qid] = _field(row, "text", queries_path, line)
        ins_og[qid] = _field(row, "instruction_og", queries_path, line)
        ins_new[qid] = _field(row, "instruction_changed", queries_path, line)
    name = name or os.path.basename(os.path.normpath(folder))
    qrels_og = _qrels_dict(read_qrels(og_path), og_path, queries, corpus, lenient_qrels)
    qrels_og, no_text = with_text(queries, qrels_og, queries_path, name)
    qrels_new = _qrels_dict(read_qrels(new_path), new_path, queries, corpus, lenient_qrels)
    pools: dict[str, dict[str, None]] = {}             # query id -> pool (an ordered set)
    repeated = 0
    for line, row in read_rows(pools_path):
        qid = str(_field(row, "qid", pools_path, line, (str, int)))
        pid = str(_field(row, "pid", pools_path, line, (str, int)))
        if qid not in qrels_og:
            continue                              # an unjudged query: not evaluated (as in MTEB)
        if pid not in corpus:
            raise DataError(f"{pools_path}:{line}: document id {pid!r} (query {qid!r}) is not in {corpus_path}")
        pool = pools.setdefault(qid, {})
        repeated += pid in pool
        pool[pid] = None
    if repeated:
        log.warning("%s: %d pool entries repeat an earlier (query, document) pair (counted once)", pools_path,
                    repeated)
    missing = sorted(set(qrels_og) - set(pools))
    if missing:
        raise DataError(f"{pools_path}: no candidate pool for judged query id(s) {missing[:5]}")
    outside = _relevant_outside_pools(pools, {og_path: qrels_og, new_path: qrels_new}, pools_path)
    pooled = {d for p in pools.values() for d in p}
    qids = sorted(qrels_og)
    split_ = FollowIRSplit(
        corpus={d: corpus[d] for d in sorted(pooled)},
        queries={q: queries[q] for q in qids},
        instructions_og={q: ins_og[q] for q in qids},
        instructions_changed={q: ins_new[q] for q in qids},
        candidates={q: list(pools[q]) for q in qids},
        qrels_og=qrels_og,
        qrels_changed={q: qrels_new.get(q, {}) for q in qids},
    )
    return FollowIRTask(name, split_, followir_main_metric(name), relevant_outside_pool=outside, without_text=no_text)


def _relevant_outside_pools(pools: dict[str, dict[str, None]], qrels: dict[str, dict[str, dict[str, int]]],
                            pools_path: str) -> dict[str, int]:
    """{query id: its judged relevant documents that are not in its pool}, for the queries that have such documents.

    Relevant: grade > 0 in any of `qrels` ({file: {qid: {did: grade}}}). Reranking a pool can never reach them, so each
    lowers the query's scores. A query whose relevant documents are all outside its pool (pools of another split or id
    scheme) is refused: its scores would mean nothing."""
    outside: dict[str, int] = {}
    for qid, pool in pools.items():
        relevant = {d for judged in qrels.values() for d, g in judged.get(qid, {}).items() if g > 0}
        missed = sorted(relevant - set(pool))
        if relevant and len(missed) == len(relevant):
            files = " and ".join(path for path, judged in qrels.items() if judged.get(qid))
            raise DataError(f"{pools_path}: the pool of query {qid!r} ({len(pool)} documents) holds none of its "
                            f"{len(relevant)} relevant documents in {files} (e.g. {missed[0]!r}): the pools and the "
                            f"qrels do not belong together (another split or id scheme?)")
        if missed:
            outside[qid] = len(missed)
    if outside:
        log.warning("%s: %d judged relevant documents of %d queries are outside their query's pool and cannot be "
                    "ranked (per query: relevant_outside_pool in meta.json)", pools_path, sum(outside.values()),
                    len(outside))
    return outside


def load_followir(location: str, split: str = "test", lenient_qrels: bool = False,
                  hub_cache_dir: str | None = None) -> FollowIRTask:
    """A local FollowIR folder, a hub id, or robust04 | news21 | core17."""
    repo = FOLLOWIR_HUB.get(location.lower(), location)
    expanded = os.path.expanduser(repo)
    if os.path.isdir(expanded):
        return load_followir_dir(expanded, split=split, lenient_qrels=lenient_qrels)
    if looks_like_path(repo):
        raise DataError(f"{location}: folder not found (a FollowIR folder: corpus.jsonl, queries.jsonl, "
                        f"qrels_og/, qrels_changed/, top_ranked.jsonl)")
    folder = hub_snapshot(repo, ["*.jsonl", "qrels_og/*", "qrels_changed/*"], hub_cache_dir)
    return load_followir_dir(folder, split=split, lenient_qrels=lenient_qrels, name=repo)


def load_synthetic(options: str, defaults: dict | None = None) -> FollowIRTask:
    """`synthetic[:seed=S,num_queries=N,pool_size=P]`; unset keys come from `defaults` (a run's data.synthetic)."""
    d = {"seed": 0, "num_queries": 45, "pool_size": 24}
    if defaults:
        d.update({"seed": defaults.get("seed", 0), "num_queries": defaults.get("num_eval_queries", 45),
                  "pool_size": defaults.get("pool_size", 24)})
    d = spec_options("synthetic", options, d)
    try:
        split_ = synthetic.make_eval_split(d["num_queries"], d["seed"], d["pool_size"])
    except ValueError as e:
        raise DataError(f"--dataset=synthetic:{options}: {e}") from None
    name = f"synthetic(seed={d['seed']},num_queries={d['num_queries']},pool_size={d['pool_size']})"
    return FollowIRTask(name, split_, "ndcg@5", ("ndcg@5", "map@1000"))


# --------------------------------------------------------------------------
# BEIR folders
# --------------------------------------------------------------------------


def load_beir(folder: str, split: str | None = None, instruction: str = "",
              lenient_qrels: bool = False) -> RetrievalTask:
    """corpus.jsonl, queries.jsonl, qrels/<split>.tsv; split defaults to test, or the only qrels file."""
    folder = os.path.expanduser(folder)
    if not os.path.isdir(folder):
        raise DataError(f"{folder}: folder not found (a BEIR folder has corpus.jsonl, queries.jsonl, qrels/)")
    qrels_dir = os.path.join(folder, "qrels")
    if split is None:
        available = sorted(os.path.basename(p)[:-4] for p in glob.glob(os.path.join(qrels_dir, "*.tsv")))
        if "test" in available or not available:
            split = "test"
        elif len(available) == 1:
            split = available[0]
        else:
            raise DataError(f"{qrels_dir}: no test.tsv; choose a split with {folder}#SPLIT from {available}")
    qrels_path = os.path.join(qrels_dir, f"{split}.tsv")
    corpus = read_corpus(os.path.join(folder, "corpus.jsonl"))
    queries_path = _require_file(os.path.join(folder, "queries.jsonl"), "queries")
    queries, instructions, seen = {}, {}, {}
    for line, row in read_rows(queries_path):
        qid = str(_field(row, "_id", queries_path, line, (str, int)))
        _first_time(seen, qid, queries_path, line, "query")
        queries[qid] = _field(row, "text", queries_path, line)
        instructions[qid] = row.get("instruction") or instruction
    qrels = _qrels_dict(read_qrels(qrels_path), qrels_path, queries, corpus, lenient_qrels)
    name = f"{os.path.basename(os.path.normpath(folder))}/{split}"
    qrels, no_text = with_text(queries, qrels, queries_path, name)
    qrels, left_out = with_relevant(qrels, qrels_path, name)
    return RetrievalTask(name, corpus, {q: queries[q] for q in qrels}, {q: instructions[q] for q in qrels}, qrels,
                         BEIR_METRICS, "ndcg@10", skip_identical_ids=True, without_relevant=left_out,
                         without_text=no_text)


# --------------------------------------------------------------------------
# MAIR
# --------------------------------------------------------------------------


def _mair_labels(value, path: str, line: int) -> list[tuple[str, int]]:
    if isinstance(value, str):                 # some copies store the list as a JSON string
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise DataError(f"{path}:{line}: field 'labels' is not a JSON list") from None
    if not isinstance(value, list):
        raise DataError(f"{path}:{line}: field 'labels' must be a list of {{id, score}}")
    out = []
    for item in value:
        if not isinstance(item, dict) or "id" not in item:
            raise DataError(f"{path}:{line}: each entry of 'labels' needs an 'id', got {item!r}")
        score = item.get("score", item.get("relevance", 1))
        out.append((str(item["id"]), _grade(score, path, line, "labels.score")))
    return out


def _mair_docs_dir(queries_dir: str) -> str:
    """The docs folder of a local task folder: itself, or its mirror under MAIR-Docs."""
    parts = os.path.normpath(os.path.abspath(queries_dir)).split(os.sep)
    if "MAIR-Queries" in parts:
        i = len(parts) - 1 - parts[::-1].index("MAIR-Queries")
        mirror = os.sep.join(parts[:i] + ["MAIR-Docs"] + parts[i + 1:])
        if os.path.isdir(mirror):
            return mirror
    return queries_dir


def load_mair_dirs(queries_dir: str, docs_dir: str, task: str, lenient_qrels: bool = False) -> list[RetrievalTask]:
    """One RetrievalTask per queries file (`queries.jsonl` or `<name>_queries.jsonl`) of a MAIR task."""
    files = sorted(glob.glob(os.path.join(queries_dir, "*queries.jsonl")))
    if not files:
        raise DataError(f"{os.path.join(queries_dir, 'queries.jsonl')}: file not found (MAIR queries of {task})")
    tasks = []
    for qpath in files:
        stem = os.path.basename(qpath)[:-len(".jsonl")]
        docs_stem = "docs" if stem == "queries" else stem[:-len("queries")] + "docs"
        dpath = _require_file(os.path.join(docs_dir, docs_stem + ".jsonl"), f"MAIR documents for {qpath}")
        corpus = read_corpus(dpath, id_field="id", text_field="doc")
        queries, instructions, entries, seen = {}, {}, [], {}
        for line, row in read_rows(qpath):
            qid = str(_field(row, "qid", qpath, line, (str, int)))
            _first_time(seen, qid, qpath, line, "query")
            queries[qid] = _field(row, "query", qpath, line)
            instructions[qid] = _field(row, "instruction", qpath, line)
            entries += [(line, qid, did, grade) for did, grade in _mair_labels(_field(row, "labels", qpath, line, ()),
                                                                                qpath, line)]
        qrels = _qrels_dict(entries, qpath, queries, corpus, lenient_qrels)
        name = task if stem == "queries" else f"{task}/{stem}"
        qrels, no_text = with_text(queries, qrels, qpath, name)
        qrels, left_out = with_relevant(qrels, qpath, name)
        tasks.append(RetrievalTask(name, corpus, {q: queries[q] for q in qrels}, {q: instructions[q] for q in qrels},
                                   qrels, ("ndcg@10",), "ndcg@10", without_relevant=left_out, without_text=no_text))
    return tasks


def load_mair(location: str, lenient_qrels: bool = False, hub_cache_dir: str | None = None) -> list[RetrievalTask]:
    expanded = os.path.expanduser(location)
    if os.path.isdir(expanded):
        return load_mair_dirs(expanded, _mair_docs_dir(expanded), os.path.basename(os.path.normpath(expanded)),
                              lenient_qrels)
    if looks_like_path(location):
        raise DataError(f"{location}: folder not found (a MAIR task folder with queries.jsonl and docs.jsonl)")
    queries_root = hub_snapshot(MAIR_QUERIES_HUB, [f"{location}/*"], hub_cache_dir)
    docs_root = hub_snapshot(MAIR_DOCS_HUB, [f"{location}/*"], hub_cache_dir)
    return load_mair_dirs(os.path.join(queries_root, location), os.path.join(docs_root, location), location,
                          lenient_qrels)


# --------------------------------------------------------------------------
# BRIGHT
# --------------------------------------------------------------------------


def _bright_rows(root: str, config: str, domain: str) -> Iterable[tuple[str, int, dict]]:
    """(file, row number, record) over the shards `<root>/<config>/<domain>-*.parquet` (or `<domain>.jsonl`)."""
    found = sorted(glob.glob(os.path.join(root, config, f"{domain}-*.parquet")) +
                   glob.glob(os.path.join(root, config, f"{domain}.jsonl")))
    if not found:
        raise DataError(f"{os.path.join(root, config, domain + '-*.parquet')}: file not found "
                        f"(BRIGHT {config}, domain {domain!r})")
    for path in found:
        for line, row in read_rows(path):
            yield path, line, row


def load_bright_dir(root: str, domain: str, instruction: str = "", long_documents: bool = False,
                    lenient_qrels: bool = False) -> RetrievalTask:
    docs_config = "long_documents" if long_documents else "documents"
    gold_field = "gold_ids_long" if long_documents else "gold_ids"
    corpus, seen = {}, {}
    for path, line, row in _bright_rows(root, docs_config, domain):
        did = str(_field(row, "id", path, line, (str, int)))
        _first_time(seen, did, path, line, "document")
        corpus[did] = _field(row, "content", path, line)
    queries, entries, excluded, seen = {}, [], {}, {}
    examples_path = ""
    for path, line, row in _bright_rows(root, "examples", domain):
        examples_path = path
        qid = str(_field(row, "id", path, line, (str, int)))
        _first_time(seen, qid, path, line, "query")
        queries[qid] = _field(row, "query", path, line)
        gold = _field(row, gold_field, path, line, (list, tuple))
        entries += [(line, qid, str(d), 1) for d in gold]
        excluded[qid] = frozenset(str(d) for d in row.get("excluded_ids") or () if str(d) != "N/A")
    qrels = _qrels_dict(entries, examples_path, queries, corpus, lenient_qrels)
    name = f"{domain}{' (long documents)' if long_documents else ''}"
    qrels, no_text = with_text(queries, qrels, examples_path, name)
    return RetrievalTask(name, corpus, {q: queries[q] for q in qrels}, {q: instruction for q in qrels}, qrels,
                         ("ndcg@10",), "ndcg@10", excluded={q: excluded[q] for q in qrels if excluded[q]},
                         without_text=no_text)


def load_bright(location: str, domain: str = "", instruction: str = "", long_documents: bool = False,
                lenient_qrels: bool = False, hub_cache_dir: str | None = None) -> RetrievalTask:
    expanded = os.path.expanduser(location)
    if not os.path.isdir(expanded) and not looks_like_path(location) and location in BRIGHT_DOMAINS and not domain:
        location, domain = BRIGHT_HUB, location          # bright:biology -> the hub copy, domain biology
        expanded = location
    if os.path.isdir(expanded):
        if not domain:
            found = sorted({os.path.basename(p).split("-")[0].removesuffix(".jsonl")
                            for p in glob.glob(os.path.join(expanded, "examples", "*"))})
            if len(found) != 1:
                raise DataError(f"{expanded}: choose a BRIGHT domain with bright:{location}#DOMAIN from {found}")
            domain = found[0]
        return load_bright_dir(expanded, domain, instruction, long_documents, lenient_qrels)
    if looks_like_path(location):
        raise DataError(f"{location}: folder not found (a BRIGHT copy with examples/ and documents/)")
    if not domain:
        raise DataError(f"--dataset=bright:{location}: name the domain, bright:{location}#DOMAIN, "
                        f"DOMAIN in {list(BRIGHT_DOMAINS)}")
    docs_config = "long_documents" if long_documents else "documents"
    root = hub_snapshot(location, [f"examples/{domain}-*", f"{docs_config}/{domain}-*"], hub_cache_dir)
    return load_bright_dir(root, domain, instruction, long_documents, lenient_qrels)
