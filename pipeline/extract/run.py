"""The extraction loop: corpus -> tokens -> windows -> batches -> device -> shards.

Shard boundaries depend only on the documents and ``shard_positions`` (a shard
closes at the first document boundary after it holds >= shard_positions rows),
and batches never cross a shard, so a run that is killed and resumed computes
every shard exactly as an uninterrupted run would.

A shard is written into ``shards/.shard-NNNNN.tmp/``, renamed into place, and
committed by rewriting manifest.json (atomically) with it listed; whatever the
manifest does not list is removed on resume. Writing runs on one background
thread, overlapping with the next batch's compute.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pyarrow as pa

from pipeline import __version__
from pipeline.extract.corpus import check_corpus, count_documents, detect_format, iter_documents
from pipeline.extract.errors import ExtractError, NonFiniteLogitsError
from pipeline.extract.windows import plan_windows
from pipeline.store.atomic import fsync_dir
from pipeline.store.manifest import (
    MANIFEST_NAME,
    file_sha256,
    load_manifest,
    path_sha256,
    save_manifest,
    summarize_shards,
)
from pipeline.store.schema import SCHEMA_VERSION
from pipeline.store.shards import (
    SHARDS_DIR,
    create_logits_store,
    positions_batch,
    positions_writer,
    shard_names,
    write_class_tail,
    zarr_chunk_rows,
)

STORES = ("topk", "full")
ROW_GROUP_ROWS = 16384
TOKENIZE_BLOCK = 256
MAX_PENDING_WRITES = 3
DEFAULT_TOPK_SHARD_POSITIONS = 1 << 20
DEFAULT_FULL_SHARD_BYTES = 4 << 30
DEFAULT_MAX_LENGTH_CAP = 2048
# Settings a resumed run must share with the run it continues.
IDENTITY_KEYS = ("model", "tokenizer", "corpus", "settings", "store", "vocab_size")


def parse_slice(value) -> tuple[int, int]:
    """'i/n' (0 <= i < n) or (i, n) -> (i, n)."""
    if isinstance(value, str):
        try:
            i, n = (int(x) for x in value.split("/"))
        except ValueError as err:
            raise ExtractError(f"--slice {value!r}: expected i/n, e.g. 0/4") from err
    else:
        i, n = (int(x) for x in value)
    if not (n >= 1 and 0 <= i < n):
        raise ExtractError(f"--slice {i}/{n}: need n >= 1 and 0 <= i < n (slices are 0-based)")
    return i, n


@dataclass
class ShardPlan:
    index: int
    doc_start: int
    doc_end: int = 0
    rows: int = 0
    skipped: int = 0
    docs: list = field(default_factory=list)  # [(doc_id, ids int64 array)]


# ------------------------------------------------------------------ corpus side


def _tokenized(tokenizer, documents):
    """Yield (doc_id, ids) from (doc_id, text), tokenizing blocks of documents at once."""
    block: list = []

    def flush():
        encoded = tokenizer([t for _, t in block], verbose=False)["input_ids"]
        for (doc_id, _), ids in zip(block, encoded, strict=True):
            yield doc_id, np.asarray(ids, dtype=np.int64)
        block.clear()

    for item in documents:
        block.append(item)
        if len(block) >= TOKENIZE_BLOCK:
            yield from flush()
    if block:
        yield from flush()


def _plan_shards(tokens, *, first_index: int, first_doc: int, shard_positions: int):
    """Group tokenized documents into shards; the last plan may hold 0 rows."""
    plan = ShardPlan(first_index, first_doc)
    for doc_id, ids in tokens:
        plan.doc_end = doc_id + 1
        if len(ids) < 2:
            plan.skipped += 1
            continue
        plan.docs.append((doc_id, ids))
        plan.rows += len(ids) - 1
        if plan.rows >= shard_positions:
            yield plan
            plan = ShardPlan(plan.index + 1, plan.doc_end)
    yield plan


def _batches(plan: ShardPlan, *, max_length: int, stride: int, batch_size: int, pad_id: int):
    """Yield batches (dict of numpy arrays) of up to batch_size windows, in document order."""
    windows = []
    for doc_id, ids in plan.docs:
        for w, (begin, end, first) in enumerate(plan_windows(len(ids), max_length, stride)):
            windows.append((doc_id, w, begin, end, first, ids))
    for s in range(0, len(windows), batch_size):
        group = windows[s : s + batch_size]
        width = max(end - begin for _, _, begin, end, _, _ in group)
        inputs = np.full((len(group), width), pad_id, dtype=np.int64)
        doc_ids, wins, offsets, index = [], [], [], []
        for j, (doc_id, w, begin, end, first, ids) in enumerate(group):
            inputs[j, : end - begin] = ids[begin:end]
            off = np.arange(first, end, dtype=np.int64)
            offsets.append(off)
            index.append(j * width + (off - begin - 1))
            doc_ids.append(np.full(len(off), doc_id, dtype=np.int64))
            wins.append(np.full(len(off), w, dtype=np.int32))
        offsets = np.concatenate(offsets)
        doc_ids = np.concatenate(doc_ids)
        labels = np.concatenate([ids[first:end] for _, _, _, end, first, ids in group])
        yield {
            "inputs": inputs,
            "index": np.concatenate(index),
            "doc_id": doc_ids,
            "window": np.concatenate(wins),
            "offset": offsets.astype(np.int32),
            "label": labels.astype(np.int32),
        }


# ------------------------------------------------------------------ writer side


class ShardSink:
    """Writes one shard at a time into a temporary directory, then commits it.

    Every method runs on the single writer thread, in submission order.
    """

    def __init__(self, run_dir: Path, manifest: dict, store: str, vocab_size: int):
        self.run_dir = run_dir
        self.manifest = manifest
        self.store = store
        self.vocab = vocab_size
        self.tmp: Path | None = None

    def begin(self, index: int, rows: int) -> None:
        self.index = index
        self.rows = rows
        self.tmp = self.run_dir / SHARDS_DIR / f".shard-{index:05d}.tmp"
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(parents=True)
        self.names = shard_names(index)
        self.writer = positions_writer(self.tmp / "positions.parquet")
        self.pending: list[pa.RecordBatch] = []
        self.pending_rows = 0
        self.written = 0
        self.tail_max = np.float32(0)
        self.logits = self.lse = None
        self.logit_buf: list[np.ndarray] = []
        self.lse_buf: list[np.ndarray] = []
        self.logit_rows = 0  # rows written to Zarr
        self.buf_rows = 0

    def add(self, cols: dict) -> None:
        batch = positions_batch(cols)
        if len(cols["tail_max"]):
            self.tail_max = max(self.tail_max, np.float32(cols["tail_max"].max()))
        self.pending.append(batch)
        self.pending_rows += batch.num_rows
        if self.pending_rows >= ROW_GROUP_ROWS:
            self._flush_rows(final=False)
        if self.store == "full":
            for chunk in cols["logits"]:
                self._add_logits(chunk)
            self.lse_buf.append(cols["logsumexp"])
            self._flush_logits(final=False)

    def _flush_rows(self, final: bool) -> None:
        if not self.pending:
            return
        table = pa.Table.from_batches(self.pending)
        cut = table.num_rows if final else (table.num_rows // ROW_GROUP_ROWS) * ROW_GROUP_ROWS
        if cut:
            self.writer.write_table(table.slice(0, cut), row_group_size=ROW_GROUP_ROWS)
            self.written += cut
        rest = table.slice(cut)
        self.pending = rest.to_batches() if rest.num_rows else []
        self.pending_rows = rest.num_rows

    def _add_logits(self, chunk: np.ndarray) -> None:
        if self.logits is None:
            self.logits, self.lse = create_logits_store(
                self.tmp / "logits.zarr",
                self.rows,
                self.vocab,
                chunk.dtype,
                zarr_chunk_rows(self.vocab, chunk.dtype.itemsize),
            )
        elif chunk.dtype != self.logits.dtype:
            # bfloat16 logits that float16 cannot hold exactly: the shard becomes float32.
            if self.logits.dtype == np.float16:
                self._upgrade_to_float32()
            chunk = chunk.astype(self.logits.dtype)
        self.logit_buf.append(chunk)
        self.buf_rows += chunk.shape[0]

    def _upgrade_to_float32(self) -> None:
        done = self.logits[: self.logit_rows] if self.logit_rows else None
        lse_done = self.lse[: self.logit_rows] if self.logit_rows else None
        shutil.rmtree(self.tmp / "logits.zarr")
        self.logits, self.lse = create_logits_store(
            self.tmp / "logits.zarr",
            self.rows,
            self.vocab,
            np.float32,
            zarr_chunk_rows(self.vocab, 4),
        )
        self.logit_buf = [b.astype(np.float32) for b in self.logit_buf]
        if done is not None:
            self.logit_buf.insert(0, done.astype(np.float32))
            self.lse_buf.insert(0, lse_done)
            self.buf_rows += self.logit_rows
            self.logit_rows = 0

    def _flush_logits(self, final: bool) -> None:
        if self.logits is None or not self.buf_rows:
            return
        step = self.logits.chunks[0]
        cut = self.buf_rows if final else (self.buf_rows // step) * step
        if not cut:
            return
        data = np.concatenate(self.logit_buf) if len(self.logit_buf) > 1 else self.logit_buf[0]
        lse = np.concatenate(self.lse_buf) if len(self.lse_buf) > 1 else self.lse_buf[0]
        a, b = self.logit_rows, self.logit_rows + cut
        self.logits[a:b] = data[:cut]
        self.lse[a:b] = lse[:cut]
        self.logit_rows = b
        self.logit_buf = [data[cut:]] if cut < len(data) else []
        self.lse_buf = [lse[cut:]] if cut < len(lse) else []
        self.buf_rows -= cut

    def commit(self, plan_meta: dict, tail_count: np.ndarray, tail_mass: np.ndarray) -> dict:
        self._flush_rows(final=True)
        self.writer.close()
        if self.written != self.rows:
            raise RuntimeError(
                f"shard {self.index}: wrote {self.written} rows, planned {self.rows}"
            )
        files = {"positions": self.tmp / "positions.parquet"}
        write_class_tail(self.tmp / "class_tail.parquet", tail_count, tail_mass)
        files["class_tail"] = self.tmp / "class_tail.parquet"
        logits_dtype = None
        if self.store == "full":
            self._flush_logits(final=True)
            if self.logit_rows != self.rows:
                raise RuntimeError(
                    f"shard {self.index}: wrote {self.logit_rows} logit rows, planned {self.rows}"
                )
            files["logits"] = self.tmp / "logits.zarr"
            logits_dtype = str(self.logits.dtype)
        entry = {
            "index": self.index,
            "rows": int(self.rows),
            **plan_meta,
            "tail_max": float(self.tail_max),
            "positions": self.names["positions"],
            "class_tail": self.names["class_tail"],
            "logits": self.names["logits"] if self.store == "full" else None,
            "logits_dtype": logits_dtype,
            "files": {},
        }
        for key, tmp_path in files.items():
            entry["files"][self.names[key]] = path_sha256(tmp_path)
        for key, tmp_path in files.items():
            final = self.run_dir / self.names[key]
            if final.is_dir():
                shutil.rmtree(final)
            os.replace(tmp_path, final)
        fsync_dir(self.run_dir / SHARDS_DIR)
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp = None
        self.manifest["shards"].append(entry)
        summarize_shards(self.manifest)
        save_manifest(self.run_dir, self.manifest)  # the commit point
        return entry

    def abort(self) -> None:
        try:
            if getattr(self, "writer", None) is not None:
                self.writer.close()
        except Exception:  # noqa: BLE001 - best effort on the error path
            pass
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)


# ------------------------------------------------------------------ run directory


def _clean_uncommitted(run_dir: Path, manifest: dict) -> None:
    """Remove shard files and temporaries that the manifest does not list."""
    shards = run_dir / SHARDS_DIR
    if not shards.exists():
        return
    listed = {Path(rel).name for s in manifest["shards"] for rel in s["files"]}
    for entry in shards.iterdir():
        if entry.name in listed:
            continue
        if entry.name.startswith(".") or entry.name.startswith(
            ("positions-", "class_tail-", "logits-")
        ):
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


def _identity_diff(old: dict, new: dict) -> list[str]:
    diffs = []
    for key in IDENTITY_KEYS:
        a, b = old.get(key), new.get(key)
        if key in ("model", "tokenizer"):
            a, b = (a or {}).get("files"), (b or {}).get("files")
        elif key == "corpus":
            pick = ("sha256", "format", "text_field")
            a = {k: (old.get(key) or {}).get(k) for k in pick}
            b = {k: (new.get(key) or {}).get(k) for k in pick}
        if a != b:
            if isinstance(a, dict) and isinstance(b, dict):
                keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
                diffs.append(f"{key} ({', '.join(keys)})")
            else:
                diffs.append(key)
    return diffs


def _prepare_run_dir(out: Path, fresh: dict, overwrite: bool) -> dict:
    """The manifest to continue: the existing one (same run) or `fresh` (new run)."""
    if out.exists() and not out.is_dir():
        raise ExtractError(f"--out {out}: exists and is not a directory")
    existing = out / MANIFEST_NAME
    if overwrite and out.exists():
        existing.unlink(missing_ok=True)
        for sub in (SHARDS_DIR, "tables"):
            shutil.rmtree(out / sub, ignore_errors=True)
    if existing.exists():
        old = load_manifest(out)
        diffs = _identity_diff(old, fresh)
        if diffs:
            raise ExtractError(
                f"--out {out} holds a different run (differs in: {'; '.join(diffs)}); "
                "pass --overwrite to replace it, or choose another directory"
            )
        return old
    if out.exists() and any(out.iterdir()):
        raise ExtractError(
            f"--out {out}: directory is not empty and holds no fullece run; "
            "pass --overwrite or choose another directory"
        )
    out.mkdir(parents=True, exist_ok=True)
    save_manifest(out, fresh)
    return fresh


# ------------------------------------------------------------------ the run


def run_extraction(
    model,
    corpus,
    out,
    *,
    store: str = "topk",
    k: int = 64,
    tau: float = 1e-3,
    max_length: int | None = None,
    stride: int | None = None,
    batch_size: int = 8,
    device: str = "auto",
    dtype: str = "auto",
    shard_positions: int | None = None,
    slice=(0, 1),  # noqa: A002 - mirrors --slice
    text_field: str = "text",
    corpus_format: str | None = None,
    tokenizer: str | None = None,
    label: str | None = None,
    chunk_elements: int | None = None,
    overwrite: bool = False,
    progress: bool = True,
) -> dict:
    """Run the causal LM in directory `model` over `corpus`, writing run directory `out`.

    store: "topk" (Parquet kept entries + tail) or "full" (Zarr logits as well).
    k, tau: kept entries = top-k ∪ {p > tau} ∪ {label}.
    max_length / stride: window length and step for long documents (defaults:
    the model's context, capped at 2048, and half of it).
    shard_positions: a shard closes at the first document boundary after this
    many rows (default 2**20 for topk; about 4 GiB of logits for full).
    slice: (i, n) or "i/n": only documents with doc_id % n == i.
    Returns the manifest (also in out/manifest.json). Rerunning with the same
    arguments resumes after the last committed shard.
    """
    t_start = time.perf_counter()
    model_dir = Path(model)
    corpus = Path(corpus)
    out = Path(out)
    if store not in STORES:
        raise ExtractError(f"--store {store!r}: use one of {', '.join(STORES)}")
    if int(k) < 0:
        raise ExtractError(f"--k {k}: must be >= 0")
    if not 0.0 <= float(tau) < 1.0:
        raise ExtractError(f"--tau {tau}: must lie in [0, 1)")
    if int(batch_size) < 1:
        raise ExtractError(f"--batch-size {batch_size}: must be >= 1")
    slice_i, slice_n = parse_slice(slice)
    fmt = detect_format(corpus, corpus_format)
    check_corpus(corpus, fmt, text_field)
    n_docs = count_documents(corpus, fmt, text_field)
    if n_docs == 0:
        raise ExtractError(f"corpus {corpus}: holds no documents")
    slice_docs = len(range(slice_i, n_docs, slice_n))
    if slice_docs == 0:
        raise ExtractError(f"--slice {slice_i}/{slice_n}: empty for a corpus of {n_docs} documents")

    from pipeline.extract import model as hf

    config = hf.read_config(model_dir)
    tok_dir = Path(tokenizer) if tokenizer else model_dir
    if not tok_dir.is_dir():
        raise ExtractError(f"tokenizer directory {tok_dir} does not exist")
    dev = hf.resolve_device(device)

    import torch

    from pipeline.extract.kernel import ClassTail, score_rows, tau_threshold

    lm, vocab = hf.load_model(model_dir, device=dev, dtype=dtype)
    tok = hf.load_tokenizer(tok_dir)
    if int(k) > vocab:
        raise ExtractError(f"--k {k} is larger than the model's output width K = {vocab}")
    ctx = hf.context_length(lm)
    if max_length is None:
        max_length = min(ctx or DEFAULT_MAX_LENGTH_CAP, DEFAULT_MAX_LENGTH_CAP)
    max_length = int(max_length)
    if max_length < 2:
        raise ExtractError(f"--max-length {max_length}: must be >= 2")
    if ctx is not None and max_length > ctx:
        raise ExtractError(f"--max-length {max_length} exceeds the model's context of {ctx} tokens")
    stride = int(stride) if stride is not None else max(1, max_length // 2)
    if not 1 <= stride < max_length:
        raise ExtractError(f"--stride {stride}: need 1 <= stride < max-length ({max_length})")
    if shard_positions is None:
        shard_positions = (
            DEFAULT_TOPK_SHARD_POSITIONS
            if store == "topk"
            else max(1024, DEFAULT_FULL_SHARD_BYTES // (2 * vocab))
        )
    shard_positions = int(shard_positions)
    if shard_positions < 1:
        raise ExtractError(f"--shard-positions {shard_positions}: must be >= 1")
    chunk_elements = int(chunk_elements or ((1 << 26) if dev == "cuda" else (1 << 20)))
    chunk_rows = max(1, chunk_elements // vocab)

    model_files = hf.directory_files(model_dir)
    tok_files = (
        model_files if tok_dir.resolve() == model_dir.resolve() else hf.directory_files(tok_dir)
    )
    settings = {
        "store": store,
        "k": int(k),
        "tau": float(tau),
        "max_length": max_length,
        "stride": stride,
        "batch_size": int(batch_size),
        "device": dev,
        "dtype": dtype,
        "shard_positions": shard_positions,
        "slice": [slice_i, slice_n],
        "chunk_rows": chunk_rows,
    }
    fresh = {
        "schema_version": SCHEMA_VERSION,
        "tool": {"name": "fullece", "version": __version__},
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "label": label or model_dir.resolve().name,
        "model": {
            "path": str(model_dir.resolve()),
            "architecture": (config.get("architectures") or [type(lm).__name__])[0],
            "dtype": str(next(lm.parameters()).dtype).replace("torch.", ""),
            "files": model_files,
        },
        "tokenizer": {"path": str(tok_dir.resolve()), "files": tok_files},
        "corpus": {
            "path": str(corpus.resolve()),
            "format": fmt,
            "text_field": text_field,
            "sha256": file_sha256(corpus),
            "documents": n_docs,
            "slice_documents": slice_docs,
        },
        "settings": settings,
        "store": store,
        "vocab_size": vocab,
        "shards": [],
        "positions": 0,
        "skipped_documents": 0,
        "tail_max": 0.0,
        "m_exact": None,
        "complete": False,
    }
    manifest = _prepare_run_dir(out, fresh, overwrite)
    if manifest.get("complete"):
        return manifest
    _clean_uncommitted(out, manifest)
    (out / SHARDS_DIR).mkdir(exist_ok=True)
    shards = manifest["shards"]
    resume_doc = shards[-1]["doc_end"] if shards else 0
    done_docs = sum(s["documents"] + s["skipped"] for s in shards)
    done_rows = sum(s["rows"] for s in shards)

    documents = (
        (d, text)
        for d, text in iter_documents(corpus, fmt, text_field)
        if d >= resume_doc and d % slice_n == slice_i
    )
    plans = _plan_shards(
        _tokenized(tok, documents),
        first_index=len(shards),
        first_doc=resume_doc,
        shard_positions=shard_positions,
    )
    tau32 = tau_threshold(float(tau))
    pad_id = 0
    sink = ShardSink(out, manifest, store, vocab)
    bar = _progress_bar(progress, done_rows)
    pending: deque = deque()
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fullece-writer")
    trailing_skipped = 0
    planned_rows, planned_docs = done_rows, done_docs
    t_loop = time.perf_counter()

    def submit(fn, *args):
        pending.append(executor.submit(fn, *args))
        while len(pending) > MAX_PENDING_WRITES:
            pending.popleft().result()

    try:
        with torch.inference_mode():
            for plan in plans:
                if plan.rows == 0:
                    trailing_skipped = plan.skipped
                    break
                tails = ClassTail(vocab, dev)
                planned_rows += plan.rows
                planned_docs += len(plan.docs) + plan.skipped
                _estimate_total(bar, planned_rows, planned_docs, slice_docs)
                submit(sink.begin, plan.index, plan.rows)
                for batch in _batches(
                    plan,
                    max_length=max_length,
                    stride=stride,
                    batch_size=int(batch_size),
                    pad_id=pad_id,
                ):
                    scored = _score_batch(
                        lm,
                        batch,
                        dev,
                        vocab,
                        score_rows,
                        tails,
                        corpus,
                        k=int(k),
                        tau32=tau32,
                        full=store == "full",
                        chunk_rows=chunk_rows,
                    )
                    submit(sink.add, scored)
                    done_rows += len(batch["label"])
                    bar.update(len(batch["label"]))
                count, mass = tails.to_numpy()
                meta = {
                    "doc_start": plan.doc_start,
                    "doc_end": plan.doc_end,
                    "documents": len(plan.docs),
                    "skipped": plan.skipped,
                }
                submit(sink.commit, meta, count, mass)
            while pending:
                pending.popleft().result()
    except BaseException:
        for fut in pending:
            try:
                fut.result()
            except BaseException:  # noqa: BLE001 - the first error is the one raised
                pass
        executor.submit(sink.abort).result()
        raise
    finally:
        executor.shutdown(wait=True)
        bar.close()
    t_end = time.perf_counter()

    manifest["skipped_documents"] = int(sum(s["skipped"] for s in shards) + trailing_skipped)
    summarize_shards(manifest)
    if manifest["positions"] == 0:
        raise ExtractError(
            f"corpus {corpus}: no document (of slice {slice_i}/{slice_n}) has 2 or more tokens"
        )
    manifest["complete"] = True
    manifest["timing"] = {
        "load_seconds": round(t_loop - t_start, 3),
        "loop_seconds": round(t_end - t_loop, 3),
    }
    save_manifest(out, manifest)
    return manifest


def _score_batch(lm, batch, dev, vocab, score_rows, tails, corpus, **kw) -> dict:
    import torch

    inputs = torch.from_numpy(batch["inputs"]).to(dev)
    logits = forward_logits(lm, inputs)
    if logits.shape[-1] != vocab:
        raise ExtractError(
            f"the model's logits have width {logits.shape[-1]}, expected K = {vocab}"
        )
    flat = logits.reshape(-1, vocab)
    index = torch.from_numpy(batch["index"]).to(dev)
    labels = torch.from_numpy(batch["label"].astype(np.int64)).to(dev)
    try:
        scored = score_rows(flat, index, labels, class_tail=tails, **kw)
    except NonFiniteLogitsError as err:
        row = err.args[0]
        raise NonFiniteLogitsError(
            f"the model produced a NaN or infinite logit at document {int(batch['doc_id'][row])} "
            f"of {corpus}, offset {int(batch['offset'][row])} (predicting token "
            f"{int(batch['label'][row])}); extraction stopped, committed shards are kept"
        ) from None
    for key in ("doc_id", "window", "offset", "label"):
        scored[key] = batch[key]
    return scored


def forward_logits(lm, inputs):
    """The bare forward pass: logits [B, L, K] in the model's output precision.

    Windows are right-padded; a causal model's logits at real tokens do not
    depend on the padding after them, so no attention mask is needed.
    """
    return lm(input_ids=inputs, use_cache=False).logits


def _progress_bar(enabled: bool, initial: int):
    from tqdm import tqdm

    return tqdm(
        total=None,
        initial=initial,
        unit="pos",
        unit_scale=True,
        dynamic_ncols=True,
        file=sys.stderr,
        disable=not enabled,
        desc="extract",
        smoothing=0.1,
    )


def _estimate_total(bar, rows: int, docs: int, slice_docs: int) -> None:
    """Total positions of the slice, extrapolated from the documents planned so far."""
    if docs:
        bar.total = max(rows, int(round(rows / docs * slice_docs)))
        bar.refresh()
