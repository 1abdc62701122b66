"""Public path of :class:`CalibrationAccumulator`; it lives in :mod:`pipeline.core.accumulator`."""

from pipeline.core.accumulator import CalibrationAccumulator

__all__ = ["CalibrationAccumulator"]
