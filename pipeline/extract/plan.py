"""Corpus side of extraction: tokenized documents -> shard plans -> batches of windows.

Shard boundaries depend only on the documents and ``shard_positions`` (a shard
closes at the first document boundary after it holds >= shard_positions rows),
and batches never cross a shard, so a run that is killed and resumed computes
every shard exactly as an uninterrupted run would.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pipeline.extract.errors import ExtractError
from pipeline.extract.settings import TOKENIZE_BLOCK
from pipeline.extract.windows import plan_windows


@dataclass
class ShardPlan:
    index: int
    doc_start: int
    doc_end: int = 0
    rows: int = 0
    skipped: int = 0
    docs: list = field(default_factory=list)  # [(doc_id, ids int64 array)]


def tokenized(tokenizer, documents, *, vocab_size: int | None = None, corpus=None):
    """Yield (doc_id, ids) from (doc_id, text), tokenizing blocks of documents at once.

    With `vocab_size`, a token id outside [0, K) is a clear error (the model's
    embedding would otherwise fail with an IndexError, or silently read garbage).
    """
    block: list = []

    def flush():
        encoded = tokenizer([t for _, t in block], verbose=False)["input_ids"]
        for (doc_id, _), ids in zip(block, encoded, strict=True):
            ids = np.asarray(ids, dtype=np.int64)
            if vocab_size is not None and len(ids) and (ids.max() >= vocab_size or ids.min() < 0):
                bad = np.unique(ids[(ids >= vocab_size) | (ids < 0)])
                shown = ", ".join(map(str, bad[:10].tolist())) + (" ..." if len(bad) > 10 else "")
                raise ExtractError(
                    f"corpus {corpus}, document {doc_id}: the tokenizer produced token id(s) "
                    f"{shown} outside the model's output width K = {vocab_size} (ids must be "
                    "< K); the tokenizer does not match the model (pass the right --tokenizer)"
                )
            yield doc_id, ids
        block.clear()

    for item in documents:
        block.append(item)
        if len(block) >= TOKENIZE_BLOCK:
            yield from flush()
    if block:
        yield from flush()


def plan_shards(tokens, *, first_index: int, first_doc: int, shard_positions: int):
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


def batches(plan: ShardPlan, *, max_length: int, stride: int, batch_size: int, pad_id: int):
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
