"""The names under which the in-loop metrics are logged (docs/scale.md, "Metric names").

One name per metric and M, ``{metric}_m{M}`` (``ece_m10``, ``full_ece_m10``,
``cw_ece_m10``), made of characters every common logger accepts as they are:
letters, digits, ``_``, ``/``, ``.`` and ``-`` (MLflow's ``log_metrics``
refuses ``@``; Lightning's and the transformers Trainer's MLflow loggers
rename such keys, each in its own way). Prefixes the loggers add (``eval_``,
``val/``) keep to the same characters.
"""

from __future__ import annotations

import re

__all__ = ["LOGGER_KEY", "METRICS", "metric_key"]

# the metrics TokenCalibrationError computes, by name
METRICS = ("ece", "full_ece", "cw_ece")
# a key every logger takes unchanged
LOGGER_KEY = re.compile(r"[A-Za-z0-9_/.\-]+")


def metric_key(metric: str, n_bins: int) -> str:
    """The logged name of `metric` at M = `n_bins`: ``metric_key("full_ece", 10)`` is
    ``"full_ece_m10"``."""
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {', '.join(METRICS)}, got {metric!r}")
    return f"{metric}_m{int(n_bins)}"
