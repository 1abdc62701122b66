"""The embedded default: verdict logic, and a miniature of `make extract` / `make metrics`
run through the same code (tens of training steps, a few hundred test tokens)."""

from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner

from pipeline import PAPER_BINS
from pipeline.demo.default import findings, format_default
from tests.helpers.default_tiny import TINY_TRAIN, write_tiny_corpus


def _row(label, step, cw_rsd, full_rsd, full10, never=0.3, rare=0.41):
    bins = [
        {
            "M": m,
            "ece": 0.01,
            "cw_ece": 1e-4,
            "full_ece": full10 if m == 10 else 0.02,
            "exact": True,
        }
        for m in PAPER_BINS
    ]
    buckets = [
        {"range": "0", "share": never, "classes": 3},
        {"range": "1-10", "share": rare, "classes": 4},
        {"range": "11-100", "share": 1 - never - rare, "classes": 3},
        {"range": ">100", "share": 0.0, "classes": 0},
    ]
    return {
        "label": label,
        "run_dir": f"runs/{label}",
        "test_loss": 3.0,
        "training": {"step": step, "tokens_seen": step * 4096},
        "metrics": {
            "positions": 100,
            "vocab_size": 10,
            "m_exact": 1000,
            "bins": bins,
            "rsd": {"bins": list(PAPER_BINS), "ece": 1.0, "cw_ece": cw_rsd, "full_ece": full_rsd},
            "token_frequency": {"vocab_size": 10, "distinct_labels": 7, "buckets": buckets},
        },
    }


def test_findings_follow_the_numbers():
    rows = [
        _row("a", 1, 40.0, 8.0, 0.30),
        _row("b", 10, 45.0, 9.0, 0.20),
        _row("c", 100, 44.0, 7.0, 0.10),
    ]
    v = findings(rows)
    assert v["table1"]["status"] == "reproduced"
    assert v["frequency"]["status"] == "reproduced"
    assert v["trend"]["status"] == "reproduced"
    assert v["trend"]["values"] == [0.30, 0.20, 0.10]
    text = format_default(rows, v)
    for needle in ("Table 1", "Token frequency", "Figure 2", "[reproduced]", "RSD cw-ECE"):
        assert needle in text

    rows = [
        _row("a", 1, 5.0, 8.0, 0.10, never=0.1, rare=0.2),
        _row("b", 10, 45.0, 9.0, 0.20, never=0.1, rare=0.2),
    ]
    v = findings(rows)
    assert v["table1"]["status"] == "partly reproduced"
    assert v["frequency"]["status"] == "not reproduced"
    assert v["trend"]["status"] == "not reproduced"

    rows = [_row("a", 1, 5.0, 8.0, 0.3), _row("b", 2, 5.0, 8.0, 0.35), _row("c", 3, 5.0, 8.0, 0.1)]
    v = findings(rows)
    assert v["table1"]["status"] == "not reproduced"
    assert v["trend"]["status"] == "partly reproduced"


@pytest.fixture(scope="module")
def mini(tmp_path_factory):
    """`fullece default extract` on a miniature: user corpus, tiny training settings."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from pipeline.cli import main

    root = tmp_path_factory.mktemp("default")
    write_tiny_corpus(root / "corpus")
    args = [
        "default",
        "extract",
        "--corpus-dir",
        str(root / "corpus"),
        "--models-dir",
        str(root / "models"),
        "--runs-dir",
        str(root / "runs"),
        "--quiet",
        "--steps",
        str(TINY_TRAIN["steps"]),
        "--checkpoints",
        str(TINY_TRAIN["checkpoints"]),
        "--vocab-size",
        str(TINY_TRAIN["vocab_size"]),
        "--layers",
        str(TINY_TRAIN["layers"]),
        "--width",
        str(TINY_TRAIN["width"]),
        "--heads",
        str(TINY_TRAIN["heads"]),
        "--context",
        str(TINY_TRAIN["context"]),
        "--train-batch-size",
        str(TINY_TRAIN["batch_size"]),
    ]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    return root, args, result


@pytest.mark.slow
def test_mini_extract_writes_loadable_checkpoints_and_valid_runs(mini):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.cli import main

    root, _, result = mini
    runs = sorted(p for p in (root / "runs").iterdir() if p.is_dir())
    assert [p.name for p in runs] == ["ckpt-000001", "ckpt-000004", "ckpt-000012"]
    for run in runs:
        ckpt = root / "models" / run.name
        AutoModelForCausalLM.from_pretrained(str(ckpt), local_files_only=True)
        AutoTokenizer.from_pretrained(str(ckpt), local_files_only=True)
        check = CliRunner().invoke(main, ["validate", str(run)])
        assert check.exit_code == 0, check.output
        manifest = json.loads((run / "manifest.json").read_text())
        assert manifest["complete"]
        assert 200 <= manifest["positions"] <= 5000  # a few hundred test tokens
        assert manifest["settings"]["k"] == 64 and manifest["settings"]["tau"] <= 1e-3
        assert manifest["m_exact"] is None or manifest["m_exact"] >= max(PAPER_BINS)
    summary = json.loads((root / "runs" / "default.json").read_text())
    assert [r["run"] for r in summary["runs"]] == [str(p) for p in runs]
    assert summary["training"]["checkpoint_steps"] == [1, 4, 12]


@pytest.mark.slow
def test_mini_extract_resumes_and_skips_what_is_done(mini):
    from pipeline.cli import main

    root, args, _ = mini
    again = CliRunner().invoke(main, args)
    assert again.exit_code == 0, again.output
    assert "skipped" in again.output  # training
    assert again.output.count("already complete, kept") == 3  # extraction


@pytest.mark.slow
def test_mini_metrics_json_has_every_paper_m_and_report_exists(mini):
    from pipeline.cli import main

    root, _, _ = mini
    for run in ("ckpt-000001", "ckpt-000012"):
        res = CliRunner().invoke(main, ["metrics", str(root / "runs" / run), "--json", "--quiet"])
        assert res.exit_code == 0, res.output
        data = json.loads(res.stdout)
        assert [b["M"] for b in data["bins"]] == list(PAPER_BINS)
        assert all(b["exact"] for b in data["bins"])
        assert all(math.isfinite(b["full_ece"]) for b in data["bins"])

    res = CliRunner().invoke(
        main,
        [
            "default",
            "metrics",
            "--runs-dir",
            str(root / "runs"),
            "--report-dir",
            str(root / "report"),
            "--quiet",
        ],
    )
    assert res.exit_code == 0, res.output
    out = res.stdout
    for needle in (
        "1. Metrics at the paper's M",
        "2. Table 1",
        "3. Token frequency",
        "4. Trend across training",
        "Findings of the paper",
    ):
        assert needle in out
    assert out.index("ckpt-000001") < out.index("ckpt-000004") < out.index("ckpt-000012")
    report = root / "report" / "report.html"
    assert report.exists() and f"report: {report}" in out
    summary = json.loads((root / "report" / "default_summary.json").read_text())
    assert [r["label"] for r in summary["runs"]] == ["ckpt-000001", "ckpt-000004", "ckpt-000012"]
    assert set(summary["findings"]) == {"table1", "frequency", "trend"}


def test_metrics_without_runs_fails_cleanly(tmp_path):
    from pipeline.cli import main

    res = CliRunner().invoke(main, ["default", "metrics", "--runs-dir", str(tmp_path / "none")])
    assert res.exit_code != 0
    assert "make extract" in res.output
