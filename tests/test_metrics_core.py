"""The metric core against the independent dense reference (tests/reference.py)."""

from __future__ import annotations

import statistics

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.core.accumulator import CalibrationAccumulator
from pipeline.core.binning import (
    bin1_threshold,
    coarsen_bins,
    fine_bin_index,
    m_exact_from_tail_max,
)
from pipeline.core.checks import InputError
from pipeline.core.metrics import (
    calibration_errors,
    classwise_ece,
    compute_metrics,
    ece,
    full_ece,
    metrics_at,
    reliability,
    rsd,
    token_frequency,
)
from pipeline.defaults import PAPER_BINS
from tests.reference import exact_bins, reference_metrics

TOL = 1e-12
f32 = np.float32


def assert_matches_reference(probs, labels, M):
    ref = reference_metrics(probs, labels, M)
    got = calibration_errors(probs, labels, n_bins=M)
    for key in ("ece", "cw_ece", "full_ece"):
        assert got[key] == pytest.approx(ref[key], abs=TOL), key
    assert ece(probs, labels, M) == got["ece"]
    assert classwise_ece(probs, labels, M) == got["cw_ece"]
    assert full_ece(probs, labels, M) == got["full_ece"]


def softmax32(x):
    x = np.asarray(x, np.float64)
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return (e / e.sum(axis=1, keepdims=True)).astype(np.float32)


# ---- binning ------------------------------------------------------------------


def test_bin_edges_belong_to_the_lower_bin():
    values = np.array([0.0, 1.0, 0.5, 0.25, f32(0.3), f32(0.7), 0.1, 0.2], np.float32)
    for M in (1, 2, 3, 4, 5, 10, 20, 50, 100, 200, 500, 1000, 7):
        assert np.array_equal(fine_bin_index(values, M), exact_bins(values, M)), M
    assert fine_bin_index(np.float32(0.5), 2) == 1  # on an edge -> lower bin
    assert fine_bin_index(np.float32(0.0), 10) == 1  # p = 0 -> bin 1
    assert fine_bin_index(np.float32(1.0), 10) == 10
    assert fine_bin_index(f32(0.3), 10) == 4  # float32(0.3) is just above 0.3


def test_every_float32_near_edges_bins_exactly():
    # all float32 values within a few ulps of every edge m/M for F = 1000
    edges = np.arange(0, 1001, dtype=np.float64) / 1000
    vals = []
    for e in edges.astype(np.float32):
        v = e
        for _ in range(3):
            v = np.nextafter(v, f32(0))
        for _ in range(7):
            vals.append(v)
            v = np.nextafter(v, f32(2))
    vals = np.clip(np.array(vals, np.float32), 0, 1)
    for M in (*PAPER_BINS, 1000, 3, 7, 999):
        assert np.array_equal(fine_bin_index(vals, M), exact_bins(vals, M)), M


@pytest.mark.parametrize("M", PAPER_BINS)
def test_coarse_bins_from_fine_bins_are_exact(M):
    rng = np.random.default_rng(M)
    vals = np.r_[rng.random(5000).astype(np.float32), np.arange(1001, dtype=np.float32) / 1000]
    assert np.array_equal(coarsen_bins(fine_bin_index(vals, 1000), 1000, M), exact_bins(vals, M))


def test_coarsen_refuses_m_not_dividing_f():
    with pytest.raises(ValueError, match="does not divide"):
        coarsen_bins([1, 2], 1000, 3)


@pytest.mark.parametrize("M", [1, 2, 3, 7, 10, 1000, 1024, 999_983])
def test_bin1_threshold_is_the_exact_split(M):
    t = bin1_threshold(M)
    assert fine_bin_index(t, M) == 1
    assert fine_bin_index(np.nextafter(t, f32(2)), M) == 2


def test_m_exact():
    assert m_exact_from_tail_max(0.0) is None
    assert m_exact_from_tail_max(0.5) == 2
    assert m_exact_from_tail_max(f32(0.001)) == 999  # float32(0.001) > 1/1000
    assert m_exact_from_tail_max(np.nextafter(f32(0.001), f32(0))) == 1000
    for t in np.random.default_rng(0).random(200).astype(np.float32) * 0.01 + 1e-6:
        m = m_exact_from_tail_max(t)
        assert fine_bin_index(t, m) == 1 and fine_bin_index(t, m + 1) == 2


