"""Position-level figures of a run (nll, perplexity, brier, entropy, smooth ECE
and the top-1 pairs adaptive ECE needs), in one streaming scan of its
positions shards.

Each Parquet row group is read once (pyarrow, vectorised per batch, no loop
over positions); sums are float64. Memory is bounded by one batch plus the N
top-1 confidences and correctness flags that adaptive and smooth ECE need
(O(N): 9 bytes a position).

Exactness: ``nll`` and the top-1 figures come from stored per-position
columns and are always exact. ``brier`` needs Σ_k p_k²: exact from the
``sum_p2`` column (positions schema v2) or, in the full store, from the
logits (one streaming dense pass); otherwise the kept entries give their part
exactly and the tail (count, mass, max) bounds the rest, so ``brier`` is null
and ``brier_bounds`` holds the interval. ``entropy`` likewise: exact when the
column is filled for every position (or from the full store's logits), else
``entropy_bounds`` from the kept entries and the tail.
"""

from __future__ import annotations

import math

import numpy as np

from pipeline.core.metrics import (
    _neg_xlogx,
    adaptive_ece_formula,
    smooth_ece_formula,
    tail_entropy_bounds,
    tail_sum_sq_bounds,
)

BATCH_ROWS = 65536
_COLUMNS = (
    "label",
    "label_prob",
    "top1_id",
    "top1_prob",
    "entropy",
    "kept_probs",
    "tail_count",
    "tail_mass",
    "tail_max",
)


class PositionScan:
    """Streaming sums over positions; feed Arrow batches, then `result()`."""

    def __init__(self):
        self.n = 0
        self.nll = 0.0
        self.brier = [0.0, 0.0]
        self.entropy = [0.0, 0.0]
        self.brier_exact = True
        self.entropy_exact = True
        self.conf: list[np.ndarray] = []
        self.correct: list[np.ndarray] = []

    def update(self, batch, dense: dict | None = None) -> None:
        """`batch`: a positions RecordBatch/Table; `dense`: optional exact
        per-row ``sum_p2`` and ``entropy`` (float64) from the full store."""
        names = batch.schema.names
        col = {name: batch.column(names.index(name)) for name in names}
        n = batch.num_rows
        if n == 0:
            return
        label = col["label"].to_numpy()
        label_p = col["label_prob"].to_numpy().astype(np.float64)
        top1_p = col["top1_prob"].to_numpy()
        self.nll += float(-np.log(label_p).sum())
        self.conf.append(np.asarray(top1_p, np.float32))
        self.correct.append(col["top1_id"].to_numpy() == label)

        kept = None
        if dense is not None:
            sum_p2 = np.asarray(dense["sum_p2"], np.float64)
            sq_lo = sq_hi = sum_p2
        elif "sum_p2" in col and col["sum_p2"].null_count == 0:
            sum_p2 = col["sum_p2"].to_numpy().astype(np.float64)
            sq_lo = sq_hi = sum_p2
        else:
            kept = _kept_sums(col["kept_probs"], n)
            tail = _tail(col)
            t_lo, t_hi = tail_sum_sq_bounds(*tail)
            sq_lo, sq_hi = kept["sum_p2"] + t_lo, kept["sum_p2"] + t_hi
            self.brier_exact = self.brier_exact and bool(np.all(t_lo == t_hi))
        self.brier[0] += float((sq_lo - 2.0 * label_p + 1.0).sum())
        self.brier[1] += float((sq_hi - 2.0 * label_p + 1.0).sum())

        if dense is not None:
            h = np.asarray(dense["entropy"], np.float64)
            self.entropy[0] += float(h.sum())
            self.entropy[1] += float(h.sum())
        else:
            ent = col["entropy"]
            h = ent.to_numpy(zero_copy_only=False).astype(np.float64)
            # null or NaN (imported dumps store NaN): not determined by the run
            known = np.isfinite(h)
            stored = None if bool(known.all()) else known
            if stored is None:
                self.entropy[0] += float(h.sum())
                self.entropy[1] += float(h.sum())
            else:
                if kept is None:
                    kept = _kept_sums(col["kept_probs"], n)
                e_lo, e_hi = tail_entropy_bounds(*_tail(col))
                lo = np.where(stored, h, kept["entropy"] + e_lo)
                hi = np.where(stored, h, kept["entropy"] + e_hi)
                self.entropy[0] += float(lo.sum())
                self.entropy[1] += float(hi.sum())
                self.entropy_exact = self.entropy_exact and bool(np.all(lo == hi))
        self.n += n

    def top1_pairs(self) -> tuple[np.ndarray, np.ndarray]:
        conf = np.concatenate(self.conf) if self.conf else np.zeros(0, np.float32)
        hit = np.concatenate(self.correct) if self.correct else np.zeros(0, bool)
        return conf, hit

    def result(self) -> dict:
        n = self.n
        if n == 0:
            raise ValueError("no positions to score")
        nll = self.nll / n
        brier = [self.brier[0] / n, self.brier[1] / n]
        entropy = [self.entropy[0] / n, self.entropy[1] / n]
        conf, hit = self.top1_pairs()
        return {
            "nll": nll,
            "perplexity": math.exp(nll) if nll < 709 else math.inf,
            "brier": brier[0] if self.brier_exact else None,
            "brier_bounds": brier,
            "entropy": entropy[0] if self.entropy_exact else None,
            "entropy_bounds": entropy,
            "smooth_ece": smooth_ece_formula(conf, hit),
        }

    def adaptive_ece(self, n_bins: int) -> float:
        conf, hit = self.top1_pairs()
        return adaptive_ece_formula(conf, hit, n_bins)


