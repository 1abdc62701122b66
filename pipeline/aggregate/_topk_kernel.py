"""The compiled kernels of ``pipeline.aggregate.topk_pass`` (numba, cached on disk).

Kept in their own module so that importing the pipeline never imports numba,
and so numba can cache them (it cannot cache closures).
"""

from __future__ import annotations

import numpy as np

from pipeline.aggregate.topk_format import (
    CLASS_HITS,
    CLASS_KEY,
    CLASS_N,
    CLASS_P_SUM,
    CLASS_WIDTH,
    CURRENT_DOC,
    CURRENT_OPEN,
    EMPTY,
    LABEL_HITS,
    LOW_N,
    LOW_P_SUM,
    MISSING_LABELS,
    SEQ_CONF_SUM,
    SEQ_CORRECT,
    SEQ_HITS,
    SEQ_KEY,
    SEQ_MARKED,
    SEQ_N,
    SEQ_P_SUM,
    SEQ_TOP1_N,
    SEQ_WIDTH,
    TAIL_COUNT,
    TOP1_CORRECT,
    TOP1_N,
    KernelCode,
)
from pipeline.core._numba import numba

# the codes as plain ints (numba freezes them as constants)
_OK, _GROW, _FULL = int(KernelCode.OK), int(KernelCode.GROW), int(KernelCode.FULL)
_BAD_ID, _BAD_PROB = int(KernelCode.BAD_ID), int(KernelCode.BAD_PROB)
_BAD_LABEL, _BAD_TOP1 = int(KernelCode.BAD_LABEL), int(KernelCode.BAD_TOP1)
_BAD_TOP1_PROB, _BAD_DOC = int(KernelCode.BAD_TOP1_PROB), int(KernelCode.BAD_DOC)
# a buffered entry's key: class << 32 | hit << 31 | bin; the table's: without the hit bit
_KEY_MASK = ~np.int64(1 << 31)
# unsigned column offsets and row widths, for the loops that index flat rows
# with unsigned integers (numba then adds no negative-index handling)
_U_CLASS_N, _U_CLASS_HITS = np.uint64(CLASS_N), np.uint64(CLASS_HITS)
_U_CLASS_P_SUM, _U_CLASS_WIDTH = np.uint64(CLASS_P_SUM), np.uint64(CLASS_WIDTH)
_U_SEQ_N, _U_SEQ_HITS = np.uint64(SEQ_N), np.uint64(SEQ_HITS)
_U_SEQ_P_SUM, _U_SEQ_WIDTH = np.uint64(SEQ_P_SUM), np.uint64(SEQ_WIDTH)

_njit = numba.njit(cache=True, nogil=True)


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
    fill = starts[:parts].astype(np.uint64)
    counts[:] = 0
    mask = np.uint64(parts - 1)
    for e in range(np.uint64(n)):  # unsigned indices: no negative-index handling
        key = keys[e]
        q = np.uint64(key >> 32) & mask
        d = fill[q]
        fill[q] = d + np.uint64(1)
        out_keys[d] = key
        out_probs[d] = probs[e]


@_njit
def insert(keys, probs, starts, first, start, region_bits, table, table_f, counts):
    """Sum the ordered entries of partitions first.. (from entry `start`) into
    their regions; (GROW, partition, entry) when an entry would fill its
    region past three quarters (grow, then call again from there); with
    a mixing hash, linear probing stays short at that load.

    `table` is the class table's slots flattened (CLASS_WIDTH int64 per
    slot, p_sum through the float64 view `table_f`); slot indices are
    unsigned so that numba adds no negative-index handling (measured: 10%).
    """
    mask = np.uint64((1 << region_bits) - 1)
    full = (np.int64(3) << region_bits) >> 2
    one = np.uint64(1)
    for q in range(first, starts.size - 1):
        base = np.uint64(q) << np.uint64(region_bits)
        for e in range(max(start, starts[q]), starts[q + 1]):
            raw = keys[e]
            key = raw & _KEY_MASK
            h = np.uint64(hash_of(key, mask))
            while True:
                s = (base + h) * _U_CLASS_WIDTH
                k = table[s]
                if k == key:
                    break
                if k == EMPTY:
                    if counts[q] >= full:
                        return _GROW, q, e
                    table[s] = key
                    counts[q] += 1
                    break
                h = (h + one) & mask
            table[s + _U_CLASS_N] += 1
            table[s + _U_CLASS_HITS] += (raw >> 31) & 1
            table_f[s + _U_CLASS_P_SUM] += np.float64(probs[e])
    return _OK, 0, 0


@_njit
def rehash_regions(slots, bigger, counts, parts, region_bits):
    mask = (np.int64(1) << region_bits) - 1
    counts[:] = 0
    for s in range(slots.shape[0]):
        key = slots[s, CLASS_KEY]
        if key == EMPTY:
            continue
        q = (key >> 32) & (parts - 1)
        base = q << region_bits
        h = hash_of(key, mask)
        while bigger[base + h, CLASS_KEY] != EMPTY:
            h = (h + 1) & mask
        bigger[base + h, :] = slots[s, :]
        counts[q] += 1


