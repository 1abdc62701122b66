"""The benchmarks still run against the current code (their data generators
write valid runs; their imports exist): tiny sizes, no timing asserted."""

from __future__ import annotations

import json

import pytest

from pipeline.aggregate import aggregate_runs
from pipeline.store.validate import find_problems


def test_generated_runs_are_valid_and_aggregate(tmp_path):
    from benchmarks.bench_aggregate import make_full_run, make_topk_run

    topk = make_topk_run(tmp_path / "topk", 600, 300, 64, shard_rows=200)
    full = make_full_run(tmp_path / "full", 64, 300)
    for run in (topk, full):
        assert find_problems(run, first_only=False, tables=False) == [], run
        tables = aggregate_runs([run])
        assert tables.positions == json.loads((run / "manifest.json").read_text())["positions"]


@pytest.mark.slow
def test_bench_extract_runs(tmp_path):
    pytest.importorskip("torch")
    from benchmarks.bench_extract import main

    result = main(
        ["--out", str(tmp_path), "--vocab", "1000", "--hidden", "32", "--layers", "1",
         "--docs", "4", "--words", "30", "--max-length", "32", "--threads", "1"]
    )  # fmt: skip
    assert result["positions"] > 0 and result["kept_entries"] > 0
    assert (tmp_path / "extract.json").exists()
