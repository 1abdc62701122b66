"""The C kernels (pipeline.core._native): built by the install, chosen by
FULLECE_KERNELS, and refusing arrays they cannot read instead of reading out of
bounds. That they give numba's bits is tested where each kernel is (the map:
test_topk_pass, test_topk_small; the floors: test_floors; the group sums:
test_startup, test_topk_small), by running both on the same inputs."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from pipeline.errors import FulleceError


def test_the_install_built_the_c_kernels():
    """`make install` compiles them (a compiler is on every machine CI runs
    on); without them every aggregate would pay numba's start-up."""
    from pipeline.core import native

    assert native._load() is not None
    assert native.native_kernels()


def test_layout_compiled_in_is_topk_formats():
    from pipeline.aggregate import _topk_native, topk_format

    for name, value in _topk_native._native.LAYOUT.items():
        want = getattr(topk_format, name, None)
        want = int(topk_format.KernelCode[name]) if want is None else int(want)
        assert value == want, name


def test_choice_by_environment(monkeypatch):
    from pipeline.core import _floors_kernel, _native_kernels, native

    monkeypatch.setenv("FULLECE_KERNELS", "numba")
    assert not native.native_kernels() and native.floors_kernel() is _floors_kernel
    monkeypatch.setenv("FULLECE_KERNELS", "native")
    assert native.native_kernels() and native.floors_kernel() is _native_kernels
    monkeypatch.setenv("FULLECE_KERNELS", "fast")
    with pytest.raises(FulleceError, match="FULLECE_KERNELS='fast'"):
        native.native_kernels()


