"""Read: the InF-IR training corpus as memory-mapped Arrow files, its rows cleaned and checked as they are read.

InF-IR (hub id ``InF-IR/InF-IR``; splits ``msmarco``, ``robust04``,
``leetcode``, ``metamath``) has one string field per role::

    instruction_positive      I+
    query_positive            Q+
    document_positive         P+   (older copies call it ``document``)
    instruction_negative      I-
    query_negative            Q-
    hard_negative_document_1  P1-
    hard_negative_document_2  P2-

A *field map* maps each canonical name above to the column that holds it in a
given source. Partial maps are completed from the default (identity) map, so
``{"query_positive": "q"}`` only renames one column.

`open_split` opens a split (a local file, a folder, or a hub id) without
reading its rows: local files become Arrow files once, memory-mapped.
`SplitOpener` opens the splits of a run again in any process (it pickles as
names, not rows); `SourceRecords` reads the clean records back by row. The
rows are read, cleaned and checked once, by the token store's pass
(data/token_store.py), which training reads through.

Cleaning follows the InF-Embed paper (appendix B.1, `clean_record`): every
instruction and query is cut at its first line break and stripped; passages
are only stripped. A row with a missing field, a non-string value, or a value
that is empty after cleaning (nothing visible: only whitespace, NUL and other
control characters, zero-width spaces or byte-order marks), or a negative that
says what its positive says (I- = I+, Q- = Q+, P1- or P2- = P+, as
`normal_text` compares them) is a *bad row*; so is a negative with its
positive's token ids (checked where the texts are tokenized,
data/token_store.py). A bad row stops the run with a :class:`BadRowError`
naming the split, the row index and the field; with ``on_bad_row="skip"`` bad
rows are dropped, counted and reported in one warning per split
(`skipped_warning`), and a split with no row left is refused
(`no_usable_rows`). Bad rows are never dropped silently.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import glob
import json
import logging
import os
import re
import sys
import tempfile
import time
import unicodedata
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from infjax.data import text_files, trust
from infjax.errors import UserError, full_disk

logger = logging.getLogger(__name__)

__all__ = [
    "FIELDS",
    "TEXT_FIELDS",
    "PASSAGE_FIELDS",
    "DEFAULT_FIELD_MAP",
    "LEGACY_FIELD_MAP",
    "ON_BAD_ROW_CHOICES",
    "BadRowError",
    "MissingColumnError",
    "resolve_field_map",
    "clean_text",
    "clean_passage",
    "clean_record",
    "open_split",
    "SplitOpener",
    "SourceRecords",
]

#: Canonical field names, in the order of the corpus card.
FIELDS: tuple[str, ...] = (
    "instruction_positive",
    "query_positive",
    "document_positive",
    "instruction_negative",
    "query_negative",
    "hard_negative_document_1",
    "hard_negative_document_2",
)

#: Instructions and queries: cut at the first line break, then stripped.
TEXT_FIELDS: frozenset[str] = frozenset(
    {"instruction_positive", "query_positive", "instruction_negative", "query_negative"}
)

#: Passages: only stripped.
PASSAGE_FIELDS: frozenset[str] = frozenset(FIELDS) - TEXT_FIELDS

#: Identity map: every canonical field is read from the column of the same name.
DEFAULT_FIELD_MAP: dict[str, str] = {name: name for name in FIELDS}

#: Map for older copies of the corpus, where P+ is stored as ``document``.
LEGACY_FIELD_MAP: dict[str, str] = {**DEFAULT_FIELD_MAP, "document_positive": "document"}

#: The field maps `config.data.field_map` names (auto: the default or the legacy map, from a source's columns).
FIELD_MAPS: dict[str, dict[str, str] | None] = {"auto": None, "default": DEFAULT_FIELD_MAP, "legacy": LEGACY_FIELD_MAP}

#: Allowed values of ``on_bad_row``.
ON_BAD_ROW_CHOICES: tuple[str, ...] = ("error", "skip")

#: Each negative field and the positive it must differ from: a record whose negative equals its positive
#: turns its rows into one query text with two positives, each the other's in-batch negative.
NEGATIVE_OF: dict[str, str] = {
    "instruction_negative": "instruction_positive",
    "query_negative": "query_positive",
    "hard_negative_document_1": "document_positive",
    "hard_negative_document_2": "document_positive",
}

#: Extensions of local files this module can read, and the datasets builder for each.
_BUILDER_BY_EXTENSION: dict[str, str] = {".parquet": "parquet", ".jsonl": "json", ".json": "json"}

#: How many offending (row, field) pairs a skip warning lists.
_MAX_REPORTED_BAD_ROWS = 5

_LINE_BREAK = re.compile(r"\r\n|\r|\n")


# ---------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------


class BadRowError(UserError, ValueError):
    """A row of the corpus with a missing, non-string or empty field.

    Attributes:
        split: name of the split the row belongs to.
        row: 0-based index of the row in the (possibly ``limit``-ed) source.
        field: canonical field name.
        column: source column the field was read from.
        reason: short human-readable cause.
    """

    def __init__(self, split: str, row: int, field: str, reason: str, column: str | None = None):
        self.split = split
        self.row = row
        self.field = field
        self.column = field if column is None else column
        self.reason = reason
        super().__init__(
            f"InF-IR split {split!r} row {row}, field {field!r} "
            f"(source column {self.column!r}): {reason}"
        )

    def __reduce__(self):  # keep the exception picklable (multiprocessing, pytest-xdist)
        return (type(self), (self.split, self.row, self.field, self.reason, self.column))


class DataFileError(UserError, ValueError):
    """A local data file that cannot be read as InF-IR rows; the message names the file and the line or byte."""


class MissingColumnError(UserError, ValueError):
    """A source lacks a column the field map asks for (checked before reading rows).

    Attributes:
        split: name of the split being loaded.
        field: canonical field name.
        column: the source column that is missing.
        available: the columns the source does have.
    """

    def __init__(self, split: str, field: str, column: str, available: Sequence[str]):
        self.split = split
        self.field = field
        self.column = column
        self.available = list(available)
        super().__init__(
            f"InF-IR split {split!r}, field {field!r}: source column {column!r} not found; "
            f"columns present: {self.available}. Rename that column to {field!r} in the data, or choose "
            "config.data.field_map=auto|default|legacy (legacy: P+ in a column named 'document')."
        )

    def __reduce__(self):
        return (type(self), (self.split, self.field, self.column, self.available))


# ---------------------------------------------------------------------------
# Field maps
# ---------------------------------------------------------------------------


def _check_field_map(field_map: Mapping[str, Any]) -> None:
    """Raise ValueError for unknown canonical keys or non-string column names."""
    unknown = sorted(str(key) for key in field_map if key not in DEFAULT_FIELD_MAP)
    if unknown:
        raise ValueError(
            f"field_map has unknown canonical field(s) {unknown}; "
            f"the canonical fields are {list(FIELDS)}"
        )
    not_str = sorted(key for key, column in field_map.items() if not isinstance(column, str) or not column)
    if not_str:
        raise ValueError(f"field_map must map each field to a non-empty column name; bad entries for {not_str}")


def _auto_field_map(columns: Iterable[str]) -> dict[str, str]:
    """The built-in map that fits ``columns``: LEGACY if only ``document`` holds P+."""
    columns = set(columns)
    if "document_positive" not in columns and "document" in columns:
        return dict(LEGACY_FIELD_MAP)
    return dict(DEFAULT_FIELD_MAP)


def resolve_field_map(field_map: Mapping[str, str] | None, columns: Sequence[str]) -> dict[str, str]:
    """Return a complete canonical-name -> source-column map for a source.

    Args:
        field_map: ``None`` to pick :data:`DEFAULT_FIELD_MAP` or
            :data:`LEGACY_FIELD_MAP` from ``columns`` (legacy when the source
            has ``document`` but no ``document_positive``), or a full or
            partial user map. A partial map is merged over that same
            automatic choice, which is the identity map unless the source only
            has the legacy ``document`` column.
        columns: the column names of the source.

    Raises:
        ValueError: if ``field_map`` has keys that are not canonical field
            names (they are named in the message) or non-string column names.
    """
    if field_map is None:
        return _auto_field_map(columns)
    _check_field_map(field_map)
    if len(field_map) == len(FIELDS):  # already complete: nothing to merge
        return dict(field_map)
    return {**_auto_field_map(columns), **field_map}


# ---------------------------------------------------------------------------
# Cleaning
# ---------------------------------------------------------------------------


def clean_text(value: str) -> str:
    """Clean an instruction or query: keep only its first line, stripped.

    Surrounding whitespace is stripped first, so a value that merely starts
    with a blank line keeps its first non-blank line.
    """
    return _LINE_BREAK.split(value.strip(), maxsplit=1)[0].strip()


def clean_passage(value: str) -> str:
    """Clean a passage: strip surrounding whitespace only."""
    return value.strip()


def visible(text: str) -> bool:
    """Whether `text` has a character a reader sees.

    Not only whitespace, control characters (NUL) and format characters (zero-width spaces and joiners,
    byte-order marks, soft hyphens)."""
    return any(unicodedata.category(c)[0] not in "CZ" for c in text)


@functools.cache
def _invisible_table() -> dict[int, None]:
    """A `str.translate` table deleting the control and format characters that are not whitespace.

    NUL, zero-width spaces and joiners, byte-order marks, soft hyphens, ...: built once, on first use."""
    return {c: None for c in range(sys.maxunicode + 1)
            if unicodedata.category(chr(c)) in ("Cc", "Cf") and not chr(c).isspace()}


def without_invisible(text: str) -> str:
    """`text` without its invisible characters (see `_invisible_table`); whitespace is kept."""
    if text.isascii() and text.isprintable():       # the common case, at C speed
        return text
    return text.translate(_invisible_table())


def normal_text(text: str) -> str:
    """`text` as compared for sameness: lower case, one space for each run of whitespace, no final periods.

    Invisible characters are dropped too. Two texts that differ only there say the same thing (a negative that says
    what its positive says is no negative); a reader, and most tokenizers, cannot tell them apart."""
    return " ".join(without_invisible(text).lower().split()).rstrip(". ")


def _invisible_difference(a: str, b: str) -> str:
    """What a bad row's message adds where two texts that `normal_text` finds the same hold invisible characters.

    That they differ only in those (a reader sees no difference at all, or only one of case, spacing or final
    periods), or that they are the very same text, those characters included (named, as U+XXXX)."""
    seen_a, seen_b = without_invisible(a), without_invisible(b)
    if (seen_a, seen_b) == (a, b):
        return ""
    if a == b:
        hidden = sorted(set(a) - set(seen_a))
        return (f"; the two are identical, character for character, their invisible "
                f"character{'s' if len(hidden) > 1 else ''} {', '.join(f'U+{ord(c):04X}' for c in hidden)} too")
    if seen_a == seen_b:
        return "; they differ only in invisible characters"
    if _loose(a) == _loose(b):             # the same invisible characters: only case, spacing or periods differ
        return "; they differ only in case, spacing or final periods"
    return "; apart from case, spacing and final periods, they differ only in invisible characters"


def _loose(text: str) -> str:
    """`normal_text` keeping the invisible characters."""
    return " ".join(text.lower().split()).rstrip(". ")


def _clean_field(field: str, value: str) -> str:
    """Apply the cleaning rule of ``field`` to ``value``."""
    return clean_text(value) if field in TEXT_FIELDS else clean_passage(value)


def _describe_bad_value(value: Any) -> str:
    """Reason string for a non-string value."""
    if value is None:
        return "value is None (null)"
    shown = repr(value)
    if len(shown) > 40:
        shown = shown[:37] + "..."
    return f"expected a string, got {type(value).__name__} {shown}"


def clean_record(
    raw: Mapping[str, Any],
    *,
    field_map: Mapping[str, str] | None,
    split: str,
    row: int,
) -> dict[str, str]:
    """Clean one raw row into a record keyed by the canonical field names: the rules of a bad row, but one.

    The one left is a negative with its positive's token ids, which needs the tokenizer: it is checked
    where the texts are tokenized (`token_store`).

    Args:
        raw: the source row (column name -> value).
        field_map: full or partial canonical -> column map; ``None`` picks the
            default or legacy map from the row's own keys.
        split: split name, for error messages.
        row: row index, for error messages.

    Returns:
        A dict with exactly the keys of :data:`FIELDS`, in that order.

    Raises:
        BadRowError: on the first field (in :data:`FIELDS` order) that is
            missing, not a string, or empty after cleaning.
    """
    resolved = resolve_field_map(field_map, list(raw.keys()))
    record: dict[str, str] = {}
    for field in FIELDS:
        column = resolved[field]
        if column not in raw:
            raise BadRowError(split, row, field, "missing from the row", column)
        value = raw[column]
        if not isinstance(value, str):
            raise BadRowError(split, row, field, _describe_bad_value(value), column)
        cleaned = _clean_field(field, value)
        if not cleaned:
            raise BadRowError(split, row, field, "empty after cleaning", column)
        if not visible(cleaned):
            raise BadRowError(split, row, field, "empty after cleaning (only invisible characters: zero-width "
                              "spaces, byte-order marks, control characters)", column)
        record[field] = cleaned
    for negative, positive in NEGATIVE_OF.items():
        if normal_text(record[negative]) == normal_text(record[positive]):
            hidden = _invisible_difference(record[negative], record[positive])
            raise BadRowError(split, row, negative, f"the same text as {positive} (a negative must differ from "
                              f"its positive{hidden})", resolved[negative])
    return record


def skipped_warning(split: str, bad: list[BadRowError]) -> str:
    """One line summarising the skipped rows of ``split``: their count and the first few."""
    shown = ", ".join(f"(row {e.row}, {e.field!r}: {e.reason})" for e in bad[:_MAX_REPORTED_BAD_ROWS])
    more = f" and {len(bad) - _MAX_REPORTED_BAD_ROWS} more" if len(bad) > _MAX_REPORTED_BAD_ROWS else ""
    return f"InF-IR split {split!r}: skipped {len(bad)} bad row(s): {shown}{more}"


def no_usable_rows(split: str, bad: list[BadRowError]) -> DataFileError:
    """The error of a split whose every row was skipped as bad, with the count of each reason."""
    reasons = collections.Counter(f"{e.field!r}: {e.reason}" for e in bad)
    return DataFileError(f"InF-IR split {split!r}: no usable rows: all {len(bad)} were skipped as bad "
                         f"(on_bad_row=skip); per reason: {dict(reasons.most_common())}")


# ---------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------


def _builder_for(path: str) -> str:
    """The datasets builder name (``parquet`` / ``json``) for a local file."""
    ext = os.path.splitext(path)[1].lower()
    try:
        return _BUILDER_BY_EXTENSION[ext]
    except KeyError:
        compressed = " (decompress it first)" if ext in (".gz", ".bz2", ".xz", ".zst", ".zip") else ""
        raise DataFileError(
            f"{path}: unsupported file type {ext or '(none)'!r}{compressed}; InF-IR data is read from "
            f"{', '.join(sorted(_BUILDER_BY_EXTENSION))} files"
        ) from None


def _files_in_folder(folder: str, split: str) -> list[str]:
    """Data files for ``split`` in a local folder.

    Either the hub layout ``<folder>/data/<split>-*.parquet`` or the readable files directly in ``folder``
    whose name starts with ``split``, all of one format. A folder that holds both sets, or files of several
    formats for the split, is refused (which one was meant is the user's to say). The log names every file
    read and every file of the folder left unread.
    """
    hub_layout = sorted(glob.glob(os.path.join(glob.escape(folder), "data", f"{glob.escape(split)}-*.parquet")))
    entries = sorted(os.listdir(folder))
    beside = [os.path.join(folder, name) for name in entries
              if name.startswith(split) and os.path.isfile(os.path.join(folder, name))
              and os.path.splitext(name)[1].lower() in _BUILDER_BY_EXTENSION]
    if hub_layout and beside:
        raise DataFileError(
            f"{folder}: holds InF-IR split {split!r} twice: in the hub layout ({len(hub_layout)} file(s) "
            f"data/{split}-*.parquet) and as {[os.path.basename(p) for p in beside]} beside it; move one set "
            f"away, or give the file to read as config.data.source")
    matches = hub_layout or beside
    if not matches:
        data_dir = os.path.join(folder, "data")
        found = entries + ([f"data/{n}" for n in sorted(os.listdir(data_dir))] if os.path.isdir(data_dir) else [])
        raise FileNotFoundError(
            f"no data files for InF-IR split {split!r} in folder {folder!r}: looked for "
            f"data/{split}-*.parquet and for {sorted(_BUILDER_BY_EXTENSION)} files whose name starts "
            f"with {split!r}; found {found}"
        )
    formats = sorted({_builder_for(p) for p in matches})
    if len(formats) > 1:
        raise DataFileError(
            f"{folder}: the files of InF-IR split {split!r} disagree in format ({formats}: "
            f"{[os.path.basename(p) for p in matches]}); keep one format, or give the file to read as "
            f"config.data.source")
    read = {os.path.abspath(p) for p in matches}
    unread = [os.path.relpath(p, folder) for p in sorted(glob.glob(os.path.join(glob.escape(folder), "*"))
                                                         + glob.glob(os.path.join(glob.escape(folder), "data", "*")))
              if os.path.isfile(p) and os.path.abspath(p) not in read]
    logger.info("InF-IR split %r from %s: reading %s%s", split, folder, [os.path.relpath(p, folder) for p in matches],
                f"; not read: {unread}" if unread else "")
    return matches


def _looks_like_path(source: str) -> bool:
    """Whether a non-existent ``source`` was meant as a local path, not a hub id."""
    if source.startswith((".", "/", "~", "\\")) or os.path.isabs(source):
        return True
    if os.path.splitext(source)[1].lower() in _BUILDER_BY_EXTENSION:
        return True
    return source.count("/") > 1  # hub ids are "name" or "owner/name"


def _load_local(files: list[str], split: str, arrow_dir: str | None = None):
    """Load local data files into a ``datasets.Dataset``: in memory, or as Arrow files memory-mapped.

    With `arrow_dir` the Arrow files are written once into it and memory-mapped (every process of a host then
    shares one copy through the page cache); None keeps the rows in memory. `arrow_dir` must be named by the
    files' content (`token_store.identify`): a throw-away cache directory, or one per content, guarantees that
    a file rewritten in place is read again rather than served from a stale cache.
    """
    import datasets

    builders = {_builder_for(path) for path in files}
    if len(builders) > 1:
        raise DataFileError(f"InF-IR split {split!r}: cannot mix file formats in one split: {files}")
    for path in files:
        if os.path.getsize(path) == 0:
            raise DataFileError(f"{path}: empty file (no rows)")
    builder = builders.pop()
    if builder == "parquet" and all(_parquet_rows(path) == 0 for path in files):
        raise DataFileError(f"{', '.join(files)}: a valid parquet file with no rows (a curation that kept 0 "
                            f"records writes one): nothing to train on")
    with contextlib.ExitStack() as stack:
        stack.enter_context(_quiet_datasets())
        cache_dir = arrow_dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="infjax-inf-ir-"))
        try:
            dataset = datasets.load_dataset(builder, data_files=files, split="train", cache_dir=cache_dir,
                                            keep_in_memory=arrow_dir is None)
        except Exception as error:   # noqa: BLE001 - `datasets` wraps parse errors; find the file and line
            full = full_disk(error)
            if full is not None:     # the Arrow files' disk, not the data, is the problem (token_store says so)
                raise full from None
            for path in files:
                problem = _first_problem(path)
                if problem:
                    raise DataFileError(f"{path}: {problem}") from None
            cause = error
            while cause.__cause__ is not None:
                cause = cause.__cause__
            raise DataFileError(f"{', '.join(files)}: cannot be read as {builder} "
                                f"({type(cause).__name__}: {str(cause)[:300]})") from error
    if arrow_dir is not None:       # the conversion's buffers: pyarrow's allocator keeps them for reuse otherwise
        import pyarrow

        trust.private(arrow_dir)    # written by this user alone: a later run may trust it (data/trust.py)

        pyarrow.default_memory_pool().release_unused()
    if len(dataset) == 0:
        raise DataFileError(f"{', '.join(files)}: no rows")
    if builder == "json":           # pyarrow's reader keeps bytes that are not UTF-8 until a row is read
        for path in files:
            _check_utf8(path)
    return dataset


def _check_utf8(path: str) -> None:
    """DataFileError naming the line and byte where `path` stops being UTF-8 (read in chunks, no copy)."""
    problem = text_files.not_utf8(path)
    if problem:
        raise DataFileError(f"{path}: {problem}")


def _parquet_rows(path: str) -> int | None:
    """The row count of a parquet file's footer, or None when it cannot be read (the loader says why)."""
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path).metadata.num_rows
    except Exception:   # noqa: BLE001
        return None


