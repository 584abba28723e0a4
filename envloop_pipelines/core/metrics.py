"""Decision metrics: the one module every evaluation, check and release card uses.

Inputs are per-question predictions. Questions have different numbers of
options, so a set of predictions is *ragged*: ``probs`` is a sequence of 1-D
probability vectors (one per question), ``labels`` the index of the true option.

Hard and soft labels
    A question may carry a *soft label* (a probability vector over its options,
    for ambiguous questions). Such a question counts in the proper scores
    (Brier, NLL) and in ECE against its soft target, and is **excluded** from
    accuracy, coverage, AURC and the false-negative rate, which need one true
    option. Its entry in ``labels`` is ignored and may be ``-1``.

Metrics
    ``accuracy`` / ``family_macro_accuracy``, ``brier`` (summed over options),
    ``nll``, ``ece`` (15 equal-width bins), ``coverage_at_error_budget`` and
    ``threshold_for_error_budget`` (tie-aware), ``aurc`` (tie-aware),
    ``false_negative_rate`` / ``safety_fnr``; ``summarize`` flattens all of
    them under stable keys; ``paired_delta`` gives ``metric(b) - metric(a)`` on
    the same questions with a record-clustered bootstrap CI and standard error
    (``scipy.stats.bootstrap``); ``minimum_detectable_effect`` turns that
    standard error into the smallest effect a paired test detects at 80% power.

Conventions
    * The prediction is ``argmax`` of the probability vector (the first index
      on an exact tie); the confidence is its probability, ``max_k p_k``.
    * Tie-aware means questions with *exactly* equal confidence are accepted
      or rejected together: no threshold can separate them, so no number here
      pretends it could.
    * A metric with nothing to measure (accuracy with no hard-labelled
      question, an FNR with no positive) is ``nan``, never 0.

Pure numpy + scipy: no Dagster, no torch.
"""

from __future__ import annotations

import functools
import inspect
import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

#: Mirrors ``envloop_pipelines.core.data.records.QUESTION_TYPES`` (not imported: that
#: module pulls pyarrow, this one stays numpy + scipy).
QUESTION_TYPES: tuple[str, ...] = ("noul", "choice", "score")
#: noul options are ordered ("true", "false"): the positive ("true") is index 0.
NOUL_POSITIVE_INDEX = 0
#: The noul option "false": a safety family's automation threshold is on its probability.
NOUL_NEGATIVE_INDEX = 1
#: A probability vector (or soft label) must sum to 1 within this tolerance.
PROB_SUM_TOLERANCE = 1e-4
#: Probabilities are clipped here before the log in NLL: -log(1e-12) ≈ 27.6 nats caps one question's loss.
NLL_CLIP = 1e-12
DEFAULT_ECE_BINS = 15
DEFAULT_ERROR_BUDGET = 0.05
# Slack for "errors <= budget * covered" so 1 error in 20 meets a 5% budget
# despite 0.05 * 20 not being exact in binary floating point.
_BUDGET_SLACK = 1e-9

SoftLabels = Sequence["np.ndarray | None"]


# --------------------------------------------------------------------------- packed form


@dataclass(frozen=True)
class _Batch:
    """Validated predictions, padded to a rectangle so every metric is vectorised.

    ``probs`` and ``target`` are ``(n, K_max)`` with zeros in the padding (zeros
    never win an argmax of a vector summing to 1, and add nothing to Brier or NLL).
    """

    probs: np.ndarray  # (n, K) float, 0 in padding
    target: np.ndarray  # (n, K) one-hot for hard questions, the soft label otherwise
    n_options: np.ndarray  # (n,) int
    labels: np.ndarray  # (n,) int; -1 allowed on soft rows
    soft: np.ndarray  # (n,) bool
    family_codes: np.ndarray | None  # (n,) int index into family_names, or None
    family_names: tuple[str, ...] = ()

    @property
    def n(self) -> int:
        return int(self.probs.shape[0])

    def take(self, idx: np.ndarray) -> "_Batch":
        return _Batch(
            probs=self.probs[idx],
            target=self.target[idx],
            n_options=self.n_options[idx],
            labels=self.labels[idx],
            soft=self.soft[idx],
            family_codes=None if self.family_codes is None else self.family_codes[idx],
            family_names=self.family_names,
        )


