"""What temperature scaling would do: NLL, ECE and Full-ECE of softmax(z / T).

At each temperature the probabilities of record are recomputed exactly from
the logits (:func:`pipeline.core.probability.probs_of_record` on ``z / T``,
float32 as everywhere) and binned by the one bin rule. One streaming pass over
the logits serves a whole batch of temperatures, so memory is bounded by one
chunk of rows.

NLL(T) is unimodal in T: with β = 1/T, NLL = mean(lse(β z) − β z_label) is
convex in β. The NLL-minimising temperature is therefore bracketed by the grid
cells around the best grid point (the grid is extended outward when the best
point is at an end) and refined by passes that each evaluate a batch of
log-spaced temperatures inside the bracket, shrinking it until its width is
below the requested relative tolerance.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator

import numpy as np

from pipeline.core.binning import check_n_bins, fine_bin_index
from pipeline.core.probability import probs_of_record

__all__ = ["DEFAULT_GRID", "temperature_grid", "parse_grid", "temperature_scan", "scan_blocks"]

DEFAULT_GRID = (0.25, 4.0, 17)  # 17 log-spaced points: T = 1 is one of them
REFINE_POINTS = 8  # temperatures per refinement pass (bracket shrinks 4.5x per pass)
DEFAULT_CHUNK_ROWS = 1024
MAX_EXTEND = 40  # outward grid steps when the optimum lies beyond the grid


def temperature_grid(lo: float, hi: float, n: int) -> np.ndarray:
    """n log-spaced temperatures from lo to hi (both included)."""
    if not (lo > 0 and hi > 0 and math.isfinite(lo) and math.isfinite(hi)):
        raise ValueError(f"temperatures must be positive and finite, got {lo}:{hi}")
    if n < 2 or hi <= lo:
        raise ValueError(f"the grid needs LO < HI and N >= 2, got {lo}:{hi}:{n}")
    return np.geomspace(lo, hi, int(n))


def parse_grid(text: str) -> tuple[float, float, int]:
    """'LO:HI:N' -> (lo, hi, n), checked."""
    parts = str(text).split(":")
    try:
        if len(parts) != 3:
            raise ValueError
        lo, hi, n = float(parts[0]), float(parts[1]), int(parts[2])
    except ValueError as err:
        raise ValueError(f"{text!r}: expected LO:HI:N, e.g. 0.25:4:17") from err
    temperature_grid(lo, hi, n)
    return lo, hi, n


class _Sums:
    """Per temperature: Σ −ln p(label), top-1 and pooled per-bin sums."""

    def __init__(self, temperatures, n_bins: int):
        self.t = np.asarray(temperatures, np.float64)
        b = self.t.size
        self.m = n_bins
        self.n = 0
        self.nll = np.zeros(b)
        self.conf = np.zeros((b, n_bins))
        self.correct = np.zeros((b, n_bins))
        self.p_sum = np.zeros((b, n_bins))
        self.hits = np.zeros((b, n_bins))

    def update(self, logits, labels) -> None:
        x = np.asarray(logits).astype(np.float32, copy=False)
        y = np.asarray(labels, np.int64)
        rows = np.arange(x.shape[0])
        m = self.m
        for i, t in enumerate(self.t):
            p = probs_of_record(x / np.float32(t))
            label_p = p[rows, y]
            self.nll[i] += -np.log(label_p.astype(np.float64)).sum()
            top1 = p.argmax(axis=1)
            conf = p[rows, top1]
            b1 = fine_bin_index(conf, m) - 1
            self.conf[i] += np.bincount(b1, weights=conf.astype(np.float64), minlength=m)
            self.correct[i] += np.bincount(b1, weights=(top1 == y).astype(np.float64), minlength=m)
            flat = p.reshape(-1)
            self.p_sum[i] += np.bincount(
                fine_bin_index(flat, m) - 1, weights=flat.astype(np.float64), minlength=m
            )
            self.hits[i] += np.bincount(fine_bin_index(label_p, m) - 1, minlength=m)
        self.n += x.shape[0]

    def rows(self) -> list[dict]:
        n = self.n
        out = []
        for i, t in enumerate(self.t):
            out.append(
                {
                    "temperature": float(t),
                    "nll": float(self.nll[i] / n),
                    "ece": float(np.abs(self.correct[i] - self.conf[i]).sum() / n),
                    "full_ece": float(np.abs(self.hits[i] - self.p_sum[i]).sum() / n),
                }
            )
        return out


BlockSource = Callable[[], Iterable[tuple[np.ndarray, np.ndarray]]]


def scan_blocks(blocks: BlockSource, temperatures, n_bins: int = 10) -> list[dict]:
    """One pass over ``blocks()`` (an iterable of (logits [r, K], labels [r]))
    evaluating every temperature given; one row per temperature."""
    n_bins = check_n_bins(n_bins)
    sums = _Sums(temperatures, n_bins)
    for logits, labels in blocks():
        sums.update(logits, labels)
    if sums.n == 0:
        raise ValueError("no positions to scan")
    return sums.rows()


def _array_blocks(logits, labels, chunk_rows: int) -> BlockSource:
    from pipeline.core.checks import InputError

    x = logits.detach().cpu().numpy() if hasattr(logits, "detach") else np.asarray(logits)
    y = labels.detach().cpu().numpy() if hasattr(labels, "detach") else np.asarray(labels)
    if x.ndim != 2:
        raise InputError(f"logits must be 2-D [n, K], got shape {x.shape}")
    y = y.reshape(-1).astype(np.int64)
    if y.shape[0] != x.shape[0]:
        raise InputError(f"{x.shape[0]} rows of logits but {y.shape[0]} labels")
    if y.size and (y.min() < 0 or y.max() >= x.shape[1]):
        raise InputError(f"labels must lie in [0, {x.shape[1]})")

    def blocks() -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for start in range(0, x.shape[0], chunk_rows):
            yield x[start : start + chunk_rows], y[start : start + chunk_rows]

    return blocks


def _refine(blocks: BlockSource, grid_rows: list[dict], n_bins: int, rtol: float, progress):
    """Bracket and refine the NLL minimiser; returns (best row, bracket, passes)."""
    rows = sorted(grid_rows, key=lambda r: r["temperature"])
    evaluated = {r["temperature"]: r for r in rows}
    passes = 0
    ts = [r["temperature"] for r in rows]
    step = math.log(ts[1] / ts[0])
    # Extend outward while the best point is at an end of what has been evaluated.
    for _ in range(MAX_EXTEND):
        i = min(range(len(rows)), key=lambda k: rows[k]["nll"])
        if 0 < i < len(rows) - 1:
            break
        t_new = (
            rows[0]["temperature"] / math.exp(step)
            if i == 0
            else rows[-1]["temperature"] * math.exp(step)
        )
        (new,) = scan_blocks(blocks, [t_new], n_bins)
        passes += 1
        evaluated[new["temperature"]] = new
        rows = sorted(evaluated.values(), key=lambda r: r["temperature"])
        step *= 2.0
    i = min(range(len(rows)), key=lambda k: rows[k]["nll"])
    lo = rows[max(i - 1, 0)]["temperature"]
    hi = rows[min(i + 1, len(rows) - 1)]["temperature"]
    best = rows[i]
    target = math.log1p(rtol)
    while math.log(hi / lo) > target:
        inner = np.exp(np.linspace(math.log(lo), math.log(hi), REFINE_POINTS + 2)[1:-1])
        new_rows = scan_blocks(blocks, inner, n_bins)
        passes += 1
        if progress is not None:
            progress(passes)
        for r in new_rows:
            evaluated[r["temperature"]] = r
        cand = sorted(
            (r for t, r in evaluated.items() if lo <= t <= hi), key=lambda r: r["temperature"]
        )
        k = min(range(len(cand)), key=lambda j: cand[j]["nll"])
        lo = cand[max(k - 1, 0)]["temperature"]
        hi = cand[min(k + 1, len(cand) - 1)]["temperature"]
        best = cand[k]
    return best, [lo, hi], passes


def temperature_scan(
    logits,
    labels,
    temperatures=None,
    *,
    n_bins: int = 10,
    grid: tuple[float, float, int] = DEFAULT_GRID,
    refine: bool = True,
    rtol: float = 1e-3,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    blocks: BlockSource | None = None,
    progress=None,
) -> dict:
    """NLL, ECE and Full-ECE (M = n_bins) of softmax(logits / T) for each T.

    `logits` [n, K] (numpy or torch) and `labels` [n], or ``blocks``: a
    callable returning a fresh iterable of (logits, labels) chunks (used for
    runs on disk; then `logits` and `labels` are None). `temperatures` default
    to the log-spaced ``grid`` (LO, HI, N). With `refine`, the NLL-minimising
    temperature is located within `rtol` (relative) beyond the grid; the
    result holds it as ``best_nll_temperature`` and the metrics at it as
    ``best``.
    """
    n_bins = check_n_bins(n_bins)
    if blocks is None:
        blocks = _array_blocks(logits, labels, int(chunk_rows))
    temps = (
        temperature_grid(*grid) if temperatures is None else np.asarray(temperatures, np.float64)
    )
    temps = np.unique(temps)
    if temps.size == 0 or not np.all(np.isfinite(temps)) or np.any(temps <= 0):
        raise ValueError("temperatures must be positive and finite")
    rows = scan_blocks(blocks, temps, n_bins)
    out = {"M": n_bins, "grid": rows, "best_nll_temperature": None, "best": None}
    if refine:
        if temps.size < 2:
            raise ValueError("refining the NLL optimum needs at least two temperatures")
        best, bracket, passes = _refine(blocks, rows, n_bins, rtol, progress)
        out.update(
            best_nll_temperature=best["temperature"],
            best=best,
            bracket=bracket,
            rtol=rtol,
            passes=1 + passes,
        )
    return out
