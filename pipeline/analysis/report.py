"""``fullece report``: PNG figures and one self-contained HTML page.

``prepare_*`` functions compute the data (numpy, from the bin tables);
``plot_*`` functions draw it. matplotlib is imported only inside the plot
functions (Agg backend), so nothing else in the tool pays for it.
"""

from __future__ import annotations

import base64
import html
import json
import math
import os
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from pipeline import PAPER_BINS
from pipeline.core.registry import PAPER_METRICS
from pipeline.progress import notice

RELIABILITY_BINS = 10
COLORS = (
    "#1f77b4",
    "#d62728",
    "#2ca02c",
    "#9467bd",
    "#ff7f0e",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
)


# ------------------------------------------------------------------ prepare


def prepare_run(
    run_dir, bins=PAPER_BINS, reliability_bins: int = RELIABILITY_BINS, quiet: bool = False
) -> dict:
    """Everything the figures of one run need (tables aggregated if needed):
    the `fullece metrics` object, reliability data, label counts, the top-1
    pairs (smooth diagram) and, for a full-store run, the temperature scan."""
    from pipeline.aggregate import ensure_tables, load_run_tables
    from pipeline.analysis.metrics import metrics_for_run
    from pipeline.core.metrics import compute_metrics, reliability
    from pipeline.store.run import is_run, open_run, run_label

    run_dir = Path(run_dir)
    tables_dir = ensure_tables(run_dir, quiet=quiet)
    tables = load_run_tables(tables_dir)
    bins = [m for m in bins if tables.fine_bins % m == 0]
    top1 = None
    temperature = None
    if is_run(run_dir):
        from pipeline.analysis.positions import scan_run

        scan = scan_run(run_dir, progress=not quiet)
        notice("report: computing the metrics (the smooth ECE loads relplot first) ...", not quiet)
        metrics = metrics_for_run(run_dir, bins, quiet=quiet, scan=scan)
        top1 = scan.top1_pairs()
        if open_run(run_dir).store == "full":
            from pipeline.analysis.temperature import temperature_for_run

            temperature = temperature_for_run(run_dir, n_bins=reliability_bins, quiet=quiet)
    else:
        from pipeline.analysis.metrics import _tail_bounds

        metrics = compute_metrics(tables, bins, _tail_bounds(tables_dir, tables))
    return {
        "label": run_label(run_dir) if is_run(run_dir) else run_dir.name,
        "path": str(run_dir),
        "metrics": metrics,
        "reliability": reliability(tables, reliability_bins),
        "label_counts": tables.label_count.copy(),
        "top1": top1,
        "temperature": temperature,
    }


def _bin_row(metrics: dict, n_bins: int) -> dict | None:
    return next((b for b in metrics["bins"] if b["M"] == n_bins), None)


def prepare_reliability(runs: list[dict], kind: str) -> dict:
    """Reliability-diagram data for `kind` ("top1" or "full"): per run and bin
    the count, mean predicted probability, observed frequency, and the gap
    split by sign: `over` = max(mean − frequency, 0) (overconfident bins) and
    `under` = max(frequency − mean, 0); NaN for empty bins."""
    from pipeline.core.registry import metric

    if kind not in ("top1", "full"):
        raise ValueError(f"kind must be 'top1' or 'full', got {kind!r}")
    rel0 = runs[0]["reliability"]
    edges = np.asarray(rel0["edges"], np.float64)
    key = "ece" if kind == "top1" else "full_ece"
    series = []
    for run in runs:
        d = run["reliability"][kind]
        mean = np.asarray(d["mean_prob"], np.float64)
        freq = np.asarray(d["frequency"], np.float64)
        row = _bin_row(run["metrics"], rel0["n_bins"])
        series.append(
            {
                "label": run["label"],
                "count": np.asarray(d["count"], np.float64),
                "mean_prob": mean,
                "frequency": freq,
                "over": np.where(np.isfinite(mean), np.maximum(mean - freq, 0.0), np.nan),
                "under": np.where(np.isfinite(mean), np.maximum(freq - mean, 0.0), np.nan),
                "value": None if row is None else row.get(key),
                "overconfidence": None if row is None else row.get("overconfidence"),
                "underconfidence": None if row is None else row.get("underconfidence"),
            }
        )
    return {
        "kind": kind,
        "n_bins": int(rel0["n_bins"]),
        "edges": edges,
        "metric": metric(key).label,
        "series": series,
    }


