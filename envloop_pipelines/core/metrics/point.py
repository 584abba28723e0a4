"""Point metrics: one number (or one per family) from one model's predictions on a set of questions.

Metrics
    ``accuracy`` / ``family_macro_accuracy``, ``brier`` (summed over options),
    ``nll``, ``ece`` (15 equal-width bins), ``coverage_at_error_budget`` and
    ``threshold_for_error_budget`` (tie-aware), ``aurc`` (tie-aware),
    ``false_negative_rate`` / ``safety_fnr``, ``safety_deferral``; ``summarize``
    flattens them under stable keys. Inputs are ragged predictions, validated
    and padded by :func:`~envloop_pipelines.core.metrics.batch.pack` (hard and
    soft labels are described there). Each public metric has a packed form on a
    :class:`~envloop_pipelines.core.metrics.batch.Batch` (:func:`packed_form`),
    which the paired bootstrap (``core/metrics/paired.py``) resamples.

Conventions
    * The prediction is ``argmax`` of the probability vector (the first index
      on an exact tie); the confidence is its probability, ``max_k p_k``.
    * Tie-aware means questions with *exactly* equal confidence are accepted
      or rejected together: no threshold can separate them, so no number here
      pretends it could.
    * A metric with nothing to measure (accuracy with no hard-labelled
      question, an FNR with no positive) is ``nan``, never 0.

Pure numpy: no Dagster, no torch.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Mapping, Sequence

import numpy as np

from envloop_pipelines.core.metrics.batch import (
    NOUL_NEGATIVE_INDEX,
    NOUL_POSITIVE_INDEX,
    Batch,
    SoftLabels,
    check_qtypes,
    confidence,
    expected_correct,
    pack,
    predictions,
)

#: Probabilities are clipped here before the log in NLL: -log(1e-12) ≈ 27.6 nats caps one question's loss.
NLL_CLIP = 1e-12
DEFAULT_ECE_BINS = 15
DEFAULT_ERROR_BUDGET = 0.05
# Slack for "errors <= budget * covered" so 1 error in 20 meets a 5% budget
# despite 0.05 * 20 not being exact in binary floating point.
_BUDGET_SLACK = 1e-9


# --------------------------------------------------------------------------- packed metrics


def _accuracy(b: Batch) -> float:
    hard = ~b.soft
    if not hard.any():
        return math.nan
    return float(np.mean(predictions(b)[hard] == b.labels[hard]))


def _per_family_accuracy(b: Batch) -> dict[str, float]:
    if b.family_codes is None:
        raise ValueError("families are required for per-family / family-macro accuracy")
    size = len(b.family_names)
    hard = ~b.soft
    present = np.bincount(b.family_codes, minlength=size)
    n_hard = np.bincount(b.family_codes[hard], minlength=size)
    n_right = np.bincount(b.family_codes[hard], weights=predictions(b)[hard] == b.labels[hard], minlength=size)
    # families absent from this (sub)set are left out; present but all-soft -> nan
    return {
        name: float(n_right[k] / n_hard[k]) if n_hard[k] else math.nan
        for k, name in enumerate(b.family_names)
        if present[k]
    }


def _family_macro_accuracy(b: Batch) -> float:
    values = [v for v in _per_family_accuracy(b).values() if not math.isnan(v)]
    return float(np.mean(values)) if values else math.nan


def _brier(b: Batch) -> float:
    # mean_i sum_k (p_ik - y_ik)^2 ; padding adds (0 - 0)^2 = 0
    return float(np.mean(np.sum((b.probs - b.target) ** 2, axis=1)))


def _nll(b: Batch) -> float:
    # mean_i -sum_k y_ik log max(p_ik, 1e-12) ; padding has y = 0
    logp = np.log(np.clip(b.probs, NLL_CLIP, 1.0))
    return float(np.mean(-np.sum(b.target * logp, axis=1)))


def _ece(b: Batch, n_bins: int = DEFAULT_ECE_BINS) -> float:
    if n_bins < 1:
        raise ValueError(f"n_bins must be >= 1, got {n_bins}")
    conf = confidence(b)
    correct = expected_correct(b)
    # Bins (0, 1/B], (1/B, 2/B], ..., ((B-1)/B, 1]: a confidence on an inner
    # edge falls in the lower bin (searchsorted 'left' counts edges < conf).
    inner_edges = np.linspace(0.0, 1.0, n_bins + 1)[1:-1]
    bins = np.searchsorted(inner_edges, conf, side="left")
    conf_sum = np.bincount(bins, weights=conf, minlength=n_bins)
    acc_sum = np.bincount(bins, weights=correct, minlength=n_bins)
    # sum_b (n_b / N) |acc_b - conf_b| = sum_b |acc_sum_b - conf_sum_b| / N
    return float(np.sum(np.abs(acc_sum - conf_sum)) / b.n)


def _risk_groups(b: Batch) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Tie groups of the hard-labelled questions, most confident first.

    Returns ``(group_conf, covered, errors, n)``: for each tie group ``g`` its
    confidence, the number of questions accepted once ``g`` is in
    (cumulative), the errors among them (cumulative), and ``n`` the number of
    hard-labelled questions.
    """
    hard = ~b.soft
    conf = confidence(b)[hard]
    wrong = (predictions(b)[hard] != b.labels[hard]).astype(np.float64)
    order = np.argsort(-conf, kind="stable")
    conf, wrong = conf[order], wrong[order]
    if conf.size == 0:
        empty = np.zeros(0)
        return empty, empty.astype(np.int64), empty, 0
    ends = np.flatnonzero(np.r_[conf[1:] != conf[:-1], True])  # last index of each tie group
    return conf[ends], ends + 1, np.cumsum(wrong)[ends], int(conf.size)


