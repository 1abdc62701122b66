"""One pass over a top-k shard's kept entries feeds every partial table.

Each record batch of the positions file is decoded once (pyarrow: the Arrow
list buffers are used in place) and walked once by a compiled kernel (numba)
that, per kept entry (class c, probability p of record, float32):

* bins it with the one rule, ``max(ceil(float64(p) * F), 1)``; ``p <= t``
  with ``t = bin1_threshold(F)`` is exactly bin 1, so bin-1 entries (most of a
  real model's kept pairs) go to dense per-class vectors, with no grouping;
* puts entries above bin 1 into two small open-addressing hash tables keyed by
  (class, bin) for class_bins and (doc_id, bin) for seq_bins;
* adds to the per-class kept count and probability mass (tokens);
* checks it on the way: class id in [0, K), p in [0, 1], and counts the rows
  whose label is among their kept ids.

Per position the kernel adds one seq_bins entry at bin 1 (kept bin-1 entries
plus the position's tail count/mass) and one top-1 entry. Everything the
shard reduces to is therefore additive state of size O(K + table rows); a
batch is the only thing proportional to the data. Sums are float64, counts
int64, as in the SQL they replace.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pipeline.core.binning import bin1_threshold, fine_bin_index

BATCH_ROWS = 65_536  # positions decoded at a time (64 kept each: 4M entries, ~32 MB)
_INITIAL_SLOTS = 1 << 16  # grown by doubling at half full
_capacity_hint = {"class": _INITIAL_SLOTS, "seq": _INITIAL_SLOTS}  # last shard's sizes

# codes the kernel returns (row index alongside), as in _topk_kernel
_OK, _BAD_ID, _BAD_PROB, _GROW = 0, 1, 2, 3


def _compile():
    """The numba kernels (imported on first use; compiled once, then cached)."""
    from pipeline.aggregate import _topk_kernel

    return _topk_kernel.batch, _topk_kernel.rehash


def _flush_document(state) -> None:
    from pipeline.aggregate import _topk_kernel

    if state._current[1]:
        slots, floats, count = state._seq
        if 2 * (count[0] + state.fine_bins + 1) > slots.shape[0]:
            state._seq = _grow(state._seq, _topk_kernel.rehash)
            slots, floats, count = state._seq
        _topk_kernel.flush(
            state._doc_bins,
            state._doc_bins.view(np.float64),
            state._touched,
            state._current,
            slots,
            floats,
            count,
            state.fine_bins + 1,
        )
        state._current[1] = 0


_EMPTY = np.iinfo(np.int64).min  # as in _topk_kernel.EMPTY
_CLASS_WIDTH, _SEQ_WIDTH = 4, 8  # slot columns (see the kernel); 32 and 64 bytes


def _new_table(width: int, cap: int = _INITIAL_SLOTS):
    slots = np.zeros((cap, width), np.int64)
    slots[:, 0] = _EMPTY
    return slots, slots.view(np.float64), np.zeros(1, np.int64)


def _grow(table, rehash):
    slots, _, count = table
    bigger = _new_table(slots.shape[1], 2 * slots.shape[0])
    rehash(slots, bigger[0], bigger[2])
    return bigger


def _table_rows(table, stride: int):
    """(ids, bins, int columns, float view) of the used slots (unsorted)."""
    slots, floats, _ = table
    used = np.flatnonzero(slots[:, 0] != _EMPTY)
    key = slots[used, 0]
    return key // stride, (key % stride).astype(np.int32), slots[used], floats[used]


class KeptEntryError(ValueError):
    """A kept entry the tables cannot hold (row index within the shard)."""

    def __init__(self, message: str, row: int):
        super().__init__(message)
        self.row = row


@dataclass
class TopkShardPass:
    """Additive state of one shard's single pass (feed batches, then `tables`)."""

    vocab_size: int
    fine_bins: int
    positions: int = 0
    label_rows_missing: int = 0  # rows whose label is not among the kept ids
    label_hits: int = 0  # kept entries equal to their row's label (= rows when valid)
    kept_entries: int = 0
    position_tail_count: int = 0
    tail_max: float = 0.0
    extra: dict = field(default_factory=dict)  # room for per-shard outputs of other passes

    def __post_init__(self):
        k, f = self.vocab_size, self.fine_bins
        self._threshold = bin1_threshold(f)
        # a class's five running sums share one 64-byte row (one cache line per
        # kept entry); the attributes are column views of it
        self._per_class = np.zeros((k, 8), np.int64)
        floats = self._per_class.view(np.float64)
        self.bin1_n = self._per_class[:, 0]
        self.bin1_hits = self._per_class[:, 1]
        self.kept_n = self._per_class[:, 2]
        self.bin1_p_sum = floats[:, 3]
        self.p_mass = floats[:, 4]
        self.label_count = np.zeros(k, np.int64)
        self.top1_count = np.zeros(k, np.int64)
        self.top1_n = np.zeros(f, np.int64)
        self.top1_conf_sum = np.zeros(f, np.float64)
        self.top1_correct = np.zeros(f, np.int64)
        self.class_tail_n = np.zeros(k, np.int64)
        # (class, bin) -> n, hits, p_sum; (doc, bin) -> n, hits, top1_n, correct, p_sum, conf
        self._class = _new_table(_CLASS_WIDTH, _capacity_hint["class"])
        self._seq = _new_table(_SEQ_WIDTH, _capacity_hint["seq"])
        # the current document's seq bins, dense over bins (see _topk_kernel.batch)
        self._doc_bins = np.zeros((f + 1, _SEQ_WIDTH), np.int64)
        self._touched = np.zeros(f + 2, np.int64)
        self._current = np.zeros(2, np.int64)

    # ------------------------------------------------------------------ input

    def add_batch(self, batch) -> None:
        """One Arrow record batch of the positions schema (any row count)."""
        import pyarrow as pa

        kernel, rehash = _compile()
        k, f = self.vocab_size, self.fine_bins
        n = batch.num_rows
        if n == 0:
            return
        col = batch.column
        kept_ids, kept_probs = col("kept_ids"), col("kept_probs")
        id_off = np.asarray(kept_ids.offsets)
        p_off = np.asarray(kept_probs.offsets)
        if not np.array_equal(np.diff(id_off), np.diff(p_off)):
            row = int(np.flatnonzero(np.diff(id_off) != np.diff(p_off))[0])
            raise KeptEntryError("kept_ids and kept_probs differ in length", self.positions + row)
        # entries of this batch only (a sliced batch's list buffers start earlier)
        ids = np.asarray(kept_ids.values)[id_off[0] : id_off[-1]]
        probs = np.asarray(kept_probs.values)[p_off[0] : p_off[-1]]
        id_off = id_off - id_off[0]
        labels = np.asarray(col("label"))
        top1_id = np.asarray(col("top1_id"))
        top1_prob = np.asarray(col("top1_prob"))
        for name, values in (("label", labels), ("top1_id", top1_id)):
            bad = np.flatnonzero((values < 0) | (values >= k))
            if bad.size:
                raise KeptEntryError(f"{name} outside [0, {k})", self.positions + int(bad[0]))
        bad = np.flatnonzero(~((top1_prob >= 0) & (top1_prob <= 1)))
        if bad.size:
            raise KeptEntryError("top1_prob outside [0, 1]", self.positions + int(bad[0]))
        docs = np.asarray(col("doc_id"), dtype=np.int64)
        limit = (1 << 62) // (f + 1)  # doc_id * (F + 1) + bin must fit an int64
        bad = np.flatnonzero((docs < -limit) | (docs > limit))
        if bad.size:
            raise KeptEntryError(
                f"doc_id outside [-{limit}, {limit}]", self.positions + int(bad[0])
            )
        tail_count = np.asarray(col("tail_count"))
        tail_mass = np.asarray(col("tail_mass"), dtype=np.float64)
        top1_bin = fine_bin_index(top1_prob, f)
        top1_ok = (top1_id == labels).astype(np.int64)
        hits = np.empty(n, np.int64)
        args = (
            ids,
            probs,
            id_off,
            labels,
            docs,
            tail_count,
            tail_mass,
            top1_bin,
            top1_prob,
            top1_ok,
            k,
            f,
            self._threshold,
            self.bin1_n,
            self.bin1_p_sum,
            self.bin1_hits,
            self.kept_n,
            self.p_mass,
            hits,
        )
        row = 0
        while True:
            code, row = kernel(
                row,
                *args,
                *self._class,
                *self._seq,
                self._doc_bins,
                self._doc_bins.view(np.float64),
                self._touched,
                self._current,
            )
            if code != _GROW:
                break
            self._class = _grow(self._class, rehash)
            self._seq = _grow(self._seq, rehash)
        if code == _BAD_ID:
            raise KeptEntryError(f"kept class id outside [0, {k})", self.positions + int(row))
        if code == _BAD_PROB:
            raise KeptEntryError("kept probability outside [0, 1]", self.positions + int(row))
        self.label_rows_missing += int(np.count_nonzero(hits == 0))
        self.label_hits += int(hits.sum())
        self.kept_entries += int(id_off[-1] - id_off[0])
        self.position_tail_count += int(tail_count.sum(dtype=np.int64))
        self.tail_max = max(self.tail_max, float(pa.compute.max(col("tail_max")).as_py() or 0.0))
        self.label_count += np.bincount(labels, minlength=k)
        self.top1_count += np.bincount(top1_id, minlength=k)
        tb = top1_bin - 1
        self.top1_n += np.bincount(tb, minlength=f)
        self.top1_conf_sum += np.bincount(tb, weights=top1_prob.astype(np.float64), minlength=f)
        self.top1_correct += np.bincount(tb, weights=top1_ok, minlength=f).astype(np.int64)
        self.positions += n

    def add_class_tail(self, class_ids, tail_count, tail_mass) -> None:
        """Per-class tail pairs enter class_bins at bin 1 (rows with count > 0)."""
        keep = tail_count > 0
        ids = class_ids[keep].astype(np.int64)
        k = self.vocab_size
        self.class_tail_n += np.bincount(ids, weights=tail_count[keep], minlength=k).astype(
            np.int64
        )
        mass = np.bincount(ids, weights=tail_mass[keep].astype(np.float64), minlength=k)
        self.bin1_p_sum += mass
        self.p_mass += mass

    # ----------------------------------------------------------------- output

    @property
    def pairs(self) -> int:
        """Kept + tail pairs seen (rows x K for a valid shard)."""
        return self.kept_entries + int(self.class_tail_n.sum())

    def tables(self) -> dict[str, dict[str, np.ndarray]]:
        """The four partial tables as columns (rows unordered: the reduce sorts)."""
        _flush_document(self)
        # the next shard of this process starts at this shard's table sizes (no regrowth)
        _capacity_hint["class"] = self._class[0].shape[0]
        _capacity_hint["seq"] = self._seq[0].shape[0]
        stride = self.fine_bins + 1
        bin1_total = self.bin1_n + self.class_tail_n
        present = np.flatnonzero(bin1_total)
        c_ids, c_bins, c_int, c_float = _table_rows(self._class, stride)
        s_ids, s_bins, s_int, s_float = _table_rows(self._seq, stride)
        top1_rows = np.flatnonzero(self.top1_n)
        tokens = np.flatnonzero(
            (self.kept_n > 0)
            | (self.class_tail_n > 0)
            | (self.label_count > 0)
            | (self.top1_count > 0)
        )
        return {
            "class_bins": {
                "class_id": np.r_[present, c_ids].astype(np.int32),
                "bin": np.r_[np.ones(present.size, np.int32), c_bins],
                "n": np.r_[bin1_total[present], c_int[:, 1]],
                "p_sum": np.r_[self.bin1_p_sum[present], c_float[:, 3]],
                "hits": np.r_[self.bin1_hits[present], c_int[:, 2]],
            },
            "top1_bins": {
                "bin": (top1_rows + 1).astype(np.int32),
                "n": self.top1_n[top1_rows],
                "conf_sum": self.top1_conf_sum[top1_rows],
                "correct": self.top1_correct[top1_rows],
            },
            "tokens": {
                "class_id": tokens.astype(np.int32),
                "label_count": self.label_count[tokens],
                "top1_count": self.top1_count[tokens],
                "p_mass": self.p_mass[tokens],
            },
            "seq_bins": {
                "seq_id": s_ids,
                "bin": s_bins,
                "n": s_int[:, 1],
                "p_sum": s_float[:, 5],
                "hits": s_int[:, 2],
                "top1_n": s_int[:, 3],
                "conf_sum": s_float[:, 6],
                "correct": s_int[:, 4],
            },
        }
