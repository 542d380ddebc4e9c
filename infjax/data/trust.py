"""Whether a cache folder may be read: written by this user alone.

A token cache entry or an Arrow folder holds what a run trains on. In a folder others can write (a mode-1777
/tmp, a team's scratch space), an entry planted by another user under the key a run computes would be
trained on silently. So an entry is used only when it, everything in it and the folder holding it belong to
this user (or to root) and no one else can write them, unless the configuration says that the cache is
shared on purpose (`config.data.cache_shared`), as git's ``safe.directory`` does for repositories.
`private` makes what this process wrote pass: it takes away group and other write permission.
"""
from __future__ import annotations

import os
import pwd
import stat

SHARED_FLAG = "config.data.cache_shared"


def _owner(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _problem(path: str, st: os.stat_result, me: int, holder: bool) -> str:
    """Why `path` (lstat `st`) is not this user's alone ("" when it is)."""
    if stat.S_ISLNK(st.st_mode):
        return f"{path} is a link"
    if st.st_uid not in (me, 0):
        return f"{path} is owned by {_owner(st.st_uid)}, not by this user ({_owner(me)})"
    writers = [who for who, bit in (("its group", stat.S_IWGRP), ("every user", stat.S_IWOTH)) if st.st_mode & bit]
    if writers and not (holder and stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX):   # sticky, as /tmp
        return f"{path} can be written by {' and '.join(writers)} (mode {stat.S_IMODE(st.st_mode):o})"
    return ""


def foreign(folder: str) -> str:
    """Why `folder` may hold what another user wrote ("" when it may not, or when it does not exist).

    Checked: the folder holding it (which must not let another user swap it), the folder, and everything
    under it, without following links."""
    me = os.geteuid()
    try:
        top = os.lstat(folder)
    except FileNotFoundError:
        return ""
    parent = os.path.dirname(os.path.abspath(folder))
    problem = _problem(parent, os.lstat(parent), me, holder=True) or _problem(folder, top, me, holder=False)
    if problem or not stat.S_ISDIR(top.st_mode):
        return problem
    for here, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = os.path.join(here, name)
            problem = _problem(path, os.lstat(path), me, holder=False)
            if problem:
                return problem
    return ""


def refusal(folder: str, what: str, problem: str, root: str) -> str:
    """The one line that refuses a folder `foreign` found a problem with."""
    return (f"{what} {folder} is not used: {problem}, so another user may have written what it holds. Use a "
            f"cache folder of your own (config.data.cache_dir; now {root}), or, if {root} is shared on "
            f"purpose, set {SHARED_FLAG}=True")


def private(folder: str) -> None:
    """Take group and other write permission away from everything this user owns under `folder`."""
    me = os.geteuid()
    for here, dirs, files in os.walk(folder):
        for path in [here] + [os.path.join(here, n) for n in dirs + files]:
            st = os.lstat(path)
            if st.st_uid == me and not stat.S_ISLNK(st.st_mode) and st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                os.chmod(path, stat.S_IMODE(st.st_mode) & ~(stat.S_IWGRP | stat.S_IWOTH))
