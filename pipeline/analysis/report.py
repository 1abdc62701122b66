"""``fullece report``: PNG figures and one self-contained HTML page.

``prepare_*`` functions compute the data (numpy, from the bin tables);
``plot_*`` functions draw it. matplotlib is imported only inside the plot
functions (Agg backend), so nothing else in the tool pays for it.
"""

from __future__ import annotations

import base64
import html
import math
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from pipeline import PAPER_BINS

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
    """Everything the figures of one run need (tables aggregated if needed)."""
    from pipeline.aggregate import ensure_tables, load_run_tables
    from pipeline.core.metrics import compute_metrics, reliability
    from pipeline.store.run import is_run, run_label

    run_dir = Path(run_dir)
    tables_dir = ensure_tables(run_dir, quiet=quiet)
    tables = load_run_tables(tables_dir)
    bins = [m for m in bins if tables.fine_bins % m == 0]
    metrics = compute_metrics(tables, bins)
    _cw_ece_intervals(metrics, tables_dir, tables)
    return {
        "label": run_label(run_dir) if is_run(run_dir) else run_dir.name,
        "path": str(run_dir),
        "metrics": metrics,
        "reliability": reliability(tables, reliability_bins),
        "label_counts": tables.label_count.copy(),
    }


def _cw_ece_intervals(metrics: dict, tables_dir, tables) -> None:
    """Imported runs (per-class tail unknown): cw-ECE is an interval, not a point (NaN)."""
    from pipeline.analysis.metrics import _set_cw_bounds, _tail_bounds

    tail_bounds = _tail_bounds(tables_dir, tables)
    if tail_bounds is None:
        return
    for row in metrics["bins"]:
        _set_cw_bounds(row, tables, row["M"], tail_bounds)
        row["cw_ece"] = float("nan")
    if metrics.get("rsd"):
        metrics["rsd"]["cw_ece"] = None


def prepare_trend(runs: list[dict], n_bins: int = 10) -> dict:
    """Metrics at M = n_bins per run, in the order given."""
    out = {"M": n_bins, "labels": [r["label"] for r in runs]}
    for key in ("ece", "cw_ece", "full_ece"):
        vals = []
        for r in runs:
            row = next((b for b in r["metrics"]["bins"] if b["M"] == n_bins), None)
            vals.append(np.nan if row is None else row[key])
        out[key] = np.asarray(vals)
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


