"""The embedded default experiment: ``fullece default extract`` and ``fullece default metrics``.

No weights or data sets can be downloaded, so the default makes its own:

``default extract`` (``make extract``)
    1. builds the default corpus from the docstrings of the standard library and of
       the pinned packages ``make install`` installs (``pipeline.demo.corpus``;
       skipped when it is already there for this Python and these versions),
       or uses the user's ``train.*``/``test.*`` in ``--corpus-dir`` or the
       files given by ``--train-corpus``/``--test-corpus``;
    2. trains the tokenizer and the small GPT-2 in a single pass over the training
       split, with log-uniform checkpoints from T/8 to T (``pipeline.demo.train``;
       skipped when they exist, resumed when interrupted);
    3. extracts every checkpoint on the test split into ``RUNS_DIR/<checkpoint>``
       (top-k store, k = 64, tau = 1/1000, so every M of the paper is exact;
       a run already complete is skipped, an interrupted one resumes).

``default metrics`` (``make metrics``)
    aggregates every run of ``RUNS_DIR`` and prints the metrics at the paper's
    M per checkpoint, the paper's Table 1 (RSD of cw-ECE and Full-ECE over M),
    the token-frequency shares of the test set, the Full-ECE trend across
    checkpoints (the paper's Figure 2), whether the runs are in the paper's
    regime (single pass, >= 5 checkpoints past the near-uniform start, >= 100,000
    test positions), a verdict per finding computed from these numbers, with
    measured reasons where one is not reproduced (each figure against its noise
    floor, Full-ECE's growth in M above its floor's, what cancels inside its
    coarse bins: docs/default-experiment.md, "Measured reasons"), then
    writes the HTML report and ``report/default_summary.json`` and prints the
    report's path. docs/default-experiment.md describes it all.
"""

from __future__ import annotations

import json
import math
import sys
import textwrap
import time
from pathlib import Path

from pipeline.defaults import PAPER_BINS
from pipeline.errors import FulleceError
from pipeline.store.atomic import write_json

SUMMARY_FILE = "default.json"
CORPUS_SUFFIXES = (".txt", ".jsonl", ".parquet")
TREND_M = 10
# What the paper reports (quoted in the output next to the measured values).
PAPER_NEVER, PAPER_RARE = 0.30, 0.41  # share of the vocabulary seen 0 and 1-10 times
# The paper's regime (its 7B pre-training, 5,000 test sentences), as the default checks it:
MIN_TEST_POSITIONS = 100_000
MIN_CHECKPOINTS = 5
NEAR_UNIFORM_MAX_PROB = 0.2  # a checkpoint whose largest probability is at most this is
# still in the near-uniform start of training, where Full-ECE says little
CANCELLED_LEGEND = (
    "cancelled: how much of Full-ECE's sum over the fine bins (share) cancels inside "
    'the M coarse bins (docs/default-experiment.md, "Measured reasons")'
)
FINDING_NAMES = {
    "table1": "Table 1 (stability in M)",
    "frequency": "token frequency",
    "trend": "Figure 2 (trend)",
}


class DefaultError(FulleceError):
    """The default experiment cannot go on (a missing checkpoint, a failed step)."""


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ------------------------------------------------------------------ extract


def _find_split(directory: Path, split: str) -> Path | None:
    for suffix in CORPUS_SUFFIXES:
        path = directory / f"{split}{suffix}"
        if path.exists():
            return path
    return None


def resolve_corpus(corpus_dir, train_corpus=None, test_corpus=None, *, log=_log) -> dict:
    """The train/test files of the default: given, the user's, or the built default corpus."""
    from pipeline.demo.corpus import CORPUS_JSON, build_default_corpus, describe

    corpus_dir = Path(corpus_dir)
    t0 = time.perf_counter()
    if (train_corpus is None) != (test_corpus is None):
        raise DefaultError("give both --train-corpus and --test-corpus, or neither")
    if train_corpus is not None:
        info = {
            "source": "given",
            "train_path": str(Path(train_corpus).resolve()),
            "test_path": str(Path(test_corpus).resolve()),
            "skipped": True,
        }
        log(f"corpus: using {train_corpus} (train) and {test_corpus} (test)")
    elif (
        not (corpus_dir / CORPUS_JSON).exists()
        and _find_split(corpus_dir, "train")
        and _find_split(corpus_dir, "test")
    ):
        info = {
            "source": "user",
            "skipped": True,
            "train_path": str(_find_split(corpus_dir, "train").resolve()),
            "test_path": str(_find_split(corpus_dir, "test").resolve()),
        }
        log(f"corpus: using the user's corpus in {corpus_dir} (no {CORPUS_JSON}: not rebuilt)")
    else:
        info = dict(build_default_corpus(corpus_dir), source="default")
        state = "already there, kept" if info["skipped"] else f"built in {info['build_seconds']}s"
        log(f"{describe(info)} [{state}]")
    for key in ("train_path", "test_path"):
        if not Path(info[key]).exists():
            raise DefaultError(f"corpus file {info[key]} does not exist")
    info["seconds"] = round(time.perf_counter() - t0, 2)
    return info


