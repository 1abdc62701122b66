"""Read vLLM prompt-logprob dumps (offline JSON Lines or saved server responses).

Accepted records, one per line (JSON Lines) or all in one JSON list:

* offline API: ``{"prompt_token_ids": [...], "prompt_logprobs": [null, {id: v, ...}, ...]}``
  where ``v`` is ``{"logprob": lp, "rank": r, "decoded_token": s}`` or a bare
  float logprob, and ``id`` a token id (a JSON string key);
* a saved server response: ``{"choices": [{"prompt_logprobs": [...],
  "prompt_token_ids": [...]}, ...], ...}`` (each choice one document; fields
  missing from a choice are taken from the response's top level, and a
  top-level ``prompt_logprobs`` makes the response one document).

Position t >= 1 predicts ``prompt_token_ids[t]`` (its label); position 0
predicts nothing and is ignored.

Which entries are the dump's top-k (for the tail bound): with ranks, the
entries of ranks 1..j where 1..j is the longest run of ranks present (every
class outside the dump then has rank > j); without ranks (bare floats), every
entry but the label, or the label alone when the position holds nothing else
(a dump is assumed to hold at least the top-1).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from pipeline.ingest.convert import EntryBatch, IngestError

BATCH_POSITIONS = 16384


class _DuplicateKeys(dict):
    duplicate = None


def _pairs_hook(pairs):
    d = dict(pairs)
    if len(d) != len(pairs):
        d = _DuplicateKeys(d)
        seen = set()
        for key, _ in pairs:
            if key in seen:
                d.duplicate = key
                break
            seen.add(key)
    return d


def _loads(text: str):
    return json.loads(text, object_pairs_hook=_pairs_hook)


def iter_records(path: Path):
    """Yield (where, record) for every record of a file: where = 'FILE:LINE' or 'FILE: item I'."""
    with open(path, encoding="utf-8") as f:
        head = ""
        while True:
            ch = f.read(1)
            if not ch or not ch.isspace():
                head = ch
                break
        f.seek(0)
        if head == "":
            raise IngestError(f"{path}: empty file (no documents)")
        if head == "[":
            try:
                records = _loads(f.read())
            except json.JSONDecodeError as err:
                raise IngestError(f"{path}:{err.lineno}: not valid JSON ({err.msg})") from err
            if not isinstance(records, list) or not records:
                raise IngestError(f"{path}: empty JSON list (no documents)")
            for i, rec in enumerate(records):
                yield f"{path}: item {i}", rec
            return
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = _loads(line)
            except json.JSONDecodeError as err:
                raise IngestError(f"{path}:{line_no}: not valid JSON ({err.msg})") from err
            yield f"{path}:{line_no}", rec


def record_documents(where: str, rec):
    """The (token_ids, prompt_logprobs) documents of one record."""
    if not isinstance(rec, dict):
        raise IngestError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    if "choices" in rec and "prompt_logprobs" not in rec:
        choices = rec["choices"]
        if not isinstance(choices, list) or not choices:
            raise IngestError(f"{where}: 'choices' is empty")
        docs = []
        for c in choices:
            if not isinstance(c, dict):
                raise IngestError(f"{where}: a choice is not a JSON object")
            docs.append(
                (c.get("prompt_token_ids", rec.get("prompt_token_ids")), c.get("prompt_logprobs"))
            )
    else:
        docs = [(rec.get("prompt_token_ids"), rec.get("prompt_logprobs"))]
    for ids, logprobs in docs:
        if ids is None:
            raise IngestError(f"{where}: no prompt_token_ids")
        if logprobs is None:
            raise IngestError(
                f"{where}: no prompt_logprobs (score with SamplingParams(prompt_logprobs=k))"
            )
        if not isinstance(ids, list) or not isinstance(logprobs, list):
            raise IngestError(f"{where}: prompt_token_ids and prompt_logprobs must be lists")
        if len(ids) != len(logprobs):
            raise IngestError(
                f"{where}: lengths disagree: {len(ids)} prompt_token_ids but "
                f"{len(logprobs)} prompt_logprobs"
            )
    return docs


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


class _Collector:
    """Flat entry lists of whole documents, flushed as EntryBatch objects."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.doc_id, self.offset, self.label, self.where = [], [], [], []
        self.row, self.ids, self.lps, self.topk = [], [], [], []

    def __len__(self):
        return len(self.label)

    def batch(self) -> EntryBatch:
        names = self.where
        b = EntryBatch(
            doc_id=np.asarray(self.doc_id, dtype=np.int64),
            offset=np.asarray(self.offset, dtype=np.int64),
            label=np.asarray(self.label, dtype=np.int64),
            row=np.asarray(self.row, dtype=np.int64),
            ids=np.asarray(self.ids, dtype=np.int64),
            logprobs=np.asarray(self.lps, dtype=np.float64),
            topk=np.asarray(self.topk, dtype=bool),
            where=lambda i: names[i],
        )
        self.reset()
        return b

    def add_document(self, where: str, doc_id: int, token_ids: list, logprobs: list) -> None:
        for t in range(1, len(token_ids)):
            here = f"{where}: position {t}"
            label = token_ids[t]
            if not isinstance(label, int) or isinstance(label, bool):
                raise IngestError(f"{here}: prompt_token_ids[{t}] = {label!r} is not a token id")
            d = logprobs[t]
            if not isinstance(d, dict):
                raise IngestError(f"{here}: expected a {{token_id: logprob}} object, got {d!r}")
            if isinstance(d, _DuplicateKeys):
                raise IngestError(f"{here}: token id {d.duplicate} appears twice")
            row = len(self.label)
            ids, lps, ranks = [], [], []
            for key, v in d.items():
                try:
                    tok = int(key)
                except ValueError:
                    raise IngestError(f"{here}: key {key!r} is not a token id") from None
                if isinstance(v, dict):
                    lp, rank = v.get("logprob"), v.get("rank")
                else:
                    lp, rank = v, None
                if not _number(lp):
                    raise IngestError(f"{here}: logprob of token {tok} is {lp!r}, not a number")
                ids.append(tok)
                lps.append(lp)
                ranks.append(rank if _number(rank) else None)
            if ranks and all(r is not None for r in ranks):
                present = set(ranks)
                j = 0
                while j + 1 in present:
                    j += 1
                flags = [r <= j for r in ranks]
            else:
                flags = [tok != label or len(ids) == 1 for tok in ids]
            self.doc_id.append(doc_id)
            self.offset.append(t)
            self.label.append(label)
            self.where.append(here)
            self.row.extend([row] * len(ids))
            self.ids.extend(ids)
            self.lps.extend(lps)
            self.topk.extend(flags)


def read_vllm(paths, stats: dict, batch_positions: int = BATCH_POSITIONS):
    """Yield EntryBatch objects over every document of every file, in order.

    ``stats`` receives ``documents`` and ``skipped_documents`` (fewer than 2 tokens).
    """
    collector = _Collector()
    doc_id = 0
    stats.setdefault("documents", 0)
    stats.setdefault("skipped_documents", 0)
    for path in paths:
        path = Path(path)
        found = 0
        for where, rec in iter_records(path):
            for token_ids, logprobs in record_documents(where, rec):
                found += 1
                stats["documents"] += 1
                if len(token_ids) < 2:
                    stats["skipped_documents"] += 1
                else:
                    collector.add_document(where, doc_id, token_ids, logprobs)
                doc_id += 1
            if len(collector) >= batch_positions:
                yield collector.batch()
        if found == 0:
            raise IngestError(f"{path}: empty file (no documents)")
    if len(collector):
        yield collector.batch()