def prepare_smooth_reliability(confidence, correct, max_points: int = 200_000) -> dict:
    """relplot's smooth reliability diagram data (relplot.prepare_rel_diagram)
    for the top-1 confidences and their correctness; no bootstrap band. Above
    `max_points` positions an evenly spaced subsample of the confidence-sorted
    pairs is used for the curve (the smooth ECE itself is reported from all)."""
    import relplot

    conf = np.asarray(confidence, np.float64)
    hit = np.asarray(correct, np.float64)
    if conf.size > max_points:
        order = np.argsort(conf, kind="stable")
        pick = order[np.linspace(0, conf.size - 1, max_points).astype(np.int64)]
        conf, hit = conf[pick], hit[pick]
    data = relplot.prepare_rel_diagram(
        conf, hit, plot_confidence_band=False, report_CE_std=False, num_bootstrap=0
    )
    data["positions"] = int(np.asarray(confidence).size)
    return data


def prepare_temperature_curve(result: dict) -> dict:
    """NLL and Full-ECE against T from a `temperature_scan` result, T* marked."""
    rows = sorted(result["grid"], key=lambda r: r["temperature"])
    return {
        "M": result["M"],
        "temperature": np.array([r["temperature"] for r in rows]),
        "nll": np.array([r["nll"] for r in rows]),
        "ece": np.array([r["ece"] for r in rows]),
        "full_ece": np.array([r["full_ece"] for r in rows]),
        "best_temperature": result.get("best_nll_temperature"),
        "best": result.get("best"),
    }


def prepare_metrics_vs_bins(runs: list[dict]) -> dict:
    """Per paper metric and run: M, value, exact flag and, where the value is
    not determined (value null, e.g. full_ece with full_ece_bounds), its interval."""
    from pipeline.core.registry import PAPER_METRICS

    out = {"metrics": [], "rsd": [r["metrics"].get("rsd") for r in runs]}
    for m in PAPER_METRICS:
        per_run = []
        for run in runs:
            rows = run["metrics"]["bins"]
            bounds = [r.get(m.bounds_key) if m.bounds_key else None for r in rows]
            per_run.append(
                {
                    "label": run["label"],
                    "M": np.array([r["M"] for r in rows]),
                    "value": np.array(
                        [np.nan if r.get(m.key) is None else r[m.key] for r in rows], np.float64
                    ),
                    "exact": np.array([bool(r["exact"]) for r in rows]),
                    "lo": np.array([np.nan if b is None else b[0] for b in bounds], np.float64),
                    "hi": np.array([np.nan if b is None else b[1] for b in bounds], np.float64),
                }
            )
        out["metrics"].append({"key": m.key, "label": m.label, "runs": per_run})
    return out


def prepare_trend(runs: list[dict], n_bins: int = 10) -> dict:
    """Metrics at M = n_bins per run, in the order given."""
    from pipeline.core.registry import PAPER_METRICS

    out = {"M": n_bins, "labels": [r["label"] for r in runs], "names": []}
    for m in PAPER_METRICS:
        vals = []
        for r in runs:
            row = _bin_row(r["metrics"], n_bins)
            vals.append(np.nan if row is None or row.get(m.key) is None else row[m.key])
        out[m.key] = np.asarray(vals, np.float64)
        out["names"].append((m.key, m.label))
    return out


