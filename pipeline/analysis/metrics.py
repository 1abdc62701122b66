"""``fullece metrics``: the metrics of a run, from its bin tables.

Metrics come from ``pipeline.core.metrics`` (the metric core); this module picks
the tables (aggregating first when they are missing or stale), computes an M
that does not divide the fine grid from the shards, adds bootstrap intervals
and formats the result as text or as the JSON object documented in
``schemas/metrics.v1.schema.json``.
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

from pipeline import PAPER_BINS
from pipeline.store.manifest import RunError
from pipeline.store.run import is_run, run_label

METRICS_JSON_VERSION = 1
# The largest M accepted: an M that does not divide F is aggregated from the
# shards with dense per-bin arrays (O(M) memory per class row of seq/top-1
# tables), so M is capped (docs/design.md).
MAX_BINS = 1_000_000
METRIC_NAMES = (("ece", "ECE"), ("cw_ece", "cw-ECE"), ("full_ece", "Full-ECE"))


def parse_bins(text) -> list[int]:
    if isinstance(text, (list, tuple)):
        values = list(text)
    else:
        try:
            values = [int(x) for x in str(text).replace(" ", "").split(",") if x]
        except ValueError as err:
            raise ValueError(f"{text!r}: expected comma-separated integers, e.g. 5,10,20") from err
    if not values or any(v < 1 for v in values):
        raise ValueError(f"{text!r}: bin counts must be positive integers")
    if any(v > MAX_BINS for v in values):
        raise ValueError(
            f"{text!r}: at most {MAX_BINS:,} bins (M is capped: the bin tables of an M that "
            "does not divide the fine grid take O(M) memory)"
        )
    return list(dict.fromkeys(int(v) for v in values))


def metrics_for_run(
    run_dir,
    bins=PAPER_BINS,
    *,
    bootstrap_replicates: int = 0,
    seed: int = 0,
    quiet: bool = False,
    partial: bool = False,
) -> dict:
    """Everything `fullece metrics` prints, as the documented JSON object.
    An incomplete run is refused unless `partial` (then ``complete: false``)."""
    from pipeline.aggregate import aggregate, ensure_tables, load_run_tables
    from pipeline.core.binning import is_exact
    from pipeline.core.metrics import compute_metrics, metrics_at, rsd
    from pipeline.store.run import describe_coverage, require_complete

    run_dir = Path(run_dir)
    coverage = require_complete(run_dir, partial)
    tables_dir = ensure_tables(run_dir, quiet=quiet)
    tables = load_run_tables(tables_dir)
    if tables.positions <= 0:
        raise RunError(f"{tables_dir}: the tables hold no positions")
    bins = list(bins)
    f = tables.fine_bins
    coarse = [m for m in bins if f % m == 0]
    other = [m for m in bins if f % m]
    result = compute_metrics(tables, coarse)
    rows = {r["M"]: dict(r, source="tables") for r in result["bins"]}
    notes = []
    extra_tables = {}
    if other:
        if not is_run(run_dir):
            raise RunError(
                f"M={','.join(map(str, other))} does not divide the fine grid F={f} of "
                f"{tables_dir}: it is computed from the shards, which need a run directory"
            )
        for m in other:
            with tempfile.TemporaryDirectory(prefix="fullece-M") as tmp:
                out, _ = aggregate(
                    [run_dir],
                    Path(tmp) / "tables",
                    fine_bins=m,
                    progress=not quiet,
                    keep_parts=False,
                )
                t_m = load_run_tables(out)
            rows[m] = dict(metrics_at(t_m, m), source="shards")
            extra_tables[m] = t_m
            notes.append(f"M={m} does not divide the fine grid F={f}: computed from the shards")
    ordered = [rows[m] for m in bins]
    for row in ordered:
        row["exact"] = bool(is_exact(row["M"], tables.m_exact))
        if not row["exact"]:
            notes.append(
                f"M={row['M']} > M_exact={tables.m_exact}: approximate (tail pairs "
                "above 1/M are counted in bin 1)"
            )
    result["bins"] = ordered
    result["rsd"] = None
    if len(ordered) >= 2:
        result["rsd"] = {"bins": bins, **{k: rsd([r[k] for r in ordered]) for k, _ in METRIC_NAMES}}
    result["bootstrap"] = None
    if bootstrap_replicates:
        from pipeline.core.bootstrap import bootstrap

        boot = bootstrap(tables, coarse, bootstrap_replicates, seed=seed) if coarse else None
        intervals = {r["M"]: r for r in (boot["intervals"] if boot else [])}
        for m, t_m in extra_tables.items():
            b = bootstrap(t_m, [m], bootstrap_replicates, seed=seed)
            intervals[m] = b["intervals"][0]
            boot = boot or b
        boot["intervals"] = [intervals[m] for m in bins]
        result["bootstrap"] = boot
    label = run_label(run_dir) if is_run(run_dir) else run_dir.resolve().name
    if not coverage["complete"]:
        notes.insert(0, f"partial run (complete: false): {describe_coverage(coverage)}")
    return {
        "schema_version": METRICS_JSON_VERSION,
        "complete": bool(coverage["complete"]),
        "run": {"label": label, "path": str(run_dir), "tables": str(tables_dir)},
        "positions": result["positions"],
        "vocab_size": result["vocab_size"],
        "fine_bins": result["fine_bins"],
        "m_exact": result["m_exact"],
        "tail_max": float(result["tail_max"]),
        "bins": [clean_row(r) for r in ordered],
        "rsd": result["rsd"],
        "token_frequency": result["token_frequency"],
        "bootstrap": result["bootstrap"],
        "notes": notes,
    }


def clean_row(row: dict) -> dict:
    return {
        "M": int(row["M"]),
        "ece": float(row["ece"]),
        "cw_ece": float(row["cw_ece"]),
        "full_ece": float(row["full_ece"]),
        "exact": bool(row["exact"]),
        "source": row.get("source", "tables"),
    }


def fmt(x: float) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return f"{x:.6f}" if abs(x) >= 1e-4 or x == 0 else f"{x:.3e}"


def format_metrics(result: dict) -> str:
    """Human-readable rendering of a `metrics_for_run` / `compute_metrics` result."""
    lines = []
    run = result.get("run")
    if run:
        lines.append(f"run: {run['label']}  ({run['path']})")
    if result.get("complete") is False:
        lines.append(
            (result.get("notes") or ["partial run"])[0].replace("partial run", "PARTIAL RUN", 1)
        )
    m_exact = result.get("m_exact")
    lines.append(
        f"N = {result['positions']:,} positions   K = {result['vocab_size']:,} classes   "
        f"F = {result.get('fine_bins')}   M_exact = {m_exact if m_exact is not None else 'all (no tail)'}"
    )
    lines.append("")
    boot = result.get("bootstrap")
    intervals = {r["M"]: r for r in boot["intervals"]} if boot else {}
    head = f"{'M':>5}  {'ECE':>12}  {'cw-ECE':>12}  {'Full-ECE':>12}  exact"
    if boot:
        head += f"   ECE {int(boot['level'] * 100)}% CI            Full-ECE {int(boot['level'] * 100)}% CI"
    lines.append(head)
    for r in result["bins"]:
        line = (
            f"{r['M']:>5}  {fmt(r['ece']):>12}  {fmt(r['cw_ece']):>12}  "
            f"{fmt(r['full_ece']):>12}  {'yes' if r['exact'] else 'NO '}"
        )
        if r.get("source") == "shards":
            line += " *"
        if r["M"] in intervals:
            iv = intervals[r["M"]]
            line += (
                f"   [{fmt(iv['ece'][0])}, {fmt(iv['ece'][1])}]"
                f"   [{fmt(iv['full_ece'][0])}, {fmt(iv['full_ece'][1])}]"
            )
        lines.append(line)
    rsd = result.get("rsd")
    if rsd:
        lines.append("")
        lines.append(
            f"RSD across M = {{{','.join(map(str, rsd['bins']))}}}:  "
            f"ECE {rsd['ece']:.2f}%   cw-ECE {rsd['cw_ece']:.2f}%   "
            f"Full-ECE {rsd['full_ece']:.2f}%"
        )
    tf = result.get("token_frequency")
    if tf:
        lines.append("")
        parts = [f"{b['range']}: {b['share'] * 100:.1f}%" for b in tf["buckets"]]
        lines.append(
            f"token frequency (share of the {tf['vocab_size']:,} vocabulary entries by "
            f"label count): " + "   ".join(parts)
        )
        lines.append(f"distinct labels: {tf['distinct_labels']:,}")
    if boot:
        lines.append("")
        lines.append(
            f"bootstrap: {boot['replicates']} replicates over {boot['sequences']:,} "
            f"sequences ({boot['method']}), seed {boot['seed']}"
        )
    for note in result.get("notes") or []:
        lines.append(f"note: {note}")
    if any(r.get("source") == "shards" for r in result["bins"]):
        lines.append("* computed from the shards (M does not divide F)")
    return "\n".join(lines)


# ------------------------------------------------------------------ compare
