"""Tokenize once: every text of the training records as token ids, cached on disk and memory-mapped.

A training record has seven texts (its fields, `inf_ir.FIELDS`). Each is
tokenized once per dataset and tokenizer, without special tokens, as the
batches need it: a passage with the passage prefix, an instruction or a
query with the whitespace the query template puts before it (Interaction I),
or with the query prefix, on its own (Interaction II). Texts are kept cut at
their side's maximum content (max_len less the special tokens), with their
uncut token counts. A step's encoder inputs are then assembled from those
ids (data/batches.py): an instruction-aware query is the template's constant
tokens, its two fields' ids and the special tokens, cut at query_max_len,
exactly as the tokenizer would have made it of the whole text. That is
checked on every query of the data while tokenizing; where a tokenizer or
template does not split that way (for one query of the data is enough), the
store says so (`TokenStore.exact` False, one warning) and each step's texts
are tokenized as the step is built (`batches.StepTexts`, per-step
tokenization).

The same pass cleans the rows (`inf_ir.clean_record`: a bad row stops the
run naming its split, row and field, or is skipped and counted), refuses a
negative with its positive's token ids, finds duplicate records by a digest
of their token ids (not by copies of their text), and lists the distinct
instructions, the pool the instruction negatives are drawn from. It runs
in worker processes (data.tokenize_workers) with a progress bar.

The cache (`data.cache_dir`, default $INFJAX_CACHE_DIR or ~/.cache/infjax)
holds one folder per key (`cache_key`), a digest of: the data's content
(`identify`: the bytes of local files, a hub split's own fingerprint), how it
is read (splits, field map, bad rows, limit, duplicates), the tokenizer (its
whole pipeline, not its path), the maximum lengths and the text format. A
second run, a resume and every other process of the host reuse it: the first
process to take the key's file lock builds it into a temporary folder renamed
into place when whole; the others wait and read it. It must be a local folder
(it is memory-mapped): every host of a job builds its own, or shares one on a
shared file system. Small in-memory data (the synthetic corpus, tests) is
tokenized in memory, without a cache (`in_memory`).

Files of a cache folder: tokens.bin (every piece's ids, uint16 where the
vocabulary allows, else int32), offset.npy [R] (where clean record r's
pieces start), length.npy [R, 7] (their kept lengths), uncut.npy [R, 7],
source.npy [R] (the row each came from, over the splits in order), kept.npy
[N] (the clean records that train, duplicates dropped), pool.npy [P]
(training record * 7 + field of each distinct instruction's first occurrence),
own.npy [N, 2] (the pool index of each training record's I+ and I-),
text_key.npy [R, 7] (a 64-bit digest of each piece's whole ids: what finds a
step's false negatives, equal texts in other rows), meta.json (written last: what was built, its warnings, its fingerprint, and
the SHA-256 of every other file). An entry is used only when each file has
its size and its digest (`check`: about 0.7 s per GB read; a file that
differs is said in one warning and the entry is built again), and only when
this user alone wrote it (`trust.foreign`; `data.cache_shared` for a folder
shared on purpose).
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import errno
import fcntl
import functools
import hashlib
import json
import logging
import multiprocessing
import os
import re
import shutil
import socket
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from infjax.data import inf_ir, trust
from infjax.data.inf_ir import FIELDS, BadRowError
from infjax.data.tokenize import QueryParts, TextFormat, Tokenizer
from infjax.errors import ConfigError, RunStopped, UserError, byte_size, describe, full_disk

log = logging.getLogger("infjax.data")

VERSION = 3                 # of the cache's layout and of what its pieces hold (2: meta.json holds digests;
                            # 3: text_key.npy)
F = {name: i for i, name in enumerate(FIELDS)}
I_POS, Q_POS, P_POS, I_NEG, Q_NEG, P_NEG1, P_NEG2 = (F[n] for n in FIELDS)
QUERY_FIELDS = (I_POS, Q_POS, I_NEG, Q_NEG)          # cut at the query side's length
FIELD_ROLE = {I_POS: "instruction", I_NEG: "instruction", Q_POS: "query", Q_NEG: "query"}
CHUNK_ROWS = 2048           # rows a worker cleans and tokenizes per task
IN_PROCESS_ROWS = 20_000    # fewer rows than this are tokenized in this process (a worker costs seconds to start)
FILES = ("tokens.bin", "offset.npy", "length.npy", "uncut.npy", "source.npy", "kept.npy", "pool.npy", "own.npy",
         "text_key.npy")


# --------------------------------------------------------------------------
# What the ids are made of (part of the cache key)
# --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Encoding:
    """How the texts of a record become ids: the lengths, the text format and the interaction."""

    query_max_len: int
    passage_max_len: int
    fmt: TextFormat = TextFormat()
    interaction: str = "concat"        # concat (Interaction I) | cross_attention (Interaction II)

    def piece_texts(self, record: dict) -> list[str]:
        """The seven texts of `record` that are tokenized (FIELDS order)."""
        return [before + record[name] for before, name in zip(self._before(), FIELDS)]

    @functools.cache
    def _before(self) -> tuple[str, ...]:
        """What goes before each field's text in its piece.

        The passage prefix, the query prefix (Interaction II), or the whitespace the template puts before the
        field (Interaction I)."""
        parts = self.parts()
        space = dict((parts.first, parts.second)) if parts is not None else {}
        return tuple(self.fmt.passage("") if i not in FIELD_ROLE else self.fmt.alone("")
                     if self.interaction == "cross_attention" else space.get(FIELD_ROLE[i], "")
                     for i in range(len(FIELDS)))

    def parts(self) -> QueryParts | None:
        return self.fmt.query_parts() if self.interaction == "concat" else None

    def key(self) -> dict:
        return {"query_max_len": self.query_max_len, "passage_max_len": self.passage_max_len,
                "query_template": self.fmt.query_template, "query_prefix": self.fmt.query_prefix,
                "passage_prefix": self.fmt.passage_prefix, "interaction": self.interaction}


@dataclasses.dataclass(frozen=True)
class Reading:
    """How the rows of the sources are read (part of the cache key)."""

    on_bad_row: str = "error"          # error | skip (inf_ir.ON_BAD_ROW_CHOICES)
    dedupe: bool = True

    def __post_init__(self):
        if self.on_bad_row not in inf_ir.ON_BAD_ROW_CHOICES:
            raise ValueError(f"on_bad_row must be one of {list(inf_ir.ON_BAD_ROW_CHOICES)}, got {self.on_bad_row!r}")


# --------------------------------------------------------------------------
# The store
# --------------------------------------------------------------------------

@dataclasses.dataclass
class TokenStore:
    """The token ids of every training record's texts, and what assembling a step needs besides.

    Records are numbered as training sees them (0 .. N-1, duplicates dropped); `kept` maps them to the
    clean records R whose pieces the arrays hold."""

    tokens: np.ndarray          # every piece's kept ids, one after another
    offset: np.ndarray          # [R] int64: where clean record r's seven pieces start in `tokens`
    length: np.ndarray          # [R, 7] int32: their kept lengths (cut at the side's content length)
    uncut: np.ndarray           # [R, 7] int32: their whole lengths
    source: np.ndarray          # [R] int64: the source row of clean record r (the splits one after another)
    kept: np.ndarray            # [N] int64: the clean record of each training record
    pool: np.ndarray            # [P] int64: training record * 7 + field of each distinct instruction
    own: np.ndarray             # [N, 2] int32: the pool index of each training record's I+ and I-
    text_key: np.ndarray        # [R, 7] uint64: a digest of each piece's whole ids (equal texts, equal keys)
    meta: dict                  # what was built (see `_meta`), JSON
    folder: str | None = None   # the cache folder it was read from (None: in memory)

    # --- what meta says
    @property
    def pre(self) -> list[int]:
        return self.meta["specials"][0]

    @property
    def post(self) -> list[int]:
        return self.meta["specials"][1]

    @property
    def constants(self) -> dict[str, list[int]]:
        """The ids of the query template's constant texts: "head", "middle", "tail" (empty lists for none)."""
        return self.meta["constants"]

    @property
    def exact(self) -> bool:
        """Whether a step's texts can be assembled from these ids (else they are tokenized per step)."""
        return bool(self.meta["exact"])

    @property
    def fingerprint(self) -> dict:
        return self.meta["fingerprint"]

    @property
    def pad_id(self) -> int:
        return int(self.meta["pad_id"])

    def cap(self, field: int) -> int:
        """The most ids a piece of `field` keeps: its side's max_len less the special tokens."""
        side = "query_max_len" if field in QUERY_FIELDS else "passage_max_len"
        return self.meta["encoding"][side] - len(self.pre) - len(self.post)

    def __len__(self) -> int:
        return len(self.kept)

    # --- pickled by file names: a worker process maps the files again instead of receiving copies
    def __getstate__(self):
        if self.folder is None:
            return self.__dict__
        return {"folder": self.folder}

    def __setstate__(self, state):
        if set(state) == {"folder"}:
            self.__dict__.update(read_folder(state["folder"]).__dict__)
        else:
            self.__dict__.update(state)

    def starts(self, records: np.ndarray, fields: np.ndarray) -> np.ndarray:
        """Where piece `fields` of clean records `records` starts in `tokens` (arrays of one shape)."""
        lengths = np.asarray(self.length[records], np.int64)                 # [..., 7]
        before = np.cumsum(lengths, axis=-1) - lengths
        return np.asarray(self.offset[records], np.int64) + np.take_along_axis(before, fields[..., None], -1)[..., 0]


