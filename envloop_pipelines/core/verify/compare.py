"""Paired comparison of two prediction files on the same labels, inside the verifier.

The promotion gate needs ``metric(candidate) − metric(champion)`` on the
hidden test set with a record-clustered bootstrap CI. Only the verifier reads
those labels, so the comparison runs here, in the sandboxed worker, and only
the deltas leave it. Questions scored in both files take part; a question
either file failed on is counted in ``n_excluded`` (each file's own report
shows the failure).
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np
import pyarrow as pa

from envloop_pipelines.core import metrics
from envloop_pipelines.core.verify.rule import match

#: The deltas a promotion decision and a release card read.
PAIRED_METRICS: tuple[str, ...] = ("family_macro_accuracy", "accuracy", "brier", "nll", "ece")


def paired_comparison(
    rows_candidate: Sequence[Mapping[str, Any]],
    rows_baseline: Sequence[Mapping[str, Any]],
    labels: pa.Table,
    *,
    metric_names: Sequence[str] = PAIRED_METRICS,
    n_resamples: int = 2000,
    confidence_level: float = 0.95,
    seed: int = 0,
) -> dict[str, Any]:
    """Paired deltas (candidate − baseline) with record-clustered bootstrap CIs."""
    a, b = match(rows_baseline, labels), match(rows_candidate, labels)
    keep = [i for i in range(len(a.items)) if a.status[i] == "scored" and b.status[i] == "scored"]
    items = [a.items[i] for i in keep]
    out: dict[str, Any] = {"n_questions": len(keep), "n_excluded": len(a.items) - len(keep), "deltas": {}}
    if not keep:
        return out
    probs_a = [a.probs[i] for i in keep]
    probs_b = [b.probs[i] for i in keep]
    labels_ = [it.label if it.hard else -1 for it in items]
    soft = [None if it.hard else np.asarray(it.soft_label) for it in items]
    families = [it.family for it in items]
    records = [it.record_id for it in items]
    for name in metric_names:
        d = metrics.paired_delta(name, probs_a, probs_b, labels_, records, soft_labels=soft, families=families,
                                 n_resamples=n_resamples, confidence_level=confidence_level, seed=seed)
        out["deltas"][name] = {
            "delta": _finite(d.delta), "ci_low": _finite(d.ci_low), "ci_high": _finite(d.ci_high),
            "n_clusters": d.n_clusters, "n_questions": d.n_questions, "confidence_level": d.confidence_level,
        }
    return out


def _finite(x: float) -> float | None:
    return float(x) if x is not None and math.isfinite(x) else None
