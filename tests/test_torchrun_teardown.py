"""Issue 21: a torchrun job exits 0 every time, not only most times.

Each test runs a real 2-process gloo job (torchrun, OMP_NUM_THREADS=1, as a
scheduler would) 20 times and requires every run to exit 0 with no
`terminate called` on standard error: once the extraction of `fullece
extract`, once the DDP synchronisation of `TokenCalibrationError`. Before the
fix, rank 0 sometimes aborted (SIGABRT) after the run was complete (see
docs/scale.md, "Teardown"). The 20 jobs run two at a time (each torchrun
--standalone has its own rendezvous port and output directory): a job is
CPU-bound only part of its life (the launcher alone, then its two ranks), so
two overlap on two cores, and a teardown racing a neighbour's work is, if
anything, more exposed than one on an idle machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from pipeline.store.manifest import load_manifest  # noqa: E402
from tests.helpers.extract_models import synthetic_texts, write_corpus  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FULLECE = Path(sys.executable).parent / "fullece"
RUNS = 20
AT_ONCE = 2

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not FULLECE.exists(), reason="the fullece entry point is not installed"),
]


def _env():
    return dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")


def _torchrun_jobs(commands) -> list[subprocess.CompletedProcess]:
    """Each command as a 2-rank torchrun job, AT_ONCE jobs at a time, in order."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    results = []
    for start in range(0, len(commands), AT_ONCE):
        jobs = [
            subprocess.Popen(
                [*launcher, "--nproc-per-node", "2", *cmd],
                cwd=ROOT,
                env=_env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
            for cmd in commands[start : start + AT_ONCE]
        ]
        for job in jobs:
            out, err = job.communicate(timeout=600)
            results.append(subprocess.CompletedProcess(job.args, job.returncode, out, err))
    return results


def _check_runs(results) -> None:
    failed = [
        f"run {i}: exit {r.returncode}: {r.stderr.decode()[-1500:]}"
        for i, r in enumerate(results)
        if r.returncode != 0 or b"terminate called" in r.stderr
    ]
    assert len(results) == RUNS
    assert not failed, f"{len(failed)} of {RUNS} runs failed:\n" + "\n".join(failed)


def test_twenty_torchrun_extractions_exit_0(tmp_path, tiny_gpt2):
    """The command of issue 21, 20 times (each into a new run directory)."""
    model = tiny_gpt2
    corpus = write_corpus(tmp_path / "c.txt", synthetic_texts(12, seed=5, max_words=25))
    commands = []
    for i in range(RUNS):
        args = ["--model", str(model), "--corpus", str(corpus), "--out", str(tmp_path / f"run{i}")]
        args += ["--k", "16", "--tau", "0.001", "--max-length", "32", "--stride", "16"]
        args += ["--shard-positions", "500", "--device", "cpu"]
        commands.append(["--no-python", str(FULLECE), "extract", *args])
    results, positions = _torchrun_jobs(commands), set()
    for i, result in enumerate(results):
        if result.returncode == 0:
            manifest = load_manifest(tmp_path / f"run{i}")
            assert manifest["complete"] and manifest["settings"]["world_size"] == 2
            positions.add(manifest["positions"])
    _check_runs(results)
    assert len(positions) == 1


_DDP_WORKER = r"""
import json, os, sys
import torch
import torch.distributed as dist
from pipeline.integrations.torchmetrics import TokenCalibrationError

rank = int(os.environ["RANK"])
dist.init_process_group("gloo")
g = torch.Generator().manual_seed(11)
k = 23
logits = torch.randn(7, 13, k, generator=g) * 3
labels = torch.randint(0, k, (7, 13), generator=g)
share = slice(0, 3) if rank == 0 else slice(3, None)
metric = TokenCalibrationError(k, n_bins=(5, 10), classwise=True)
metric.update(logits[share], labels[share])
values = {name: float(v) for name, v in metric.compute().items()}
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as fh:
    json.dump(values, fh)
dist.destroy_process_group()
"""


def test_twenty_ddp_metric_jobs_exit_0(tmp_path):
    """A user's DDP evaluation with TokenCalibrationError (its states synchronised
    over gloo in compute()), 20 times under torchrun."""
    worker = tmp_path / "worker.py"
    worker.write_text(_DDP_WORKER)
    for i in range(RUNS):
        (tmp_path / f"job{i}").mkdir()
    results = _torchrun_jobs([[str(worker), str(tmp_path / f"job{i}")] for i in range(RUNS)])
    values = []
    for i, result in enumerate(results):
        out = tmp_path / f"job{i}"
        if result.returncode == 0:
            per_rank = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
            assert per_rank[0] == per_rank[1]  # both ranks get the values of all data
            values.append(per_rank[0])
    _check_runs(results)
    assert all(v == values[0] for v in values)
