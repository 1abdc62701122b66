"""`fullece aggregate`: tables equal the metric core's in-memory tables and the
dense reference; incremental per-shard parts; errors that name the file."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from pipeline.aggregate import (
    AggregateError,
    aggregate,
    aggregate_runs,
    load_run_tables,
    tables_status,
)
from pipeline.cli.aggregate import aggregate_command
from pipeline.core.accumulator import CalibrationAccumulator
from pipeline.core.metrics import metrics_at
from pipeline.store.hashes import path_sha256
from pipeline.store.schema import SchemaVersionError
from tests.helpers.analysis_runs import (
    assert_table_columns_equal,
    assert_tables_match_dense,
    dense_case,
    dense_reference,
    dense_reference_tables,
    write_run,
)
from tests.helpers.shard_readers import accumulate_kept

SUM_TOL = 1e-12


def core_tables(run_dir, manifest):
    """The metric core's in-memory tables for the same kept entries + tails
    (numpy, not the DuckDB SQL that `aggregate` runs)."""
    acc = CalibrationAccumulator(vocab_size=manifest["vocab_size"])
    accumulate_kept(acc, run_dir, manifest)
    return acc.compute()


def assert_tables_equal(a, b):
    assert a.positions == b.positions and a.vocab_size == b.vocab_size
    assert a.fine_bins == b.fine_bins and a.m_exact == b.m_exact
    assert_table_columns_equal(a, b, atol=SUM_TOL)


@pytest.fixture(scope="module")
def case():
    return dense_case(600, 40, seed=11, docs=30)


@pytest.mark.parametrize("store,k,tau", [("topk", 4, None), ("topk", 3, 1e-3), ("full", 0, None)])
def test_tables_equal_core_and_dense(tmp_path, case, store, k, tau):
    run = tmp_path / "run"
    manifest = write_run(run, case, store=store, k=k, tau=tau, shard_rows=170)
    tables = aggregate_runs([run])
    assert (run / "tables" / "meta.json").exists()
    if tau is not None or store == "full":
        # every tail probability <= 1/F (or no tail): the fine tables themselves
        # equal the dense ones, built literally from the definitions
        assert_tables_match_dense(
            tables, dense_reference_tables(case.probs, case.labels, case.doc_ids)
        )
        assert all(metrics_at(tables, m)["exact"] for m in (5, 10, 20, 50, 100, 500))
    else:
        # tail pairs above 1/F sit in bin 1 by construction: compare with the
        # kept + tail accumulation of the same shards
        assert_tables_equal(tables, core_tables(run, manifest))
    compared = []
    for m in (5, 10, 20, 50):
        got = metrics_at(tables, m)
        if got["exact"]:
            ref = dense_reference(case.probs, case.labels, m)
            for key in ("ece", "cw_ece", "full_ece"):
                assert got[key] == pytest.approx(ref[key], abs=1e-12), (store, m, key)
            compared.append(m)
    assert compared, f"no M was exact for {store} k={k} tau={tau}: nothing compared"


def test_float16_full_store(tmp_path):
    case = dense_case(200, 30, seed=3, docs=10, dtype=np.float16)
    run = tmp_path / "run"
    write_run(run, case, store="full", shard_rows=64, zarr_chunk_rows=16)
    tables = aggregate_runs([run])
    ref = dense_reference(case.probs, case.labels, 10)
    got = metrics_at(tables, 10)
    for key in ref:
        assert got[key] == pytest.approx(ref[key], abs=1e-12)


def test_incremental_parts(tmp_path, case, monkeypatch):
    run = tmp_path / "run"
    write_run(run, case, store="topk", k=4, shard_rows=200)
    first = aggregate_runs([run])
    parts = sorted(p.name for p in (run / "tables" / "parts").iterdir())
    assert parts == ["00000", "00001", "00002"]
    assert tables_status([run]) is None

    import pipeline.aggregate.shard_map as agg

    calls = []
    original = agg._aggregate_topk_shard
    monkeypatch.setattr(
        agg, "_aggregate_topk_shard", lambda *a, **k: calls.append(a[1].index) or original(*a, **k)
    )
    again = aggregate_runs([run])
    assert calls == []  # nothing re-read
    assert_tables_equal(first, again)

    # a changed shard (new sha256 in the manifest) is re-aggregated, alone
    manifest = json.loads((run / "manifest.json").read_text())
    other = dense_case(200, 40, seed=99, docs=5)
    write_run(tmp_path / "other", other, store="topk", k=4, shard_rows=200)
    src = tmp_path / "other" / "shards"
    for name in ("positions-00000.parquet", "class_tail-00000.parquet"):
        shutil.copy(src / name, run / "shards" / name.replace("00000", "00001"))
    omani = json.loads((tmp_path / "other" / "manifest.json").read_text())
    entry = dict(
        omani["shards"][0],
        index=1,
        positions="shards/positions-00001.parquet",
        class_tail="shards/class_tail-00001.parquet",
        files={
            rel: path_sha256(run / rel)
            for rel in ("shards/positions-00001.parquet", "shards/class_tail-00001.parquet")
        },
    )
    manifest["shards"][1] = entry
    (run / "manifest.json").write_text(json.dumps(manifest))
    assert tables_status([run]) is not None
    changed = aggregate_runs([run])
    assert calls == [1]
    assert changed.positions == 600
    assert not np.array_equal(changed.label_count, first.label_count)


def test_several_runs_into_one(tmp_path, case):
    a, b = case, dense_case(300, 40, seed=12, docs=10)
    write_run(tmp_path / "a", a, k=40)
    write_run(tmp_path / "b", b, k=40)
    merged = aggregate_runs([tmp_path / "a", tmp_path / "b"], out=tmp_path / "merged")
    sa = aggregate_runs([tmp_path / "a"])  # reuses the parts built for the merge
    sb = aggregate_runs([tmp_path / "b"])
    assert_tables_equal(merged, sa.merge(sb))
    with pytest.raises(AggregateError, match="--out"):
        aggregate([tmp_path / "a", tmp_path / "b"])


def test_positions_versions_mix(tmp_path, case):
    """Runs of every positions version (v3: kept elements non-null; v2: nullable;
    v1: no sum_p2) aggregate into the same tables, byte for byte, alone and
    together, and the SQL positions view reads them all as one."""
    from tests.helpers.sql import query_rows

    b = dense_case(300, 40, seed=12, docs=10)
    tables = {}
    for version in (3, 2, 1):
        for name, data in (("a", case), ("b", b)):
            write_run(tmp_path / f"{name}{version}", data, k=5, positions_version=version)
        for name in ("a", "b"):
            aggregate_runs([tmp_path / f"{name}{version}"])
        aggregate_runs(
            [tmp_path / f"a{version}", tmp_path / f"b{version}"], out=tmp_path / f"m{version}"
        )
        tables[version] = {
            f"{where}/{p.name}": p.read_bytes()
            for where in (f"a{version}/tables", f"b{version}/tables", f"m{version}")
            for p in sorted((tmp_path / where).glob("*.parquet"))
        }
    assert len(tables[3]) == 12
    assert tables[2] == {k.replace("3", "2"): v for k, v in tables[3].items()}
    assert tables[1] == {k.replace("3", "1"): v for k, v in tables[3].items()}
    mixed = aggregate_runs([tmp_path / "a2", tmp_path / "b3"], out=tmp_path / "mixed")
    assert_tables_equal(
        mixed, aggregate_runs([tmp_path / "a3", tmp_path / "b3"], out=tmp_path / "m3")
    )
    for p in sorted((tmp_path / "m3").glob("*.parquet")):
        assert (tmp_path / "mixed" / p.name).read_bytes() == p.read_bytes(), p.name
    runs = [tmp_path / "a1", tmp_path / "b2", tmp_path / "b3"]
    for run, label in zip(runs, ("v1", "v2", "v3"), strict=True):
        manifest = json.loads((run / "manifest.json").read_text())
        (run / "manifest.json").write_text(json.dumps({**manifest, "label": label}))
    query = (
        "SELECT run, count(*), sum(len(kept_ids)), sum(list_sum(kept_probs)), count(sum_p2) "
        "FROM positions GROUP BY run ORDER BY run"
    )
    _, rows = query_rows(runs, query)
    for row, run in zip(rows, runs, strict=True):
        table = pq.read_table(sorted((run / "shards").glob("positions-*.parquet")))
        kept = table.column("kept_probs").combine_chunks()
        assert row[1:3] == (table.num_rows, len(kept.values))
        assert row[3] == pytest.approx(np.sum(kept.values.to_numpy(), dtype=np.float64))
        assert row[4] == (0 if row[0] == "v1" else table.num_rows)  # v1: sum_p2 null


def test_errors_name_the_file(tmp_path, case):
    run = tmp_path / "run"
    write_run(run, case, k=3, shard_rows=300)
    # missing shard
    (run / "shards" / "class_tail-00001.parquet").unlink()
    with pytest.raises(AggregateError, match="class_tail-00001.parquet: shard file missing"):
        aggregate([run])
    # different vocabularies
    write_run(tmp_path / "k30", dense_case(50, 30, seed=1, docs=3))
    write_run(tmp_path / "k40", dense_case(50, 40, seed=1, docs=3))
    with pytest.raises(AggregateError, match="different vocabularies.*K=30.*K=40"):
        aggregate([tmp_path / "k30", tmp_path / "k40"], out=tmp_path / "m")
    # a run with no positions
    empty = tmp_path / "empty"
    write_run(empty, dense_case(50, 30, seed=1, docs=3))
    manifest = json.loads((empty / "manifest.json").read_text())
    manifest["shards"] = []
    (empty / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(AggregateError, match="no positions"):
        aggregate([empty])
    # no manifest
    (tmp_path / "nothing").mkdir()
    with pytest.raises(Exception, match="no manifest.json"):
        aggregate([tmp_path / "nothing"])


def test_shard_failing_validation(tmp_path, case):
    run = tmp_path / "run"
    write_run(run, case, k=3, shard_rows=600)
    pos = run / "shards" / "positions-00000.parquet"
    t = pq.read_table(pos)
    pq.write_table(t.drop_columns(["tail_max"]), pos)
    with pytest.raises(AggregateError, match="positions-00000.parquet.*tail_max"):
        aggregate([run])
    # a label not among the kept ids
    write_run(run, case, k=3, shard_rows=600)
    t = pq.read_table(pos)
    labels = t.column("label").to_numpy().copy()
    kept0 = set(t.column("kept_ids")[0].as_py())
    labels[0] = min(set(range(40)) - kept0)
    t = t.set_column(t.schema.get_field_index("label"), "label", pa.array(labels, pa.int32()))
    pq.write_table(t.cast(t.schema), pos)
    manifest = json.loads((run / "manifest.json").read_text())  # as a faulty extractor would
    manifest["shards"][0]["files"]["shards/positions-00000.parquet"] = path_sha256(pos)
    (run / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(AggregateError, match="positions-00000.parquet.*label"):
        aggregate([run])


def test_tables_of_another_schema_version(tmp_path, case):
    run = tmp_path / "run"
    write_run(run, case, k=3)
    aggregate([run])
    meta = json.loads((run / "tables" / "meta.json").read_text())
    meta["schema_version"] = 99
    (run / "tables" / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(SchemaVersionError, match="meta.json.*99"):
        load_run_tables(run)
    aggregate([run])  # rebuilt
    cb = run / "tables" / "class_bins.parquet"
    t = pq.read_table(cb)
    t = t.replace_schema_metadata({"fullece.table": "class_bins", "fullece.schema_version": "7"})
    pq.write_table(t, cb)
    with pytest.raises(SchemaVersionError, match="class_bins.parquet.*7"):
        load_run_tables(run)


def test_cli(tmp_path, case):
    run = tmp_path / "run"
    write_run(run, case, k=3)
    res = CliRunner().invoke(aggregate_command, [str(run), "--quiet"])
    assert res.exit_code == 0, res.output
    assert "600 positions" in res.output
    res = CliRunner().invoke(aggregate_command, [str(tmp_path / "missing")])
    assert res.exit_code != 0 and "missing" in res.output


def _force_map_workers(monkeypatch, workers):
    import pipeline.aggregate.shard_map as agg

    original = agg._map_topk_shards
    monkeypatch.setattr(
        agg,
        "_map_topk_shards",
        lambda todo, fine_bins, bar, _w, *kept: original(todo, fine_bins, bar, workers, *kept),
    )


def test_parallel_map_equals_serial(tmp_path, case, monkeypatch):
    """Shards mapped by several threads at once give the serial map's tables:
    counts identical, sums within 1e-12 (only the order of float additions may differ)."""
    run = tmp_path / "run"
    manifest = write_run(run, case, store="topk", k=5, shard_rows=90)  # 7 shards
    assert len(manifest["shards"]) == 7
    _force_map_workers(monkeypatch, 1)
    serial = aggregate_runs([run], out=tmp_path / "serial")
    _force_map_workers(monkeypatch, 4)
    parallel = aggregate_runs([run], out=tmp_path / "parallel")
    assert_tables_equal(serial, parallel)
    assert_tables_equal(parallel, core_tables(run, manifest))  # and both the core's


@pytest.mark.parametrize("compiled", [False, True], ids=["numpy", "compiled"])
@pytest.mark.parametrize("broken", [3, 0], ids=["shard-3", "first-shard"])
def test_parallel_map_error_names_its_shard(tmp_path, case, monkeypatch, compiled, broken):
    """A bad kept probability in a shard mapped beside others (the first one
    read while the kernels load, or a later one) names its shard, and the
    threads beside the map (the scores, the reading ahead) are stopped."""
    from pipeline.aggregate import topk_small

    if compiled:
        monkeypatch.setattr(topk_small, "SMALL_RUN_ENTRIES", 1)
    run = tmp_path / "run"
    write_run(run, case, store="topk", k=3, shard_rows=100)
    pos = run / "shards" / f"positions-0000{broken}.parquet"
    t = pq.read_table(pos)
    probs = t.column("kept_probs").combine_chunks()
    values = probs.values.to_numpy().copy()
    values[0] = 1.5  # a kept probability outside [0, 1]
    bad = pa.ListArray.from_arrays(
        probs.offsets, pa.array(values, probs.type.value_type), type=probs.type
    )
    t = t.set_column(t.schema.get_field_index("kept_probs"), "kept_probs", bad)
    pq.write_table(t.cast(t.schema), pos)
    manifest = json.loads((run / "manifest.json").read_text())  # as a faulty extractor would
    manifest["shards"][broken]["files"][f"shards/positions-0000{broken}.parquet"] = path_sha256(pos)
    (run / "manifest.json").write_text(json.dumps(manifest))
    _force_map_workers(monkeypatch, 3)
    with pytest.raises(AggregateError, match=f"positions-0000{broken}.parquet: row 0: kept probab"):
        aggregate([run], progress=False)
    # the scores' scan beside the map was stopped, not left running
    import threading

    left = {t.name for t in threading.enumerate()} & {"aggregate-scores", "read-ahead"}
    assert not left


def test_duckdb_reduce_gets_the_memory_this_process_does_not_hold():
    """--memory-limit bounds the whole process: DuckDB's reduce is given the
    limit less this process's resident memory (at least 16MB)."""
    from pipeline.aggregate.reduce import _resident_bytes, duckdb_memory_limit, limit_bytes

    resident = _resident_bytes()
    assert resident and resident > 10**6
    given = limit_bytes(duckdb_memory_limit("64GB"))
    assert abs(given - (64 * 10**9 - resident)) < 64 * 10**6  # resident may move a little
    assert duckdb_memory_limit("16MB") == "16MB"  # never below DuckDB's minimum