@contextlib.contextmanager
def _quiet_datasets():
    """No progress bar or error log lines from `datasets` while it reads a local file.

    A failure is reported once, by the caller, naming the file and line."""
    import datasets
    from datasets.utils import logging as ds_logging

    level, bars_off = ds_logging.get_verbosity(), datasets.are_progress_bars_disabled()
    ds_logging.set_verbosity(ds_logging.CRITICAL)
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        ds_logging.set_verbosity(level)
        if not bars_off:
            datasets.enable_progress_bars()


def _first_problem(path: str) -> str | None:
    """Where a .json / .jsonl file stops being UTF-8 JSON objects ("line N ..."), or None."""
    ext = os.path.splitext(path)[1].lower()
    if ext not in (".json", ".jsonl"):
        return None
    problem = text_files.not_utf8(path)
    if problem:
        return problem
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if ext == ".json":
        try:
            json.loads(text)
        except ValueError as e:
            return f"line {e.lineno}: not valid JSON ({e.msg}, column {e.colno})"
        return None
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            return f"line {n}: not valid JSON ({e.msg}, column {e.colno})"
        if not isinstance(row, dict):
            return f"line {n}: a JSON {type(row).__name__}, not an object with the InF-IR fields"
    return None


def _load_hub(source: str, split: str):
    """Load ``split`` of a hub dataset; any failure becomes FileNotFoundError."""
    import datasets

    try:
        return datasets.load_dataset(source, split=split)
    except Exception as error:  # offline, unknown id, unknown split, auth, ...
        raise FileNotFoundError(
            f"could not load InF-IR split {split!r} from {source!r}: it is not an existing local "
            f"path, and loading it as a hub dataset failed ({type(error).__name__}: {error}). "
            f"To use a local copy, pass a .parquet/.jsonl/.json file, or a folder holding "
            f"data/{split}-*.parquet or files named {split}*.parquet/.jsonl/.json."
        ) from error


