"""The rule verifier: the chosen option against the label, proper scores against soft labels.

Per item: the chosen option is the argmax of the probabilities (the first on a
tie, as in :mod:`envloop_pipelines.core.metrics.batch`); ``correct`` compares it with
a hard label; ``brier`` and ``nll`` are taken against the soft label when the
question has one, else against the one-hot label. The aggregate over scored
items is :func:`envloop_pipelines.core.metrics.point.summarize`, so the numbers are
the ones every other report uses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import pyarrow as pa

from envloop_pipelines.core.metrics.point import DEFAULT_ERROR_BUDGET, NLL_CLIP, safety_deferral, summarize
from envloop_pipelines.core.verify.protocol import (
    MAX_LISTED_EXTRA,
    PROB_SUM_TOLERANCE,
    ItemScore,
    VerifierReport,
)

RULE_VERIFIER_VERSION = "rule/1"


@dataclass(frozen=True)
class LabelItem:
    """One question of the label table."""

    record_id: str
    question_id: str
    family: str
    type: str
    option_keys: tuple[str, ...]
    label: int | None
    soft_label: tuple[float, ...] | None

    @property
    def hard(self) -> bool:
        return self.soft_label is None


@dataclass(frozen=True)
class Matched:
    """The join of predictions and labels: per question, its checked probabilities or the reason it has none."""

    items: tuple[LabelItem, ...]
    probs: tuple[np.ndarray | None, ...]  # in the question's option order
    errors: tuple[str | None, ...]
    status: tuple[str, ...]  # scored / missing / invalid
    answers: tuple[Any, ...]  # the row's ``answer`` column, when present
    extra_ids: tuple[tuple[str, str], ...]
    n_extra: int


def label_items(labels: pa.Table) -> tuple[LabelItem, ...]:
    """The label table as items, in its row order."""
    cols = {name: labels.column(name).to_pylist() for name in ("record_id", "question_id", "family", "type", "option_keys", "label")}
    soft = labels.column("soft_label").to_pylist() if "soft_label" in labels.column_names else [None] * labels.num_rows
    return tuple(
        LabelItem(str(r), str(q), str(f), str(t), tuple(k), lab, None if s is None else tuple(float(x) for x in s))
        for r, q, f, t, k, lab, s in zip(cols["record_id"], cols["question_id"], cols["family"], cols["type"],
                                         cols["option_keys"], cols["label"], soft)
    )


def _check_row(row: Mapping[str, Any], item: LabelItem) -> tuple[np.ndarray | None, str | None]:
    """The row's probabilities in the question's option order, or why they are unusable."""
    if "_error" in row:
        return None, str(row["_error"])
    keys, probs = row.get("option_keys"), row.get("probs")
    if not isinstance(keys, (list, tuple)) or not all(isinstance(k, str) for k in keys):
        return None, "option_keys must be a list of strings"
    if not isinstance(probs, (list, tuple)):
        return None, "probs must be a list of numbers"
    if len(keys) != len(probs):
        return None, f"{len(keys)} option_keys but {len(probs)} probs"
    if len(set(keys)) != len(keys):
        return None, "option_keys has duplicates"
    if set(keys) != set(item.option_keys):
        missing = sorted(set(item.option_keys) - set(keys))
        unknown = sorted(set(keys) - set(item.option_keys))
        return None, f"option_keys do not match the question's options (missing {missing}, unknown {unknown})"
    if any(isinstance(p, bool) or not isinstance(p, (int, float)) for p in probs):
        return None, "probs must be numbers"
    values = np.asarray(probs, dtype=np.float64)
    if not np.all(np.isfinite(values)):
        return None, "probs contain a non-finite value"
    if np.any(values < 0):
        return None, "probs contain a negative value"
    total = float(values.sum())
    if abs(total - 1.0) > PROB_SUM_TOLERANCE:
        return None, f"probs sum to {total:.6f}, not 1 (tolerance {PROB_SUM_TOLERANCE})"
    position = {k: i for i, k in enumerate(keys)}
    return values[[position[k] for k in item.option_keys]], None


def match(rows: Sequence[Mapping[str, Any]], labels: pa.Table) -> Matched:
    """Join prediction rows with labels on ``(record_id, question_id)`` and validate each row."""
    items = label_items(labels)
    index = {(i.record_id, i.question_id): n for n, i in enumerate(items)}
    by_item: dict[int, list[Mapping[str, Any]]] = {}
    extra: list[tuple[str, str]] = []
    n_extra = 0
    for row in rows:
        key = (str(row.get("record_id")), str(row.get("question_id")))
        n = index.get(key)
        if n is None:
            n_extra += 1
            if len(extra) < MAX_LISTED_EXTRA:
                extra.append(key)
            continue
        by_item.setdefault(n, []).append(row)
    probs: list[np.ndarray | None] = []
    errors: list[str | None] = []
    status: list[str] = []
    answers: list[Any] = []
    for n, item in enumerate(items):
        found = by_item.get(n)
        if not found:
            probs.append(None), errors.append("no prediction for this question"), status.append("missing"), answers.append(None)
            continue
        if len(found) > 1:
            rows_at = ", ".join(str(r.get("_row")) for r in found)
            probs.append(None), errors.append(f"{len(found)} prediction rows for this question (rows {rows_at})")
            status.append("invalid"), answers.append(None)
            continue
        vec, error = _check_row(found[0], item)
        probs.append(vec), errors.append(error), status.append("scored" if error is None else "invalid")
        answers.append(found[0].get("answer"))
    return Matched(items, tuple(probs), tuple(errors), tuple(status), tuple(answers), tuple(extra), n_extra)


def _target(item: LabelItem) -> np.ndarray | None:
    if item.soft_label is not None:
        return np.asarray(item.soft_label, dtype=np.float64)
    if item.label is None or not 0 <= item.label < len(item.option_keys):
        return None
    target = np.zeros(len(item.option_keys))
    target[item.label] = 1.0
    return target


def failure(item: LabelItem, status: str, error: str | None) -> ItemScore:
    """An item that could not be scored: score 0, wrong if it has a hard label, with its reason."""
    return ItemScore(item.record_id, item.question_id, item.family, item.type, status, 0.0,  # type: ignore[arg-type]
                     correct=False if item.hard else None, error=error)


def build_report(
    kind: str,
    matched: Matched,
    scores: Sequence[ItemScore],
    metrics_out: Mapping[str, Any],
    provenance: Mapping[str, Any],
) -> VerifierReport:
    """Counts, ``accuracy_all`` and ``mean_score`` over all items (failures included)."""
    n_items = len(scores)
    count = {s: sum(1 for i in scores if i.status == s) for s in ("scored", "missing", "invalid")}
    hard = [i for i in scores if i.correct is not None]
    return VerifierReport(
        kind=kind,
        n_items=n_items,
        n_scored=count["scored"],
        n_missing=count["missing"],
        n_invalid=count["invalid"],
        n_extra=matched.n_extra,
        complete=count["scored"] == n_items and matched.n_extra == 0,
        metrics=dict(metrics_out),
        accuracy_all=(sum(1 for i in hard if i.correct) / len(hard)) if hard else None,
        mean_score=(sum(i.score for i in scores) / n_items) if n_items else None,
        items=tuple(scores),
        extra_ids=matched.extra_ids,
        provenance=dict(provenance),
    )


class RuleVerifier:
    """Option match and proper scores (Brier, NLL) against hard or soft labels.

    Args:
        safety_families: families whose false-negative rate the aggregate reports (``fnr/<family>``).
        error_budget: the budget of the aggregate's coverage metric.
        safety_thresholds: the predictions' own automation thresholds on P("false") per safety family
            (the checkpoint's calibration): the aggregate then also reports ``defer_rate/<family>``
            and ``fnr_automated/<family>`` (:func:`~envloop_pipelines.core.metrics.point.safety_deferral`).
    """

    kind = "rule"

    def __init__(self, *, safety_families: Sequence[str] = (), error_budget: float = DEFAULT_ERROR_BUDGET,
                 safety_thresholds: Mapping[str, float] | None = None) -> None:
        self.safety_families = tuple(safety_families)
        self.error_budget = error_budget
        self.safety_thresholds = dict(safety_thresholds or {})

    def score(
        self, rows: Sequence[Mapping[str, Any]], labels: pa.Table, *, provenance: Mapping[str, Any] | None = None
    ) -> VerifierReport:
        matched = match(rows, labels)
        scores: list[ItemScore] = []
        agg_probs: list[np.ndarray] = []
        agg_labels: list[int] = []
        agg_soft: list[np.ndarray | None] = []
        agg_families: list[str] = []
        agg_types: list[str] = []
        for item, vec, error, status in zip(matched.items, matched.probs, matched.errors, matched.status):
            target = _target(item)
            if target is None and status == "scored":
                status, error = "invalid", f"the label {item.label!r} is not usable for {len(item.option_keys)} options"
            if status != "scored" or vec is None or target is None:
                scores.append(failure(item, status, error))
                continue
            chosen = int(np.argmax(vec))  # first index on an exact tie, as in core.metrics.batch
            brier = float(np.sum((vec - target) ** 2))
            nll = float(-np.sum(target * np.log(np.clip(vec, NLL_CLIP, 1.0))))
            correct = (chosen == item.label) if item.hard else None
            score = float(correct) if item.hard else float(target[chosen])
            scores.append(ItemScore(item.record_id, item.question_id, item.family, item.type, "scored", score,
                                    correct=correct, predicted=item.option_keys[chosen], brier=brier, nll=nll))
            agg_probs.append(vec)
            agg_labels.append(item.label if item.hard else -1)  # type: ignore[arg-type]
            agg_soft.append(None if item.hard else target)
            agg_families.append(item.family)
            agg_types.append(item.type)
        summary: dict[str, Any] = {}
        if agg_probs:
            summary = summarize(
                agg_probs, agg_labels, agg_families, soft_labels=agg_soft, qtypes=agg_types,
                safety_families=self.safety_families, error_budget=self.error_budget,
            )
            for family, values in safety_deferral(agg_probs, agg_labels, agg_families, self.safety_thresholds,
                                                          soft_labels=agg_soft).items():
                summary.update({f"{name}/{family}": value for name, value in values.items()})
            summary = {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in summary.items()}
        prov = {"verifier": RULE_VERIFIER_VERSION, **(provenance or {})}
        return build_report(self.kind, matched, scores, summary, prov)


__all__ = ["LabelItem", "Matched", "RULE_VERIFIER_VERSION", "RuleVerifier", "build_report", "failure", "label_items", "match"]