def _check_budget(budget: float) -> None:
    if not 0.0 <= budget <= 1.0 or math.isnan(budget):
        raise ValueError(f"error budget must be in [0, 1], got {budget}")


def _last_admissible_group(b: Batch, budget: float) -> tuple[int | None, np.ndarray, np.ndarray, int]:
    _check_budget(budget)
    group_conf, covered, errors, n = _risk_groups(b)
    admissible = np.flatnonzero(errors <= budget * covered + _BUDGET_SLACK)
    # Risk is not monotone in coverage: take the *largest* admissible prefix,
    # not the first one before a violation. Coverage grows with the group index.
    last = int(admissible[-1]) if admissible.size else None
    return last, group_conf, covered, n


def _coverage(b: Batch, budget: float = DEFAULT_ERROR_BUDGET) -> float:
    last, _, covered, n = _last_admissible_group(b, budget)
    if n == 0:
        return math.nan
    return 0.0 if last is None else float(covered[last] / n)


def _threshold(b: Batch, budget: float = DEFAULT_ERROR_BUDGET) -> float:
    last, group_conf, _, _ = _last_admissible_group(b, budget)
    return math.inf if last is None else float(group_conf[last])


def _aurc(b: Batch) -> float:
    _, covered, errors, n = _risk_groups(b)
    if n == 0:
        return math.nan
    sizes = np.diff(np.r_[0, covered])  # m_g, questions entering with group g
    # AURC = sum_g (m_g / N) * (e_g / n_g)
    return float(np.sum(sizes * errors / covered) / n)


def _fnr(b: Batch, positive_index: int = NOUL_POSITIVE_INDEX) -> float:
    hard = ~b.soft
    if np.any(positive_index >= b.n_options) or positive_index < 0:
        raise ValueError(f"positive_index {positive_index} is out of range for some question's options")
    positives = hard & (b.labels == positive_index)
    if not positives.any():
        return math.nan
    false_negatives = positives & (predictions(b) != positive_index)
    return float(false_negatives.sum() / positives.sum())  # FN / (TP + FN)


def _safety_fnr(
    b: Batch,
    safety_families: Sequence[str],
    qtypes: np.ndarray | None,
    positive_index: int = NOUL_POSITIVE_INDEX,
) -> dict[str, float]:
    if isinstance(safety_families, str):
        raise ValueError(f"safety_families must be a sequence of family names, got the string {safety_families!r}")
    if safety_families and b.family_codes is None:
        raise ValueError("families are required to compute the safety false-negative rate")
    out: dict[str, float] = {}
    for family in safety_families:
        if family not in b.family_names:
            out[family] = math.nan
            continue
        rows = np.flatnonzero(b.family_codes == b.family_names.index(family))
        if rows.size == 0:
            out[family] = math.nan
            continue
        if qtypes is not None:
            kinds = sorted(set(qtypes[rows]) - {"noul"})
            if kinds:
                raise ValueError(
                    f"safety family {family!r} must hold only noul questions (positive = 'true', "
                    f"index 0), found {kinds!r}"
                )
        out[family] = _fnr(b.take(rows), positive_index)
    return out


