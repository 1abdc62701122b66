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

from pipeline.ingest.convert import EntryBatch, IngestError

REQUIRED = ("doc_id", "label", "ids", "logprobs")
OPTIONAL = ("offset", "label_logprob")
BATCH_ROWS = 65536
LABEL_LOGPROB_TOLERANCE = 1e-6


def _list_parts(col: pa.Array, name: str, where):
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    if not (pa.types.is_list(col.type) or pa.types.is_large_list(col.type)):
        raise IngestError(f"{where(None)}: column {name!r} must be a list, not {col.type}")
    if col.null_count:
        i = int(np.flatnonzero(~col.is_valid().to_numpy(zero_copy_only=False))[0])
        raise IngestError(f"{where(i)}: {name} is null")
    offsets = col.offsets.to_numpy().astype(np.int64)
    values = col.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0]))
    if values.null_count:
        raise IngestError(f"{where(None)}: column {name!r} holds null elements")
    return offsets - offsets[0], values.to_numpy(zero_copy_only=False)


def _int_column(batch, name, where):
    col = batch.column(name)
    if not pa.types.is_integer(col.type):
        raise IngestError(f"{where(None)}: column {name!r} must be an integer, not {col.type}")
    if col.null_count:
        i = int(np.flatnonzero(~col.is_valid().to_numpy(zero_copy_only=False))[0])
        raise IngestError(f"{where(i)}: {name} is null")
    return col.to_numpy(zero_copy_only=False).astype(np.int64)


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
        for batch in pf.iter_batches(batch_size=batch_positions, columns=columns):
            n = batch.num_rows

            def where(i, base=base, path=path):
                return f"{path}" if i is None else f"{path}: row {base + i}"

            doc = _int_column(batch, "doc_id", where)
            label = _int_column(batch, "label", where)
            id_off, ids = _list_parts(batch.column("ids"), "ids", where)
            lp_off, lps = _list_parts(batch.column("logprobs"), "logprobs", where)
            if not np.array_equal(id_off, lp_off):
                i = int(np.flatnonzero(np.diff(id_off) != np.diff(lp_off))[0])
                raise IngestError(
                    f"{where(i)}: lengths disagree: {id_off[i + 1] - id_off[i]} ids but "
                    f"{lp_off[i + 1] - lp_off[i]} logprobs"
                )
            ids = ids.astype(np.int64)
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
            row = np.repeat(np.arange(n), np.diff(id_off))
            topk = np.ones(len(ids), dtype=bool)
            has_label = np.bincount(row[ids == label[row]], minlength=n) > 0
            if "label_logprob" in batch.schema.names:
                ll_col = batch.column("label_logprob")
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