# ---- metrics against the reference --------------------------------------------


def test_paper_figure1_toy():
    probs = np.array(
        [
            [0.6, 0.2, 0.1, 0.1],
            [0.1, 0.7, 0.1, 0.1],
            [0.3, 0.3, 0.3, 0.1],
            [0.05, 0.05, 0.1, 0.8],
            [0.25, 0.25, 0.25, 0.25],
        ],
        np.float32,
    )
    labels = np.array([0, 2, 1, 3, 3])
    for M in (1, 2, 3, 5, 10, 20):
        assert_matches_reference(probs, labels, M)


def test_values_on_bin_edges():
    probs = np.array(
        [
            [0.5, 0.25, 0.25, 0.0],
            [1.0, 0.0, 0.0, 0.0],
            [f32(0.3), f32(0.7), 0.0, 0.0],
            [0.25, 0.25, 0.25, 0.25],
            [0.0, 0.5, 0.5, 0.0],
            [f32(0.7), 0.0, f32(0.3), 0.0],
        ],
        np.float32,
    )
    labels = np.array([1, 0, 1, 3, 2, 2])
    for M in (*PAPER_BINS, 1, 2, 3, 4, 1000):
        assert_matches_reference(probs, labels, M)


def test_one_hot_and_uniform_rows():
    K = 6
    one_hot = np.eye(K, dtype=np.float32)
    uniform = np.full((4, K), 1 / K, np.float32)
    probs = np.r_[one_hot, uniform]
    labels = np.array([0, 1, 2, 0, 0, 5, 1, 2, 3, 0])
    for M in (2, 5, 6, 10, 100):
        assert_matches_reference(probs, labels, M)
    # perfectly calibrated one-hot predictions
    assert calibration_errors(one_hot, np.arange(K), 10) == {
        "M": 10,
        "ece": 0.0,
        "cw_ece": 0.0,
        "full_ece": 0.0,
        "exact": True,
        **dict.fromkeys(("ece_l2", "ece_l2_debiased", "full_ece_l2", "full_ece_l2_debiased"), 0.0),
        "ece_over": 0.0,
        "ece_under": 0.0,
    }


def test_never_seen_classes_count_in_cw_ece():
    rng = np.random.default_rng(1)
    probs = softmax32(rng.normal(size=(40, 12)))
    labels = rng.integers(0, 2, size=40)  # classes 2..11 never occur
    for M in (5, 10, 20):
        assert_matches_reference(probs, labels, M)


def test_k1_and_k2():
    assert_matches_reference(np.ones((3, 1), np.float32), np.zeros(3, int), 10)
    rng = np.random.default_rng(2)
    p = rng.random(50).astype(np.float32)
    probs = np.c_[p, (1 - p.astype(np.float64)).astype(np.float32)]
    probs[:5, 0] = [0, 1, 0.5, f32(0.3), f32(0.7)]
    probs[:5, 1] = [1, 0, 0.5, f32(0.7), f32(0.3)]
    labels = rng.integers(0, 2, 50)
    for M in (1, 2, 5, 10, 50):
        assert_matches_reference(probs, labels, M)


@st.composite
def prob_matrices(draw):
    n = draw(st.integers(1, 25))
    k = draw(st.integers(1, 9))
    # integer weights over a small denominator produce many exact bin edges
    weights = draw(
        st.lists(st.lists(st.integers(0, 20), min_size=k, max_size=k), min_size=n, max_size=n)
    )
    w = np.array(weights, dtype=np.float64)
    w[w.sum(axis=1) == 0, 0] = 1.0
    probs = (w / w.sum(axis=1, keepdims=True)).astype(np.float32)
    labels = np.array(draw(st.lists(st.integers(0, k - 1), min_size=n, max_size=n)))
    M = draw(st.sampled_from([1, 2, 3, 4, 5, 7, 10, 20, 50, 100]))
    return probs, labels, M


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prob_matrices())
def test_hypothesis_matches_reference(case):
    probs, labels, M = case
    assert_matches_reference(probs, labels, M)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 60), st.integers(1, 30))
