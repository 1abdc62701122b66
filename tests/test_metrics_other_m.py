"""An M that does not divide the fine grid is computed from the shards
(re-aggregated at F = M); that must leave the run's own kept sums alone: the
Full-ECE floors at the other M's stay what they were, in that call and after."""

from __future__ import annotations

import json

from click.testing import CliRunner

from pipeline.cli.metrics import metrics
from tests.helpers.analysis_runs import dense_case, write_run


def _floors(run, bins: str) -> dict:
    res = CliRunner().invoke(metrics, [str(run), "--json", "--quiet", "--bins", bins])
    assert res.exit_code == 0, res.output
    return {b["M"]: b["full_ece_floor"] for b in json.loads(res.stdout)["bins"]}


def test_an_m_from_the_shards_keeps_the_floors_of_the_others(tmp_path):
    case = dense_case(300, 30, seed=5, docs=10)
    write_run(tmp_path / "run", case, k=4, tau=1e-3, shard_rows=200, label="a")
    before = _floors(tmp_path / "run", "10,20")
    assert all(v is not None and v > 0 for v in before.values()), before
    with_7 = _floors(tmp_path / "run", "7,10,20")
    assert with_7[10] == before[10] and with_7[20] == before[20]
    assert _floors(tmp_path / "run", "10,20") == before
