"""Independent references for the extraction tests: literal formulas of docs/design.md.

`dense_metrics` works on a dense [N, K] float32 probability matrix;
`sparse_metrics` on a run directory's kept entries + per-class tail vectors.
Neither uses pipeline.core.binning / accumulator / metrics.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

PAPER_BINS = (5, 10, 20, 50, 100, 200, 500)


def bin_of(p, m: int) -> np.ndarray:
    return np.maximum(np.ceil(np.asarray(p, dtype=np.float64) * m), 1).astype(np.int64)


def _ece(top1_prob, correct, m):
    b = bin_of(top1_prob, m)
    c = np.bincount(b, weights=correct.astype(np.float64), minlength=m + 1)
    s = np.bincount(b, weights=np.asarray(top1_prob, dtype=np.float64), minlength=m + 1)
    return float(np.abs(c - s).sum() / len(top1_prob))


def dense_metrics(probs: np.ndarray, labels: np.ndarray, m: int) -> dict:
    """ECE, cw-ECE, Full-ECE at M from dense float32 probabilities (the literal definitions)."""
    n, k = probs.shape
    rows = np.arange(n)
    top1 = probs.argmax(axis=1)
    ece = _ece(probs[rows, top1], top1 == labels, m)
    bins = bin_of(probs, m)
    p64 = probs.astype(np.float64)
    hits = np.zeros((n, k))
    hits[rows, labels] = 1.0
    key = (np.arange(k)[None, :] * (m + 1) + bins).ravel()
    hs = np.bincount(key, weights=hits.ravel(), minlength=k * (m + 1))
    ps = np.bincount(key, weights=p64.ravel(), minlength=k * (m + 1))
    cw = float(np.abs(hs - ps).sum() / (n * k))
    hb = np.bincount(bins.ravel(), weights=hits.ravel(), minlength=m + 1)
    pb = np.bincount(bins.ravel(), weights=p64.ravel(), minlength=m + 1)
    full = float(np.abs(hb - pb).sum() / n)
    return {"ece": ece, "cw_ece": cw, "full_ece": full}


def read_run(run_dir, manifest) -> dict:
    """Every committed shard's positions (one table) and summed class tails."""
    tables = [pq.read_table(f"{run_dir}/{s['positions']}") for s in manifest["shards"]]
    table = pa.concat_tables(tables).combine_chunks()
    k = manifest["vocab_size"]
    count = np.zeros(k, dtype=np.int64)
    mass = np.zeros(k, dtype=np.float64)
    for s in manifest["shards"]:
        ct = pq.read_table(f"{run_dir}/{s['class_tail']}")
        count[ct.column("class_id").to_numpy()] += ct.column("tail_count").to_numpy()
        mass[ct.column("class_id").to_numpy()] += ct.column("tail_mass").to_numpy()
    ids = table.column("kept_ids").chunk(0)
    probs = table.column("kept_probs").chunk(0)
    return {
        "table": table,
        "kept_ids": ids.values.to_numpy(),
        "kept_probs": probs.values.to_numpy(),
        "offsets": ids.offsets.to_numpy().astype(np.int64),
        "class_tail_count": count,
        "class_tail_mass": mass,
    }


def sparse_metrics(run: dict, vocab_size: int, m: int) -> dict:
    """The same metrics from kept entries + tail (valid when every tail_max <= 1/M)."""
    t = run["table"]
    labels = t.column("label").to_numpy().astype(np.int64)
    n, k = len(labels), vocab_size
    assert np.all(t.column("tail_max").to_numpy().astype(np.float64) * m <= 1.0)
    ece = _ece(t.column("top1_prob").to_numpy(), t.column("top1_id").to_numpy() == labels, m)
    counts = np.diff(run["offsets"])
    rows = np.repeat(np.arange(n), counts)
    ids = run["kept_ids"].astype(np.int64)
    bins = bin_of(run["kept_probs"], m)
    hits = (ids == labels[rows]).astype(np.float64)
    p64 = run["kept_probs"].astype(np.float64)
    key = ids * (m + 1) + bins
    hs = np.bincount(key, weights=hits, minlength=k * (m + 1))
    ps = np.bincount(key, weights=p64, minlength=k * (m + 1))
    ps[np.arange(k) * (m + 1) + 1] += run["class_tail_mass"]
    cw = float(np.abs(hs - ps).sum() / (n * k))
    hb = hs.reshape(k, m + 1).sum(axis=0)
    pb = ps.reshape(k, m + 1).sum(axis=0)
    full = float(np.abs(hb - pb).sum() / n)
    return {"ece": ece, "cw_ece": cw, "full_ece": full}
