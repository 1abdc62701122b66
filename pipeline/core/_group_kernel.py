"""The compiled segment sums of ``pipeline.core.tables.group_sum`` (numba).

In a module of their own so that importing the core never imports numba.
"""

from __future__ import annotations

import numpy as np

from pipeline.core._numba import numba


@numba.njit(cache=True, nogil=True)
def segment_sums_int(values, order, starts):
    """out[g] = sum of values[order[t]] for t in starts[g]..starts[g+1]-1
    (the last group runs to the end of `order`), in int64, in that order:
    ``np.add.reduceat(values[order], starts)`` without the gathered copy."""
    out = np.empty(starts.size, np.int64)
    for g in range(starts.size):
        end = starts[g + 1] if g + 1 < starts.size else order.size
        total = np.int64(0)
        for t in range(starts[g], end):
            total += np.int64(values[order[t]])
        out[g] = total
    return out


@numba.njit(cache=True, nogil=True)
def segment_sums_float(values, order, starts):
    """As segment_sums_int, summed in float64."""
    out = np.empty(starts.size, np.float64)
    for g in range(starts.size):
        end = starts[g + 1] if g + 1 < starts.size else order.size
        total = 0.0
        for t in range(starts[g], end):
            total += np.float64(values[order[t]])
        out[g] = total
    return out


@numba.njit(cache=True, nogil=True)
def merge_sorted_runs(ids, bins, run_starts, stride, ints, floats):
    """Sum runs of rows, each in strictly increasing key order (key = id *
    stride + bin), into one table in key order: a k-way merge (a binary heap
    of the runs' next rows; equal keys are taken in run order, so each key's
    rows are summed in input order, as a stable sort would).

    `ints` / `floats`: tuples of value columns (int64 / float64) over all
    rows. Returns (rows out, ids, bins, int sums [len(ints), rows], float
    sums [len(floats), rows]), the arrays sized for every input row, or
    rows out = -1 when a run is not strictly increasing (the caller then
    groups another way).
    """
    k = run_starts.size - 1
    total = run_starts[k]
    out_ids = np.empty(total, np.int64)
    out_bins = np.empty(total, np.int32)
    out_ints = np.empty((len(ints), total), np.int64)
    out_floats = np.empty((len(floats), total), np.float64)
    heap_key = np.empty(k, np.int64)
    heap_run = np.empty(k, np.int64)
    pos = run_starts[:k].copy()
    size = 0
    for r in range(k):  # every run's first row onto the heap (sift up)
        if pos[r] < run_starts[r + 1]:
            key = np.int64(ids[pos[r]]) * stride + bins[pos[r]]
            c = size
            size += 1
            while c > 0:
                parent = (c - 1) >> 1
                if heap_key[parent] < key or (heap_key[parent] == key and heap_run[parent] < r):
                    break
                heap_key[c] = heap_key[parent]
                heap_run[c] = heap_run[parent]
                c = parent
            heap_key[c] = key
            heap_run[c] = r
    m = -1
    last = np.int64(0)
    while size > 0:
        key = heap_key[0]
        r = heap_run[0]
        i = pos[r]
        if m < 0 or key != last:
            m += 1
            last = key
            out_ids[m] = ids[i]
            out_bins[m] = bins[i]
            for c in range(len(ints)):
                out_ints[c, m] = ints[c][i]
            for c in range(len(floats)):
                out_floats[c, m] = floats[c][i]
        else:
            for c in range(len(ints)):
                out_ints[c, m] += ints[c][i]
            for c in range(len(floats)):
                out_floats[c, m] += floats[c][i]
        pos[r] = i + 1
        # the run's next row replaces the top (or the last heap entry does)
        if pos[r] < run_starts[r + 1]:
            new_key = np.int64(ids[pos[r]]) * stride + bins[pos[r]]
            if new_key <= key:
                return -1, out_ids, out_bins, out_ints, out_floats
            new_run = r
        else:
            size -= 1
            new_key = heap_key[size]
            new_run = heap_run[size]
        c = 0
        while True:  # sift down
            child = 2 * c + 1
            if child >= size:
                break
            if child + 1 < size and (
                heap_key[child + 1] < heap_key[child]
                or (
                    heap_key[child + 1] == heap_key[child] and heap_run[child + 1] < heap_run[child]
                )
            ):
                child += 1
            if heap_key[child] > new_key or (
                heap_key[child] == new_key and heap_run[child] > new_run
            ):
                break
            heap_key[c] = heap_key[child]
            heap_run[c] = heap_run[child]
            c = child
        if size > 0:
            heap_key[c] = new_key
            heap_run[c] = new_run
    return m + 1, out_ids, out_bins, out_ints, out_floats
