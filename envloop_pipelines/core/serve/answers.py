"""Calibrated probabilities → Jev answers (``docs/jev-api.md``, "Response").

* noul: ``{"type": "noul", "noul": P(true)}``; of the Jev fields it carries only ``noul``.
* choice: ``choice`` = the argmax of ``probabilities`` (the first option on an
  exact tie), probabilities keyed exactly by option, and TypeSafe's confidence
  ``(p_max − 1/K) / (1 − 1/K)``: 0 for a uniform answer, 1 for a certain one.
* score: ``score`` = Σ i·pᵢ over zero-based levels, ``legend`` echoes the levels
  as sent, probabilities keyed by level index as a string, and the confidence
  ``max(0, 1 − Σ pᵢ·|i − mode| / MAD_uniform)`` with ``mode`` the most probable
  level (the lowest on an exact tie) and ``MAD_uniform`` the mean absolute
  deviation of the uniform distribution over the K levels, ``Σ (1/K)·|i − (K−1)/2|``
  (about its own centre; it depends on K only). A flat or nearly flat answer
  therefore gets 0 wherever its mode falls: its spread about any level is at
  least the uniform's MAD. Worked example (the contract's): p = (0, 0.95, 0.05),
  mode 1, Σ pᵢ|i−1| = 0.05, MAD_uniform = (1 + 0 + 1)/3 = 0.667, confidence =
  1 − 0.075 = 0.925. (Taking MAD_uniform about the mode instead, as this module
  once did, gives a tilted flat 10-level answer a confidence near 0.1.)

Fields we add carry an ``x_`` prefix, on every answer type:

* ``x_defer``: the release's automation decision. ``False`` when the answer's
  calibrated top probability reaches the checkpoint's automation threshold
  (fitted on val for its error budget), so a client may act on it; ``True``
  means hand it to a person. (The threshold is on the top probability, as it
  was fitted, not on the TypeSafe confidence above.) A noul question keyed by
  a declared safety family (``needs_approval`` by default; as in the data
  format, a question's family is its key) must also clear that family's
  threshold on P("false"), fitted on val for a false-negative-rate target:
  below it the answer defers, whatever its confidence.
* ``x_defer_reason`` (only when ``x_defer``): ``"safety"`` (a safety family's
  P("false") under its threshold) or ``"confidence"`` (the top probability
  under the automation threshold); :func:`~envloop_pipelines.core.model.calibration.defer_reason`.
* ``x_truncated``: the state did not fit the model's window, so part of it was
  not read (the readout says which part); the answer is still given, and says so.
* ``x_option_windows`` (only when > 1): the options did not fit the model's
  window with room for the state, so they were read in that many windows of
  consecutive options, all with the same instructions and state; the logits
  of all windows share one softmax (an approximation: each option sees only
  its window's neighbours).

The response carries ``x_automation_threshold`` (null when no threshold meets
the error budget: then every answer defers), ``x_safety_thresholds`` (only
when the checkpoint declares safety families: family → threshold on P("false"),
null where every answer of the family defers) and ``x_checkpoint_sha256``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from envloop_pipelines.core.model.calibration import defer_reason
from envloop_pipelines.core.serve.schemas import ServedQuestion


@dataclass(frozen=True)
class ModelAnswer:
    """What the model says about one question (before it becomes JSON).

    Attributes:
        probs: Calibrated probabilities, one per option, in the question's option order.
        truncated: Whether the state was cut to fit the model's window (in any window).
        n_state_tokens_dropped: The most state tokens dropped in any window.
        n_windows: How many windows of options the question was read in.
    """

    probs: np.ndarray
    truncated: bool = False
    n_state_tokens_dropped: int = 0
    n_windows: int = 1


def _checked(probs: Sequence[float] | np.ndarray) -> np.ndarray:
    p = np.asarray(probs, dtype=np.float64)
    if p.ndim != 1 or p.size < 2 or not np.all(np.isfinite(p)) or np.any(p < 0):
        raise ValueError(f"probabilities must be a finite, non-negative vector of ≥ 2 entries, got {p!r}")
    total = float(p.sum())
    if total <= 0:
        raise ValueError("probabilities sum to 0")
    return p / total


def choice_confidence(probs: Sequence[float] | np.ndarray) -> float:
    """TypeSafe's choice confidence ``(p_max − 1/K) / (1 − 1/K)``, clipped to [0, 1]."""
    p = _checked(probs)
    k = p.size
    return float(min(1.0, max(0.0, (float(p.max()) - 1.0 / k) / (1.0 - 1.0 / k))))


def uniform_mad(k: int) -> float:
    """The mean absolute deviation of the uniform distribution over levels ``0..k-1``: ``Σ (1/k)·|i − (k−1)/2|``.

    K = 2: 0.5; K = 3: 2/3; K = 10: 2.5 (closed form: ``(k² − (k mod 2)) / (4k)``).
    """
    if k < 2:
        raise ValueError(f"a score needs at least 2 levels, got {k}")
    idx = np.arange(k, dtype=np.float64)
    return float(np.mean(np.abs(idx - (k - 1) / 2.0)))