def run_default_extract(
    corpus_dir="data/corpus",
    models_dir="data/models",
    runs_dir="runs",
    *,
    train_corpus=None,
    test_corpus=None,
    train_options: dict | None = None,
    k: int = 64,
    tau: float = 1e-3,
    batch_size: int = 8,
    device: str = "auto",
    progress: bool = True,
    log=_log,
) -> dict:
    """Corpus -> checkpoints -> one run per checkpoint. Returns the summary (also in RUNS_DIR/default.json)."""
    from pipeline.demo.train import train_model

    t_all = time.perf_counter()
    runs_dir = Path(runs_dir)
    corpus = resolve_corpus(corpus_dir, train_corpus, test_corpus, log=log)

    t0 = time.perf_counter()
    options = dict(train_options or {})
    if Path(corpus["train_path"]).suffix != ".txt":
        options.setdefault("text_field", "text")
    checkpoints = train_model(
        corpus["train_path"], models_dir, progress=progress, log=log, **options
    )
    t_train = time.perf_counter() - t0

    from pipeline.extract import ExtractError, run_extraction

    runs = []
    t_extract = time.perf_counter()
    for ckpt in checkpoints:
        out = runs_dir / ckpt.name
        t0 = time.perf_counter()
        settings = dict(
            store="topk",
            k=k,
            tau=tau,
            batch_size=batch_size,
            device=device,
            label=ckpt.name,
            progress=progress,
        )
        was_complete = _run_complete(out)
        try:
            manifest = run_extraction(ckpt, corpus["test_path"], out, **settings)
        except ExtractError as err:
            if not (out / "manifest.json").exists():
                raise DefaultError(str(err)) from err
            # a run of an earlier model (retrained checkpoints): replace it
            log(f"extract: {out} holds a run of another model or corpus; replacing it")
            manifest = run_extraction(ckpt, corpus["test_path"], out, overwrite=True, **settings)
            was_complete = False
        seconds = time.perf_counter() - t0
        state = "already complete, kept" if was_complete else f"{seconds:.1f}s"
        log(
            f"extract: {ckpt.name} -> {out}: {manifest['positions']:,} positions, "
            f"K = {manifest['vocab_size']}, M_exact = {manifest.get('m_exact') or 'every M'} "
            f"[{state}]"
        )
        runs.append(
            {
                "checkpoint": str(ckpt),
                "run": str(out),
                "positions": manifest["positions"],
                "m_exact": manifest.get("m_exact"),
                "seconds": round(seconds, 2),
                "skipped": was_complete,
            }
        )
    summary = {
        "corpus": {
            k_: corpus.get(k_)
            for k_ in ("source", "train_path", "test_path", "skipped", "seconds", "python", "files")
            if k_ in corpus
        },
        "models_dir": str(Path(models_dir)),
        "training": _training_summary(models_dir, t_train),
        "runs": runs,
        "extract_seconds": round(time.perf_counter() - t_extract, 2),
        "total_seconds": round(time.perf_counter() - t_all, 2),
    }
    write_json(runs_dir / SUMMARY_FILE, summary)
    log(
        f"default extract: done in {summary['total_seconds']:.1f}s (corpus {corpus['seconds']:.1f}s, "
        f"training {t_train:.1f}s, extraction {summary['extract_seconds']:.1f}s); "
        f"next: fullece default metrics --runs-dir {runs_dir}"
    )
    return summary


def _run_complete(run_dir: Path) -> bool:
    try:
        return bool(json.loads((run_dir / "manifest.json").read_text()).get("complete"))
    except (OSError, ValueError):
        return False


def _training_summary(models_dir, seconds: float) -> dict:
    from pipeline.demo.train import PLAN_FILE

    try:
        plan = json.loads((Path(models_dir) / PLAN_FILE).read_text())
    except (OSError, ValueError):
        plan = {}
    keep = (
        "settings",
        "steps",
        "tokens_per_step",
        "checkpoint_steps",
        "train_seconds",
        "tokens_per_second",
        "tokenizer_seconds",
        "threads",
    )
    out = {k: plan[k] for k in keep if k in plan}
    if "corpus" in plan:
        out["train_tokens"] = plan["corpus"].get("tokens")
        out["train_documents"] = plan["corpus"].get("documents")
    out["seconds_this_call"] = round(seconds, 2)
    return out


# ------------------------------------------------------------------ metrics


