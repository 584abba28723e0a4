"""Issue 25, duplicated blocks merged: the decision's bar is :func:`gate_bar`'s, the bar the hypothesis's MDE was
registered with, not a second copy of the formula in :func:`decide_promotion`.

The copies had drifted: ``gate_bar`` leaves the seed bound out of a floor of one arm (no spread to bound), while
``decide_promotion`` computed it anyway and crashed on the one arm's sample deviation.
"""

from __future__ import annotations

import pytest

from envloop_pipelines.core.ledger.hypothesis import Gate
from envloop_pipelines.core.loop.promotion import NoiseFloor, decide_promotion, gate_bar

METRIC = "family_macro_accuracy"


def _floor(values: tuple[float, ...], floor: float) -> NoiseFloor:
    return NoiseFloor(key="k", metric=METRIC, values=values, floor=floor, family_floors={})


CASES = [
    (Gate(), _floor((0.50, 0.52, 0.51), 0.02), 0.50, True),  # the seed bound decides
    (Gate(min_delta=0.05), _floor((0.50, 0.52, 0.51), 0.02), 0.55, True),  # min_delta decides
    (Gate(floor_multiplier=3.0), _floor((0.50, 0.50, 0.51), 0.01), 0.60, True),  # multiplier × floor
    (Gate(floor_multiplier=0.5), _floor((0.50, 0.52, 0.51), 0.02), 0.60, True),  # an old loose gate: applied as 1
    (Gate(), _floor((0.50, 0.52, 0.51), 0.02), 0.50, False),  # the RL round: no seed bound
    (Gate(), _floor((0.51,), 0.0), 0.50, True),  # one arm: no spread, no seed bound
]


@pytest.mark.parametrize(("gate", "floor", "champion", "seed_bound"), CASES)
def test_the_decision_applies_gate_bars_bar(gate: Gate, floor: NoiseFloor, champion: float, seed_bound: bool) -> None:
    delta = {"delta": 0.03, "ci_low": 0.01, "ci_high": 0.05}
    decision = decide_promotion(gate, delta, floor, {METRIC: champion + 0.03, "ece": 0.0}, {METRIC: champion},
                                apply_seed_bound=seed_bound)
    expected = gate_bar(gate, floor, champion if seed_bound else None)
    assert decision.checks["bar"] == expected["bar"]
    assert decision.checks["seed_gap"] == expected["seed_gap"]
    assert decision.checks["floor_multiplier"] == expected["floor_multiplier"]
    assert decision.promote == (0.03 > expected["bar"])