def plot_reliability(runs: list[dict], kind: str, path: Path) -> Path:
    """Reliability diagram: observed frequency vs mean predicted probability per
    bin, with the per-bin count below (log scale for the full distribution)."""
    plt = _plt()
    fig, (ax, axc) = plt.subplots(
        2,
        1,
        figsize=(5.2, 6.0),
        sharex=True,
        gridspec_kw={"height_ratios": [3, 1.2], "hspace": 0.08},
    )
    rel0 = runs[0]["reliability"]
    edges = np.asarray(rel0["edges"])
    width = np.diff(edges)
    centers = edges[:-1] + width / 2
    ax.plot([0, 1], [0, 1], ls="--", color="0.5", lw=1, label="perfect calibration")
    single = len(runs) == 1
    for i, run in enumerate(runs):
        d = run["reliability"][kind]
        color = COLORS[i % len(COLORS)]
        freq = np.asarray(d["frequency"], float)
        mean = np.asarray(d["mean_prob"], float)
        ok = np.isfinite(freq)
        if single:
            ax.bar(
                centers[ok],
                freq[ok],
                width=width[ok] * 0.9,
                color=color,
                alpha=0.75,
                edgecolor="white",
                label="observed frequency",
            )
            gap_lo = np.minimum(freq[ok], mean[ok])
            ax.bar(
                centers[ok],
                np.abs(mean[ok] - freq[ok]),
                bottom=gap_lo,
                width=width[ok] * 0.9,
                color="none",
                edgecolor="#d62728",
                hatch="///",
                lw=0.8,
                label="gap to mean confidence",
            )
        else:
            ax.plot(mean[ok], freq[ok], marker="o", ms=4, color=color, label=run["label"])
        axc.bar(
            centers + (i - (len(runs) - 1) / 2) * width * 0.8 / len(runs),
            np.asarray(d["count"], float),
            width=width * 0.8 / len(runs),
            color=color,
            alpha=0.8,
        )
    metric = {"top1": ("ece", "ECE"), "full": ("full_ece", "Full-ECE")}[kind]
    m = rel0["n_bins"]
    if single:
        row = next((b for b in runs[0]["metrics"]["bins"] if b["M"] == m), None)
        if row is not None:
            ax.text(
                0.04,
                0.93,
                f"{metric[1]}(M={m}) = {row[metric[0]]:.4f}",
                transform=ax.transAxes,
                fontsize=10,
                va="top",
                bbox={"facecolor": "white", "edgecolor": "0.8"},
            )
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_ylabel("observed frequency")
    title = {"top1": "Top-1 reliability diagram", "full": "Full-distribution reliability diagram"}
    ax.set_title(f"{title[kind]} (M = {m})")
    ax.legend(loc="upper left", bbox_to_anchor=(0.0, 0.86), fontsize=8, frameon=False)
    if kind == "full":
        axc.set_yscale("log")  # bin 1 holds nearly every pair
    axc.set_ylabel("pairs" if kind == "full" else "positions")
    axc.set_xlabel("predicted probability" if kind == "full" else "top-1 confidence")
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_metrics_vs_bins(runs: list[dict], path: Path) -> Path:
    """ECE, cw-ECE and Full-ECE against M (log scale): the instability of
    cw-ECE across M that the paper is about. Hollow markers: approximate."""
    plt = _plt()
    names = (("ece", "ECE"), ("cw_ece", "cw-ECE"), ("full_ece", "Full-ECE"))
    fig, axes = plt.subplots(1, 3, figsize=(11.5, 3.6))
    for ax, (key, name) in zip(axes, names, strict=True):
        for i, run in enumerate(runs):
            rows = run["metrics"]["bins"]
            ms = np.array([r["M"] for r in rows])
            vals = np.array([r[key] for r in rows])
            exact = np.array([r["exact"] for r in rows])
            color = COLORS[i % len(COLORS)]
            ax.plot(ms, vals, color=color, lw=1.5, label=run["label"])
            ax.scatter(ms[exact], vals[exact], color=color, s=22, zorder=3)
            ax.scatter(ms[~exact], vals[~exact], facecolor="white", edgecolor=color, s=22, zorder=3)
        rsd = runs[0]["metrics"].get("rsd")
        if rsd and len(runs) == 1 and rsd.get(key) is not None and math.isfinite(rsd[key]):
            ax.text(
                0.04, 0.94, f"RSD = {rsd[key]:.1f}%", transform=ax.transAxes, va="top", fontsize=9
            )
        ax.set_xscale("log")
        all_m = sorted({r["M"] for run in runs for r in run["metrics"]["bins"]})
        ax.set_xticks(all_m, [str(m) for m in all_m])
        ax.minorticks_off()
        ax.set_xlabel("number of bins M")
        ax.set_title(name)
        ax.set_ylim(bottom=0)
        ax.grid(True, which="major", alpha=0.3)
    axes[0].set_ylabel("calibration error")
    if len(runs) > 1:
        axes[-1].legend(fontsize=8, frameon=False)
    fig.suptitle("Calibration error against the number of bins", y=1.02)
    fig.tight_layout()
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_token_frequency(runs: list[dict], path: Path) -> Path:
    """Share of the vocabulary by how often each entry occurs as a label."""
    plt = _plt()
    hists = [prepare_frequency_histogram(r["label_counts"]) for r in runs]
    labels = max((h["labels"] for h in hists), key=len)
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    x = np.arange(len(labels))
    w = 0.8 / len(runs)
    for i, (run, h) in enumerate(zip(runs, hists, strict=True)):
        shares = np.zeros(len(labels))
        shares[: len(h["shares"])] = h["shares"]
        bars = ax.bar(
            x + (i - (len(runs) - 1) / 2) * w,
            shares * 100,
            width=w,
            color=COLORS[i % len(COLORS)],
            label=run["label"],
        )
        if len(runs) == 1:
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
    ax.set_title(f"Token frequency (K = {hists[0]['vocab_size']:,})")
    if len(runs) > 1:
        ax.legend(fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_trend(trend: dict, path: Path) -> Path:
    """Metrics at M across runs (training checkpoints, say), in the order given."""
    plt = _plt()
    names = (("ece", "ECE"), ("cw_ece", "cw-ECE"), ("full_ece", "Full-ECE"))
    fig, axes = plt.subplots(1, 3, figsize=(11.5, 3.6))
    x = np.arange(len(trend["labels"]))
    for ax, (key, name), color in zip(axes, names, COLORS, strict=False):
        ax.plot(x, trend[key], marker="o", color=color)
        ax.set_xticks(x, trend["labels"], rotation=30, ha="right")
        ax.set_title(f"{name} (M = {trend['M']})")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("calibration error")
    fig.tight_layout()
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
    return path


# --------------------------------------------------------------------- HTML


def _cw_html(row: dict) -> str:
    if row.get("cw_ece_bounds") is not None:  # imported run: the proven interval
        return f"[{row['cw_ece_bounds'][0]:.3e}, {row['cw_ece_bounds'][1]:.3e}]"
    return f"{row['cw_ece']:.3e}"


def _metrics_table(runs: list[dict]) -> str:
    rows = []
    for run in runs:
        m = run["metrics"]
        for b in m["bins"]:
            rows.append(
                f"<tr><td>{html.escape(run['label'])}</td><td>{b['M']}</td>"
                f"<td>{b['ece']:.6f}</td><td>{_cw_html(b)}</td><td>{b['full_ece']:.6f}</td>"
                f"<td>{'exact' if b['exact'] else 'approximate'}</td></tr>"
            )
    head = "<tr><th>run</th><th>M</th><th>ECE</th><th>cw-ECE</th><th>Full-ECE</th><th></th></tr>"
    return f"<table>{head}{''.join(rows)}</table>"


def _summary(runs: list[dict]) -> str:
    items = []
    for run in runs:
        m = run["metrics"]
        rsd = m.get("rsd") or {}
        tf = m["token_frequency"]
        shares = ", ".join(f"{b['range']}: {b['share'] * 100:.1f}%" for b in tf["buckets"])
        rsd_txt = ", ".join(
            f"{n} {rsd[k]:.1f}%"
            for k, n in (("ece", "ECE"), ("cw_ece", "cw-ECE"), ("full_ece", "Full-ECE"))
            if rsd.get(k) is not None and math.isfinite(rsd[k])
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
{_metrics_table(runs)}
{"".join(sections)}
</body></html>
"""
    path = out_dir / "report.html"
    atomic.write_bytes(path, page.encode())
    return path


def write_report(run_dirs, out_dir, *, quiet: bool = False) -> Path:
    """Figures (PNG) and report.html in `out_dir`; returns the HTML path."""
    if isinstance(run_dirs, (str, Path)):
        run_dirs = [run_dirs]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = [prepare_run(d, quiet=quiet) for d in run_dirs]
    figures = [
        (
            "Top-1 reliability diagram",
            plot_reliability(runs, "top1", out_dir / "reliability_top1.png"),
            "Accuracy against top-1 confidence; hatched: the gap per bin. Below: positions per bin.",
        ),
        (
            "Full-distribution reliability diagram",
            plot_reliability(runs, "full", out_dir / "reliability_full.png"),
            "Label frequency against predicted probability over every (position, class) pair.",
        ),
        (
            "Calibration error against M",
            plot_metrics_vs_bins(runs, out_dir / "metrics_vs_bins.png"),
            "ECE, cw-ECE and Full-ECE for the paper's M set; hollow markers are approximate "
            "(M > M_exact).",
        ),
        (
            "Token frequency",
            plot_token_frequency(runs, out_dir / "token_frequency.png"),
            "Share of the vocabulary by the number of times each entry occurs as a label.",
        ),
    ]
    if len(runs) > 1:
        figures.append(
            (
                "Trend across runs",
                plot_trend(prepare_trend(runs), out_dir / "trend.png"),
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
    return write_html(runs, figures, out_dir)
