"""Paired statistics: how much a candidate moves a metric on the same questions as its baseline, and how sure.

``paired_delta`` gives ``metric(b) - metric(a)`` on the same questions, for a
point metric of :mod:`envloop_pipelines.core.metrics.point` (or any callable of
the same shape), with a record-clustered bootstrap CI and standard error
(``scipy.stats.bootstrap``); ``minimum_detectable_effect`` turns that standard
error into the smallest effect a paired test detects at 80% power.

Pure numpy + scipy: no Dagster, no torch.
"""

from __future__ import annotations

import functools
import inspect
import math
import warnings
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import numpy as np

from envloop_pipelines.core.metrics.batch import (
    NOUL_POSITIVE_INDEX,
    Batch,
    SoftLabels,
    check_qtypes,
    confidence,
    expected_correct,
    pack,
    predictions,
)
from envloop_pipelines.core.metrics.point import (
    DEFAULT_ECE_BINS,
    METRICS,
    NLL_CLIP,
    accuracy,
    brier,
    ece,
    false_negative_rate,
    family_macro_accuracy,
    nll,
    packed_form,
)


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
    the array of cluster indices; vectorised over resamples for a metric that
    follows from per-record sums, one call per resample otherwise).

    Args:
        metric_fn: A point metric of :mod:`envloop_pipelines.core.metrics.point`
            (or its name in its ``METRICS``, or a ``functools.partial`` of one), or any callable
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
    metric_fn = _resolve_metric(metric_fn)
    if not 0.0 < confidence_level < 1.0:
        raise ValueError(f"confidence_level must be in (0, 1), got {confidence_level}")
    if n_resamples < 1:
        raise ValueError(f"n_resamples must be >= 1, got {n_resamples}")
    batch_a, batch_b = _pack_pair(probs_a, probs_b, labels, soft_labels, families)
    n = batch_a.n
    if len(record_ids) != n:
        raise ValueError(f"length mismatch: {n} probability vectors but {len(record_ids)} record_ids")
    clusters = _Clusters.of(record_ids)
    check_qtypes(qtypes, n)  # validated here; custom metrics receive the sequence as given

    impl = packed_form(metric_fn)
    if impl is not None:
        delta_on = _packed_delta(impl, batch_a, batch_b)
    else:
        delta_on = _custom_delta(metric_fn, probs_a, probs_b, labels,
                                 soft_labels=soft_labels, families=families, qtypes=qtypes)
    point = float(delta_on(None))

    columns = _columns_impl(metric_fn) if impl is not None else None
    if columns is None:
        statistic, vectorized = _resampled_delta(delta_on, clusters), False
    else:
        statistic, vectorized = _summed_delta(columns, batch_a, batch_b, clusters), True

    result = PairedDelta(
        metric=_metric_name(metric_fn),
        delta=point,
        ci_low=point,
        ci_high=point,
        n_clusters=clusters.n,
        n_questions=n,
        confidence_level=confidence_level,
        se=0.0 if math.isfinite(point) else math.nan,
    )
    if clusters.n < 2:  # one record: every resample is that record
        return result
    boot = _bootstrap(statistic, clusters.n, vectorized=vectorized, n_resamples=n_resamples,
                      confidence_level=confidence_level, method=method, seed=seed)
    distribution = np.asarray(boot.bootstrap_distribution, dtype=np.float64)
    if np.all(np.isfinite(distribution)) and np.ptp(distribution) == 0.0:
        return result
    return replace(
        result,
        ci_low=float(boot.confidence_interval.low),
        ci_high=float(boot.confidence_interval.high),
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


# --------------------------------------------------------------------------- the parts of paired_delta

#: The delta on a subset of the questions (their indices; ``None`` for all of them).
_DeltaOn = Callable[["np.ndarray | None"], float]


def _resolve_metric(metric_fn: Callable[..., float] | str) -> Callable[..., float]:
    """``metric_fn`` itself, or the metric of :data:`METRICS` it names."""
    if isinstance(metric_fn, str):
        if metric_fn not in METRICS:
            raise ValueError(f"unknown metric {metric_fn!r}; known: {', '.join(METRICS)}")
        return METRICS[metric_fn]
    return metric_fn


def _pack_pair(
    probs_a: Sequence[np.ndarray],
    probs_b: Sequence[np.ndarray],
    labels: Sequence[int],
    soft_labels: SoftLabels | None,
    families: Sequence[str] | None,
) -> tuple[Batch, Batch]:
    """Both models' predictions packed, after checking they answer the same questions with the same options."""
    if len(probs_a) != len(probs_b):
        raise ValueError(f"length mismatch: {len(probs_a)} questions in probs_a but {len(probs_b)} in probs_b")
    batch_a = pack(probs_a, labels, soft_labels, families, what="probs_a")
    batch_b = pack(probs_b, labels, soft_labels, families, what="probs_b")
    if not np.array_equal(batch_a.n_options, batch_b.n_options):
        i = int(np.flatnonzero(batch_a.n_options != batch_b.n_options)[0])
        raise ValueError(
            f"probs_a[{i}] has {batch_a.n_options[i]} options but probs_b[{i}] has {batch_b.n_options[i]}"
        )
    return batch_a, batch_b


@dataclass(frozen=True)
class _Clusters:
    """The questions grouped by record, CSR style: the questions of cluster ``c`` are
    ``order[starts[c] : starts[c] + counts[c]]``; clusters are numbered in sorted record id order."""

    inverse: np.ndarray  # (n_questions,) the cluster of each question
    order: np.ndarray  # (n_questions,) question indices, cluster by cluster
    counts: np.ndarray  # (n,) questions per cluster
    starts: np.ndarray  # (n,) where each cluster begins in ``order``

    @classmethod
    def of(cls, record_ids: Sequence[str]) -> "_Clusters":
        records = np.asarray([str(r) for r in record_ids], dtype=object)
        _, inverse = np.unique(records, return_inverse=True)
        counts = np.bincount(inverse)
        return cls(inverse=inverse, order=np.argsort(inverse, kind="stable"), counts=counts,
                   starts=np.concatenate(([0], np.cumsum(counts)[:-1])))

    @property
    def n(self) -> int:
        return int(self.counts.size)

    def questions(self, drawn: np.ndarray) -> np.ndarray:
        """Every question of the drawn clusters (repeats included), cluster by cluster in draw order."""
        sizes = self.counts[drawn]
        # position of each gathered question inside its cluster: 0..size-1
        within = np.arange(sizes.sum()) - np.repeat(np.cumsum(sizes) - sizes, sizes)
        return self.order[np.repeat(self.starts[drawn], sizes) + within]

    def sums(self, columns: np.ndarray) -> np.ndarray:
        """``(n, k)``: each cluster's sum of the ``(n_questions, k)`` per-question columns."""
        out = np.zeros((self.n, columns.shape[1]))
        np.add.at(out, self.inverse, columns)
        return out


def _packed_delta(impl: Callable[[Batch], float], batch_a: Batch, batch_b: Batch) -> _DeltaOn:
    """The delta of a packed metric: resamples index the packed batches, nothing is validated again."""

    def delta_on(idx: np.ndarray | None) -> float:
        if idx is None:
            return impl(batch_b) - impl(batch_a)
        return impl(batch_b.take(idx)) - impl(batch_a.take(idx))

    return delta_on


def _custom_delta(
    metric_fn: Callable[..., float],
    probs_a: Sequence[np.ndarray],
    probs_b: Sequence[np.ndarray],
    labels: Sequence[int],
    *,
    soft_labels: SoftLabels | None,
    families: Sequence[str] | None,
    qtypes: Sequence[str] | None,
) -> _DeltaOn:
    """The delta of any other callable, called on the ragged lists of the picked questions.

    It receives ``soft_labels``, ``families`` and ``qtypes`` as keywords when it accepts them; soft
    labels it cannot take are an error.
    """
    if soft_labels is not None and not _accepts(metric_fn, "soft_labels"):
        raise ValueError(f"{_metric_name(metric_fn)} does not accept soft_labels, but soft labels were given")
    list_a, list_b = list(probs_a), list(probs_b)
    list_labels = list(labels)
    n = len(list_a)
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

    return delta_on


def _resampled_delta(delta_on: _DeltaOn, clusters: _Clusters) -> Callable[[np.ndarray], float]:
    """The bootstrap statistic of one resample (an array of drawn cluster indices): the delta on their questions."""

    def statistic(drawn: np.ndarray) -> float:
        return delta_on(clusters.questions(np.asarray(drawn, dtype=np.int64)))

    return statistic


def _summed_delta(columns: Callable[[Batch], _Columns], batch_a: Batch, batch_b: Batch,
                  clusters: _Clusters) -> Callable[..., np.ndarray]:
    """The vectorised bootstrap statistic of a decomposable metric, for a whole batch of resamples at once.

    A resample's value is (counts of each record drawn) @ (per-record sums of each model's columns):
    the same resamples as :func:`_resampled_delta`, without one Python call per resample.
    """
    cols_a, finish_a = columns(batch_a)
    cols_b, finish_b = columns(batch_b)
    sums_a, sums_b = clusters.sums(cols_a), clusters.sums(cols_b)

    def statistic(drawn: np.ndarray, axis: int = -1) -> np.ndarray:
        draws = np.asarray(drawn, dtype=np.int64)
        flat = draws.reshape(-1, draws.shape[-1])
        rows = np.repeat(np.arange(flat.shape[0]), flat.shape[1])
        times_drawn = np.zeros((flat.shape[0], clusters.n))
        np.add.at(times_drawn, (rows, flat.ravel()), 1.0)
        out = finish_b(times_drawn @ sums_b) - finish_a(times_drawn @ sums_a)
        return out.reshape(draws.shape[:-1])

    return statistic


def _bootstrap(statistic: Callable[..., Any], n_clusters: int, *, vectorized: bool, n_resamples: int,
               confidence_level: float, method: str, seed: int) -> Any:
    """``scipy.stats.bootstrap`` over the cluster indices, seeded; a degenerate distribution does not warn."""
    with warnings.catch_warnings():
        from scipy import stats  # imported here: scipy.stats costs ~1 s to import, and only the bootstrap needs it

        warnings.simplefilter("ignore", stats.DegenerateDataWarning)
        return stats.bootstrap(
            (np.arange(n_clusters),),
            statistic,
            n_resamples=n_resamples,
            batch=min(n_resamples, 256),  # bounds the (batch, n_clusters) index array
            vectorized=vectorized,
            confidence_level=confidence_level,
            method=method,
            rng=np.random.default_rng(seed),
        )


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


# --------------------------------------------------------------------------- decomposable metrics

# A resample's value follows from per-record sums, so the bootstrap runs
# vectorized (a (resamples x records) count matrix times the records' sums) instead of one Python call
# per resample. Each function gives per-question columns and the finish that turns summed columns
# into the metric, exactly as the packed implementation computes it.
_Columns = tuple[np.ndarray, Callable[[np.ndarray], np.ndarray]]


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan)


