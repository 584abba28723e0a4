"""``envloop round status`` says why a round's run failed (issue 27, item 3), on the local instance."""

from __future__ import annotations

import json
from pathlib import Path

import dagster as dg
from click.testing import CliRunner

from envloop_pipelines.cli import main


@dg.op
def baseline_eval() -> None:
    raise ValueError("champion checkpoint missing: manifest.json not found")


@dg.job(name="round_job")
def failing_round_job() -> None:
    baseline_eval()


def test_a_failed_round_shows_the_failed_steps_own_error(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("ENVLOOP_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster"))
    (tmp_path / "dagster").mkdir()
    with dg.instance_for_test(temp_dir=str(tmp_path / "dagster")) as instance:
        instance.add_dynamic_partitions("rounds", ["r0001"])
        result = failing_round_job.execute_in_process(instance=instance, tags={"dagster/partition": "r0001"},
                                                      raise_on_error=False)
        assert not result.success
    runner = CliRunner()
    shown = runner.invoke(main, ["round", "status", "--json"], catch_exceptions=False)
    [row] = json.loads(shown.output)
    assert (row["round"], row["status"]) == ("r0001", "FAILURE")
    assert row["reason"] == "baseline_eval: ValueError: champion checkpoint missing: manifest.json not found"
    text = runner.invoke(main, ["round", "status"], catch_exceptions=False).output
    assert "failed: baseline_eval: ValueError: champion checkpoint missing" in text, text
