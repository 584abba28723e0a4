"""Group-disjoint splits: train / val / dev / test / holdout.

The unit of splitting is the group (``meta.user_id`` by default), so the test
measures generalisation to unseen users rather than memory of them.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterable, Mapping

import numpy as np

from envloop_pipelines.core.fractions import Fractions

SPLITS: tuple[str, ...] = ("train", "val", "dev", "test", "holdout")
#: Splits whose labels live apart from their inputs and are read by the verifier only.
HIDDEN_SPLITS: frozenset[str] = frozenset({"test", "holdout"})
#: Splits the training side may read with labels.
OPEN_SPLITS: tuple[str, ...] = ("train", "val", "dev")


@dataclass(frozen=True)
class SplitFractions(Fractions):
    """Fractions of groups per split; they must sum to 1 (validation and ``parse`` from :class:`Fractions`).

    Defaults: 60% train, 10% val, 10% dev, 10% test, 10% holdout of the users.
    Parsed from ``"train=0.6,val=0.1,dev=0.1,test=0.1,holdout=0.1"`` (omitted splits are 0).
    """

    label = "fractions"
    item = "split"

    # The fields, in SPLITS order, are the split names.
    train: float = 0.6
    val: float = 0.1
    dev: float = 0.1
    test: float = 0.1
    holdout: float = 0.1


def assign_splits(
    groups: Iterable[str],
    fractions: SplitFractions = SplitFractions(),
    seed: int = 0,
    declared: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Assign every group to one split, deterministically from ``seed``.

    Args:
        groups: group keys (duplicates are fine; order does not matter).
        fractions: share of groups per split.
        seed: shuffling seed; the same groups and seed give the same assignment.
        declared: groups whose split is fixed in advance (for example by a data
            generator that renders test users differently); they are kept as
            declared and the remaining groups are shuffled into the splits.

    Returns:
        A mapping group → split name.
    """
    declared = dict(declared or {})
    for group, split in declared.items():
        if split not in SPLITS:
            raise ValueError(f"group {group!r} declares unknown split {split!r}; allowed: {', '.join(SPLITS)}")
    unique = sorted(set(groups) - set(declared))
    # Hash the seed with the sorted keys so adding a group elsewhere does not
    # matter for the order, only for the cut points.
    order = np.random.default_rng(_seed_int(seed)).permutation(len(unique))
    shuffled = [unique[i] for i in order]
    counts = _largest_remainder_counts(len(shuffled), fractions)
    assignment: dict[str, str] = dict(declared)
    start = 0
    for name in SPLITS:
        for group in shuffled[start : start + counts[name]]:
            assignment[group] = name
        start += counts[name]
    return assignment


def split_counts(n: int, fractions: SplitFractions) -> dict[str, int]:
    """How many of ``n`` groups :func:`assign_splits` puts in each split (its cut points)."""
    return _largest_remainder_counts(n, fractions)


def _largest_remainder_counts(n: int, fractions: SplitFractions) -> dict[str, int]:
    """Integer counts per split summing to ``n`` (Hamilton's method), every
    positive fraction getting at least one group when there are enough groups."""
    shares = fractions.as_dict()
    raw = {name: shares[name] * n for name in SPLITS}
    counts = {name: int(np.floor(raw[name])) for name in SPLITS}
    leftover = n - sum(counts.values())
    for name in sorted(SPLITS, key=lambda s: raw[s] - counts[s], reverse=True)[:leftover]:
        counts[name] += 1
    positive = [s for s in SPLITS if shares[s] > 0]
    if n >= len(positive):
        for name in positive:
            if counts[name] == 0:
                donor = max(SPLITS, key=lambda s: counts[s])
                counts[donor] -= 1
                counts[name] += 1
    return counts


def _seed_int(seed: int) -> int:
    return int.from_bytes(hashlib.sha256(f"envloop-splits:{seed}".encode()).digest()[:8], "big")