def local_files(source: str, split: str) -> list[str] | None:
    """The local files that hold ``split`` of ``source`` (a file, or a folder's files for the split).

    None for a hub id; FileNotFoundError for a path that does not exist."""
    path = os.path.expanduser(source)
    if os.path.isfile(path):
        return [path]
    if os.path.isdir(path):
        return _files_in_folder(path, split)
    if _looks_like_path(source):
        raise FileNotFoundError(f"InF-IR source {source!r} for split {split!r}: no such file or folder")
    return None


def _open_source(source: str, split: str, arrow_dir: str | None = None):
    """Dispatch ``source`` to a local file, a local folder or the hub (see `_load_local` for `arrow_dir`)."""
    files = local_files(source, split)
    if files is not None:
        return _load_local(files, split, arrow_dir)
    return _load_hub(source, split)


def open_split(source: str, split: str, *, field_map: Mapping[str, str] | None = None, limit: int | None = None,
               arrow_dir: str | None = None):
    """One split as rows not read yet: (``datasets.Dataset``, the resolved field map).

    `source`: a local ``.parquet`` / ``.jsonl`` / ``.json`` file (`split` is then only a label for
    messages); a local folder (``<folder>/data/<split>-*.parquet``, the hub layout, else the files of the
    folder whose name starts with `split`); otherwise a hub dataset id such as ``"InF-IR/InF-IR"``. Local
    files become Arrow files in `arrow_dir` (see `_load_local`), memory-mapped; a missing column is refused
    before any row is read; `limit` keeps the first rows. Rows are cleaned when they are read (`clean_record`).
    """
    if field_map is not None:
        _check_field_map(field_map)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise ValueError(f"limit must be a non-negative int or None, got {limit!r}")
    started = time.perf_counter()
    logger.info("reading the training data %s (split %s)", source, split)
    dataset = _open_source(os.fspath(source), split, arrow_dir)
    columns = list(dataset.column_names)
    resolved = resolve_field_map(field_map, columns)
    _check_columns(resolved, columns, split)
    if limit is not None and limit < len(dataset):
        dataset = dataset.select(range(limit))
    logger.info("%d rows of %s (split %s) opened in %.1f s", len(dataset), source, split,
                time.perf_counter() - started)
    return dataset, resolved


