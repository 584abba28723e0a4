"""Seeded random streams keyed by name, so every part is reproducible on its own.

Each user, record and rendering draws from its own generator seeded by a hash
of (purpose, seed, key). Adding users or records therefore never changes the
ones that already exist, and a record can be re-rendered without replaying
the whole benchmark.
"""

from __future__ import annotations

import hashlib
from typing import Sequence, TypeVar

import numpy as np

T = TypeVar("T")


def stream(*parts: object) -> np.random.Generator:
    """A numpy generator seeded from the hash of ``parts``."""
    digest = hashlib.sha256("|".join(["envloop-benchmark", *map(str, parts)]).encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:16], "big"))


def pick(rng: np.random.Generator, items: Sequence[T]) -> T:
    """One item, uniformly (plain Python value, never a numpy scalar)."""
    return items[int(rng.integers(len(items)))]


def sample(rng: np.random.Generator, items: Sequence[T], k: int) -> list[T]:
    """``k`` distinct items in random order."""
    return [items[int(i)] for i in rng.choice(len(items), size=k, replace=False)]


def shuffled(rng: np.random.Generator, items: Sequence[T]) -> list[T]:
    """A shuffled copy."""
    return [items[int(i)] for i in rng.permutation(len(items))]


def chance(rng: np.random.Generator, p: float) -> bool:
    """True with probability ``p``."""
    return bool(rng.random() < p)


def weighted(rng: np.random.Generator, items: Sequence[T], weights: Sequence[float]) -> T:
    """One item with the given (unnormalised) weights."""
    w = np.asarray(weights, dtype=float)
    return items[int(rng.choice(len(items), p=w / w.sum()))]


def log_uniform(rng: np.random.Generator, low: float, high: float) -> float:
    """A dollar amount, log-uniform in [low, high], rounded to cents."""
    return round(float(np.exp(rng.uniform(np.log(low), np.log(high)))), 2)
