"""`fullece report`: PNG figures and an HTML page that references every one."""

from __future__ import annotations

import re

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
        "import sys, pipeline.aggregate.executor, pipeline.analysis.metrics, pipeline.analysis.sql, pipeline.analysis.report, "
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
