"""Position-level metrics scan (issue 12): which engine reads the positions fastest.

    python -m benchmarks.bench_metrics --out DIR [--quick]

Writes a synthetic top-k positions Parquet file (N positions, 64 kept entries
each, zstd, 64k-row groups) and computes, over one scan, what `fullece metrics`
needs from it: Σ −ln p(label), Σ_kept p² per row (for the Brier bounds) and the
N top-1 (confidence, correct) pairs. Engines timed on the same file:

* pyarrow ``iter_batches`` + numpy (what :mod:`pipeline.aggregate.positions` uses),
* DuckDB (one SELECT with ``list_sum(list_transform(...))``, fetched as numpy),
* Polars (``scan_parquet`` with ``list.eval``), collected.

Prints a table and writes DIR/metrics.json. Also times relplot.smECE and
adaptive ECE on the N pairs.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


def write_positions(path: Path, n: int, kept: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    writer = None
    chunk = 100_000
    for start in range(0, n, chunk):
        r = min(chunk, n - start)
        probs = rng.dirichlet(np.ones(kept) * 0.3, size=r).astype(np.float32) * np.float32(0.9)
        offsets = np.arange(0, (r + 1) * kept, kept, dtype=np.int32)
        label = rng.integers(0, 50_000, r).astype(np.int32)
        top1 = probs.max(axis=1)
        table = pa.table(
            {
                "label": label,
                "label_prob": probs[:, 0],
                "top1_id": np.where(rng.random(r) < 0.4, label, label + 1).astype(np.int32),
                "top1_prob": top1,
                "entropy": rng.random(r).astype(np.float32),
                "kept_probs": pa.ListArray.from_arrays(pa.array(offsets), pa.array(probs.ravel())),
                "tail_count": np.full(r, 50_000 - kept, np.int32),
                "tail_mass": np.full(r, 0.1),
                "tail_max": np.full(r, 1e-4, np.float32),
            }
        )
        if writer is None:
            writer = pq.ParquetWriter(str(path), table.schema, compression="zstd")
        writer.write_table(table, row_group_size=65536)
    writer.close()


def run_pyarrow(path: Path) -> dict:
    from pipeline.aggregate.positions import PositionScan

    scan = PositionScan()
    for batch in pq.ParquetFile(str(path)).iter_batches(batch_size=65536):
        scan.update(batch)
    return {"nll_sum": scan.nll, "n": scan.n}


def run_duckdb(path: Path) -> dict:
    import duckdb

    con = duckdb.connect()
    res = con.execute(
        f"""SELECT -ln(label_prob::DOUBLE) AS nll,
                   list_sum(list_transform(kept_probs, lambda x: x::DOUBLE * x)) AS kept_sq,
                   top1_prob, top1_id = label AS correct, tail_count, tail_mass, tail_max
            FROM read_parquet('{path}')"""
    ).fetchnumpy()
    con.close()
    return {"nll_sum": float(res["nll"].sum()), "n": int(res["nll"].size)}


def run_polars(path: Path) -> dict:
    import polars as pl

    df = (
        pl.scan_parquet(str(path))
        .select(
            (-pl.col("label_prob").cast(pl.Float64).log()).alias("nll"),
            pl.col("kept_probs")
            .list.eval(pl.element().cast(pl.Float64) ** 2)
            .list.sum()
            .alias("kept_sq"),
            pl.col("top1_prob"),
            (pl.col("top1_id") == pl.col("label")).alias("correct"),
            pl.col("tail_count"),
            pl.col("tail_mass"),
            pl.col("tail_max"),
        )
        .collect()
    )
    return {"nll_sum": float(df["nll"].sum()), "n": df.height}


def best_of(fn, *args, repeat: int = 3):
    times, out = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn(*args)
        times.append(time.perf_counter() - t0)
    return min(times), out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    n = 200_000 if args.quick else 2_000_000
    kept = 64
    path = args.out / "bench_positions.parquet"
    write_positions(path, n, kept)
    results = {"positions": n, "kept": kept, "file_bytes": path.stat().st_size, "engines": {}}
    ref = None
    for name, fn in (
        ("pyarrow+numpy", run_pyarrow),
        ("duckdb", run_duckdb),
        ("polars", run_polars),
    ):
        seconds, out = best_of(fn, path)
        ref = ref or out["nll_sum"]
        assert abs(out["nll_sum"] - ref) <= 1e-9 * abs(ref), (name, out, ref)
        results["engines"][name] = {"seconds": seconds, "positions_per_s": n / seconds}
    from pipeline.core.metrics import adaptive_ece_formula, smooth_ece_formula

    rng = np.random.default_rng(1)
    conf = rng.random(n).astype(np.float32)
    hit = rng.random(n) < conf
    results["adaptive_ece_s"], _ = best_of(adaptive_ece_formula, conf, hit, 10, repeat=1)
    results["smooth_ece_s"], _ = best_of(smooth_ece_formula, conf, hit, repeat=1)
    path.unlink()
    print(f"positions scan, N = {n:,}, {kept} kept entries each")
    for name, r in results["engines"].items():
        print(f"  {name:<14} {r['seconds']:8.3f} s   {r['positions_per_s'] / 1e6:6.2f} M pos/s")
    print(f"  adaptive ECE on N pairs: {results['adaptive_ece_s']:.3f} s")
    print(f"  relplot.smECE on N pairs: {results['smooth_ece_s']:.3f} s")
    (args.out / "metrics.json").write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
