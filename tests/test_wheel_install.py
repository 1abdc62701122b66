"""A wheel install, without torch and without the checkout, validates and
measures a run: the JSON schemas ship as package data and the analysis half
needs nothing from the extract extra.

Builds the wheel from a copy of the tracked files (`pip wheel --no-deps
--no-build-isolation`), installs it into a fresh `python -m venv` with its
dependencies from pip's configured indexes, and runs the installed `fullece`
with no PYTHONPATH, from a directory outside the checkout.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.analysis_runs import dense_case, dense_reference, write_run

ROOT = Path(__file__).resolve().parent.parent
UNAVAILABLE = (
    "No matching distribution found",
    "Could not find a version",
    "Failed to establish a new connection",
    "Network is unreachable",
    "Temporary failure in name resolution",
)

pytestmark = pytest.mark.slow


def _run(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


def _copy_tracked_files(dst: Path) -> None:
    listed = _run(["git", "ls-files", "-z"], cwd=ROOT)
    if listed.returncode != 0:
        pytest.skip(f"not a git checkout, cannot list the tracked files: {listed.stderr.strip()}")
    for rel in filter(None, listed.stdout.split("\0")):
        src = ROOT / rel
        if src.is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    base = tmp_path_factory.mktemp("wheel")
    src = base / "src"
    _copy_tracked_files(src)
    built = _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(base / "dist"),
            str(src),
        ]
    )
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = (base / "dist").glob("fullece-*.whl")
    venv = base / "venv"
    made = _run([sys.executable, "-m", "venv", str(venv)])
    if made.returncode != 0:
        pytest.skip(f"python -m venv is unavailable here: {made.stderr.strip()[-300:]}")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    pip = _run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", str(wheel)], env=env)
    if pip.returncode != 0:
        out = pip.stdout + pip.stderr
        if any(s in out for s in UNAVAILABLE):
            pytest.skip(
                f"the wheel's dependencies cannot be installed here (no index): {out[-400:]}"
            )
        raise AssertionError(out)
    return venv, env


def test_wheel_validates_and_measures_a_run_without_torch(installed, tmp_path):
    venv, env = installed
    python = venv / "bin" / "python"
    probe = _run(
        [
            str(python),
            "-c",
            "import importlib.util as u, pipeline; "
            "from pipeline.core.native import native_kernels; "
            "print(u.find_spec('torch') is None, u.find_spec('transformers') is None, "
            "native_kernels(), pipeline.__file__)",
        ],
        env=env,
        cwd=tmp_path,
    )
    assert probe.returncode == 0, probe.stderr
    no_torch, no_transformers, native, location = probe.stdout.split()
    assert no_torch == "True" and no_transformers == "True"
    assert native == "True", "the wheel lacks the C kernels (pipeline.core._native)"
    assert Path(location).is_relative_to(venv), f"imported from the checkout: {location}"

    case = dense_case(500, 30, seed=21, docs=20)
    write_run(tmp_path / "run", case, k=4, tau=1e-3, shard_rows=150)
    shutil.copytree(tmp_path / "run", tmp_path / "run-inrepo")
    fullece = str(venv / "bin" / "fullece")

    valid = _run([fullece, "validate", str(tmp_path / "run")], env=env, cwd=tmp_path)
    assert valid.returncode == 0, valid.stdout + valid.stderr
    measured = _run(
        [fullece, "metrics", "--json", "--quiet", str(tmp_path / "run")], env=env, cwd=tmp_path
    )
    assert measured.returncode == 0, measured.stderr
    wheel_result = json.loads(measured.stdout)

    from click.testing import CliRunner

    from pipeline.cli.metrics import metrics

    res = CliRunner().invoke(metrics, ["--json", "--quiet", str(tmp_path / "run-inrepo")])
    assert res.exit_code == 0, res.output
    in_repo = json.loads(res.stdout)
    # the same numbers, to the last bit; only the paths of the two copies differ
    assert wheel_result.pop("run")["label"] == in_repo.pop("run")["label"]
    assert wheel_result == in_repo
    for row in wheel_result["bins"]:
        ref = dense_reference(case.probs, case.labels, row["M"])
        for key in ("ece", "cw_ece", "full_ece"):
            assert row[key] == pytest.approx(ref[key], abs=1e-12)

    broken = tmp_path / "run" / "shards" / "positions-00001.parquet"
    data = bytearray(broken.read_bytes())
    data[len(data) // 2] ^= 0x40
    broken.write_bytes(bytes(data))
    invalid = _run([fullece, "validate", str(tmp_path / "run")], env=env, cwd=tmp_path)
    assert invalid.returncode == 1 and "positions-00001.parquet" in invalid.stdout + invalid.stderr


def _command_paths(group, prefix=()):
    """Every command path of the checkout's CLI (groups included), e.g. ('import', 'vllm')."""
    import click

    ctx = click.Context(group)
    for name in group.list_commands(ctx):
        cmd = group.get_command(ctx, name)
        yield (*prefix, name)
        if isinstance(cmd, click.Group):
            yield from _command_paths(cmd, (*prefix, name))


