"""The console script (`pipeline.cli.run`) ends a finished reading command
without the interpreter's teardown, and every other command as Python does:
either way its output is complete and its exit status the command's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers.analysis_runs import dense_case, write_run
from tests.helpers.processes import cli_env

# an atexit handler runs in Python's own exit, never after os._exit
PROGRAM = """
import atexit, sys
atexit.register(open, sys.argv[1], "w")
from pipeline.cli import run
sys.argv = ["fullece", *sys.argv[2:]]
run()
"""


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("quick") / "run"
    write_run(path, dense_case(200, 20, seed=5, docs=4), k=4)
    return path


def _fullece(tmp_path, *args):
    mark = tmp_path / "teardown-ran"
    mark.unlink(missing_ok=True)
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM, str(mark), *map(str, args)],
        capture_output=True,
        text=True,
        env=cli_env(),
        cwd=tmp_path,
        timeout=300,
    )
    return done, mark.exists()


def test_finished_reading_commands_skip_the_teardown(small_run, tmp_path):
    done, teardown = _fullece(tmp_path, "aggregate", small_run, "--quiet")
    assert done.returncode == 0 and not teardown, done.stderr
    done, teardown = _fullece(tmp_path, "metrics", small_run, "--json", "--quiet")
    assert done.returncode == 0 and not teardown, done.stderr
    assert json.loads(done.stdout)["positions"] == 200  # all of it, flushed
    out = tmp_path / "report"
    done, teardown = _fullece(tmp_path, "report", small_run, "--out", out, "--quiet")
    assert done.returncode == 0 and not teardown, done.stderr
    assert (out / "report.html").is_file() and not list(out.glob(".*.tmp"))
    assert not list((small_run / "tables").glob(".fullece-tmp/*"))  # scratch removed


def test_errors_keep_their_status_and_other_commands_their_teardown(small_run, tmp_path):
    done, teardown = _fullece(tmp_path, "metrics", tmp_path / "missing", "--json")
    assert done.returncode == 1 and "no such run directory" in done.stderr and not teardown
    done, teardown = _fullece(tmp_path, "metrics", small_run, "--no-such-option")
    assert done.returncode == 2 and "No such option" in done.stderr
    done, teardown = _fullece(tmp_path, "validate", small_run)
    assert done.returncode == 0 and teardown, done.stderr
    done, teardown = _fullece(tmp_path, "sql", small_run, "SELECT 41 + 1 AS x")
    assert done.returncode == 0 and "42" in done.stdout and teardown, done.stderr
    done, teardown = _fullece(tmp_path, "--help")
    assert done.returncode == 0 and "Usage:" in done.stdout and teardown
