"""Issue 22, item 6: the per-class state of TokenCalibrationError is held once.

torchmetrics keeps a default of every state to reset to (``Metric._defaults``);
for the two [K, S] per-class states that default is one zero, expanded, and it
stays one element through ``.to()``, ``deepcopy``, pickling, ``reset()`` and
``forward()``, while the states themselves stay dense and correct. The memory
this saves is measured by benchmarks/bench_tmetrics_memory.py (docs/scale.md)."""

from __future__ import annotations

import copy
import pickle

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchmetrics")

from pipeline.core.probability import probs_of_record  # noqa: E402
from pipeline.integrations.torchmetrics import TokenCalibrationError  # noqa: E402
from tests.reference import reference_metrics  # noqa: E402

CLASS_STATES = ("class_hits", "class_p_sum")


def _assert_default_is_one_zero(metric, shape):
    for name in CLASS_STATES:
        default = metric._defaults[name]
        assert tuple(default.shape) == shape
        assert default.untyped_storage().nbytes() == default.element_size()  # one element
        assert not default.any()
        state = getattr(metric, name)
        assert tuple(state.shape) == shape and state.is_contiguous()
        assert state.untyped_storage().nbytes() == state.numel() * state.element_size()


def _data(seed, n=40, k=30):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * 3, torch.randint(0, k, (n,), generator=g)


def _cw_reference(*batches, m=10):
    logits = torch.cat([x for x, _ in batches])
    labels = torch.cat([y for _, y in batches])
    return reference_metrics(probs_of_record(logits).numpy(), labels.numpy(), m)["cw_ece"]


def test_class_state_defaults_are_one_zero_throughout():
    k, n_bins = 30, (5, 10)
    shape = (k, 15)
    metric = TokenCalibrationError(k, n_bins=n_bins, classwise=True)
    _assert_default_is_one_zero(metric, shape)
    a, b = _data(0), _data(1)

    metric.update(*a)
    assert int(metric.class_hits.sum()) == 40 * len(n_bins)  # the state itself is dense
    metric = metric.to(torch.device("cpu"))
    _assert_default_is_one_zero(metric, shape)
    for clone in (copy.deepcopy(metric), pickle.loads(pickle.dumps(metric))):
        _assert_default_is_one_zero(clone, shape)
        assert float(clone.compute()["cw_ece_m10"]) == pytest.approx(_cw_reference(a), abs=1e-12)

    metric.reset()  # back to dense zeros, from the one-zero default
    _assert_default_is_one_zero(metric, shape)
    assert not metric.class_hits.any() and not metric.class_p_sum.any()
    metric.update(*b)
    assert float(metric.compute()["cw_ece_m10"]) == pytest.approx(_cw_reference(b), abs=1e-12)

    # forward(): the batch's value, and the state of both batches after it
    metric.reset()
    metric.update(*a)
    batch_value = metric(*b)["cw_ece_m10"]
    assert float(batch_value) == pytest.approx(_cw_reference(b), abs=1e-12)
    assert float(metric.compute()["cw_ece_m10"]) == pytest.approx(_cw_reference(a, b), abs=1e-12)
    _assert_default_is_one_zero(metric, shape)


def test_single_value_cw_form_keeps_one_copy():
    metric = TokenCalibrationError(30, metric="cw_ece", n_bins=10)
    _assert_default_is_one_zero(metric, (30, 10))
    metric.update(*_data(2))
    assert float(metric.compute()) == pytest.approx(_cw_reference(_data(2)), abs=1e-12)
