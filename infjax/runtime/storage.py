"""Run folders on a local disk or an object store (gs://, s3://), through `etils.epath` as Orbax uses.

A workdir is named by a string: a local path, or a URL such as gs://bucket/runs/x (reached through
gcsfs / s3fs, the optional `gcs` / `s3` extras; Orbax's arrays go through tensorstore's own GCS / S3
drivers). Local paths are made absolute; URLs are kept as given (`os.path.abspath("gs://b/x")` would
be a local folder named gs:). Object stores have no folders, appends, renames or locks of their own:
`makedirs` is a no-op there, `rename` is copy-and-delete, and callers that need an append (metrics.jsonl)
or a lock (one run per workdir) handle the object-store case themselves.
"""
from __future__ import annotations

import os
import re

import fsspec
from etils import epath

_URL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")

# An object store's listings change under this process (Orbax writes arrays through tensorstore, other hosts
# write too): fsspec's cached listings would hide new checkpoints, so they are off (unless configured).
for _protocol in ("gs", "gcs", "s3", "s3a"):
    fsspec.config.conf.setdefault(_protocol, {}).setdefault("use_listings_cache", False)


def is_remote(path: str) -> bool:
    """True for an object-store URL (gs://, s3://, ...), False for a local path."""
    return bool(_URL.match(os.fspath(path)))


def absolute(path: str) -> str:
    """A local path made absolute (~ expanded); a URL unchanged but for a trailing slash."""
    path = os.fspath(path)
    return path.rstrip("/") if is_remote(path) else os.path.abspath(os.path.expanduser(path))


def unwritable(path: str) -> str | None:
    """Why a local folder `path` (existing or to be created) cannot be written, or None (object stores: None;
    their permissions show at the first write)."""
    if is_remote(path):
        return None
    path = os.path.abspath(os.path.expanduser(path))
    probe = path
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        return f"{probe} is not a folder"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{probe} is not writable" + (" (read-only file system)" if _read_only(probe) else "")
    return None


def _read_only(path: str) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def join(path: str, *parts: str) -> str:
    if is_remote(path):
        return "/".join([path.rstrip("/"), *[p.strip("/") for p in parts]])
    return os.path.join(path, *parts)


def Path(path: str) -> epath.Path:  # noqa: N802 - a constructor
    return epath.Path(path)


def exists(path: str) -> bool:
    return epath.Path(path).exists()


def isdir(path: str) -> bool:
    return epath.Path(path).is_dir()


def listdir(path: str) -> list[str]:
    """Names in the folder (or under the prefix) `path`; [] when there is none."""
    p = epath.Path(path)
    if not p.is_dir():
        return []
    return sorted(child.name for child in p.iterdir())


def makedirs(path: str) -> None:
    epath.Path(path).mkdir(parents=True, exist_ok=True)


def read_text(path: str) -> str:
    return epath.Path(path).read_text(encoding="utf-8")


def write_text(path: str, text: str) -> None:
    """Write a whole file: locally through a temporary file and a rename (never half written); on an object
    store as one upload (an object appears only when complete)."""
    if is_remote(path):
        epath.Path(path).write_text(text, encoding="utf-8")
        return
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def rename(src: str, dst: str) -> None:
    """Rename a file or folder (on an object store: copy, then delete)."""
    if not is_remote(src):
        os.replace(src, dst)
        return
    s, d = epath.Path(src), epath.Path(dst)
    if s.is_dir():
        copy_tree(src, dst)
        s.rmtree()
    else:
        s.copy(d)
        s.unlink()


def rmtree(path: str) -> None:
    p = epath.Path(path)
    if p.is_dir():
        p.rmtree()
    elif p.exists():
        p.unlink()


def copy_tree(src: str, dst: str) -> None:
    """Copy every file under `src` to the same relative path under `dst` (each may be local or a URL)."""
    source = epath.Path(src)
    if not source.is_dir():
        raise FileNotFoundError(f"{src}: no such folder")
    makedirs(dst)
    for child in sorted(source.iterdir(), key=lambda p: p.name):
        target = join(dst, child.name)
        if child.is_dir():
            copy_tree(str(child), target)
        else:
            child.copy(epath.Path(target), overwrite=True)
