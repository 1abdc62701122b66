"""The one rule for a path a run's manifest names: relative, and inside the
run (no ``..``, no symbolic link pointing out): a run is only ever its own
files. Standard library only, so that the prehash (``pipeline.store.hashes``)
applies it before numpy and pyarrow are imported."""

from __future__ import annotations

from pathlib import Path


def inside_run(run_dir, rel, error: type[Exception] = ValueError) -> Path:
    """RUN_DIR/rel, or `error` naming the manifest and the path when it would
    leave the run directory (absolute, ``..`` or a symbolic link pointing out)."""
    where = Path(run_dir) / "manifest.json"
    if not isinstance(rel, str) or not rel:
        raise error(f"{where}: shard path {rel!r} is not a relative path")
    pure = Path(rel)
    if pure.is_absolute() or ".." in pure.parts or rel.startswith(("/", "\\")):
        raise error(
            f"{where}: shard path {rel!r} points outside the run directory "
            "(only relative paths inside the run are accepted)"
        )
    full = Path(run_dir) / pure
    try:
        real = full.resolve()
        root = Path(run_dir).resolve()
    except OSError as err:
        raise error(f"{full}: cannot resolve ({err})") from err
    if real != root and root not in real.parents:
        raise error(f"{where}: shard path {rel!r} resolves to {real}, outside the run directory")
    return full
