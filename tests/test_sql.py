"""`fullece sql`: every worked query of docs/sql.md runs and matches
`fullece metrics` / the tables."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from pipeline.aggregate import load_run_tables
from pipeline.analysis.sql import run_query
from pipeline.cli.metrics import metrics
from pipeline.cli.sql import sql
from tests.helpers.analysis_runs import dense_case, dense_doc_full_ece, write_run

ROOT = Path(__file__).resolve().parent.parent
SQL_DOC = ROOT / "docs" / "sql.md"


def sql_blocks():
    """(file, check name, query) of every ```sql block in docs/sql.md."""
    out = []
    for b in re.findall(r"```sql\n(.*?)```", SQL_DOC.read_text(), re.S):
        m = re.search(r"--\s*check:\s*(\S+)", b)
        out.append((SQL_DOC.name, m.group(1) if m else None, b))
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("sql")
    case = dense_case(900, 40, seed=31, docs=45)
    write_run(d / "run", case, k=4, tau=1e-3, shard_rows=400, label="sql-run")
    res = CliRunner().invoke(metrics, [str(d / "run"), "--json", "--quiet"])
    assert res.exit_code == 0, res.output
    return d / "run", case, json.loads(res.stdout)


def test_examples_have_checks():
    blocks = sql_blocks()
    missing = [(f, q[:60]) for f, n, q in blocks if n is None]
    assert not missing, f"every ```sql block needs a '-- check: NAME' line: {missing}"
    names = {n for _, n, _ in blocks}
    assert {"full_ece@10", "rare_tokens", "worst_documents"} <= names


@pytest.mark.parametrize(
    "source,name,query", sql_blocks(), ids=[f"{f}:{n}" for f, n, _ in sql_blocks()]
)
def test_example(run, source, name, query):
    run_dir, case, met = run
    names, rows = run_query([run_dir], query)
    by_m = {b["M"]: b for b in met["bins"]}
    if "@" in name:
        metric, m = name.split("@")
        assert len(rows) == 1
        assert rows[0][0] == pytest.approx(by_m[int(m)][metric], abs=1e-12)
    elif name == "token_frequency":
        shares = {b["range"]: b["share"] for b in met["token_frequency"]["buckets"]}
        got = {r[0]: r[2] for r in rows}
        for key, share in shares.items():
            assert got.get(key, 0.0) == pytest.approx(share)
    elif name == "rare_tokens":
        counts = np.bincount(case.labels, minlength=case.vocab_size)
        rare = np.flatnonzero((counts >= 1) & (counts <= 10))
        row = dict(zip(names, rows[0], strict=True))
        assert row["classes"] == rare.size
        assert row["occurrences"] == counts[rare].sum()
        mass = case.probs[:, rare].astype(np.float64).sum()
        assert row["predicted_mass"] == pytest.approx(mass, rel=1e-9)
        # cw-ECE share at M=10 from the dense matrix, restricted to rare classes
        p64 = case.probs.astype(np.float64)
        bins = np.maximum(np.ceil(p64 * 10), 1)
        y = np.zeros_like(case.probs, dtype=np.float64)
        y[np.arange(case.n), case.labels] = 1
        share = sum(
            np.abs(
                (y[:, rare] * (bins[:, rare] == m)).sum(0)
                - (p64[:, rare] * (bins[:, rare] == m)).sum(0)
            ).sum()
            for m in range(1, 11)
        ) / (case.n * case.vocab_size)
        assert row["cw_ece_share"] == pytest.approx(share, abs=1e-12)
    elif name == "worst_documents":
        ref = dense_doc_full_ece(case.probs, case.labels, case.doc_ids, 10)
        worst = sorted(ref.items(), key=lambda kv: (-kv[1], kv[0]))[:10]
        assert [r[0] for r in rows] == [d for d, _ in worst]
        for r, (_, v) in zip(rows, worst, strict=True):
            assert r[2] == pytest.approx(v, abs=1e-12)
    elif name == "positions":
        order = np.lexsort(
            (np.arange(case.n), case.doc_ids, case.probs[np.arange(case.n), case.labels])
        )
        assert [r[2] for r in rows] == case.labels[order[:5]].tolist()
    else:
        pytest.fail(f"unknown check {name}")


def test_views_and_manifest(run):
    run_dir, case, met = run
    names, rows = run_query([run_dir], "SELECT run, store, vocab_size, positions FROM manifest")
    assert rows == [("sql-run", "topk", 40, 900)]
    _, rows = run_query([run_dir], "SELECT count(*) FROM positions")
    assert rows[0][0] == 900
    _, rows = run_query([run_dir], "SELECT sum(n) FROM class_bins")
    assert rows[0][0] == 900 * 40
    tables = load_run_tables(run_dir)
    _, rows = run_query([run_dir], "SELECT fine_bins, m_exact FROM meta")
    assert rows[0] == (tables.fine_bins, tables.m_exact)


def test_several_runs_group_by_run(run, tmp_path):
    run_dir, _, met = run
    other = dense_case(300, 40, seed=2, docs=10)
    write_run(tmp_path / "b", other, k=40, label="other")
    _, rows = run_query(
        [run_dir, tmp_path / "b"], "SELECT run, sum(hits) FROM class_bins GROUP BY run ORDER BY run"
    )
    assert rows == [("other", 300), ("sql-run", 900)]


def test_cli_outputs(run, tmp_path):
    run_dir, _, _ = run
    q = "SELECT bin, n FROM top1_bins ORDER BY bin LIMIT 3"
    res = CliRunner().invoke(sql, [str(run_dir), q])
    assert res.exit_code == 0, res.output
    assert "bin" in res.stdout and "(3 rows)" in res.stdout
    for flag, name in (("--csv", "o.csv"), ("--json", "o.json"), ("--parquet", "o.parquet")):
        res = CliRunner().invoke(sql, [str(run_dir), q, flag, str(tmp_path / name)])
        assert res.exit_code == 0, res.output
    assert (tmp_path / "o.csv").read_text().startswith("bin,n")
    assert len(json.loads((tmp_path / "o.json").read_text())) == 3
    assert pq.read_table(tmp_path / "o.parquet").num_rows == 3
    res = CliRunner().invoke(sql, [str(run_dir), "SELECT nope FROM top1_bins"])
    assert res.exit_code != 0 and "nope" in res.output


def test_views_are_read_only(run):
    run_dir, _, _ = run
    import duckdb

    with pytest.raises(duckdb.Error):
        run_query([run_dir], "DELETE FROM class_bins")
