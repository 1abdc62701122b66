"""Where the JSON schema files are: package data of ``pipeline.schemas`` in an
installed wheel, the top-level ``schemas/`` directory in a checkout."""

from __future__ import annotations

from pathlib import Path

CHECKOUT_SCHEMAS = Path(__file__).resolve().parents[2] / "schemas"


def schemas_dir() -> Path:
    try:
        from importlib.resources import files

        path = Path(str(files("pipeline.schemas")))
        if path.is_dir():
            return path
    except (ImportError, ModuleNotFoundError, TypeError):
        pass
    return CHECKOUT_SCHEMAS


def schema_file(name: str) -> Path:
    path = schemas_dir() / name
    if not path.exists():
        raise FileNotFoundError(f"{path}: schema file missing from the installation")
    return path
