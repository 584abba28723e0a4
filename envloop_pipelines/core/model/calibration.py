"""Calibration: one temperature per question type, and the automation threshold.

Both are fitted on val and ship inside the checkpoint (``to_dict`` /
``from_dict``). The temperature ``T`` of a question type rescales its logits,
``p = softmax(z / T)``, chosen to minimise the val NLL; ``T > 1`` softens an
over-confident model, ``T < 1`` sharpens an under-confident one. The
automation threshold is the confidence above which a decision is automated:
the one that keeps the val error rate of the automated questions within the
error budget (``core.metrics.point.threshold_for_error_budget``, after temperature
scaling). ``+inf`` means no threshold meets the budget: automate nothing.

A declared **safety family** (a noul question whose missed "true" is costly,
such as ``needs_approval``) gets its own threshold, fitted on val to a
false-negative-rate target (default 0.10): the model answers such a question
automatically only when its calibrated P("false") — "no approval needed" —
is at least the family's ``safety_thresholds`` value, the smallest value at
which the val positives answered automatically as "false" are at most the
target share of all val positives (:func:`safety_threshold`). Below it the
answer defers to a person. ``+inf`` (no val positive to fit on, or no
threshold meets the target) defers every question of the family.

Pure numpy + scipy: no Dagster, no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
from scipy import optimize, special

from envloop_pipelines.core.metrics.batch import (
    NOUL_NEGATIVE_INDEX,
    NOUL_POSITIVE_INDEX,
    PROB_SUM_TOLERANCE,
    QUESTION_TYPES,
)
from envloop_pipelines.core.metrics.point import DEFAULT_ERROR_BUDGET, threshold_for_error_budget

#: Search range of the temperature: wide enough for any sane model, bounded so
#: that perfectly separable val data cannot send T to 0.
TEMPERATURE_BOUNDS: tuple[float, float] = (0.05, 20.0)
#: The val false-negative rate a safety family's automation threshold is fitted to.
DEFAULT_SAFETY_FNR_TARGET = 0.10
#: The least safety threshold: just above 0.5, where "false" is the answer.
_ABOVE_HALF = float(np.nextafter(0.5, 1.0))


def softmax(logits: np.ndarray | Sequence[float], temperature: float = 1.0) -> np.ndarray:
    """Numerically stable softmax of ``logits / temperature`` over the last axis.

    Subtracting the max first keeps ``exp`` from overflowing (logits of 1000
    give 1, not nan).
    """
    if not temperature > 0 or not math.isfinite(temperature):
        raise ValueError(f"temperature must be a finite positive number, got {temperature}")
    z = np.asarray(logits, dtype=np.float64) / temperature
    if z.size == 0:
        raise ValueError("softmax of an empty logit vector")
    if not np.all(np.isfinite(z)):
        raise ValueError("logits must be finite")
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def _pad_logits(
    logits: Sequence[np.ndarray],
    labels: Sequence[int],
    soft_labels: Sequence[np.ndarray | None] | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pad ragged logits to ``(n, K)`` and build the targets.

    Returns ``(z, z_for_dot, target)``: ``z`` padded with ``-inf`` (no mass in
    the log-sum-exp), ``z_for_dot`` padded with 0 (so ``target * z`` is 0, not
    nan, in the padding), ``target`` one-hot or the soft label.
    """
    n = len(logits)
    if n == 0:
        raise ValueError("empty input: no logits to fit a temperature on")
    if len(labels) != n:
        raise ValueError(f"length mismatch: {n} logit vectors but {len(labels)} labels")
    if soft_labels is not None and len(soft_labels) != n:
        raise ValueError(f"length mismatch: {n} logit vectors but {len(soft_labels)} soft_labels")
    rows = [np.asarray(z, dtype=np.float64) for z in logits]
    for i, z in enumerate(rows):
        if z.ndim != 1 or z.size == 0:
            raise ValueError(f"logits[{i}] must be a non-empty 1-D array, got shape {z.shape}")
        if not np.all(np.isfinite(z)):
            raise ValueError(f"logits[{i}] contains a non-finite value")
    width = max(z.size for z in rows)
    z_pad = np.full((n, width), -np.inf)
    z_dot = np.zeros((n, width))
    target = np.zeros((n, width))
    for i, z in enumerate(rows):
        z_pad[i, : z.size] = z
        z_dot[i, : z.size] = z
        soft = None if soft_labels is None else soft_labels[i]
        if soft is not None:
            y = np.asarray(soft, dtype=np.float64)
            if y.shape != z.shape or np.any(y < 0) or abs(y.sum() - 1.0) > PROB_SUM_TOLERANCE:
                raise ValueError(f"soft_labels[{i}] must be a probability vector over the {z.size} options")
            target[i, : z.size] = y
        else:
            label = labels[i]
            if isinstance(label, bool) or not isinstance(label, (int, np.integer)) or not 0 <= label < z.size:
                raise ValueError(f"labels[{i}] = {label!r} is not an option index in 0..{z.size - 1}")
            target[i, int(label)] = 1.0
    return z_pad, z_dot, target


