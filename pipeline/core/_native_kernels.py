"""The kernels of ``_floors_kernel`` and ``_group_kernel`` with the same
signatures, run by the C module ``pipeline.core._native`` (see
``pipeline.core.native``): the same loops and sums, no numba to import."""

from __future__ import annotations

import numpy as np

from pipeline.core import _native


def bin_mass_sq_rows(offsets, probs, bin1, fine_bins, threshold, grids, source, out):
    """_floors_kernel.bin_mass_sq_rows (out: a C-contiguous float64 array)."""
    _native.bin_mass_sq_rows(
        np.ascontiguousarray(offsets, np.int64),
        np.ascontiguousarray(probs, np.float32),
        np.ascontiguousarray(bin1, np.float64),
        int(fine_bins),
        float(threshold),
        np.ascontiguousarray(grids, np.int64),
        np.ascontiguousarray(source, np.int64),
        out,
    )


def _segment_sums(values, order, starts, dtype):
    out = np.empty(np.size(starts), dtype)
    _native.segment_sums(
        values, np.ascontiguousarray(order, np.int64), np.ascontiguousarray(starts, np.int64), out
    )
    return out


def segment_sums_int(values, order, starts):
    return _segment_sums(np.ascontiguousarray(values, np.int64), order, starts, np.int64)


def segment_sums_float(values, order, starts):
    v = np.ascontiguousarray(values)
    if v.dtype not in (np.float32, np.float64):
        v = v.astype(np.float64)
    return _segment_sums(v, order, starts, np.float64)


def merge_sorted_runs(ids, bins, run_starts, stride, ints, floats):
    """_group_kernel.merge_sorted_runs: (rows out or -1, ids, bins, int sums,
    float sums), the arrays sized for every input row."""
    run_starts = np.ascontiguousarray(run_starts, np.int64)
    total = int(run_starts[-1])
    ints = tuple(np.ascontiguousarray(c, np.int64) for c in ints)
    floats = tuple(np.ascontiguousarray(c, np.float64) for c in floats)
    out_ids, out_bins = np.empty(total, np.int64), np.empty(total, np.int32)
    out_ints = np.empty((len(ints), total), np.int64)
    out_floats = np.empty((len(floats), total), np.float64)
    rows = _native.merge_sorted_runs(
        np.ascontiguousarray(ids, np.int64), np.ascontiguousarray(bins, np.int32), run_starts,
        int(stride), ints, floats, out_ids, out_bins, out_ints, out_floats,
    )  # fmt: skip
    return rows, out_ids, out_bins, out_ints, out_floats