def _cols_accuracy(b: Batch) -> _Columns:
    hard = ~b.soft
    cols = np.stack([hard & (predictions(b) == b.labels), hard], axis=1).astype(np.float64)
    return cols, lambda S: _ratio(S[:, 0], S[:, 1])


def _cols_mean(values: np.ndarray) -> _Columns:
    cols = np.stack([values, np.ones_like(values)], axis=1)
    return cols, lambda S: S[:, 0] / S[:, 1]


def _cols_brier(b: Batch) -> _Columns:
    return _cols_mean(np.sum((b.probs - b.target) ** 2, axis=1))


def _cols_nll(b: Batch) -> _Columns:
    return _cols_mean(-np.sum(b.target * np.log(np.clip(b.probs, NLL_CLIP, 1.0)), axis=1))


def _cols_family_macro(b: Batch) -> _Columns:
    if b.family_codes is None:
        raise ValueError("families are required for per-family / family-macro accuracy")
    size = len(b.family_names)
    hard = ~b.soft
    right = hard & (predictions(b) == b.labels)
    cols = np.zeros((b.n, 2 * size))
    cols[np.arange(b.n), b.family_codes] = right
    cols[np.arange(b.n), size + b.family_codes] = hard

    def finish(S: np.ndarray) -> np.ndarray:
        acc = _ratio(S[:, :size], S[:, size:])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # a resample with no hard question: nan
            return np.nanmean(acc, axis=1)

    return cols, finish


def _cols_fnr(b: Batch) -> _Columns:
    positives = ~b.soft & (b.labels == NOUL_POSITIVE_INDEX)
    missed = positives & (predictions(b) != NOUL_POSITIVE_INDEX)
    cols = np.stack([missed, positives], axis=1).astype(np.float64)
    return cols, lambda S: _ratio(S[:, 0], S[:, 1])


def _cols_ece(b: Batch, n_bins: int = DEFAULT_ECE_BINS) -> _Columns:
    conf, correct = confidence(b), expected_correct(b)
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


def _columns_impl(metric_fn: Callable[..., float]) -> Callable[[Batch], _Columns] | None:
    if metric_fn in _COLUMNS:
        return _COLUMNS[metric_fn]
    if (isinstance(metric_fn, functools.partial) and metric_fn.func is ece and not metric_fn.args
            and set(metric_fn.keywords) <= {"n_bins"}):
        return functools.partial(_cols_ece, **metric_fn.keywords)
    return None


__all__ = [
    "DEFAULT_POWER",
    "PairedDelta",
    "minimum_detectable_effect",
    "paired_delta",
]
