"""`fullece report`: PNG figures and an HTML page that references every one."""

from __future__ import annotations

import re

import numpy as np
import pytest
from click.testing import CliRunner

from pipeline.analysis.report import write_report
from pipeline.cli.report import report
from tests.helpers.analysis_runs import dense_case, write_run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("n_runs", [1, 3])
def test_report_files(tmp_path, n_runs):
    runs = []
    for i in range(n_runs):
        case = dense_case(300, 30, seed=40 + i, docs=15, temperature=1.6 - 0.2 * i)
        write_run(tmp_path / f"r{i}", case, k=5, label=f"ckpt-{i}")
        runs.append(tmp_path / f"r{i}")
    html_path = write_report(runs, tmp_path / "out", quiet=True)
    pngs = sorted((tmp_path / "out").glob("*.png"))
    names = {p.name for p in pngs}
    assert {
        "reliability_top1.png",
        "reliability_full.png",
        "metrics_vs_bins.png",
        "token_frequency.png",
    } <= names
    assert ("trend.png" in names) == (n_runs > 1)
    for p in pngs:
        data = p.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000
    page = html_path.read_text()
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    for p in pngs:
        assert f'href="{p.name}"' in page
    assert len(re.findall(r'src="data:image/png;base64,', page)) == len(pngs)  # self-contained
    for i in range(n_runs):
        assert f"ckpt-{i}" in page


def test_report_cli(tmp_path):
    write_run(tmp_path / "r", dense_case(200, 30, seed=1, docs=5), k=3)
    res = CliRunner().invoke(report, [str(tmp_path / "r"), "--out", str(tmp_path / "o"), "--quiet"])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "o" / "report.html").exists()