def test_hypothesis_softmax_rows(seed, n, k):
    rng = np.random.default_rng(seed)
    probs = softmax32(rng.normal(scale=3, size=(n, k)))
    labels = rng.integers(0, k, n)
    assert_matches_reference(probs, labels, 10)


def test_fine_tables_give_every_paper_m_exactly():
    rng = np.random.default_rng(3)
    probs = softmax32(rng.normal(scale=4, size=(300, 40)))
    labels = rng.integers(0, 40, 300)
    acc = CalibrationAccumulator(vocab_size=40)  # F = 1000
    acc.update(probs, labels)
    result = compute_metrics(acc.compute())
    assert [row["M"] for row in result["bins"]] == list(PAPER_BINS)
    for row in result["bins"]:
        ref = reference_metrics(probs, labels, row["M"])
        for key in ("ece", "cw_ece", "full_ece"):
            assert row[key] == pytest.approx(ref[key], abs=TOL)
        assert row["exact"]
    # RSD from the reference values, by the textbook formula (statistics module,
    # not the numpy expression the code uses)
    for key in ("ece", "cw_ece", "full_ece"):
        values = [reference_metrics(probs, labels, m)[key] for m in PAPER_BINS]
        want = statistics.stdev(values) / statistics.mean(values) * 100
        assert result["rsd"][key] == pytest.approx(want, rel=1e-9)


def test_torch_tensors_match_numpy():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(4)
    probs = softmax32(rng.normal(scale=3, size=(80, 17)))
    labels = rng.integers(0, 17, 80)
    for fn in (ece, classwise_ece, full_ece):
        assert fn(torch.from_numpy(probs), torch.from_numpy(labels), 10) == pytest.approx(
            fn(probs, labels, 10), abs=TOL
        )
    logits = torch.from_numpy(rng.normal(size=(30, 17)).astype(np.float32))
    lab = torch.from_numpy(rng.integers(0, 17, 30))
    a = CalibrationAccumulator(17)
    a.update_logits(logits, lab)
    b = CalibrationAccumulator(17)
    b.update_logits(logits.numpy(), lab.numpy())
    ta, tb = a.compute(), b.compute()
    for M in PAPER_BINS:
        for key in ("ece", "cw_ece", "full_ece"):
            assert metrics_at(ta, M)[key] == pytest.approx(metrics_at(tb, M)[key], abs=1e-6)


# ---- kept + tail ----------------------------------------------------------------


def split_kept_tail(probs, labels, k, tau):
    """Dense -> kept (top-k ∪ p > tau ∪ label) + tail, as extraction does."""
    n, K = probs.shape
    order = np.argsort(-probs, axis=1, kind="stable")
    keep = np.zeros_like(probs, dtype=bool)
    keep[np.arange(n)[:, None], order[:, :k]] = True
    keep |= probs > tau
    keep[np.arange(n), labels] = True
    ids = [np.flatnonzero(row) for row in keep]
    offsets = np.r_[0, np.cumsum([len(i) for i in ids])]
    flat_ids = np.concatenate(ids)
    rows = np.repeat(np.arange(n), np.diff(offsets))
    flat_p = probs[rows, flat_ids]
    tail = np.where(keep, 0.0, probs.astype(np.float64))
    tail_max = np.where(keep, 0.0, probs).max(axis=1).astype(np.float32)
    return dict(
        kept_ids=flat_ids,
        kept_probs=flat_p,
        row_offsets=offsets,
        tail_count=(~keep).sum(axis=1),
        tail_mass=tail.sum(axis=1),
        tail_max=tail_max,
        class_tail_count=(~keep).sum(axis=0),
        class_tail_mass=tail.sum(axis=0),
    )


def kept_tables(probs, labels, kt, fine_bins=1000, seq_ids=None):
    acc = CalibrationAccumulator(probs.shape[1], fine_bins=fine_bins)
    acc.update_kept(
        kt["kept_ids"],
        kt["kept_probs"],
        labels,
        kt["tail_count"],
        kt["tail_mass"],
        kt["tail_max"],
        row_offsets=kt["row_offsets"],
        seq_ids=seq_ids,
    )
    acc.add_class_tail(kt["class_tail_count"], kt["class_tail_mass"])
    return acc.compute()


