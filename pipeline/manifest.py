"""manifest.json of a run directory: identity, settings, shards, exactness.

Fields (schema version 1; JSON Schema in schemas/manifest.v1.schema.json)::

    schema_version  int, 1
    tool            {"name": "fullece", "version": str}
    created         ISO-8601 UTC timestamp
    label           str, names the run in `compare` (default: the model dir name)
    model           {"path", "architecture", "dtype", "files": {name: sha256}}
    tokenizer       {"path", "files": {name: sha256}}
    corpus          {"path", "format", "text_field", "sha256", "documents", ...}
    settings        {"store", "k", "tau", "max_length", "stride", "batch_size",
                     "device", "dtype", "shard_positions", "slice": [i, n]}
    store           "topk" | "full"
    vocab_size      int, K = the model's output width
    shards          [{"index", "rows", "tail_max", "files": {relpath: sha256},
                      "positions": relpath, "class_tail": relpath | null,
                      "logits": relpath | null}]
    positions       int, total committed rows
    skipped_documents int, documents shorter than 2 tokens
    tail_max        float, max over positions of tail_max (0 when no tail)
    m_exact         int | null: largest M with every tail probability in bin 1
                    (null: no tail at all, every M is exact)
    complete        bool, true once every document of the slice is committed
"""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.schema import check_version

MANIFEST_NAME = "manifest.json"


class RunError(ValueError):
    """A run directory is missing, incomplete or inconsistent."""


def manifest_path(run_dir) -> Path:
    return Path(run_dir) / MANIFEST_NAME


def load_manifest(run_dir) -> dict:
    path = manifest_path(run_dir)
    if not path.exists():
        raise RunError(f"{run_dir}: not a fullece run (no {MANIFEST_NAME})")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise RunError(f"{path}: not valid JSON ({err})") from err
    check_version(manifest.get("schema_version"), str(path))
    for key in ("vocab_size", "store", "shards"):
        if key not in manifest:
            raise RunError(f"{path}: required field {key!r} is missing")
    return manifest
