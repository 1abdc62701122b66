"""pipeline.open_tables / open_positions: Polars LazyFrames over a run.

A Polars query over the LazyFrames must give the numbers `fullece metrics`
prints, and a query over the raw shards (kept entries + per-class tail, no
bin tables) must give the dense reference computed from the definitions.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import polars as pl
import pytest
from click.testing import CliRunner

import pipeline
from pipeline.cli.metrics import metrics
from pipeline.store.manifest import RunError
from tests.helpers.analysis_runs import dense_case, dense_reference, write_run

F = 1000


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("frames") / "run"
    case = dense_case(700, 30, seed=5, docs=25)
    write_run(d, case, k=4, tau=1e-3, shard_rows=250)
    res = CliRunner().invoke(metrics, [str(d), "--json", "--quiet", "--bins", "5,10,50"])
    assert res.exit_code == 0, res.output
    return d, case, json.loads(res.stdout)


def coarse(M: int) -> pl.Expr:
    """ceil(bin * M / F) in integers: exact."""
    return ((pl.col("bin") * M + F - 1) // F).alias("m")


def polars_metrics(tables: dict, M: int, n: int, k: int) -> dict:
    cb = tables["class_bins"]
    full = (
        cb.group_by(coarse(M))
        .agg(pl.col("hits").sum(), pl.col("p_sum").sum())
        .select((pl.col("hits") - pl.col("p_sum")).abs().sum())
        .collect()
        .item()
    ) / n
    cw = (
        cb.group_by("class_id", coarse(M))
        .agg(pl.col("hits").sum(), pl.col("p_sum").sum())
        .select((pl.col("hits") - pl.col("p_sum")).abs().sum())
        .collect()
        .item()
    ) / (n * k)
    ece = (
        tables["top1_bins"]
        .group_by(coarse(M))
        .agg(pl.col("correct").sum(), pl.col("conf_sum").sum())
        .select((pl.col("correct") - pl.col("conf_sum")).abs().sum())
        .collect()
        .item()
    ) / n
    return {"ece": ece, "cw_ece": cw, "full_ece": full}


def test_tables_give_the_metrics_of_fullece_metrics(run):
    run_dir, case, met = run
    tables = pipeline.open_tables(run_dir)
    assert set(tables) == {"class_bins", "top1_bins", "tokens", "seq_bins"}
    assert all(isinstance(f, pl.LazyFrame) for f in tables.values())
    n = tables["top1_bins"].select(pl.col("n").sum()).collect().item()
    assert n == case.n == met["positions"]
    compared = 0
    for row in met["bins"]:
        got = polars_metrics(tables, row["M"], n, case.vocab_size)
        for key in ("ece", "cw_ece", "full_ece"):
            assert got[key] == pytest.approx(row[key], rel=1e-12, abs=1e-15)
        compared += 1
    assert compared == 3


def test_positions_give_the_dense_reference(run):
    """Full-ECE at M = 10 from the shards alone (kept entries + per-class tail,
    tail pairs in bin 1), against the dense matrix."""
    run_dir, case, _ = run
    M = 10
    pos = pipeline.open_positions(run_dir)
    kept = (
        pos.select("label", "kept_ids", "kept_probs")
        .explode("kept_ids", "kept_probs")
        .with_columns(
            # the bin rule in float64: float32 * M is exact there
            pl.max_horizontal(
                (pl.col("kept_probs").cast(pl.Float64) * M).ceil(), pl.lit(1.0)
            ).alias("m"),
            (pl.col("kept_ids") == pl.col("label")).cast(pl.Int64).alias("hit"),
            pl.col("kept_probs").cast(pl.Float64).alias("p"),
        )
        .group_by("m")
        .agg(pl.col("hit").sum(), pl.col("p").sum())
        .collect()
    )
    tail = pos.select(pl.col("tail_mass").sum()).collect().item()
    per_bin = {int(m): [h, p] for m, h, p in kept.select("m", "hit", "p").iter_rows()}
    per_bin.setdefault(1, [0, 0.0])[1] += tail
    n = pos.select(pl.len()).collect().item()
    full = sum(abs(h - p) for h, p in per_bin.values()) / n
    ref = dense_reference(case.probs, case.labels, M)["full_ece"]
    assert full == pytest.approx(ref, rel=1e-9)


def test_float32_columns_need_a_cast(run):
    """Summed as float64 after a cast, label_prob matches numpy's float64 sum."""
    run_dir, case, _ = run
    pos = pipeline.open_positions(run_dir)
    got = pos.select(pl.col("label_prob").cast(pl.Float64).sum()).collect().item()
    want = case.probs[np.arange(case.n), case.labels].astype(np.float64).sum()
    assert got == pytest.approx(want, rel=1e-12)
    assert pos.select(pl.len()).collect().item() == case.n


def test_missing_tables_name_the_directory(tmp_path):
    case = dense_case(50, 8, seed=1, docs=3)
    write_run(tmp_path / "r", case, k=3)
    with pytest.raises(RunError, match="fullece aggregate"):
        pipeline.open_tables(tmp_path / "r")
    with pytest.raises(RunError, match="not a fullece run"):
        pipeline.open_positions(tmp_path / "nothing")


def test_import_pipeline_does_not_import_polars():
    code = "import sys, pipeline; assert 'polars' not in sys.modules; print(pipeline.open_tables)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "open_tables" in out.stdout
