"""``envloop train`` and ``envloop eval``: the entry points a training pod runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from envloop_pipelines.cli import main

pytestmark = pytest.mark.slow


def test_train_then_eval_on_an_open_split(tmp_path: Path) -> None:
    env = {"ENVLOOP_HOME": str(tmp_path / "home")}
    runner = CliRunner()
    assert runner.invoke(main, ["data", "generate", "--users", "20", "--records-per-user", "3"], env=env).exit_code == 0
    out = tmp_path / "ckpt"
    result = runner.invoke(main, ["train", "--task", "personal_agent", "--recipe", "packaged:decision_head_cpu.yaml",
                                  "--out", str(out), "--recipe-override", "max_steps=2",
                                  "--recipe-override", "max_length=128"], env=env,
                           catch_exceptions=False)
    assert result.exit_code == 0, result.output
    trained = json.loads(result.output[result.output.index("{"):])
    assert trained["checkpoint"] == str(out) and (out / "manifest.json").exists()
    result = runner.invoke(main, ["eval", "--checkpoint", str(out), "--task", "personal_agent", "--split", "dev", "--json"],
                           env=env, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    metrics = json.loads(result.output[result.output.index("{"):])
    for key in ("family_macro_accuracy", "brier", "nll", "ece", "coverage_at_5pct", "aurc", "fnr/needs_approval"):
        assert key in metrics
    assert metrics["split"] == "dev" and metrics["n_predicted"] > 0
    # Test and holdout labels are the verifier's: the eval CLI does not offer them.
    refused = runner.invoke(main, ["eval", "--checkpoint", str(out), "--task", "personal_agent", "--split", "test"], env=env)
    assert refused.exit_code == 2 and "'test' is not one of" in refused.output
    # A checkpoint is never overwritten; a bad override names the field.
    again = runner.invoke(main, ["train", "--task", "personal_agent", "--recipe", "packaged:decision_head_cpu.yaml",
                                 "--out", str(out)], env=env)
    assert again.exit_code == 2 and "never overwritten" in again.output
    bad = runner.invoke(main, ["train", "--task", "personal_agent", "--recipe", "packaged:decision_head_cpu.yaml",
                               "--out", str(tmp_path / "x"), "--recipe-override", "lr=-1"], env=env)
    assert bad.exit_code == 2 and "lr" in bad.output
