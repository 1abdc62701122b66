"""JSON out of numbers: NaN/inf become null (JSON has no NaN), numpy scalars
become Python ones. The one sanitiser every JSON writer of the project uses."""

from __future__ import annotations

import json
import math
import sys


def json_safe(x):
    """A copy of `x` that ``json.dumps(..., allow_nan=False)`` accepts."""
    if isinstance(x, dict):
        return {str(k): json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    # numpy values exist only once numpy is imported: the commands' modules
    # import this one without paying numpy's import (~0.06 s)
    np = sys.modules.get("numpy")
    if np is not None and isinstance(x, np.ndarray):
        return json_safe(x.tolist())
    if np is not None and isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def dumps(x, indent: int | None = 2) -> str:
    return json.dumps(json_safe(x), indent=indent, allow_nan=False)
