"""`fullece validate`: checksums, schemas and row counts of a run directory."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from pipeline.aggregate.validate import find_problems, schema_errors
from pipeline.cli import main
from pipeline.store.schema import SchemaVersionError
from tests.helpers.analysis_runs import dense_case, write_run


@pytest.fixture(scope="module", params=["synthetic", "extracted"])
def runs(request, tmp_path_factory):
    """Runs of both stores: written from the documented formats (no torch needed),
    and written by the extraction stage (needs torch + transformers)."""
    base = tmp_path_factory.mktemp(f"validate-{request.param}")
    out = {store: base / store for store in ("topk", "full")}
    if request.param == "synthetic":
        case = dense_case(400, 30, seed=5, docs=20)
        for store, run_dir in out.items():
            write_run(run_dir, case, store=store, k=4, tau=1e-3, shard_rows=100)
        return out
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from pipeline.extract import run_extraction
    from tests.helpers.extract_models import synthetic_texts, write_corpus

    model = request.getfixturevalue("tiny_gpt2")
    corpus = write_corpus(base / "c.txt", synthetic_texts(30, seed=5, max_words=20))
    for store, run_dir in out.items():
        run_extraction(
            model,
            corpus,
            run_dir,
            store=store,
            shard_positions=100,
            progress=False,
            device="cpu",
        )
    return out


@pytest.fixture
def run_copy(runs, tmp_path):
    def copy(store="topk"):
        dst = tmp_path / store
        shutil.copytree(runs[store], dst)
        return dst

    return copy


def _flip_byte(path: Path, where: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    i = int(len(data) * where)
    data[i] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("store", ["topk", "full"])
def test_valid_run(runs, store):
    assert find_problems(runs[store]) == []
    res = CliRunner().invoke(main, ["validate", str(runs[store])])
    assert res.exit_code == 0 and "valid" in res.output


def test_flipped_byte_names_the_shard(run_copy):
    run = run_copy()
    _flip_byte(run / "shards" / "positions-00001.parquet")
    problems = find_problems(run)
    assert len(problems) == 1 and "shards/positions-00001.parquet" in problems[0]
    assert "checksum" in problems[0]
    res = CliRunner().invoke(main, ["validate", str(run)])
    assert res.exit_code == 1 and "shards/positions-00001.parquet" in res.output


def test_flipped_byte_in_zarr_chunk(run_copy):
    run = run_copy("full")
    chunk = next(
        p
        for p in sorted((run / "shards" / "logits-00002.zarr" / "logits").rglob("*"))
        if p.is_file() and p.name != "zarr.json"
    )
    _flip_byte(chunk)
    problems = find_problems(run)
    assert problems and "shards/logits-00002.zarr" in problems[0]


def test_missing_and_extra_problems(run_copy):
    run = run_copy()
    (run / "shards" / "class_tail-00000.parquet").unlink()
    assert "class_tail-00000.parquet: shard file missing" in find_problems(run)[0]


def test_unknown_manifest_version(run_copy):
    run = run_copy()
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["schema_version"] = 99
    (run / "manifest.json").write_text(json.dumps(manifest))
    problems = find_problems(run)
    assert "schema version 99 is not supported" in problems[0]


def test_manifest_schema_violation(run_copy):
    run = run_copy()
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["settings"]["k"] = -1
    del manifest["complete"]
    (run / "manifest.json").write_text(json.dumps(manifest))
    problems = find_problems(run, first_only=False)
    assert any("settings.k" in p for p in problems)
    assert any("'complete' is missing" in p for p in problems)


def test_row_count_mismatch(run_copy):
    run = run_copy()
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["shards"][0]["rows"] += 1
    (run / "manifest.json").write_text(json.dumps(manifest))
    assert "rows, the manifest says" in find_problems(run)[0]


def test_readers_refuse_unknown_table_version(run_copy):
    from pipeline.store.manifest import load_manifest
    from tests.helpers.shard_readers import read_positions

    run = run_copy()
    manifest = load_manifest(run)
    path = run / manifest["shards"][0]["positions"]
    table = pq.read_table(path)
    meta = dict(table.schema.metadata)
    meta[b"fullece.schema_version"] = b"7"
    pq.write_table(table.replace_schema_metadata(meta), path)
    with pytest.raises(SchemaVersionError, match="schema version 7 is not supported"):
        read_positions(run, manifest["shards"][0])


def test_schema_subset_validator():
    schema = {
        "type": "object",
        "required": ["a"],
        "properties": {
            "a": {"type": "integer", "minimum": 0},
            "b": {"type": ["string", "null"]},
            "c": {"type": "array", "items": {"enum": [1, 2]}},
        },
    }
    assert schema_errors({"a": 1, "b": None, "c": [1, 2]}, schema) == []
    errs = schema_errors({"a": -1, "b": 3, "c": [3]}, schema)
    assert len(errs) == 3
    assert schema_errors({"a": True}, schema)  # a bool is not an integer
    assert schema_errors([], schema) == ["$: expected object, got list"]
