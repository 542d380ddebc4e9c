"""MTEB 2.x against infjax: the adapter's encoder protocol, and FollowIR-style tasks built from local data scored
by MTEB with (a) infjax's adapter on a run directory and (b) the exported sentence-transformers folder loaded by
MTEB's own wrapper, both equal to `python -m infjax.evaluate`."""
import json
import os

import numpy as np
import pytest

mteb = pytest.importorskip("mteb")

from infjax.data import synthetic  # noqa: E402
from infjax.data.tokenize import TextFormat  # noqa: E402
from infjax.evaluation import datasets as eval_data  # noqa: E402
from infjax.evaluation.mteb_adapter import InfjaxMTEBModel, changed_documents, mteb_task  # noqa: E402
from infjax.evaluation.types import DataError  # noqa: E402
from infjax.inference.sources import EmbeddingModel  # noqa: E402
from tests.helpers.configs import small_export_config as small_config  # noqa: E402  (test_export's run)
from tests.helpers.evaluation import _jsonl, _tsv, fake_embed  # noqa: E402

SYNTHETIC = "synthetic:seed=0,num_queries=45,pool_size=24"   # the default split, named in full: a run dir's
                                                            # own data.synthetic would otherwise set its size
MAX_LEN = 256                                               # the export's max_seq_length: all three read 256 tokens


def write_followir_fixture(folder):
    """A small FollowIR folder in the hub layout (jhu-clsp/*-instructions): titled and untitled documents, graded
    original qrels (2 and 1), a changed instruction that drops some of them, and each query's candidate pool."""
    split = synthetic.make_eval_split(num_queries=5, seed=11, pool_size=10)
    corpus = []
    for i, (d, text) in enumerate(sorted(split.corpus.items())):
        title, _, body = text.partition(". ")
        corpus.append({"_id": d, "title": title if i % 2 else "", "text": body if i % 2 else text})
    _jsonl(os.path.join(folder, "corpus.jsonl"), corpus)
    _jsonl(os.path.join(folder, "queries.jsonl"),
           [{"_id": q, "text": split.queries[q], "instruction_og": split.instructions_og[q],
             "instruction_changed": split.instructions_changed[q]} for q in split.queries])
    og = [(q, d, 2 if g and int(d.rsplit("d", 1)[1]) % 2 else g) for q, docs in split.qrels_og.items()
          for d, g in docs.items()]
    _jsonl(os.path.join(folder, "qrels_og", "test.jsonl"), [{"query-id": q, "corpus-id": d, "score": g} for q, d, g in og])
    _tsv(os.path.join(folder, "qrels_changed", "test.tsv"),
         [(q, d, g) for q, docs in split.qrels_changed.items() for d, g in docs.items()])
    _jsonl(os.path.join(folder, "top_ranked.jsonl"),
           [{"qid": q, "pid": d} for q, pool in split.candidates.items() for d in pool])
    return folder


def fake_model(template="{query} {instruction}"):
    seen = {"q": [], "p": []}

    def embed(side):
        return lambda texts: seen[side].extend(texts) or fake_embed(list(texts))

    fmt = TextFormat(query_template=template, query_prefix="query: ", passage_prefix="passage: ")
    return EmbeddingModel("runs/fake", "run", 7, fmt, 64, 64, embed("q"), embed("p")), seen


def test_adapter_speaks_mteb2s_encoder_protocol():
    from mteb.models.models_protocols import EncoderProtocol
    from mteb.types import PromptType

    model, seen = fake_model(template="{instruction} -- {query}")
    adapter = InfjaxMTEBModel(model)
    assert isinstance(adapter, EncoderProtocol)
    meta = adapter.mteb_model_meta
    assert (meta.name, meta.revision, meta.embed_dim, meta.similarity_fn_name) == ("infjax/fake", "step-7", 64, "cosine")
    seen["p"].clear()                                                  # the size probe
    # mteb 2.x hands over batches: queries with MTEB's own "{query} {instruction}" text, which the adapter
    # replaces by the model's template; documents with MTEB's "title body" text.
    batches = iter([{"text": ["q1 i1", "q2 i2"], "query": ["q1", "q2"], "instruction": ["i1", "i2"]}])
    q = adapter.encode(batches, task_metadata=None, hf_split="test", hf_subset="default",
                       prompt_type=PromptType.query)
    assert seen["q"] == ["query: i1 -- q1", "query: i2 -- q2"] and q.shape == (2, 64)
    docs = iter([{"text": ["T body"], "title": ["T"], "body": ["body"]}, {"text": ["other"], "body": ["other"]}])
    p = adapter.encode(docs, task_metadata=None, hf_split="test", hf_subset="default",
                       prompt_type=PromptType.document)
    assert seen["p"] == ["passage: T body", "passage: other"]
    sim = np.asarray(adapter.similarity(q, p))
    np.testing.assert_allclose(sim, q @ p.T, atol=1e-6)                 # cosine of unit vectors


