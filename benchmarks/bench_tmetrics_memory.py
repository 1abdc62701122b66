"""Host memory of ``TokenCalibrationError(K, classwise=True)``: resident set size
(RSS) at construction, after ``update()``, and the peaks of ``update()``,
``forward()``, ``compute()`` and ``reset()``, on CPU.

    python -m benchmarks.bench_tmetrics_memory --out DIR [--quick] [--vocab K]

Each variant runs in a fresh process. RSS is psutil's; a phase's peak is the
kernel's high-water mark (VmHWM of /proc/self/status, reset before the phase by
writing 5 to /proc/self/clear_refs), all as the increase over the RSS before
construction (the batch of logits already allocated). Two variants:

* ``expanded_default``: the metric as it is (torchmetrics' reset default of
  each [K, S] state is one zero expanded to [K, S]);
* ``dense_default``: the same with a dense [K, S] zero as that default, what
  torchmetrics keeps when a state is registered as is (``add_state`` deep-copies
  it into ``Metric._defaults``).

The per-class state is ``16 K S`` bytes (S = 885 for the paper's M): 453.1 MB
at K = 32,000. Writes DIR/tmetrics_memory.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MB = 1e6

_CHILD = r"""
import gc, json, sys
import psutil, torch
from pipeline.integrations.torchmetrics import TokenCalibrationError

k, batch, variant = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
proc = psutil.Process()

def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")

def peak():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")

g = torch.Generator().manual_seed(0)
logits = torch.randn(batch, k, generator=g) * 4
labels = torch.randint(0, k, (batch,), generator=g)
torch.tensor([1.0]).sum()  # torch's lazy initialisation, before the baseline
gc.collect()
base = proc.memory_info().rss
out = {}

def phase(name, fn):
    gc.collect()
    reset_peak()
    result = fn()
    gc.collect()
    out[name + "_peak"] = peak() - base
    out[name + "_after"] = proc.memory_info().rss - base
    return result

def construct():
    metric = TokenCalibrationError(k, classwise=True)
    if variant == "dense_default":
        for name in ("class_hits", "class_p_sum"):
            d = metric._defaults[name]
            metric._defaults[name] = torch.zeros(d.shape, dtype=d.dtype)
    return metric

metric = phase("construct", construct)
phase("update", lambda: metric.update(logits, labels))
phase("forward", lambda: metric(logits, labels))
phase("compute", metric.compute)
phase("reset", metric.reset)
print(json.dumps(out))
"""


def measure(k: int, batch: int, variant: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(k), str(batch), variant],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise SystemExit(f"{variant}: the measuring process failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--quick", action="store_true", help="K = 4,000 (seconds)")
    ap.add_argument("--vocab", type=int, default=32_000)
    ap.add_argument("--batch", type=int, default=256, help="positions per update/forward")
    args = ap.parse_args(argv)
    from pipeline.defaults import PAPER_BINS

    k = 4_000 if args.quick else args.vocab
    s = sum(PAPER_BINS)
    result = {
        "K": k,
        "S": s,
        "batch_positions": args.batch,
        "state_bytes": 16 * k * s,
        "logits_batch_bytes": 4 * k * args.batch,
        "unit": "bytes over the RSS before construction",
        "variants": {},
    }
    for variant in ("expanded_default", "dense_default"):
        result["variants"][variant] = measure(k, args.batch, variant)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tmetrics_memory.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"K = {k}, S = {s}: per-class state {result['state_bytes'] / MB:.1f} MB")
    names = list(result["variants"]["expanded_default"])
    print(f"{'MB':<18}" + "".join(f"{v:>18}" for v in result["variants"]))
    for name in names:
        row = [result["variants"][v][name] / MB for v in result["variants"]]
        print(f"{name:<18}" + "".join(f"{x:>18.1f}" for x in row))
    return result


if __name__ == "__main__":
    main()
