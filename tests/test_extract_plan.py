"""Batches do not depend on the world size (issue 21): the documents of a slice
form batch groups of batch_size consecutive documents, torchrun ranks take whole
groups, and a batch never mixes two groups, so every rank split (and every
shard size) feeds the model exactly the batches one process feeds it."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.extract.plan import (
    batch_group,
    batches,
    plan_shards,
    rank_documents,
    rank_of_group,
)


def _corpus(seed: int, n_docs: int = 41):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 40, n_docs)  # some documents have < 2 tokens
    return [(d, rng.integers(0, 100, int(n)).astype(np.int64)) for d, n in enumerate(lengths)]


def _rank_batches(docs, *, slice_, rank, world, batch_size, shard_positions):
    """What run_extraction feeds the model on `rank`: (doc_id, batch) in order."""
    i, n = slice_

    def group_of(d):
        return batch_group(d, n, batch_size)

    mine = [(d, ids) for d, ids in docs if d % n == i and rank_of_group(group_of(d), world) == rank]
    plans = list(
        plan_shards(
            iter(mine),
            first_index=0,
            first_doc=0,
            shard_positions=shard_positions,
            group_of=group_of,
        )
    )
    out = [
        b
        for plan in plans
        for b in batches(plan, max_length=12, stride=5, batch_size=batch_size, pad_id=0)
    ]
    return out, plans


def _key(batch) -> bytes:
    return b"".join(batch[k].tobytes() for k in sorted(batch))


@pytest.mark.parametrize("batch_size", [1, 3, 8])
@pytest.mark.parametrize("slice_", [(0, 1), (1, 3)])
def test_every_world_size_runs_the_same_batches(batch_size, slice_):
    docs = _corpus(seed=batch_size)
    one, _ = _rank_batches(
        docs, slice_=slice_, rank=0, world=1, batch_size=batch_size, shard_positions=10**9
    )
    assert one
    for world in (2, 3, 5):
        for shard_positions in (1, 37, 10**9):
            split = []
            for rank in range(world):
                got, _ = _rank_batches(
                    docs,
                    slice_=slice_,
                    rank=rank,
                    world=world,
                    batch_size=batch_size,
                    shard_positions=shard_positions,
                )
                split += got
            assert sorted(map(_key, split)) == sorted(map(_key, one)), (world, shard_positions)


@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_a_batch_holds_one_group_and_shards_close_between_groups(batch_size):
    docs = _corpus(seed=7)
    for rank in range(2):
        got, plans = _rank_batches(
            docs, slice_=(0, 1), rank=rank, world=2, batch_size=batch_size, shard_positions=20
        )
        for b in got:
            assert len(b["inputs"]) <= batch_size
            groups = set((b["doc_id"] // batch_size).tolist())  # slice 0/1: index = doc_id
            assert len(groups) == 1 and groups.pop() % 2 == rank
        for prev, nxt in zip(plans[:-1], plans[1:], strict=True):
            last = max(d for d, _, _ in prev.docs) if prev.docs else prev.doc_end - 1
            first = min(d for d, _, _ in nxt.docs) if nxt.docs else nxt.doc_start
            assert last // batch_size != first // batch_size
            assert nxt.doc_start == prev.doc_end


def test_rank_documents_counts_the_groups_of_a_rank():
    for docs in range(0, 40):
        for g in (1, 3, 8):
            for world in (1, 2, 3):
                counts = [rank_documents(docs, g, r, world) for r in range(world)]
                want = [sum(1 for j in range(docs) if (j // g) % world == r) for r in range(world)]
                assert counts == want