def prepare_frequency_histogram(label_counts: np.ndarray) -> dict:
    """Share of the vocabulary per label-count bucket: 0, 1, 2-10, 11-100, ..."""
    counts = np.asarray(label_counts)
    k = counts.size
    edges = [0, 1, 2, 11, 101, 1001, 10001]
    top = int(counts.max()) if counts.size else 0
    while edges[-1] <= top:
        edges.append((edges[-1] - 1) * 10 + 1)
    labels, shares = [], []
    for lo, hi in zip(edges[:-1], edges[1:], strict=True):
        n = int(((counts >= lo) & (counts < hi)).sum())
        labels.append(str(lo) if hi == lo + 1 else f"{lo}-{hi - 1}")
        shares.append(n / k)
    while len(shares) > 3 and shares[-1] == 0:
        labels.pop()
        shares.pop()
    return {"labels": labels, "shares": np.asarray(shares), "vocab_size": k}


# --------------------------------------------------------------------- plot


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    plt.rcParams.update(
        {
            "font.size": 10,
            "axes.spines.top": False,
            "axes.spines.right": False,
            "savefig.dpi": 150,
            "figure.dpi": 100,
        }
    )
    return plt


def save_figure(fig, path: Path) -> Path:
    """Write a figure as PNG and release it."""
    import matplotlib.pyplot as plt

    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
    return path


OVER_COLOR = "#d62728"
UNDER_COLOR = "#1f77b4"


def plot_reliability(data: dict, ax=None):
    """Reliability diagram from :func:`prepare_reliability`: observed
    frequency against mean predicted probability per bin; for one run the gap
    of each bin is shaded red where the model is overconfident (mean >
    frequency) and blue where it is underconfident. Without `ax`, a count
    panel is added below. Returns the figure."""
    plt = _plt()
    axc = None
    if ax is None:
        fig, (ax, axc) = plt.subplots(
            2,
            1,
            figsize=(5.2, 6.0),
            sharex=True,
            gridspec_kw={"height_ratios": [3, 1.2], "hspace": 0.08},
        )
    else:
        fig = ax.figure
    edges = data["edges"]
    width = np.diff(edges)
    centers = edges[:-1] + width / 2
    kind = data["kind"]
    ax.plot([0, 1], [0, 1], ls="--", color="0.5", lw=1, label="perfect calibration")
    series = data["series"]
    single = len(series) == 1
    for i, s in enumerate(series):
        color = COLORS[i % len(COLORS)]
        freq, mean = s["frequency"], s["mean_prob"]
        ok = np.isfinite(freq)
        if single:
            ax.bar(
                centers[ok],
                freq[ok],
                width=width[ok] * 0.9,
                color="0.55",
                alpha=0.6,
                edgecolor="white",
                label="observed frequency",
            )
            over = ok & (s["over"] > 0)
            under = ok & (s["under"] > 0)
            ax.bar(
                centers[over],
                s["over"][over],
                bottom=freq[over],
                width=width[over] * 0.9,
                color=OVER_COLOR,
                alpha=0.45,
                hatch="///",
                edgecolor=OVER_COLOR,
                lw=0.6,
                label="overconfident: confidence above frequency",
            )
            ax.bar(
                centers[under],
                s["under"][under],
                bottom=mean[under],
                width=width[under] * 0.9,
                color=UNDER_COLOR,
                alpha=0.45,
                hatch="\\\\\\",
                edgecolor=UNDER_COLOR,
                lw=0.6,
                label="underconfident: frequency above confidence",
            )
            ax.scatter(mean[ok], freq[ok], s=10, color="black", zorder=3)
        else:
            ax.plot(mean[ok], freq[ok], marker="o", ms=4, color=color, label=s["label"])
        if axc is not None:
            axc.bar(
                centers + (i - (len(series) - 1) / 2) * width * 0.8 / len(series),
                s["count"],
                width=width * 0.8 / len(series),
                color=color,
                alpha=0.8,
            )
    m = data["n_bins"]
    s0 = series[0]
    if single and s0["value"] is not None:
        text = f"{data['metric']}(M={m}) = {s0['value']:.4f}"
        if kind == "full" and s0.get("overconfidence") is not None:
            text += f"\nover {s0['overconfidence']:.4f} + under {s0['underconfidence']:.4f}"
        ax.text(
            0.04,
            0.96,
            text,
            transform=ax.transAxes,
            fontsize=9,
            va="top",
            bbox={"facecolor": "white", "edgecolor": "0.8"},
        )
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_ylabel("observed frequency")
    title = {"top1": "Top-1 reliability diagram", "full": "Full-distribution reliability diagram"}
    ax.set_title(f"{title[kind]} (M = {m})")
    ax.legend(loc="upper left", bbox_to_anchor=(0.0, 0.84), fontsize=7, frameon=False)
    xlabel = "predicted probability" if kind == "full" else "top-1 confidence"
    if axc is not None:
        if kind == "full":
            axc.set_yscale("log")  # bin 1 holds nearly every pair
        axc.set_ylabel("pairs" if kind == "full" else "positions")
        axc.set_xlabel(xlabel)
    else:
        ax.set_xlabel(xlabel)
    return fig