def test_kept_plus_tail_equals_dense_when_tail_is_in_bin1():
    rng = np.random.default_rng(5)
    n, K = 400, 300
    probs = softmax32(rng.normal(scale=2.5, size=(n, K)))
    labels = rng.integers(0, K, n)
    kt = split_kept_tail(probs, labels, k=8, tau=1e-3)
    tables = kept_tables(probs, labels, kt)
    assert float(kt["tail_max"].max()) <= 1e-3
    assert tables.m_exact >= 999
    dense = CalibrationAccumulator(K)
    dense.update(probs, labels)
    dense_tables = dense.compute()
    for M in PAPER_BINS:
        got, ref = metrics_at(tables, M), reference_metrics(probs, labels, M)
        assert got["exact"]
        for key in ("ece", "cw_ece", "full_ece"):
            assert got[key] == pytest.approx(ref[key], abs=TOL)
            assert got[key] == pytest.approx(metrics_at(dense_tables, M)[key], abs=TOL)
    # the tables themselves agree with the dense path
    a, b = tables.to_arrow(), dense_tables.to_arrow()
    assert a["class_bins"].column("n").equals(b["class_bins"].column("n"))
    assert np.allclose(
        a["class_bins"].column("p_sum").to_numpy(),
        b["class_bins"].column("p_sum").to_numpy(),
        rtol=0,
        atol=TOL,
    )
    assert np.allclose(tables.p_mass, dense_tables.p_mass, rtol=0, atol=TOL)


def test_kept_plus_tail_is_flagged_inexact_above_m_exact():
    rng = np.random.default_rng(6)
    n, K = 200, 40
    probs = softmax32(rng.normal(scale=1.0, size=(n, K)))
    labels = rng.integers(0, K, n)
    kt = split_kept_tail(probs, labels, k=2, tau=1.0)  # fat tail
    tables = kept_tables(probs, labels, kt)
    m_exact = tables.m_exact
    assert m_exact is not None and m_exact < 50
    for M in PAPER_BINS:
        row = metrics_at(tables, M)
        assert row["exact"] == (M <= m_exact)
        if row["exact"]:
            ref = reference_metrics(probs, labels, M)
            for key in ("ece", "cw_ece", "full_ece"):
                assert row[key] == pytest.approx(ref[key], abs=TOL)


def test_k1_kept_tail():
    probs = np.ones((5, 1), np.float32)
    labels = np.zeros(5, int)
    kt = split_kept_tail(probs, labels, k=1, tau=0.5)
    tables = kept_tables(probs, labels, kt)
    assert tables.m_exact is None  # no tail at all
    assert metrics_at(tables, 10)["full_ece"] == 0.0


# ---- chunking and merging -------------------------------------------------------


def _assert_tables_equal(a, b):
    ta, tb = a.to_arrow(), b.to_arrow()
    for name in ta:
        x, y = ta[name], tb[name]
        assert x.num_rows == y.num_rows, name
        for col in x.column_names:
            xa, ya = x.column(col).to_numpy(), y.column(col).to_numpy()
            if xa.dtype.kind == "f":
                assert np.allclose(xa, ya, rtol=0, atol=TOL), (name, col)
            else:
                assert np.array_equal(xa, ya), (name, col)
    assert (a.positions, a.tail_max, a.vocab_size) == (b.positions, b.tail_max, b.vocab_size)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**32 - 1), st.lists(st.integers(1, 60), min_size=1, max_size=6))
