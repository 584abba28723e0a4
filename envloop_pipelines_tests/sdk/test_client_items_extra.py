"""Issue 27 item 1 through the doors a person uses, with names that exist before and after the fix: the SDK's
check, the CLI's ``--hypothesis`` file and the launchpad's registration step each refuse the issue's hypotheses
before anything is launched or written, naming the field (at 6e02c93 all of them went through, and a
``max_stepz`` hypothesis was registered: ledger, file and MLflow run)."""

from __future__ import annotations

import json
from pathlib import Path

import click
import pytest

from envloop_pipelines.sdk.errors import ClientError

#: The issue's hypotheses, each with the field its refusal names.
ISSUE = [
    ({"change": {"kind": "recipe", "recipe_diff": {"max_stepz": 3}}}, "change.recipe_diff"),
    ({"predicted_delta": "big"}, "predicted_delta"),
    ({"seeds": "abc"}, "seeds"),
    ({"seeds": [5]}, "seeds"),  # values, not a count (issue 34)
    ({"change": {"kind": "banana"}}, "change.kind"),
    ({"change": {}}, "change"),
]


@pytest.mark.parametrize("proposal, field", ISSUE)
def test_the_sdk_and_the_cli_refuse_the_issues_hypotheses_naming_the_field(tmp_path: Path, proposal: dict,
                                                                            field: str) -> None:
    from envloop_pipelines.cli.clients import read_hypothesis as _read_hypothesis
    from envloop_pipelines.sdk.client import _hypothesis_json

    with pytest.raises(ClientError, match=rf"{field.replace('.', '[.]')}:"):  # Client.start_round's check
        _hypothesis_json(proposal)
    path = tmp_path / "hypothesis.json"
    path.write_text(json.dumps(proposal))
    with pytest.raises(click.BadParameter, match=rf"{field.replace('.', '[.]')}:"):  # envloop round start --hypothesis
        _read_hypothesis(path)


def test_the_launchpads_registration_step_writes_nothing_for_an_unknown_recipe_key(tmp_path: Path) -> None:
    """A run launched with the raw config (the doc's curl, the launchpad) reaches this step unchecked."""
    from envloop_pipelines.core.loop.config import LoopConfig
    from envloop_pipelines.core.decision_loop.step_records import EnvironmentSynthesis
    from envloop_pipelines.core.data.snapshots import open_task
    from envloop_pipelines.core.decision_loop.registered_hypothesis import register_hypothesis
    from envloop_pipelines.core.tracking import MlflowTracker

    from click.testing import CliRunner

    from envloop_pipelines.cli import main

    home = tmp_path / "home"
    generated = CliRunner().invoke(main, ["data", "generate", "--users", "6", "--records-per-user", "2"],
                                   env={"ENVLOOP_HOME": str(home)})
    assert generated.exit_code == 0, generated.output  # the task's snapshot: the step reads it
    before = sorted(p for p in home.rglob("*") if p.is_file())
    tracker = MlflowTracker(f"sqlite:///{tmp_path / 'mlflow.db'}", home=home)
    config = LoopConfig(task="personal_agent", home=str(home), safety_families=())
    synthesis = EnvironmentSynthesis(round="r0001", generator="g", n_rows=0, per_cluster={}, clusters=(),
                                     path=str(tmp_path / "none.parquet"), sha256="0" * 64)
    proposal = {"change": {"kind": "recipe", "recipe_diff": {"max_stepz": 3}}, "predicted_delta": 0.02,
                "rationale": "a typo"}
    with pytest.raises(ValueError, match=r"change\.recipe_diff: unknown recipe field\(s\) \['max_stepz'\] \(did you mean 'max_steps'"):
        register_hypothesis(config, open_task("personal_agent", home=home), synthesis, tracker, proposal=proposal)
    assert sorted(p for p in home.rglob("*") if p.is_file()) == before  # no ledger event, no hypothesis file
    assert tracker.client.get_experiment_by_name("personal_agent") is None  # no MLflow run
