"""Issue 27 item 1: one validation of a whole hypothesis, called by every door before anything is registered
or launched; each refusal names the field and writes nothing."""

from __future__ import annotations

import json
from pathlib import Path

import click
import pytest

from envloop_pipelines.core.ledger.hypothesis import Gate, Hypothesis, HypothesisRefusedError
from envloop_pipelines.core.ledger.ledger import Ledger
from envloop_pipelines.core.decision_loop.registered_hypothesis import proposal_errors

BAD = [
    ({"change": {"kind": "recipe", "recipe_diff": {"max_stepz": 3}}}, "change.recipe_diff",
     "unknown recipe field(s) ['max_stepz'] (did you mean 'max_steps' for 'max_stepz'?); allowed: "),
    ({"change": {"kind": "recipe", "recipe_diff": {"max_steps": -3}}}, "change.recipe_diff", "max_steps"),
    ({"change": {"kind": "recipe", "recipe_diff": {"seed": 3}}}, "change.recipe_diff.seed", "hypothesis's seeds"),
    ({"change": {"kind": "recipe", "recipe_diff": [1]}}, "change.recipe_diff", "must be an object"),
    ({"change": {"kind": "recipe"}}, "change.recipe_diff", "needs recipe_diff"),
    ({"change": {"kind": "recipe", "recipe_overrides": {"max_steps": 3}}}, "change.recipe_overrides",
     "a hypothesis's own recipe change is change.recipe_diff"),
    ({"predicted_delta": "big"}, "predicted_delta", 'must be a finite number, got "big"'),
    ({"predicted_delta": float("nan")}, "predicted_delta", "must be a finite number, got NaN"),
    ({"predicted_delta": True}, "predicted_delta", "must be a finite number, got true"),
    ({"seeds": "abc"}, "seeds", 'must be a count of seeds, an integer from 1 to 8 (the loop draws them after '
                                'registration), got "abc"'),
    ({"seeds": 0}, "seeds", "must be a count of seeds, an integer from 1 to 8"),
    ({"seeds": True}, "seeds", "must be a count of seeds"),
    # issue 34: a person says how many seeds, never which (a preview on test, then the winner registered)
    ({"seeds": [3004]}, "seeds", "a round's seeds are drawn by the loop after registration; give a count (how many, "
                                 "e.g. \"seeds\": 1), not values (got [3004])"),
    ({"seeds": [3, 3]}, "seeds", "give a count"),
    ({"change": {"kind": "banana"}}, "change.kind", 'must be one of data, recipe, got "banana"'),
    ({"change": {}}, "change", "must not be empty"),
    ({"change": "more data"}, "change", "must be an object"),
    ({"change": {"kind": "rl_from_verified_attempts"}}, "change.kind", "must be one of data, recipe"),
    ({"rationale": 3}, "rationale", "must be text"),
]


@pytest.mark.parametrize("proposal, field, message", BAD)
def test_each_bad_field_is_refused_by_every_door_and_named(tmp_path: Path, proposal: dict, field: str,
                                                           message: str) -> None:
    from envloop_pipelines.cli.clients import read_hypothesis as _read_hypothesis
    from envloop_pipelines.sdk.client import _hypothesis_json
    from envloop_pipelines.sdk.errors import RefusedError

    errors = proposal_errors(proposal)
    assert any(e.startswith(field + ":") and message in e for e in errors), errors
    path = tmp_path / "hyp.json"
    path.write_text(json.dumps(proposal))
    with pytest.raises(click.BadParameter, match=field.replace(".", r"\.")):  # CLI --hypothesis
        _read_hypothesis(path)
    with pytest.raises(RefusedError, match=field.replace(".", r"\.")):  # SDK, launchpad JSON
        _hypothesis_json(proposal)


