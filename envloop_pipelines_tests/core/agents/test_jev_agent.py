"""A decision model served by ``envloop serve`` as the agent of decision environments (the Jev API).

A real checkpoint (the serve tests' small one, two training steps) behind a real server process: the
runner asks each environment's typed question over ``POST /v1/systemone`` and submits the answer
distribution; the rule verifier scores it, and a stored attempt replays to the same verdict.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from envloop_pipelines.core.agents.client import AgentSpec
from envloop_pipelines.core.agents.evaluate import evaluate_agent
from envloop_pipelines.core.agents.runner import replay_in
from envloop_pipelines.core.environments.episode import open_episode
from envloop_pipelines.testing.environments import decision_env, spec_set
from envloop_pipelines.testing.serve import build_checkpoint, start_server

pytestmark = pytest.mark.integration


def test_envloop_serve_answers_decision_environments(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    checkpoint = build_checkpoint(tmp_path / "ckpt")
    server = start_server(checkpoint, tmp_path / "serve", keys=("agent-key",))
    try:
        monkeypatch.setenv("ENVLOOP_TEST_JEV_KEY", "agent-key")
        agent = AgentSpec(f"{server.url}/v1", "jev-latest", api_key_env="ENVLOOP_TEST_JEV_KEY", kind="jev")
        specs = [decision_env(label=i, env_id=f"decision/route-{i}") for i in range(3)]
        result = evaluate_agent(spec_set("route", specs), agent, attempts=1, workers=1, store=False)
    finally:
        server.stop()
    assert result.statuses["error"] == 0 and result.n_attempts == 3
    for a in result.attempts:
        answer = a.final_state["answer"]
        assert sorted(answer) == ["billing", "other", "shipping"] and abs(sum(answer.values()) - 1) < 1e-6
        assert a.messages[1]["role"] == "user" and '"questions"' in a.messages[1]["content"]
        assert a.score["status"] == "scored" and a.prompt_tokens > 0
    # The model gives one distribution for one question: the three environments differ only in their label,
    # so exactly the one whose label is the model's top option passes.
    assert result.statuses["passed"] == 1
    a = result.attempts[0]
    episode = open_episode(specs[0])
    try:
        assert replay_in(a, episode).passed == a.passed
    finally:
        episode.close()