def read_folder(folder: str) -> TokenStore:
    """A cache folder's store, its arrays memory-mapped (nothing read until a step needs it)."""
    with open(os.path.join(folder, "meta.json"), encoding="utf-8") as f:
        meta = json.load(f)
    arrays = {name[:-4]: np.load(os.path.join(folder, name), mmap_mode="r") for name in FILES if name.endswith(".npy")}
    tokens = np.memmap(os.path.join(folder, "tokens.bin"), dtype=meta["dtype"], mode="r") \
        if meta["tokens"] else np.zeros(0, meta["dtype"])
    return TokenStore(tokens=tokens, meta=meta, folder=folder, **arrays)


# --------------------------------------------------------------------------
# One chunk of rows: clean, tokenize, check (in a worker process, or here)
# --------------------------------------------------------------------------

@dataclasses.dataclass
class Job:
    """What a worker needs: the sources, the tokenizer's folder, the encoding.

    The sources' memory-mapped datasets pickle as file names."""

    sources: list            # [(split, datasets.Dataset, resolved field map)]
    tokenizer_path: str
    padding_side: str
    encoding: Encoding
    chunk_rows: int = CHUNK_ROWS


_WORKER: dict[str, Any] = {}


def _start_worker(job: Job, parallel_tokenizer: bool) -> None:
    if not parallel_tokenizer:          # one process per core already: the tokenizer's own threads would compete
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    tok = Tokenizer(job.tokenizer_path, job.padding_side)
    _WORKER.clear()
    _WORKER.update(job=job, tok=tok, specials=tok.specials())


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def _encode_chunk(task: tuple[int, int, int]) -> dict:
    """Rows start..stop-1 of source `split_index`: their clean records' pieces, digests and bad rows."""
    split_index, start, stop = task
    job, tok = _WORKER["job"], _WORKER["tok"]
    split, dataset, resolved = job.sources[split_index]
    columns = list(dict.fromkeys(resolved[f] for f in FIELDS))
    values = dataset.select_columns(columns)[start:stop]
    records, rows, bad = [], [], []
    for k, raw in enumerate(zip(*(values[c] for c in columns))):
        try:
            records.append(inf_ir.clean_record(dict(zip(columns, raw)), field_map=resolved, split=split,
                                               row=start + k))
            rows.append(start + k)
        except BadRowError as e:
            bad.append(e)
    return _encode_records(records, rows, bad, split, resolved, job.encoding, tok, _WORKER["specials"])


