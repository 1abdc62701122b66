"""The compiled kernels of ``pipeline.aggregate.topk_pass`` (numba, cached on disk).

Kept in their own module so that importing the pipeline never imports numba,
and so numba can cache them (it cannot cache closures).
"""

from __future__ import annotations

import numba
import numpy as np

OK, BAD_ID, BAD_PROB, GROW, FULL, BAD_LABEL, BAD_TOP1, BAD_TOP1_PROB, BAD_DOC = range(9)
# a buffered entry's key: class << 32 | hit << 31 | bin; the table's: without the hit bit
_KEY_MASK = ~np.int64(1 << 31)
EMPTY = np.iinfo(np.int64).min  # key of a free slot

_njit = numba.njit(cache=True, nogil=True)
_OK, _BAD_ID, _BAD_PROB, _GROW, _FULL, _EMPTY = OK, BAD_ID, BAD_PROB, GROW, FULL, EMPTY
_BAD_LABEL, _BAD_TOP1, _BAD_TOP1_PROB, _BAD_DOC = BAD_LABEL, BAD_TOP1, BAD_TOP1_PROB, BAD_DOC


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

    `table` is the class table's slots flattened (4 int64 per slot: key, n,
    hits, p_sum through the float64 view `table_f`); slot indices are
    unsigned so that numba adds no negative-index handling (measured: 10%).
    """
    mask = np.uint64((1 << region_bits) - 1)
    full = (np.int64(3) << region_bits) >> 2
    one, two, three = np.uint64(1), np.uint64(2), np.uint64(3)
    for q in range(first, starts.size - 1):
        base = np.uint64(q) << np.uint64(region_bits)
        for e in range(max(start, starts[q]), starts[q + 1]):
            raw = keys[e]
            key = raw & _KEY_MASK
            h = np.uint64(hash_of(key, mask))
            while True:
                s = (base + h) << two
                k = table[s]
                if k == key:
                    break
                if k == _EMPTY:
                    if counts[q] >= full:
                        return _GROW, q, e
                    table[s] = key
                    counts[q] += 1
                    break
                h = (h + one) & mask
            table[s + one] += 1
            table[s + two] += (raw >> 31) & 1
            table_f[s + three] += np.float64(probs[e])
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
    start, ids, probs, offsets, labels, top1_id, top1_prob, docs, tail_count, tail_mass,
    tail_max, vocab, fine_bins, threshold, doc_limit,
    bin1_n, bin1_p, bin1_hits, label_count, top1_count, top1_int, top1_conf, totals,
    largest_tail, buf_keys, buf_probs, buf_n, part_counts, seq_rows, seq_n, doc, touched, current,
):  # fmt: skip
    """Fold rows start.. of one batch in. Returns (code, row): _GROW asks the
    caller to enlarge `seq_rows`, _FULL to empty the entry buffer (see
    `partition`/`insert`), then to call again from that row; a _BAD_* code
    names the first row that fails its check (label, top1_id and kept ids in
    [0, vocab), probabilities in [0, 1], |doc_id| <= doc_limit), checked
    before the row changes anything.

    Per row: label_count[label] and top1_count[top1_id] count it; its top-1
    bin (the one rule, max(ceil(float64(p) * F), 1)) adds to top1_int[bin]
    (n, correct) and top1_conf[bin]; totals += [rows whose label is not
    kept, kept entries equal to the label, tail_count]; largest_tail[0] is
    the largest tail_max seen.

    Entries above bin 1 are appended to the buffer (key = id << 32 | bin,
    with bit 31 set for the row's label; probability) for the class table
    (columns [key, n, hits, p_sum]), counted per class partition (id & (parts
    - 1)). The current document's seq bins are summed in `doc`, one row per
    bin in the layout of a seq row ([key, n, hits, top1_n, correct, p_sum,
    conf_sum, marked], floats through a float64 view: one cache line per
    bin), `touched` listing the bins used, and are appended to `seq_rows`
    (key = doc_id * (F + 1) + bin; seq_n[0] rows used) when the document
    changes. Rows of a document are consecutive in a shard; if not, its key
    repeats and the rows are summed when the table is made. current = [doc,
    active].
    """
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
        if seq_n[0] + stride > seq_rows.shape[0]:
            return _GROW, i
        if buf_n[0] + hi - lo > buf_keys.size:
            return _FULL, i
        label = labels[i]
        if label < 0 or label >= vocab:
            return _BAD_LABEL, i
        top1 = top1_id[i]
        if top1 < 0 or top1 >= vocab:
            return _BAD_TOP1, i
        q = top1_prob[i]
        if not (q >= 0.0 and q <= 1.0):
            return _BAD_TOP1_PROB, i
        doc_id = np.int64(docs[i])
        if doc_id < -doc_limit or doc_id > doc_limit:
            return _BAD_DOC, i
        if current[1] == 0 or doc_id != current[0]:
            if current[1]:
                flush(doc, touched, current, seq_rows, seq_n, stride)
            current[0] = doc_id
            current[1] = 1
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
                r = b << np.uint64(3)
                n_b = doc_flat[r + np.uint64(1)]
                if n_b == 0:  # (the check on n first: most entries meet a listed bin)
                    touch(doc, touched, np.int64(b))
                doc_flat[r + np.uint64(1)] = n_b + 1
                doc_flat[r + np.uint64(2)] += hit
                doc_flat_f[r + np.uint64(5)] += v64
        e = np.int64(eu)
        buf_n[0] = e
        if hits == 0:
            totals[0] += 1
        totals[1] += hits
        tc = tail_count[i]
        totals[2] += tc
        if tail_max[i] > largest_tail[0]:
            largest_tail[0] = tail_max[i]
        if n1 + tc > 0:
            touch(doc, touched, 1)
            doc[1, 1] += n1 + tc
            doc[1, 2] += h1
            doc_f[1, 5] += p1 + tail_mass[i]
        label_count[label] += 1
        top1_count[top1] += 1
        q64 = np.float64(q)
        b = max(np.int64(np.ceil(q64 * fine_bins)), 1)
        ok = 1 if top1 == label else 0
        top1_int[b, 0] += 1
        top1_int[b, 1] += ok
        top1_conf[b] += q64
        touch(doc, touched, b)
        doc[b, 3] += 1
        doc[b, 4] += ok
        doc_f[b, 6] += q64
    return _OK, -1


@_njit
def class_table(slots, bin1_n, bin1_hits, bin1_p, order, vocab, fine_bins):
    """The shard's class_bins columns in (class, bin) order: the class table's
    used slots plus, per class with bin1_n[c] != 0, its bin-1 row from the
    dense vectors; and the class mass (sum of p_sum) per class. Two counting
    sorts (the slots by bin into `order`, a scratch of at least as many int64
    as used slots; then stably by class into the outputs), each output written
    once at its final size."""
    per_class = np.zeros(vocab + 1, np.int64)
    per_bin = np.zeros(fine_bins + 2, np.int64)
    for c in range(vocab):
        if bin1_n[c] != 0:
            per_class[c + 1] += 1
    for s in range(slots.shape[0]):
        key = slots[s, 0]
        if key != _EMPTY:
            per_class[(key >> 32) + 1] += 1
            per_bin[(key & 0xFFFFFFFF) + 1] += 1
    for c in range(vocab):
        per_class[c + 1] += per_class[c]
    for b in range(fine_bins + 1):
        per_bin[b + 1] += per_bin[b]
    for s in range(slots.shape[0]):
        key = slots[s, 0]
        if key != _EMPTY:
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
    for c in range(vocab):  # bin 1 first: table rows hold bins >= 2
        if bin1_n[c] != 0:
            r = per_class[c]
            per_class[c] = r + 1
            ids[r] = c
            bins[r] = 1
            n[r] = bin1_n[c]
            p_sum[r] = bin1_p[c]
            hits[r] = bin1_hits[c]
            p_mass[c] += bin1_p[c]
    for t in range(per_bin[fine_bins + 1]):
        s = order[t]
        key = slots[s, 0]
        c = key >> 32
        r = per_class[c]
        per_class[c] = r + 1
        ids[r] = c
        bins[r] = key & 0xFFFFFFFF
        n[r] = slots[s, 1]
        hits[r] = slots[s, 2]
        p_sum[r] = floats[s, 3]
        p_mass[c] += floats[s, 3]
    return ids, bins, n, p_sum, hits, p_mass