# --------------------------------------------------------------------------- public metrics


def accuracy(probs: Sequence[np.ndarray], labels: Sequence[int], soft_labels: SoftLabels | None = None) -> float:
    """Fraction of hard-labelled questions whose argmax is the true option.

    Args:
        probs: One probability vector per question.
        labels: Index of the true option per question.
        soft_labels: Optional soft target per question (``None`` for hard);
            soft-labelled questions are excluded.

    Returns:
        Micro accuracy over the hard-labelled questions; ``nan`` if there are none.
    """
    return _accuracy(pack(probs, labels, soft_labels))


def per_family_accuracy(
    probs: Sequence[np.ndarray],
    labels: Sequence[int],
    families: Sequence[str],
    soft_labels: SoftLabels | None = None,
) -> dict[str, float]:
    """Accuracy of each family over its hard-labelled questions.

    Returns:
        ``{family: accuracy}`` sorted by family name; a family whose questions
        are all soft-labelled maps to ``nan``.
    """
    return _per_family_accuracy(pack(probs, labels, soft_labels, families))


def family_macro_accuracy(
    probs: Sequence[np.ndarray],
    labels: Sequence[int],
    families: Sequence[str],
    soft_labels: SoftLabels | None = None,
) -> float:
    """Mean over families of per-family accuracy (each family weighs the same).

    A family with no hard-labelled question is left out of the mean; ``nan``
    when no family has one.
    """
    return _family_macro_accuracy(pack(probs, labels, soft_labels, families))


def brier(probs: Sequence[np.ndarray], labels: Sequence[int], soft_labels: SoftLabels | None = None) -> float:
    """Multi-class Brier score, summed over options: ``mean_i sum_k (p_ik - y_ik)^2``.

    ``y_i`` is one-hot on the label, or the soft label when given. Range [0, 2].
    """
    return _brier(pack(probs, labels, soft_labels))


def nll(probs: Sequence[np.ndarray], labels: Sequence[int], soft_labels: SoftLabels | None = None) -> float:
    """Negative log-likelihood ``mean_i -sum_k y_ik log p_ik`` (nats), ``p`` clipped at 1e-12.

    With a soft target this is the cross-entropy against it.
    """
    return _nll(pack(probs, labels, soft_labels))


def ece(
    probs: Sequence[np.ndarray],
    labels: Sequence[int],
    soft_labels: SoftLabels | None = None,
    *,
    n_bins: int = DEFAULT_ECE_BINS,
) -> float:
    """Top-label expected calibration error with ``n_bins`` equal-width bins on [0, 1].

    Confidence is ``max_k p_k``; correctness is ``argmax == label``, or for a
    soft-labelled question the target probability of the argmax option. Bins
    are ``(0, 1/B], (1/B, 2/B], ..., ((B-1)/B, 1]``, and
    ``ECE = sum_b (n_b / N) |acc_b - conf_b|``.
    """
    return _ece(pack(probs, labels, soft_labels), n_bins)


def coverage_at_error_budget(
    probs: Sequence[np.ndarray],
    labels: Sequence[int],
    soft_labels: SoftLabels | None = None,
    *,
    budget: float = DEFAULT_ERROR_BUDGET,
) -> float:
    """Largest fraction of questions that can be answered with error rate <= ``budget``.

    Questions are accepted most-confident first, one tie group (equal
    confidence) at a time; the result is the largest accepted fraction whose
    error rate is within the budget, 0 if none is. Soft-labelled questions are
    excluded; ``nan`` if no hard-labelled question remains.
    """
    return _coverage(pack(probs, labels, soft_labels), budget)


def threshold_for_error_budget(
    probs: Sequence[np.ndarray],
    labels: Sequence[int],
    soft_labels: SoftLabels | None = None,
    *,
    budget: float = DEFAULT_ERROR_BUDGET,
) -> float:
    """Confidence threshold that achieves :func:`coverage_at_error_budget`.

    Accepting the questions with ``max_k p_k >= threshold`` covers exactly the
    fraction ``coverage_at_error_budget`` returns (on the same data).

    Returns:
        The confidence of the least confident accepted tie group, or ``+inf``
        (automate nothing) when no prefix meets the budget or there is no
        hard-labelled question.
    """
    return _threshold(pack(probs, labels, soft_labels), budget)