def _kept_sums(kept_probs, n: int) -> dict:
    """Per row: Σ p² and −Σ p ln p over the kept entries (float64)."""
    arr = kept_probs.combine_chunks() if hasattr(kept_probs, "combine_chunks") else kept_probs
    offsets = arr.offsets.to_numpy()
    values = arr.values.to_numpy().astype(np.float64)[offsets[0] : offsets[-1]]
    rows = np.repeat(np.arange(n), np.diff(offsets))
    return {
        "sum_p2": np.bincount(rows, weights=values * values, minlength=n),
        "entropy": np.bincount(rows, weights=_neg_xlogx(values), minlength=n),
    }


def _tail(col):
    return (
        col["tail_count"].to_numpy(),
        col["tail_mass"].to_numpy(),
        col["tail_max"].to_numpy(),
    )


def _dense_rows_of_shard(shard):
    """(sum_p2, entropy) per row of a full-store shard, from its logits."""
    from pipeline.core.probability import probs_of_record
    from pipeline.store.run import iter_logit_blocks

    sq, ent = [], []
    for _, block, lse in iter_logit_blocks(shard):
        p = probs_of_record(block, lse).astype(np.float64)
        sq.append(np.einsum("ij,ij->i", p, p))
        ent.append(_neg_xlogx(p).sum(axis=1))
    return np.concatenate(sq), np.concatenate(ent)


def scan_run(run_dir, *, progress: bool = False) -> PositionScan:
    """One scan over every positions shard of a run (and, in the full store,
    one streaming pass over its logits for Σ p² and the entropy), every byte
    read through the store's verified readers (checksums, value ranges)."""
    from pipeline.store.run import iter_positions, open_positions, open_verified_run

    run = open_verified_run(run_dir)
    scan = PositionScan()
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=sum(s.rows for s in run.shards), unit="pos", desc="positions")
    for shard in run.shards:
        if shard.rows == 0:
            continue
        names = open_positions(shard)[1].schema_arrow.names
        cols = list(_COLUMNS) + (["sum_p2"] if "sum_p2" in names else [])
        dense = _dense_rows_of_shard(shard) if run.store == "full" else None
        start = 0
        for batch in iter_positions(shard, cols, BATCH_ROWS):
            stop = start + batch.num_rows
            part = (
                None
                if dense is None
                else {"sum_p2": dense[0][start:stop], "entropy": dense[1][start:stop]}
            )
            scan.update(batch, part)
            start = stop
            if bar is not None:
                bar.update(batch.num_rows)
    if bar is not None:
        bar.close()
    return scan
