"""The compiled Σ_i q_im² of ``pipeline.core.floors.bin_mass_sq_of_entries`` (numba).

In a module of their own so that importing the core never imports numba. The
sums are those of the numpy path to the bit: each row's entries are grouped
by (fine bin, then every coarser grid from the finest one already done that
it divides), each group summed from 0.0 in the order the numpy path's stable
sort leaves it (a fine bin's entries in input order, the bins ascending), and
each square added to its bin row by row.
"""

from __future__ import annotations

import numpy as np

from pipeline.core._numba import numba

# isort: split
# after pipeline.core._numba, which imports numba without its BLAS probe
from numba.cpython.unsafe.numbers import trailing_zeros


@numba.njit(cache=True, nogil=True)
def bin_mass_sq_rows(offsets, probs, bin1, fine_bins, threshold, grids, source, out):
    """out[g, b - 1] += Σ over rows of q_rb² at grid M = grids[g] (g >= 1), where
    row r holds probs[offsets[r]:offsets[r + 1]] (float32) plus bin1[r] of mass
    known to lie in fine bin 1. grids[0] is F; grid g is coarsened from the
    groups of grid source[g], a finer grid it divides."""
    n = offsets.size - 1
    n_grids = grids.size
    width = 1
    for r in range(n):
        width = max(width, offsets[r + 1] - offsets[r] + 1)
    width = min(width, fine_bins + 1)  # distinct fine bins of a row
    fine_sum = np.zeros(fine_bins + 1, np.float64)
    seen_in_row = np.full(fine_bins + 1, -1, np.int64)
    # the row's fine bins as bits: read in ascending order, no sort
    seen_bits = np.zeros((fine_bins >> 6) + 1, np.uint64)
    touched = np.empty(width, np.int64)
    group_bin = np.empty((n_grids, width), np.int64)
    group_q = np.empty((n_grids, width), np.float64)
    count = np.zeros(n_grids, np.int64)
    # the bin of grid g holding bin b of its source grid: looked up, not divided
    # per group (an integer division per group was most of the per-row cost)
    coarse_of = np.zeros((n_grids, fine_bins + 1), np.int64)
    for g in range(1, n_grids):
        ratio = grids[source[g]] // grids[g]
        for b in range(1, grids[source[g]] + 1):
            coarse_of[g, b] = (b + ratio - 1) // ratio
    for r in range(n):
        low = 0.0
        h = 0
        # unsigned indices: numba then adds no negative-index handling
        for t in range(np.uint64(offsets[r]), np.uint64(offsets[r + 1])):
            v = probs[t]
            if v > threshold:
                # v above bin 1's threshold: float64(v) * F > 1, so the fine bin is >= 2
                level = np.uint64(np.ceil(np.float64(v) * fine_bins))
                if seen_in_row[level] != r:  # a new fine bin: its sum starts at 0.0
                    seen_in_row[level] = r
                    fine_sum[level] = 0.0
                    seen_bits[level >> np.uint64(6)] |= np.uint64(1) << (level & np.uint64(63))
                    h += 1
                fine_sum[level] += np.float64(v)
            else:
                low += np.float64(v)
        low += bin1[r]
        if h:  # the distinct fine bins in ascending order, the bits cleared for the next row
            i = 0
            for w in range(seen_bits.size):
                word = seen_bits[w]
                while word:
                    touched[i] = (w << 6) + np.int64(trailing_zeros(word))
                    i += 1
                    word &= word - np.uint64(1)
                seen_bits[w] = 0
        # grid 0 (F): bin 1 holds the low mass, then one group per fine bin
        group_bin[0, 0] = 1
        group_q[0, 0] = low
        for i in range(h):
            level = touched[i]
            group_bin[0, i + 1] = level
            group_q[0, i + 1] = fine_sum[level]
        count[0] = h + 1
        for g in range(1, n_grids):
            src = source[g]
            groups = count[src]
            c = 0
            i = 0
            while i < groups:
                coarse = coarse_of[g, group_bin[src, i]]
                q = 0.0
                while i < groups and coarse_of[g, group_bin[src, i]] == coarse:
                    q += group_q[src, i]
                    i += 1
                group_bin[g, c] = coarse
                group_q[g, c] = q
                out[g, coarse - 1] += q * q
                c += 1
            count[g] = c
