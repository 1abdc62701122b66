"""Public path of the metric functions (``from pipeline.metrics import ece``);
they live in :mod:`pipeline.core.metrics` (and the noise floors in
:mod:`pipeline.core.floors`)."""

from pipeline.core.floors import *  # noqa: F403
from pipeline.core.floors import __all__ as _floors_all
from pipeline.core.metrics import *  # noqa: F403
from pipeline.core.metrics import __all__ as _metrics_all

__all__ = [*_metrics_all, *_floors_all]