def _mean_nll(beta: float, z_pad: np.ndarray, z_dot: np.ndarray, target: np.ndarray) -> float:
    # -sum_k y_k log softmax(beta z)_k = logsumexp(beta z) - beta sum_k y_k z_k   (sum_k y_k = 1)
    return float(np.mean(special.logsumexp(beta * z_pad, axis=1) - beta * np.sum(target * z_dot, axis=1)))


def fit_temperature(
    logits: Sequence[np.ndarray],
    labels: Sequence[int],
    soft_labels: Sequence[np.ndarray | None] | None = None,
    *,
    bounds: tuple[float, float] = TEMPERATURE_BOUNDS,
) -> float:
    """The temperature ``T`` minimising the mean NLL of ``softmax(logits / T)``.

    The search runs over ``log T`` (bounded Brent, ``scipy.optimize.minimize_scalar``):
    the NLL is convex in ``1/T``, hence unimodal in ``log T``.

    Args:
        logits: One logit vector per question (ragged).
        labels: True option per question (ignored where a soft label is given).
        soft_labels: Optional soft target per question (``None`` for hard).
        bounds: ``(T_min, T_max)``.

    Returns:
        The fitted temperature, within ``bounds``.
    """
    low, high = bounds
    if not 0 < low < high or not math.isfinite(high):
        raise ValueError(f"temperature bounds must satisfy 0 < low < high < inf, got {bounds}")
    z_pad, z_dot, target = _pad_logits(logits, labels, soft_labels)
    result = optimize.minimize_scalar(
        lambda log_t: _mean_nll(math.exp(-log_t), z_pad, z_dot, target),
        bounds=(math.log(low), math.log(high)),
        method="bounded",
        options={"xatol": 1e-6},
    )
    return float(min(max(math.exp(result.x), low), high))


def safety_threshold(p_negative: Sequence[float], positive: Sequence[bool],
                     fnr_target: float = DEFAULT_SAFETY_FNR_TARGET) -> float:
    """The smallest automation threshold on P("false") that keeps the false-negative rate within ``fnr_target``.

    A question is answered automatically as "false" only when ``p_negative >= threshold``; the rest
    defer to a person. A false negative is then a positive (true answer "true") answered
    automatically, so ``FNR(t) = #{positives with p_negative >= t} / #positives``, which falls as
    ``t`` rises. The threshold is chosen just above the ``k``-th largest ``p_negative`` among the
    positives, ``k = floor(fnr_target · #positives)``, so that at most ``k`` positives clear it;
    questions with exactly equal ``p_negative`` are kept or deferred together (tie-aware). It is
    never at or below 0.5, so only answers of "false" are ever automated.

    Args:
        p_negative: calibrated P("false") per question of the family.
        positive: whether each question's true answer is "true".
        fnr_target: the largest acceptable FNR, in [0, 1).

    Returns:
        The threshold in (0, 1], or ``+inf`` when there is no positive to fit on (defer everything).
    """
    if not 0.0 <= fnr_target < 1.0:
        raise ValueError(f"fnr_target must be in [0, 1), got {fnr_target}")
    p = np.asarray(p_negative, dtype=np.float64)
    pos = np.asarray(positive, dtype=bool)
    if p.shape != pos.shape or p.ndim != 1:
        raise ValueError(f"length mismatch: {p.size} probabilities but {pos.size} positive flags")
    if not np.all(np.isfinite(p)) or np.any(p < 0) or np.any(p > 1):
        raise ValueError("p_negative must be probabilities in [0, 1]")
    scores = np.sort(p[pos])[::-1]  # positives, most confidently "false" first
    if scores.size == 0:
        return math.inf
    k = int(math.floor(fnr_target * scores.size + 1e-12))  # positives allowed through
    # Just above the (k+1)-th largest: the k largest (and no tie of the (k+1)-th) clear it. Never at or
    # under 0.5: an automated answer is then always "false" (an exact tie answers "true"), so every
    # positive that clears it is a false negative and "true" (ask a person) always goes to a person.
    return float(max(np.nextafter(scores[k], math.inf), _ABOVE_HALF))