def _check_simplex(flat: np.ndarray, offsets: np.ndarray, sizes: np.ndarray, what: str) -> None:
    """Raise unless every segment of ``flat`` is finite, non-negative and sums to 1."""
    if not np.all(np.isfinite(flat)):
        row = int(np.searchsorted(offsets, np.flatnonzero(~np.isfinite(flat))[0], side="right") - 1)
        raise ValueError(f"{what}[{row}] contains a non-finite value")
    if np.any(flat < 0):
        row = int(np.searchsorted(offsets, np.flatnonzero(flat < 0)[0], side="right") - 1)
        raise ValueError(f"{what}[{row}] contains a negative probability")
    sums = np.add.reduceat(flat, offsets) if flat.size else np.zeros(0)
    bad = np.flatnonzero(np.abs(sums - 1.0) > PROB_SUM_TOLERANCE)
    if bad.size:
        row = int(bad[0])
        raise ValueError(
            f"{what}[{row}] sums to {sums[row]:.6f}, not 1 (tolerance {PROB_SUM_TOLERANCE}); "
            f"{bad.size} of {sizes.size} vectors are not normalised"
        )


def _as_1d_arrays(values: Sequence[Any], what: str) -> list[np.ndarray]:
    arrays = []
    for i, value in enumerate(values):
        arr = np.asarray(value, dtype=np.float64)
        if arr.ndim != 1 or arr.size == 0:
            raise ValueError(f"{what}[{i}] must be a non-empty 1-D array, got shape {arr.shape}")
        arrays.append(arr)
    return arrays


def _as_labels(labels: Sequence[int], n: int, what: str = "labels") -> np.ndarray:
    if len(labels) != n:
        raise ValueError(f"length mismatch: {n} probability vectors but {len(labels)} {what}")
    raw = np.asarray(labels)
    if raw.ndim != 1 or raw.dtype.kind not in "iu":
        raise ValueError(f"{what} must be a 1-D sequence of integers (option indices), got dtype {raw.dtype}")
    return raw.astype(np.int64)


def _as_strings(values: Sequence[str] | None, n: int, what: str) -> np.ndarray | None:
    if values is None:
        return None
    if len(values) != n:
        raise ValueError(f"length mismatch: {n} probability vectors but {len(values)} {what}")
    out = np.empty(n, dtype=object)
    for i, value in enumerate(values):
        if not isinstance(value, str):
            raise ValueError(f"{what}[{i}] must be a string, got {type(value).__name__}")
        out[i] = value
    return out


def _check_qtypes(qtypes: Sequence[str] | None, n: int) -> np.ndarray | None:
    arr = _as_strings(qtypes, n, "qtypes")
    if arr is not None:
        bad = sorted({q for q in arr if q not in QUESTION_TYPES})
        if bad:
            raise ValueError(f"qtypes must be one of {', '.join(QUESTION_TYPES)}, got {bad!r}")
    return arr


