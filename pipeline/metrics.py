"""Public path of the metric functions (``from pipeline.metrics import ece``);
they live in :mod:`pipeline.core.metrics`."""

from pipeline.core.metrics import *  # noqa: F403
from pipeline.core.metrics import __all__  # noqa: F401