@numba.njit(cache=True, nogil=True, inline="always")
def touch(doc, touched, b):
    """List bin b among the current document's bins (SEQ_MARKED marks it)."""
    if doc[b, SEQ_MARKED] == 0:
        doc[b, SEQ_MARKED] = 1
        touched[0] += 1
        touched[touched[0]] = b


@_njit
def flush(documents, stride):
    """Append the current document's bins to the seq rows (one row per bin,
    in bin order: documents in increasing order then need no sort)."""
    doc, touched, seq_rows, seq_n = documents.doc, documents.touched, documents.rows, documents.used
    base = documents.current[CURRENT_DOC] * stride
    touched[1 : touched[0] + 1].sort()
    for t in range(1, touched[0] + 1):
        b = touched[t]
        r = seq_n[0]
        seq_n[0] = r + 1
        seq_rows[SEQ_KEY, r] = base + b
        for col in range(SEQ_KEY + 1, SEQ_MARKED):  # the sums: same columns, bits copied
            seq_rows[col, r] = doc[b, col]
        doc[b, :] = 0
    touched[0] = 0


@_njit
def batch(start, rows, rules, sums, buffer, documents):
    """Fold rows start.. of one batch (a `BatchRows`) in. Returns (code, row):
    GROW asks the caller to enlarge the seq rows, FULL to empty the entry
    buffer (see `partition`/`insert`), then to call again from that row; a
    BAD_* code names the first row that fails its check (label, top1_id and
    kept ids in [0, vocab), probabilities in [0, 1], |doc_id| <= doc_limit:
    the `Rules`), checked before the row changes anything.

    Per row (into `sums`, a `ShardSums`): label_count[label] and
    top1_count[top1_id] count it; its top-1 bin (the one rule,
    max(ceil(float64(p) * F), 1)) adds to top1_counts[bin] (n, correct) and
    top1_conf[bin]; totals += [rows whose label is not kept, kept entries
    equal to the label, tail_count]; largest_tail[0] is the largest tail_max
    seen.

    Entries above bin 1 are appended to `buffer` (key = id << 32 | bin,
    with bit 31 set for the row's label; probability) for the class table,
    counted per class partition (id & (parts - 1)). The current document's
    seq bins are summed in `documents.doc`, one seq row per bin, `touched`
    listing the bins used, and are appended to the seq rows (key = doc_id *
    (F + 1) + bin) when the document changes. Rows of a document are
    consecutive in a shard; if not, its key repeats and the rows are summed
    when the table is made.
    """
    ids, probs, offsets, labels = rows.ids, rows.probs, rows.offsets, rows.label
    vocab, fine_bins, threshold, doc_limit = rules
    bin1_n, bin1_p, bin1_hits = sums.bin1_n, sums.bin1_p_sum, sums.bin1_hits
    totals, largest_tail = sums.totals, sums.largest_tail
    buf_keys, buf_probs, buf_n, part_counts = buffer
    seq_rows, seq_n, doc, touched, current = documents
    stride = fine_bins + 1
    parts_mask = part_counts.size - 1
    doc_f = doc.view(np.float64)
    # the per-entry loop indexes with unsigned integers and flat rows: numba
    # then adds no negative-index handling (measured: the loop 20% faster)
    doc_flat = doc.reshape(-1)
    doc_flat_f = doc_flat.view(np.float64)
    pmask = np.uint64(parts_mask)
    for i in range(start, labels.size):
        lo, hi = offsets[i], offsets[i + 1]
        if seq_n[0] + stride > seq_rows.shape[1]:
            return _GROW, i
        if buf_n[0] + hi - lo > buf_keys.size:
            return _FULL, i
        label = labels[i]
        if label < 0 or label >= vocab:
            return _BAD_LABEL, i
        top1 = rows.top1_id[i]
        if top1 < 0 or top1 >= vocab:
            return _BAD_TOP1, i
        q = rows.top1_prob[i]
        if not (q >= 0.0 and q <= 1.0):
            return _BAD_TOP1_PROB, i
        doc_id = np.int64(rows.doc_id[i])
        if doc_id < -doc_limit or doc_id > doc_limit:
            return _BAD_DOC, i
        if current[CURRENT_OPEN] == 0 or doc_id != current[CURRENT_DOC]:
            if current[CURRENT_OPEN]:
                flush(documents, stride)
            current[CURRENT_DOC] = doc_id
            current[CURRENT_OPEN] = 1
        n1 = 0
        p1 = 0.0
        h1 = 0
        hits = 0
        e = buf_n[0]
        eu = np.uint64(e)
        for j in range(np.uint64(lo), np.uint64(hi)):
            c = ids[j]
            v = probs[j]
            if c < 0 or c >= vocab:
                return _BAD_ID, i
            if not (v >= 0.0 and v <= 1.0):
                return _BAD_PROB, i
            cu = np.uint64(c)
            v64 = np.float64(v)
            hit = 1 if c == label else 0
            hits += hit
            if v <= threshold:
                bin1_n[cu] += 1
                bin1_p[cu] += v64
                bin1_hits[cu] += hit
                n1 += 1
                p1 += v64
                h1 += hit
            else:
                b = np.uint64(np.ceil(v64 * fine_bins))
                buf_keys[eu] = (np.int64(c) << 32) | (np.int64(hit) << 31) | np.int64(b)
                buf_probs[eu] = v
                eu += np.uint64(1)
                part_counts[cu & pmask] += 1
                r = b * _U_SEQ_WIDTH
                n_b = doc_flat[r + _U_SEQ_N]
                if n_b == 0:  # (the check on n first: most entries meet a listed bin)
                    touch(doc, touched, np.int64(b))
                doc_flat[r + _U_SEQ_N] = n_b + 1
                doc_flat[r + _U_SEQ_HITS] += hit
                doc_flat_f[r + _U_SEQ_P_SUM] += v64
        e = np.int64(eu)
        buf_n[0] = e
        if hits == 0:
            totals[MISSING_LABELS] += 1
        totals[LABEL_HITS] += hits
        tc = rows.tail_count[i]
        totals[TAIL_COUNT] += tc
        if rows.tail_max[i] > largest_tail[0]:
            largest_tail[0] = rows.tail_max[i]
        if n1 + tc > 0:
            touch(doc, touched, 1)
            doc[1, SEQ_N] += n1 + tc
            doc[1, SEQ_HITS] += h1
            doc_f[1, SEQ_P_SUM] += p1 + rows.tail_mass[i]
        sums.label_count[label] += 1
        sums.top1_count[top1] += 1
        q64 = np.float64(q)
        b = max(np.int64(np.ceil(q64 * fine_bins)), 1)
        ok = 1 if top1 == label else 0
        sums.top1_counts[b, TOP1_N] += 1
        sums.top1_counts[b, TOP1_CORRECT] += ok
        sums.top1_conf[b] += q64
        touch(doc, touched, b)
        doc[b, SEQ_TOP1_N] += 1
        doc[b, SEQ_CORRECT] += ok
        doc_f[b, SEQ_CONF_SUM] += q64
    return _OK, -1