def find_runs(runs_dir) -> list[Path]:
    """Run directories under runs_dir (those with a manifest), by training step then name."""
    runs_dir = Path(runs_dir)
    if not runs_dir.is_dir():
        raise DefaultError(f"{runs_dir}: no such directory (run `make extract` first)")
    runs = [p for p in sorted(runs_dir.iterdir()) if (p / "manifest.json").is_file()]
    if not runs:
        raise DefaultError(f"{runs_dir}: holds no runs (run `make extract` first)")
    return sorted(runs, key=lambda p: (_training_info(p).get("step", math.inf), p.name))


def _training_info(run_dir: Path) -> dict:
    """training.json of the checkpoint a run was extracted from ({} when unknown)."""
    try:
        manifest = json.loads((run_dir / "manifest.json").read_text())
        model = Path(manifest["model"]["path"])
        return json.loads((model / "training.json").read_text())
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def position_stats(run_dir) -> dict:
    """From the positions shards: mean negative log-likelihood of the labels
    (nats/token; null where a label's probability is stored as 0, which leaves it
    undetermined: pipeline.core.metrics.nll_sum) and the largest top-1 probability
    of the run."""
    from pipeline.core.metrics import mean_nll, nll_sum
    from pipeline.store.run import open_verified_run, read_positions

    total, zero, n, top = 0.0, 0, 0, 0.0
    for shard in open_verified_run(run_dir).shards:
        if not shard.rows:
            continue
        table = read_positions(shard, ["label_prob", "top1_prob"])  # verified
        shard_total, shard_zero = nll_sum(table.column("label_prob").to_numpy())
        total, zero, n = total + shard_total, zero + shard_zero, n + table.num_rows
        if table.num_rows:
            top = max(top, float(table.column("top1_prob").to_numpy().max()))
    return {"test_loss": mean_nll(total, zero, n)[0] if n else None, "max_prob": top if n else None}


def saturated(row: dict, m: int) -> bool:
    """Every probability of the run lies in bin 1 at M = m (largest <= 1/m): ECE, cw-ECE
    and Full-ECE then only see bin 1, where Full-ECE is 0 by construction."""
    top = row.get("max_prob")
    return top is not None and float(top) * m <= 1.0  # float64(p) * M, as the binning


def collect(runs_dir, *, quiet: bool = False) -> list[dict]:
    """Metrics (paper's M), training info and test loss of every run, in training order."""
    from pipeline.aggregate import load_run_tables
    from pipeline.analysis.metrics import metrics_for_run
    from pipeline.core.cancellation import full_ece_cancellation

    rows = []
    for run_dir in find_runs(runs_dir):
        result = metrics_for_run(run_dir, PAPER_BINS, quiet=quiet)
        tables = load_run_tables(result["run"]["tables"])
        rows.append(
            {
                "run_dir": str(run_dir),
                "label": result["run"]["label"],
                "training": _training_info(run_dir),
                **position_stats(run_dir),
                "metrics": result,
                "cancellation": [
                    full_ece_cancellation(tables, b["M"])
                    for b in result["bins"]
                    if tables.fine_bins % b["M"] == 0
                ],
            }
        )
    return rows


def _f(x, digits: int = 6) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "n/a"
    return f"{x:.{digits}f}" if abs(x) >= 10 ** -(digits - 2) or x == 0 else f"{x:.2e}"


def _pct(x) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.2f}%"


def _tokens(n) -> str:
    if n is None:
        return "?"
    if n >= 1e6:
        return f"{n / 1e6:.2f}M"
    return f"{n / 1e3:.0f}k" if n >= 1e4 else f"{n:,}"


def _excluded_note(excluded: list[dict], m: int) -> str:
    if not excluded:
        return ""
    names = ", ".join(r["label"] for r in excluded)
    top = max(r["max_prob"] for r in excluded)
    return (
        f"; left out: {names}, whose largest probability ({top:.3g}) is <= 1/{m}: at "
        f"M = {m} every probability lies in bin 1, where Full-ECE is 0 by construction"
    )


def findings(rows: list[dict]) -> dict:
    """The paper's three findings, judged from the measured numbers.

    A checkpoint that puts every probability in bin 1 (largest <= 1/M, an
    untrained model) has Full-ECE = 0 at that M by construction; such
    checkpoints are left out of the judgement (and named), never silently.
    """
    return {
        "table1": _table1_finding(rows),
        "frequency": _frequency_finding(rows),
        "trend": _trend_finding(rows),
    }


def _status(hits: int, judged: int) -> str:
    if judged and hits == judged:
        return "reproduced"
    return "partly reproduced" if hits else "not reproduced"


