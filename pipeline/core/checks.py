"""Input checks shared by the metric API and the accumulator: clear errors
that say where the problem is (row, column, value)."""

from __future__ import annotations

import numpy as np

from pipeline.errors import FulleceError

ROW_SUM_ATOL = 1e-3  # float32 softmax over 128k+ classes sums to 1 within ~1e-5


class InputError(FulleceError):
    """Probabilities, logits or labels that cannot be measured."""


def is_torch_tensor(x) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "detach")


def to_numpy(x) -> np.ndarray:
    if is_torch_tensor(x):
        x = x.detach()
        if str(x.dtype) == "torch.bfloat16":
            x = x.float()
        return x.cpu().numpy()
    return np.asarray(x)


def check_labels(labels, n_rows: int, vocab_size: int, *, row_offset: int = 0) -> np.ndarray:
    labels = to_numpy(labels)
    if labels.ndim != 1:
        raise InputError(f"labels must be 1-D [n], got shape {labels.shape}")
    if labels.shape[0] != n_rows:
        raise InputError(f"{n_rows} rows of probabilities but {labels.shape[0]} labels")
    if labels.size and not np.issubdtype(labels.dtype, np.integer):
        if not np.all(np.mod(labels, 1) == 0):
            raise InputError("labels must be integer class ids")
    labels = labels.astype(np.int64, copy=False)
    bad = np.flatnonzero((labels < 0) | (labels >= vocab_size))
    if bad.size:
        i = int(bad[0])
        raise InputError(
            f"label {labels[i]} at row {row_offset + i} is outside [0, {vocab_size}) "
            f"({bad.size} such label(s))"
        )
    return labels


def check_prob_matrix_shape(probs) -> tuple[int, int]:
    shape = tuple(probs.shape)
    if len(shape) != 2:
        raise InputError(f"probabilities must be 2-D [n, K], got shape {shape}")
    n, k = shape
    if n == 0:
        raise InputError("empty input: no positions")
    if k == 0:
        raise InputError("empty vocabulary: K = 0")
    return n, k


def check_row_sums(
    row_sums: np.ndarray, *, row_offset: int = 0, atol: float = ROW_SUM_ATOL
) -> None:
    """row_sums in float64; NaN/inf anywhere in a row shows up here too."""
    bad_finite = np.flatnonzero(~np.isfinite(row_sums))
    if bad_finite.size:
        raise InputError(
            f"row {row_offset + int(bad_finite[0])} contains NaN or inf "
            f"({bad_finite.size} such row(s))"
        )
    bad = np.flatnonzero(np.abs(row_sums - 1.0) > atol)
    if bad.size:
        i = int(bad[0])
        raise InputError(
            f"row {row_offset + i} sums to {row_sums[i]:.9g}, not 1 within {atol:g} "
            f"({bad.size} such row(s)); pass logits with from_logits / update_logits, "
            "or normalise the rows"
        )


def check_value_range(min_value: float, max_value: float, *, where: str = "probabilities") -> None:
    if min_value < 0.0:
        raise InputError(f"{where} contain a negative value ({min_value:g})")
    if max_value > 1.0:
        raise InputError(f"{where} contain a value above 1 ({max_value:.9g})")