def test_any_chunking_merges_to_identical_tables(seed, sizes):
    rng = np.random.default_rng(seed)
    n, K = sum(sizes), 23
    probs = softmax32(rng.normal(scale=3, size=(n, K)))
    labels = rng.integers(0, K, n)
    seqs = np.repeat(np.arange(n), 1)[:n] // 7
    whole = CalibrationAccumulator(K)
    whole.update(probs, labels, seq_ids=seqs)
    merged_acc = None
    merged_tables = None
    start = 0
    for size in sizes:
        part = CalibrationAccumulator(K)
        sl = slice(start, start + size)
        part.update(probs[sl], labels[sl], seq_ids=seqs[sl])
        t = part.compute()
        merged_tables = t if merged_tables is None else merged_tables.merge(t)
        merged_acc = part if merged_acc is None else merged_acc.merge(part)
        start += size
    _assert_tables_equal(whole.compute(), merged_tables)
    _assert_tables_equal(whole.compute(), merged_acc.compute())
    # kept + tail path, chunked the same way: every chunk its own kept entries and
    # per-class tail; the merged tables equal the unchunked ones and the reference
    whole_kept = kept_tables(
        probs, labels, split_kept_tail(probs, labels, k=4, tau=1e-3), seq_ids=seqs
    )
    merged_kept = CalibrationAccumulator(K).compute()  # the empty table is the identity
    start = 0
    for size in sizes:
        sl = slice(start, start + size)
        kt = split_kept_tail(probs[sl], labels[sl], k=4, tau=1e-3)
        merged_kept = merged_kept.merge(kept_tables(probs[sl], labels[sl], kt, seq_ids=seqs[sl]))
        start += size
    _assert_tables_equal(whole_kept, merged_kept)
    if merged_kept.m_exact is None or merged_kept.m_exact >= 10:
        ref = reference_metrics(probs, labels, 10)
        got = metrics_at(merged_kept, 10)
        for key in ("ece", "cw_ece", "full_ece"):
            assert got[key] == pytest.approx(ref[key], abs=TOL)


