"""infjax/evaluation/datasets.py: the loaders (hub layouts as local fixtures) and what they refuse or leave out."""
import json
import os
import re

import pytest

from infjax.data.tokenize import TextFormat
from infjax.evaluation import datasets as eval_data, tasks as eval_tasks
from infjax.evaluation.datasets import DataError
from tests.helpers.evaluation import (SPLIT, _blank_queries, _jsonl, _pools_without, _rewrite_parquet, fake_embed,
                                      write_beir, write_followir)


def test_followir_fixture_in_hub_layout_loads_as_the_split(tmp_path):
    task = eval_data.load(f"followir:{write_followir(str(tmp_path / 'robust04-instructions'))}")[0]
    assert task.main_metric == "map@1000"
    assert task.split.candidates == SPLIT.candidates and task.split.qrels_og == SPLIT.qrels_og
    assert task.split.qrels_changed == SPLIT.qrels_changed and task.split.corpus == SPLIT.corpus
    assert task.split.instructions_changed == SPLIT.instructions_changed
    news = eval_data.load(f"followir:{write_followir(str(tmp_path / 'news21-instructions'))}")[0]
    assert news.main_metric == "ndcg@5"


def test_mair_and_bright_fixtures_load_and_retrieve(tmp_path):
    # MAIR: MAIR-Queries/<task>/queries.jsonl beside MAIR-Docs/<task>/docs.jsonl, plus a second split.
    qdir, ddir = tmp_path / "MAIR-Queries" / "Toy", tmp_path / "MAIR-Docs" / "Toy"
    docs = list(SPLIT.corpus.items())
    _jsonl(str(ddir / "docs.jsonl"), [{"id": d, "doc": t} for d, t in docs])
    _jsonl(str(ddir / "extra_docs.jsonl"), [{"id": d, "doc": t} for d, t in docs[:5]])
    _jsonl(str(qdir / "queries.jsonl"),
           [{"qid": q, "instruction": SPLIT.instructions_og[q], "query": SPLIT.queries[q],
             "labels": [{"id": d, "score": g} for d, g in SPLIT.qrels_og[q].items() if g]} for q in SPLIT.queries])
    _jsonl(str(qdir / "extra_queries.jsonl"),
           [{"qid": "x", "instruction": "find it", "query": "anything", "labels": json.dumps([{"id": docs[0][0],
                                                                                              "score": 2}])}])
    tasks = eval_data.load(f"mair:{qdir}")
    assert [t.name for t in tasks] == ["Toy/extra_queries", "Toy"]
    assert tasks[0].qrels == {"x": {docs[0][0]: 2}} and tasks[1].instructions == SPLIT.instructions_og
    # BRIGHT: examples/<domain>-*.parquet and documents/<domain>-*.parquet; excluded ids never ranked.
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path / "BRIGHT"
    (root / "examples").mkdir(parents=True)
    (root / "documents").mkdir()
    pq.write_table(pa.Table.from_pylist([{"id": d, "content": t} for d, t in docs]),
                   str(root / "documents" / "pony-00000-of-00001.parquet"))
    q0, pool = "q0", SPLIT.candidates["q0"]
    gold = [d for d in pool if SPLIT.qrels_og[q0][d]]
    excluded = [d for d in pool if not SPLIT.qrels_og[q0][d]][:2]
    pq.write_table(pa.Table.from_pylist([{"id": "b0", "query": SPLIT.queries[q0], "reasoning": "", "gold_ids": gold,
                                          "gold_ids_long": [], "excluded_ids": excluded, "gold_answer": ""}]),
                   str(root / "examples" / "pony-00000-of-00001.parquet"))
    (task,) = eval_data.load(f"bright:{root}", instruction="Retrieve the manual page.")
    assert task.name == "pony" and task.qrels == {"b0": {d: 1 for d in gold}}
    fmt = TextFormat()
    result = eval_tasks.evaluate_task(task, eval_tasks.template_pairs(fake_embed, fmt), fake_embed, fmt, top_k=len(docs))
    assert not set(excluded) & set(result["runs"][""]["b0"])
    assert len(result["runs"][""]["b0"]) == len(docs) - len(excluded)
    assert 0.0 <= result["summary"]["ndcg@10"] <= 1.0