def _pack(
    probs: Sequence[np.ndarray],
    labels: Sequence[int],
    soft_labels: SoftLabels | None = None,
    families: Sequence[str] | None = None,
    *,
    what: str = "probs",
) -> _Batch:
    """Validate ragged predictions and pad them into a :class:`_Batch`."""
    n = len(probs)
    if n == 0:
        raise ValueError(f"empty input: {what} holds no questions")
    arrays = _as_1d_arrays(probs, what)
    lab = _as_labels(labels, n)
    sizes = np.fromiter((a.size for a in arrays), dtype=np.int64, count=n)
    offsets = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    flat = np.concatenate(arrays)
    _check_simplex(flat, offsets, sizes, what)

    soft = np.zeros(n, dtype=bool)
    flat_target = np.zeros_like(flat)
    if soft_labels is not None:
        if len(soft_labels) != n:
            raise ValueError(f"length mismatch: {n} probability vectors but {len(soft_labels)} soft_labels")
        for i, target in enumerate(soft_labels):
            if target is None:
                continue
            arr = np.asarray(target, dtype=np.float64)
            if arr.shape != (sizes[i],):
                raise ValueError(
                    f"soft_labels[{i}] has shape {arr.shape} but the question has {sizes[i]} options"
                )
            _check_simplex(arr, np.array([0]), np.array([arr.size]), f"soft_labels[{i}]")
            soft[i] = True
            flat_target[offsets[i] : offsets[i] + sizes[i]] = arr

    hard = ~soft
    out_of_range = hard & ((lab < 0) | (lab >= sizes))
    out_of_range |= soft & ((lab < -1) | (lab >= sizes))
    if out_of_range.any():
        i = int(np.flatnonzero(out_of_range)[0])
        raise ValueError(
            f"labels[{i}] = {lab[i]} is out of range for a question with {sizes[i]} options "
            f"(allowed 0..{sizes[i] - 1}{', or -1 on a soft-labelled question' if soft[i] else ''})"
        )
    flat_target[offsets[hard] + lab[hard]] = 1.0  # one-hot for hard-labelled questions

    width = int(sizes.max())
    mask = np.arange(width)[None, :] < sizes[:, None]
    padded = np.zeros((n, width))
    padded[mask] = flat  # row-major boolean fill keeps each question's options in order
    target = np.zeros((n, width))
    target[mask] = flat_target
    family_array = _as_strings(families, n, "families")
    family_names: tuple[str, ...] = ()
    family_codes = None
    if family_array is not None:
        names, family_codes = np.unique(family_array.astype(str), return_inverse=True)
        family_names = tuple(str(x) for x in names)
    return _Batch(
        probs=padded,
        target=target,
        n_options=sizes,
        labels=lab,
        soft=soft,
        family_codes=family_codes,
        family_names=family_names,
    )


# --------------------------------------------------------------------------- core (packed) metrics


def _predictions(b: _Batch) -> np.ndarray:
    return np.argmax(b.probs, axis=1)


def _confidence(b: _Batch) -> np.ndarray:
    return b.probs.max(axis=1)


def _expected_correct(b: _Batch) -> np.ndarray:
    # target[i, argmax_i]: 1/0 for a hard label (argmax == label), the target
    # probability of the chosen option for a soft label.
    return b.target[np.arange(b.n), _predictions(b)]


def _accuracy(b: _Batch) -> float:
    hard = ~b.soft
    if not hard.any():
        return math.nan
    return float(np.mean(_predictions(b)[hard] == b.labels[hard]))


def _per_family_accuracy(b: _Batch) -> dict[str, float]:
    if b.family_codes is None:
        raise ValueError("families are required for per-family / family-macro accuracy")
    size = len(b.family_names)
    hard = ~b.soft
    present = np.bincount(b.family_codes, minlength=size)
    n_hard = np.bincount(b.family_codes[hard], minlength=size)
    n_right = np.bincount(b.family_codes[hard], weights=_predictions(b)[hard] == b.labels[hard], minlength=size)
    # families absent from this (sub)set are left out; present but all-soft -> nan
    return {
        name: float(n_right[k] / n_hard[k]) if n_hard[k] else math.nan
        for k, name in enumerate(b.family_names)
        if present[k]
    }


def _family_macro_accuracy(b: _Batch) -> float:
    values = [v for v in _per_family_accuracy(b).values() if not math.isnan(v)]
    return float(np.mean(values)) if values else math.nan


def _brier(b: _Batch) -> float:
    # mean_i sum_k (p_ik - y_ik)^2 ; padding adds (0 - 0)^2 = 0
    return float(np.mean(np.sum((b.probs - b.target) ** 2, axis=1)))


def _nll(b: _Batch) -> float:
    # mean_i -sum_k y_ik log max(p_ik, 1e-12) ; padding has y = 0
    logp = np.log(np.clip(b.probs, NLL_CLIP, 1.0))
    return float(np.mean(-np.sum(b.target * logp, axis=1)))


