"""sha256 of run files: the digests the manifest records, cached per process,
and begun early.

Standard library only, so that a command can start hashing the first shards
it maps (:func:`prehash_first_shards`, one a core, on a thread) before it
imports numpy and pyarrow: the import takes one core for ~0.15 s and the other
would be idle, while hashing a shard (~0.9 GB/s here) is the first thing a
command that reads it must finish. A file is then hashed once:
:func:`cached_sha256` waits for a hash under way instead of starting another. A digest is used only if
the file's (size, mtime, inode) are the same before and after it was hashed
and when it is asked for, as for any cached digest.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import threading
import time
from pathlib import Path

from pipeline.store.runpaths import inside_run

_HASH_BLOCK = 1 << 20
# A file modified this recently may change again within the same timestamp
# tick (same size, same mtime): never cached (git's "racy" rule).
_RACY_NS = 2_000_000_000

_HASH_CACHE: dict[tuple, str] = {}
_PENDING: dict[tuple, _Pending] = {}
# prehashed digests not cached (files modified too recently): each used once
_PREHASHED: dict[tuple, str] = {}
_LOCK = threading.Lock()


class _Pending:
    """A hash under way on the prehash thread; `digest` None if it failed or
    the file changed while it was read."""

    def __init__(self):
        self.done = threading.Event()
        self.digest: str | None = None


def file_sha256(path) -> str:
    # read into one buffer, reused: a fresh block per read is fresh pages, whose
    # faults took a third of the hash's CPU here (98 MB: 0.088-0.118 -> 0.074-0.080 s)
    h = hashlib.sha256()
    block = bytearray(_HASH_BLOCK)
    view = memoryview(block)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(block):
            h.update(view[:n])
    return h.hexdigest()


def path_sha256(path) -> str:
    """sha256 of a file, or of a directory tree (a Zarr store).

    A directory hashes the sorted lines ``relpath\\0sha256(file)\\n`` of every
    regular file below it, so any changed, added or removed file changes it.
    """
    path = Path(path)
    if not path.is_dir():
        return file_sha256(path)
    leaves = {}
    for root, dirs, files in os.walk(path):
        dirs.sort()
        for name in sorted(files):
            full = Path(root) / name
            leaves[full.relative_to(path).as_posix()] = file_sha256(full)
    return tree_digest(leaves)


def tree_digest(file_digests: dict[str, str]) -> str:
    """The directory digest of :func:`path_sha256`, from the per-file sha256
    (relpath -> hex) instead of the files (a sealed Zarr store's chunk index)."""
    h = hashlib.sha256()
    for rel in sorted(file_digests):
        h.update(f"{rel}\0{file_digests[rel]}\n".encode())
    return h.hexdigest()


def settled(mtime_ns: int) -> bool:
    """Whether a file last modified at `mtime_ns` may be cached by its stat
    (see _RACY_NS): every cache keyed by :func:`file_key` asks this."""
    return time.time_ns() - mtime_ns > _RACY_NS


def file_key(path: Path, st: os.stat_result) -> tuple:
    """What identifies a file's contents for a cache: (resolved path, size,
    mtime, inode): a rewritten file has another."""
    return (str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ino)


def cached_sha256(path) -> str:
    """sha256 of a file or directory tree, cached by (path, size, mtime, inode) so
    one process never hashes an unchanged file twice."""
    path = Path(path)
    st = path.stat()
    if path.is_dir():
        # a tree: key on every file's stat (cheap) so any rewrite is seen
        stats = []
        for root, _dirs, files in os.walk(path):
            for name in files:
                s = os.stat(os.path.join(root, name))
                stats.append((root, name, s.st_size, s.st_mtime_ns, s.st_ino))
        probe = tuple(sorted(stats))
        key = (str(path.resolve()), probe)
        newest = max((k[3] for k in probe), default=0)
    else:
        key = file_key(path, st)
        newest = st.st_mtime_ns
    with _LOCK:
        digest = _HASH_CACHE.get(key) or _PREHASHED.pop(key, None)
        pending = _PENDING.get(key)
    if digest is None and pending is not None:
        pending.done.wait()
        with _LOCK:
            _PREHASHED.pop(key, None)
        digest = pending.digest
    if digest is None:
        digest = path_sha256(path)
        if settled(newest):
            _HASH_CACHE[key] = digest
    return digest


def _hash_pending(jobs: list[tuple[Path, tuple, _Pending]]) -> None:
    for path, key, pending in jobs:
        try:
            digest = file_sha256(path)
            if file_key(path, path.stat()) == key:  # unchanged while it was read
                pending.digest = digest
                with _LOCK:
                    (_HASH_CACHE if settled(key[2]) else _PREHASHED)[key] = digest
        except OSError:
            pass  # the command's own check reports the file
        finally:
            with _LOCK:
                _PENDING.pop(key, None)
            pending.done.set()


def prehash(paths) -> None:
    """Hash these regular files on a daemon thread, in order (nothing else:
    directories, missing files and anything not a regular file are left to
    the command's own checks)."""
    jobs = []
    with _LOCK:
        for path in map(Path, paths):
            try:
                st = path.stat()
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            key = file_key(path, st)
            if key in _HASH_CACHE or key in _PENDING or key in _PREHASHED:
                continue
            pending = _Pending()
            _PENDING[key] = pending
            jobs.append((path, key, pending))
    if jobs:
        threading.Thread(target=_hash_pending, args=(jobs,), name="prehash", daemon=True).start()


def first_shard_files(run_dir, shards: int = 1) -> list[Path]:
    """The files of the first `shards` shards in RUN_DIR/manifest.json (in
    shard order) that resolve inside the run (none when the manifest cannot
    be read: the command reports it)."""
    return [path for files in _first_shards(run_dir, shards) for path in files]


def _first_shards(run_dir, shards: int) -> list[list[Path]]:
    run_dir = Path(run_dir)
    try:
        listed = json.loads((run_dir / "manifest.json").read_text()).get("shards") or []
        names = [sorted(shard.get("files") or {}) for shard in listed[: max(0, shards)]]
    except (OSError, ValueError, AttributeError, IndexError, TypeError):
        return []
    found = []
    for files in names:
        paths = []
        for rel in files:
            try:
                paths.append(inside_run(run_dir, rel).resolve())
            except (ValueError, OSError):  # refused: the command's own check reports it
                continue
        found.append(paths)
    return found


def prehash_first_shards(run_dirs, shards: int | None = None) -> None:
    """Begin hashing the runs' first `shards` shards in the map's order (default:
    one a core, the shards the map starts with): see the module's docstring.
    While numpy and pyarrow import, one core hashes ~0.2 GB here, more than
    one shard of a large run; hashes not finished then go on beside the map
    (each file is hashed once either way)."""
    left = shards if shards is not None else (os.cpu_count() or 1)
    paths = []
    for run_dir in run_dirs:
        first = _first_shards(run_dir, left)
        left -= len(first)
        paths += [path for files in first for path in files]
        if left <= 0:
            break
    prehash(paths)