def test_missing_file_field_and_qrel_reference_are_named(tmp_path):
    beir = write_beir(str(tmp_path / "beir"))
    os.remove(os.path.join(beir, "qrels", "test.tsv"))
    with pytest.raises(DataError, match=r"qrels/test\.tsv: file not found"):
        eval_data.load(f"beir:{beir}")
    write_beir(beir)
    with open(os.path.join(beir, "corpus.jsonl"), "a") as f:
        f.write(json.dumps({"_id": "broken", "title": "t"}) + "\n")
    with pytest.raises(DataError, match=r"corpus\.jsonl:\d+: missing field 'text'"):
        eval_data.load(f"beir:{beir}")
    write_beir(beir)
    with open(os.path.join(beir, "qrels", "test.tsv"), "a") as f:
        f.write("q1\tno-such-doc\t1\n")
    with pytest.raises(DataError, match=r"test\.tsv:\d+: document id 'no-such-doc' \(query 'q1'\).* with "
                                         r"infjax\.evaluate --lenient_qrels \(training's eval\.sets takes "
                                         r"judged documents only\)"):
        eval_data.load(f"beir:{beir}")
    assert "no-such-doc" not in eval_data.load(f"beir:{beir}", lenient_qrels=True)[0].qrels["q1"]
    with open(os.path.join(beir, "qrels", "test.tsv"), "a") as f:
        f.write("q99\tq0-d0\t1\n")
    with pytest.raises(DataError, match=r"query id 'q99'"):
        eval_data.load(f"beir:{beir}", lenient_qrels=True)
    fir = write_followir(str(tmp_path / "fir"))
    os.remove(os.path.join(fir, "top_ranked.jsonl"))
    with pytest.raises(DataError, match=r"top_ranked\.jsonl: file not found"):
        eval_data.load(f"followir:{fir}")
    write_followir(fir)
    _jsonl(os.path.join(fir, "queries.jsonl"), [{"_id": q, "text": SPLIT.queries[q]} for q in SPLIT.queries])
    with pytest.raises(DataError, match=r"queries\.jsonl:1: missing field 'instruction_og'"):
        eval_data.load(f"followir:{fir}")
    for bad in ("nope:x", "beir:"):
        with pytest.raises(DataError, match="--dataset"):
            eval_data.load(bad)
    with pytest.raises(DataError, match="folder not found"):
        eval_data.load(f"mair:{tmp_path / 'missing'}")


def test_hub_datasets_offline_fail_naming_the_repository(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DataError, match="jhu-clsp/robust04-instructions.*local folder"):
        eval_data.load("followir:robust04")
    with pytest.raises(DataError, match="MAIR-Bench/MAIR-Queries"):
        eval_data.load("mair:CliniDS_2016")
    with pytest.raises(DataError, match="xlangai/BRIGHT"):
        eval_data.load("bright:biology")
    with pytest.raises(DataError, match="name the domain"):
        eval_data.load("bright:xlangai/BRIGHT")


def _append(path, text):
    with open(path, "a", encoding="utf-8") as f:
        f.write(text)


def _lines(path):
    return open(path, encoding="utf-8").read().splitlines()


@pytest.mark.parametrize("case", ["duplicate query", "duplicate document", "grade 0.5", "grade 1.9", "grade inf",
                                  "grade nan", "judged twice, other grade"])
def test_beir_files_that_contradict_themselves_are_refused_naming_file_line_and_id(tmp_path, case):
    folder = write_beir(str(tmp_path / "toy"))
    corpus, queries = os.path.join(folder, "corpus.jsonl"), os.path.join(folder, "queries.jsonl")
    qrels = os.path.join(folder, "qrels", "test.tsv")
    qid, did, grade = _lines(qrels)[1].split("\t")
    if case == "duplicate query":
        _append(queries, json.dumps({"_id": qid, "text": "another text"}) + "\n")
        where, expected = queries, f"query id {qid!r} appears again (first at line "
    elif case == "duplicate document":
        _append(corpus, json.dumps({"_id": did, "text": "another text"}) + "\n")
        where, expected = corpus, f"document id {did!r} appears again (first at line "
    elif case.startswith("grade"):
        _append(qrels, f"{qid}\t{did}\t{case.split()[1]}\n")
        where, expected = qrels, f"field 'score' must be an integer relevance grade, got '{case.split()[1]}'"
    else:
        _append(qrels, f"{qid}\t{did}\t{int(grade) + 1}\n")
        where, expected = qrels, f"query {qid!r} judges document {did!r} again with grade {int(grade) + 1}"
    line = len(_lines(where))
    with pytest.raises(DataError, match=re.escape(f"{where}:{line}: {expected}")):
        eval_data.load(f"beir:{folder}")