def plot_smooth_reliability(data: dict, ax=None):
    """relplot's smooth reliability diagram (relplot.plot_rel_diagram) of
    :func:`prepare_smooth_reliability` data. Returns the figure."""
    import relplot

    plt = _plt()
    if ax is None:
        fig, ax = plt.subplots(figsize=(5.0, 5.0))
    else:
        fig = ax.figure
    relplot.plot_rel_diagram(data, fig=fig, ax=ax, use_default_style=False)
    ax.set_xlabel("top-1 confidence")
    ax.set_ylabel("accuracy (smoothed)")
    ax.set_title(
        f"Top-1 smooth reliability diagram (smECE = {data['ce']:.4f}, N = {data['positions']:,})",
        fontsize=10,
    )
    return fig


def plot_temperature_curve(data: dict, ax=None):
    """NLL (left axis) and Full-ECE / ECE (right axis) against T (log scale),
    the NLL-minimising T* marked. Returns the figure."""
    plt = _plt()
    if ax is None:
        fig, ax = plt.subplots(figsize=(6.4, 4.0))
    else:
        fig = ax.figure
    t = data["temperature"]
    ax.plot(t, data["nll"], color="black", marker="o", ms=3, label="NLL")
    ax.set_xscale("log")
    lo2, hi2 = math.floor(math.log2(t.min())), math.ceil(math.log2(t.max()))
    ticks = [2.0**e for e in range(lo2, hi2 + 1) if t.min() <= 2.0**e <= t.max()]
    ax.set_xticks(ticks, [f"{x:g}" for x in ticks])
    ax.minorticks_off()
    ax.set_xlabel("temperature T (logits / T)")
    ax.set_ylabel("NLL (nats)")
    ax2 = ax.twinx()
    ax2.spines["right"].set_visible(True)
    ax2.plot(t, data["full_ece"], color=OVER_COLOR, marker="s", ms=3, label="Full-ECE")
    ax2.plot(t, data["ece"], color=UNDER_COLOR, marker="^", ms=3, ls=":", label="ECE")
    ax2.set_ylabel(f"calibration error (M = {data['M']})")
    ax2.set_ylim(bottom=0)
    ax.axvline(1.0, color="0.7", lw=0.8, ls="--")
    if data["best_temperature"] is not None:
        ts = data["best_temperature"]
        ax.axvline(ts, color="#2ca02c", lw=1.2)
        b = data["best"]
        ax.text(
            0.5,
            0.97,
            f"T* = {ts:.4f}:  NLL {b['nll']:.4f},  ECE {b['ece']:.4f},  Full-ECE {b['full_ece']:.4f}",
            transform=ax.transAxes,
            ha="center",
            color="#2ca02c",
            va="top",
            fontsize=8,
            bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8},
        )
    handles = ax.get_legend_handles_labels()
    handles2 = ax2.get_legend_handles_labels()
    ax.legend(
        handles[0] + handles2[0],
        handles[1] + handles2[1],
        fontsize=8,
        frameon=False,
        loc="center right",
    )
    ax.set_title("Temperature scaling: NLL and calibration error against T")
    return fig


