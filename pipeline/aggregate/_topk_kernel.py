"""The compiled kernels of ``pipeline.aggregate.topk_pass`` (numba, cached on disk).

Kept in their own module so that importing the pipeline never imports numba,
and so numba can cache them (it cannot cache closures).
"""

from __future__ import annotations

import numba
import numpy as np

OK, BAD_ID, BAD_PROB, GROW, FULL = 0, 1, 2, 3, 4
# a buffered entry's key: class << 32 | hit << 31 | bin; the table's: without the hit bit
_KEY_MASK = ~np.int64(1 << 31)
EMPTY = np.iinfo(np.int64).min  # key of a free slot

_njit = numba.njit(cache=True, nogil=True)
_OK, _BAD_ID, _BAD_PROB, _GROW, _FULL, _EMPTY = OK, BAD_ID, BAD_PROB, GROW, FULL, EMPTY


@numba.njit(cache=True, nogil=True, inline="always")
def hash_of(key, mask):
    # splitmix64's finaliser: every key bit reaches the low bits (the class
    # sits in the high half of a class key, the bin in the low half)
    x = np.uint64(key)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return np.int64((x ^ (x >> np.uint64(31))) & np.uint64(mask))


# ---- class table: one hash region per class partition -----------------------
# A kept entry's (class, bin) group is random in the class table; probed in
# arrival order, nearly every probe is a cache miss. Entries are therefore
# buffered, ordered by class partition (class & (parts - 1)), and inserted one
# partition at a time into that partition's own region of the table, which
# fits the core's L2 cache (region size 2^region_bits slots).


@_njit
def partition(keys, probs, n, counts, out_keys, out_probs, starts):
    """Counting sort of the first n buffered entries by class partition
    (`counts`: entries per partition, counted by `batch`; reset here)."""
    parts = counts.size
    starts[0] = 0
    for q in range(parts):
        starts[q + 1] = starts[q] + counts[q]
    fill = starts[:parts].copy()
    counts[:] = 0
    for e in range(n):
        q = (keys[e] >> 32) & (parts - 1)
        d = fill[q]
        fill[q] = d + 1
        out_keys[d] = keys[e]
        out_probs[d] = probs[e]


@_njit
def insert(keys, probs, starts, first, start, region_bits, c_int, c_float, counts):
    """Sum the ordered entries of partitions first.. (from entry `start`) into
    their regions; (GROW, partition, entry) when an entry would fill its
    region past three quarters (grow, then call again from there); with
    a mixing hash, linear probing stays short at that load."""
    mask = (np.int64(1) << region_bits) - 1
    full = (np.int64(3) << region_bits) >> 2
    for q in range(first, starts.size - 1):
        base = np.int64(q) << region_bits
        for e in range(max(start, starts[q]), starts[q + 1]):
            key = keys[e] & _KEY_MASK
            h = hash_of(key, mask)
            while True:
                s = base + h
                k = c_int[s, 0]
                if k == key:
                    break
                if k == _EMPTY:
                    if counts[q] >= full:
                        return _GROW, q, e
                    c_int[s, 0] = key
                    counts[q] += 1
                    break
                h = (h + 1) & mask
            c_int[s, 1] += 1
            c_int[s, 2] += (keys[e] >> 31) & 1
            c_float[s, 3] += np.float64(probs[e])
    return _OK, 0, 0


@_njit
def rehash_regions(slots, bigger, counts, parts, region_bits):
    mask = (np.int64(1) << region_bits) - 1
    counts[:] = 0
    for s in range(slots.shape[0]):
        key = slots[s, 0]
        if key == _EMPTY:
            continue
        q = (key >> 32) & (parts - 1)
        base = q << region_bits
        h = hash_of(key, mask)
        while bigger[base + h, 0] != _EMPTY:
            h = (h + 1) & mask
        bigger[base + h, :] = slots[s, :]
        counts[q] += 1


@numba.njit(cache=True, nogil=True, inline="always")
def touch(doc, touched, b):
    """List bin b among the current document's bins (column 7 marks it)."""
    if doc[b, 7] == 0:
        doc[b, 7] = 1
        touched[0] += 1
        touched[touched[0]] = b


@_njit
def flush(doc, touched, current, seq_rows, seq_n, stride):
    """Append the current document's bins to the seq rows (one row per bin,
    in bin order: documents in increasing order then need no sort)."""
    base = current[0] * stride
    touched[1 : touched[0] + 1].sort()
    for t in range(1, touched[0] + 1):
        b = touched[t]
        r = seq_n[0]
        seq_n[0] = r + 1
        seq_rows[r, 0] = base + b
        for col in range(1, 7):  # n, hits, top1_n, correct, p_sum, conf_sum (same layout)
            seq_rows[r, col] = doc[b, col]
        doc[b, :] = 0
    touched[0] = 0