def _table1_finding(rows: list[dict]) -> dict:
    """Table 1: RSD of Full-ECE below RSD of cw-ECE at every checkpoint."""
    with_rsd = [r for r in rows if r["metrics"].get("rsd")]
    m_min = min((b["M"] for b in rows[0]["metrics"]["bins"]), default=TREND_M)
    judged = [r for r in with_rsd if not saturated(r, m_min)] or with_rsd
    excluded = [r for r in with_rsd if r not in judged]
    lower = [
        r["label"]
        for r in judged
        if r["metrics"]["rsd"]["full_ece"] is not None
        and r["metrics"]["rsd"]["cw_ece"] is not None
        and r["metrics"]["rsd"]["full_ece"] < r["metrics"]["rsd"]["cw_ece"]
    ]
    against = [r for r in judged if r["label"] not in lower]
    return {
        "status": _status(len(lower), len(judged)),
        "checkpoints": len(judged),
        "full_below_cw": len(lower),
        "excluded": [r["label"] for r in excluded],
        "text": f"RSD of Full-ECE < RSD of cw-ECE at {len(lower)} of {len(judged)} checkpoints"
        f"{_excluded_note(excluded, m_min)} (paper: at both of its models, "
        "7.6-8.4% vs 40.9-44.9%)",
        "why": why_table1(against[-1]) if against else None,
    }


def _frequency_finding(rows: list[dict]) -> dict:
    """Token frequency: at least half of the vocabulary occurs at most 10 times."""
    tf = rows[-1]["metrics"]["token_frequency"]
    shares = {b["range"]: b["share"] for b in tf["buckets"]}
    never, rare = shares.get("0", float("nan")), shares.get("1-10", float("nan"))
    status = "reproduced" if never + rare >= 0.5 else "not reproduced"
    return {
        "status": status,
        "never": never,
        "one_to_ten": rare,
        "text": f"{never * 100:.1f}% of the vocabulary never occurs in the test set and "
        f"{rare * 100:.1f}% occurs 1-10 times, {(never + rare) * 100:.1f}% in all "
        f"(paper: 30% and 41%, 71%; criterion: at least half of the vocabulary occurs "
        f"at most 10 times)",
        "why": (
            f"the test split's {rows[-1]['metrics']['positions']:,} labels cover "
            f"{tf['distinct_labels']:,} of the {tf['vocab_size']:,} vocabulary entries"
            if status != "reproduced"
            else None
        ),
    }


def _trend_finding(rows: list[dict]) -> dict:
    """Figure 2: Full-ECE (M = TREND_M) decreases over training."""
    import numpy as np

    judged = [r for r in rows if not saturated(r, TREND_M)]
    if len(judged) < 2:
        judged = rows
    excluded = [r for r in rows if r not in judged]
    values = [_at(r, TREND_M)["full_ece"] for r in judged]
    diffs = np.diff(values).tolist()
    ups = sum(d >= 0 for d in diffs)
    if len(values) < 2:
        status, how = "not tested", "a single checkpoint"
    elif all(d < 0 for d in diffs):
        status, how = "reproduced", "decreases at every checkpoint"
    elif values[-1] < values[0]:
        status, how = (
            "partly reproduced",
            f"lower at the end, but rises at {ups} of {len(diffs)} steps",
        )
    else:
        status, how = (
            "not reproduced",
            (
                f"not lower at the last checkpoint than at the first "
                f"(rises at {ups} of {len(diffs)} steps)"
            ),
        )
    return {
        "status": status,
        "values": values,
        "checkpoints": [r["label"] for r in judged],
        "excluded": [r["label"] for r in excluded],
        "why": why_trend(judged, values) if status != "reproduced" and len(values) > 1 else None,
        "text": f"Full-ECE (M={TREND_M}) {how}: "
        + " -> ".join(_f(v, 4) for v in values)
        + f"{_excluded_note(excluded, TREND_M)}"
        + " (paper: a consistent decrease over training)",
    }


# ------------------------------------------------------------------ measured reasons
# Pure functions of the metrics rows (floors: docs/metrics.md, "Noise floors") and of
# the cancellation figures collect() takes from each run's tables
# (pipeline.core.cancellation); docs/default-experiment.md, "Measured reasons".

EXPLAINED_KEYS = ("ece", "cw_ece", "full_ece")


def against_floor(b: dict, key: str) -> dict:
    """A bins[] figure against its noise floor: ``excess`` = value − floor,
    ``above_noise`` = value > p95 (the floor's 95th percentile, the rule by which
    `fullece metrics` marks a figure ~). None where the row has no floor."""
    value, floor, p95 = b.get(key), b.get(f"{key}_floor"), b.get(f"{key}_floor_p95")
    known = value is not None and floor is not None and p95 is not None
    return {
        "M": b["M"],
        "value": value,
        "floor": floor,
        "p95": p95,
        "excess": value - floor if known else None,
        "above_noise": bool(value > p95) if known else None,
    }


