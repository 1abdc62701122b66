"""The compiled kernels of ``pipeline.aggregate.topk_pass`` (numba, cached on disk).

Kept in their own module so that importing the pipeline never imports numba,
and so numba can cache them (it cannot cache closures).
"""

from __future__ import annotations

import numba
import numpy as np

OK, BAD_ID, BAD_PROB, GROW = 0, 1, 2, 3
EMPTY = np.iinfo(np.int64).min  # key of a free slot

_njit = numba.njit(cache=True, nogil=True)
_OK, _BAD_ID, _BAD_PROB, _GROW, _EMPTY = OK, BAD_ID, BAD_PROB, GROW, EMPTY


@numba.njit(cache=True, nogil=True, inline="always")
def slot_of(slots, count, key):
    # open addressing, linear probing; one slot = one row of `slots`
    mask = slots.shape[0] - 1
    x = np.uint64(key) * np.uint64(0x9E3779B97F4A7C15)
    h = np.int64((x ^ (x >> np.uint64(29))) & np.uint64(mask))
    while True:
        k = slots[h, 0]
        if k == key:
            return h
        if k == _EMPTY:
            slots[h, 0] = key
            count[0] += 1
            return h
        h = (h + 1) & mask


@_njit
def rehash(slots, bigger, count):
    count[0] = 0
    for s in range(slots.shape[0]):
        if slots[s, 0] != _EMPTY:
            t = slot_of(bigger, count, slots[s, 0])
            bigger[t, 1:] = slots[s, 1:]


@numba.njit(cache=True, nogil=True, inline="always")
def touch(doc_bins, touched, b):
    if doc_bins[b, 7] == 0:
        doc_bins[b, 7] = 1
        touched[0] += 1
        touched[touched[0]] = b


@_njit
def flush(doc_bins, doc_floats, touched, current, s_int, s_float, s_count, stride):
    """Move the current document's bins into the seq table (one insert per bin)."""
    base = current[0] * stride
    for t in range(1, touched[0] + 1):
        b = touched[t]
        s = slot_of(s_int, s_count, base + b)
        for col in range(1, 5):
            s_int[s, col] += doc_bins[b, col]
        s_float[s, 5] += doc_floats[b, 5]
        s_float[s, 6] += doc_floats[b, 6]
        doc_bins[b, :] = 0
    touched[0] = 0


@_njit
def batch(
    start, ids, probs, offsets, labels, docs, tail_count, tail_mass, top1_bin, top1_prob,
    top1_ok, vocab, fine_bins, threshold,
    bin1_n, bin1_p, bin1_hits, kept_n, p_mass, label_hits,
    c_int, c_float, c_count, s_int, s_float, s_count,
    doc_bins, doc_floats, touched, current,
):  # fmt: skip
    """Fold rows start.. of one batch in. Returns (code, row): _GROW asks the
    caller to enlarge the hash tables and call again from that row.

    Slot columns: class [key, n, hits, p_sum]; seq [key, n, hits, top1_n,
    correct, p_sum, conf_sum, -]; key = id * (F + 1) + bin. The current
    document's seq bins are summed in `doc_bins` (dense over bins, same
    columns, column 7 marks a touched bin) and enter the seq table when the
    document changes (rows of a document are consecutive in a shard; if not,
    it still sums right, with more inserts). current = [doc, active].
    """
    stride = fine_bins + 1
    for i in range(start, labels.size):
        lo, hi = offsets[i], offsets[i + 1]
        if (
            2 * (c_count[0] + hi - lo) > c_int.shape[0]
            or 2 * (s_count[0] + stride) > s_int.shape[0]
        ):
            return _GROW, i
        doc = docs[i]
        if current[1] == 0 or doc != current[0]:
            if current[1]:
                flush(doc_bins, doc_floats, touched, current, s_int, s_float, s_count, stride)
            current[0] = doc
            current[1] = 1
        label = labels[i]
        n1 = 0
        p1 = 0.0
        h1 = 0
        hits = 0
        for j in range(lo, hi):
            c = ids[j]
            v = probs[j]
            if c < 0 or c >= vocab:
                return _BAD_ID, i
            if not (v >= 0.0 and v <= 1.0):
                return _BAD_PROB, i
            v64 = np.float64(v)
            hit = 1 if c == label else 0
            hits += hit
            kept_n[c] += 1
            p_mass[c] += v64
            if v <= threshold:
                bin1_n[c] += 1
                bin1_p[c] += v64
                bin1_hits[c] += hit
                n1 += 1
                p1 += v64
                h1 += hit
            else:
                b = np.int64(np.ceil(v64 * fine_bins))
                s = slot_of(c_int, c_count, np.int64(c) * stride + b)
                c_int[s, 1] += 1
                c_int[s, 2] += hit
                c_float[s, 3] += v64
                touch(doc_bins, touched, b)
                doc_bins[b, 1] += 1
                doc_bins[b, 2] += hit
                doc_floats[b, 5] += v64
        label_hits[i] = hits
        tc = tail_count[i]
        if n1 + tc > 0:
            touch(doc_bins, touched, 1)
            doc_bins[1, 1] += n1 + tc
            doc_bins[1, 2] += h1
            doc_floats[1, 5] += p1 + tail_mass[i]
        b = top1_bin[i]
        touch(doc_bins, touched, b)
        doc_bins[b, 3] += 1
        doc_bins[b, 4] += top1_ok[i]
        doc_floats[b, 6] += np.float64(top1_prob[i])
    return _OK, -1
