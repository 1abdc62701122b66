"""Synthetic run directories for the analysis tests, written straight from the
documented formats (pipeline/store/schema.py, schemas/manifest.v1.schema.json): no extraction
code involved.

Everything starts from a dense case: logits [n, K], their float32 logsumexp,
the probability of record ``float32 exp(float32(logit) - logsumexp)`` and
labels. A top-k run keeps top-k U {p > tau} U {label} per position with the
tail summarised per position and per class; a full run stores the logits in
Zarr v3. Both can be compared with the dense matrix itself.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.store.hashes import path_sha256
from pipeline.store.schema import CLASS_TAIL, POSITIONS, POSITIONS_V1, POSITIONS_V2

MANIFEST_SCHEMA = Path(__file__).resolve().parents[2] / "schemas" / "manifest.v1.schema.json"


@dataclass
class DenseCase:
    logits: np.ndarray  # [n, K] as stored (float16 or float32)
    lse: np.ndarray  # [n] float32
    probs: np.ndarray  # [n, K] float32, the probability of record
    labels: np.ndarray  # [n] int64
    doc_ids: np.ndarray  # [n] int64, non-decreasing

    @property
    def n(self) -> int:
        return self.probs.shape[0]

    @property
    def vocab_size(self) -> int:
        return self.probs.shape[1]


def float32_lse(x32: np.ndarray) -> np.ndarray:
    m = x32.max(axis=1)
    s = np.exp(x32 - m[:, None]).sum(axis=1, dtype=np.float64)
    return (m.astype(np.float64) + np.log(s)).astype(np.float32)


def dense_case(
    n: int = 300,
    vocab_size: int = 50,
    *,
    seed: int = 0,
    docs: int = 20,
    scale: float = 3.0,
    temperature: float = 1.4,
    dtype=np.float32,
    zipf: float = 1.0,
) -> DenseCase:
    """A random dense case. Labels are drawn from softmax(logits / temperature):
    temperature != 1 makes the model miscalibrated (overconfident for > 1)."""
    rng = np.random.default_rng(seed)
    # frequent classes get larger logits on average (a Zipf-like vocabulary)
    prior = -zipf * np.log(np.arange(1, vocab_size + 1))
    logits = (rng.standard_normal((n, vocab_size)) * scale + prior).astype(dtype)
    x32 = logits.astype(np.float32)
    lse = float32_lse(x32)
    probs = np.exp(x32 - lse[:, None]).astype(np.float32)
    t = x32.astype(np.float64) / temperature
    q = np.exp(t - t.max(axis=1, keepdims=True))
    q /= q.sum(axis=1, keepdims=True)
    u = rng.random(n)
    labels = np.minimum((q.cumsum(axis=1) < u[:, None]).sum(axis=1), vocab_size - 1)
    cuts = np.sort(rng.choice(np.arange(1, n), size=min(docs, n) - 1, replace=False))
    doc_ids = np.zeros(n, np.int64)
    doc_ids[cuts] = 1
    doc_ids = np.cumsum(doc_ids) * 3 + 7  # arbitrary, non-contiguous ids
    return DenseCase(logits, lse, probs, labels.astype(np.int64), doc_ids)


def kept_mask(probs: np.ndarray, labels: np.ndarray, k: int, tau: float | None) -> np.ndarray:
    n, K = probs.shape
    order = np.argsort(-probs, axis=1, kind="stable")
    mask = np.zeros((n, K), bool)
    np.put_along_axis(mask, order[:, : min(k, K)], True, axis=1)
    if tau is not None:
        mask |= probs > np.float32(tau)
    mask[np.arange(n), labels] = True
    return mask


def positions_table(
    case: DenseCase, rows: slice, k: int, tau: float | None, positions_version: int = 3
):
    """(positions pa.Table, class tail_count [K], class tail_mass [K]) of some rows.

    positions_version 3 (the newest) carries sum_p2 and non-null kept elements;
    2 the same columns, elements nullable; 1 the older layout without sum_p2."""
    P = case.probs[rows]
    y = case.labels[rows]
    n, K = P.shape
    mask = kept_mask(P, y, k, tau)
    counts = mask.sum(axis=1)
    offsets = np.zeros(n + 1, np.int32)
    np.cumsum(counts, out=offsets[1:])
    r, c = np.nonzero(mask)  # row-major: ids ascending within a row
    tail = np.where(mask, np.float32(0), P)
    tail_mass = tail.sum(axis=1, dtype=np.float64)
    tail_max = tail.max(axis=1).astype(np.float32)
    top1 = P.argmax(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        ent = -np.where(P > 0, P * np.log(P), 0).sum(axis=1)
    table = pa.table(
        {
            "doc_id": pa.array(case.doc_ids[rows], pa.int64()),
            "window": pa.array(np.zeros(n, np.int32)),
            "offset": pa.array(np.arange(1, n + 1, dtype=np.int32)),
            "label": pa.array(y.astype(np.int32)),
            "label_prob": pa.array(P[np.arange(n), y]),
            "top1_id": pa.array(top1.astype(np.int32)),
            "top1_prob": pa.array(P[np.arange(n), top1]),
            "entropy": pa.array(ent.astype(np.float32)),
            "kept_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(c.astype(np.int32))),
            "kept_probs": pa.ListArray.from_arrays(pa.array(offsets), pa.array(P[r, c])),
            "tail_count": pa.array((K - counts).astype(np.int32)),
            "tail_mass": pa.array(tail_mass),
            "tail_max": pa.array(tail_max),
            "sum_p2": pa.array(np.square(P.astype(np.float64)).sum(axis=1)),
        }
    ).cast(POSITIONS)
    if positions_version == 2:
        table = table.cast(POSITIONS_V2)
    if positions_version == 1:
        table = table.drop_columns(["sum_p2"]).cast(POSITIONS_V1)
    class_count = (~mask).sum(axis=0).astype(np.int64)
    class_mass = tail.sum(axis=0, dtype=np.float64)
    return table, class_count, class_mass


def write_run(
    run_dir,
    case: DenseCase,
    *,
    store: str = "topk",
    k: int = 5,
    tau: float | None = None,
    shard_rows: int = 100,
    label: str | None = None,
    zarr_chunk_rows: int = 32,
    positions_version: int = 3,
) -> dict:
    """Write a run directory (manifest + shards) holding `case`; returns the manifest."""
    run_dir = Path(run_dir)
    (run_dir / "shards").mkdir(parents=True, exist_ok=True)
    K = case.vocab_size
    shards = []
    for index, start in enumerate(range(0, case.n, shard_rows)):
        rows = slice(start, min(case.n, start + shard_rows))
        table, class_count, class_mass = positions_table(case, rows, k, tau, positions_version)
        names = {
            "positions": f"shards/positions-{index:05d}.parquet",
            "class_tail": f"shards/class_tail-{index:05d}.parquet",
            "logits": f"shards/logits-{index:05d}.zarr" if store == "full" else None,
        }
        pq.write_table(table, run_dir / names["positions"], row_group_size=64)
        pq.write_table(
            pa.table(
                {
                    "class_id": np.arange(K, dtype=np.int32),
                    "tail_count": class_count,
                    "tail_mass": class_mass,
                },
                schema=CLASS_TAIL,
            ),
            run_dir / names["class_tail"],
        )
        if store == "full":
            write_zarr(
                run_dir / names["logits"], case.logits[rows], case.lse[rows], zarr_chunk_rows
            )
        files = {rel: path_sha256(run_dir / rel) for rel in names.values() if rel}
        tail_max = float(table.column("tail_max").to_numpy().max())
        shards.append(
            {"index": index, "rows": table.num_rows, "tail_max": tail_max, **names, "files": files}
        )
    tail_max = max(s["tail_max"] for s in shards)
    from pipeline.core.binning import m_exact_from_tail_max

    manifest = {
        "schema_version": 1,
        "tool": {"name": "fullece", "version": "test"},
        "created": "2024-01-01T00:00:00Z",
        "label": label or run_dir.name,
        "model": {
            "path": f"/models/{label or run_dir.name}",
            "architecture": "synthetic",
            "dtype": "float32",
            "files": {},
        },
        "tokenizer": {"path": "/models/tok", "files": {}},
        "corpus": {
            "path": "/corpus/test.txt",
            "format": "txt",
            "sha256": "0" * 64,
            "documents": int(np.unique(case.doc_ids).size),
        },
        "settings": {
            "store": store,
            "k": k,
            "tau": 1.0 if tau is None else tau,  # no threshold: nothing has p > 1
            "max_length": 64,
            "stride": 32,
            "batch_size": 8,
            "device": "cpu",
            "dtype": "float32",
            "shard_positions": shard_rows,
            "slice": [0, 1],
        },
        "store": store,
        "vocab_size": K,
        "shards": shards,
        "positions": case.n,
        "skipped_documents": 0,
        "tail_max": tail_max if store == "topk" else 0.0,
        "m_exact": m_exact_from_tail_max(tail_max) if store == "topk" else None,
        "complete": True,
    }
    # the helper writes only what the documented manifest schema allows
    validate_json(manifest, json.loads(MANIFEST_SCHEMA.read_text()))
    (run_dir / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return manifest


def write_zarr(path, logits: np.ndarray, lse: np.ndarray, chunk_rows: int = 32) -> None:
    import zarr
    from zarr.codecs import BloscCodec

    n, K = logits.shape
    group = zarr.open_group(str(path), mode="w", zarr_format=3)
    group.attrs.update({"fullece.schema_version": 1, "fullece.table": "logits"})
    codec = BloscCodec(typesize=logits.dtype.itemsize, cname="zstd", clevel=1, shuffle="shuffle")
    arr = group.create_array(
        "logits",
        shape=(n, K),
        chunks=(min(chunk_rows, n), K),
        dtype=logits.dtype,
        compressors=codec,
    )
    arr[:] = logits
    lse_arr = group.create_array("logsumexp", shape=(n,), chunks=(max(n, 1),), dtype=np.float32)
    lse_arr[:] = lse


# ----------------------------------------------------------- dense reference


def ref_bins(values, M: int) -> np.ndarray:
    """max(ceil(float64(p) * M), 1), the literal rule."""
    return np.maximum(np.ceil(np.asarray(values, np.float32).astype(np.float64) * M), 1).astype(
        np.int64
    )


def dense_reference(probs: np.ndarray, labels: np.ndarray, M: int) -> dict:
    """ECE, cw-ECE (all K classes) and Full-ECE at M, per-bin literal formulas."""
    P32 = np.asarray(probs, np.float32)
    P = P32.astype(np.float64)
    N, K = P.shape
    y = np.asarray(labels)
    B = ref_bins(P32, M)
    Y = np.zeros((N, K))
    Y[np.arange(N), y] = 1
    top1 = P32.argmax(axis=1)
    conf = P[np.arange(N), top1]
    cb = B[np.arange(N), top1]
    correct = (top1 == y).astype(np.float64)
    ece = sum(abs(correct[cb == m].sum() - conf[cb == m].sum()) for m in range(1, M + 1)) / N
    cw = 0.0
    for m in range(1, M + 1):
        inb = B == m
        cw += np.abs((Y * inb).sum(axis=0) - (P * inb).sum(axis=0)).sum()
    cw /= N * K
    full = sum(abs((Y * (B == m)).sum() - (P * (B == m)).sum()) for m in range(1, M + 1)) / N
    return {"ece": ece, "cw_ece": cw, "full_ece": full}


def dense_doc_full_ece(probs, labels, doc_ids, M: int) -> dict:
    """Per-document Full-ECE at M (a document's positions only)."""
    out = {}
    for d in np.unique(doc_ids):
        rows = doc_ids == d
        out[int(d)] = dense_reference(probs[rows], labels[rows], M)["full_ece"]
    return out


# ------------------------------------------------- a small JSON Schema check


def validate_json(obj, schema: dict, path: str = "$") -> None:
    """The JSON Schema subset our schemas use (type, const, enum, required,
    properties, additionalProperties, items, minItems, maxItems, minimum,
    maximum, oneOf). Raises AssertionError naming the path."""
    types = schema.get("type")
    if types is not None:
        types = [types] if isinstance(types, str) else types
        pytypes = {
            "object": dict,
            "array": list,
            "string": str,
            "boolean": bool,
            "null": type(None),
            "integer": int,
            "number": (int, float),
        }
        ok = any(
            isinstance(obj, pytypes[t])
            and not (t in ("integer", "number") and isinstance(obj, bool))
            for t in types
        )
        assert ok, f"{path}: {obj!r} is not of type {types}"
    if "const" in schema:
        assert obj == schema["const"], f"{path}: {obj!r} != {schema['const']!r}"
    if "enum" in schema:
        assert obj in schema["enum"], f"{path}: {obj!r} not in {schema['enum']}"
    if "oneOf" in schema:
        matches = 0
        for sub in schema["oneOf"]:
            try:
                validate_json(obj, sub, path)
                matches += 1
            except AssertionError:
                pass
        assert matches == 1, f"{path}: matches {matches} of oneOf"
    if isinstance(obj, (int, float)) and not isinstance(obj, bool):
        if "minimum" in schema:
            assert obj >= schema["minimum"], f"{path}: {obj} < {schema['minimum']}"
        if "maximum" in schema:
            assert obj <= schema["maximum"], f"{path}: {obj} > {schema['maximum']}"
    if isinstance(obj, dict):
        for key in schema.get("required", []):
            assert key in obj, f"{path}: missing {key!r}"
        props = schema.get("properties", {})
        if schema.get("additionalProperties") is False:
            extra = set(obj) - set(props)
            assert not extra, f"{path}: unexpected {sorted(extra)}"
        for key, sub in props.items():
            if key in obj:
                validate_json(obj[key], sub, f"{path}.{key}")
    if isinstance(obj, list):
        if "minItems" in schema:
            assert len(obj) >= schema["minItems"], f"{path}: fewer than {schema['minItems']} items"
        if "maxItems" in schema:
            assert len(obj) <= schema["maxItems"], f"{path}: more than {schema['maxItems']} items"
        if "items" in schema:
            for i, item in enumerate(obj):
                validate_json(item, schema["items"], f"{path}[{i}]")


def dense_reference_tables(probs, labels, doc_ids, F: int = 1000) -> dict:
    """The bin tables of a dense case at fine grid F, built literally from the
    definitions (one np.add.at per column, no pipeline code), as dense arrays:
    class_* [K, F+1], top1_* [F+1], tokens [K], seq_* keyed by (doc, bin)."""
    P32 = np.asarray(probs, np.float32)
    P = P32.astype(np.float64)
    N, K = P.shape
    y = np.asarray(labels)
    B = ref_bins(P32, F)
    cls = np.broadcast_to(np.arange(K), (N, K))
    Y = np.zeros((N, K), np.int64)
    Y[np.arange(N), y] = 1
    out = {
        k: np.zeros((K, F + 1), t)
        for k, t in (("n", np.int64), ("p_sum", float), ("hits", np.int64))
    }
    np.add.at(out["n"], (cls, B), 1)
    np.add.at(out["p_sum"], (cls, B), P)
    np.add.at(out["hits"], (cls, B), Y)
    top1 = P32.argmax(axis=1)
    conf = P[np.arange(N), top1]
    tb = B[np.arange(N), top1]
    correct = (top1 == y).astype(np.int64)
    top = {
        k: np.zeros(F + 1, t)
        for k, t in (("n", np.int64), ("conf_sum", float), ("correct", np.int64))
    }
    np.add.at(top["n"], tb, 1)
    np.add.at(top["conf_sum"], tb, conf)
    np.add.at(top["correct"], tb, correct)
    docs, d = np.unique(np.asarray(doc_ids), return_inverse=True)
    dd = np.broadcast_to(d[:, None], (N, K))
    seq = {
        k: np.zeros((docs.size, F + 1), float)
        for k in ("n", "p_sum", "hits", "top1_n", "conf_sum", "correct")
    }
    np.add.at(seq["n"], (dd, B), 1)
    np.add.at(seq["p_sum"], (dd, B), P)
    np.add.at(seq["hits"], (dd, B), Y)
    np.add.at(seq["top1_n"], (d, tb), 1)
    np.add.at(seq["conf_sum"], (d, tb), conf)
    np.add.at(seq["correct"], (d, tb), correct)
    return {
        "class": out,
        "top1": top,
        "tokens": {
            "label_count": np.bincount(y, minlength=K),
            "top1_count": np.bincount(top1, minlength=K),
            "p_mass": P.sum(axis=0),
        },
        "seq_ids": docs,
        "seq": seq,
    }


def assert_tables_match_dense(tables, ref: dict, atol: float = 1e-12) -> None:
    """A BinTables equals the literal dense tables, cell by cell."""
    K, F = tables.vocab_size, tables.fine_bins
    cb = tables.class_bins
    for key in ("n", "p_sum", "hits"):
        got = np.zeros((K, F + 1))
        np.add.at(got, (cb.ids, cb.bins), cb.values[key])
        np.testing.assert_allclose(
            got, ref["class"][key], rtol=0, atol=atol, err_msg=f"class_bins.{key}"
        )
    for key, arr in (
        ("n", tables.top1_n),
        ("conf_sum", tables.top1_conf_sum),
        ("correct", tables.top1_correct),
    ):
        np.testing.assert_allclose(
            arr, ref["top1"][key][1:], rtol=0, atol=atol, err_msg=f"top1_bins.{key}"
        )
    for key in ("label_count", "top1_count", "p_mass"):
        np.testing.assert_allclose(
            getattr(tables, key), ref["tokens"][key], rtol=0, atol=atol, err_msg=key
        )
    sb = tables.seq_bins
    row = np.searchsorted(ref["seq_ids"], sb.ids)
    assert np.array_equal(ref["seq_ids"][row], sb.ids), "seq_bins: unknown seq_id"
    for key, want in ref["seq"].items():
        got = np.zeros_like(want)
        np.add.at(got, (row, sb.bins), sb.values[key])
        np.testing.assert_allclose(got, want, rtol=0, atol=atol, err_msg=f"seq_bins.{key}")


def assert_table_columns_equal(a, b, atol: float = 1e-12) -> None:
    """Two BinTables' Arrow tables row for row: integer columns identical, float
    sums within `atol` (only the order of float additions may differ)."""
    ta, tb = a.to_arrow(), b.to_arrow()
    for name in ta:
        x, y = ta[name], tb[name]
        assert x.num_rows == y.num_rows, name
        for col in x.column_names:
            u, v = x.column(col).to_numpy(), y.column(col).to_numpy()
            if np.issubdtype(u.dtype, np.integer):
                np.testing.assert_array_equal(u, v, err_msg=f"{name}.{col}")
            else:
                np.testing.assert_allclose(u, v, rtol=0, atol=atol, err_msg=f"{name}.{col}")
