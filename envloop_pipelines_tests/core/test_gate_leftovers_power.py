"""Issue 23, "a hypothesis without an MDE is not registered", at the ledger's own door.

``Ledger.register_hypothesis`` refuses a hypothesis whose ``power`` is missing or whose ``power.mde`` is not a
finite number ≥ 0, whoever registers it (before, only the round's registration step refused). The RL round,
whose floor is measured after registration, registers an analytic MDE from its held-out evaluation's size.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from envloop_pipelines.core.ledger.event_log import EVENT_HYPOTHESIS_REGISTERED
from envloop_pipelines.core.ledger.hypothesis import Gate, Hypothesis, HypothesisRefusedError, power_errors
from envloop_pipelines.core.ledger.ledger import Ledger
from envloop_pipelines.core.storage import atomic_write_bytes

from .measured_power import measured_power

Z975, Z80 = 1.959964, 0.841621


def _hypothesis(power: Any) -> Hypothesis:
    return Hypothesis(task="t", round="r0001", benchmark_version="t@abc", change={"kind": "data"}, predicted_delta=0.01,
                      gate=Gate(), seeds=(1,), recipe_hash="h", power=power)


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("power", [None, {}, {"mde": None}, {"mde": float("nan")}, {"mde": math.inf}, {"mde": -0.01},
                                   {"mde": "0.02"}, {"mde": True}, {"se": 0.01, "why_unmeasured": "no pair"}])
def test_the_ledger_refuses_a_hypothesis_without_an_mde_and_writes_nothing(tmp_path: Path, power: Any) -> None:
    ledger = Ledger("t", tmp_path)
    before = _files(tmp_path)
    with pytest.raises(HypothesisRefusedError, match=r"round r0001: hypothesis refused: power\.mde: "):
        ledger.register_hypothesis(_hypothesis(power))
    assert ledger.hypothesis("r0001") is None and list(ledger.events()) == [] and _files(tmp_path) == before


def test_a_hypothesis_with_its_mde_is_registered_with_it(tmp_path: Path) -> None:
    ledger = Ledger("t", tmp_path)
    assert power_errors({"mde": 0}) == [] and power_errors(measured_power()) == []
    h = _hypothesis(measured_power(0.01, mde=0.02))
    assert ledger.register_hypothesis(h) == h.hash
    event = next(ledger.events(EVENT_HYPOTHESIS_REGISTERED))
    assert event["mde"] == 0.02 and event["underpowered"] is True
    assert ledger.register_hypothesis(h) == h.hash  # a retry is a no-op


def test_a_hypothesis_registered_before_the_rule_still_reads_and_re_registers(tmp_path: Path) -> None:
    """An older ledger's hypothesis (no power in its content) is never rewritten: it reads, and its retry is a no-op."""
    ledger = Ledger("t", tmp_path)
    old = _hypothesis(None)
    atomic_write_bytes(ledger.hypothesis_path("r0001"), json.dumps({**old.to_dict(), "hash": old.hash}).encode())
    ledger._append_registered(old)  # as Ledger.register_hypothesis wrote it before the rule
    assert ledger.hypothesis("r0001").hash == old.hash
    assert ledger.register_hypothesis(old) == old.hash


# -- the RL round: an analytic MDE from its held-out evaluation's size --------------------------------------------

def _rl_config(tmp_path: Path, **kw: Any) -> Any:
    from envloop_pipelines.core.rl_loop.round_config import RlRoundConfig

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"base_model: {tmp_path / 'no-model'}\n")
    return RlRoundConfig(task="shell-rl", recipe=str(recipe), home=str(tmp_path), **kw)


@pytest.mark.parametrize("n_holdout, eval_attempts, predicted, underpowered", [
    (2, 2, 0.05, True),    # n = 4: se 0.354, MDE 0.99
    (50, 4, 0.2, False),   # n = 200: se 0.05, MDE 0.14
])
def test_the_rl_round_registers_an_analytic_mde(tmp_path: Path, n_holdout: int, eval_attempts: int, predicted: float,
                                                underpowered: bool) -> None:
    from envloop_pipelines.core.rl_loop.round_steps import register_rl_hypothesis
    from envloop_pipelines.core.tracking import KIND_HYPOTHESIS, TAG_KIND, TAG_ROUND, TAG_UNDERPOWERED, MlflowTracker

    from .test_rl_round import dataset

    config = _rl_config(tmp_path, eval_attempts=eval_attempts, predicted_delta=predicted)
    ds = dataset([0, 1], list(range(10, 10 + n_holdout)))
    tracker = MlflowTracker(home=tmp_path)
    hyp = register_rl_hypothesis(config, ds, "r0001", tracker, sampler={"kind": "test"}).hypothesis
    n = n_holdout * eval_attempts
    se = math.sqrt(2 * 0.25 / n)
    assert hyp.power["se"] == pytest.approx(se)
    assert hyp.power["mde"] == pytest.approx((Z975 + Z80) * se, rel=1e-5)
    assert hyp.power["n_environments"] == n_holdout and hyp.power["attempts_per_environment"] == eval_attempts
    assert hyp.underpowered is underpowered and hyp.power["confidence_level"] == 0.95
    event = next(Ledger("shell-rl", tmp_path).events(EVENT_HYPOTHESIS_REGISTERED))
    assert event["mde"] == pytest.approx(hyp.power["mde"]) and event["underpowered"] is underpowered
    run = tracker.find_run("shell-rl", {TAG_ROUND: "r0001", TAG_KIND: KIND_HYPOTHESIS})
    assert tracker.run_data(run.run_id).data.tags[TAG_UNDERPOWERED] == str(underpowered).lower()
    # A retry registers the same hypothesis (its power is part of its content).
    assert register_rl_hypothesis(config, ds, "r0001", tracker, sampler={"kind": "test"}).hash == hyp.hash


def test_an_rl_round_with_no_held_out_environment_has_no_mde_and_is_refused(tmp_path: Path) -> None:
    from envloop_pipelines.core.rl_loop.round_steps import register_rl_hypothesis
    from envloop_pipelines.core.tracking import MlflowTracker

    from .test_rl_round import dataset

    with pytest.raises(HypothesisRefusedError, match="power.mde"):
        register_rl_hypothesis(_rl_config(tmp_path), dataset([0, 1], []), "r0001", MlflowTracker(home=tmp_path),
                               sampler={"kind": "test"})
    assert list(Ledger("shell-rl", tmp_path).events()) == []
