"""The (query, passage) pairs to curate and the passage collection they come from.

Three kinds of input (``--input``):

- a BEIR folder (corpus.jsonl, queries.jsonl, qrels/<split>.tsv): one pair per judged (query, document) with a
  grade above 0; the collection is the whole corpus;
- a ``.jsonl`` file of ``{"query": ..., "passage": ...}`` objects (an optional ``"id"`` names the pair); the
  collection is the set of all passages in the file;
- a hub dataset id with ``query`` and ``passage`` columns (``--input_split``, default ``train``);
- ``synthetic`` or ``synthetic:N``: the (Q+, P+) pairs of N records (default 200) of infjax's synthetic
  corpus (infjax.data.synthetic, offline); the collection is every passage of those records.

The collection supplies the verifier's random distractors and the passages that `negatives=retrieve` searches.
``limit`` pairs are drawn with ``seed`` (a permutation of the input order), then kept in input order, so the
same flags always select the same pairs.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os

import numpy as np

from infjax.data import synthetic
from infjax.errors import UserError
from infjax.evaluation.datasets import load_beir, read_rows
from infjax.evaluation.types import DataError


class SourceError(UserError, ValueError):
    """An input that cannot be read as (query, passage) pairs; the message names the file, line or field."""


@dataclasses.dataclass(frozen=True)
class Pair:
    """One (Q+, P+) pair. ``id`` is stable across runs: it keys every stage's output."""

    id: str
    query: str
    passage: str
    passage_id: str


@dataclasses.dataclass(frozen=True)
class Collection:
    """The selected pairs and the passage collection (passage id -> text) they were drawn from."""

    name: str
    pairs: tuple[Pair, ...]
    passages: dict[str, str]
    total_pairs: int                 # pairs in the input before --limit


def pair_id(query: str, passage: str) -> str:
    """A content id for a pair without one: the first 16 hex digits of sha256(query NUL passage)."""
    return hashlib.sha256(f"{query}\x00{passage}".encode()).hexdigest()[:16]


def select(pairs: list[Pair], limit: int | None, seed: int) -> list[Pair]:
    """`limit` pairs drawn with `seed` (all when None), in input order."""
    if limit is None or limit >= len(pairs):
        return list(pairs)
    chosen = np.random.default_rng(seed).permutation(len(pairs))[:limit]
    return [pairs[i] for i in sorted(chosen)]


def _beir(folder: str, split: str | None) -> tuple[list[Pair], dict[str, str]]:
    task = load_beir(folder, split=split)
    pairs = []
    for qid in sorted(task.qrels):
        for did, grade in sorted(task.qrels[qid].items()):
            if grade > 0:
                pairs.append(Pair(f"{qid}::{did}", task.queries[qid], task.corpus[did], did))
    if not pairs:
        raise SourceError(f"{folder}: no judgment with a grade above 0 in its qrels")
    return pairs, dict(task.corpus)


def _text(row: dict, field: str, where: str) -> str:
    value = row.get(field)
    if not isinstance(value, str) or not value.strip():
        raise SourceError(f"{where}: field {field!r} must be a non-empty string, got {value!r:.60}")
    return value.strip()


def _rows_to_pairs(rows, where) -> tuple[list[Pair], dict[str, str]]:
    pairs, passages, seen = [], {}, {}
    passage_ids: dict[str, str] = {}
    for n, row in rows:
        query, passage = _text(row, "query", where(n)), _text(row, "passage", where(n))
        given = row.get("id")
        if given is not None and not isinstance(given, (str, int)):
            raise SourceError(f"{where(n)}: field 'id' must be a string or an integer, got {given!r:.60}")
        pid = str(given) if given is not None else pair_id(query, passage)
        if pid in seen:
            raise SourceError(f"{where(n)}: pair id {pid!r} repeats {where(seen[pid])} "
                              "(a pair without an 'id' is identified by its query and passage)")
        seen[pid] = n
        did = passage_ids.setdefault(passage, f"p{len(passage_ids)}")
        passages[did] = passage
        pairs.append(Pair(pid, query, passage, did))
    if not pairs:
        raise SourceError(f"{where(0).rsplit(':', 1)[0]}: no pairs")
    return pairs, passages


def _jsonl(path: str) -> tuple[list[Pair], dict[str, str]]:
    def rows():
        try:
            yield from read_rows(path)            # evaluation's reader: line numbers, one error per bad line
        except DataError as e:
            raise SourceError(str(e)) from None

    return _rows_to_pairs(rows(), lambda n: f"{path}:{n}")


def _hub(dataset_id: str, split: str) -> tuple[list[Pair], dict[str, str]]:
    import datasets

    try:
        data = datasets.load_dataset(dataset_id, split=split)
    except Exception as e:    # noqa: BLE001 - offline, unknown id or split: one message naming the input
        raise SourceError(f"--input={dataset_id!r}: not a local folder or .jsonl file, and loading it as a hub "
                          f"dataset (split {split!r}) failed: {type(e).__name__}: {str(e)[:300]}") from None
    missing = [c for c in ("query", "passage") if c not in data.column_names]
    if missing:
        raise SourceError(f"--input={dataset_id!r} split {split!r}: columns {missing} not found; "
                          f"columns present: {data.column_names}")
    return _rows_to_pairs(enumerate(data, 1), lambda n: f"{dataset_id}[{split}] row {n}")


SYNTHETIC_RECORDS = 200


def _synthetic(spec: str) -> tuple[list[Pair], dict[str, str]]:
    _, _, count = spec.partition(":")
    if count and not (count.isdigit() and int(count) > 0):
        raise SourceError(f"--input={spec!r}: expected synthetic or synthetic:N with N >= 1")
    records = synthetic.make_train_records(int(count or SYNTHETIC_RECORDS), seed=0)
    ids: dict[str, str] = {}                     # text -> passage id, in order of first appearance
    for r in records:
        for f in ("document_positive", "hard_negative_document_1", "hard_negative_document_2"):
            ids.setdefault(r[f], f"s{len(ids)}")
    passages = {pid: text for text, pid in ids.items()}
    pairs = [Pair(f"syn{i:04d}", r["query_positive"], r["document_positive"], ids[r["document_positive"]])
             for i, r in enumerate(records)]
    return pairs, passages


def load(spec: str, *, split: str | None = None, limit: int | None = None, seed: int = 0) -> Collection:
    """Read `spec` (BEIR folder, .jsonl of pairs, synthetic[:N], or hub id); select `limit` pairs with `seed`."""
    path = os.path.expanduser(spec)
    if spec == "synthetic" or spec.startswith("synthetic:"):
        pairs, passages = _synthetic(spec)
    elif os.path.isdir(path):
        pairs, passages = _beir(path, split)
    elif os.path.isfile(path):
        if not path.endswith(".jsonl"):
            raise SourceError(f"--input={spec!r}: a file input must be a .jsonl of {{query, passage}} objects")
        pairs, passages = _jsonl(path)
    elif spec.startswith(("/", ".", "~")) or spec.count("/") > 1 or spec.endswith(".jsonl"):
        raise SourceError(f"--input={spec!r}: no such file or folder")
    else:
        pairs, passages = _hub(spec, split or "train")
    return Collection(spec, tuple(select(pairs, limit, seed)), passages, len(pairs))