def growth_in_m(row: dict, key: str = "full_ece") -> dict:
    """A figure's growth from the smallest to the largest M of a run, its floor's
    growth over the same M's, and their difference (the growth above the floor)."""
    bins = sorted(row["metrics"]["bins"], key=lambda b: b["M"])
    lo, hi = against_floor(bins[0], key), against_floor(bins[-1], key)

    def diff(name):
        return None if lo[name] is None or hi[name] is None else hi[name] - lo[name]

    growth, floor_growth = diff("value"), diff("floor")
    return {
        "from": lo,
        "to": hi,
        "growth": growth,
        "floor_growth": floor_growth,
        "above_floor": None if growth is None or floor_growth is None else growth - floor_growth,
    }


def cancellation_at(row: dict, m: int) -> dict | None:
    """The run's determined cancellation figures at M = m (None when not known)."""
    return next((c for c in row.get("cancellation") or () if c["M"] == m and c["determined"]), None)


def explain_checkpoint(row: dict) -> dict:
    """Every measured reason for one checkpoint: each figure against its floor at
    every M, cw-ECE's and Full-ECE's growth in M against their floors', and what
    cancels inside Full-ECE's coarse bins at every M."""
    bins = row["metrics"]["bins"]
    return {
        "checkpoint": row["label"],
        "against_floor": {key: [against_floor(b, key) for b in bins] for key in EXPLAINED_KEYS},
        "growth": {key: growth_in_m(row, key) for key in ("cw_ece", "full_ece")},
        "cancellation": list(row.get("cancellation") or ()),
    }


def _vs_floor(a: dict) -> str:
    """`value (floor f, p95 q: [not] above noise)`: one figure against its floor."""
    if a["above_noise"] is None:
        return f"{_f(a['value'], 4)} (no floor)"
    verdict = "above noise" if a["above_noise"] else "not above noise"
    return f"{_f(a['value'], 4)} (floor {_f(a['floor'], 4)}, p95 {_f(a['p95'], 4)}: {verdict})"


def _share(c: dict) -> str:
    share = c["cancelled_share"]
    return f"{_f(c['cancelled'], 4)} ({'n/a' if share is None else f'{share * 100:.0f}%'})"


def _noise_count(row: dict, key: str) -> str:
    marks = [against_floor(b, key)["above_noise"] for b in row["metrics"]["bins"]]
    known = [m for m in marks if m is not None]
    return f"above noise at {known.count(True)} of {len(known)} M's with a floor"


def why_table1(row: dict) -> str:
    """Measured reasons why Full-ECE's RSD over M is not below cw-ECE's at `row`:
    both figures at the smallest and largest M against their floors, Full-ECE's
    growth against its floor's, and what cancels inside its coarse bins there."""
    g, cw = growth_in_m(row, "full_ece"), growth_in_m(row, "cw_ece")
    lo_m, hi_m = g["from"]["M"], g["to"]["M"]
    parts = [
        f"at {row['label']}, Full-ECE goes from {_vs_floor(g['from'])} at M = {lo_m} to "
        f"{_vs_floor(g['to'])} at M = {hi_m}"
    ]
    if g["above_floor"] is not None:
        parts.append(
            f"of its growth {_f(g['growth'], 4)}, the floor's growth is "
            f"{_f(g['floor_growth'], 4)} and {_f(g['above_floor'], 4)} lies above it"
        )
    c_lo, c_hi = cancellation_at(row, lo_m), cancellation_at(row, hi_m)
    if c_lo and c_hi:
        parts.append(
            f"of the sum over its {c_lo['fine_bins']} fine bins, {_f(c_lo['fine_sum'], 4)}, "
            f"{_share(c_lo)} cancels inside the {lo_m} coarse bins at M = {lo_m} and "
            f"{_share(c_hi)} inside the {hi_m} at M = {hi_m}"
        )
    parts.append(
        f"cw-ECE goes from {_vs_floor(cw['from'])} to {_vs_floor(cw['to'])}, "
        f"{_noise_count(row, 'cw_ece')}"
    )
    return "; ".join(parts)


