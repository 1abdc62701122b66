"""The user's private cache (``$XDG_CACHE_HOME/fullece``, else
``~/.cache/fullece``): ``tables/`` of runs fullece cannot write into,
``scores/`` (the sums ``fullece metrics`` reads) and ``verified/`` (stamps of
checks already run), in directories only this user owns and can write (never
a shared temp directory).
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

from pipeline.store.manifest import AggregateError

CACHE_ENV = "XDG_CACHE_HOME"


def user_cache_dir() -> Path:
    """The current user's fullece cache: $XDG_CACHE_HOME/fullece (an absolute
    XDG_CACHE_HOME only, as the XDG spec says), else ~/.cache/fullece."""
    base = os.environ.get(CACHE_ENV, "")
    root = Path(base) if os.path.isabs(base) else Path.home() / ".cache"
    return root / "fullece"


def _safe_ancestors(path: Path) -> None:
    """Every directory leading to `path` (symbolic links resolved) is owned by
    root or this user and writable by no one else unless sticky (/tmp): no
    other user can swap a component for one of theirs."""
    uid = os.getuid()
    probe = Path(os.path.realpath(path))
    for directory in [*reversed(probe.parents), probe]:
        try:
            st = directory.stat()
        except FileNotFoundError:
            return
        foreign_write = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
        if st.st_uid not in (0, uid) or (foreign_write and not st.st_mode & stat.S_ISVTX):
            raise AggregateError(
                f"{directory}: the tables cache {path} would lie in a directory another "
                "user can change (owned by uid "
                f"{st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}); set {CACHE_ENV} to a "
                "directory of your own"
            )


def _private_dir(path: Path) -> Path:
    """`path` as a directory of this user only: created 0700 if missing, then
    refused unless it is a real directory (not a symbolic link) owned by the
    current uid that no one else can write."""
    try:
        path.mkdir(mode=0o700, exist_ok=True)
    except OSError as err:
        raise AggregateError(f"{path}: cannot create the tables cache ({err})") from None
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise AggregateError(
            f"{path}: the tables cache is a symbolic link or not a directory; "
            "refused (remove it: fullece recreates it)"
        )
    if st.st_uid != os.getuid():
        raise AggregateError(
            f"{path}: the tables cache is owned by uid {st.st_uid}, not by you "
            f"(uid {os.getuid()}); refused (remove it, or set {CACHE_ENV})"
        )
    if st.st_mode & 0o077:
        raise AggregateError(
            f"{path}: the tables cache has mode {stat.S_IMODE(st.st_mode):o}, open to "
            "other users; refused (chmod 700 it, or remove it)"
        )
    return path


def private_cache_dir(*names: str) -> Path:
    """``user_cache_dir()/<names...>``, every component this user's own (see
    _private_dir): what fullece derives from runs it could not write into, and
    the sums it keeps, live only here, never where another user could pre-seed
    them or point them elsewhere."""
    base = user_cache_dir()
    _safe_ancestors(base.parent)
    base.parent.mkdir(parents=True, exist_ok=True)
    _safe_ancestors(base.parent)
    directory = _private_dir(base)
    for name in names:
        directory = _private_dir(directory / name)
    return directory


def _tables_cache(run_dirs) -> Path:
    """Where tables of runs that cannot hold them (read-only) are kept: the
    user's own cache (``user_cache_dir()/tables/<sha256 of the runs' real
    paths>``), every component checked (see _private_dir), never a shared
    temp directory another user could pre-seed or point elsewhere."""
    tag = hashlib.sha256("\0".join(str(Path(d).resolve()) for d in run_dirs).encode()).hexdigest()[
        :16
    ]
    return private_cache_dir("tables", tag)