def _encode_records(records: list[dict], rows: list[int], bad: list[BadRowError], split: str, resolved: dict,
                    enc: Encoding, tok: Tokenizer, specials) -> dict:
    pre, post = specials if specials is not None else ([], [])
    n = len(records)
    texts = [t for r in records for t in enc.piece_texts(r)]
    ids = tok.encode(texts)
    uncut = np.fromiter(map(len, ids), np.int32, len(ids)).reshape(n, 7)
    flat = np.fromiter((i for piece in ids for i in piece), np.int64, int(uncut.sum()))
    ends = np.cumsum(uncut.reshape(-1), dtype=np.int64)
    piece_digests = [_digest(flat[e - u:e].tobytes()) for e, u in zip(ends.tolist(), uncut.reshape(-1).tolist())]
    # a negative the model reads as its positive (the same ids) is a bad row, as a same-text one is
    good = np.ones(n, bool)
    for r in range(n):
        d = piece_digests[7 * r:7 * r + 7]
        for negative, positive in inf_ir.NEGATIVE_OF.items():
            if d[F[negative]] == d[F[positive]]:
                bad.append(BadRowError(split, rows[r], negative, f"the same token ids as {positive} for the model's "
                                       f"tokenizer, which reads the two texts alike (they differ only in what it "
                                       f"ignores: case, accents, spacing or invisible characters); a negative must "
                                       f"differ from its positive", resolved[negative]))
                good[r] = False
                break
    # kept ids: each piece cut at its side's content length
    caps = np.array([enc.query_max_len if i in QUERY_FIELDS else enc.passage_max_len for i in range(7)],
                    np.int32) - len(pre) - len(post)
    length = np.minimum(uncut, caps[None, :])
    within = np.arange(len(flat)) - np.repeat(ends - uncut.reshape(-1), uncut.reshape(-1))
    keep = within < np.repeat(length.reshape(-1), uncut.reshape(-1))
    if not good.all():
        keep &= np.repeat(np.repeat(good, 7), uncut.reshape(-1))
    mismatch, example = _check_assembly(records, ids, enc, tok, pre, post, good)
    sel = np.flatnonzero(good)
    return {"rows": np.asarray(rows, np.int64)[sel], "bad": bad, "tokens": flat[keep].astype(np.int32),
            "length": length[sel], "uncut": uncut[sel],
            "token_digest": np.frombuffer(b"".join(_digest(b"".join(piece_digests[7 * r:7 * r + 7])) for r in sel),
                                          np.uint8).reshape(-1, 16),
            "text_key": np.frombuffer(b"".join(d[:8] for r in sel for d in piece_digests[7 * r:7 * r + 7]),
                                      np.uint64).reshape(-1, 7),
            "text_digest": np.frombuffer(b"".join(_digest(json.dumps(records[r], sort_keys=True, ensure_ascii=False)
                                                          .encode()) for r in sel), np.uint8).reshape(-1, 16),
            "instruction_digest": np.frombuffer(b"".join(_digest(records[r][name].encode()) for r in sel
                                                         for name in ("instruction_positive", "instruction_negative")),
                                                np.uint8).reshape(-1, 2, 16),
            "mismatch": mismatch, "example": example}


