"""Former home of the extraction loop, kept so old imports keep working.

The code now lives in: settings.py (defaults, checks), plan.py (documents ->
shard plans -> batches), pipeline.store.writer (shard files, atomic commits),
rundir.py (run directory: create, resume, verify), writer.py (RunWriter),
dist.py (torchrun) and loop.py (run_extraction).
"""

from __future__ import annotations

from pipeline.extract.loop import forward_logits, run_extraction
from pipeline.extract.plan import ShardPlan
from pipeline.extract.settings import STORES, parse_slice
from pipeline.store.writer import ShardWriter as ShardSink

__all__ = ["STORES", "ShardPlan", "ShardSink", "forward_logits", "parse_slice", "run_extraction"]