def test_mteb_task_from_a_followir_split_and_its_refusals(tmp_path):
    folder = write_followir_fixture(str(tmp_path / "core17-instructions"))
    task = eval_data.load(f"followir:{folder}")[0]
    mt = mteb_task(task)
    mt.load_data()
    data = mt.dataset["default"]["test"]
    assert sorted(data["queries"]["id"]) == sorted(f"{q}-{s}" for q in task.split.queries for s in ("og", "changed"))
    q = sorted(task.split.queries)[0]
    assert data["top_ranked"][f"{q}-og"] == task.split.candidates[q] == data["top_ranked"][f"{q}-changed"]
    assert data["relevant_docs"][f"{q}-og"] == task.split.qrels_og[q]
    assert 2 in {g for qrels in data["relevant_docs"].values() for g in qrels.values()}   # graded, as written
    assert all(changed_documents(task).values())                       # every query has changed documents
    empty = eval_data.FollowIRTask(task.name, eval_data.FollowIRSplit(
        **{**task.split.__dict__, "qrels_changed": {**task.split.qrels_changed, q: {}}}), task.main_metric)
    with pytest.raises(DataError, match=f"query id.*'{q} \\(changed\\)'.* no relevant document"):
        mteb_task(empty)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 3-step run of the embedded MiniLM and its export (test_export's small config)."""
    pytest.importorskip("sentence_transformers")
    from infjax import export, train

    workdir = str(tmp_path_factory.mktemp("mteb_run") / "run")
    train.run(small_config(), workdir)
    out = str(tmp_path_factory.mktemp("mteb_export") / "model")
    assert export.main(["--workdir", workdir, "--out", out]) == 0
    return workdir, out


def _infjax_evaluate(model, spec, out, lengths=(f"--query_max_len={MAX_LEN}", f"--passage_max_len={MAX_LEN}")):
    from infjax import evaluate

    assert evaluate.main([f"--model={model}", f"--dataset={spec}", f"--out={out}", "--no_progress", *lengths]) == 0
    with open(os.path.join(out, "summary.json")) as f:
        return json.load(f)


def _mteb_scores(model, spec):
    task = mteb_task(eval_data.load(spec)[0])
    result = mteb.evaluate(model, [task], cache=None, show_progress_bar=False)
    return result.task_results[0].scores["test"][0]


@pytest.mark.slow
def test_mteb_scores_equal_infjax_evaluate_through_the_adapter_and_the_export(trained, tmp_path):
    from mteb.models.sentence_transformer_wrapper import SentenceTransformerEncoderWrapper

    workdir, exported = trained
    fixture = write_followir_fixture(str(tmp_path / "core17-instructions"))
    adapter = InfjaxMTEBModel(workdir, query_max_len=MAX_LEN, passage_max_len=MAX_LEN, progress=False)
    st = SentenceTransformerEncoderWrapper(exported)                  # MTEB's own loading of an ST folder
    assert st.model.max_seq_length == MAX_LEN
    for i, spec in enumerate((SYNTHETIC, f"followir:{fixture}")):
        ref = _infjax_evaluate(workdir, spec, str(tmp_path / f"eval{i}"))      # one --out per evaluation
        if spec == SYNTHETIC:               # the export through `infjax.evaluate --dataset=synthetic` as it stands
            assert _infjax_evaluate(exported, "synthetic", str(tmp_path / "eval_export"), []) == pytest.approx(ref)
        for label, model in (("adapter on the run", adapter), ("exported folder", st)):
            s = _mteb_scores(model, spec)
            print(f"{spec} {label}: MTEB p-MRR x100 {100 * s['p-MRR']:.9f} (infjax.evaluate {ref['p_mrr']:.9f}), "
                  f"MAP@1000 {s['og_unrounded']['map_at_1000']:.9f} ({ref['map@1000']:.9f}), "
                  f"nDCG@5 {s['og_unrounded']['ndcg_at_5']:.9f} ({ref['ndcg@5']:.9f})")
            assert 100 * s["p-MRR"] == pytest.approx(ref["p_mrr"], abs=1e-6), (spec, label)
            assert s["og_unrounded"]["map_at_1000"] == pytest.approx(ref["map@1000"], abs=1e-6), (spec, label)
            assert s["og_unrounded"]["ndcg_at_5"] == pytest.approx(ref["ndcg@5"], abs=1e-6), (spec, label)
            assert s["og"]["map_at_1000"] == round(ref["map@1000"], 5)          # MTEB's reported (rounded) figures
            assert s["og"]["ndcg_at_5"] == round(ref["ndcg@5"], 5)


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