def _check_assembly(records, ids, enc: Encoding, tok: Tokenizer, pre, post, good) -> tuple[int, str | None]:
    """How many of these records' texts, assembled from their pieces' ids, differ from the tokenizer's own ids.

    Returns (count, the first such text). Checked: every instruction-aware query (Interaction I) against the
    tokenizer's ids of the whole text, and a few passages, some of them cut."""
    if tok.truncation_side != "right":
        return len(records), f"the tokenizer cuts texts on the {tok.truncation_side} (assembly cuts on the right)"
    parts = enc.parts()
    if enc.interaction == "concat" and parts is None:
        return len(records), f"data.query_template={enc.fmt.query_template!r} names a field twice"
    const = {}
    if parts is not None:
        const = dict(zip(("head", "middle", "tail"), tok.encode([parts.head, parts.middle, parts.tail])))
    texts, assembled, max_lens = [], [], []
    qcap = enc.query_max_len - len(pre) - len(post)
    pcap = enc.passage_max_len - len(pre) - len(post)
    passages_checked = 0
    for r, record in enumerate(records):
        if not good[r]:
            continue
        piece = ids[7 * r:7 * r + 7]
        if parts is not None:
            for i_field, q_field in ((I_POS, Q_POS), (I_NEG, Q_POS), (I_POS, Q_NEG)):
                by_role = {"instruction": piece[i_field], "query": piece[q_field]}
                content = (const["head"] + by_role[parts.first[0]] + const["middle"] + by_role[parts.second[0]]
                           + const["tail"])
                texts.append(enc.fmt.query(record[FIELDS[i_field]], record[FIELDS[q_field]]))
                assembled.append(pre + content[:qcap] + post)
                max_lens.append(enc.query_max_len)
        for p_field in (P_POS, P_NEG1, P_NEG2):        # a few passages: the cut ones first
            if passages_checked < 4 and (len(piece[p_field]) > pcap or r == 0):
                texts.append(enc.fmt.passage(record[FIELDS[p_field]]))
                assembled.append(pre + piece[p_field][:pcap] + post)
                max_lens.append(enc.passage_max_len)
                passages_checked += 1
    if not texts:
        return 0, None
    mismatch, example = 0, None
    for length in sorted(set(max_lens)):
        which = [i for i, m in enumerate(max_lens) if m == length]
        direct = tok.encode([texts[i] for i in which], length, special=True)
        for i, d in zip(which, direct):
            if list(d) != assembled[i]:
                mismatch += 1
                if example is None:
                    example = f"{texts[i][:80]!r}: the tokenizer gives {list(d)[:12]}..., assembled {assembled[i][:12]}..."
    return mismatch, example


# --------------------------------------------------------------------------
# The pass over every row
# --------------------------------------------------------------------------

def _tasks(sources, chunk_rows: int) -> list[tuple[int, int, int]]:
    return [(i, start, min(start + chunk_rows, len(ds))) for i, (_, ds, _) in enumerate(sources)
            for start in range(0, len(ds), chunk_rows)]


def cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _worker_count(requested: int, rows: int) -> int:
    if requested >= 0:
        return requested
    return 0 if rows < IN_PROCESS_ROWS else cores()


def encode_sources(job: Job, reading: Reading, workers: int, tokens_out, progress: bool = True) -> dict:
    """Every row of `job.sources`, cleaned, checked and tokenized: the store's arrays and its meta's counts.

    `tokens` is not among the arrays: it goes to `tokens_out` as it comes. Bad rows stop it (on_bad_row=error)
    or are skipped and counted, one warning per split; a split whose every row is bad is refused."""
    from tqdm.auto import tqdm

    if reading.on_bad_row == "error":              # a null or blank field stops the run now, not at its row
        t0 = time.perf_counter()
        for split, dataset, resolved in job.sources:
            bad = inf_ir.first_empty_row(dataset, resolved, split)
            if bad is not None:
                raise bad
        log.info("no null or blank field in %d rows (checked in %.1f s, before tokenizing)",
                 sum(len(ds) for _, ds, _ in job.sources), time.perf_counter() - t0)
    tasks = _tasks(job.sources, job.chunk_rows)
    total = sum(len(ds) for _, ds, _ in job.sources)
    workers = _worker_count(workers, total)
    splits = [s for s, _, _ in job.sources]
    first_row = np.cumsum([0] + [len(ds) for _, ds, _ in job.sources])
    parts: dict[str, list] = {k: [] for k in ("rows", "length", "uncut", "token_digest", "text_digest",
                                              "instruction_digest", "text_key")}
    bad_by_split: dict[int, list[BadRowError]] = {}
    mismatch, example, written, done = 0, None, 0, 0
    t0 = time.perf_counter()
    log.info("tokenizing %d rows of %s (%s)", total, ", ".join(splits),
             "in this process" if not workers else f"{workers} worker processes")
    bar = tqdm(total=total, desc="tokenize", unit="row", dynamic_ncols=True, file=sys.stderr,
               disable=not progress or not _interactive(), mininterval=1.0)
    with _pool(job, workers) as results:
        for (split_index, start, stop), out in zip(tasks, results(tasks)):
            if out["bad"]:
                if reading.on_bad_row == "error":
                    raise min(out["bad"], key=lambda e: e.row)
                bad_by_split.setdefault(split_index, []).extend(out["bad"])
            out["rows"] = out["rows"] + first_row[split_index]
            for k in parts:
                parts[k].append(out[k])
            tokens_out(out["tokens"])
            written += len(out["tokens"])
            mismatch += out["mismatch"]
            example = example or out["example"]
            bar.update(stop - start)
            done += stop - start
            _progress_line(done, total, t0, bar.disable)
    bar.close()
    arrays = {k: np.concatenate(v) if v else np.zeros((0, *shape), dtype) for (k, v), (shape, dtype) in
              zip(parts.items(), [((), np.int64), ((7,), np.int32), ((7,), np.int32), ((16,), np.uint8),
                                  ((16,), np.uint8), ((2, 16), np.uint8), ((7,), np.uint64)])}
    warnings = []
    for split_index, bad in sorted(bad_by_split.items()):
        bad.sort(key=lambda e: e.row)
        warnings.append(inf_ir.skipped_warning(splits[split_index], bad))
        if len(bad) == len(job.sources[split_index][1]):
            raise inf_ir.no_usable_rows(splits[split_index], bad)
    seconds = time.perf_counter() - t0
    log.info("tokenized %d rows (%d records, %d skipped as bad) into %d ids in %.1f s (%.0f rows/s)", total,
             len(arrays["rows"]), total - len(arrays["rows"]), written, seconds, total / max(seconds, 1e-9))
    return {**arrays, "warnings": warnings, "mismatch": mismatch, "example": example, "seconds": seconds,
            "workers": workers, "split_rows": [len(ds) for _, ds, _ in job.sources]}


