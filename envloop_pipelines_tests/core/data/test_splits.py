"""Group-disjoint splits."""

from __future__ import annotations

import itertools

import pytest

from envloop_pipelines.core.data.splits import SPLITS, SplitFractions, assign_splits


def test_deterministic_and_complete() -> None:
    groups = [f"u{i}" for i in range(101)]
    a = assign_splits(groups, SplitFractions(), seed=7)
    assert a == assign_splits(list(reversed(groups)) + groups[:5], SplitFractions(), seed=7)
    assert a != assign_splits(groups, SplitFractions(), seed=8)
    assert set(a) == set(groups) and set(a.values()) == set(SPLITS)
    counts = {s: sum(v == s for v in a.values()) for s in SPLITS}
    assert counts == {"train": 61, "val": 10, "dev": 10, "test": 10, "holdout": 10}


def test_every_pair_of_splits_is_group_disjoint() -> None:
    a = assign_splits([f"u{i}" for i in range(40)], SplitFractions(), seed=1)
    members = {s: {g for g, v in a.items() if v == s} for s in SPLITS}
    for x, y in itertools.combinations(SPLITS, 2):
        assert not members[x] & members[y]


def test_declared_splits_are_kept() -> None:
    a = assign_splits([f"u{i}" for i in range(20)], seed=0, declared={"u3": "test", "u4": "holdout"})
    assert a["u3"] == "test" and a["u4"] == "holdout"


def test_small_splits_get_a_group_each() -> None:
    a = assign_splits([f"u{i}" for i in range(5)], SplitFractions(), seed=0)
    assert sorted(a.values()) == sorted(SPLITS)


@pytest.mark.parametrize("text, needle", [("train=0.5,val=0.1", "sum to 1"), ("train=0.9,tst=0.1", "unknown split 'tst'"),
                                          ("train=x,val=1", "not a number")])
def test_fraction_errors_name_the_problem(text: str, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        SplitFractions.parse(text)
