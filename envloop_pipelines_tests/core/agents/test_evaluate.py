"""Evaluation end to end: a scripted policy over real HTTP solving a known fraction p of shell environments.

The solver (``envloop_pipelines/testing/scripted_agents.py``) solves an attempt with probability p,
decided by a seeded RNG with the attempt's sampling seed, so attempts are independent Bernoulli(p)
draws: pass@1 must lie within its interval of p, and pass@k within its interval of 1 - (1 - p)^k,
growing with k.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from envloop_pipelines.core.agents.attempts import read_attempts
from envloop_pipelines.core.agents.client import AgentSpec
from envloop_pipelines.core.agents.evaluate import (
    HoldoutAttemptsError,
    evaluate_agent,
    run_attempts,
    stored_evaluations,
    track_evaluation,
)
from envloop_pipelines.core.agents.runner import AttemptLimits, replay_in
from envloop_pipelines.core.environments.episode import open_episode
from envloop_pipelines.testing.environments import shell_env, spec_set
from envloop_pipelines.testing.scripted_agents import ScriptedServer, scripted_server
from envloop_pipelines.testing.services import free_port


@pytest.fixture(scope="module")
def server() -> Iterator[ScriptedServer]:
    with scripted_server() as s:
        yield s


def test_pass_at_k_of_a_known_p_lies_within_its_intervals(server: ScriptedServer, tmp_path: Path) -> None:
    p, k_max = 0.5, 4
    dataset = spec_set("shell-p", [shell_env(seed) for seed in range(10)])
    result = evaluate_agent(dataset, AgentSpec(server.url, f"solver-p{p}"), attempts=k_max, workers=4, home=tmp_path)
    assert result.n_attempts == 40 and result.statuses["error"] == 0
    assert [r.k for r in result.pass_at_k] == [1, 2, 4]
    for row in result.pass_at_k:
        expected = 1 - (1 - p) ** row.k
        assert row.ci_low <= expected <= row.ci_high, (row, expected)
        assert row.n_environments == 10
    # pass@1 varies over environments (bootstrap); pass@4 is 1.0 wherever an attempt passed, and when that is
    # every environment the bootstrap has nothing to resample and Wilson's interval (over 10) stands in.
    assert result.pass_at_k[0].method == "bootstrap"
    assert result.pass_at_k[-1].method == ("wilson" if result.pass_at_k[-1].value == 1.0 else "bootstrap")
    values = [r.value for r in result.pass_at_k]
    assert values == sorted(values) and values[-1] > values[0] + 0.2
    # The table and the cost add up to the attempts.
    assert sum(r.attempts for r in result.per_environment) == 40
    assert sum(r.passed for r in result.per_environment) == result.statuses["passed"]
    assert result.cost.completion_tokens == 40 * 3 * 12 and result.cost.tool_calls == 40 * 2
    # One attempt per environment: pass@1 with the Wilson interval, covering p too.
    single = evaluate_agent(dataset, AgentSpec(server.url, f"solver-p{p}"), attempts=1, workers=4, home=tmp_path)
    (row,) = single.pass_at_k
    assert row.method == "wilson" and row.ci_low <= p <= row.ci_high


def test_a_run_is_stored_replays_and_is_logged_to_mlflow(server: ScriptedServer, tmp_path: Path) -> None:
    from envloop_pipelines.core.tracking import KIND_AGENT_EVAL, TAG_AGENT, TAG_KIND, MlflowTracker

    dataset = spec_set("shell-store", [shell_env(seed) for seed in range(3)])
    agent = AgentSpec(server.url, "solver-p0.5")
    result = evaluate_agent(dataset, agent, attempts=2, workers=2, home=tmp_path)
    folder = Path(result.run_dir)
    assert folder.parent.name == dataset.version and folder.name == result.run_id
    stored = read_attempts(folder)
    assert [a.to_dict() for a in stored] == [a.to_dict() for a in sorted(result.attempts, key=lambda a: a.key)]
    assert json.loads((folder / "summary.json").read_text())["pass_at_k"][0]["value"] == result.pass_at_1.value
    assert stored_evaluations(dataset.name, dataset.version, home=tmp_path)[0]["run_id"] == result.run_id
    # Replaying each stored transcript against a fresh episode reproduces its verdict.
    specs = {e.id: e for e in dataset.environments}
    for a in stored:
        episode = open_episode(specs[a.environment_id], work_root=tmp_path, home=tmp_path)
        try:
            assert replay_in(a, episode).passed == a.passed
        finally:
            episode.close()
    tracker = MlflowTracker(f"sqlite:///{tmp_path / 'mlflow.db'}", home=tmp_path)
    run = track_evaluation(result, tracker)
    data = tracker.run_data(run.run_id).data
    assert data.tags[TAG_KIND] == KIND_AGENT_EVAL and data.tags[TAG_AGENT] == agent.label
    assert data.metrics["pass_at_1"] == pytest.approx(result.pass_at_1.value)
    assert data.metrics["pass_at_2.ci_high"] >= data.metrics["pass_at_2"] >= data.metrics["pass_at_2.ci_low"]
    assert data.params["dataset_version"] == dataset.version and data.params["attempts"] == "2"


def test_failures_are_counted_not_raised(server: ScriptedServer, tmp_path: Path) -> None:
    dataset = spec_set("shell-fail", [shell_env(seed) for seed in range(2)])
    dead = evaluate_agent(dataset, AgentSpec(f"http://127.0.0.1:{free_port()}/v1", "m"), attempts=2, home=tmp_path,
                          store=False)
    assert dead.statuses == {"passed": 0, "failed": 0, "error": 4} and dead.errors == {"connection failed": 4}
    assert dead.pass_at_1.value == 0.0
    broken = evaluate_agent(dataset, AgentSpec(server.url, "malformed-json"), attempts=1, home=tmp_path, store=False,
                            limits=AttemptLimits(max_turns=3))
    assert broken.statuses["error"] == 2 and broken.errors == {"malformed tool call call_0": 2}


def test_heldout_environments_give_aggregates_only(server: ScriptedServer, tmp_path: Path) -> None:
    specs = [shell_env(0), shell_env(1), shell_env(2, split="heldout"), shell_env(3, split="heldout")]
    dataset = spec_set("shell-loop", specs)
    held = evaluate_agent(dataset, AgentSpec(server.url, "solver-p1.0"), attempts=1, split="heldout", home=tmp_path)
    assert held.aggregate_only and held.per_environment == () and held.attempts == () and held.errors == {}
    assert held.pass_at_1.value == 1.0 and held.n_environments == 2
    folder = Path(held.run_dir)
    assert sorted(p.name for p in folder.iterdir()) == ["summary.json"]
    summary = (folder / "summary.json").read_text()
    assert "shell/0002" not in summary and "messages" not in summary  # no environment named, no transcript
    with pytest.raises(HoldoutAttemptsError, match="held out"):
        run_attempts(dataset, AgentSpec(server.url, "solver-p1.0"), attempts=1, home=tmp_path)
    train = run_attempts(dataset, AgentSpec(server.url, "solver-p1.0"), attempts=2, split="train", home=tmp_path)
    assert len(train) == 4 and all(a.passed and a.split == "train" for a in train)
    with pytest.raises(ValueError, match="no environments in split 'dev'"):
        evaluate_agent(dataset, AgentSpec(server.url, "solver-p1.0"), attempts=1, split="dev", home=tmp_path)