_last_line = [0.0]


def _every(seconds: float) -> bool:
    now = time.monotonic()
    if now - _last_line[0] >= seconds:
        _last_line[0] = now
        return True
    return False


def _progress_line(done: int, total: int, t0: float, no_bar: bool) -> None:
    """Without a bar (a log file, a pipe): a line every 30 s."""
    if no_bar and done < total and _every(30.0):
        rate = done / max(time.perf_counter() - t0, 1e-9)
        log.info("tokenizing: %d of %d rows (%.0f%%), %.0f rows/s, about %.0f s left", done, total,
                 100 * done / total, rate, (total - done) / max(rate, 1e-9))


def _interactive() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


@contextlib.contextmanager
def _pool(job: Job, workers: int):
    """A function tasks -> results in order: in this process (workers=0), or in `workers` processes.

    The processes are spawned, not forked: this process runs JAX's threads."""
    if workers == 0:
        _start_worker(job, parallel_tokenizer=True)
        try:
            yield lambda tasks: map(_encode_chunk, tasks)
        finally:
            _WORKER.clear()
        return
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(workers, initializer=_start_worker, initargs=(job, False)) as pool:
        yield lambda tasks: pool.imap(_encode_chunk, tasks, chunksize=1)


# --------------------------------------------------------------------------
# From the pass's arrays to the store: duplicates, the instruction pool, the fingerprint
# --------------------------------------------------------------------------

def _first_of(digests: np.ndarray) -> np.ndarray:
    """For each row of `digests` [n, 16] uint8, the index of the first row equal to it."""
    if len(digests) == 0:
        return np.zeros(0, np.int64)
    keys = np.ascontiguousarray(digests).view(np.dtype((np.void, digests.shape[1]))).reshape(-1)
    _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    return first[inverse.reshape(-1)]


