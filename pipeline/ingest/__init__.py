"""Import logit dumps made elsewhere as ordinary top-k runs (``fullece import``).

* ``import_vllm(files, out, vocab_size=K)``: vLLM ``prompt_logprobs`` dumps
  (offline JSON Lines or saved server responses), see ``pipeline.ingest.vllm``;
* ``import_topk(files, out, vocab_size=K)``: the generic top-k Parquet layout,
  see ``pipeline.ingest.topk``.

The result is a run directory like ``fullece extract --store topk`` writes
(same positions schema), with ``source.kind`` in its manifest and a per-class
tail capacity in its class_tail shards, since a dump holds no per-class tail.
Exactness (docs/import.md): ECE and Full-ECE are exact for M <= M_exact;
cw-ECE is reported as an interval. No torch here.
"""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.ingest.convert import DEFAULT_SUM_TOLERANCE, EntryBatch, IngestError
from pipeline.ingest.writer import (
    DEFAULT_SHARD_POSITIONS,
    ImportWriter,
    already_imported,
    source_files,
)

__all__ = [
    "DEFAULT_SUM_TOLERANCE",
    "EntryBatch",
    "IngestError",
    "import_topk",
    "import_vllm",
    "vocab_size_from_model",
]


def vocab_size_from_model(model_dir) -> tuple[int, dict]:
    """K from a model directory's config.json (no weights loaded), and the
    manifest's ``model`` record ({path, files: {config.json: sha256}})."""
    from pipeline.store.manifest import file_sha256

    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise IngestError(f"{path}: no config.json (give --vocab-size K instead)")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise IngestError(f"{path}: not valid JSON ({err})") from err
    k = config.get("vocab_size")
    if k is None and isinstance(config.get("text_config"), dict):
        k = config["text_config"].get("vocab_size")
    if not isinstance(k, int) or k < 1:
        raise IngestError(f"{path}: no positive integer vocab_size (give --vocab-size K)")
    model = {"path": str(model_dir), "files": {"config.json": file_sha256(path)}}
    if config.get("architectures"):
        model["architecture"] = str(config["architectures"][0])
    return k, model


def _run_import(
    kind, reader, files, out, vocab_size, label, model, sum_tolerance, shard_positions, progress
):
    from pipeline.progress import progress_bar

    out = Path(out)
    if vocab_size is None or int(vocab_size) < 1:
        raise IngestError("the vocabulary size K must be a positive integer")
    if not files:
        raise IngestError("no input files")
    sources = source_files(files)
    if already_imported(out, kind, sources, int(vocab_size)):
        from pipeline.store.manifest import load_manifest

        return out, load_manifest(out), False
    stats: dict = {}
    source = {"kind": kind, "files": sources}
    with (
        ImportWriter(
            out,
            vocab_size=vocab_size,
            source=source,
            label=label,
            model=model,
            sum_tolerance=sum_tolerance,
            shard_positions=shard_positions,
        ) as writer,
        progress_bar(f"import {kind}", enabled=progress, leave=False) as bar,
    ):
        # batches no larger than a shard, so shards close near shard_positions
        batch_positions = max(1, min(shard_positions, 16384))
        for batch in reader([Path(f) for f in files], stats, batch_positions):
            bar.update(writer.add(batch))
        source.update(stats)
    from pipeline.store.manifest import load_manifest

    return out, load_manifest(out), True


def import_vllm(
    files,
    out,
    *,
    vocab_size: int,
    label: str | None = None,
    model: dict | None = None,
    sum_tolerance: float = DEFAULT_SUM_TOLERANCE,
    shard_positions: int = DEFAULT_SHARD_POSITIONS,
    progress: bool = False,
):
    """Import vLLM prompt-logprob dumps into run directory `out`.

    Returns (out, manifest, written): written is False when `out` already held
    this exact import. Raises IngestError naming file, line and position.
    """
    from pipeline.ingest.vllm import read_vllm

    return _run_import(
        "vllm",
        read_vllm,
        files,
        out,
        vocab_size,
        label,
        model,
        sum_tolerance,
        shard_positions,
        progress,
    )


def import_topk(
    files,
    out,
    *,
    vocab_size: int,
    label: str | None = None,
    model: dict | None = None,
    sum_tolerance: float = DEFAULT_SUM_TOLERANCE,
    shard_positions: int = DEFAULT_SHARD_POSITIONS,
    progress: bool = False,
):
    """Import top-k Parquet files (docs/import.md) into run directory `out`."""
    from pipeline.ingest.topk import read_topk

    return _run_import(
        "topk",
        read_topk,
        files,
        out,
        vocab_size,
        label,
        model,
        sum_tolerance,
        shard_positions,
        progress,
    )