def test_seq_bins_pool_to_the_class_tables():
    rng = np.random.default_rng(7)
    probs = softmax32(rng.normal(scale=3, size=(120, 30)))
    labels = rng.integers(0, 30, 120)
    acc = CalibrationAccumulator(30)
    acc.update(probs, labels, seq_ids=np.arange(120) // 11)
    t = acc.compute()
    sb, cb = t.seq_bins, t.class_bins
    for key in ("n", "hits"):
        by_bin_seq = np.bincount(sb.bins, weights=sb.values[key], minlength=1001)
        by_bin_cls = np.bincount(cb.bins, weights=cb.values[key], minlength=1001)
        assert np.array_equal(by_bin_seq, by_bin_cls)
    assert np.allclose(
        np.bincount(sb.bins, weights=sb.values["p_sum"], minlength=1001),
        np.bincount(cb.bins, weights=cb.values["p_sum"], minlength=1001),
        atol=1e-12,
    )
    assert sb.values["top1_n"].sum() == 120
    assert np.array_equal(
        np.bincount(sb.bins, weights=sb.values["correct"], minlength=1001)[1:], t.top1_correct
    )


# ---- other outputs ---------------------------------------------------------------


def test_token_frequency_and_reliability():
    labels = np.array([0] * 12 + [1] * 3 + [2] * 150 + [3])
    K = 8
    probs = np.full((labels.size, K), 1 / K, np.float32)
    acc = CalibrationAccumulator(K)
    acc.update(probs, labels)
    t = acc.compute()
    tf = token_frequency(t)
    shares = {b["range"]: b["classes"] for b in tf["buckets"]}
    assert shares == {"0": 4, "1-10": 2, "11-100": 1, ">100": 1}
    assert sum(b["share"] for b in tf["buckets"]) == pytest.approx(1.0)
    rel = reliability(t, 10)
    assert rel["full"]["count"].sum() == labels.size * K
    assert rel["top1"]["count"].sum() == labels.size
    assert rel["full"]["mean_prob"][1] == pytest.approx(1 / K)  # 0.125 is in bin 2
    assert np.isnan(rel["full"]["mean_prob"][5])


def test_rsd():
    assert rsd([1.0, 1.0, 1.0]) == 0.0
    # [1, 3]: mean 2, sample variance ((1-2)^2 + (3-2)^2) / (2-1) = 2, RSD = sqrt(2)/2
    assert rsd([1.0, 3.0]) == pytest.approx(70.71067811865476, rel=1e-15)
    # [2, 4, 9]: mean 5, sample variance (9 + 1 + 16) / 2 = 13
    assert rsd([2.0, 4.0, 9.0]) == pytest.approx(100 * 13**0.5 / 5, rel=1e-15)
    with pytest.raises(ValueError):
        rsd([1.0])


# ---- bad input ------------------------------------------------------------------


@pytest.mark.parametrize(
    "probs, labels, message",
    [
        (np.ones((3,), np.float32), [0, 0, 0], "2-D"),
        (np.full((2, 2), 0.5, np.float32), [0, 0, 0], "2 rows of probabilities but 3 labels"),
        (np.full((2, 2), 0.5, np.float32), [0, 2], "label 2 at row 1 is outside"),
        (np.full((2, 2), 0.5, np.float32), [-1, 0], "label -1 at row 0"),
        (np.array([[0.5, 0.5], [np.nan, 1.0]], np.float32), [0, 0], "row 1 contains NaN or inf"),
        (np.array([[0.5, 0.5], [np.inf, 0.0]], np.float32), [0, 0], "row 1 contains NaN or inf"),
        (np.array([[0.5, 0.5], [0.5, 0.6]], np.float32), [0, 0], "row 1 sums to 1.1"),
        (np.array([[1.5, -0.5]], np.float32), [0], "negative"),
        (np.zeros((0, 3), np.float32), [], "empty input"),
    ],
)
def test_bad_input_is_named(probs, labels, message):
    with pytest.raises(InputError, match=message):
        ece(probs, np.asarray(labels), 10)


def test_bad_n_bins():
    probs = np.full((2, 2), 0.5, np.float32)
    for bad in (0, -3):
        with pytest.raises(ValueError, match="n_bins"):
            ece(probs, [0, 1], bad)
    with pytest.raises(TypeError):
        ece(probs, [0, 1], 2.5)


def test_bad_kept_input_is_named():
    acc = CalibrationAccumulator(5)
    with pytest.raises(InputError, match="label 3 is not among the kept ids"):
        acc.update_kept(
            np.array([[0, 1]]), np.array([[0.6, 0.3]], np.float32), [3], [3], [0.1], [0.05]
        )
    with pytest.raises(InputError, match="kept \\+ 2 tail entries != K = 5"):
        acc.update_kept(
            np.array([[0, 1]]), np.array([[0.6, 0.3]], np.float32), [1], [2], [0.1], [0.05]
        )
    with pytest.raises(InputError, match="appears twice"):
        acc.update_kept(
            np.array([[1, 1]]), np.array([[0.6, 0.3]], np.float32), [1], [3], [0.1], [0.05]
        )
    acc.update_kept(np.array([[0, 1]]), np.array([[0.6, 0.3]], np.float32), [1], [3], [0.1], [0.05])
    with pytest.raises(InputError, match="class tail vectors"):
        acc.compute()


def test_bad_seq_ids_or_top1_of_kept_input_add_nothing():
    """Every check of update_kept runs before the state changes: a refused batch
    (seq_ids or top1_ids wrong) leaves the accumulator as it was."""
    acc = CalibrationAccumulator(5)
    ids, probs = np.array([[0, 1]]), np.array([[0.6, 0.3]], np.float32)
    with pytest.raises(InputError, match="seq_ids must be"):
        acc.update_kept(ids, probs, [1], [3], [0.1], [0.05], seq_ids=[0, 1])
    with pytest.raises(InputError):
        acc.update_kept(ids, probs, [1], [3], [0.1], [0.05], top1_ids=[9], top1_probs=[0.6])
    assert acc.positions == 0 and acc.tail_max == 0.0
    assert not acc._bin1_n.any() and not acc._p_mass.any() and not acc._label_count.any()


def test_dense_width_must_match():
    acc = CalibrationAccumulator(4)
    with pytest.raises(InputError, match="expected K=4"):
        acc.update(np.full((2, 3), 1 / 3, np.float32), [0, 1])


def test_nan_logits_named():
    acc = CalibrationAccumulator(3)
    logits = np.zeros((4, 3), np.float32)
    logits[2, 1] = np.nan
    with pytest.raises(InputError, match="row 2"):
        acc.update_logits(logits, [0, 0, 0, 0])


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(0, 40), min_size=1, max_size=60),
    st.sampled_from(["as is", "sorted", "two runs", "many", "spread"]),
    st.integers(0, 2**31),
)
def test_group_sum_adds_every_row_of_a_key(raw_keys, layout, seed):
    """group_sum against a dict of running sums, written from its definition:
    every path (keys already sorted, a few sorted runs, many runs over a small
    key range, a wide range), repeated keys, int32 and float32 inputs summed
    in int64 / float64."""
    from pipeline.core.tables import group_sum

    rng = np.random.default_rng(seed)
    keys = np.array(raw_keys, np.int64)
    if layout == "sorted":
        keys = np.sort(keys)
    elif layout == "two runs":  # two tables' rows, each sorted (merged by a sort)
        keys = np.r_[np.sort(keys), np.sort(keys[::2])]
    elif layout == "many":  # many runs over a small range: the dense bincount
        keys = rng.integers(0, 50, 400 + keys.size)
    elif layout == "spread":  # a key range too wide for the dense bincount
        keys = keys * (1 << 40) + 7
    counts = rng.integers(-5, 1000, keys.size).astype(np.int32)
    masses = rng.random(keys.size).astype(np.float32)
    ukeys, sums = group_sum(keys, {"n": counts, "p": masses})
    want_n, want_p = {}, {}
    for key, n, p in zip(keys.tolist(), counts.tolist(), masses.tolist(), strict=True):
        want_n[key] = want_n.get(key, 0) + n
        want_p[key] = want_p.get(key, 0.0) + p  # in input order, as group_sum
    assert ukeys.tolist() == sorted(want_n)
    assert sums["n"].dtype == np.int64 and sums["p"].dtype == np.float64
    assert sums["n"].tolist() == [want_n[k] for k in sorted(want_n)]
    assert sums["p"].tolist() == pytest.approx([want_p[k] for k in sorted(want_p)], rel=1e-12)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5), st.sampled_from(["sorted", "one unsorted"]), st.integers(0, 2**31))