#: Why an answer defers (``x_defer_reason`` in a served answer).
DEFER_SAFETY = "safety"
DEFER_CONFIDENCE = "confidence"


def defer_reason(probs: np.ndarray | Sequence[float], automation_threshold: float,
                 safety_threshold: float | None = None) -> str | None:
    """Why an answer goes to a person, or ``None`` when code may act on it.

    (A fitted safety threshold is above 0.5, so an answer automated under it is always "false".)

    ``"safety"``: the question is of a declared safety family (``safety_threshold`` given) and its
    calibrated P("false") is under that family's threshold. ``"confidence"``: its top probability is
    under the automation threshold (fitted for the error budget). The safety test comes first.
    """
    p = np.asarray(probs, dtype=np.float64)
    if safety_threshold is not None:
        if p.size != 2:
            raise ValueError(f"a safety family's question must be noul (2 options), got {p.size} options")
        if not p[NOUL_NEGATIVE_INDEX] >= safety_threshold:
            return DEFER_SAFETY
    if not float(np.max(p)) >= automation_threshold:
        return DEFER_CONFIDENCE
    return None


@dataclass(frozen=True)
class Calibration:
    """Per-question-type temperatures and the automation threshold, fitted on val.

    Attributes:
        temperatures: One temperature per question type; a type not given
            gets 1.0 (the model's own logits).
        automation_threshold: Automate a decision when its calibrated
            confidence (max probability) is ``>=`` this; ``+inf`` automates nothing.
        error_budget: The val error rate the threshold was fitted for.
        safety_thresholds: Per declared safety family, the least calibrated P("false") at which
            one of its questions is answered automatically (:func:`safety_threshold`); ``+inf``
            defers all of them. Empty when no safety family was declared.
        safety_fnr_target: The val false-negative rate the safety thresholds were fitted for.
    """

    temperatures: Mapping[str, float] = field(default_factory=dict)
    automation_threshold: float = math.inf
    error_budget: float = DEFAULT_ERROR_BUDGET
    safety_thresholds: Mapping[str, float] = field(default_factory=dict)
    safety_fnr_target: float = DEFAULT_SAFETY_FNR_TARGET

    def __post_init__(self) -> None:
        unknown = sorted(set(self.temperatures) - set(QUESTION_TYPES))
        if unknown:
            raise ValueError(f"temperatures: unknown question types {unknown!r}; allowed: {', '.join(QUESTION_TYPES)}")
        full: dict[str, float] = {}
        for qtype in QUESTION_TYPES:
            value = float(self.temperatures.get(qtype, 1.0))
            if not value > 0 or not math.isfinite(value):
                raise ValueError(f"temperatures[{qtype!r}] must be a finite positive number, got {value}")
            full[qtype] = value
        object.__setattr__(self, "temperatures", full)
        threshold = float(self.automation_threshold)
        if math.isnan(threshold):
            raise ValueError("automation_threshold must be a number or +inf, got nan")
        object.__setattr__(self, "automation_threshold", threshold)
        if not 0.0 <= self.error_budget <= 1.0:
            raise ValueError(f"error_budget must be in [0, 1], got {self.error_budget}")
        safety: dict[str, float] = {}
        for family, value in self.safety_thresholds.items():
            t = float(value)
            if math.isnan(t) or t < 0:
                raise ValueError(f"safety_thresholds[{family!r}] must be a probability or +inf, got {value}")
            safety[str(family)] = t
        object.__setattr__(self, "safety_thresholds", safety)
        if not 0.0 <= self.safety_fnr_target < 1.0:
            raise ValueError(f"safety_fnr_target must be in [0, 1), got {self.safety_fnr_target}")

    def temperature(self, qtype: str) -> float:
        """Temperature of ``qtype``."""
        if qtype not in self.temperatures:
            raise ValueError(f"unknown question type {qtype!r}; allowed: {', '.join(QUESTION_TYPES)}")
        return self.temperatures[qtype]

    def apply(self, logits: np.ndarray | Sequence[float], qtype: str) -> np.ndarray:
        """Calibrated probabilities ``softmax(logits / T[qtype])``."""
        return softmax(logits, self.temperature(qtype))

    def apply_all(self, logits: Sequence[np.ndarray], qtypes: Sequence[str]) -> list[np.ndarray]:
        """:meth:`apply` to each question of a ragged batch."""
        if len(logits) != len(qtypes):
            raise ValueError(f"length mismatch: {len(logits)} logit vectors but {len(qtypes)} qtypes")
        return [self.apply(z, q) for z, q in zip(logits, qtypes)]

    def automate(self, probs: np.ndarray | Sequence[float]) -> bool:
        """Whether a calibrated probability vector is confident enough to automate."""
        return bool(np.max(np.asarray(probs, dtype=np.float64)) >= self.automation_threshold)

    def deferral(self, probs: np.ndarray | Sequence[float], family: str | None = None) -> str | None:
        """Why an answer defers to a person (:func:`defer_reason` with this calibration's thresholds)."""
        return defer_reason(probs, self.automation_threshold,
                            None if family is None else self.safety_thresholds.get(family))

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form; an infinite threshold is written as ``null`` (strict JSON has no Infinity).

        The safety keys are written only when a safety family was declared, so a calibration without
        one serialises (and hashes, inside a checkpoint) as before they existed.
        """
        threshold = self.automation_threshold
        out: dict[str, Any] = {
            "temperatures": dict(self.temperatures),
            "automation_threshold": None if math.isinf(threshold) else threshold,
            "error_budget": self.error_budget,
        }
        if self.safety_thresholds:
            out["safety_thresholds"] = {f: None if math.isinf(t) else t for f, t in self.safety_thresholds.items()}
            out["safety_fnr_target"] = self.safety_fnr_target
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Calibration":
        """Inverse of :meth:`to_dict` (``null`` threshold → ``+inf``)."""
        unknown = sorted(set(data) - {"temperatures", "automation_threshold", "error_budget", "safety_thresholds",
                                      "safety_fnr_target"})
        if unknown:
            raise ValueError(f"calibration: unknown keys {unknown!r}")
        if "temperatures" not in data or not isinstance(data["temperatures"], Mapping):
            raise ValueError("calibration: 'temperatures' must be a mapping of question type to temperature")
        threshold = data.get("automation_threshold")
        safety = data.get("safety_thresholds") or {}
        if not isinstance(safety, Mapping):
            raise ValueError("calibration: 'safety_thresholds' must be a mapping of family to threshold")
        return cls(
            temperatures={str(k): float(v) for k, v in data["temperatures"].items()},
            automation_threshold=math.inf if threshold is None else float(threshold),
            error_budget=float(data.get("error_budget", DEFAULT_ERROR_BUDGET)),
            safety_thresholds={str(f): math.inf if t is None else float(t) for f, t in safety.items()},
            safety_fnr_target=float(data.get("safety_fnr_target", DEFAULT_SAFETY_FNR_TARGET)),
        )


def fit_calibration(
    logits: Sequence[np.ndarray],
    labels: Sequence[int],
    qtypes: Sequence[str],
    soft_labels: Sequence[np.ndarray | None] | None = None,
    error_budget: float = DEFAULT_ERROR_BUDGET,
    *,
    families: Sequence[str] | None = None,
    safety_families: Sequence[str] = (),
    safety_fnr_target: float = DEFAULT_SAFETY_FNR_TARGET,
) -> Calibration:
    """Fit one temperature per question type, then the automation threshold, on val.

    Args:
        logits: Val logits per question (ragged).
        labels: True option per question.
        qtypes: Question type per question (``noul`` / ``choice`` / ``score``).
        soft_labels: Optional soft targets (they count in the temperature fit,
            not in the threshold).
        error_budget: Largest acceptable val error rate among automated questions.
        families: Family per question (needed when ``safety_families`` are declared).
        safety_families: Declared safety families: each present in val gets a threshold on its
            calibrated P("false") for ``safety_fnr_target`` (:func:`safety_threshold`). Their
            questions must be noul.
        safety_fnr_target: The val false-negative rate the safety thresholds are fitted for.

    Returns:
        A :class:`Calibration`; a type absent from val keeps temperature 1.0, a safety family absent
        from val gets no threshold.
    """
    n = len(logits)
    if n == 0:
        raise ValueError("empty input: no val questions to calibrate on")
    for what, seq in (("labels", labels), ("qtypes", qtypes)):
        if len(seq) != n:
            raise ValueError(f"length mismatch: {n} logit vectors but {len(seq)} {what}")
    if soft_labels is not None and len(soft_labels) != n:
        raise ValueError(f"length mismatch: {n} logit vectors but {len(soft_labels)} soft_labels")
    bad = sorted({q for q in qtypes if q not in QUESTION_TYPES})
    if bad:
        raise ValueError(f"qtypes must be one of {', '.join(QUESTION_TYPES)}, got {bad!r}")

    temperatures: dict[str, float] = {}
    for qtype in QUESTION_TYPES:
        rows = [i for i, q in enumerate(qtypes) if q == qtype]
        if rows:
            temperatures[qtype] = fit_temperature(
                [logits[i] for i in rows],
                [labels[i] for i in rows],
                None if soft_labels is None else [soft_labels[i] for i in rows],
            )
    scaled = Calibration(temperatures=temperatures, error_budget=error_budget)
    probs = scaled.apply_all(logits, qtypes)
    threshold = threshold_for_error_budget(probs, labels, soft_labels, budget=error_budget)
    safety: dict[str, float] = {}
    if safety_families:
        if isinstance(safety_families, str):
            raise ValueError(f"safety_families must be a sequence of family names, got the string {safety_families!r}")
        if families is None or len(families) != n:
            raise ValueError("families (one per question) are required to fit safety thresholds")
        for family in safety_families:
            rows = [i for i, f in enumerate(families) if f == family
                    and (soft_labels is None or soft_labels[i] is None)]
            if not rows:
                continue
            kinds = sorted({qtypes[i] for i in rows} - {"noul"})
            if kinds:
                raise ValueError(f"safety family {family!r} must hold only noul questions, found {kinds!r}")
            safety[family] = safety_threshold([float(probs[i][NOUL_NEGATIVE_INDEX]) for i in rows],
                                              [labels[i] == NOUL_POSITIVE_INDEX for i in rows],
                                              safety_fnr_target)
    return Calibration(temperatures=temperatures, automation_threshold=threshold, error_budget=error_budget,
                       safety_thresholds=safety, safety_fnr_target=safety_fnr_target)


__all__ = ["Calibration", "DEFAULT_SAFETY_FNR_TARGET", "DEFER_CONFIDENCE", "DEFER_SAFETY", "TEMPERATURE_BOUNDS", "fit_calibration",
           "defer_reason", "fit_temperature", "safety_threshold", "softmax"]