def _ece(b: _Batch, n_bins: int = DEFAULT_ECE_BINS) -> float:
    if n_bins < 1:
        raise ValueError(f"n_bins must be >= 1, got {n_bins}")
    conf = _confidence(b)
    correct = _expected_correct(b)
    # Bins (0, 1/B], (1/B, 2/B], ..., ((B-1)/B, 1]: a confidence on an inner
    # edge falls in the lower bin (searchsorted 'left' counts edges < conf).
    inner_edges = np.linspace(0.0, 1.0, n_bins + 1)[1:-1]
    bins = np.searchsorted(inner_edges, conf, side="left")
    conf_sum = np.bincount(bins, weights=conf, minlength=n_bins)
    acc_sum = np.bincount(bins, weights=correct, minlength=n_bins)
    # sum_b (n_b / N) |acc_b - conf_b| = sum_b |acc_sum_b - conf_sum_b| / N
    return float(np.sum(np.abs(acc_sum - conf_sum)) / b.n)


def _risk_groups(b: _Batch) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Tie groups of the hard-labelled questions, most confident first.

    Returns ``(group_conf, covered, errors, n)``: for each tie group ``g`` its
    confidence, the number of questions accepted once ``g`` is in
    (cumulative), the errors among them (cumulative), and ``n`` the number of
    hard-labelled questions.
    """
    hard = ~b.soft
    conf = _confidence(b)[hard]
    wrong = (_predictions(b)[hard] != b.labels[hard]).astype(np.float64)
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


def _last_admissible_group(b: _Batch, budget: float) -> tuple[int | None, np.ndarray, np.ndarray, int]:
    _check_budget(budget)
    group_conf, covered, errors, n = _risk_groups(b)
    admissible = np.flatnonzero(errors <= budget * covered + _BUDGET_SLACK)
    # Risk is not monotone in coverage: take the *largest* admissible prefix,
    # not the first one before a violation. Coverage grows with the group index.
    last = int(admissible[-1]) if admissible.size else None
    return last, group_conf, covered, n


def _coverage(b: _Batch, budget: float = DEFAULT_ERROR_BUDGET) -> float:
    last, _, covered, n = _last_admissible_group(b, budget)
    if n == 0:
        return math.nan
    return 0.0 if last is None else float(covered[last] / n)


def _threshold(b: _Batch, budget: float = DEFAULT_ERROR_BUDGET) -> float:
    last, group_conf, _, _ = _last_admissible_group(b, budget)
    return math.inf if last is None else float(group_conf[last])


def _aurc(b: _Batch) -> float:
    _, covered, errors, n = _risk_groups(b)
    if n == 0:
        return math.nan
    sizes = np.diff(np.r_[0, covered])  # m_g, questions entering with group g
    # AURC = sum_g (m_g / N) * (e_g / n_g)
    return float(np.sum(sizes * errors / covered) / n)


def _fnr(b: _Batch, positive_index: int = NOUL_POSITIVE_INDEX) -> float:
    hard = ~b.soft
    if np.any(positive_index >= b.n_options) or positive_index < 0:
        raise ValueError(f"positive_index {positive_index} is out of range for some question's options")
    positives = hard & (b.labels == positive_index)
    if not positives.any():
        return math.nan
    false_negatives = positives & (_predictions(b) != positive_index)
    return float(false_negatives.sum() / positives.sum())  # FN / (TP + FN)


def _safety_fnr(
    b: _Batch,
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
    return _accuracy(_pack(probs, labels, soft_labels))


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
    return _per_family_accuracy(_pack(probs, labels, soft_labels, families))


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
    return _family_macro_accuracy(_pack(probs, labels, soft_labels, families))


def brier(probs: Sequence[np.ndarray], labels: Sequence[int], soft_labels: SoftLabels | None = None) -> float:
    """Multi-class Brier score, summed over options: ``mean_i sum_k (p_ik - y_ik)^2``.

    ``y_i`` is one-hot on the label, or the soft label when given. Range [0, 2].
    """
    return _brier(_pack(probs, labels, soft_labels))


def nll(probs: Sequence[np.ndarray], labels: Sequence[int], soft_labels: SoftLabels | None = None) -> float:
    """Negative log-likelihood ``mean_i -sum_k y_ik log p_ik`` (nats), ``p`` clipped at 1e-12.

    With a soft target this is the cross-entropy against it.
    """
    return _nll(_pack(probs, labels, soft_labels))


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
    return _ece(_pack(probs, labels, soft_labels), n_bins)


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
    return _coverage(_pack(probs, labels, soft_labels), budget)


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
    return _threshold(_pack(probs, labels, soft_labels), budget)


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
    return _aurc(_pack(probs, labels, soft_labels))


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
    return _fnr(_pack(probs, labels, soft_labels), positive_index)


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
    b = _pack(probs, labels, soft_labels, families)
    return _safety_fnr(b, safety_families, _check_qtypes(qtypes, b.n), positive_index)


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
    b = _pack(probs, labels, soft_labels, families)
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
        says_false = _predictions(b.take(rows)) == NOUL_NEGATIVE_INDEX
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
    b = _pack(probs, labels, soft_labels, families)
    qt = _check_qtypes(qtypes, b.n)
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


# --------------------------------------------------------------------------- paired deltas


@dataclass(frozen=True)
class PairedDelta:
    """``metric(b) - metric(a)`` on the same questions, with a record-clustered bootstrap CI."""

    metric: str
    delta: float
    ci_low: float
    ci_high: float
    n_clusters: int
    n_questions: int
    confidence_level: float
    #: Standard error of the delta: the standard deviation of its bootstrap distribution (0 when the
    #: distribution is degenerate; ``nan`` when undefined). A power analysis reads it (``minimum_detectable_effect``).
    se: float = math.nan


#: Metrics ``paired_delta`` accepts by name.
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


# --- Decomposable metrics: a resample's value follows from per-record sums, so the bootstrap runs
# vectorized (a (resamples x records) count matrix times the records' sums) instead of one Python call
# per resample. Each function gives per-question columns and the finish that turns summed columns
# into the metric, exactly as the packed implementation computes it.
_Columns = tuple[np.ndarray, Callable[[np.ndarray], np.ndarray]]


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan)


def _cols_accuracy(b: _Batch) -> _Columns:
    hard = ~b.soft
    cols = np.stack([hard & (_predictions(b) == b.labels), hard], axis=1).astype(np.float64)
    return cols, lambda S: _ratio(S[:, 0], S[:, 1])


def _cols_mean(values: np.ndarray) -> _Columns:
    cols = np.stack([values, np.ones_like(values)], axis=1)
    return cols, lambda S: S[:, 0] / S[:, 1]


def _cols_brier(b: _Batch) -> _Columns:
    return _cols_mean(np.sum((b.probs - b.target) ** 2, axis=1))


def _cols_nll(b: _Batch) -> _Columns:
    return _cols_mean(-np.sum(b.target * np.log(np.clip(b.probs, NLL_CLIP, 1.0)), axis=1))


def _cols_family_macro(b: _Batch) -> _Columns:
    if b.family_codes is None:
        raise ValueError("families are required for per-family / family-macro accuracy")
    size = len(b.family_names)
    hard = ~b.soft
    right = hard & (_predictions(b) == b.labels)
    cols = np.zeros((b.n, 2 * size))
    cols[np.arange(b.n), b.family_codes] = right
    cols[np.arange(b.n), size + b.family_codes] = hard

    def finish(S: np.ndarray) -> np.ndarray:
        acc = _ratio(S[:, :size], S[:, size:])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # a resample with no hard question: nan
            return np.nanmean(acc, axis=1)

    return cols, finish


def _cols_fnr(b: _Batch) -> _Columns:
    positives = ~b.soft & (b.labels == NOUL_POSITIVE_INDEX)
    missed = positives & (_predictions(b) != NOUL_POSITIVE_INDEX)
    cols = np.stack([missed, positives], axis=1).astype(np.float64)
    return cols, lambda S: _ratio(S[:, 0], S[:, 1])


def _cols_ece(b: _Batch, n_bins: int = DEFAULT_ECE_BINS) -> _Columns:
    conf, correct = _confidence(b), _expected_correct(b)
    bins = np.searchsorted(np.linspace(0.0, 1.0, n_bins + 1)[1:-1], conf, side="left")
    cols = np.zeros((b.n, n_bins + 1))
    cols[np.arange(b.n), bins] = correct - conf  # per bin: acc_sum - conf_sum
    cols[:, n_bins] = 1.0
    return cols, lambda S: np.sum(np.abs(S[:, :n_bins]), axis=1) / S[:, n_bins]


_COLUMNS: dict[Callable[..., float], Callable[..., _Columns]] = {
    accuracy: _cols_accuracy,
    family_macro_accuracy: _cols_family_macro,
    brier: _cols_brier,
    nll: _cols_nll,
    ece: _cols_ece,
    false_negative_rate: _cols_fnr,
}


def _columns_impl(metric_fn: Callable[..., float]) -> Callable[[_Batch], _Columns] | None:
    if metric_fn in _COLUMNS:
        return _COLUMNS[metric_fn]
    if (isinstance(metric_fn, functools.partial) and metric_fn.func is ece and not metric_fn.args
            and set(metric_fn.keywords) <= {"n_bins"}):
        return functools.partial(_cols_ece, **metric_fn.keywords)
    return None


def _packed_impl(metric_fn: Callable[..., float]) -> Callable[[_Batch], float] | None:
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


def _accepts(fn: Callable[..., Any], name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # builtins without a signature: assume yes
        return True
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _metric_name(metric_fn: Callable[..., float]) -> str:
    if isinstance(metric_fn, functools.partial):
        keywords = ",".join(f"{k}={v}" for k, v in sorted(metric_fn.keywords.items()))
        return f"{_metric_name(metric_fn.func)}({keywords})" if keywords else _metric_name(metric_fn.func)
    return getattr(metric_fn, "__name__", type(metric_fn).__name__)


def paired_delta(
    metric_fn: Callable[..., float] | str,
    probs_a: Sequence[np.ndarray],
    probs_b: Sequence[np.ndarray],
    labels: Sequence[int],
    record_ids: Sequence[str],
    *,
    soft_labels: SoftLabels | None = None,
    families: Sequence[str] | None = None,
    qtypes: Sequence[str] | None = None,
    n_resamples: int = 2000,
    confidence_level: float = 0.95,
    seed: int = 0,
    method: str = "percentile",
) -> PairedDelta:
    """Paired difference ``metric(b) - metric(a)`` with a record-clustered bootstrap CI.

    Questions of one record share a state, so their errors are correlated; the
    bootstrap therefore resamples *records* (clusters) with replacement, takes
    every question of each drawn record, and recomputes the delta on both
    models' predictions for the same questions (``scipy.stats.bootstrap`` over
    the array of cluster indices, ``vectorized=False``).

    Args:
        metric_fn: A metric of this module (or its name in :data:`METRICS`, or
            a ``functools.partial`` of one), or any callable
            ``metric_fn(probs, labels, ...) -> float``; it receives
            ``soft_labels``, ``families`` and ``qtypes`` as keywords when it
            accepts them (soft labels it cannot take are an error).
        probs_a: Baseline predictions.
        probs_b: Candidate predictions, same questions and option counts.
        labels: True option per question.
        record_ids: Record (cluster) of each question.
        soft_labels: Optional soft targets, shared by both models.
        families: Family per question (needed by family metrics).
        qtypes: Question type per question (passed to custom metrics).
        n_resamples: Bootstrap resamples.
        confidence_level: Two-sided level of the CI.
        seed: Seed of the resampling generator (same seed, same CI).
        method: ``scipy.stats.bootstrap`` method. ``"percentile"`` by default
            because ``"BCa"`` needs a jackknife (one metric call per record).

    Returns:
        A :class:`PairedDelta`. When the bootstrap distribution is degenerate
        (every resample gives the same delta — identical models, a constant
        per-record gap, or a single record) the CI is the point delta at both
        ends, where scipy would give ``nan`` or warn. A CI that is ``nan``
        for another reason (a resample on which the metric is undefined) is
        kept ``nan``.
    """
    if isinstance(metric_fn, str):
        if metric_fn not in METRICS:
            raise ValueError(f"unknown metric {metric_fn!r}; known: {', '.join(METRICS)}")
        metric_fn = METRICS[metric_fn]
    if not 0.0 < confidence_level < 1.0:
        raise ValueError(f"confidence_level must be in (0, 1), got {confidence_level}")
    if n_resamples < 1:
        raise ValueError(f"n_resamples must be >= 1, got {n_resamples}")
    if len(probs_a) != len(probs_b):
        raise ValueError(f"length mismatch: {len(probs_a)} questions in probs_a but {len(probs_b)} in probs_b")
    batch_a = _pack(probs_a, labels, soft_labels, families, what="probs_a")
    batch_b = _pack(probs_b, labels, soft_labels, families, what="probs_b")
    if not np.array_equal(batch_a.n_options, batch_b.n_options):
        i = int(np.flatnonzero(batch_a.n_options != batch_b.n_options)[0])
        raise ValueError(
            f"probs_a[{i}] has {batch_a.n_options[i]} options but probs_b[{i}] has {batch_b.n_options[i]}"
        )
    n = batch_a.n
    if len(record_ids) != n:
        raise ValueError(f"length mismatch: {n} probability vectors but {len(record_ids)} record_ids")
    records = np.asarray([str(r) for r in record_ids], dtype=object)
    _check_qtypes(qtypes, n)  # validated here; custom metrics receive the sequence as given

    impl = _packed_impl(metric_fn)
    if impl is not None:

        def delta_on(idx: np.ndarray | None) -> float:
            if idx is None:
                return impl(batch_b) - impl(batch_a)
            return impl(batch_b.take(idx)) - impl(batch_a.take(idx))

    else:
        if soft_labels is not None and not _accepts(metric_fn, "soft_labels"):
            raise ValueError(f"{_metric_name(metric_fn)} does not accept soft_labels, but soft labels were given")
        list_a, list_b = list(probs_a), list(probs_b)
        list_labels = list(labels)
        extras: dict[str, Sequence[Any] | None] = {
            name: value
            for name, value in (("soft_labels", soft_labels), ("families", families), ("qtypes", qtypes))
            if value is not None and _accepts(metric_fn, name)
        }

        def delta_on(idx: np.ndarray | None) -> float:
            if idx is None:
                idx = np.arange(n)
            pick = [int(i) for i in idx]
            kwargs = {name: [value[i] for i in pick] for name, value in extras.items()}
            lab = [list_labels[i] for i in pick]
            value_b = metric_fn([list_b[i] for i in pick], lab, **kwargs)
            value_a = metric_fn([list_a[i] for i in pick], lab, **kwargs)
            return float(value_b) - float(value_a)

    point = float(delta_on(None))

    # Cluster layout, CSR style: the questions of cluster c are
    # order[starts[c] : starts[c] + counts[c]].
    _, inverse = np.unique(records, return_inverse=True)
    order = np.argsort(inverse, kind="stable")
    counts = np.bincount(inverse)
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    n_clusters = int(counts.size)

    def statistic(clusters: np.ndarray) -> float:
        clusters = np.asarray(clusters, dtype=np.int64)
        sizes = counts[clusters]
        # position of each gathered question inside its cluster: 0..size-1
        within = np.arange(sizes.sum()) - np.repeat(np.cumsum(sizes) - sizes, sizes)
        return delta_on(order[np.repeat(starts[clusters], sizes) + within])

    vectorized = False
    columns = _columns_impl(metric_fn) if impl is not None else None
    if columns is not None:
        # Per-record sums of each model's columns: a resample's value is (counts of each record drawn)
        # @ those sums, for a whole batch of resamples at once; the same resamples as the loop above.
        cols_a, finish_a = columns(batch_a)
        cols_b, finish_b = columns(batch_b)
        sums_a = np.zeros((n_clusters, cols_a.shape[1]))
        sums_b = np.zeros((n_clusters, cols_b.shape[1]))
        np.add.at(sums_a, inverse, cols_a)
        np.add.at(sums_b, inverse, cols_b)

        def statistic(clusters: np.ndarray, axis: int = -1) -> np.ndarray:  # type: ignore[misc]  # noqa: F811
            draws = np.asarray(clusters, dtype=np.int64)
            flat = draws.reshape(-1, draws.shape[-1])
            rows = np.repeat(np.arange(flat.shape[0]), flat.shape[1])
            drawn = np.zeros((flat.shape[0], n_clusters))
            np.add.at(drawn, (rows, flat.ravel()), 1.0)
            out = finish_b(drawn @ sums_b) - finish_a(drawn @ sums_a)
            return out.reshape(draws.shape[:-1])

        vectorized = True

    result = PairedDelta(
        metric=_metric_name(metric_fn),
        delta=point,
        ci_low=point,
        ci_high=point,
        n_clusters=n_clusters,
        n_questions=n,
        confidence_level=confidence_level,
        se=0.0 if math.isfinite(point) else math.nan,
    )
    if n_clusters < 2:  # one record: every resample is that record
        return result
    with warnings.catch_warnings():
        from scipy import stats  # imported here: scipy.stats costs ~1 s to import, and only the bootstrap needs it

        warnings.simplefilter("ignore", stats.DegenerateDataWarning)
        boot = stats.bootstrap(
            (np.arange(n_clusters),),
            statistic,
            n_resamples=n_resamples,
            batch=min(n_resamples, 256),  # bounds the (batch, n_clusters) index array
            vectorized=vectorized,
            confidence_level=confidence_level,
            method=method,
            rng=np.random.default_rng(seed),
        )
    distribution = np.asarray(boot.bootstrap_distribution, dtype=np.float64)
    if np.all(np.isfinite(distribution)) and np.ptp(distribution) == 0.0:
        return result
    return PairedDelta(
        metric=result.metric,
        delta=point,
        ci_low=float(boot.confidence_interval.low),
        ci_high=float(boot.confidence_interval.high),
        n_clusters=n_clusters,
        n_questions=n,
        confidence_level=confidence_level,
        se=float(np.std(distribution, ddof=1)) if np.all(np.isfinite(distribution)) else math.nan,
    )


#: The power a hypothesis's test is sized for: the chance that a true effect of the MDE is detected.
DEFAULT_POWER = 0.8


def minimum_detectable_effect(se: float, *, confidence_level: float = 0.95, power: float = DEFAULT_POWER,
                              bar: float = 0.0) -> float:
    """The smallest true paired effect the gate detects with ``power``: its CI clears zero and its gain the bar.

    A candidate is promoted when its observed delta ``d`` (≈ normal around the true effect, sd ``se``)
    clears both the bar and the lower end of the two-sided ``confidence_level`` CI above zero, i.e.
    ``d > T = max(bar, z_{1−α/2} · se)``; ``P(d > T) ≥ power`` holds from

        ``MDE = max(bar, z_{1−α/2} · se) + z_{power} · se``

    with ``α = 1 − confidence_level`` and ``se`` the standard error of the paired delta
    (:attr:`PairedDelta.se`). Without a bar (``bar = 0``) it is the textbook ``(z_{1−α/2} + z_{power}) · se``:
    ``2.80 · se`` at α = 0.05 and 80% power. A predicted effect below it is more likely missed than seen.

    Raises:
        ValueError: ``se`` or ``bar`` negative or not finite, or a level outside (0, 1).
    """
    if not 0.0 < confidence_level < 1.0:
        raise ValueError(f"confidence_level must be in (0, 1), got {confidence_level}")
    if not 0.0 < power < 1.0:
        raise ValueError(f"power must be in (0, 1), got {power}")
    if not (math.isfinite(se) and se >= 0.0):
        raise ValueError(f"se must be a finite number >= 0, got {se}")
    if not (math.isfinite(bar) and bar >= 0.0):
        raise ValueError(f"bar must be a finite number >= 0, got {bar}")
    from scipy import stats

    alpha = 1.0 - confidence_level
    return float(max(bar, stats.norm.ppf(1.0 - alpha / 2.0) * se) + stats.norm.ppf(power) * se)


__all__ = [
    "DEFAULT_ECE_BINS",
    "DEFAULT_ERROR_BUDGET",
    "DEFAULT_POWER",
    "METRICS",
    "NOUL_NEGATIVE_INDEX",
    "NOUL_POSITIVE_INDEX",
    "PairedDelta",
    "QUESTION_TYPES",
    "accuracy",
    "aurc",
    "brier",
    "coverage_at_error_budget",
    "coverage_key",
    "ece",
    "false_negative_rate",
    "family_macro_accuracy",
    "minimum_detectable_effect",
    "nll",
    "paired_delta",
    "per_family_accuracy",
    "safety_deferral",
    "safety_fnr",
    "summarize",
    "threshold_for_error_budget",
]