def test_sparse_merge_sums_every_table(parts, layout, seed):
    """sparse_merge_arrow (the reduce's k-way merge) against a dict of sums
    over all rows of all tables, written from the definition: keys shared by
    several tables, tables without rows, a table out of key order (then the
    sort path), on class_bins and seq_bins."""
    import pyarrow as pa

    from pipeline.core.tables import TABLE_FIELDS, sparse_merge_arrow, value_fields
    from pipeline.store.schema import TABLE_SCHEMAS

    rng = np.random.default_rng(seed)
    fine_bins, vocab = 7, 9
    for name in ("class_bins", "seq_bins"):
        entity = TABLE_FIELDS[name][0].name
        tables, want = [], {}
        for p in range(parts):
            cells = rng.choice(vocab * fine_bins, rng.integers(0, 20), replace=False)
            cells = np.sort(cells)
            if layout == "one unsorted" and p == 0:
                cells = cells[::-1]
            ids, bins = cells // fine_bins, cells % fine_bins + 1
            columns = {entity: ids, "bin": bins}
            for f in value_fields(name):
                columns[f.name] = (
                    rng.integers(0, 100, cells.size)
                    if f.dtype == "int64"
                    else rng.random(cells.size)
                )
            tables.append(pa.table(columns).cast(TABLE_SCHEMAS[name]))
            for r in range(cells.size):
                sums = want.setdefault((int(ids[r]), int(bins[r])), {})
                for f in value_fields(name):
                    sums[f.name] = sums.get(f.name, 0) + columns[f.name][r]
        merged = sparse_merge_arrow(tables, name, fine_bins, vocab)
        keys = sorted(want)
        assert list(zip(merged.ids.tolist(), merged.bins.tolist(), strict=True)) == keys
        for f in value_fields(name):
            got = merged.values[f.name].tolist()
            assert got == pytest.approx([want[key][f.name] for key in keys], rel=1e-12)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 30), st.integers(0, 2**31))