def plot_metrics_vs_bins(data: dict, ax=None):
    """ECE, cw-ECE and Full-ECE against M (log scale), one panel each (`ax`:
    a sequence of as many axes). A marker: a determined (exact) value; a
    vertical bar over a shaded band: the proven interval where the tables do
    not determine the value (M > M_exact, or cw-ECE of an import)."""
    plt = _plt()
    panels = data["metrics"]
    if ax is None:
        fig, axes = plt.subplots(1, len(panels), figsize=(11.5, 3.6))
    else:
        axes = list(ax)
        fig = axes[0].figure
    many = any(len(p["runs"]) > 1 for p in panels)
    for a, panel in zip(axes, panels, strict=True):
        all_m = set()
        for i, r in enumerate(panel["runs"]):
            color = COLORS[i % len(COLORS)]
            ms, vals = r["M"], r["value"]
            all_m.update(ms.tolist())
            known = np.isfinite(vals)
            a.plot(ms[known], vals[known], color=color, lw=1.5, label=r["label"])
            a.scatter(ms[known], vals[known], color=color, s=22, zorder=3)
            iv = np.isfinite(r["lo"]) & np.isfinite(r["hi"]) & ~known
            if iv.any():
                a.fill_between(ms[iv], r["lo"][iv], r["hi"][iv], color=color, alpha=0.15, lw=0)
                a.vlines(
                    ms[iv],
                    r["lo"][iv],
                    r["hi"][iv],
                    color=color,
                    lw=3,
                    alpha=0.6,
                    label=f"{r['label']}: proven interval (not determined)",
                )
        rsd = data["rsd"][0] if data["rsd"] else None
        key = panel["key"]
        if rsd and not many and rsd.get(key) is not None and math.isfinite(rsd[key]):
            a.text(
                0.96,
                0.04,
                f"RSD = {rsd[key]:.1f}%{_rsd_scope(rsd, key)}".replace(" (", "\n(", 1),
                transform=a.transAxes,
                ha="right",
                va="bottom",
                fontsize=9,
            )
        a.set_xscale("log")
        ticks = sorted(all_m)
        a.set_xticks(ticks, [str(m) for m in ticks])
        a.minorticks_off()
        a.set_xlabel("number of bins M")
        a.set_title(panel["label"])
        a.set_ylim(bottom=0)
        a.grid(True, which="major", alpha=0.3)
    axes[0].set_ylabel("calibration error")
    if many:
        axes[-1].legend(fontsize=8, frameon=False)
    fig.suptitle("Calibration error against the number of bins", y=1.02)
    fig.tight_layout()
    return fig


def plot_token_frequency(hists: list[tuple[str, dict]], ax=None):
    """Share of the vocabulary by how often each entry occurs as a label;
    `hists`: (label, :func:`prepare_frequency_histogram` data) per run."""
    plt = _plt()
    if ax is None:
        fig, ax = plt.subplots(figsize=(6.4, 3.8))
    else:
        fig = ax.figure
    labels = max((h["labels"] for _, h in hists), key=len)
    x = np.arange(len(labels))
    w = 0.8 / len(hists)
    for i, (name, h) in enumerate(hists):
        shares = np.zeros(len(labels))
        shares[: len(h["shares"])] = h["shares"]
        bars = ax.bar(
            x + (i - (len(hists) - 1) / 2) * w,
            shares * 100,
            width=w,
            color=COLORS[i % len(COLORS)],
            label=name,
        )
        if len(hists) == 1:
            for b, s in zip(bars, shares, strict=True):
                ax.text(
                    b.get_x() + b.get_width() / 2,
                    b.get_height(),
                    f"{s * 100:.1f}%",
                    ha="center",
                    va="bottom",
                    fontsize=8,
                )
    ax.set_xticks(x, labels)
    ax.set_xlabel("occurrences as a label")
    ax.set_ylabel("share of the vocabulary (%)")
    ax.set_title(f"Token frequency (K = {hists[0][1]['vocab_size']:,})")
    if len(hists) > 1:
        ax.legend(fontsize=8, frameon=False)
    fig.tight_layout()
    return fig


