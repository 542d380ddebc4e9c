"""What a usable model folder is (infjax/models/folder.py): each class of bad folder is refused in one line naming
the file, through the one check that training, restores, evaluate, export and curate's embedder pass; a run
records its tokenizer and a base folder that changed it is refused; curate's embedder reads with infjax's own
encoder the sentence-transformers folders infjax reads as sentence-transformers does."""
import json
import os
import shutil
import sys

import numpy as np
import pytest

from infjax.models import folder as folder_lib
from infjax.models.hf.files import CheckpointNotFound
from tests.helpers.tiny import hf_config, tiny_bert_path, write_random_checkpoint


@pytest.fixture
def tiny(tmp_path):
    """A copy of the tiny BERT (a sentence-transformers folder as MiniLM's: Transformer, 1_Pooling, Normalize
    without a folder) to break."""
    return shutil.copytree(tiny_bert_path(), str(tmp_path / "tiny"))


def _refused(path, match, **kwargs):
    with pytest.raises(folder_lib.FolderUnusable) as e:
        folder_lib.check(path, **kwargs)
    message = str(e.value)
    assert "\n" not in message and match in message, message
    return message


def test_a_whole_folder_passes_and_its_tokenizer_is_recorded_by_content(tiny, tmp_path):
    checked = folder_lib.check(tiny)
    assert [m["path"] for m in checked.modules] == ["", "1_Pooling", "2_Normalize"]   # 2_Normalize: no folder
    assert checked.tokens == 30522
    moved = shutil.copytree(tiny, str(tmp_path / "elsewhere"))
    saved, now = (folder_lib.record(p) for p in (tiny, moved))
    assert now["fingerprint"] == saved["fingerprint"] and folder_lib.other_tokenizer(saved, now) is None
    with open(os.path.join(moved, "tokenizer_config.json")) as f:
        settings = json.load(f)
    with open(os.path.join(moved, "tokenizer_config.json"), "w") as f:      # the same vocabulary, cased
        json.dump({**settings, "do_lower_case": False}, f)
    os.remove(os.path.join(moved, "tokenizer.json"))
    now = folder_lib.record(moved)
    assert now["fingerprint"] != saved["fingerprint"]
    assert folder_lib.other_tokenizer(saved, now) == (
        f"the run was trained with the tokenizer of {tiny} (30522 tokens, fingerprint {saved['fingerprint']}), but "
        f"{moved} now holds another (30522 tokens, fingerprint {now['fingerprint']}): restore the tokenizer files "
        f"the run started with")


@pytest.mark.parametrize("kept", ["tokenizer_config.json", "nothing", "vocab.json"])
def test_a_folder_without_tokenizer_files_is_refused_naming_them(tiny, kept):
    """A folder without tokenizer files is refused naming them (transformers would build a 5-token tokenizer)."""
    for name in ("tokenizer.json", "vocab.txt") + (("tokenizer_config.json",) if kept == "nothing" else ()):
        os.remove(os.path.join(tiny, name))
    if kept == "vocab.json":
        with open(os.path.join(tiny, "vocab.json"), "w") as f:
            json.dump({"a": 0}, f)
        _refused(tiny, f"{tiny}: no merges.txt (it has vocab.json")
        return
    message = _refused(tiny, f"{tiny}: no tokenizer.json or vocab.txt")
    assert ("tokenizer_config.json alone" in message) == (kept == "tokenizer_config.json")
    assert "copy the tokenizer files" in message


def test_a_tokenizer_that_does_not_fit_the_embedding_table_is_refused(tiny, tmp_path):
    # ids past the table: MiniLM's tokenizer (30522 ids) on a table of 1000 rows, weights read or not
    small = write_random_checkpoint("bert", {**hf_config(), "vocab_size": 1000}, str(tmp_path / "small"))
    for weights in (True, False):
        _refused(small, "its tokenizer gives ids up to 30521, past the embedding table", weights=weights)
        _refused(small, f"{small}/config.json has vocab_size=1000", weights=weights)
    # a tokenizer of 100 tokens on a table of 30522 rows: not the one these weights were trained with
    from tests.helpers.backbones import write_word_tokenizer

    for name in ("tokenizer.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json"):
        os.remove(os.path.join(tiny, name))
    write_word_tokenizer(tiny, 100)
    _refused(tiny, "its tokenizer has 100 tokens for an embedding table of 30522 rows")
    assert folder_lib.check(tiny, weights=False).tokens == 100     # shapes alone: ids fit the table


