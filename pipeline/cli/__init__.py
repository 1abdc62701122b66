"""The ``fullece`` command. Subcommands live in their own modules and are
imported only when used, so ``fullece metrics`` never pays for (or needs) torch."""

from __future__ import annotations

import importlib

import click

from pipeline import __version__

# name -> "module:attribute"; each module defines one click command.
_COMMANDS = {
    "extract": "pipeline.cli.extract:extract",
    "validate": "pipeline.cli.validate:validate",
    "aggregate": "pipeline.cli.aggregate:aggregate_command",
    "metrics": "pipeline.cli.metrics:metrics",
    "compare": "pipeline.cli.metrics:compare",
    "sql": "pipeline.cli.sql:sql",
    "report": "pipeline.cli.report:report",
    "train": "pipeline.cli.train:train",
    "corpus": "pipeline.cli.corpus:corpus",
    "default": "pipeline.cli.default:default",
    "import": "pipeline.cli.importer:import_command",
    "temperature": "pipeline.cli.temperature:temperature",
}


EXTRACT_EXTRA = ("torch", "transformers", "tokenizers")


def require_extract_extra(command: str) -> None:
    """Fail with an install hint when the `extract` extra is missing."""
    import importlib.util

    missing = []
    for name in EXTRACT_EXTRA:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(name)
    if missing:
        raise click.ClickException(
            f"`fullece {command}` needs {', '.join(EXTRACT_EXTRA)} (missing: {', '.join(missing)}). "
            "Install them with `pip install 'fullece[extract]'` (or `make install`); "
            "the analysis commands (aggregate, metrics, compare, sql, report, validate) "
            "work without them."
        )


class LazyGroup(click.Group):
    def list_commands(self, ctx):
        return sorted(_COMMANDS)

    def get_command(self, ctx, name):
        target = _COMMANDS.get(name)
        if target is None:
            return None
        module_name, attr = target.split(":")
        return getattr(importlib.import_module(module_name), attr)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="fullece")
def main():
    """Token-level calibration of causal language models (ECE, cw-ECE, Full-ECE).

    \b
    Typical use:
      fullece extract --model DIR --corpus test.txt --out runs/ckpt1
      fullece aggregate runs/ckpt1
      fullece metrics runs/ckpt1
      fullece sql runs/ckpt1 "SELECT * FROM top1_bins LIMIT 5"
      fullece report runs/ckpt1 --out report/
    """


if __name__ == "__main__":
    main()