def plot_trend(trend: dict, ax=None):
    """Metrics at M across runs (training checkpoints, say), in the order given."""
    plt = _plt()
    names = trend["names"]
    if ax is None:
        fig, axes = plt.subplots(1, len(names), figsize=(11.5, 3.6))
    else:
        axes = list(ax)
        fig = axes[0].figure
    x = np.arange(len(trend["labels"]))
    for a, (key, name), color in zip(axes, names, COLORS, strict=False):
        a.plot(x, trend[key], marker="o", color=color)
        a.set_xticks(x, trend["labels"], rotation=30, ha="right")
        a.set_title(f"{name} (M = {trend['M']})")
        a.set_ylim(bottom=0)
        a.grid(True, alpha=0.3)
    axes[0].set_ylabel("calibration error")
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------- HTML


def _cell(row: dict, key: str, bounds_key: str | None, spec: str) -> str:
    value = row.get(key)
    if value is not None:
        return format(value, spec)
    bounds = row.get(bounds_key) if bounds_key else None
    if bounds:
        return f"[{format(bounds[0], spec)}, {format(bounds[1], spec)}]"
    return "n/a"


def _metrics_table(runs: list[dict]) -> str:
    from pipeline.core.registry import BIN_METRICS

    cols = [m for m in BIN_METRICS if any(m.key in b for r in runs for b in r["metrics"]["bins"])]
    rows = []
    for run in runs:
        for b in run["metrics"]["bins"]:
            cells = "".join(
                f"<td>{_cell(b, m.key, m.bounds_key, '.3e' if m.key == 'cw_ece' else '.6f')}</td>"
                for m in cols
            )
            rows.append(
                f"<tr><td>{html.escape(run['label'])}</td><td>{b['M']}</td>{cells}"
                f"<td>{'exact' if b['exact'] else 'M > M_exact: [proven interval]'}</td></tr>"
            )
    head = "".join(f"<th>{html.escape(m.label)}</th>" for m in cols)
    head = f"<tr><th>run</th><th>M</th>{head}<th></th></tr>"
    return f"<table>{head}{''.join(rows)}</table>"


def _scores_table(runs: list[dict]) -> str:
    from pipeline.core.registry import RUN_METRICS

    if not any(r["metrics"].get("nll") is not None for r in runs):
        return ""
    head = "".join(f"<th>{html.escape(m.label)}</th>" for m in RUN_METRICS)
    rows = []
    for run in runs:
        m = run["metrics"]
        cells = "".join(f"<td>{_cell(m, x.key, x.bounds_key, '.6f')}</td>" for x in RUN_METRICS)
        rows.append(f"<tr><td>{html.escape(run['label'])}</td>{cells}</tr>")
    return f"<table><tr><th>run</th>{head}</tr>{''.join(rows)}</table>"


def _rsd_scope(rsd: dict, key: str) -> str:
    """' (exact M = {..} only)' when an RSD covers fewer M's than the M set."""
    used = rsd.get(f"{key}_bins")
    if used is None or len(used) == len(rsd["bins"]):
        return ""
    return f" (exact M = {{{','.join(map(str, used))}}} only)"


def _summary(runs: list[dict]) -> str:
    items = []
    for run in runs:
        m = run["metrics"]
        rsd = m.get("rsd") or {}
        tf = m["token_frequency"]
        shares = ", ".join(f"{b['range']}: {b['share'] * 100:.1f}%" for b in tf["buckets"])
        rsd_txt = ", ".join(
            f"{m.label} {rsd[m.key]:.1f}%{_rsd_scope(rsd, m.key)}"
            for m in PAPER_METRICS
            if rsd.get(m.key) is not None and math.isfinite(rsd[m.key])
        )
        items.append(
            f"<li><b>{html.escape(run['label'])}</b>: N = {m['positions']:,} positions, "
            f"K = {m['vocab_size']:,}, M_exact = {m['m_exact'] if m['m_exact'] is not None else 'all'}"
            f"; RSD across M: {rsd_txt or 'n/a'}; token frequency: {shares}</li>"
        )
    return "<ul>" + "".join(items) + "</ul>"