def score_confidence(probs: Sequence[float] | np.ndarray) -> float:
    """TypeSafe's score confidence ``max(0, 1 − Σ pᵢ·|i − mode| / MAD_uniform)``.

    ``mode`` is the most probable level (the lowest index on an exact tie) and ``MAD_uniform``
    is :func:`uniform_mad` of the number of levels.
    """
    p = _checked(probs)
    idx = np.arange(p.size, dtype=np.float64)
    mode = int(np.argmax(p))
    spread = float(np.sum(p * np.abs(idx - mode)))
    return float(min(1.0, max(0.0, 1.0 - spread / uniform_mad(p.size))))


def expected_score(probs: Sequence[float] | np.ndarray) -> float:
    """Σ i·pᵢ over zero-based levels."""
    p = _checked(probs)
    return float(np.dot(np.arange(p.size, dtype=np.float64), p))


def defers(probs: Sequence[float] | np.ndarray, automation_threshold: float) -> bool:
    """Whether an answer goes to a person: its top probability is under the automation threshold."""
    return not float(np.max(_checked(probs))) >= automation_threshold


def chosen_option(question: ServedQuestion, probs: Sequence[float] | np.ndarray) -> str:
    """The option key a chat completion answers with: the argmax (``"true"``/``"false"`` for noul, the level index for score)."""
    return question.option_keys[int(np.argmax(_checked(probs)))]


def jev_answer(question: ServedQuestion, answer: ModelAnswer, *, automation_threshold: float,
               safety_threshold: float | None = None) -> dict[str, Any]:
    """One answer in the contract's shape, plus its ``x_`` fields.

    ``safety_threshold``: the checkpoint's threshold on P("false") when the question is of a declared
    safety family (``None`` otherwise).
    """
    p = _checked(answer.probs)
    if p.size != len(question.option_keys):
        raise ValueError(f"question {question.id!r}: {p.size} probabilities for {len(question.option_keys)} options")
    values = [float(v) for v in p]
    out: dict[str, Any]
    if question.type == "noul":
        out = {"type": "noul", "noul": values[0]}  # NOUL_OPTIONS = ("true", "false"): index 0 is P(true)
    elif question.type == "choice":
        out = {
            "type": "choice",
            "choice": question.option_keys[int(np.argmax(p))],
            "probabilities": dict(zip(question.option_keys, values)),
            "confidence": choice_confidence(p),
        }
    elif question.type == "score":
        levels = question.levels if question.levels is not None else question.option_texts
        out = {
            "type": "score",
            "score": expected_score(p),
            "legend": {str(i): level for i, level in enumerate(levels)},
            "probabilities": {str(i): v for i, v in enumerate(values)},
            "confidence": score_confidence(p),
        }
    else:  # pragma: no cover - schemas only admit the three types
        raise ValueError(f"unknown question type {question.type!r}")
    reason = defer_reason(p, automation_threshold, safety_threshold)
    out["x_defer"] = reason is not None
    if reason is not None:
        out["x_defer_reason"] = reason
    out["x_truncated"] = bool(answer.truncated)
    if answer.n_windows > 1:
        out["x_option_windows"] = int(answer.n_windows)
    return out


def finite_or_none(value: float) -> float | None:
    """JSON-safe threshold: +inf (automate nothing) becomes null."""
    return float(value) if math.isfinite(value) else None


def option_logprobs(question: ServedQuestion, probs: Sequence[float] | np.ndarray, top: int | None) -> dict[str, Any]:
    """OpenAI ``choices[0].logprobs``: one content token (the chosen option) with the options as ``top_logprobs``.

    ``top=None`` lists every option; otherwise the ``top`` most probable, most probable first.
    A probability of exactly 0 is reported as log-probability -9999.0 (OpenAI's floor), keeping the JSON finite.
    """
    p = _checked(probs)

    def entry(i: int) -> dict[str, Any]:
        key = question.option_keys[i]
        return {"token": key, "logprob": math.log(p[i]) if p[i] > 0 else -9999.0, "bytes": list(key.encode("utf-8"))}

    order = sorted(range(p.size), key=lambda i: (-p[i], i))
    k = p.size if top is None else min(top, p.size)
    best = entry(order[0])
    best["top_logprobs"] = [entry(i) for i in order[:k]]
    return {"content": [best], "refusal": None}


__all__ = [
    "ModelAnswer",
    "choice_confidence",
    "chosen_option",
    "defers",
    "expected_score",
    "finite_or_none",
    "jev_answer",
    "option_logprobs",
    "score_confidence",
    "uniform_mad",
]