def why_trend(judged: list[dict], values: list[float]) -> str:
    """Measured reasons behind the trend of Full-ECE at M = TREND_M: per checkpoint
    its excess over the floor and what cancels inside the coarse bins; at the first
    rise, how much of it is the floor's."""
    at = [against_floor(_at(r, TREND_M), "full_ece") for r in judged]
    known = [a for a in at if a["above_noise"] is not None]
    parts = []
    if known:
        parts.append(
            f"Full-ECE at M = {TREND_M} minus its floor: "
            + " -> ".join(_f(a["excess"], 4) if a["excess"] is not None else "n/a" for a in at)
            + f" (above noise at {sum(a['above_noise'] for a in known)} of "
            f"{len(known)} checkpoints with a floor)"
        )
    cancels = [cancellation_at(r, TREND_M) for r in judged]
    if all(cancels):
        parts.append(
            f"cancelled inside its {TREND_M} coarse bins: "
            + " -> ".join(_share(c) for c in cancels)
            + f" of the fine-bin sums {' -> '.join(_f(c['fine_sum'], 4) for c in cancels)}"
        )
    for i in range(len(values) - 1):
        if values[i + 1] >= values[i]:
            a, b = judged[i], judged[i + 1]
            rise = (
                f"the first rise, {a['label']} -> {b['label']}: {_f(values[i + 1] - values[i], 4)}"
            )
            if at[i]["floor"] is not None and at[i + 1]["floor"] is not None:
                floor_rise = at[i + 1]["floor"] - at[i]["floor"]
                rise += (
                    f", of which the floor's change {_f(floor_rise, 4)} and "
                    f"{_f(values[i + 1] - values[i] - floor_rise, 4)} above it"
                )
            parts.append(
                rise + f", while the test loss goes {_f(a['test_loss'], 3)} -> "
                f"{_f(b['test_loss'], 3)} and the largest probability "
                f"{_f(a.get('max_prob'), 3)} -> {_f(b.get('max_prob'), 3)}"
            )
            break
    return "; ".join(parts)


def _at(row: dict, m: int) -> dict:
    return next(b for b in row["metrics"]["bins"] if b["M"] == m)


def format_default(rows: list[dict], verdicts: dict) -> str:
    bins = [b["M"] for b in rows[0]["metrics"]["bins"]]
    first = rows[0]["metrics"]
    lines = [
        "fullece default: calibration of the embedded GPT-2 at each training checkpoint",
        f"test split: N = {first['positions']:,} positions, K = {first['vocab_size']:,} "
        f"classes; {len(rows)} checkpoint(s)",
        "",
    ]
    lines += _metrics_section(rows)
    lines += _rsd_section(rows, bins)
    lines += _growth_section(rows, bins)
    lines += _frequency_section(rows)
    lines += _trend_section(rows)
    lines += _regime_section(rows, verdicts)
    return "\n".join(lines)


def _metrics_section(rows: list[dict]) -> list[str]:
    """1. Each checkpoint's metrics and floors at the paper's M."""
    from pipeline.analysis.metrics import FLOOR_LEGEND, with_floor

    lines = ["1. Metrics at the paper's M"]
    for r in rows:
        m = r["metrics"]
        t = r["training"]
        step = f"step {t['step']}, {_tokens(t.get('tokens_seen'))} training tokens, " if t else ""
        lines.append("")
        top = r.get("max_prob")
        lines.append(
            f"{r['label']}  ({step}test loss {_f(r['test_loss'], 3)} nats/token, "
            f"largest probability {'n/a' if top is None else f'{top:.3f}'}, "
            f"M_exact = {m['m_exact'] if m['m_exact'] is not None else 'every M'})"
        )
        lines.append(
            f"  {'M':>4}  {'ECE (floor)':>21}  {'cw-ECE (floor)':>23}  "
            f"{'Full-ECE (floor)':>21}  {'cancelled':>14}  exact"
        )
        for b in m["bins"]:
            c = cancellation_at(r, b["M"])
            lines.append(
                f"  {b['M']:>4}  {with_floor(b, 'ece'):>21}  {with_floor(b, 'cw_ece'):>23}  "
                f"{with_floor(b, 'full_ece'):>21}  {_share(c) if c else 'n/a':>14}  "
                f"{'yes' if b['exact'] else 'NO'}"
            )
    lines += ["", f"  {FLOOR_LEGEND}; {CANCELLED_LEGEND}"]
    return lines


def _rsd_section(rows: list[dict], bins: list[int]) -> list[str]:
    """2. Table 1: the RSD over M of each checkpoint."""
    lines = [
        "",
        f"2. Table 1: RSD over M in {{{','.join(map(str, bins))}}} "
        "(paper: cw-ECE 40.93% / 44.90%, Full-ECE 7.56% / 8.36% for its 2B / 7B models)",
        "",
        f"  {'checkpoint':<14} {'step':>6}  {'RSD ECE':>9}  {'RSD cw-ECE':>10}  {'RSD Full-ECE':>12}",
    ]
    for r in rows:
        rsd = r["metrics"]["rsd"] or {}
        lines.append(
            f"  {r['label']:<14} {r['training'].get('step', ''):>6}  "
            f"{_pct(rsd.get('ece')):>9}  {_pct(rsd.get('cw_ece')):>10}  "
            f"{_pct(rsd.get('full_ece')):>12}"
        )
        for key, name in (("ece", "ECE"), ("cw_ece", "cw-ECE"), ("full_ece", "Full-ECE")):
            used = rsd.get(f"{key}_bins")
            if used is not None and len(used) != len(rsd["bins"]):
                lines.append(
                    f"  {'':<14} {'':>6}  {name} RSD over the exact M = "
                    f"{{{','.join(map(str, used))}}} only (never from intervals)"
                )
    return lines