def aurc(probs: Sequence[np.ndarray], labels: Sequence[int], soft_labels: SoftLabels | None = None) -> float:
    """Area under the risk–coverage curve, tie-aware (lower is better).

    Sort the ``N`` hard-labelled questions by confidence, descending, into tie
    groups ``g = 1..G`` of sizes ``m_g``; after group ``g`` is accepted,
    ``n_g = m_1 + ... + m_g`` questions are covered with ``e_g`` errors. Then::

        AURC = sum_g (m_g / N) * (e_g / n_g)

    i.e. the mean over questions of the selective risk at the point where the
    question's tie group enters. Without ties this is the usual
    ``(1/N) sum_{i=1..N} risk(top i)``.
    """
    return _aurc(pack(probs, labels, soft_labels))


def false_negative_rate(
    probs: Sequence[np.ndarray],
    labels: Sequence[int],
    positive_index: int = NOUL_POSITIVE_INDEX,
    soft_labels: SoftLabels | None = None,
) -> float:
    """``FN / positives``: how often a true positive is predicted as something else.

    A question is a positive when its label is ``positive_index`` (noul: index
    0 = "true") and a false negative when, in addition, its argmax is another
    option. Soft-labelled questions are excluded; ``nan`` without positives.
    """
    return _fnr(pack(probs, labels, soft_labels), positive_index)


def safety_fnr(
    probs: Sequence[np.ndarray],
    labels: Sequence[int],
    families: Sequence[str],
    safety_families: Sequence[str],
    soft_labels: SoftLabels | None = None,
    qtypes: Sequence[str] | None = None,
    positive_index: int = NOUL_POSITIVE_INDEX,
) -> dict[str, float]:
    """False-negative rate of each declared safety family.

    Args:
        safety_families: Names of the families where a missed positive is a
            safety failure; their questions must be noul (checked when
            ``qtypes`` is given).

    Returns:
        ``{family: FNR}`` in the declared order; ``nan`` for a declared family
        absent from the data or without positives.
    """
    b = pack(probs, labels, soft_labels, families)
    return _safety_fnr(b, safety_families, check_qtypes(qtypes, b.n), positive_index)


def safety_deferral(
    probs: Sequence[np.ndarray],
    labels: Sequence[int],
    families: Sequence[str],
    thresholds: Mapping[str, float],
    soft_labels: SoftLabels | None = None,
) -> dict[str, dict[str, float]]:
    """What a safety family's automation threshold leaves to people, and what it lets through.

    A question of family ``f`` is answered automatically only when its P("false") is at least
    ``thresholds[f]`` (``core/model/calibration.py``); the others defer to a person. Returns, per
    family present: ``defer_rate`` (share of its questions deferred) and ``fnr_automated`` (share of
    its positives answered "false" automatically: the false negatives no person sees; ``nan``
    without a positive). Soft-labelled questions count in ``defer_rate`` only. The automation
    threshold of the error budget may defer more; these figures are for the safety threshold alone.
    """
    b = pack(probs, labels, soft_labels, families)
    out: dict[str, dict[str, float]] = {}
    for family, threshold in thresholds.items():
        if b.family_codes is None or family not in b.family_names:
            continue
        rows = np.flatnonzero(b.family_codes == b.family_names.index(family))
        if rows.size == 0:
            continue
        if np.any(b.n_options[rows] != 2):
            raise ValueError(f"safety family {family!r} must hold only noul questions (2 options)")
        automated = b.probs[rows, NOUL_NEGATIVE_INDEX] >= threshold
        says_false = predictions(b.take(rows)) == NOUL_NEGATIVE_INDEX
        positives = ~b.soft[rows] & (b.labels[rows] == NOUL_POSITIVE_INDEX)
        missed = automated & says_false & positives
        out[family] = {
            "defer_rate": float(1.0 - automated.mean()),
            "fnr_automated": float(missed.sum() / positives.sum()) if positives.any() else math.nan,
        }
    return out


