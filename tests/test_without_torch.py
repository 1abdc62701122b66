"""Analysis must work on a machine without torch: run it in a subprocess in
which importing torch (or transformers) fails."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

BLOCK_TORCH = textwrap.dedent(
    """
    import sys
    class _Block:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("torch", "transformers", "tokenizers"):
                raise ImportError(f"{name} is blocked in this test")
    sys.meta_path.insert(0, _Block())
    """
)


def run_without_torch(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", BLOCK_TORCH + textwrap.dedent(code), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_torch_is_really_blocked():
    proc = run_without_torch("import torch")
    assert proc.returncode != 0 and "blocked" in proc.stderr


def test_metric_core_runs_without_torch():
    proc = run_without_torch(
        """
        import numpy as np
        import pipeline, pipeline.core.metrics, pipeline.core.accumulator, pipeline.store.tablestore
        from pipeline.core.metrics import ece, classwise_ece, full_ece
        p = np.full((4, 4), 0.25, np.float32)
        print(ece(p, np.arange(4)), classwise_ece(p, np.arange(4)), full_ece(p, np.arange(4)))
        assert "torch" not in sys.modules
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["0.0", "0.0", "0.0"]


def test_cli_help_and_every_analysis_command_load_without_torch():
    proc = run_without_torch(
        """
        from click.testing import CliRunner
        from pipeline.cli import main
        runner = CliRunner()
        out = runner.invoke(main, ["--help"])
        assert out.exit_code == 0, out.output
        for name in main.list_commands(None):
            result = runner.invoke(main, [name, "--help"])
            assert result.exit_code == 0, (name, result.output, result.exception)
        assert "torch" not in sys.modules, "an analysis module imported torch"
        print("ok")
        """
    )
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert proc.stdout.strip().endswith("ok")


def test_extraction_without_torch_says_what_to_install(tmp_path):
    (tmp_path / "c.txt").write_text("some text\n")
    proc = run_without_torch(
        """
        from click.testing import CliRunner
        from pipeline.cli import main
        d = sys.argv[1]
        for args in (["extract", "--model", d, "--corpus", d + "/c.txt", "--out", d + "/r"],
                     ["train", "--corpus", d + "/c.txt", "--out", d + "/m"]):
            result = CliRunner().invoke(main, args)
            assert result.exit_code == 1, (args, result.output, result.exception)
            assert "pip install 'fullece[extract]'" in result.output, result.output
            assert "missing: torch, transformers, tokenizers" in result.output, result.output
        print("ok")
        """,
        str(tmp_path),
    )
    assert proc.returncode == 0, proc.stderr + proc.stdout
