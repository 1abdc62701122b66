"""``fullece metrics`` and ``fullece compare``: metrics from the bin tables.

Metrics come from ``pipeline.metrics`` (the metric core); this module picks
the tables (aggregating first when they are missing or stale), computes an M
that does not divide the fine grid from the shards, adds bootstrap intervals
and formats the result as text or as the JSON object documented in
``schemas/metrics.v1.schema.json``.
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
from pathlib import Path

import click
import numpy as np

from pipeline import PAPER_BINS
from pipeline.manifest import RunError
from pipeline.schema import SchemaVersionError

METRICS_JSON_VERSION = 1
METRIC_NAMES = (("ece", "ECE"), ("cw_ece", "cw-ECE"), ("full_ece", "Full-ECE"))


def parse_bins(text) -> list[int]:
    if isinstance(text, (list, tuple)):
        values = list(text)
    else:
        try:
            values = [int(x) for x in str(text).replace(" ", "").split(",") if x]
        except ValueError as err:
            raise click.BadParameter(
                f"{text!r}: expected comma-separated integers, e.g. 5,10,20"
            ) from err
    if not values or any(v < 1 for v in values):
        raise click.BadParameter(f"{text!r}: bin counts must be positive integers")
    return list(dict.fromkeys(int(v) for v in values))


def _run_label(path: Path) -> str:
    try:
        from pipeline.manifest import load_manifest

        return str(load_manifest(path).get("label") or path.resolve().name)
    except (RunError, OSError, ValueError):
        return path.resolve().name


def _is_run(path: Path) -> bool:
    return (Path(path) / "manifest.json").exists()


def metrics_for_run(
    run_dir, bins=PAPER_BINS, *, bootstrap_replicates: int = 0, seed: int = 0, quiet: bool = False
) -> dict:
    """Everything `fullece metrics` prints, as the documented JSON object."""
    from pipeline.aggregate import aggregate, ensure_tables, load_run_tables
    from pipeline.binning import is_exact
    from pipeline.metrics import compute_metrics, metrics_at, rsd

    run_dir = Path(run_dir)
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
        if not _is_run(run_dir):
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
        from pipeline.bootstrap import bootstrap

        boot = bootstrap(tables, coarse, bootstrap_replicates, seed=seed) if coarse else None
        intervals = {r["M"]: r for r in (boot["intervals"] if boot else [])}
        for m, t_m in extra_tables.items():
            b = bootstrap(t_m, [m], bootstrap_replicates, seed=seed)
            intervals[m] = b["intervals"][0]
            boot = boot or b
        boot["intervals"] = [intervals[m] for m in bins]
        result["bootstrap"] = boot
    label = _run_label(run_dir) if _is_run(run_dir) else run_dir.resolve().name
    return {
        "schema_version": METRICS_JSON_VERSION,
        "run": {"label": label, "path": str(run_dir), "tables": str(tables_dir)},
        "positions": result["positions"],
        "vocab_size": result["vocab_size"],
        "fine_bins": result["fine_bins"],
        "m_exact": result["m_exact"],
        "tail_max": float(result["tail_max"]),
        "bins": [_clean_row(r) for r in ordered],
        "rsd": result["rsd"],
        "token_frequency": result["token_frequency"],
        "bootstrap": result["bootstrap"],
        "notes": notes,
    }


def _clean_row(row: dict) -> dict:
    return {
        "M": int(row["M"]),
        "ece": float(row["ece"]),
        "cw_ece": float(row["cw_ece"]),
        "full_ece": float(row["full_ece"]),
        "exact": bool(row["exact"]),
        "source": row.get("source", "tables"),
    }


def _fmt(x: float) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return f"{x:.6f}" if abs(x) >= 1e-4 or x == 0 else f"{x:.3e}"


def format_metrics(result: dict) -> str:
    """Human-readable rendering of a `metrics_for_run` / `compute_metrics` result."""
    lines = []
    run = result.get("run")
    if run:
        lines.append(f"run: {run['label']}  ({run['path']})")
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
            f"{r['M']:>5}  {_fmt(r['ece']):>12}  {_fmt(r['cw_ece']):>12}  "
            f"{_fmt(r['full_ece']):>12}  {'yes' if r['exact'] else 'NO '}"
        )
        if r.get("source") == "shards":
            line += " *"
        if r["M"] in intervals:
            iv = intervals[r["M"]]
            line += (
                f"   [{_fmt(iv['ece'][0])}, {_fmt(iv['ece'][1])}]"
                f"   [{_fmt(iv['full_ece'][0])}, {_fmt(iv['full_ece'][1])}]"
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


def compare_runs(run_dirs, n_bins: int = 10, *, quiet: bool = False) -> dict:
    """One row per run (labelled from its manifest) at M = n_bins, and the trend."""
    from pipeline.aggregate import ensure_tables, load_run_tables
    from pipeline.metrics import metrics_at

    rows = []
    for run_dir in run_dirs:
        run_dir = Path(run_dir)
        tables = load_run_tables(ensure_tables(run_dir, quiet=quiet))
        if tables.fine_bins % n_bins:
            raise click.BadParameter(f"M={n_bins} must divide the fine grid F={tables.fine_bins}")
        m = metrics_at(tables, n_bins)
        rows.append(
            {
                "label": _run_label(run_dir) if _is_run(run_dir) else run_dir.name,
                "path": str(run_dir),
                "positions": tables.positions,
                "vocab_size": tables.vocab_size,
                "m_exact": tables.m_exact,
                **_clean_row(m),
            }
        )
    return {"schema_version": METRICS_JSON_VERSION, "M": n_bins, "runs": rows, "trend": trend(rows)}


def _spearman(values) -> float | None:
    v = np.asarray(values, np.float64)
    if v.size < 3 or np.all(v == v[0]):
        return None
    r = np.argsort(np.argsort(v)).astype(np.float64)
    x = np.arange(v.size, dtype=np.float64)
    return float(np.corrcoef(x, r)[0, 1])


def trend(rows: list[dict]) -> dict:
    """Per metric: first, last, change, step directions and rank correlation with order."""
    out = {}
    for key, _ in METRIC_NAMES:
        vals = [r[key] for r in rows]
        if not vals:
            continue
        steps = np.sign(np.diff(vals)).astype(int).tolist()
        first, last = vals[0], vals[-1]
        if len(vals) < 2:
            direction = "single run"
        elif all(s < 0 for s in steps):
            direction = "decreasing"
        elif all(s > 0 for s in steps):
            direction = "increasing"
        elif last < first:
            direction = "down overall"
        elif last > first:
            direction = "up overall"
        else:
            direction = "flat"
        out[key] = {
            "first": first,
            "last": last,
            "change": last - first,
            # a base at float-rounding level (Full-ECE of a near-uniform model
            # is 0 by construction) makes a relative change meaningless
            "relative_change": (last - first) / first
            if abs(first) > 1e-6 * max(abs(v) for v in vals)
            else None,
            "steps": steps,
            "direction": direction,
            "spearman": _spearman(vals),
        }
    return out


def format_compare(result: dict) -> str:
    rows = result["runs"]
    w = max([len("run")] + [len(r["label"]) for r in rows])
    lines = [
        f"metrics at M = {result['M']}",
        "",
        f"{'run':<{w}}  {'N':>10}  {'ECE':>10}  {'cw-ECE':>10}  {'Full-ECE':>10}  exact",
    ]
    for r in rows:
        lines.append(
            f"{r['label']:<{w}}  {r['positions']:>10,}  {_fmt(r['ece']):>10}  "
            f"{_fmt(r['cw_ece']):>10}  {_fmt(r['full_ece']):>10}  "
            f"{'yes' if r['exact'] else 'NO'}"
        )
    if len(rows) >= 2:
        lines.append("")
        lines.append("trend (first -> last run):")
        for key, name in METRIC_NAMES:
            t = result["trend"][key]
            rel = (
                f" ({t['relative_change'] * 100:+.1f}%)" if t["relative_change"] is not None else ""
            )
            rho = f", Spearman {t['spearman']:+.2f}" if t["spearman"] is not None else ""
            lines.append(
                f"  {name:<9} {_fmt(t['first'])} -> {_fmt(t['last'])}{rel}: {t['direction']}{rho}"
            )
    return "\n".join(lines)


# --------------------------------------------------------------------- CLI


def _fail(err: Exception):
    raise click.ClickException(str(err)) from err


@click.command("metrics")
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option(
    "--bins",
    "bins",
    default=",".join(map(str, PAPER_BINS)),
    show_default=True,
    help="Comma-separated M values.",
)
@click.option(
    "--bootstrap",
    "replicates",
    type=int,
    default=0,
    help="Add 95% intervals for ECE and Full-ECE from B replicates over sequences.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Bootstrap seed.")
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print one JSON object (schemas/metrics.v1.schema.json).",
)
@click.option("--quiet", is_flag=True, help="No progress bar or notices.")
def metrics(run_dir, bins, replicates, seed, as_json, quiet):
    """ECE, cw-ECE and Full-ECE of a run at each M, their RSD, token frequencies."""
    bins = parse_bins(bins)
    try:
        result = metrics_for_run(
            run_dir, bins, bootstrap_replicates=replicates, seed=seed, quiet=quiet
        )
    except (RunError, SchemaVersionError, ValueError, FileNotFoundError) as err:
        _fail(err)
    if as_json:
        click.echo(json.dumps(_no_nan(result), indent=2, allow_nan=False, default=_json_default))
    else:
        click.echo(format_metrics(result))


def _no_nan(x):
    """NaN/inf (an RSD of all-zero values, say) become null: JSON has no NaN."""
    if isinstance(x, dict):
        return {k: _no_nan(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_no_nan(v) for v in x]
    if isinstance(x, (float, np.floating)) and not math.isfinite(float(x)):
        return None
    return x


def _json_default(x):
    if isinstance(x, np.generic):
        return x.item()
    raise TypeError(f"not JSON serialisable: {type(x)}")


@click.command("compare")
@click.argument("run_dirs", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option(
    "-M", "--bins", "n_bins", type=int, default=10, show_default=True, help="Number of bins M."
)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object.")
@click.option("--quiet", is_flag=True, help="No progress bar or notices.")
def compare(run_dirs, n_bins, as_json, quiet):
    """Compare runs (training checkpoints, say): one row each and the trend."""
    try:
        result = compare_runs(list(run_dirs), n_bins, quiet=quiet)
    except (RunError, SchemaVersionError, ValueError, FileNotFoundError) as err:
        _fail(err)
    if as_json:
        click.echo(json.dumps(_no_nan(result), indent=2, allow_nan=False, default=_json_default))
    else:
        click.echo(format_compare(result))


if __name__ == "__main__":  # pragma: no cover
    metrics(sys.argv[1:])
