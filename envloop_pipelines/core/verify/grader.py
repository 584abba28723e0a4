"""The model grader: a scoring model behind the verifier protocol.

Same file in, same report out as the rule verifier; the per-item score comes
from a :class:`ScoringModel` that sees the question's options, the reference
(the hidden label) and the candidate's answer: the ``answer`` column when the
predictions file has one (free text), else the chosen option key. The grader
runs in the verifier's sandboxed worker, so a grader model never shares a
process with the candidate.

A scoring model is named by an import path ``package.module:factory`` (the
factory returns a :class:`ScoringModel`), so the worker can build it in its own
process. :class:`TextMatchScorer` (``text_match``) is the built-in one: token F1
between the answer and the reference option, a deterministic baseline and the
one the tests use; a neural judge plugs in the same way.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np
import pyarrow as pa

from envloop_pipelines.core.verify.protocol import ItemScore, VerifierReport
from envloop_pipelines.core.verify.rule import build_report, failure, match

GRADER_VERIFIER_VERSION = "grader/1"
BUILTIN_SCORERS: dict[str, str] = {"text_match": "envloop_pipelines.core.verify.grader:TextMatchScorer"}


@dataclass(frozen=True)
class GradeRequest:
    """What a scoring model sees for one item (never the model under test, only its answer)."""

    record_id: str
    question_id: str
    option_keys: tuple[str, ...]
    reference: str | None  # the label's option key (None for a soft-labelled item)
    soft_label: tuple[float, ...] | None
    answer: str  # the free-text answer, or the chosen option key
    probs: tuple[float, ...] | None  # the candidate's probabilities in option order, when it gave them


@runtime_checkable
class ScoringModel(Protocol):
    """Scores answers in [0, 1]. ``name`` goes into the report's provenance."""

    name: str

    def grade(self, requests: Sequence[GradeRequest]) -> Sequence[float]:
        ...


_TOKEN = re.compile(r"[\w']+", re.UNICODE)


def _tokens(text: str) -> list[str]:
    return [t.lower() for t in _TOKEN.findall(text)]


class TextMatchScorer:
    """Token F1 between the answer and the reference option key (1.0 for an exact match).

    For a soft-labelled item, the soft label's mass on the option the answer names
    (0 when it names none).
    """

    name = "text_match/1"

    def grade(self, requests: Sequence[GradeRequest]) -> Sequence[float]:
        out = []
        for req in requests:
            answer = _tokens(req.answer)
            if req.soft_label is not None:
                named = [i for i, k in enumerate(req.option_keys) if _tokens(k) == answer]
                out.append(float(req.soft_label[named[0]]) if named else 0.0)
                continue
            reference = _tokens(req.reference or "")
            if not answer or not reference:
                out.append(0.0)
                continue
            common = sum(min(answer.count(t), reference.count(t)) for t in set(reference))
            if common == 0:
                out.append(0.0)
                continue
            precision, recall = common / len(answer), common / len(reference)
            out.append(2 * precision * recall / (precision + recall))
        return out


def load_scoring_model(spec: str) -> ScoringModel:
    """A scoring model from a built-in name or ``package.module:factory``.

    Raises:
        ValueError: when the spec is malformed or the factory does not give a :class:`ScoringModel`.
    """
    path = BUILTIN_SCORERS.get(spec, spec)
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"grader {spec!r} must be one of {sorted(BUILTIN_SCORERS)} or 'package.module:factory'")
    factory = getattr(importlib.import_module(module_name), attr)
    model = factory()
    if not isinstance(model, ScoringModel):
        raise ValueError(f"{path} returned {type(model).__name__}, which has no 'name' and 'grade(requests)'")
    return model


class ModelGrader:
    """Scores each item with a :class:`ScoringModel`; ``passed`` (``correct``) is score ≥ ``threshold``.

    Args:
        model: the scoring model, or its spec for :func:`load_scoring_model`.
        threshold: the score at which an item counts as correct.
    """

    kind = "grader"

    def __init__(self, model: ScoringModel | str = "text_match", *, threshold: float = 0.5) -> None:
        self.model = load_scoring_model(model) if isinstance(model, str) else model
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {threshold}")
        self.threshold = threshold

    def score(
        self, rows: Sequence[Mapping[str, Any]], labels: pa.Table, *, provenance: Mapping[str, Any] | None = None
    ) -> VerifierReport:
        matched = match(rows, labels)
        pending: list[tuple[int, GradeRequest]] = []
        scores: list[ItemScore | None] = []
        for n, (item, vec, error, status, answer) in enumerate(
            zip(matched.items, matched.probs, matched.errors, matched.status, matched.answers)
        ):
            if answer is not None and not isinstance(answer, str):
                status, error = "invalid", "answer must be a string"
            if status != "scored" or vec is None:
                scores.append(failure(item, status, error))
                continue
            chosen = item.option_keys[int(np.argmax(vec))]
            reference = item.option_keys[item.label] if item.hard and item.label is not None else None
            pending.append((n, GradeRequest(item.record_id, item.question_id, item.option_keys, reference,
                                            item.soft_label, answer if answer is not None else chosen,
                                            tuple(float(x) for x in vec))))
            scores.append(None)
        graded = list(self.model.grade([req for _, req in pending])) if pending else []
        if len(graded) != len(pending):
            raise RuntimeError(f"scoring model {self.model.name} returned {len(graded)} scores for {len(pending)} items")
        for (n, req), value in zip(pending, graded):
            item = matched.items[n]
            value = float(value)
            if not 0.0 <= value <= 1.0:
                scores[n] = failure(item, "invalid", f"scoring model returned {value}, outside [0, 1]")
                continue
            scores[n] = ItemScore(item.record_id, item.question_id, item.family, item.type, "scored", value,
                                  correct=(value >= self.threshold) if item.hard else None, predicted=req.answer[:200])
        final = [s for s in scores if s is not None]
        scored = [s.score for s in final if s.status == "scored"]
        summary = {"mean_score_scored": float(np.mean(scored)) if scored else None,
                   "pass_rate_scored": float(np.mean([s >= self.threshold for s in scored])) if scored else None,
                   "threshold": self.threshold}
        prov = {"verifier": GRADER_VERIFIER_VERSION, "scoring_model": self.model.name, **(provenance or {})}
        return build_report(self.kind, matched, final, summary, prov)


__all__ = ["BUILTIN_SCORERS", "GradeRequest", "ModelGrader", "ScoringModel", "TextMatchScorer", "load_scoring_model"]