@_njit
def class_table(slots, low, low_hits, tail_n, order, vocab, fine_bins):
    """The shard's class_bins columns in (class, bin) order: per class, its low
    rows with n != 0 (`low`: (low_bins, K, LOW_WIDTH), bins 1..low_bins, their
    label hits in `low_hits` (low_bins, K);
    tail_n[c] added to bin 1's n), then the class table's used slots (bins
    above); and the class mass (sum of p_sum) per class, added in bin order.
    Two counting sorts (the slots by bin into `order`, a scratch of at least as
    many int64 as used slots; then stably by class into the outputs), each
    output written once at its final size."""
    low_bins = low.shape[0]
    low_f = low.view(np.float64)
    per_class = np.zeros(vocab + 1, np.int64)
    per_bin = np.zeros(fine_bins + 2, np.int64)
    for c in range(vocab):
        for b in range(1, low_bins + 1):
            if low[b - 1, c, LOW_N] + (tail_n[c] if b == 1 else 0) != 0:
                per_class[c + 1] += 1
    for s in range(slots.shape[0]):
        key = slots[s, CLASS_KEY]
        if key != EMPTY:
            per_class[(key >> 32) + 1] += 1
            per_bin[(key & 0xFFFFFFFF) + 1] += 1
    for c in range(vocab):
        per_class[c + 1] += per_class[c]
    for b in range(fine_bins + 1):
        per_bin[b + 1] += per_bin[b]
    for s in range(slots.shape[0]):
        key = slots[s, CLASS_KEY]
        if key != EMPTY:
            b = key & 0xFFFFFFFF
            order[per_bin[b]] = s
            per_bin[b] += 1
    rows = per_class[vocab]
    ids = np.empty(rows, np.int32)
    bins = np.empty(rows, np.int32)
    n = np.empty(rows, np.int64)
    p_sum = np.empty(rows, np.float64)
    hits = np.empty(rows, np.int64)
    p_mass = np.zeros(vocab, np.float64)
    floats = slots.view(np.float64)
    for c in range(vocab):  # the low rows first: table rows hold the bins above
        for b in range(1, low_bins + 1):
            count = low[b - 1, c, LOW_N] + (tail_n[c] if b == 1 else 0)
            if count != 0:
                r = per_class[c]
                per_class[c] = r + 1
                ids[r] = c
                bins[r] = b
                n[r] = count
                p_sum[r] = low_f[b - 1, c, LOW_P_SUM]
                hits[r] = low_hits[b - 1, c]
                p_mass[c] += low_f[b - 1, c, LOW_P_SUM]
    for t in range(per_bin[fine_bins + 1]):
        s = order[t]
        key = slots[s, CLASS_KEY]
        c = key >> 32
        r = per_class[c]
        per_class[c] = r + 1
        ids[r] = c
        bins[r] = key & 0xFFFFFFFF
        n[r] = slots[s, CLASS_N]
        hits[r] = slots[s, CLASS_HITS]
        p_sum[r] = floats[s, CLASS_P_SUM]
        p_mass[c] += floats[s, CLASS_P_SUM]
    return ids, bins, n, p_sum, hits, p_mass
