"""The ``confidence`` of served answers, per the contract (``docs/serving.md``, ``shared/docs/jev-api.md``).

choice: ``(p_max − 1/K) / (1 − 1/K)``; score: ``max(0, 1 − Σ pᵢ·|i − mode| / MAD_uniform)`` with the
mode the most probable level and ``MAD_uniform`` the uniform distribution's mean absolute deviation,
``Σ (1/K)·|i − (K − 1)/2|``. No model and no server: the numbers come from the answer functions the
server calls, and from ``jev_answer`` on questions parsed by the server's own request models.
"""

from __future__ import annotations

import numpy as np
import pytest

from envloop_pipelines.core.serve.answers import (
    ModelAnswer,
    choice_confidence,
    jev_answer,
    score_confidence,
    uniform_mad,
)
from envloop_pipelines.core.serve.schemas import parse_systemone, served_request


def _tilted(k: int, slope: float, peak: float) -> np.ndarray:
    """A nearly flat distribution over k levels: ``exp(−slope·|i − peak|)``, normalised."""
    p = np.exp(-slope * np.abs(np.arange(k) - peak))
    return p / p.sum()


def _by_hand(p: np.ndarray) -> float:
    """The contract's score formula written out once more, loop by loop."""
    k = len(p)
    mode = max(range(k), key=lambda i: (p[i], -i))  # the most probable level, the lowest on a tie
    spread = sum(p[i] * abs(i - mode) for i in range(k))
    mad_uniform = sum(abs(i - (k - 1) / 2) for i in range(k)) / k
    return max(0.0, 1 - spread / mad_uniform)


# --------------------------------------------------------------------------- MAD_uniform


@pytest.mark.parametrize("k", range(2, 11))
def test_uniform_mad_is_the_mean_absolute_deviation_of_the_uniform_levels(k: int) -> None:
    # closed form: (k² − (k mod 2)) / (4k); K=2: 0.5, K=3: 2/3, K=10: 2.5
    assert uniform_mad(k) == pytest.approx((k * k - k % 2) / (4 * k))
    assert uniform_mad(k) == pytest.approx(np.mean(np.abs(np.arange(k) - np.mean(np.arange(k)))))


def test_uniform_mad_refuses_a_single_level() -> None:
    with pytest.raises(ValueError, match="at least 2 levels"):
        uniform_mad(1)


# --------------------------------------------------------------------------- score


def test_the_contract_examples() -> None:
    assert score_confidence([0.0, 0.95, 0.05]) == pytest.approx(0.925)  # MAD_uniform (1+0+1)/3, spread 0.05
    assert choice_confidence([0.88, 0.12]) == pytest.approx(0.76)


@pytest.mark.parametrize("k, slope", [(10, 0.02), (10, 0.05), (10, 0.08), (6, 0.05), (5, 0.05)])
@pytest.mark.parametrize("where", ["low end", "next to the low end", "next to the high end", "high end"])
def test_a_nearly_flat_answer_tilted_towards_a_level_has_no_confidence(k: int, slope: float, where: str) -> None:
    # a tilt towards an end, or towards a level next to it: the spread about the mode is at least the
    # uniform's MAD, so the confidence is exactly 0
    peak = {"low end": 0, "next to the low end": 1, "next to the high end": k - 2, "high end": k - 1}[where]
    p = _tilted(k, slope, peak)
    assert p.max() - p.min() < 0.08  # nearly flat
    assert int(np.argmax(p)) == peak
    assert score_confidence(p) == pytest.approx(_by_hand(p), abs=1e-12)
    assert f"{score_confidence(p):.3f}" == "0.000"


@pytest.mark.parametrize("k", [3, 4, 7, 10])
def test_a_nearly_flat_answer_with_noise_has_almost_no_confidence(k: int) -> None:
    rng = np.random.default_rng(k)
    for _ in range(200):
        p = np.full(k, 1 / k) + rng.uniform(-0.0005, 0.0005, k)
        p /= p.sum()
        assert score_confidence(p) < 0.01
        assert score_confidence(p) == pytest.approx(_by_hand(p), abs=1e-12)


def test_two_levels_is_two_p_max_minus_one() -> None:
    # K = 2: spread 1 − p_max, MAD_uniform 0.5
    for p_max in (0.5, 0.505, 0.6, 0.9, 1.0):
        assert score_confidence([p_max, 1 - p_max]) == pytest.approx(2 * p_max - 1)
        assert score_confidence([1 - p_max, p_max]) == pytest.approx(2 * p_max - 1)


def test_the_issue_case_10_levels_was_0_114_with_the_mad_taken_about_the_mode() -> None:
    # The served number the issue reports: MAD_uniform about the mode (Σ (1/K)|i − mode|) gives a tilted,
    # nearly flat 10-level answer about 0.11; the contract's MAD_uniform (about the centre) gives 0.
    p = _tilted(10, 0.063, 0)
    idx = np.arange(10)
    about_mode = 1 - float(np.sum(p * idx)) / float(np.mean(idx))
    assert about_mode == pytest.approx(0.114, abs=0.005)
    assert score_confidence(p) == 0.0


