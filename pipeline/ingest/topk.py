"""Read the generic top-k Parquet layout (docs/import.md).

One row per position, rows in document order (a document's rows together,
in position order):

=============== =================== =========================================
column          type                meaning
=============== =================== =========================================
doc_id          integer             document id (unique across all files)
label           integer             the token that came next
ids             list<integer>       the top-k token ids (any order)
logprobs        list<float>         their log-probabilities (same length)
offset          integer, optional   position in the document (default: 1, 2, ...)
label_logprob   float, optional     the label's logprob, required when the
                                    label is not among ``ids``
=============== =================== =========================================

Every entry of ``ids`` counts as top-k (for the tail bound); a label added
through ``label_logprob`` does not.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline.defaults import DEFAULT_FINE_BINS
from pipeline.ingest.convert import EntryBatch, IngestError
from pipeline.store.batches import row_group_batches

REQUIRED = ("doc_id", "label", "ids", "logprobs")
OPTIONAL = ("offset", "label_logprob")
BATCH_ROWS = 65536
LABEL_LOGPROB_TOLERANCE = 1e-6


INT64_MAX = (1 << 63) - 1
INT32_MAX = (1 << 31) - 1
# aggregate keys a document's bins as doc_id * (F + 1) + bin in an int64: the
# largest doc_id it accepts at the default fine grid F (topk_pass._DOC_LIMIT)
DOC_ID_MAX = (1 << 62) // (DEFAULT_FINE_BINS + 1)


def _is_number(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t)


def _as_int64(values: pa.Array, name: str, where_value) -> np.ndarray:
    """An integer Arrow array as int64, refusing values an int64 cannot hold
    (uint64 above 2^63 - 1 would wrap to negative numbers)."""
    out = values.to_numpy(zero_copy_only=False)
    if out.dtype == np.uint64 and out.size and out.max() > INT64_MAX:
        j = int(np.flatnonzero(out > INT64_MAX)[0])
        raise IngestError(f"{where_value(j)}: {name} {int(out[j])} is too large (above 2^63 - 1)")
    return out.astype(np.int64)


def _list_parts(col: pa.Array, name: str, where, integer: bool):
    """(offsets, values) of a list column: integers (ids) or numbers (logprobs);
    strings, booleans and floats where integers belong are refused, not cast."""
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    if not (pa.types.is_list(col.type) or pa.types.is_large_list(col.type)):
        raise IngestError(f"{where(None)}: column {name!r} must be a list, not {col.type}")
    element = col.type.value_type
    if not (pa.types.is_integer(element) if integer else _is_number(element)):
        kind = "integers" if integer else "numbers"
        raise IngestError(
            f"{where(None)}: column {name!r} must be a list of {kind}, not {col.type} "
            "(values are not converted)"
        )
    if col.null_count:
        i = int(np.flatnonzero(~col.is_valid().to_numpy(zero_copy_only=False))[0])
        raise IngestError(f"{where(i)}: {name} is null")
    offsets = col.offsets.to_numpy().astype(np.int64)
    values = col.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0]))
    offsets = offsets - offsets[0]
    if values.null_count:
        raise IngestError(f"{where(None)}: column {name!r} holds null elements")
    if not integer:
        return offsets, values.to_numpy(zero_copy_only=False)

    def where_value(j):
        return where(int(np.searchsorted(offsets, j, side="right") - 1))

    return offsets, _as_int64(values, name, where_value)


def _int_column(batch, name, where):
    col = batch.column(name)
    if not pa.types.is_integer(col.type):
        raise IngestError(f"{where(None)}: column {name!r} must be an integer, not {col.type}")
    if col.null_count:
        i = int(np.flatnonzero(~col.is_valid().to_numpy(zero_copy_only=False))[0])
        raise IngestError(f"{where(i)}: {name} is null")
    return _as_int64(col, name, where)


def _check_range(values: np.ndarray, name: str, lo: int, hi: int, why: str, where) -> None:
    bad = (values < lo) | (values > hi)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise IngestError(f"{where(i)}: {name} {int(values[i])} outside [{lo}, {hi}] ({why})")


def _batches(pf: pq.ParquetFile, path: Path, batch_rows: int, columns: list[str]):
    """pf's record batches; a damaged page becomes an error naming the file and row."""
    rows = 0
    batches = row_group_batches(pf, batch_rows, columns)
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except (OSError, pa.ArrowException) as err:
            raise IngestError(
                f"{path}: row {rows} onward: unreadable Parquet data ({err})"
            ) from None
        rows += batch.num_rows
        yield batch


