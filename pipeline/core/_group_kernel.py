"""The compiled segment sums of ``pipeline.core.tables.group_sum`` (numba).

In a module of their own so that importing the core never imports numba.
"""

from __future__ import annotations

import numba
import numpy as np


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
