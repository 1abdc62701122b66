"""An independent dense reference, written straight from the paper's equations
(ECE eq. 3, cw-ECE eq. 6, Full-ECE eqs. 9-11) as literal per-bin loops.

Bin membership uses exact rational arithmetic (fractions.Fraction): value p is
in bin m of M when (m-1)/M < p <= m/M, and p = 0 is in bin 1. Nothing here
shares code with pipeline/.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np


def exact_bins(values, M: int) -> np.ndarray:
    """Bin of each value by rational comparison with the edges m/M."""
    flat = np.asarray(values, dtype=np.float32).ravel()
    uniq, inverse = np.unique(flat, return_inverse=True)
    bins = np.array([max(math.ceil(Fraction(float(v)) * M), 1) for v in uniq], dtype=np.int64)
    return bins[inverse].reshape(np.shape(values))


def reference_metrics(probs, labels, M: int) -> dict:
    P32 = np.asarray(probs, dtype=np.float32)
    P = P32.astype(np.float64)
    y = np.asarray(labels)
    N, K = P.shape
    B = exact_bins(P32, M)
    yhat = P.argmax(axis=1)  # first index among ties
    conf = P[np.arange(N), yhat]
    conf_bin = B[np.arange(N), yhat]

    ece = 0.0
    for m in range(1, M + 1):
        in_bin = conf_bin == m
        size = in_bin.sum()
        if size:
            A = np.mean(yhat[in_bin] == y[in_bin])
            C = np.mean(conf[in_bin])
            ece += size / N * abs(A - C)

    cw = 0.0
    for k in range(K):
        for m in range(1, M + 1):
            in_bin = B[:, k] == m
            size = in_bin.sum()
            if size:
                A = np.mean(y[in_bin] == k)
                C = np.mean(P[in_bin, k])
                cw += size / (N * K) * abs(A - C)

    full = 0.0
    for m in range(1, M + 1):
        size_star = 0
        hits = 0.0
        mass = 0.0
        for k in range(K):
            in_bin = B[:, k] == m
            size_star += in_bin.sum()
            hits += np.sum(y[in_bin] == k)
            mass += np.sum(P[in_bin, k])
        if size_star:
            A_star = hits / size_star
            C_star = mass / size_star
            full += size_star / N * abs(A_star - C_star)
    return {"ece": ece, "cw_ece": cw, "full_ece": full}
