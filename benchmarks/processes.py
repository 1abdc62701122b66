"""The environment of every whole process a benchmark times.

Processes run with ``PYTHONDONTWRITEBYTECODE=1`` (as in CI and many
containers), so nothing they import is cached for the next one: a module whose
source changed since its bytecode was compiled (an edited checkout, an
editable install) is compiled afresh by every timed process, several ms each
(docs/performance.md, "What is left on the real runs"). An install compiles
bytecode (``make install``); :func:`timed_process_env` brings the project's
own sources to that state first, so a benchmark run by hand
(``python -m benchmarks.bench_aggregate``) times what ``make bench`` does.
"""

from __future__ import annotations

import compileall
import os
from pathlib import Path

_COMPILED: set[Path] = set()


def compile_sources(directories) -> list[Path]:
    """Compile each directory's stale or missing bytecode (``compileall``:
    only what changed; once per process and directory). Returns those whose
    compilation failed (a read-only install: its bytecode is the install's)."""
    failed = []
    for directory in map(Path, directories):
        if directory in _COMPILED:
            continue
        if not compileall.compile_dir(directory, quiet=2):
            failed.append(directory)
        _COMPILED.add(directory)
    return failed


def project_sources() -> list[Path]:
    """The package's and the benchmarks' source directories."""
    import pipeline

    return [Path(pipeline.__file__).resolve().parent, Path(__file__).resolve().parent]


def timed_process_env() -> dict[str, str]:
    """``os.environ`` with ``PYTHONDONTWRITEBYTECODE=1``, the project's
    bytecode compiled first (:func:`compile_sources`)."""
    compile_sources(project_sources())
    return {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
