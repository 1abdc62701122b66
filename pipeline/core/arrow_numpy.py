"""Arrow columns as numpy arrays without pyarrow's pandas bridge.

``pyarrow.Array.to_numpy`` converts through Arrow's pandas layer, which imports
pandas on first use (0.4 s and more of start-up, several seconds on a loaded
machine) although no pandas object is made. Fixed-width numeric columns
without nulls, all the bin tables hold, are read straight from their data
buffers instead; anything else goes to ``to_numpy``.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

_NUMERIC = {
    pa.int8(): np.int8,
    pa.int16(): np.int16,
    pa.int32(): np.int32,
    pa.int64(): np.int64,
    pa.uint8(): np.uint8,
    pa.uint16(): np.uint16,
    pa.uint32(): np.uint32,
    pa.uint64(): np.uint64,
    pa.float32(): np.float32,
    pa.float64(): np.float64,
}


def column_numpy(column) -> np.ndarray:
    """A writable numpy copy of an Arrow Array or ChunkedArray (values as stored)."""
    chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
    dtype = _NUMERIC.get(column.type)
    if dtype is None or any(c.null_count for c in chunks):
        return np.array(column.to_numpy(zero_copy_only=False))
    parts = [np.frombuffer(c.buffers()[1], dtype)[c.offset : c.offset + len(c)] for c in chunks]
    if not parts:
        return np.empty(0, dtype)
    return np.concatenate(parts) if len(parts) > 1 else parts[0].copy()