def write_html(runs: list[dict], figures: list[tuple[str, Path, str]], out_dir: Path) -> Path:
    from pipeline.store import atomic

    sections = []
    for title, png, caption in figures:
        data = base64.b64encode(png.read_bytes()).decode()
        sections.append(
            f'<figure id="{png.stem}"><h2>{html.escape(title)}</h2>'
            f'<a href="{png.name}"><img src="data:image/png;base64,{data}" '
            f'alt="{html.escape(title)}" data-file="{png.name}"></a>'
            f'<figcaption>{html.escape(caption)} (<a href="{png.name}">{png.name}</a>)'
            f"</figcaption></figure>"
        )
    created = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>fullece report</title>
<style>
body {{ font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; max-width: 1200px;
       margin: 2em auto; padding: 0 1em; color: #222; }}
table {{ border-collapse: collapse; font-size: 0.9em; }}
td, th {{ border-bottom: 1px solid #ddd; padding: 0.25em 0.8em; text-align: right; }}
td:first-child, th:first-child {{ text-align: left; }}
figure {{ margin: 2em 0; }} img {{ max-width: 100%; }}
figcaption {{ color: #555; font-size: 0.9em; }}
</style></head><body>
<h1>Token-level calibration report</h1>
<p>Generated by fullece on {created}. ECE: top-1; cw-ECE: all K classes;
Full-ECE: every (position, class) probability pooled into M equal-width bins
((m-1)/M, m/M].</p>
{_summary(runs)}
{_scores_table(runs)}
{_metrics_table(runs)}
{"".join(sections)}
</body></html>
"""
    path = out_dir / "report.html"
    atomic.write_bytes(path, page.encode())
    return path


REPORT_RECORD = ".fullece-report.json"


def report_file_names(n_runs: int) -> list[str]:
    """Every file name a report of `n_runs` runs may write in its --out."""
    names = [
        "reliability_top1.png",
        "reliability_full.png",
        "metrics_vs_bins.png",
        "token_frequency.png",
        "metrics.json",
        "report.html",
    ]
    for i in range(n_runs):
        suffix = "" if n_runs == 1 else f"_{i}"
        names += [f"smooth_reliability{suffix}.png", f"temperature{suffix}.png"]
    return names + (["trend.png"] if n_runs > 1 else [])


def _read_record(out_dir: Path) -> dict:
    """{name: sha256 | None} of the files fullece wrote in out_dir (None: being written)."""
    try:
        files = json.loads((out_dir / REPORT_RECORD).read_text()).get("files")
    except (OSError, ValueError, AttributeError, RecursionError):
        return {}
    return files if isinstance(files, dict) else {}


def _write_record(out_dir: Path, files: dict) -> None:
    from pipeline.store import atomic

    atomic.write_json(out_dir / REPORT_RECORD, {"tool": "fullece report", "files": files})


def claim_report_files(out_dir: Path, names: list[str], force: bool) -> dict:
    """Refuse to overwrite a file of `out_dir` that fullece did not write.

    A file is fullece's when REPORT_RECORD lists it with its current sha256
    (or as being written by a report that stopped half way). Returns the
    record to keep; raises ValueError naming the other files unless `force`.
    """
    from pipeline.store.manifest import file_sha256

    record = _read_record(out_dir)
    foreign = []
    for name in names:
        path = out_dir / name
        if not os.path.lexists(path):
            continue
        ours = name in record and (
            record[name] is None
            or (path.is_file() and not path.is_symlink() and file_sha256(path) == record[name])
        )
        if not ours:
            foreign.append(name)
    if foreign and not force:
        raise ValueError(
            f"--out {out_dir}: would overwrite {', '.join(foreign)}, not written by fullece "
            f"(or changed since; {REPORT_RECORD} records what it wrote): choose another --out, "
            "or pass --force to overwrite"
        )
    return record


def write_report(run_dirs, out_dir, *, quiet: bool = False, force: bool = False) -> Path:
    """Figures (PNG) and report.html in `out_dir`; returns the HTML path.

    A file in `out_dir` that fullece did not write is never overwritten
    unless `force` (claim_report_files); what it wrote is recorded in
    ``out_dir/.fullece-report.json``."""
    from pipeline.store.manifest import file_sha256

    if isinstance(run_dirs, (str, Path)):
        run_dirs = [run_dirs]
    out_dir = Path(out_dir)
    names = report_file_names(len(run_dirs))
    record = claim_report_files(out_dir, names, force) if out_dir.is_dir() else {}
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_record(out_dir, {**record, **dict.fromkeys(names)})
    runs = [prepare_run(d, quiet=quiet) for d in run_dirs]
    notice(f"report: drawing the figures into {out_dir} ...", not quiet)
    figures = [
        (
            "Top-1 reliability diagram",
            save_figure(
                plot_reliability(prepare_reliability(runs, "top1")),
                out_dir / "reliability_top1.png",
            ),
            "Accuracy against top-1 confidence; red: overconfident gap, blue: underconfident "
            "gap per bin. Below: positions per bin.",
        ),
        (
            "Full-distribution reliability diagram",
            save_figure(
                plot_reliability(prepare_reliability(runs, "full")),
                out_dir / "reliability_full.png",
            ),
            "Label frequency against predicted probability over every (position, class) pair; "
            "red: overconfident bins, blue: underconfident bins.",
        ),
        (
            "Calibration error against M",
            save_figure(
                plot_metrics_vs_bins(prepare_metrics_vs_bins(runs)),
                out_dir / "metrics_vs_bins.png",
            ),
            "ECE, cw-ECE and Full-ECE for the paper's M set; markers are exact values, bars "
            "over shaded bands are proven intervals where the data do not determine the value "
            "(M > M_exact, or cw-ECE of an import); ECE is exact at every M.",
        ),
        (
            "Token frequency",
            save_figure(
                plot_token_frequency(
                    [(r["label"], prepare_frequency_histogram(r["label_counts"])) for r in runs]
                ),
                out_dir / "token_frequency.png",
            ),
            "Share of the vocabulary by the number of times each entry occurs as a label.",
        ),
    ]
    for i, run in enumerate(runs):
        suffix = "" if len(runs) == 1 else f"_{i}"
        if run["top1"] is not None:
            figures.append(
                (
                    f"Smooth reliability diagram ({run['label']})",
                    save_figure(
                        plot_smooth_reliability(prepare_smooth_reliability(*run["top1"])),
                        out_dir / f"smooth_reliability{suffix}.png",
                    ),
                    "relplot's kernel-smoothed reliability curve of the top-1 confidences "
                    "(Błasiok & Nakkiran); the title gives the smooth ECE.",
                )
            )
        if run["temperature"] is not None:
            figures.append(
                (
                    f"Temperature scaling ({run['label']})",
                    save_figure(
                        plot_temperature_curve(prepare_temperature_curve(run["temperature"])),
                        out_dir / f"temperature{suffix}.png",
                    ),
                    "NLL, ECE and Full-ECE of softmax(logits / T), recomputed from the stored "
                    "logits; green: the NLL-minimising T*.",
                )
            )
    if len(runs) > 1:
        figures.append(
            (
                "Trend across runs",
                save_figure(plot_trend(prepare_trend(runs)), out_dir / "trend.png"),
                "Metrics at M = 10 for each run, in the order given.",
            )
        )
    from pipeline.store import atomic

    summary = [
        {
            "label": r["label"],
            "path": r["path"],
            "bins": r["metrics"]["bins"],
            "rsd": r["metrics"]["rsd"],
        }
        for r in runs
    ]
    atomic.write_json(out_dir / "metrics.json", summary)
    page = write_html(runs, figures, out_dir)
    written = [png for _, png, _ in figures] + [out_dir / "metrics.json", page]
    record.update((p.name, file_sha256(p)) for p in written)
    _write_record(out_dir, {k: v for k, v in record.items() if v is not None})
    return page
