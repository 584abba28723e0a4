"""A floor that puts promotion out of reach is said up front (issue 27, item 9)."""

from __future__ import annotations

import pytest

from envloop_pipelines.core.ledger.hypothesis import Gate
from envloop_pipelines.core.loop.promotion import NoiseFloor, decide_promotion, unreachable_bar


def floor_of(*values: float) -> NoiseFloor:
    return NoiseFloor(key="k", metric="family_macro_accuracy", values=values, floor=max(values) - min(values),
                      family_floors={})


def test_two_far_apart_null_arms_put_the_bar_above_what_accuracy_can_gain() -> None:
    floor = floor_of(0.286, 0.762)  # the arms; release 1 is the first (the champion)
    message = unreachable_bar(floor, 0.286)
    assert message is not None and message.startswith("no candidate can be promoted: the bar 2.84")
    assert "(0.7140)" in message and "2 null arms" in message and "noise_arms" in message
    # the decision agrees: even the best possible candidate (accuracy 1.0) does not clear that bar
    best = decide_promotion(Gate(), {"delta": 1 - 0.286, "ci_low": 0.5, "ci_high": 0.9}, floor,
                            {"family_macro_accuracy": 1.0, "ece": 0.0}, {"family_macro_accuracy": 0.286, "ece": 0.0})
    assert not best.promote and best.checks["bar"] == pytest.approx(2.8411, abs=1e-3)


def test_a_tight_floor_leaves_room_and_says_nothing() -> None:
    assert unreachable_bar(floor_of(0.50, 0.51, 0.52), 0.50) is None
    # a gate on another metric than the floor's is refused elsewhere; no claim here
    assert unreachable_bar(floor_of(0.286, 0.762), 0.286, Gate(primary_metric="nll", direction="decrease")) is None
    # a champion at the ceiling leaves nothing to gain, whatever the floor
    assert unreachable_bar(floor_of(0.50, 0.51, 0.52), 1.0) is not None