def read_topk(paths, stats: dict, batch_positions: int = BATCH_ROWS):
    """Yield EntryBatch objects over every row of every file, in order."""
    seen_docs: set[int] = set()
    last_doc = None
    last_offset = 0
    stats.setdefault("documents", 0)
    stats.setdefault("skipped_documents", 0)
    for path in paths:
        path = Path(path)
        try:
            pf = pq.ParquetFile(str(path))
        except (OSError, pa.ArrowInvalid) as err:
            raise IngestError(f"{path}: not a readable Parquet file ({err})") from err
        names = pf.schema_arrow.names
        missing = [c for c in REQUIRED if c not in names]
        if missing:
            raise IngestError(f"{path}: missing column(s) {', '.join(missing)}")
        if pf.metadata.num_rows == 0:
            raise IngestError(f"{path}: empty file (no rows)")
        columns = list(REQUIRED) + [c for c in OPTIONAL if c in names]
        base = 0
        for batch in _batches(pf, path, batch_positions, columns):
            n = batch.num_rows

            def where(i, base=base, path=path):
                return f"{path}" if i is None else f"{path}: row {base + i}"

            doc = _int_column(batch, "doc_id", where)
            _check_range(doc, "doc_id", 0, DOC_ID_MAX, "what validate and aggregate accept", where)
            label = _int_column(batch, "label", where)
            id_off, ids = _list_parts(batch.column("ids"), "ids", where, integer=True)
            lp_off, lps = _list_parts(batch.column("logprobs"), "logprobs", where, integer=False)
            if not np.array_equal(id_off, lp_off):
                i = int(np.flatnonzero(np.diff(id_off) != np.diff(lp_off))[0])
                raise IngestError(
                    f"{where(i)}: lengths disagree: {id_off[i + 1] - id_off[i]} ids but "
                    f"{lp_off[i + 1] - lp_off[i]} logprobs"
                )
            lps = lps.astype(np.float64)
            # document order: a document's rows are contiguous
            change = np.flatnonzero(np.diff(doc) != 0) + 1
            starts = np.concatenate([[0], change]) if n else change
            for s in starts:
                d = int(doc[s])
                if d == last_doc and s == 0:
                    continue
                if d in seen_docs:
                    raise IngestError(
                        f"{where(int(s))}: doc_id {d} appears again after other documents "
                        "(rows must be in document order)"
                    )
                seen_docs.add(d)
                stats["documents"] += 1
            # offsets: given (strictly increasing within a document) or 1, 2, ...
            same_doc = np.concatenate([[doc[0] == last_doc], doc[1:] == doc[:-1]])
            if "offset" in batch.schema.names:
                offset = _int_column(batch, "offset", where)
                _check_range(offset, "offset", 1, INT32_MAX, "a token index >= 1, int32", where)
                prev = np.concatenate([[last_offset], offset[:-1]])
                bad = same_doc & (offset <= prev)
                if bad.any():
                    i = int(np.flatnonzero(bad)[0])
                    raise IngestError(
                        f"{where(i)}: offset {offset[i]} does not follow {prev[i]} "
                        "(rows must be in position order)"
                    )
            else:
                idx = np.arange(n)
                start_of = np.maximum.accumulate(np.where(~same_doc, idx, -1))
                offset = np.where(start_of >= 0, idx - start_of + 1, last_offset + 1 + idx)
                _check_range(offset, "offset", 1, INT32_MAX, "a token index >= 1, int32", where)
            row = np.repeat(np.arange(n), np.diff(id_off))
            topk = np.ones(len(ids), dtype=bool)
            has_label = np.bincount(row[ids == label[row]], minlength=n) > 0
            if "label_logprob" in batch.schema.names:
                ll_col = batch.column("label_logprob")
                if not _is_number(ll_col.type):
                    raise IngestError(
                        f"{where(None)}: column 'label_logprob' must be a number, not "
                        f"{ll_col.type} (values are not converted)"
                    )
                ll = pc.fill_null(ll_col, float("nan")).to_numpy(zero_copy_only=False)
                ll = ll.astype(np.float64)
                add = ~has_label & ~np.isnan(ll)
                # a label already among ids: its label_logprob must agree
                at = np.flatnonzero(ids == label[row])
                given = ll[row[at]]
                off = ~np.isnan(given) & (
                    np.abs(given - lps[at])
                    > LABEL_LOGPROB_TOLERANCE * np.maximum(1.0, np.abs(lps[at]))
                )
                if off.any():
                    j = int(np.flatnonzero(off)[0])
                    raise IngestError(
                        f"{where(int(row[at[j]]))}: label_logprob {float(given[j])!r} disagrees with "
                        f"the label's logprob {float(lps[at[j]])!r} in logprobs"
                    )
                extra = np.flatnonzero(add)
                row = np.concatenate([row, extra])
                ids = np.concatenate([ids, label[extra]])
                lps = np.concatenate([lps, ll[extra]])
                topk = np.concatenate([topk, np.zeros(len(extra), dtype=bool)])
            last_doc, last_offset = int(doc[-1]), int(offset[-1])
            yield EntryBatch(
                doc_id=doc,
                offset=offset,
                label=label,
                row=row,
                ids=ids,
                logprobs=lps,
                topk=topk,
                where=lambda i, where=where, doc=doc, offset=offset: (
                    f"{where(i)} (doc_id {doc[i]}, offset {offset[i]})"
                ),
            )
            base += n
