"""Errors of the extraction stage (no torch import here)."""

from __future__ import annotations


class ExtractError(ValueError):
    """Bad input to `fullece extract`: the message names the file, document or offset."""


class NonFiniteLogitsError(ExtractError):
    """The model produced a NaN or infinite logit."""