def finish(arrays: dict, reading: Reading) -> tuple[dict, list[str]]:
    """kept, pool, own and the fingerprint from the pass's digests; the duplicates' warning, if any."""
    t0 = time.perf_counter()
    n = len(arrays["rows"])
    first = _first_of(arrays["token_digest"])
    repeats = np.flatnonzero(first != np.arange(n))
    warnings = []
    if len(repeats):
        same_text = [bool((arrays["text_digest"][i] == arrays["text_digest"][first[i]]).all()) for i in repeats[:3]]
        shown = ", ".join(f"record {i} repeats record {first[i]}" + ("" if same else
                                                                       " (the same token ids, not the same text)")
                          for i, same in zip(repeats[:3].tolist(), same_text))
        more = f" and {len(repeats) - 3} more" if len(repeats) > 3 else ""
        what = ("dropped (data.dedupe=True)" if reading.dedupe else
                "kept (data.dedupe=False): a batch may hold one twice, an in-batch false negative")
        warnings.append(f"training data: {len(repeats)} duplicate record(s) {what}: {shown}{more}")
    kept = np.flatnonzero(first == np.arange(n)) if reading.dedupe else np.arange(n)
    # the pool: distinct instruction texts over the training records, I+ then I- of each, in that order
    ins = arrays["instruction_digest"][kept].reshape(-1, 16)
    firsts = _first_of(ins)                                      # [2N] index of the first equal instruction
    leaders = np.unique(firsts)                                  # first occurrences, ascending = pool order
    own = np.searchsorted(leaders, firsts).astype(np.int32).reshape(-1, 2)
    where = (leaders // 2) * 7 + np.where(leaders % 2 == 0, I_POS, I_NEG)     # training record * 7 + field
    h = hashlib.blake2b(digest_size=8)
    h.update(np.ascontiguousarray(arrays["text_digest"][kept]).tobytes())
    fingerprint = {"records": int(len(kept)), "hash": h.hexdigest(), "of": "record digests"}
    log.info("duplicates, instruction pool and fingerprint of %d records found in %.1f s", n, time.perf_counter() - t0)
    return {"kept": kept.astype(np.int64), "pool": where.astype(np.int64), "own": own,
            "fingerprint": fingerprint}, warnings


def _meta(encoding: Encoding, reading: Reading, tok: Tokenizer, arrays: dict, finished: dict, warnings: list[str],
          key: dict, dtype: str, tokens: int) -> dict:
    specials = tok.specials()
    parts = encoding.parts()
    constants = {"head": [], "middle": [], "tail": []}
    if parts is not None:
        constants = dict(zip(("head", "middle", "tail"), tok.encode([parts.head, parts.middle, parts.tail])))
    exact = specials is not None and arrays["mismatch"] == 0
    return {"version": VERSION, "key": key, "encoding": encoding.key(), "reading": dataclasses.asdict(reading),
            "specials": list(specials) if specials is not None else [[], []], "constants": constants,
            "query_order": [parts.first[0], parts.second[0]] if parts is not None else None,
            "pad_id": tok.pad_id, "dtype": dtype, "tokens": tokens,
            "exact": exact, "mismatch": int(arrays["mismatch"]), "mismatch_example": arrays["example"],
            "records": int(len(finished["kept"])), "clean_records": int(len(arrays["rows"])),
            "split_rows": arrays["split_rows"],
            "instructions": int(len(finished["pool"])), "fingerprint": finished["fingerprint"],
            "warnings": warnings, "seconds": round(arrays["seconds"], 1),
            "built": datetime.datetime.now().isoformat(timespec="seconds"), "host": socket.gethostname()}


def token_dtype(tok: Tokenizer) -> str:
    return "uint16" if tok.vocab_size <= np.iinfo(np.uint16).max + 1 else "int32"


def build(job: Job, reading: Reading, key: dict, folder: str | None, workers: int = -1,
          progress: bool = True) -> TokenStore:
    """Tokenize every row of `job.sources` into a store.

    Written into `folder` (then read back memory-mapped), or kept in memory (folder None)."""
    tok = Tokenizer(job.tokenizer_path, job.padding_side)
    dtype = token_dtype(tok)
    chunks: list[np.ndarray] = []
    out = open(os.path.join(folder, "tokens.bin"), "wb") if folder else None
    try:
        def write(ids: np.ndarray) -> None:
            if out is not None:
                out.write(ids.astype(dtype).tobytes())
            else:
                chunks.append(ids.astype(dtype))
        arrays = encode_sources(job, reading, workers, write, progress)
    finally:
        if out is not None:
            out.close()
    finished, dup_warnings = finish(arrays, reading)
    lengths = arrays["length"].astype(np.int64).sum(axis=1)
    store_arrays = {"offset": np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) if len(lengths)
                    else np.zeros(0, np.int64),
                    "length": arrays["length"], "uncut": arrays["uncut"], "source": arrays["rows"],
                    "kept": finished["kept"], "pool": finished["pool"], "own": finished["own"],
                    "text_key": arrays["text_key"]}
    meta = _meta(job.encoding, reading, tok, arrays, finished, arrays["warnings"] + dup_warnings, key, dtype,
                 int(lengths.sum()))
    if folder is None:
        tokens = np.concatenate(chunks) if chunks else np.zeros(0, dtype)
        return TokenStore(tokens=tokens, meta=meta, **store_arrays)
    for name, value in store_arrays.items():
        np.save(os.path.join(folder, f"{name}.npy"), value)
    meta["files"] = {name: file_digest(os.path.join(folder, name)) for name in FILES}
    with open(os.path.join(folder, "meta.json"), "w", encoding="utf-8") as f:   # last: the folder is whole
        json.dump(meta, f, indent=1)
    return read_folder(folder)


# --------------------------------------------------------------------------
# The cache: where, which key, one builder per key
# --------------------------------------------------------------------------

def cache_root(configured: str = "") -> str:
    """data.cache_dir, else $INFJAX_CACHE_DIR, else ~/.cache/infjax; a local folder (memory-mapped files)."""
    path = configured or os.environ.get("INFJAX_CACHE_DIR") or os.path.join("~", ".cache", "infjax")
    if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", path):          # an object store's URL (gs://, s3://)
        raise ConfigError(f"config.data.cache_dir={path!r}: the token cache is memory-mapped, so it must be a local "
                          f"folder (the workdir may still be on an object store); leave it empty for "
                          f"~/.cache/infjax, or name a local or shared file system path")
    return os.path.abspath(os.path.expanduser(path))


def file_digest(path: str) -> str:
    """A digest of a file's bytes: identity by content (a file rewritten in place, same size and date, differs).

    SHA-256: about 0.7 s per GB where the CPU has SHA instructions (0.06 s for all-MiniLM-L6-v2's 87 MiB,
    docs/evaluation.md, 2026-11-28)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def key_digest(key: dict) -> str:
    """A cache entry's folder name: a digest of its key."""
    return hashlib.blake2b(json.dumps(key, sort_keys=True).encode(), digest_size=12).hexdigest()