def coverage_key(budget: float) -> str:
    """Summary key of the coverage at ``budget``: 0.05 → ``coverage_at_5pct``, 0.025 → ``coverage_at_2.5pct``."""
    _check_budget(budget)
    percent = round(budget * 100, 6)  # round first: 0.29 * 100 = 28.999999999999996
    return f"coverage_at_{int(percent)}pct" if percent == int(percent) else f"coverage_at_{percent:g}pct"


def summarize(
    probs: Sequence[np.ndarray],
    labels: Sequence[int],
    families: Sequence[str],
    *,
    soft_labels: SoftLabels | None = None,
    qtypes: Sequence[str] | None = None,
    safety_families: Sequence[str] = (),
    error_budget: float = DEFAULT_ERROR_BUDGET,
    n_bins: int = DEFAULT_ECE_BINS,
) -> dict[str, float]:
    """Every metric of this module, flattened under stable keys.

    Keys: ``family_macro_accuracy``, ``accuracy``, ``brier``, ``nll``, ``ece``,
    ``coverage_at_<P>pct`` (see :func:`coverage_key`), ``aurc``,
    ``fnr/<family>`` for each declared safety family, ``acc/<family>`` for each
    family present, ``n_questions`` (all questions, soft-labelled included).
    """
    b = pack(probs, labels, soft_labels, families)
    qt = check_qtypes(qtypes, b.n)
    per_family = _per_family_accuracy(b)
    macro = [v for v in per_family.values() if not math.isnan(v)]
    out: dict[str, float] = {
        "family_macro_accuracy": float(np.mean(macro)) if macro else math.nan,
        "accuracy": _accuracy(b),
        "brier": _brier(b),
        "nll": _nll(b),
        "ece": _ece(b, n_bins),
        coverage_key(error_budget): _coverage(b, error_budget),
        "aurc": _aurc(b),
    }
    for family, value in _safety_fnr(b, safety_families, qt).items():
        out[f"fnr/{family}"] = value
    for family, value in per_family.items():
        out[f"acc/{family}"] = value
    out["n_questions"] = float(b.n)
    return out


#: The metrics by name: the names ``paired_delta`` (``core/metrics/paired.py``) accepts.
METRICS: dict[str, Callable[..., float]] = {
    "accuracy": accuracy,
    "family_macro_accuracy": family_macro_accuracy,
    "brier": brier,
    "nll": nll,
    "ece": ece,
    "coverage_at_error_budget": coverage_at_error_budget,
    "aurc": aurc,
    "false_negative_rate": false_negative_rate,
}

# The packed implementation of each public metric, so the bootstrap resamples
# index arrays instead of re-validating ragged lists 2 x n_resamples times.
_PACKED: dict[Callable[..., float], Callable[..., float]] = {
    accuracy: _accuracy,
    family_macro_accuracy: _family_macro_accuracy,
    brier: _brier,
    nll: _nll,
    ece: _ece,
    coverage_at_error_budget: _coverage,
    aurc: _aurc,
    false_negative_rate: _fnr,
}


def packed_form(metric_fn: Callable[..., float]) -> Callable[[Batch], float] | None:
    """The packed implementation of ``metric_fn`` (one of :data:`METRICS`, or a ``functools.partial`` of one
    setting only ``n_bins`` or ``budget``) on a :class:`Batch`; ``None`` for any other callable."""
    if metric_fn in _PACKED:
        return _PACKED[metric_fn]
    if (
        isinstance(metric_fn, functools.partial)
        and metric_fn.func in _PACKED
        and not metric_fn.args
        and set(metric_fn.keywords) <= {"n_bins", "budget"}  # the options the packed forms take
    ):
        return functools.partial(_PACKED[metric_fn.func], **metric_fn.keywords)
    return None


__all__ = [
    "DEFAULT_ECE_BINS",
    "DEFAULT_ERROR_BUDGET",
    "METRICS",
    "NLL_CLIP",
    "accuracy",
    "aurc",
    "brier",
    "coverage_at_error_budget",
    "coverage_key",
    "ece",
    "false_negative_rate",
    "family_macro_accuracy",
    "nll",
    "packed_form",
    "per_family_accuracy",
    "safety_deferral",
    "safety_fnr",
    "summarize",
    "threshold_for_error_budget",
]