@_njit
def batch(
    start, ids, probs, offsets, labels, docs, tail_count, tail_mass, top1_bin, top1_prob,
    top1_ok, vocab, fine_bins, threshold,
    bin1_n, bin1_p, bin1_hits, label_hits,
    buf_keys, buf_probs, buf_n, part_counts, seq_rows, seq_n, doc, touched, current,
):  # fmt: skip
    """Fold rows start.. of one batch in. Returns (code, row): _GROW asks the
    caller to enlarge `seq_rows`, _FULL to empty the entry buffer (see
    `partition`/`insert`), then to call again from that row.

    Entries above bin 1 are appended to the buffer (key = id << 32 | bin,
    with bit 31 set for the row's label; probability) for the class table
    (columns [key, n, hits, p_sum]),
    counted per class partition (id & (parts - 1)).
    The current document's seq bins are summed in `doc`, one row per bin in
    the layout of a seq row ([key, n, hits, top1_n, correct, p_sum, conf_sum,
    marked], floats through a float64 view: one cache line per bin),
    `touched` listing the bins used, and are appended to `seq_rows` (key =
    doc_id * (F + 1) + bin; seq_n[0] rows used) when the document changes. Rows of a
    document are consecutive in a shard; if not, its key repeats and the rows
    are summed when the table is made. current = [doc, active].
    """
    stride = fine_bins + 1
    parts_mask = part_counts.size - 1
    doc_f = doc.view(np.float64)
    for i in range(start, labels.size):
        lo, hi = offsets[i], offsets[i + 1]
        if seq_n[0] + stride > seq_rows.shape[0]:
            return _GROW, i
        if buf_n[0] + hi - lo > buf_keys.size:
            return _FULL, i
        doc_id = docs[i]
        if current[1] == 0 or doc_id != current[0]:
            if current[1]:
                flush(doc, touched, current, seq_rows, seq_n, stride)
            current[0] = doc_id
            current[1] = 1
        label = labels[i]
        n1 = 0
        p1 = 0.0
        h1 = 0
        hits = 0
        e = buf_n[0]
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
            if v <= threshold:
                bin1_n[c] += 1
                bin1_p[c] += v64
                bin1_hits[c] += hit
                n1 += 1
                p1 += v64
                h1 += hit
            else:
                b = np.int64(np.ceil(v64 * fine_bins))
                buf_keys[e] = (np.int64(c) << 32) | (np.int64(hit) << 31) | b
                buf_probs[e] = v
                e += 1
                part_counts[c & parts_mask] += 1
                n_b = doc[b, 1]
                if n_b == 0:  # (the check on n first: most entries meet a listed bin)
                    touch(doc, touched, b)
                doc[b, 1] = n_b + 1
                doc[b, 2] += hit
                doc_f[b, 5] += v64
        buf_n[0] = e
        label_hits[i] = hits
        tc = tail_count[i]
        if n1 + tc > 0:
            touch(doc, touched, 1)
            doc[1, 1] += n1 + tc
            doc[1, 2] += h1
            doc_f[1, 5] += p1 + tail_mass[i]
        b = top1_bin[i]
        touch(doc, touched, b)
        doc[b, 3] += 1
        doc[b, 4] += top1_ok[i]
        doc_f[b, 6] += np.float64(top1_prob[i])
    return _OK, -1


@_njit
def class_rows_sorted(slots, bin1_classes, vocab, fine_bins):
    """The class table's used rows plus one zero row (class, bin 1) per class
    in `bin1_classes`, in (class, bin) order: two counting sorts (by bin, then
    stably by class). Key = class << 32 | bin."""
    n = bin1_classes.size
    for s in range(slots.shape[0]):
        if slots[s, 0] != _EMPTY:
            n += 1
    keys = np.empty(n, np.int64)
    where = np.empty(n, np.int64)  # slot, or -1 for a bin-1 row
    e = 0
    for c in bin1_classes:
        keys[e] = (np.int64(c) << 32) | 1
        where[e] = -1
        e += 1
    for s in range(slots.shape[0]):
        if slots[s, 0] != _EMPTY:
            keys[e] = slots[s, 0]
            where[e] = s
            e += 1
    by_bin = np.zeros(fine_bins + 2, np.int64)
    for e in range(n):
        by_bin[(keys[e] & 0xFFFFFFFF) + 1] += 1
    for b in range(fine_bins + 1):
        by_bin[b + 1] += by_bin[b]
    first = np.empty(n, np.int64)
    for e in range(n):
        b = keys[e] & 0xFFFFFFFF
        first[by_bin[b]] = e
        by_bin[b] += 1
    by_class = np.zeros(vocab + 1, np.int64)
    for e in range(n):
        by_class[(keys[e] >> 32) + 1] += 1
    for c in range(vocab):
        by_class[c + 1] += by_class[c]
    out = np.zeros((n, slots.shape[1]), np.int64)
    for e in first:
        c = keys[e] >> 32
        r = by_class[c]
        by_class[c] = r + 1
        if where[e] >= 0:
            out[r, :] = slots[where[e], :]
        else:
            out[r, 0] = keys[e]
    return out
