"""pass@k: the unbiased estimator against brute force and the binomial expectation; the intervals."""

from __future__ import annotations

import itertools
from math import comb

import numpy as np
import pytest

from envloop_pipelines.core.agents.stats import default_ks, pass_at_k, pass_at_k_summary


@pytest.mark.parametrize("n,c", [(5, 0), (5, 1), (5, 3), (5, 5), (8, 2)])
def test_pass_at_k_is_the_share_of_k_subsets_holding_a_pass(n: int, c: int) -> None:
    outcomes = [True] * c + [False] * (n - c)
    for k in range(1, n + 1):
        subsets = list(itertools.combinations(range(n), k))
        brute = sum(any(outcomes[i] for i in s) for s in subsets) / len(subsets)
        assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12)


def test_pass_at_k_is_unbiased_for_independent_attempts() -> None:
    # E over Binomial(n, p) of the estimator equals 1 - (1 - p)^k exactly.
    n, p = 6, 0.3
    for k in (1, 2, 4, 6):
        expected = sum(comb(n, c) * p**c * (1 - p) ** (n - c) * pass_at_k(n, c, k) for c in range(n + 1))
        assert expected == pytest.approx(1 - (1 - p) ** k, abs=1e-12)


def test_pass_at_k_refuses_counts_out_of_range() -> None:
    with pytest.raises(ValueError, match="k must be between 1 and the attempts per environment \\(3\\)"):
        pass_at_k(3, 1, 4)
    with pytest.raises(ValueError, match="0 <= c <= n"):
        pass_at_k(3, 4, 1)
    with pytest.raises(ValueError, match="c must be an integer"):
        pass_at_k(3, True, 1)


def test_summary_values_grow_with_k_and_intervals_hold_them() -> None:
    rng = np.random.default_rng(0)
    counts = {f"env{i}": (8, int(rng.binomial(8, 0.4))) for i in range(40)}
    rows = pass_at_k_summary(counts, [1, 2, 4, 8])
    assert [r.k for r in rows] == [1, 2, 4, 8]
    values = [r.value for r in rows]
    assert values == sorted(values) and values[0] < values[-1]
    for r in rows:
        assert r.method == "bootstrap" and r.n_environments == 40
        assert r.ci_low <= r.value <= r.ci_high and r.ci_high - r.ci_low > 0.01
    assert pass_at_k_summary(counts, [1, 2, 4, 8]) == rows  # seeded: the same interval again


def test_one_attempt_per_environment_gets_the_wilson_interval() -> None:
    (row,) = pass_at_k_summary([(1, 1)] * 10, [1])
    assert row.method == "wilson" and row.value == 1.0
    # Wilson for 10/10 at 95%: lower end 10 / (10 + 1.96^2) = 0.722.
    assert row.ci_low == pytest.approx(10 / (10 + 1.959964**2), abs=1e-4) and row.ci_high == pytest.approx(1.0)


def test_ks_beyond_the_attempts_are_skipped_and_defaults() -> None:
    assert [r.k for r in pass_at_k_summary([(2, 1), (3, 0)], [1, 2, 3])] == [1, 2]
    assert default_ks(1) == [1] and default_ks(5) == [1, 2, 4, 5] and default_ks(8) == [1, 2, 4, 8]
    with pytest.raises(ValueError, match="at least one environment"):
        pass_at_k_summary({}, [1])


def test_the_same_value_everywhere_gets_wilson_not_a_point() -> None:
    rows = pass_at_k_summary([(4, 4)] * 12, [1, 4])
    assert [r.method for r in rows] == ["wilson", "wilson"] and all(r.value == 1.0 for r in rows)
    assert rows[0].ci_low == pytest.approx(12 / (12 + 1.959964**2), abs=1e-4) and rows[0].ci_high == 1.0
    # pass@4 is 1.0 wherever one of the 4 attempts passed: identical values again, whatever pass@1 was
    mixed = pass_at_k_summary([(4, 1), (4, 2), (4, 4)] * 4, [1, 4])
    assert mixed[0].method == "bootstrap" and mixed[1].method == "wilson" and mixed[1].ci_low < 0.8