def test_a_process_with_the_c_kernels_never_imports_numba(tmp_path):
    """The whole point: the kernels' module loads without numba."""
    code = (
        "import sys\n"
        "from pipeline.aggregate import topk_pass\n"
        "from pipeline.core.native import floors_kernel, group_kernel\n"
        "print(topk_pass._kernels().__name__, floors_kernel().__name__,"
        " group_kernel().__name__, 'numba' in sys.modules)\n"
    )
    env = {**os.environ, "FULLECE_KERNELS": "native"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [
        "pipeline.aggregate._topk_native",
        "pipeline.core._native_kernels",
        "pipeline.core._native_kernels",
        "False",
    ]


def test_wrong_dtypes_and_sizes_are_refused():
    from pipeline.core import _native

    offsets = np.array([0, 2], np.int64)
    probs = np.array([0.5, 0.25], np.float32)
    grids, source = np.array([10, 5], np.int64), np.array([0, 0], np.int64)
    out = np.zeros((2, 10))
    _native.bin_mass_sq_rows(offsets, probs, np.zeros(1), 10, 0.1, grids, source, out)
    assert out[1, 2] == 0.5**2 and out[1, 1] == 0.25**2  # M = 5: 0.5 in bin 3, 0.25 in bin 2
    with pytest.raises(TypeError, match="probs: expected float32"):
        _native.bin_mass_sq_rows(offsets, probs.astype(np.float64), np.zeros(1), 10, 0.1,
                                 grids, source, out)  # fmt: skip
    with pytest.raises(TypeError, match="out: expected a C-contiguous writable"):
        _native.bin_mass_sq_rows(offsets, probs, np.zeros(1), 10, 0.1, grids, source, out.T)
    with pytest.raises(ValueError, match="wrong sizes"):  # offsets past the entries
        _native.bin_mass_sq_rows(np.array([0, 3], np.int64), probs, np.zeros(1), 10, 0.1,
                                 grids, source, out)  # fmt: skip
    with pytest.raises(ValueError, match="above 1"):
        _native.bin_mass_sq_rows(offsets, np.array([0.5, 1.5], np.float32), np.zeros(1), 10,
                                 0.1, grids, source, out)  # fmt: skip
    keys = np.zeros(4, np.int64)
    with pytest.raises(ValueError, match="wrong sizes"):  # more entries than the buffer holds
        _native.partition(keys, np.zeros(4, np.float32), 5, np.zeros(2, np.int64),
                          np.zeros(4, np.int64), np.zeros(4, np.float32), np.zeros(3, np.int64))  # fmt: skip
    with pytest.raises(TypeError, match="takes 7 arguments"):
        _native.partition(keys)


def test_a_class_table_too_small_for_its_regions_is_refused():
    """batch() inserting straight into the class table checks the table holds
    every region it addresses (and takes the buffer path without one)."""
    from pipeline.aggregate import _topk_native, topk_pass
    from pipeline.aggregate.topk_format import BatchRows, ClassTable

    state = topk_pass.TopkShardPass(vocab_size=2, fine_bins=10)
    rows = BatchRows(np.array([0, 1], np.int32), np.array([0.5, 0.5], np.float32),
                     np.array([0, 2], np.int64), np.zeros(1, np.int32), np.zeros(1, np.int32),
                     np.array([0.5], np.float32), np.zeros(1, np.int64), np.zeros(1, np.int32),
                     np.zeros(1), np.zeros(1, np.float32))  # fmt: skip
    args = (rows, state._rules(), state._sums(), state._entry_buffer(2), state._documents())
    low = np.zeros((1, 2, 2), np.int64)  # bin 1 alone in the low rows: bin 5 goes to the table
    hits = np.zeros((1, 2), np.int64)
    small = ClassTable(np.zeros((4, 4), np.int64), np.zeros(1, np.int64), 3)  # 8 slots needed
    with pytest.raises(ValueError, match="wrong sizes"):
        _topk_native.batch(0, *args, small, low=low, low_hits=hits)
    fits = ClassTable(np.zeros((8, 4), np.int64), np.zeros(1, np.int64), 3)
    fits.slots[:, 0] = np.iinfo(np.int64).min
    assert _topk_native.batch(0, *args, fits, low=low, low_hits=hits) == (0, -1)
    assert fits.counts[0] == 2 and fits.slots[:, 1].sum() == 2  # (0, bin 5), (1, bin 5)
    assert not low.any() and not hits.any()


def test_low_rows_of_the_wrong_size_or_layout_are_refused():
    """batch() sums the low bins in `low`, (low_bins, K, 2) int64, and their
    label hits in `low_hits`, (low_bins, K), both C-contiguous: rows or hits
    too small for K classes, hits of other bins than the rows', or a strided
    view (whose sums a copy would lose), are refused before anything is summed."""
    from pipeline.aggregate import _topk_native, topk_pass
    from pipeline.aggregate.topk_format import BatchRows

    state = topk_pass.TopkShardPass(vocab_size=2, fine_bins=10)
    assert state._low.shape == (10, 2, 2)  # every bin of F = 10 in the low rows
    assert state._low_hits.shape == (10, 2)
    rows = BatchRows(np.array([0, 1], np.int32), np.array([0.5, 0.5], np.float32),
                     np.array([0, 2], np.int64), np.zeros(1, np.int32), np.zeros(1, np.int32),
                     np.array([0.5], np.float32), np.zeros(1, np.int64), np.zeros(1, np.int32),
                     np.zeros(1), np.zeros(1, np.float32))  # fmt: skip
    args = (rows, state._rules(), state._sums(), state._entry_buffer(2), state._documents())
    hits = state._low_hits
    with pytest.raises(ValueError, match="wrong sizes"):  # 1 class of 2
        _topk_native.batch(
            0, *args, low=np.zeros((10, 1, 2), np.int64), low_hits=np.zeros((10, 1), np.int64)
        )
    with pytest.raises(ValueError, match="wrong sizes"):  # low_bins above F
        _topk_native.batch(
            0, *args, low=np.zeros((11, 2, 2), np.int64), low_hits=np.zeros((11, 2), np.int64)
        )
    with pytest.raises(ValueError, match="wrong sizes"):  # hits of 9 bins for 10 bins' rows
        _topk_native.batch(0, *args, low=state._low, low_hits=np.zeros((9, 2), np.int64))
    with pytest.raises(TypeError, match="low bins: expected a C-contiguous writable"):
        _topk_native.batch(0, *args, low=state._low[:, :1], low_hits=hits)
    with pytest.raises(TypeError, match="low hits: expected a C-contiguous writable"):
        _topk_native.batch(0, *args, low=state._low, low_hits=np.zeros((10, 4), np.int64)[:, ::2])
    assert not state._low.any() and not hits.any() and not state.label_count.any()
    assert _topk_native.batch(0, *args, low=state._low, low_hits=hits) == (0, -1)
    # both entries in bin 5 of their class's low rows, the label's a hit
    assert state._low[4, :, 0].tolist() == [1, 1] and hits[4].tolist() == [1, 0]
    assert state._low.view(np.float64)[4, :, 1].tolist() == [0.5, 0.5]
    assert not hits[[0, 1, 2, 3, 5, 6, 7, 8, 9]].any()


@pytest.mark.parametrize("abi", [None, 1])
def test_a_build_of_other_kernel_arguments_is_refused(monkeypatch, abi):
    """A C module built from an older source (kernels taking other arguments,
    the same table layout) is refused with a clear error on import, not run
    with arguments it would misread (a development tree not rebuilt)."""
    import importlib.util
    import types

    import pipeline.aggregate._topk_native as wrappers
    import pipeline.core
    from pipeline.core import _native

    assert _native.ABI == wrappers.ABI  # this build
    stale = types.ModuleType("pipeline.core._native")
    stale.__dict__.update({k: v for k, v in vars(_native).items() if k != "ABI"})
    if abi is not None:
        stale.ABI = abi
    monkeypatch.setattr(pipeline.core, "_native", stale)
    spec = importlib.util.spec_from_file_location("stale_wrappers", wrappers.__file__)
    with pytest.raises(ImportError, match="another version of its source.*reinstall"):
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


def test_low_bins_fill_8_mb_at_most_32_and_numba_keeps_bin_1_alone(monkeypatch):
    """The low rows' size as docs/design.md states it: as many bins as fit
    8 MB of 16-byte rows, at most 32 and at most F; numba's kernels sum bin 1
    alone there (their batch puts the bins above in the class table)."""
    from pipeline.aggregate import topk_pass

    assert [topk_pass.low_bins(k, 1000) for k in (2, 4096, 32_000, 128_000, 10**7)] == [
        32, 32, 16, 4, 1,
    ]  # fmt: skip
    assert topk_pass.low_bins(2, 10) == 10
    for kernels, bins in (("native", 16), ("numba", 1)):
        monkeypatch.setenv("FULLECE_KERNELS", kernels)
        state = topk_pass.TopkShardPass(vocab_size=32_000, fine_bins=1000)
        assert state._low.shape == (bins, 32_000, 2) and state._low.flags.c_contiguous
        assert state._low_hits.shape == (bins, 32_000) and state._low_hits.flags.c_contiguous
