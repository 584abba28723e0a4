"""Paired comparison of two prediction files on the same labels, inside the verifier.

The promotion gate needs ``metric(candidate) − metric(champion)`` on the
hidden test set with a record-clustered bootstrap CI. Only the verifier reads
those labels, so the comparison runs here, in the sandboxed worker, and only
the deltas leave it. Questions scored in both files take part; a question
either file failed on is counted in ``n_excluded`` (each file's own report
shows the failure).

Beside the overall metrics, the guards of the gate get their own paired
deltas, on the same record-clustered bootstrap: ``families`` holds each
family's accuracy delta (its 95% CI decides the family guard), ``safety``
each declared safety family's false-negative-rate delta with a 90% CI, whose
lower end is the one-sided 95% bound the safety guard reads
(``docs/loop-rules.md``). Aggregates only: no per-question value leaves.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np
import pyarrow as pa

from envloop_pipelines.core.metrics.batch import NOUL_POSITIVE_INDEX
from envloop_pipelines.core.metrics.paired import PairedDelta, paired_delta
from envloop_pipelines.core.verify.rule import match

#: The deltas a promotion decision and a release card read.
PAIRED_METRICS: tuple[str, ...] = ("family_macro_accuracy", "accuracy", "brier", "nll", "ece")
#: Two-sided level of the safety FNR delta's CI: its lower end is a one-sided 95% lower bound.
SAFETY_CONFIDENCE_LEVEL = 0.90


def paired_comparison(
    rows_candidate: Sequence[Mapping[str, Any]],
    rows_baseline: Sequence[Mapping[str, Any]],
    labels: pa.Table,
    *,
    metric_names: Sequence[str] = PAIRED_METRICS,
    n_resamples: int = 2000,
    confidence_level: float = 0.95,
    seed: int = 0,
    safety_families: Sequence[str] = (),
) -> dict[str, Any]:
    """Paired deltas (candidate − baseline) with record-clustered bootstrap CIs.

    Returns ``{"n_questions", "n_excluded", "deltas": {metric: ...}, "families": {family: ...},
    "safety": {family: ...}}``; each delta is ``{"delta", "ci_low", "ci_high", "se", "n_clusters",
    "n_questions", "confidence_level"}`` (``None`` where undefined).
    """
    a, b = match(rows_baseline, labels), match(rows_candidate, labels)
    keep = [i for i in range(len(a.items)) if a.status[i] == "scored" and b.status[i] == "scored"]
    items = [a.items[i] for i in keep]
    out: dict[str, Any] = {"n_questions": len(keep), "n_excluded": len(a.items) - len(keep), "deltas": {},
                           "families": {}, "safety": {}}
    if not keep:
        return out
    probs_a = [a.probs[i] for i in keep]
    probs_b = [b.probs[i] for i in keep]
    labels_ = [it.label if it.hard else -1 for it in items]
    soft = [None if it.hard else np.asarray(it.soft_label) for it in items]
    families = [it.family for it in items]
    records = [it.record_id for it in items]
    for name in metric_names:
        d = paired_delta(name, probs_a, probs_b, labels_, records, soft_labels=soft, families=families,
                                 n_resamples=n_resamples, confidence_level=confidence_level, seed=seed)
        out["deltas"][name] = _as_dict(d)
    for family in sorted(set(families)):
        rows = [i for i, f in enumerate(families) if f == family and labels_[i] >= 0]
        if rows:
            out["families"][family] = _as_dict(_paired_on(rows, "accuracy", probs_a, probs_b, labels_, records,
                                                          n_resamples, confidence_level, seed))
    for family in safety_families:
        rows = [i for i, f in enumerate(families) if f == family and labels_[i] >= 0]
        if any(labels_[i] == NOUL_POSITIVE_INDEX for i in rows):  # an FNR needs a positive
            out["safety"][family] = _as_dict(_paired_on(rows, "false_negative_rate", probs_a, probs_b, labels_,
                                                        records, n_resamples, SAFETY_CONFIDENCE_LEVEL, seed))
    return out


def _paired_on(rows: Sequence[int], metric: str, probs_a: Sequence[np.ndarray], probs_b: Sequence[np.ndarray],
               labels: Sequence[int], records: Sequence[str], n_resamples: int, confidence_level: float,
               seed: int) -> PairedDelta:
    """``metric``'s paired delta on the questions ``rows`` only (hard-labelled), clustered by record."""
    return paired_delta(metric, [probs_a[i] for i in rows], [probs_b[i] for i in rows],
                                [labels[i] for i in rows], [records[i] for i in rows], n_resamples=n_resamples,
                                confidence_level=confidence_level, seed=seed)


def _as_dict(d: PairedDelta) -> dict[str, Any]:
    return {"delta": _finite(d.delta), "ci_low": _finite(d.ci_low), "ci_high": _finite(d.ci_high),
            "se": _finite(d.se), "n_clusters": d.n_clusters, "n_questions": d.n_questions,
            "confidence_level": d.confidence_level}


def _finite(x: float) -> float | None:
    return float(x) if x is not None and math.isfinite(x) else None
