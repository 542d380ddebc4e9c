"""Run folders on a local disk or an object store (gs://, s3://), through `etils.epath` as Orbax uses.

A workdir is named by a string: a local path, or a URL such as gs://bucket/runs/x (reached through
gcsfs / s3fs, the optional `gcs` / `s3` extras; Orbax's arrays go through tensorstore's own GCS / S3
drivers). Local paths are made absolute; URLs are kept as given (`os.path.abspath("gs://b/x")` would
be a local folder named gs:). Object stores have no folders, appends, renames or locks of their own:
`makedirs` is a no-op there, `rename` is copy-and-delete, and callers that need an append (metrics.jsonl)
or a lock (one run per workdir) handle the object-store case themselves.
"""
from __future__ import annotations

import contextlib
import os
import re
import tempfile

import fsspec
from etils import epath

from infjax.errors import UserError

_URL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")

# An object store's listings change under this process (Orbax writes arrays through tensorstore, other hosts
# write too): fsspec's cached listings would hide new checkpoints, so they are off (unless configured).
for _protocol in ("gs", "gcs", "s3", "s3a"):
    fsspec.config.conf.setdefault(_protocol, {}).setdefault("use_listings_cache", False)


def is_remote(path: str) -> bool:
    """True for an object-store URL (gs://, s3://, ...), False for a local path."""
    return bool(_URL.match(os.fspath(path)))


# The package fsspec needs for an object store's URLs, and the infjax extra that installs it.
_BACKENDS = {"gs": ("gcsfs", "gcs"), "gcs": ("gcsfs", "gcs"), "s3": ("s3fs", "s3"), "s3a": ("s3fs", "s3")}


def check_backend(path: str) -> None:
    """For a URL: raise UserError, one line naming the extra to install, when nothing can reach its store
    (without this, the first read fails deep in fsspec with a long traceback)."""
    path = os.fspath(path)
    if not is_remote(path):
        return
    protocol = path.split("://", 1)[0].lower()
    try:
        fsspec.get_filesystem_class(protocol)
    except ImportError:
        package, extra = _BACKENDS.get(protocol, (None, None))
        fix = (f"install the `{extra}` extra: pip install 'infjax[{extra}]' (it brings {package})" if extra
               else "install the fsspec backend for it")
        raise UserError(f"{path}: {protocol}:// needs a package that is not installed; {fix}") from None
    except ValueError:
        raise UserError(f"{path}: {protocol}:// is not a storage this installation knows (local paths, gs://, "
                        f"s3://)") from None


def absolute(path: str) -> str:
    """A local path made absolute (~ expanded); a URL unchanged but for a trailing slash (its store's package
    checked: `check_backend`)."""
    path = os.fspath(path)
    if is_remote(path):
        check_backend(path)
        return path.rstrip("/")
    return os.path.abspath(os.path.expanduser(path))


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


def _path(path: str) -> epath.Path:
    check_backend(path)
    return epath.Path(path)


def Path(path: str) -> epath.Path:  # noqa: N802 - a constructor
    return _path(path)


def exists(path: str) -> bool:
    return _path(path).exists()


def isdir(path: str) -> bool:
    return _path(path).is_dir()


def listdir(path: str) -> list[str]:
    """Names in the folder (or under the prefix) `path`; [] when there is none."""
    p = _path(path)
    if not p.is_dir():
        return []
    return sorted(child.name for child in p.iterdir())


def makedirs(path: str) -> None:
    _path(path).mkdir(parents=True, exist_ok=True)


def read_text(path: str) -> str:
    return _path(path).read_text(encoding="utf-8")


@contextlib.contextmanager
def replacing(path: str, binary: bool = False):
    """A new local file written in full, then renamed over `path` (never half written).

    The temporary file gets a fresh name of its own (O_EXCL: nothing planted at a guessable name is followed), and the
    rename replaces a symbolic link at `path` instead of writing through it. On an error the temporary file goes."""
    folder, name = os.path.split(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}.tmp-")
    try:
        os.fchmod(fd, 0o666 & ~umask())     # mkstemp makes 0600: the file gets the usual permissions
        with os.fdopen(fd, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})) as f:
            yield f
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def umask() -> int:
    """This process's umask (read by setting it and back: the only way): what a new file's mode leaves out."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_text(path: str, text: str) -> None:
    """Write a whole file: locally through `replacing` (never half written, never through a link); on an object
    store as one upload (an object appears only when complete)."""
    if is_remote(path):
        _path(path).write_text(text, encoding="utf-8")
        return
    with replacing(path) as f:
        f.write(text)


def rename(src: str, dst: str) -> None:
    """Rename a file or folder (on an object store: copy, then delete)."""
    if not is_remote(src):
        os.replace(src, dst)
        return
    s, d = _path(src), _path(dst)
    if s.is_dir():
        copy_tree(src, dst)
        s.rmtree()
    else:
        s.copy(d)
        s.unlink()


def rmtree(path: str) -> None:
    p = _path(path)
    if p.is_dir():
        p.rmtree()
    elif p.exists():
        p.unlink()


def copy_tree(src: str, dst: str) -> None:
    """Copy every file under `src` to the same relative path under `dst` (each may be local or a URL)."""
    source = _path(src)
    if not source.is_dir():
        raise FileNotFoundError(f"{src}: no such folder")
    makedirs(dst)
    for child in sorted(source.iterdir(), key=lambda p: p.name):
        target = join(dst, child.name)
        if child.is_dir():
            copy_tree(str(child), target)
        else:
            child.copy(_path(target), overwrite=True)