def test_every_module_that_modules_json_names_is_checked(tiny):
    modules_file = os.path.join(tiny, "modules.json")
    modules = json.load(open(modules_file))
    shutil.rmtree(os.path.join(tiny, "1_Pooling"))
    _refused(tiny, f"{modules_file} names module 1 (Pooling) in 1_Pooling/, which is missing", reader="infjax")
    _refused(tiny, "which is missing", reader="sentence_transformers")
    os.makedirs(os.path.join(tiny, "1_Pooling"))
    _refused(tiny, "names module 1 (Pooling) in 1_Pooling/, which has no config.json")
    with open(os.path.join(tiny, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": 32, "pooling_mode_mean_tokens": False}, f)
    _refused(tiny, "1_Pooling/config.json: names no pooling mode")
    with open(os.path.join(tiny, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": 32, "pooling_mode_max_tokens": True}, f)
    folder_lib.check(tiny)                          # sentence-transformers computes it; infjax does not:
    with pytest.raises(folder_lib.PoolingUnread, match="1_Pooling/config.json: a pooling mode infjax does not"):
        folder_lib.pooling(tiny)
    assert "pooling" in folder_lib.infjax_reads(tiny)
    with open(modules_file, "w") as f:
        json.dump(modules + [{"idx": 3, "path": "3_Dense", "type": "sentence_transformers.models.Dense"}], f)
    _refused(tiny, "names module 3 (Dense) in 3_Dense/, which is missing")
    with open(modules_file, "w") as f:
        f.write('{"not": "a list"}')
    _refused(tiny, f"{modules_file}: expected a list of modules")


@pytest.mark.parametrize("name", ["../evilpool", "/abs/evilpool", "1_Pooling/../../evilpool"])
@pytest.mark.parametrize("reader", ["infjax", "sentence_transformers"])
def test_a_module_named_outside_the_folder_is_refused_by_either_reader(tiny, tmp_path, name, reader):
    """modules.json naming a module outside the folder (../x, an absolute path) is refused, though the module is
    there and whole: what a folder's file names is inside it."""
    pool = os.path.join(tiny, "1_Pooling")
    target = os.path.normpath(os.path.join(tiny, name)) if not os.path.isabs(name) else name
    if not os.path.isabs(name):
        shutil.copytree(pool, target)
    modules_file = os.path.join(tiny, "modules.json")
    modules = json.load(open(modules_file))
    modules[1]["path"] = name
    json.dump(modules, open(modules_file, "w"))
    _refused(tiny, f"{modules_file} names module 1 (Pooling) in {name}/, outside the folder: a module is a "
                   f"sub-folder named relative to it", reader=reader)


def _shard(tiny):
    """The tiny BERT's weights as shards and an index, as save_pretrained writes a large model."""
    from infjax.models.hf import files as hf_files

    tensors = hf_files.read_safetensors(os.path.join(tiny, "model.safetensors"))
    os.remove(os.path.join(tiny, "model.safetensors"))
    written = hf_files.save_safetensors(tiny, tensors, max_shard_size=sum(t.nbytes for t in tensors.values()) // 2)
    assert len(written) >= 3 and written[-1] == hf_files.SAFETENSORS_INDEX
    return os.path.join(tiny, hf_files.SAFETENSORS_INDEX), written[:-1]


@pytest.mark.parametrize("reader", ["infjax", "sentence_transformers"])
def test_a_shard_index_is_held_to_one_rule_by_either_reader(tiny, tmp_path, reader):
    """A sharded folder passes; an index whose second shard is missing, or that names a shard outside the
    folder (present there), is refused by both readers, naming the index."""
    index, shards = _shard(tiny)
    folder_lib.check(tiny, reader=reader)
    os.rename(os.path.join(tiny, shards[1]), tmp_path / shards[1])
    with pytest.raises((folder_lib.FolderUnusable, CheckpointNotFound)) as e:
        folder_lib.check(tiny, reader=reader)
    assert f"{index} lists shard(s) that are missing: ['{shards[1]}']" in str(e.value), str(e.value)
    content = json.load(open(index))
    content["weight_map"] = {k: (f"../{shards[1]}" if v == shards[1] else v) for k, v in content["weight_map"].items()}
    json.dump(content, open(index, "w"))
    with pytest.raises((folder_lib.FolderUnusable, CheckpointNotFound)) as e:
        folder_lib.check(tiny, reader=reader)
    assert f"{index} names shard(s) outside its folder: ['../{shards[1]}']" in str(e.value), str(e.value)


@pytest.mark.parametrize("change", [{"model_type": "llama"}, {"model_type": "qwen2"}, {"intermediate_size": 48}])
def test_a_config_json_the_weights_do_not_fit_is_refused_naming_the_key(tiny, change):
    """config.json naming another family (llama, qwen2 on BERT weights) or other sizes is refused from the
    weights' headers, before a model is built, naming model_type and what disagrees."""
    config_file = os.path.join(tiny, "config.json")
    config = json.load(open(config_file))
    json.dump({**config, **change}, open(config_file, "w"))
    message = _refused(tiny, f"{config_file}: model_type {change.get('model_type', 'bert')!r} and the sizes it "
                             f"gives disagree with the weights of {tiny} (")
    assert ("missing tensors: ['embed_tokens.weight'" in message if "model_type" in change
            else "shape mismatches: ['encoder.layer.0.intermediate.dense.weight: expected (48, 32), got (64, 32)'"
            in message), message
    if change.get("model_type") == "qwen2":           # without the weights, the tokenizer it chooses is seen
        _refused(tiny, "transformers reads the tokenizer files as Qwen2Tokenizer, as config.json's model_type "
                       "'qwen2', over tokenizer_config.json's tokenizer_class 'BertTokenizer' says", weights=False)
    else:
        folder_lib.check(tiny, weights=False)         # a restore reads no weights: nothing to compare


@pytest.mark.parametrize("name", ["model.safetensors", "vocab.txt", "config.json"])
def test_a_file_this_user_may_not_read_is_said_to_be_a_permission(tiny, monkeypatch, name):
    """A weights, tokenizer or config file this user may not read (mode 000 for a user other than root, as
    `os.access` reports it) is refused as a permission, naming its owner and mode, not as a damaged file."""
    import pwd

    file = os.path.join(tiny, name)
    os.chmod(file, 0)
    real = os.access
    monkeypatch.setattr(folder_lib.os, "access", lambda p, mode: False if p == file else real(p, mode))
    owner = pwd.getpwuid(os.stat(file).st_uid).pw_name
    _refused(tiny, f"{file}: this user ({pwd.getpwuid(os.geteuid()).pw_name}) may not read it (owned by {owner}, "
                   f"mode 0): a permission, not a damaged file; ask {owner} to let you read it")


def test_a_tokenizer_class_that_is_not_the_models_is_named(tiny):
    file = os.path.join(tiny, "tokenizer_config.json")
    json.dump({**json.load(open(file)), "tokenizer_class": "GPT2Tokenizer"}, open(file, "w"))
    _refused(tiny, "as tokenizer_config.json's tokenizer_class 'GPT2Tokenizer' says")


def test_the_files_a_family_needs_are_checked(tiny, tmp_path):
    os.remove(os.path.join(tiny, "model.safetensors"))
    with pytest.raises(CheckpointNotFound, match=f"no model.safetensors or model.safetensors.index.json in {tiny}"):
        folder_lib.check(tiny)
    assert folder_lib.check(tiny, weights=False).config["model_type"] == "bert"     # a restore reads no weights
    _refused(tiny, "no weights (model.safetensors or pytorch_model.bin)", reader="sentence_transformers")
    open(os.path.join(tiny, "pytorch_model.bin"), "wb").close()
    _refused(tiny, "only has PyTorch pickle weights (pytorch_model.bin)")
    folder_lib.check(tiny, reader="sentence_transformers")          # sentence-transformers reads those
    config = json.load(open(os.path.join(tiny, "config.json")))
    with open(os.path.join(tiny, "config.json"), "w") as f:
        json.dump({**config, "model_type": "mpnet"}, f)
    _refused(tiny, "model_type 'mpnet' is not supported", weights=False)
    with open(os.path.join(tiny, "config.json"), "w") as f:
        json.dump({k: v for k, v in config.items() if k != "hidden_size"}, f)
    _refused(tiny, "missing required key(s) ['hidden_size']", weights=False)
    with open(os.path.join(tiny, "config.json"), "w") as f:
        f.write("{")
    _refused(tiny, f"{tiny}/config.json: not valid JSON", weights=False)
    os.remove(os.path.join(tiny, "config.json"))
    _refused(tiny, f"{tiny}: no config.json", weights=False)


def test_evaluate_refuses_a_model_folder_without_tokenizer_or_with_a_missing_module(tiny, capsys):
    """evaluate refuses, before any model is loaded, a folder without tokenizer or with a module missing.

    Exit 2 and one line naming the file, whichever reader (auto or --model_type=hf); never a lower score, or an
    export encoded with mean pooling while its Pooling module is gone."""
    from infjax import evaluate

    os.remove(os.path.join(tiny, "tokenizer.json"))
    os.remove(os.path.join(tiny, "vocab.txt"))
    for model_type in ("auto", "hf"):
        assert evaluate.main([f"--model={tiny}", f"--model_type={model_type}", "--dataset=synthetic"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith(f"infjax.evaluate: error: {tiny}: no tokenizer.json or vocab.txt"), err
    for name in ("tokenizer.json", "vocab.txt"):
        shutil.copy(os.path.join(tiny_bert_path(), name), tiny)
    shutil.rmtree(os.path.join(tiny, "1_Pooling"))
    assert evaluate.main([f"--model={tiny}", "--dataset=synthetic"]) == 2
    assert "modules.json names module 1 (Pooling) in 1_Pooling/, which is missing" in capsys.readouterr().err


def test_curates_embedder_is_encoded_by_infjax_where_infjax_reads_the_folder(tiny, monkeypatch, caplog):
    """curate's embedder is infjax's encoder where it reads the folder as sentence-transformers does.

    The same weights, pooling, prompts and max_seq_length (the same embeddings as --model_type=hf), and
    sentence-transformers never imported (torch is 10x slower); a folder with a module infjax does not read is
    encoded by sentence-transformers, saying why."""
    import logging

    from infjax.curation import retrieve
    from infjax.curation.sources import Collection
    from infjax.inference import sources as model_sources

    monkeypatch.setitem(sys.modules, "sentence_transformers", None)       # `import sentence_transformers` fails
    collection = Collection(name="two", pairs=(), passages={"a": "a passage about cooking", "b": "one about topic 5"},
                            total_pairs=0)
    with caplog.at_level(logging.INFO, logger="infjax.model_sources"):
        retriever = retrieve.Retriever(tiny, collection, top_k=2, progress=False)
    assert retriever.model.kind == "hf" and "is encoded by infjax's own encoder" in caplog.text
    assert (retriever.model.query_max_len, retriever.model.passage_max_len) == (256, 256)   # its max_seq_length
    texts = list(collection.passages.values())
    reference = model_sources.load_model(tiny, model_type="hf", passage_max_len=256, progress=False)
    np.testing.assert_array_equal(retriever.model.embed_passage(texts), reference.embed_passage(texts))
    assert retriever(["Cooking, please."], ["what is this"])[0][0] in ("a", "b")

    # a module infjax does not read (a Dense layer): sentence-transformers encodes it, saying why
    modules = json.load(open(os.path.join(tiny, "modules.json")))
    os.makedirs(os.path.join(tiny, "3_Dense"))
    for name in ("config.json", "model.safetensors"):
        open(os.path.join(tiny, "3_Dense", name), "w").close()
    with open(os.path.join(tiny, "modules.json"), "w") as f:
        json.dump(modules + [{"idx": 3, "path": "3_Dense", "type": "sentence_transformers.models.Dense"}], f)
    loaded = []
    monkeypatch.setattr(model_sources, "_load_sentence_transformers", lambda src, *a: loaded.append(src.given))
    monkeypatch.setattr(model_sources, "sentence_transformers_missing", lambda: None)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="infjax.model_sources"):
        retrieve.Retriever(tiny, collection)
    assert loaded == [tiny]
    assert "is encoded by sentence-transformers: infjax does not read" in caplog.text
    assert "it has a Dense module (3_Dense) that infjax does not read" in caplog.text