def identify(source: str, splits: Sequence[str], root: str, shared: bool = False
             ) -> tuple[list[dict], tuple[str | None, ...]]:
    """Each split of `source` by its content, for the cache key; and where its local files become Arrow files.

    A split of local files is the SHA-256 of each file's bytes (`file_digest`), and its Arrow files go into
    ROOT/arrow/<digest of those digests>/, so that a file rewritten in place is converted again. A hub split is
    the fingerprint `datasets` gives it (`inf_ir.hub_fingerprint`), its Arrow files datasets' own (None).
    """
    identity, arrow_dirs = [], []
    t0 = time.perf_counter()
    log.info("identifying the training data %s (splits %s) by its content", source, ", ".join(splits))
    for split in splits:
        try:
            files = inf_ir.local_files(source, split)
        except FileNotFoundError as e:
            raise FileNotFoundError(f"config.data.source={source!r}: {e}") from e
        if files is None:
            identity.append({"split": split, "hub": source, "fingerprint": inf_ir.hub_fingerprint(source, split)})
            arrow_dirs.append(None)
        else:
            digests = [file_digest(f) for f in files]
            identity.append({"split": split, "files": digests, "bytes": sum(os.path.getsize(f) for f in files)})
            arrow_dir = os.path.join(root, "arrow", key_digest({"files": digests}))
            os.makedirs(os.path.dirname(arrow_dir), mode=0o755, exist_ok=True)
            trusted(arrow_dir, "Arrow folder", root, shared)
            arrow_dirs.append(arrow_dir)
    log.info("training data identified by content in %.1f s (%s)", time.perf_counter() - t0, ", ".join(
        f"{i['split']}: {len(i['files'])} file(s)" if "files" in i else f"{i['split']}: hub" for i in identity))
    return identity, tuple(arrow_dirs)


def cache_key(identity: list[dict], field_map: str, limit: int, reading: Reading, tokenizer: Tokenizer,
              encoding: Encoding) -> dict:
    """What names a cache entry (`key_digest` of it).

    The data's content (`identify`), how its rows are read (the field map's name, the limit, `reading`), the
    tokenizer's identity and the encoding; VERSION, the layout of the files."""
    return {"version": VERSION, "data": identity, "field_map": field_map, "limit": limit,
            "reading": dataclasses.asdict(reading), "tokenizer": tokenizer.identity(), "encoding": encoding.key()}


class BuildLock:
    """An exclusive flock on ROOT/tokens/KEY.lock while a store is built or checked.

    A process that waits says who holds it when it starts waiting, then every `SAY_EVERY` seconds."""

    SAY_EVERY = 60.0          # seconds between two "waiting" lines
    POLL = 1.0                # seconds between two tries of the lock

    def __init__(self, path: str):
        self.path, self.fd = path, None

    def __enter__(self):
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            what = "is a link (refused)" if e.errno == errno.ELOOP else f"cannot be opened: {e.strerror or e}"
            raise UserError(f"token cache lock {self.path} {what}; set config.data.cache_dir to a folder this "
                            f"process can write") from None
        say_at = time.monotonic()
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError:
                if time.monotonic() >= say_at:
                    holder = os.pread(self.fd, 4096, 0).decode(errors="replace") or "unknown"
                    log.info("waiting for another process to finish the token cache %s (holder: %s)",
                             self.path[:-5], holder)
                    say_at = time.monotonic() + self.SAY_EVERY
                time.sleep(self.POLL)
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                       "since": datetime.datetime.now().isoformat(timespec="seconds")}).encode(), 0)
        return self

    def __exit__(self, *exc):
        os.ftruncate(self.fd, 0)
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        return False


def open_cached(make_job: Callable[[], Job], reading: Reading, key: dict, root: str, workers: int = -1,
                shared: bool = False) -> TokenStore:
    """The store of `key` under `root`: read when a whole one is there, else built from `make_job()`.

    The sources are opened only then; one process per key builds, the others wait for it. An entry another
    user may have written is refused (UserError), unless `shared` (config.data.cache_shared)."""
    name = key_digest(key)
    tokens_dir = os.path.join(root, "tokens")
    os.makedirs(tokens_dir, mode=0o755, exist_ok=True)
    folder = os.path.join(tokens_dir, name)
    meta = os.path.join(folder, "meta.json")
    if os.path.isfile(meta):
        trusted(folder, "token cache entry", root, shared)
        checked = check(folder)
        if not checked.problem:
            return _hit(folder, checked)
    with BuildLock(folder + ".lock"):
        if os.path.isfile(meta):                  # built by the process that held the lock, or damaged
            trusted(folder, "token cache entry", root, shared)
            checked = check(folder)
            if not checked.problem:
                return _hit(folder, checked)
            log.warning("token cache %s is damaged (%s): tokenizing again", folder, checked.problem)
        for stale in os.listdir(tokens_dir):       # left by a builder that died: nobody holds the lock
            if stale.startswith(name + ".tmp-"):
                shutil.rmtree(os.path.join(tokens_dir, stale), ignore_errors=True)
        if os.path.isdir(folder):                  # a folder without meta.json is not whole
            shutil.rmtree(folder)
        tmp = f"{folder}.tmp-{socket.gethostname()}-{os.getpid()}"
        os.makedirs(tmp)
        try:
            store = build(make_job(), reading, key, tmp, workers)
            trust.private(tmp)
            os.replace(tmp, folder)
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            full = full_disk(e)
            if full is None:
                raise
            raise RunStopped(f"the token cache {root} ran out of space ({describe(full)}): tokenizing this data "
                             f"needs {_needs(key)} there, {byte_size(shutil.disk_usage(root).free)} are free now. "
                             f"The unfinished entry was removed and nothing was trained; free space there, or set "
                             f"config.data.cache_dir to a folder with room") from None
        log.info("token cache %s written (%s; a SHA-256 of each file, checked when it is read)", folder,
                 byte_size(_size(folder)))
        del store                                  # mapped from the temporary folder's name
        return read_folder(folder)