def first_empty_row(dataset, resolved: Mapping[str, str], split: str, batch_rows: int = 200_000
                    ) -> BadRowError | None:
    """The bad-row error of the first row with a null or blank field, read from the Arrow table in seconds.

    The rows a tokenizing pass would stop at late (row 90,000 of 100,000 after minutes), found before it starts;
    the message is `clean_record`'s for that row, the one rule. Other bad rows (invisible characters, a
    negative equal to its positive) are still found by the pass. None when no row has one, or for rows that
    are not a ``datasets.Dataset``."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if not hasattr(dataset, "with_format"):
        return None
    columns = list(dict.fromkeys(resolved[f] for f in FIELDS))
    start = 0
    for table in dataset.select_columns(columns).with_format("arrow").iter(batch_size=batch_rows):
        blank = None
        for column in columns:
            values = table.column(column)
            if pa.types.is_string(values.type) or pa.types.is_large_string(values.type):
                bad = pc.or_kleene(pc.is_null(values), pc.equal(pc.utf8_trim_whitespace(values), ""))
            else:
                bad = pc.is_null(values)
            bad = pc.fill_null(bad, True)
            blank = bad if blank is None else pc.or_(blank, bad)
        if blank is not None and pc.any(blank).as_py():
            row = start + pc.index(blank, True).as_py()
            try:
                clean_record(dataset[row], field_map=resolved, split=split, row=row)
            except BadRowError as e:
                return e
        start += table.num_rows
    return None


def _check_columns(field_map: Mapping[str, str], columns: Sequence[str], split: str) -> None:
    """Raise MissingColumnError for the first mapped column the source lacks."""
    present = set(columns)
    for field in FIELDS:
        if field_map[field] not in present:
            raise MissingColumnError(split, field, field_map[field], columns)


def hub_fingerprint(source: str, split: str) -> str:
    """The fingerprint `datasets` gives a hub split: its own cache's identity of the content.

    The one use of datasets' private API (`Dataset._fingerprint`), for the token cache's key."""
    dataset, _ = open_split(source, split)
    return dataset._fingerprint  # noqa: SLF001


@dataclasses.dataclass(frozen=True)
class SplitOpener:
    """Opens the splits of a run as memory-mapped datasets: [(split, dataset, resolved field map)].

    Picklable by its names: a process that needs the texts (a worker, `SourceRecords`) opens them again
    from the Arrow files instead of receiving rows."""

    source: str
    splits: tuple[str, ...]
    field_map: str                          # a name of FIELD_MAPS (config.data.field_map)
    limit: int                              # the first rows of each split (0: all)
    arrow_dirs: tuple[str | None, ...]      # per split: where its local files become Arrow files (None: hub)

    def __call__(self) -> list:
        out = []
        for split, arrow_dir in zip(self.splits, self.arrow_dirs):
            dataset, resolved = open_split(self.source, split, field_map=FIELD_MAPS[self.field_map],
                                           limit=self.limit or None, arrow_dir=arrow_dir)
            out.append((split, dataset, resolved))
        return out


@dataclasses.dataclass(frozen=True)
class InMemorySplit:
    """In-memory records (the synthetic corpus, benchmarks, tests) as the one split `SourceRecords` reads."""

    records: list[dict]

    def __call__(self) -> list:
        return [("records", self.records, dict(DEFAULT_FIELD_MAP))]


class SourceRecords(Sequence):
    """Clean records read when asked for: record i is source row `rows[i]` of the splits one after another.

    `open_splits()` gives [(split, dataset, resolved field map)]; it is called once, on the first read."""

    def __init__(self, open_splits: Callable[[], list], rows: Sequence[int]):
        self._open, self._splits, self.rows = open_splits, None, rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if self._splits is None:
            self._splits = self._open()
            self._first = [0]
            for _, dataset, _ in self._splits:
                self._first.append(self._first[-1] + len(dataset))
        row = int(self.rows[i])
        k = int(np.searchsorted(self._first, row, side="right")) - 1
        split, dataset, resolved = self._splits[k]
        return clean_record(dataset[row - self._first[k]], field_map=resolved, split=split, row=row - self._first[k])

    def __getstate__(self):
        return {"_open": self._open, "_splits": None, "rows": self.rows}