def test_matplotlib_only_inside_report():
    import subprocess
    import sys

    code = (
        "import sys, pipeline.aggregate.tables, pipeline.analysis.metrics, pipeline.analysis.sql, pipeline.analysis.report, "
        "pipeline.core.bootstrap; assert 'matplotlib' not in sys.modules; "
        "assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_prepared_data_match_the_dense_case(tmp_path):
    """The data the figures draw (prepare_*), against values computed from the
    dense case itself: metrics, reliability counts/frequencies, label counts, trend."""
    import numpy as np

    from pipeline.analysis.report import prepare_run, prepare_trend
    from tests.helpers.analysis_runs import dense_reference, ref_bins

    runs = []
    cases = []
    for i in range(2):
        case = dense_case(300, 20, seed=60 + i, docs=10, temperature=1.5 - 0.3 * i)
        write_run(tmp_path / f"r{i}", case, k=20, label=f"ckpt-{i}")  # k = K: no tail
        runs.append(prepare_run(tmp_path / f"r{i}", quiet=True))
        cases.append(case)
    for run, case in zip(runs, cases, strict=True):
        for row in run["metrics"]["bins"]:
            ref = dense_reference(case.probs, case.labels, row["M"])
            for key in ("ece", "cw_ece", "full_ece"):
                assert row[key] == pytest.approx(ref[key], abs=1e-12)
        np.testing.assert_array_equal(
            run["label_counts"], np.bincount(case.labels, minlength=case.vocab_size)
        )
        rel = run["reliability"]
        M = rel["n_bins"]
        top1 = case.probs.argmax(axis=1)
        conf = case.probs[np.arange(case.n), top1]
        b = ref_bins(conf, M)
        count = np.bincount(b, minlength=M + 1)[1:]
        np.testing.assert_array_equal(rel["top1"]["count"], count)
        hits = np.bincount(b, weights=top1 == case.labels, minlength=M + 1)[1:]
        seen = count > 0
        np.testing.assert_allclose(rel["top1"]["frequency"][seen], hits[seen] / count[seen])
        assert np.isnan(rel["top1"]["frequency"][~seen]).all()
        full = np.bincount(ref_bins(case.probs, M).ravel(), minlength=M + 1)[1:]
        np.testing.assert_array_equal(rel["full"]["count"], full)
    trend = prepare_trend(runs, 10)
    assert trend["labels"] == ["ckpt-0", "ckpt-1"]
    for i, case in enumerate(cases):
        assert trend["full_ece"][i] == pytest.approx(
            dense_reference(case.probs, case.labels, 10)["full_ece"], abs=1e-12
        )


# ------------------------------------------------ prepare_* (data, no drawing)


def _run_stub(label, mean, freq, count, n_bins=4, metrics_row=None):
    nan = float("nan")
    d = {
        "count": np.asarray(count, float),
        "mean_prob": np.asarray([nan if c == 0 else m for m, c in zip(mean, count, strict=True)]),
        "frequency": np.asarray([nan if c == 0 else f for f, c in zip(freq, count, strict=True)]),
    }
    rows = [metrics_row] if metrics_row else []
    return {
        "label": label,
        "reliability": {
            "n_bins": n_bins,
            "edges": np.linspace(0, 1, n_bins + 1),
            "top1": d,
            "full": d,
        },
        "metrics": {"bins": rows, "rsd": None},
    }


def test_prepare_reliability_splits_gaps_by_sign():
    from pipeline.analysis.report import prepare_reliability

    row = {
        "M": 4,
        "ece": 0.1,
        "full_ece": 0.2,
        "exact": True,
        "overconfidence": 0.15,
        "underconfidence": 0.05,
    }
    run = _run_stub("r", [0.1, 0.4, 0.6, 0.9], [0.2, 0.3, 0.6, 0.5], [5, 3, 0, 2], metrics_row=row)
    data = prepare_reliability([run], "full")
    s = data["series"][0]
    np.testing.assert_allclose(s["over"], [0.0, 0.1, np.nan, 0.4], atol=1e-12)
    np.testing.assert_allclose(s["under"], [0.1, 0.0, np.nan, 0.0], atol=1e-12)
    assert data["metric"] == "Full-ECE" and s["value"] == 0.2 and s["overconfidence"] == 0.15
    assert prepare_reliability([run], "top1")["metric"] == "ECE"
    with pytest.raises(ValueError):
        prepare_reliability([run], "classwise")


def test_prepare_temperature_curve_and_metrics_intervals():
    from pipeline.analysis.report import prepare_metrics_vs_bins, prepare_temperature_curve

    scan = {
        "M": 10,
        "grid": [
            {"temperature": 2.0, "nll": 1.5, "ece": 0.2, "full_ece": 0.3},
            {"temperature": 0.5, "nll": 2.5, "ece": 0.4, "full_ece": 0.6},
        ],
        "best_nll_temperature": 1.7,
        "best": {"temperature": 1.7, "nll": 1.4, "ece": 0.1, "full_ece": 0.2},
    }
    curve = prepare_temperature_curve(scan)
    np.testing.assert_array_equal(curve["temperature"], [0.5, 2.0])
    np.testing.assert_array_equal(curve["nll"], [2.5, 1.5])
    assert curve["best_temperature"] == 1.7
    rows = [
        {"M": 5, "ece": 0.1, "cw_ece": 0.01, "full_ece": 0.2, "exact": True},
        {
            "M": 10,
            "ece": 0.1,
            "cw_ece": None,
            "cw_ece_bounds": [0.02, 0.03],
            "full_ece": 0.2,
            "exact": True,
        },
    ]
    data = prepare_metrics_vs_bins([{"label": "imp", "metrics": {"bins": rows, "rsd": None}}])
    cw = next(p for p in data["metrics"] if p["key"] == "cw_ece")["runs"][0]
    np.testing.assert_array_equal(cw["value"][:1], [0.01])
    assert np.isnan(cw["value"][1]) and cw["lo"][1] == 0.02 and cw["hi"][1] == 0.03


def test_full_store_report_has_smooth_and_temperature_figures(tmp_path):
    import matplotlib

    from pipeline.analysis.report import (
        plot_reliability,
        plot_temperature_curve,
        prepare_reliability,
        prepare_run,
        prepare_temperature_curve,
    )

    write_run(tmp_path / "full", dense_case(200, 20, seed=2, docs=5), store="full")
    write_report([tmp_path / "full"], tmp_path / "out", quiet=True)
    names = {p.name for p in (tmp_path / "out").glob("*.png")}
    assert {"smooth_reliability.png", "temperature.png"} <= names
    page = (tmp_path / "out" / "report.html").read_text()
    assert "NLL" in page and "adaptive ECE" in page
    run = prepare_run(tmp_path / "full", quiet=True)
    fig = plot_temperature_curve(prepare_temperature_curve(run["temperature"]))
    assert isinstance(fig, matplotlib.figure.Figure)
    import matplotlib.pyplot as plt

    fig2, ax = plt.subplots()
    assert plot_reliability(prepare_reliability([run], "top1"), ax=ax) is fig2
    plt.close("all")