def test_wheel_runs_every_command_on_an_imported_run(installed, tmp_path):
    """`pip install .` ships every subpackage: each subcommand's --help, then
    import, aggregate, metrics, sql and report run from the wheel (once,
    `pipeline.ingest` was missing and `fullece import` failed)."""
    from pipeline.cli import main
    from tests.test_import import _random_docs, write_vllm

    venv, env = installed
    fullece = str(venv / "bin" / "fullece")
    paths = list(_command_paths(main))
    assert ("import", "vllm") in paths and ("metrics",) in paths
    for path in [()] + paths:
        shown = _run([fullece, *path, "--help"], env=env, cwd=tmp_path)
        assert shown.returncode == 0 and "Usage:" in shown.stdout, (path, shown.stderr)

    dump = write_vllm(tmp_path / "dump.jsonl", _random_docs(seed=3, n_docs=8, vocab=50), 5)
    run = tmp_path / "run"
    steps = [
        ["import", "vllm", str(dump), "--out", str(run), "--vocab-size", "50", "--quiet"],
        ["aggregate", str(run), "--quiet"],
        ["metrics", "--json", "--quiet", str(run)],
        ["sql", str(run), "SELECT count(*) AS n FROM positions"],
        ["report", str(run), "--out", str(tmp_path / "report"), "--quiet"],
    ]
    outputs = {}
    for step in steps:
        done = _run([fullece, *step], env=env, cwd=tmp_path)
        assert done.returncode == 0, (step, done.stdout + done.stderr)
        outputs[step[0]] = done.stdout
    positions = sum(len(ids) - 1 for ids, _ in _random_docs(seed=3, n_docs=8, vocab=50))
    assert json.loads(outputs["metrics"])["positions"] == positions
    assert str(positions) in outputs["sql"].split()
    assert (tmp_path / "report" / "report.html").is_file()


@pytest.fixture(scope="module")
def installed_with_extract(installed, tmp_path_factory):
    """The same wheel with the extract extra, torch pinned to the local CPU build
    (an unpinned torch would pull CUDA packages)."""
    venv, env = installed
    (wheel,) = (venv.parent / "dist").glob("fullece-*.whl")
    venv2 = tmp_path_factory.mktemp("wheel-extract") / "venv"
    made = _run([sys.executable, "-m", "venv", str(venv2)])
    assert made.returncode == 0, made.stderr
    pip = _run(
        [
            str(venv2 / "bin" / "python"),
            "-m",
            "pip",
            "install",
            "-q",
            f"{wheel}[extract]",
            "torch==2.13.0",
        ],
        env=env,
    )
    if pip.returncode != 0:
        out = pip.stdout + pip.stderr
        if any(s in out for s in UNAVAILABLE):
            pytest.skip(f"the extract extra cannot be installed here (no index): {out[-400:]}")
        raise AssertionError(out)
    return venv2, env


def test_wheel_extract_extra_extracts_a_tiny_model(installed_with_extract, tmp_path):
    from tests.helpers.extract_models import build_gpt2, synthetic_texts

    venv, env = installed_with_extract
    fullece = str(venv / "bin" / "fullece")
    model = build_gpt2(tmp_path / "gpt2")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(synthetic_texts(12, seed=5)) + "\n")
    run = tmp_path / "run"
    for step in (
        [
            "extract",
            "--model",
            str(model),
            "--corpus",
            str(corpus),
            "--k",
            "8",
            "--tau",
            "0.01",
            "--device",
            "cpu",
            "--out",
            str(run),
        ],
        ["validate", str(run)],
        ["metrics", "--json", "--quiet", str(run)],
    ):
        done = _run([fullece, *step], env=env, cwd=tmp_path)
        assert done.returncode == 0, (step, done.stdout + done.stderr)
    assert json.loads(done.stdout)["positions"] > 0