def test_a_judgment_repeated_with_the_same_grade_counts_once(tmp_path, caplog):
    folder = write_beir(str(tmp_path / "toy"))
    qrels = os.path.join(folder, "qrels", "test.tsv")
    before = eval_data.load(f"beir:{folder}")[0].qrels
    first = _lines(qrels)[1]
    _append(qrels, f"{first}\n{first}.0\n")                      # the same grade, written 2 and 2.0
    assert eval_data.load(f"beir:{folder}")[0].qrels == before
    assert "2 judgments repeat an earlier one with the same grade" in caplog.text


def _write_mair(folder):
    """A MAIR task folder (queries.jsonl + docs.jsonl) from the synthetic split."""
    _jsonl(os.path.join(folder, "docs.jsonl"), [{"id": d, "doc": t} for d, t in SPLIT.corpus.items()])
    _jsonl(os.path.join(folder, "queries.jsonl"),
           [{"qid": q, "instruction": SPLIT.instructions_og[q], "query": SPLIT.queries[q],
             "labels": [{"id": d, "score": g} for d, g in SPLIT.qrels_og[q].items() if g]} for q in SPLIT.queries])
    return folder


def _write_bright(root, doc_shards=1):
    """A BRIGHT copy (examples/pony-*.parquet, documents/pony-*.parquet in `doc_shards` shards)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(os.path.join(root, "examples"), exist_ok=True)
    os.makedirs(os.path.join(root, "documents"), exist_ok=True)
    docs = list(SPLIT.corpus.items())
    for i in range(doc_shards):
        pq.write_table(pa.Table.from_pylist([{"id": d, "content": t} for d, t in docs[i::doc_shards]]),
                       os.path.join(root, "documents", f"pony-{i:05d}-of-{doc_shards:05d}.parquet"))
    rows = [{"id": q, "query": SPLIT.queries[q], "gold_ids": [d for d, g in SPLIT.qrels_og[q].items() if g],
             "gold_ids_long": [], "excluded_ids": []} for q in SPLIT.queries]
    pq.write_table(pa.Table.from_pylist(rows), os.path.join(root, "examples", "pony-00000-of-00001.parquet"))
    return root


@pytest.mark.parametrize("case", ["mair query", "bright query", "bright document"])
def test_every_loader_refuses_an_id_given_twice_naming_file_row_and_id(tmp_path, case):
    """An id given twice is refused naming the file, the row and the id, in every loader.

    That is a MAIR or BRIGHT query and a BRIGHT document, here in another shard: neither text is kept, no
    judgments are merged."""
    import pyarrow.parquet as pq

    if case == "mair query":
        folder = _write_mair(str(tmp_path / "Toy"))
        path = os.path.join(folder, "queries.jsonl")
        _append(path, json.dumps({"qid": "q0", "instruction": "other", "query": "another text",
                                  "labels": [{"id": "q1-d0", "score": 1}]}) + "\n")
        spec, expected = f"mair:{folder}", f"{path}:{len(_lines(path))}: query id 'q0' appears again (first at line 1)"
    elif case == "bright query":
        root = _write_bright(str(tmp_path / "BRIGHT"))
        path = os.path.join(root, "examples", "pony-00000-of-00001.parquet")
        _rewrite_parquet(path, lambda rows: rows + [{**rows[0], "query": "another text", "gold_ids": ["q1-d0"]}])
        spec = f"bright:{root}"
        expected = f"{path}:{len(SPLIT.queries) + 1}: query id 'q0' appears again (first at line 1)"
    else:
        root = _write_bright(str(tmp_path / "BRIGHT"), doc_shards=2)
        first, second = (os.path.join(root, "documents", f"pony-0000{i}-of-00002.parquet") for i in (0, 1))
        did = pq.read_table(first).to_pylist()[1]["id"]
        _rewrite_parquet(second, lambda rows: rows + [{"id": did, "content": "another text"}])
        spec = f"bright:{root}"
        expected = (f"{second}:{pq.read_metadata(second).num_rows}: document id {did!r} appears again (first at "
                    f"{first}:2)")
    with pytest.raises(DataError, match=re.escape(expected)):
        eval_data.load(spec)


def test_followir_pools_holding_none_of_a_querys_relevant_documents_are_refused(tmp_path):
    """Pools that hold none of a query's relevant documents (pools of another split or id scheme) are refused,
    naming the file, the query and the counts, instead of scoring a meaningless p-MRR."""
    folder = write_followir(str(tmp_path / "core17-instructions"))
    relevant = {d for qrels in (SPLIT.qrels_og, SPLIT.qrels_changed) for d, g in qrels["q1"].items() if g > 0}
    _pools_without(folder, {("q1", d) for d in relevant})
    with pytest.raises(DataError, match=re.escape(f"{folder}/top_ranked.jsonl: the pool of query 'q1' "
                                                  f"({len(SPLIT.candidates['q1']) - len(relevant)} documents) holds "
                                                  f"none of its {len(relevant)} relevant documents in ")):
        eval_data.load(f"followir:{folder}")


BLANK = ["", "   ", "\t\n", "\u200b", "\u200b \u00ad\ufeff", "\x00"]      # no character a reader sees


def test_with_text_leaves_out_queries_with_nothing_visible_and_refuses_a_set_of_them():
    queries = {f"q{i}": text for i, text in enumerate(BLANK)} | {"ok": "a query", "ok2": "\u200bzero-width inside"}
    qrels = {q: {"d": 1} for q in queries}
    kept, blank = eval_data.with_text(queries, qrels, "queries.jsonl", "toy")
    assert sorted(kept) == ["ok", "ok2"] and blank == tuple(sorted(f"q{i}" for i in range(len(BLANK))))
    with pytest.raises(DataError, match=r"^queries.jsonl: none of the 6 judged queries of toy has visible text"):
        eval_data.with_text({q: t for q, t in queries.items() if q.startswith("q")},
                            {q: {"d": 1} for q in queries if q.startswith("q")}, "queries.jsonl", "toy")


@pytest.mark.parametrize("kind", ["beir", "mair", "bright", "followir"])
def test_every_loader_leaves_out_and_counts_queries_without_visible_text(tmp_path, kind, caplog):
    """Every loader leaves out the queries without visible text and counts them.

    Empty, spaces or a zero-width space: such a query is left out of the task (as a query without a relevant
    document) and counted in a warning and in `without_text`, never ranked and averaged in."""
    q0, q1, q2 = sorted(SPLIT.queries)
    blank = {q0: "", q1: "\u200b "}
    if kind == "beir":
        folder = write_beir(str(tmp_path / "toy"))
        _blank_queries(os.path.join(folder, "queries.jsonl"), "text", blank)
    elif kind == "mair":
        folder = _write_mair(str(tmp_path / "toy"))
        _blank_queries(os.path.join(folder, "queries.jsonl"), "query", blank)
    elif kind == "bright":
        folder = _write_bright(str(tmp_path / "BRIGHT"))
        _blank_queries(os.path.join(folder, "examples", "pony-00000-of-00001.parquet"), "query", blank)
    else:
        folder = write_followir(str(tmp_path / "toy"))
        _blank_queries(os.path.join(folder, "queries.jsonl"), "text", blank)
    with caplog.at_level("WARNING", logger="infjax.eval_data"):
        (task,) = eval_data.load(f"{kind}:{folder}")
    assert task.without_text == (q0, q1)
    judged = task.split.qrels_og if kind == "followir" else task.qrels
    queries = task.split.queries if kind == "followir" else task.queries
    assert sorted(judged) == sorted(queries) == [q2]
    assert "2 of 3 judged queries have no visible text (empty, spaces or invisible characters only) and are left " \
           f"out of the means (first: {q0}, {q1})" in caplog.text
    result = eval_tasks.evaluate_task(task, eval_tasks.template_pairs(fake_embed, TextFormat()), fake_embed,
                                      TextFormat())
    assert sorted(result["per_query"]) == [q2] and result["without_text"] == [q0, q1]