def test_a_good_proposal_passes() -> None:
    good = {"change": {"kind": "recipe", "recipe_diff": {"max_steps": 80, "lora": {"r": 4}}}, "predicted_delta": 0.02,
            "gate": {"min_delta": 0.01}, "seeds": 2, "rationale": "under-trained"}
    assert proposal_errors(good) == []
    assert proposal_errors({}) == []  # everything derived


def test_the_ledger_refuses_an_invalid_hypothesis_and_writes_nothing(tmp_path: Path) -> None:
    ledger = Ledger("t", tmp_path)
    bad = Hypothesis(task="t", round="r0001", benchmark_version="t@abc",
                     change={"kind": "recipe", "recipe_diff": {"max_stepz": 3}}, predicted_delta=float("inf"),
                     gate=Gate(), seeds=("abc",), recipe_hash="h")  # type: ignore[arg-type]
    with pytest.raises(HypothesisRefusedError) as refused:
        ledger.register_hypothesis(bad)
    for field in ("change.recipe_diff", "predicted_delta", "seeds"):
        assert f"{field}:" in str(refused.value)
    assert ledger.hypothesis("r0001") is None and list(ledger.events()) == []
    assert [p for p in ledger.root.rglob("*") if p.is_file()] == []


def test_the_old_spelling_of_the_recipe_change_is_refused_everywhere(tmp_path: Path) -> None:
    """Issue 46: ``change.recipe_overrides`` (the loop's override's name) is refused by the ledger's registration
    too, and a hypothesis a ledger holds from before under that name is refused, not trained without its change."""
    from envloop_pipelines.core.ledger.event_log import LedgerError
    from envloop_pipelines.core.ledger.hypothesis import recipe_diff

    ledger = Ledger("t", tmp_path)
    old = Hypothesis(task="t", round="r0001", benchmark_version="t@abc",
                     change={"kind": "recipe", "recipe_overrides": {"max_steps": 3}}, predicted_delta=0.01,
                     gate=Gate(), seeds=(1,), recipe_hash="h")
    with pytest.raises(HypothesisRefusedError, match=r"change\.recipe_overrides: .*change\.recipe_diff"):
        ledger.register_hypothesis(old)
    assert list(ledger.events()) == []
    with pytest.raises(LedgerError, match=r"change\.recipe_overrides: .*register the hypothesis again"):
        recipe_diff(old.change)
    assert recipe_diff({"kind": "recipe", "recipe_diff": {"max_steps": 3}}) == {"max_steps": 3}
    assert recipe_diff({"kind": "data"}) == {}


def test_the_registration_step_refuses_before_writing_anything(tmp_path: Path) -> None:
    """``register_hypothesis`` (the launchpad's registration step): no ledger, file or MLflow run."""
    from envloop_pipelines.core.loop.config import LoopConfig
    from envloop_pipelines.core.decision_loop.step_records import EnvironmentSynthesis
    from envloop_pipelines.core.data.snapshots import TaskSnapshot
    from envloop_pipelines.core.decision_loop.registered_hypothesis import register_hypothesis
    from envloop_pipelines.core.tracking import MlflowTracker

    home = tmp_path / "home"
    home.mkdir()
    tracker = MlflowTracker(f"sqlite:///{tmp_path / 'mlflow.db'}", home=home)
    config = LoopConfig(task="tickets", home=str(home), safety_families=())
    synthesis = EnvironmentSynthesis(round="r0001", generator="g", n_rows=0, per_cluster={}, clusters=(),
                                     path=str(tmp_path / "none.parquet"), sha256="0" * 64)
    with pytest.raises(ValueError, match=r"predicted_delta: must be a finite number, got \"big\""):
        register_hypothesis(config, TaskSnapshot(tmp_path / "never-read"), synthesis, tracker,
                            proposal={"predicted_delta": "big",
                                      "change": {"kind": "recipe", "recipe_diff": {"max_stepz": 1}}})
    assert [p for p in home.rglob("*")] == []
    assert tracker.client.get_experiment_by_name("tickets") is None  # no MLflow experiment, so no run
