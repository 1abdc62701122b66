"""In-loop metric benchmark: TokenCalibrationError.update cost per 1k positions.

    python -m benchmarks.bench_tmetrics --out DIR [--quick] [--device cpu|cuda]

Random float32 logits [N, K] (scaled so that distributions are peaked, as a
trained LM's are) go through ``TokenCalibrationError(K).update`` in batches of
``--batch`` positions, with and without ``classwise=True``. In the same run
the bare ``torch.log_softmax`` of the same batches is timed: the ratio says
what the metric costs on top of turning logits into probabilities at all
(which an evaluation computing its loss already pays). Best of 3 repeats.
Writes DIR/tmetrics.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _best_seconds(fn, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure(n: int, k: int, batch: int, device: str, scale: float) -> dict:
    import torch

    sys.path.insert(0, str(ROOT))
    from pipeline.integrations.torchmetrics import TokenCalibrationError

    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(n, k, generator=g) * scale).to(device)
    labels = torch.randint(0, k, (n,), generator=g).to(device)
    batches = [(logits[i : i + batch], labels[i : i + batch]) for i in range(0, n, batch)]

    def sync():
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    def bare():
        for x, _ in batches:
            torch.log_softmax(x, dim=-1)
        sync()

    result = {"N": n, "K": k, "batch": batch, "device": device, "logit_scale": scale}
    result["log_softmax_s"] = _best_seconds(bare)
    for classwise in (False, True):
        metric = TokenCalibrationError(k, classwise=classwise).to(device)

        def run(metric=metric):
            for x, y in batches:
                metric.update(x, y)
            sync()

        seconds = _best_seconds(run)
        name = "classwise" if classwise else "pooled"
        result[f"{name}_s"] = seconds
        result[f"{name}_ms_per_1k_positions"] = seconds / n * 1000 * 1000
        result[f"{name}_over_log_softmax"] = seconds / result["log_softmax_s"]
        metric.compute()  # the values are checked in tests; here it must just run
    return result


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--quick", action="store_true", help="N=1,024 (well under a minute)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--vocab", type=int, default=32_000)
    ap.add_argument("--positions", type=int, default=4_096)
    ap.add_argument("--batch", type=int, default=1_024)
    ap.add_argument("--logit-scale", type=float, default=4.0)
    args = ap.parse_args(argv)
    n = 1_024 if args.quick else args.positions
    result = measure(n, args.vocab, min(args.batch, n), args.device, args.logit_scale)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tmetrics.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
