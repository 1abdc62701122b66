"""The metric registry: one declaration per metric `fullece metrics` reports.

Each :class:`Metric` says where the figure lives in the JSON object (top level
or each ``bins[]`` row), what it is called in text, how it is computed (which
table or column) and what makes it exact. The text output, the JSON schema
(``schemas/metrics.v1.schema.json``, checked against this table in the tests),
``fullece compare`` and the report read their metric lists from here, so a new
metric is declared once.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Metric", "REGISTRY", "PAPER_METRICS", "BIN_METRICS", "RUN_METRICS", "metric"]


@dataclass(frozen=True)
class Metric:
    key: str  # JSON key
    label: str  # text / figure label
    level: str  # "run": one value per run (top level); "bins": one per bins[] row
    formula: str  # the definition, in one line
    source: str  # which table / column it is computed from
    exact_when: str  # what makes it exact (else: interval key or exact=false)
    bounds_key: str | None = None  # JSON key of the [lo, hi] interval, when it can be one
    paper: bool = False  # one of the paper's three metrics (ECE, cw-ECE, Full-ECE)
    text: bool = True  # shown in the text output, compare and the report (else JSON only)


REGISTRY: tuple[Metric, ...] = (
    Metric(
        "ece",
        "ECE",
        "bins",
        "(1/N) Σ_m |correct_m − conf_sum_m|",
        "top1_bins (n, conf_sum, correct)",
        "always (top-1 is stored per position): ece_bounds collapses at every M",
        bounds_key="ece_bounds",
        paper=True,
    ),
    Metric(
        "cw_ece",
        "cw-ECE",
        "bins",
        "(1/(N K)) Σ_k Σ_m |hits_mk − p_sum_mk|",
        "class_bins (class_id, bin, p_sum, hits)",
        "M <= m_exact (every tail probability in bin 1) and a known per-class tail",
        bounds_key="cw_ece_bounds",
        paper=True,
    ),
    Metric(
        "full_ece",
        "Full-ECE",
        "bins",
        "(1/N) Σ_m |Σ_k hits_mk − Σ_k p_sum_mk|",
        "class_bins pooled over classes",
        "M <= m_exact",
        bounds_key="full_ece_bounds",
        paper=True,
    ),
    Metric(
        "overconfidence",
        "over",
        "bins",
        "(1/N) Σ_m max(p_sum_m − hits_m, 0), pooled over classes",
        "class_bins pooled over classes",
        "M <= m_exact; full_ece = overconfidence + underconfidence (always equal halves)",
        text=False,
    ),
    Metric(
        "underconfidence",
        "under",
        "bins",
        "(1/N) Σ_m max(hits_m − p_sum_m, 0), pooled over classes",
        "class_bins pooled over classes",
        "M <= m_exact",
        text=False,
    ),
    Metric(
        "mce",
        "MCE",
        "bins",
        "max over non-empty top-1 bins of |correct_m/n_m − conf_sum_m/n_m|",
        "top1_bins",
        "always",
    ),
    Metric(
        "adaptive_ece",
        "adaptive ECE",
        "bins",
        "(1/N) Σ_b |Σ_{i∈b} (1[top1_i = label_i] − top1_prob_i)| over M equal-count bins "
        "of the positions sorted by (top1_prob, correct), split like numpy.array_split",
        "top1_bins (n, conf_sum, correct per fine bin); positions with --positions",
        "no equal-count boundary cuts a fine bin, or --positions; else adaptive_ece_bounds",
        bounds_key="adaptive_ece_bounds",
    ),
    Metric(
        "ece_over",
        "ECE over",
        "bins",
        "(1/N) Σ_m max(conf_sum_m − correct_m, 0), top-1: ECE from overconfident bins",
        "top1_bins",
        "always; ece = ece_over + ece_under",
    ),
    Metric(
        "ece_under",
        "ECE under",
        "bins",
        "(1/N) Σ_m max(correct_m − conf_sum_m, 0), top-1: ECE from underconfident bins",
        "top1_bins",
        "always",
    ),
    Metric(
        "ece_l2",
        "ECE-L2",
        "bins",
        "sqrt(Σ_m (n_m/N) (conf_m − acc_m)²), top-1",
        "top1_bins (n, conf_sum, correct)",
        "always",
        text=False,
    ),
    Metric(
        "ece_l2_debiased",
        "ECE-L2 debiased",
        "bins",
        "sqrt(max(0, Σ_{m: n_m ≥ 2} (n_m/N) [(conf_m − acc_m)² − acc_m (1 − acc_m)/(n_m − 1)])), "
        "top-1 (Kumar, Liang & Ma 2019)",
        "top1_bins (n, conf_sum, correct)",
        "always",
    ),
    Metric(
        "full_ece_l2",
        "Full-L2",
        "bins",
        "sqrt(Σ_m (n_m/N) (conf_m − acc_m)²) over every (position, class) pair, n_m pairs",
        "class_bins pooled over classes (n, p_sum, hits)",
        "M <= m_exact; else full_ece_l2_bounds",
        bounds_key="full_ece_l2_bounds",
        text=False,
    ),
    Metric(
        "full_ece_l2_debiased",
        "Full-L2 debiased",
        "bins",
        "full_ece_l2 with each bin's acc_m (1 − acc_m)/(n_m − 1) subtracted, bins with "
        "n_m < 2 left out, sqrt(max(0, ·))",
        "class_bins pooled over classes (n, p_sum, hits)",
        "M <= m_exact; else full_ece_l2_debiased_bounds",
        bounds_key="full_ece_l2_debiased_bounds",
    ),
    Metric(
        "nll",
        "NLL",
        "run",
        "(1/N) Σ_i −ln p_i(label_i), float64 arithmetic on the float32 probability of record",
        "positions.label_prob",
        "always",
    ),
    Metric(
        "perplexity",
        "perplexity",
        "run",
        "exp(nll)",
        "positions.label_prob",
        "always",
    ),
    Metric(
        "brier",
        "Brier",
        "run",
        "(1/N) Σ_i Σ_k (p_ik − 1[k = label_i])² = (1/N) Σ_i (Σ_k p_ik² − 2 p_i(label_i) + 1)",
        "positions.sum_p2 (schema v2) or the full store's logits; else kept_probs + tail",
        "sum_p2 stored or full store; else brier_bounds from the kept entries and the tail",
        bounds_key="brier_bounds",
    ),
    Metric(
        "entropy",
        "entropy",
        "run",
        "(1/N) Σ_i −Σ_k p_ik ln p_ik (nats)",
        "positions.entropy or the full store's logits; else kept_probs + tail",
        "entropy stored for every position or full store; else entropy_bounds",
        bounds_key="entropy_bounds",
    ),
    Metric(
        "smooth_ece",
        "smooth ECE",
        "run",
        "smECE of Błasiok & Nakkiran (relplot.smECE's algorithm) on the top-1 pairs, each "
        "confidence at its fine bin's mean (raw confidences with --positions)",
        "top1_bins (n, conf_sum, correct); positions with --positions",
        "always (a deterministic function of the top-1 fine grid, or of the top-1 pairs)",
    ),
)

_BY_KEY = {m.key: m for m in REGISTRY}
PAPER_METRICS = tuple(m for m in REGISTRY if m.paper)
BIN_METRICS = tuple(m for m in REGISTRY if m.level == "bins")
RUN_METRICS = tuple(m for m in REGISTRY if m.level == "run")


def metric(key: str) -> Metric:
    return _BY_KEY[key]