def _growth_section(rows: list[dict], bins: list[int]) -> list[str]:
    """Full-ECE's growth from the smallest M to the largest, against its floor's."""
    lo_m, hi_m = min(bins), max(bins)
    lines = [
        "",
        f"  Full-ECE from M = {lo_m} to M = {hi_m}: its growth against its floor's, and what "
        "cancels inside the coarse bins",
        "",
        f"  {'checkpoint':<14} {'growth':>8}  {'floor growth':>12}  {'above floor':>11}  "
        f"{'fine-bin sum':>12}  {f'cancelled M={lo_m}':>15}  {f'cancelled M={hi_m}':>17}",
    ]
    for r in rows:
        g = growth_in_m(r, "full_ece")
        c_lo, c_hi = cancellation_at(r, lo_m), cancellation_at(r, hi_m)
        lines.append(
            f"  {r['label']:<14} {_f(g['growth'], 4):>8}  {_f(g['floor_growth'], 4):>12}  "
            f"{_f(g['above_floor'], 4):>11}  {_f(c_lo['fine_sum'], 4) if c_lo else 'n/a':>12}  "
            f"{_share(c_lo) if c_lo else 'n/a':>15}  {_share(c_hi) if c_hi else 'n/a':>17}"
        )
    return lines


def _frequency_section(rows: list[dict]) -> list[str]:
    """3. How often the vocabulary occurs as a label in the test set."""
    tf = rows[-1]["metrics"]["token_frequency"]
    labels = rows[-1]["metrics"]["positions"]
    lines = [
        "",
        f"3. Token frequency on the test set ({labels:,} labels, {tf['vocab_size']:,} vocabulary "
        f"entries, {tf['distinct_labels']:,} distinct labels)",
        "",
    ]
    paper = {"0": f"paper {PAPER_NEVER:.0%}", "1-10": f"paper {PAPER_RARE:.0%}"}
    for b in tf["buckets"]:
        note = f"   ({paper[b['range']]})" if b["range"] in paper else ""
        lines.append(
            f"  occurs {b['range']:>6} times: {b['share'] * 100:5.1f}% of the vocabulary "
            f"({b['classes']:,} entries){note}"
        )
    return lines


def _trend_section(rows: list[dict]) -> list[str]:
    """4. The metrics across training at M = TREND_M (the paper's Figure 2)."""
    lines = [
        "",
        f"4. Trend across training (the paper's Figure 2: Full-ECE at M = {TREND_M})",
        "",
        f"  {'checkpoint':<14} {'step':>6} {'tokens':>8}  {'test loss':>9}  {'ECE':>8}  "
        f"{'cw-ECE':>10}  {'Full-ECE':>8}  {'floor':>8}  {'p95':>8}  {'above floor':>11}  "
        f"{'cancelled':>14}",
    ]
    for r in rows:
        b = _at(r, TREND_M)
        a = against_floor(b, "full_ece")
        c = cancellation_at(r, TREND_M)
        t = r["training"]
        lines.append(
            f"  {r['label']:<14} {t.get('step', ''):>6} "
            f"{_tokens(t.get('tokens_seen')) if t else '':>8}  "
            f"{_f(r['test_loss'], 3):>9}  {_f(b['ece'], 4):>8}  {_f(b['cw_ece']):>10}  "
            f"{_f(b['full_ece'], 4):>8}{'~' if a['above_noise'] is False else ' '} "
            f"{_f(a['floor'], 4):>8}  {_f(a['p95'], 4):>8}  {_f(a['excess'], 4):>11}  "
            f"{_share(c) if c else 'n/a':>14}"
        )
    return lines


def _regime_section(rows: list[dict], verdicts: dict) -> list[str]:
    """5. The paper's regime, and the verdict on each of its findings."""
    regime = regime_of(rows)
    lines = [
        "",
        "5. The paper's regime (single pass, non-degenerate checkpoints, large test split)",
        "",
    ]
    for check in regime["checks"]:
        lines.append(f"  [{'ok' if check['ok'] else 'NOT MET'}] {check['text']}")
    lines += ["", "Findings of the paper on this model (computed from the numbers above):"]
    for key, name in FINDING_NAMES.items():
        v = verdicts[key]
        lines.append(f"  [{v['status']}] {name}: {v['text']}")
        if v.get("why"):
            lines += textwrap.wrap(
                f"why: {v['why']}", 100, initial_indent="      ", subsequent_indent="        "
            )
    return lines