@pytest.mark.parametrize("k", range(2, 11))
def test_uniform_is_zero_and_certain_is_one_on_every_level(k: int) -> None:
    assert score_confidence(np.full(k, 1 / k)) == 0.0
    for level in range(k):
        p = np.zeros(k)
        p[level] = 1.0
        assert score_confidence(p) == 1.0


def test_many_levels() -> None:
    # 10 levels, 0.9 on level 4 and 0.1 next to it: spread 0.1, MAD_uniform 2.5
    p = np.zeros(10)
    p[4], p[5] = 0.9, 0.1
    assert score_confidence(p) == pytest.approx(1 - 0.1 / 2.5)
    # the same mass far away costs more: 0.1 on level 9 is 5 levels off
    q = np.zeros(10)
    q[4], q[9] = 0.9, 0.1
    assert score_confidence(q) == pytest.approx(1 - 0.5 / 2.5)
    # mass at both ends of a 10-level scale: a bimodal answer is not confident
    assert score_confidence([0.5] + [0.0] * 8 + [0.5]) == 0.0


def test_ties_take_the_lowest_most_probable_level() -> None:
    # 4 levels, a tie between levels 1 and 2: mode 1, spread 0.5·1 = 0.5, MAD_uniform 1.0
    assert score_confidence([0.0, 0.5, 0.5, 0.0]) == pytest.approx(0.5)
    # symmetric ties give the same number for either mode
    assert score_confidence([0.0, 0.5, 0.5, 0.0]) == score_confidence([0.0, 0.5, 0.5, 0.0][::-1])
    # a tie between the ends: mode 0, spread 0.5·3 = 1.5 > MAD_uniform 1.0 → 0
    assert score_confidence([0.5, 0.0, 0.0, 0.5]) == 0.0
    # a tie of the first two of three: mode 0, spread 0.45 + 0.1·2 = 0.65 vs MAD 2/3
    assert score_confidence([0.45, 0.45, 0.1]) == pytest.approx(1 - 0.65 / (2 / 3))


def test_random_distributions_match_the_formula_written_out() -> None:
    rng = np.random.default_rng(18)
    for _ in range(500):
        k = int(rng.integers(2, 11))
        p = rng.dirichlet(np.full(k, float(rng.choice([0.1, 1.0, 30.0]))))
        assert score_confidence(p) == pytest.approx(_by_hand(p), abs=1e-12)
        assert 0.0 <= score_confidence(p) <= 1.0


# --------------------------------------------------------------------------- choice


@pytest.mark.parametrize("k", [2, 3, 10, 100, 255])
def test_choice_with_many_options(k: int) -> None:
    assert choice_confidence(np.full(k, 1 / k)) == pytest.approx(0.0, abs=1e-12)
    certain = np.zeros(k)
    certain[-1] = 1.0
    assert choice_confidence(certain) == 1.0
    nearly_flat = np.full(k, 1.0)
    nearly_flat[0] = 1.02
    nearly_flat /= nearly_flat.sum()
    assert choice_confidence(nearly_flat) == pytest.approx((nearly_flat.max() - 1 / k) / (1 - 1 / k))
    assert choice_confidence(nearly_flat) < 0.02


def test_choice_ties() -> None:
    assert choice_confidence([0.5, 0.5, 0.0, 0.0]) == pytest.approx((0.5 - 0.25) / 0.75)
    assert choice_confidence([0.5, 0.5]) == 0.0


# --------------------------------------------------------------------------- the served answer


def _question(kind: str, criteria: object):
    body = {"model": "jev-latest", "state": "s", "questions": {"q": {"type": kind, "instructions": "?", "criteria": criteria}}}
    [q] = served_request(parse_systemone(body)).questions
    return q


def test_served_score_answers_carry_the_contract_confidence() -> None:
    for k, probs in [(10, _tilted(10, 0.063, 0)), (4, _tilted(4, 0.1, 3)), (3, np.array([0.0, 0.95, 0.05])),
                     (10, np.eye(10)[7])]:
        answer = jev_answer(_question("score", [f"level {i}" for i in range(k)]), ModelAnswer(probs=probs),
                            automation_threshold=0.9)
        shown = np.array([answer["probabilities"][str(i)] for i in range(k)])
        assert answer["confidence"] == pytest.approx(_by_hand(shown), abs=1e-12)
    flat = jev_answer(_question("score", [f"level {i}" for i in range(10)]), ModelAnswer(probs=_tilted(10, 0.063, 0)),
                      automation_threshold=0.9)
    assert round(flat["confidence"], 3) == 0.0


def test_served_choice_answers_carry_the_contract_confidence() -> None:
    options = {f"o{i}": None for i in range(255)}
    probs = np.full(255, 1.0)
    probs[17] = 3.0
    probs /= probs.sum()
    answer = jev_answer(_question("choice", options), ModelAnswer(probs=probs), automation_threshold=0.9)
    assert answer["choice"] == "o17"
    assert answer["confidence"] == pytest.approx((probs.max() - 1 / 255) / (1 - 1 / 255))
