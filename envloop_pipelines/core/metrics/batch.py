"""Predictions as one padded batch: the input every metric of this package validates and reads.

Inputs are per-question predictions. Questions have different numbers of
options, so a set of predictions is *ragged*: ``probs`` is a sequence of 1-D
probability vectors (one per question), ``labels`` the index of the true option.
:func:`pack` checks them (finite, non-negative, summing to 1, labels in range)
and pads them into a :class:`Batch` so every metric is vectorised.

Hard and soft labels
    A question may carry a *soft label* (a probability vector over its options,
    for ambiguous questions). Such a question counts in the proper scores
    (Brier, NLL) and in ECE against its soft target, and is **excluded** from
    accuracy, coverage, AURC and the false-negative rate, which need one true
    option. Its entry in ``labels`` is ignored and may be ``-1``.

Conventions
    The prediction is ``argmax`` of the probability vector (the first index on
    an exact tie, :func:`predictions`); the confidence is its probability,
    ``max_k p_k`` (:func:`confidence`).

Pure numpy: no Dagster, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

#: Mirrors ``envloop_pipelines.core.data.records.QUESTION_TYPES`` (not imported: that
#: module pulls pyarrow, this one stays numpy).
QUESTION_TYPES: tuple[str, ...] = ("noul", "choice", "score")
#: noul options are ordered ("true", "false"): the positive ("true") is index 0.
NOUL_POSITIVE_INDEX = 0
#: The noul option "false": a safety family's automation threshold is on its probability.
NOUL_NEGATIVE_INDEX = 1
#: A probability vector (or soft label) must sum to 1 within this tolerance.
PROB_SUM_TOLERANCE = 1e-4

SoftLabels = Sequence["np.ndarray | None"]


# --------------------------------------------------------------------------- packed form


@dataclass(frozen=True)
class Batch:
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

    def take(self, idx: np.ndarray) -> "Batch":
        return Batch(
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


def check_qtypes(qtypes: Sequence[str] | None, n: int) -> np.ndarray | None:
    """``qtypes`` as an object array after checking its length and values (``None`` stays ``None``)."""
    arr = _as_strings(qtypes, n, "qtypes")
    if arr is not None:
        bad = sorted({q for q in arr if q not in QUESTION_TYPES})
        if bad:
            raise ValueError(f"qtypes must be one of {', '.join(QUESTION_TYPES)}, got {bad!r}")
    return arr


def pack(
    probs: Sequence[np.ndarray],
    labels: Sequence[int],
    soft_labels: SoftLabels | None = None,
    families: Sequence[str] | None = None,
    *,
    what: str = "probs",
) -> Batch:
    """Validate ragged predictions and pad them into a :class:`Batch`."""
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
    return Batch(
        probs=padded,
        target=target,
        n_options=sizes,
        labels=lab,
        soft=soft,
        family_codes=family_codes,
        family_names=family_names,
    )


# --------------------------------------------------------------------------- per-question readouts


def predictions(b: Batch) -> np.ndarray:
    """The predicted option of each question: its argmax, the first index on an exact tie."""
    return np.argmax(b.probs, axis=1)


def confidence(b: Batch) -> np.ndarray:
    """The confidence of each question: the probability of its predicted option, ``max_k p_k``."""
    return b.probs.max(axis=1)


def expected_correct(b: Batch) -> np.ndarray:
    """``target[i, argmax_i]``: 1/0 for a hard label (argmax == label), the soft target's probability of the argmax."""
    return b.target[np.arange(b.n), predictions(b)]


__all__ = [
    "NOUL_NEGATIVE_INDEX",
    "NOUL_POSITIVE_INDEX",
    "PROB_SUM_TOLERANCE",
    "QUESTION_TYPES",
    "Batch",
    "SoftLabels",
    "check_qtypes",
    "confidence",
    "expected_correct",
    "pack",
    "predictions",
]