def _needs(key: dict) -> str:
    """What a build of `key` takes on disk, from its data files' size (docs/data.md §6: the Arrow files are up
    to 3x a parquet file's bytes, about 1x a JSON file's; the token cache about 1x a parquet file's)."""
    data = sum(split.get("bytes", 0) for split in key.get("data", []))
    if not data:
        return "room for the Arrow files and the token ids"
    return f"up to about {byte_size(4 * data)} (4x the data files' {byte_size(data)}: Arrow files and token ids)"


def trusted(folder: str, what: str, root: str, shared: bool) -> None:
    """Refuse `folder` (UserError, one line) when another user may have written it, unless `shared`."""
    problem = trust.foreign(folder)
    if not problem:
        return
    if not shared:
        raise UserError(trust.refusal(folder, what, problem, root))
    log.info("%s %s is used although %s: %s=True says %s is shared on purpose", what, folder, problem,
             trust.SHARED_FLAG, root)


@dataclasses.dataclass(frozen=True)
class Checked:
    """What `check` found: the problem ("" when none), the bytes it read and the seconds it took."""

    problem: str
    nbytes: int = 0
    seconds: float = 0.0


def check(folder: str) -> Checked:
    """Whether a cache folder holds what meta.json says: every file of the size it says, then of the digest.

    A cut file, a missing one, another folder's file or one whose bytes changed in place is not whole;
    `Checked.problem` names the first such file."""
    t0 = time.perf_counter()
    try:
        with open(os.path.join(folder, "meta.json"), encoding="utf-8") as f:
            meta = json.load(f)
        size = os.path.getsize(os.path.join(folder, "tokens.bin"))
        want = meta["tokens"] * np.dtype(meta["dtype"]).itemsize
        if size != want:
            return Checked(f"tokens.bin has {size} bytes, meta.json says {want}")
        lengths = {"offset": meta["clean_records"], "length": meta["clean_records"], "uncut": meta["clean_records"],
                   "source": meta["clean_records"], "kept": meta["records"], "pool": meta["instructions"],
                   "own": meta["records"], "text_key": meta["clean_records"]}
        for name, n in lengths.items():
            rows = np.load(os.path.join(folder, f"{name}.npy"), mmap_mode="r").shape[0]
            if rows != n:
                return Checked(f"{name}.npy has {rows} rows, meta.json says {n}")
        digests = meta["files"]
        nbytes = 0
        for name in FILES:
            path = os.path.join(folder, name)
            nbytes += os.path.getsize(path)
            if file_digest(path) != digests[name]:
                return Checked(f"{name} is not the file that was written: its SHA-256 differs from the one "
                               f"meta.json holds")
    except (OSError, ValueError, KeyError, TypeError) as e:
        return Checked(f"{type(e).__name__}: {e}")
    return Checked("", nbytes, time.perf_counter() - t0)


def _hit(folder: str, checked: Checked) -> TokenStore:
    store = read_folder(folder)
    m = store.meta
    log.info("token cache %s: %d records, %d ids, tokenized %s on %s in %.0f s; its files match their digests "
             "(%s read in %.1f s)", folder, m["records"], m["tokens"], m["built"], m["host"], m["seconds"],
             byte_size(checked.nbytes), checked.seconds)
    return store


def _size(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))


def in_memory(records: Sequence[dict], tokenizer_path: str, encoding: Encoding, reading: Reading = Reading(),
              padding_side: str = "right", split: str = "records") -> TokenStore:
    """A store of in-memory records (the synthetic corpus, tests), cleaned and checked as file rows are."""
    import datasets

    columns = {name: [r[name] for r in records] for name in FIELDS}
    return of_splits([(split, datasets.Dataset.from_dict(columns), dict(inf_ir.DEFAULT_FIELD_MAP))], tokenizer_path,
                     encoding, reading, padding_side)


def of_splits(sources: list, tokenizer_path: str, encoding: Encoding, reading: Reading = Reading(),
              padding_side: str = "right") -> TokenStore:
    """A store of opened splits, built in this process and kept in memory, not cached.

    `sources`: [(split, dataset, resolved field map)], as `inf_ir.open_split` gives them."""
    job = Job(list(sources), tokenizer_path, padding_side, encoding)
    return build(job, reading, {"in_memory": True}, None, workers=0, progress=False)