def regime_of(rows: list[dict]) -> dict:
    """Whether the runs are in the paper's regime, each condition from the numbers.

    Single pass: no checkpoint has seen more training tokens than the training
    split holds (``tokens_seen <= train_tokens``, from each checkpoint's
    training.json). Non-degenerate: the largest predicted probability of every
    checkpoint exceeds NEAR_UNIFORM_MAX_PROB. Test split: at least
    MIN_TEST_POSITIONS positions, and at least MIN_CHECKPOINTS checkpoints.
    """
    seen = [r["training"].get("tokens_seen") for r in rows]
    unique = [r["training"].get("train_tokens") for r in rows]
    known = all(s is not None and u is not None for s, u in zip(seen, unique, strict=True))
    single = known and all(s <= u for s, u in zip(seen, unique, strict=True))
    most_seen = max((s for s in seen if s is not None), default=None)
    train_tokens = next((u for u in reversed(unique) if u is not None), None)
    positions = rows[0]["metrics"]["positions"]
    tops = [r.get("max_prob") for r in rows]
    low = [
        r["label"]
        for r, t in zip(rows, tops, strict=True)
        if t is None or t <= NEAR_UNIFORM_MAX_PROB
    ]
    checks = [
        {
            "name": "single_pass",
            "ok": bool(single),
            "text": (
                f"single pass: at most {_tokens(most_seen)} training tokens seen, of "
                f"{_tokens(train_tokens)} unique ones"
                if known
                else "single pass: unknown (a checkpoint has no tokens_seen/train_tokens)"
            ),
        },
        {
            "name": "checkpoints",
            "ok": len(rows) >= MIN_CHECKPOINTS,
            "text": f"{len(rows)} checkpoints (at least {MIN_CHECKPOINTS})",
        },
        {
            "name": "non_degenerate",
            "ok": not low,
            "text": "largest predicted probability above "
            f"{NEAR_UNIFORM_MAX_PROB} at every checkpoint (lowest: "
            f"{min((t for t in tops if t is not None), default=float('nan')):.3f})"
            + (f"; near-uniform: {', '.join(low)}" if low else ""),
        },
        {
            "name": "test_positions",
            "ok": positions >= MIN_TEST_POSITIONS,
            "text": f"{positions:,} test positions (at least {MIN_TEST_POSITIONS:,})",
        },
    ]
    return {
        "met": all(c["ok"] for c in checks),
        "single_pass": bool(single),
        "train_tokens": train_tokens,
        "max_tokens_seen": most_seen,
        "checks": checks,
    }


def run_default_metrics(runs_dir="runs", report_dir="report", *, quiet: bool = False) -> dict:
    """Aggregate every run, compute everything `default metrics` prints, write the report."""
    from pipeline.analysis.report import write_report

    t0 = time.perf_counter()
    rows = collect(runs_dir, quiet=quiet)
    verdicts = findings(rows)
    text = format_default(rows, verdicts)
    report = write_report([Path(r["run_dir"]) for r in rows], report_dir, quiet=quiet)
    regime = regime_of(rows)
    summary = {
        "train_tokens": regime["train_tokens"],
        "test_positions": rows[0]["metrics"]["positions"],
        "vocab_size": rows[0]["metrics"]["vocab_size"],
        "single_pass": regime["single_pass"],
        "regime": regime,
        "checkpoints": [
            {
                "name": r["label"],
                "step": r["training"].get("step"),
                "tokens_seen": r["training"].get("tokens_seen"),
                "train_loss": r["training"].get("train_loss"),
                "test_loss": r["test_loss"],
                "max_prob": r.get("max_prob"),
                "ece_m10": _at(r, TREND_M)["ece"],
                "cw_ece_m10": _at(r, TREND_M)["cw_ece"],
                "full_ece_m10": _at(r, TREND_M)["full_ece"],
                "rsd": r["metrics"]["rsd"],
            }
            for r in rows
        ],
        "verdicts": [
            {"finding": FINDING_NAMES[key], "key": key, **verdicts[key]} for key in FINDING_NAMES
        ],
        "runs": [
            {
                "label": r["label"],
                "run_dir": r["run_dir"],
                "training": r["training"],
                "test_loss": r["test_loss"],
                "max_prob": r.get("max_prob"),
                "bins": r["metrics"]["bins"],
                "rsd": r["metrics"]["rsd"],
                "token_frequency": r["metrics"]["token_frequency"],
                "positions": r["metrics"]["positions"],
                "m_exact": r["metrics"]["m_exact"],
            }
            for r in rows
        ],
        "findings": verdicts,
        "explanations": [explain_checkpoint(r) for r in rows],
        "report": str(report),
        "seconds": round(time.perf_counter() - t0, 2),
    }
    write_json(Path(report_dir) / "default_summary.json", summary)
    return {"text": text, "report": report, "summary": summary}
