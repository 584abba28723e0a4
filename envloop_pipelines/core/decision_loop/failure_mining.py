"""The asset ``failure_mining``: where the champion is wrong on dev, grouped and ranked.

Every hard-labelled dev question gets the champion's answer; errors and
*confident* errors (wrong with confidence at or above the automation
threshold, the ones that would have been acted on) are grouped into clusters by
family, type, true → predicted option, variant, state-length bucket and
renderer, and ranked by excess error: how many more errors the cluster holds
than the overall error rate predicts for its size.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from envloop_pipelines.core.data.snapshots import TaskSnapshot
from envloop_pipelines.core.decision_loop.step_records import BaselineEval, FailureMining
from envloop_pipelines.core.loop.config import LoopConfig

#: State length buckets in characters (short notes, a paragraph, a page, long).
LENGTH_BUCKETS: tuple[tuple[int, str], ...] = ((400, "short"), (900, "medium"), (1600, "long"))
CLUSTER_KEYS: tuple[str, ...] = ("family", "type", "transition", "variant", "length", "renderer")
#: Coarser groupings tried in turn when no cluster at the finer one reaches the minimum size (small dev sets).
FALLBACK_GROUPINGS: tuple[tuple[str, ...], ...] = (
    CLUSTER_KEYS,
    ("family", "type", "transition", "variant"),
    ("family", "variant"),
    ("family",),
)


@dataclass(frozen=True)
class FailureCluster:
    """One group of dev questions sharing the cluster keys."""

    key: dict[str, str]
    n: int
    errors: int
    confident_errors: int
    error_rate: float
    excess_errors: float
    example_ids: tuple[str, ...]

    @property
    def name(self) -> str:
        return "/".join(f"{k}={v}" for k, v in self.key.items())

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["name"] = self.name
        d["example_ids"] = list(self.example_ids)
        return d


@dataclass(frozen=True)
class FailureReport:
    n_questions: int
    n_errors: int
    n_confident_errors: int
    error_rate: float
    threshold: float
    clusters: tuple[FailureCluster, ...]
    by_family: dict[str, dict[str, float]]

    def top(self, k: int) -> tuple[FailureCluster, ...]:
        return self.clusters[:k]

    def to_dict(self) -> dict[str, Any]:
        return {
            "n_questions": self.n_questions,
            "n_errors": self.n_errors,
            "n_confident_errors": self.n_confident_errors,
            "error_rate": self.error_rate,
            "threshold": self.threshold if np.isfinite(self.threshold) else None,
            "by_family": self.by_family,
            "clusters": [c.to_dict() for c in self.clusters],
        }


def length_bucket(n_chars: int) -> str:
    for limit, name in LENGTH_BUCKETS:
        if n_chars < limit:
            return name
    return "very_long"


def cluster_failures_with_fallback(questions: pa.Table, predictions: pa.Table, *, threshold: float,
                                min_cluster_size: int = 3, max_examples: int = 5) -> FailureReport:
    """:func:`cluster_failures` at the finest grouping that yields a cluster (see :data:`FALLBACK_GROUPINGS`)."""
    report = None
    for grouping in FALLBACK_GROUPINGS:
        report = cluster_failures(questions, predictions, threshold=threshold, min_cluster_size=min_cluster_size,
                               max_examples=max_examples, group_by=grouping)
        if report.clusters:
            break
    assert report is not None
    return report


def cluster_failures(
    questions: pa.Table,
    predictions: pa.Table,
    *,
    threshold: float,
    min_cluster_size: int = 3,
    max_examples: int = 5,
    group_by: Sequence[str] = CLUSTER_KEYS,
) -> FailureReport:
    """Cluster the champion's dev errors.

    Args:
        questions: the labelled dev question table (``QUESTION_SCHEMA``).
        predictions: the champion's predictions on it (``PREDICTION_SCHEMA``), any order.
        threshold: the champion's automation threshold; errors at or above it are *confident*.
        min_cluster_size: clusters with fewer questions are not ranked (too small to target).
        max_examples: example ids kept per cluster.
        group_by: which cluster keys to use (a subset of :data:`CLUSTER_KEYS`).

    Returns:
        Clusters with at least one error, ranked by excess errors (then confident errors).
    """
    unknown = [k for k in group_by if k not in CLUSTER_KEYS]
    if unknown:
        raise ValueError(f"group_by keys {unknown} unknown; allowed: {', '.join(CLUSTER_KEYS)}")
    pred_by_key = {
        (r, q): (keys, probs)
        for r, q, keys, probs in zip(
            predictions.column("record_id").to_pylist(), predictions.column("question_id").to_pylist(),
            predictions.column("option_keys").to_pylist(), predictions.column("probs").to_pylist(),
        )
    }
    rows = questions.to_pylist()
    groups: dict[tuple[str, ...], list[tuple[str, bool, bool]]] = defaultdict(list)
    family_stats: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    n = n_err = n_conf = 0
    for row in rows:
        if row.get("label") is None or row.get("soft_label") is not None:
            continue  # ambiguous questions have no "error" to mine
        key = (row["record_id"], row["question_id"])
        if key not in pred_by_key:
            raise ValueError(f"no prediction for dev question {key[0]}/{key[1]}")
        option_keys, probs = pred_by_key[key]
        probs = np.asarray(probs)
        predicted = int(np.argmax(probs))
        wrong = predicted != row["label"]
        confident = bool(wrong and probs[predicted] >= threshold)
        true_key = row["option_keys"][row["label"]]
        values = {
            "family": row["family"],
            "type": row["type"],
            "transition": f"{true_key}->{option_keys[predicted]}" if wrong else f"{true_key}->{true_key}",
            "variant": row.get("variant") or "unknown",
            "length": length_bucket(len(row["state_text"])),
            "renderer": row.get("renderer") or "unknown",
        }
        groups[tuple(values[k] for k in group_by)].append((f"{key[0]}/{key[1]}", wrong, confident))
        stats = family_stats[row["family"]]
        stats[0] += 1
        stats[1] += int(wrong)
        stats[2] += int(confident)
        n += 1
        n_err += int(wrong)
        n_conf += int(confident)
    rate = n_err / n if n else 0.0
    clusters = []
    # Transitions split errors from successes, so excess error is measured on the
    # cluster without the transition key (its population), then attributed per transition.
    population: dict[tuple[str, ...], int] = defaultdict(int)
    t_index = list(group_by).index("transition") if "transition" in group_by else None
    for gkey, items in groups.items():
        pkey = gkey if t_index is None else gkey[:t_index] + gkey[t_index + 1:]
        population[pkey] += len(items)
    for gkey, items in groups.items():
        errors = sum(w for _, w, _ in items)
        if errors == 0:
            continue
        pkey = gkey if t_index is None else gkey[:t_index] + gkey[t_index + 1:]
        size = population[pkey]
        if size < min_cluster_size:
            continue
        clusters.append(
            FailureCluster(
                key=dict(zip(group_by, gkey)),
                n=size,
                errors=errors,
                confident_errors=sum(c for _, _, c in items),
                error_rate=errors / size,
                excess_errors=errors - rate * size,
                example_ids=tuple(i for i, w, _ in items if w)[:max_examples],
            )
        )
    clusters.sort(key=lambda c: (-c.excess_errors, -c.confident_errors, c.name))
    by_family = {
        fam: {"n": s[0], "errors": s[1], "confident_errors": s[2], "error_rate": s[1] / s[0] if s[0] else 0.0}
        for fam, s in sorted(family_stats.items())
    }
    return FailureReport(n, n_err, n_conf, rate, float(threshold), tuple(clusters), by_family)


def mine_failures(config: LoopConfig, task: TaskSnapshot, baseline: BaselineEval) -> FailureMining:
    """Cluster the champion's dev errors, ranked by excess error."""
    dev = task.table("dev")
    report = cluster_failures_with_fallback(dev, pq.read_table(baseline.predictions),
                                         threshold=baseline.automation_threshold)
    return FailureMining.from_dict({"round": baseline.round, **report.to_dict()})


def top_clusters(mined: FailureMining, k: int) -> tuple[FailureCluster, ...]:
    """The ``k`` highest-ranked clusters as ``FailureCluster`` values."""
    return tuple(FailureCluster(key=c["key"], n=c["n"], errors=c["errors"], confident_errors=c["confident_errors"],
                                error_rate=c["error_rate"], excess_errors=c["excess_errors"],
                                example_ids=tuple(c["example_ids"])) for c in mined.clusters[:k])


__all__ = ["CLUSTER_KEYS", "FALLBACK_GROUPINGS", "FailureCluster", "FailureReport", "cluster_failures",
           "cluster_failures_with_fallback", "length_bucket", "mine_failures", "top_clusters"]