def test_one_table_in_key_order_is_its_own_sum(rows, seed):
    """sparse_table_as_is hands back a lone table in key order with unique keys
    (a single shard's partial table) as it is, equal to the merge's table to
    the bit; anything the merge would sort or sum is left to the merge (None);
    its checks are the merge's."""
    import tempfile
    from pathlib import Path

    import pyarrow as pa

    from pipeline.core.tables import (
        TABLE_FIELDS,
        sparse_merge_arrow,
        sparse_table_as_is,
        sparse_to_arrow,
        value_fields,
    )
    from pipeline.store.schema import TABLE_SCHEMAS
    from pipeline.store.tablestore import write_table_file

    rng = np.random.default_rng(seed)
    fine_bins, vocab = 7, 9
    for name in ("class_bins", "seq_bins"):
        entity = TABLE_FIELDS[name][0].name
        cells = np.sort(rng.choice(vocab * fine_bins, rows, replace=False))
        ids, bins = cells // fine_bins, cells % fine_bins + 1
        if name == "seq_bins":
            ids = ids - 4  # document ids may be negative
        columns = {entity: ids, "bin": bins}
        for f in value_fields(name):
            columns[f.name] = rng.integers(0, 100, rows) if f.dtype == "int64" else rng.random(rows)
        table = pa.table(columns).cast(TABLE_SCHEMAS[name])
        empty = table.slice(0, 0)
        got = sparse_table_as_is([empty, table, empty], name, fine_bins, vocab)
        if rows == 0:
            assert got is None  # no table: the merge writes the empty one
            continue
        assert got.equals(table)
        merged = sparse_to_arrow(sparse_merge_arrow([table], name, fine_bins, vocab), name)
        assert merged.schema.equals(got.schema, check_metadata=True)
        for column in merged.column_names:
            want = merged.column(column).to_numpy()
            assert got.column(column).to_numpy().tobytes() == want.tobytes(), column
        # written, the same bytes as the merge's table, from one chunk or several
        chunked = pa.concat_tables([table.slice(0, rows // 2), table.slice(rows // 2)])
        with tempfile.TemporaryDirectory() as tmp:
            files = []
            for i, t in enumerate((merged, got, sparse_table_as_is([chunked], name, 7, vocab))):
                write_table_file(t, Path(tmp) / f"{i}.parquet")
                files.append((Path(tmp) / f"{i}.parquet").read_bytes())
            assert files[0] == files[1] == files[2]
        # left to the merge: two tables, a table out of order or with a key twice
        assert sparse_table_as_is([table, table], name, fine_bins, vocab) is None
        if rows > 1:
            assert sparse_table_as_is([table[::-1]], name, fine_bins, vocab) is None
            twice = pa.concat_tables([table.slice(0, 1), table.slice(0, rows - 1)])
            assert sparse_table_as_is([twice], name, fine_bins, vocab) is None
        other = table.cast(pa.schema([pa.field(f.name, pa.int64()) if f.name == "bin" else f
                                      for f in table.schema]))  # fmt: skip
        assert sparse_table_as_is([other], name, fine_bins, vocab) is None
        tagged = table.replace_schema_metadata({"other": "metadata"})
        assert sparse_table_as_is([tagged], name, fine_bins, vocab) is None
        bad_bin = pa.table(dict(columns, bin=np.where(np.arange(rows) == rows - 1, 8, bins)))
        with pytest.raises(ValueError, match="bin outside 1..7"):
            sparse_table_as_is([bad_bin.cast(TABLE_SCHEMAS[name])], name, fine_bins, vocab)
    table = pa.table({"class_id": [2, 9], "bin": [1, 1], "n": [1, 1], "p_sum": [0.1, 0.2],
                      "hits": [0, 1]}).cast(TABLE_SCHEMAS["class_bins"])  # fmt: skip
    with pytest.raises(ValueError, match=r"class_id outside \[0, 9\)"):
        sparse_table_as_is([table], "class_bins", 7, 9)


def test_sparse_merge_refuses_bins_out_of_range():
    import pyarrow as pa

    from pipeline.core.tables import sparse_merge_arrow
    from pipeline.store.schema import TABLE_SCHEMAS

    good = {"class_id": [1, 2], "bin": [1, 3], "n": [1, 1], "p_sum": [0.1, 0.2], "hits": [0, 1]}
    bad = dict(good, bin=[1, 8])
    tables = [pa.table(t).cast(TABLE_SCHEMAS["class_bins"]) for t in (good, bad)]
    with pytest.raises(ValueError, match="bin outside 1..7"):
        sparse_merge_arrow(tables, "class_bins", 7, 9)
