"""A model folder's identity by content: one digest over every file that can change its embeddings.

The embedding cache keys a sentence-transformers or Hugging Face folder by
`folder_digest`, never by its path or file dates: a pooling switched from mean
to CLS in `1_Pooling/config.json`, another `vocab.txt`, a `2_Dense/` layer or a
weight file of the same size copied with its date kept all give a new digest.

Which files: every file under the folder, sub-folders included (`1_Pooling/`,
`2_Normalize/`, `2_Dense/`, `query/` and `passage/` of separate encoders),
links followed, except those no encoder of infjax or sentence-transformers on
torch reads: hidden entries (`.git/`, `.gitattributes`, `.cache/`), `*.md`,
`__pycache__/`, and the other runtimes' `onnx/` and `openvino/` folders. A file
too many costs reading time only; a file too few could give a wrong hit.

The cost: SHA-256 reads about 1.4 GB/s on a CPU with SHA instructions (0.06 s
for all-MiniLM-L6-v2's 87 MiB, about 10 s for 14 GB of weights). So that this
is paid once per file, not on every evaluation, each file's digest is kept in a
small index (DIGESTS_FILE under $INFJAX_CACHE_DIR, else ~/.cache/infjax) under
its real path and (device, inode, size, mtime in ns, ctime in ns). A file
changed in any way gets a new ctime, which the kernel sets and no copy or
`touch` can set back, so it is read again; the index only saves the reading of
unchanged files. Where the index cannot be read or written, every file is read.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re

from infjax.errors import UserError
from infjax.runtime import storage

log = logging.getLogger("infjax.inference")

DIGESTS_FILE = "file-digests.json"
SKIPPED_FOLDERS = frozenset({"__pycache__", "onnx", "openvino"})
MAX_REMEMBERED = 4096           # files the index keeps (the most recently hashed)


class UnreadableModelFile(UserError, OSError):
    """A file of a model folder that cannot be read while its identity is computed."""


def model_files(folder: str) -> list[tuple[str, str]]:
    """(path relative to `folder`, path) of every file that can change `folder`'s embeddings.

    Sorted by the relative path (see the module's docstring for what is left out). Linked folders are followed
    once."""
    found, seen = [], set()
    for root, dirs, files in os.walk(folder, followlinks=True):
        real = os.path.realpath(root)
        if real in seen:              # a link back up the tree
            dirs[:] = []
            continue
        seen.add(real)
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in SKIPPED_FOLDERS]
        for name in files:
            if name.startswith(".") or name.endswith((".md", ".pyc")):
                continue
            path = os.path.join(root, name)
            if os.path.isfile(path):
                found.append((os.path.relpath(path, folder).replace(os.sep, "/"), path))
    return sorted(found)


def file_sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _signature(st: os.stat_result) -> list[int]:
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def index_path() -> str | None:
    """Where the per-file digests are kept: DIGESTS_FILE under $INFJAX_CACHE_DIR, else ~/.cache/infjax.

    None for an object-store URL: then nothing is kept."""
    root = os.environ.get("INFJAX_CACHE_DIR") or os.path.join("~", ".cache", "infjax")
    if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", root):
        return None
    return os.path.join(os.path.abspath(os.path.expanduser(root)), DIGESTS_FILE)


def _read_index(path: str | None) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            index = json.load(f)
        return index if isinstance(index, dict) else {}
    except (OSError, ValueError, TypeError):
        return {}


def _write_index(path: str | None, index: dict) -> None:
    if path is None:
        return
    kept = dict(list(index.items())[-MAX_REMEMBERED:])
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with storage.replacing(path) as f:            # several processes: the last one's index stays, whole
            json.dump(kept, f)
    except OSError as e:
        log.debug("file digests not kept in %s: %s", path, e)


def folder_digest(folder: str, index_file: str | None = "") -> str:
    """SHA-256 over the relative path, size and SHA-256 of each of `model_files(folder)`.

    Equal for two folders whose files hold the same bytes, wherever they are and whatever their dates.
    `index_file`: where the per-file digests are kept ("" for `index_path()`, None for nowhere)."""
    index_file = index_path() if index_file == "" else index_file
    index = _read_index(index_file)
    h = hashlib.sha256()
    changed = False
    for rel, path in model_files(folder):
        real = os.path.realpath(path)
        try:
            before = _signature(os.stat(real))
            kept = index.get(real)
            if isinstance(kept, list) and kept[:-1] == before:
                digest = kept[-1]
                index[real] = index.pop(real)          # recently used: kept longest
            else:
                digest = file_sha256(real)
                if _signature(os.stat(real)) == before:        # not changing while it was read
                    index.pop(real, None)
                    index[real] = before + [digest]
                    changed = True
        except OSError as e:
            raise UnreadableModelFile(f"{path}: cannot be read to identify the model ({e.strerror or e}); "
                                      f"check its permissions, or copy the folder again") from None
        h.update(f"{rel}\0{before[2]}\0{digest}\n".encode())
    if changed:
        _write_index(index_file, index)
    return h.hexdigest()[:32]
