"""The runner over real HTTP and real sandboxes: transcripts, limits, recorded failures, replay."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from envloop_pipelines.core.agents.attempts import Attempt, read_attempts, write_attempts
from envloop_pipelines.core.agents.client import AgentSpec
from envloop_pipelines.core.agents.runner import BASH_TOOL, AttemptLimits, replay_in, run_attempt
from envloop_pipelines.core.environments.episode import open_episode
from envloop_pipelines.core.environments.spec import EnvironmentSpec
from envloop_pipelines.testing.environments import decision_env, shell_env
from envloop_pipelines.testing.scripted_agents import ScriptedServer, scripted_server
from envloop_pipelines.testing.services import free_port


@pytest.fixture(scope="module")
def server() -> Iterator[ScriptedServer]:
    with scripted_server() as s:
        yield s


def attempt(spec: EnvironmentSpec, agent: AgentSpec, tmp_path: Path, *, index: int = 0,
            limits: AttemptLimits = AttemptLimits()) -> Attempt:
    episode = open_episode(spec, work_root=tmp_path, home=tmp_path / "home")
    try:
        return run_attempt(episode, agent, dataset="d", dataset_version="v1", split=spec.split, seed=spec.seed,
                           attempt=index, limits=limits)
    finally:
        episode.close()


def replayed(a: Attempt, spec: EnvironmentSpec, tmp_path: Path) -> dict:
    episode = open_episode(spec, work_root=tmp_path, home=tmp_path / "home")
    try:
        return replay_in(a, episode).to_dict()
    finally:
        episode.close()


def test_a_solving_agent_passes_with_its_whole_transcript(server: ScriptedServer, tmp_path: Path) -> None:
    spec = shell_env(3)
    a = attempt(spec, AgentSpec(server.url, "solver-p1.0"), tmp_path)
    assert a.status == "passed" and a.passed and a.error == "" and a.score["passed"] is True
    assert [m["role"] for m in a.messages] == ["system", "user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert a.messages[1] == {"role": "user", "content": spec.instruction}
    calls = [m["tool_calls"][0] for m in a.messages if m.get("tool_calls")]
    assert [json.loads(c["function"]["arguments"])["command"] for c in calls][0] == "ls -la"
    assert [m["tool_call_id"] for m in a.messages if m["role"] == "tool"] == [c["id"] for c in calls]
    assert a.messages[3]["content"].startswith("exit_code: 0\nstdout:\n") and "notes.txt" in a.messages[3]["content"]
    assert a.tools == [BASH_TOOL] and a.turns == 3 and a.tool_calls == 2
    assert a.completion_tokens == 36 and a.prompt_tokens > 0 and a.wall_s > 0
    # every chat request of the attempt carried its sampling seed
    assert {r["seed"] for r in server.requests[-3:]} == {a.sampling_seed}
    assert a.final_state["files"]  # the final working directory
    # replay: the same tool calls in a fresh episode give the same verdict
    assert replayed(a, spec, tmp_path)["passed"] is True


def test_a_wrong_agent_fails_and_replays_to_the_same_verdict(server: ScriptedServer, tmp_path: Path) -> None:
    spec = shell_env(4)
    a = attempt(spec, AgentSpec(server.url, "solver-p0.0"), tmp_path)
    assert a.status == "failed" and not a.passed and a.error == ""
    assert replayed(a, spec, tmp_path)["passed"] is False


@pytest.mark.parametrize("model,message", [
    ("malformed-json", "malformed tool call call_0: arguments are not JSON"),
    ("unknown-tool", "malformed tool call call_0: unknown tool 'python' (tools: bash)"),
    ("no-command", "malformed tool call call_0: arguments need a string 'command'"),
    ("http-error", "HTTP 503 from"),
    ("not-a-completion", "not a chat completion"),
])
def test_a_misbehaving_endpoint_is_a_recorded_error(server: ScriptedServer, tmp_path: Path, model: str, message: str) -> None:
    a = attempt(shell_env(1), AgentSpec(server.url, model), tmp_path)
    assert a.status == "error" and not a.passed and message in a.error
    assert a.score is not None and a.score["passed"] is False  # the untouched state was still judged
    if model in ("malformed-json", "unknown-tool", "no-command"):
        assert a.messages[-1]["role"] == "tool" and a.messages[-1]["content"].startswith("error: malformed tool call")


def test_a_dead_endpoint_and_a_slow_one_are_recorded_errors(server: ScriptedServer, tmp_path: Path) -> None:
    dead = attempt(shell_env(1), AgentSpec(f"http://127.0.0.1:{free_port()}/v1", "solver-p1.0"), tmp_path)
    assert dead.status == "error" and dead.error.startswith("connection failed") and dead.turns == 0
    slow = attempt(shell_env(1), AgentSpec(server.url, "slow"), tmp_path,
                   limits=AttemptLimits(request_timeout_s=0.3))
    assert slow.status == "error" and slow.error.startswith("timeout")


def test_turn_and_token_limits_end_an_attempt_and_the_state_is_judged(server: ScriptedServer, tmp_path: Path) -> None:
    one_turn = attempt(shell_env(3), AgentSpec(server.url, "solver-p1.0"), tmp_path, limits=AttemptLimits(max_turns=1))
    assert one_turn.status == "failed" and one_turn.turns == 1 and "turn limit: 1 model calls" in one_turn.error
    # the solving call is the second: two turns solve the task even though the agent never said it was done
    two_turns = attempt(shell_env(3), AgentSpec(server.url, "solver-p1.0"), tmp_path, limits=AttemptLimits(max_turns=2))
    assert two_turns.status == "passed" and "turn limit" in two_turns.error
    tokens = attempt(shell_env(3), AgentSpec(server.url, "solver-p1.0"), tmp_path, limits=AttemptLimits(max_tokens=12))
    assert tokens.turns == 1 and "token limit: 12 of 12 completion tokens used" in tokens.error
    assert server.requests[-1]["max_tokens"] == 12


def test_decision_environments_take_an_option_or_a_distribution(server: ScriptedServer, tmp_path: Path) -> None:
    spec = decision_env(label=0)
    right = attempt(spec, AgentSpec(server.url, "chooser-billing"), tmp_path)
    assert right.status == "passed" and right.final_state["answer"] == "billing" and right.tools == []
    assert "Type: choice" in right.messages[1]["content"] and "- billing: Charges and refunds" in right.messages[1]["content"]
    wrong = attempt(spec, AgentSpec(server.url, "chooser-other"), tmp_path)
    assert wrong.status == "failed" and replayed(wrong, spec, tmp_path)["passed"] is False
    bogus = attempt(spec, AgentSpec(server.url, "chooser-sales"), tmp_path)
    assert bogus.status == "error" and "is not one of the options" in bogus.error
    jev = attempt(spec, AgentSpec(server.url, "jev-latest", kind="jev"), tmp_path)
    assert jev.final_state["answer"] == {"billing": 1 / 3, "shipping": 1 / 3, "other": 1 / 3}
    assert jev.status in ("passed", "failed") and jev.score["status"] == "scored"
    assert replayed(jev, spec, tmp_path)["value"] == jev.score["value"]
    jev_in_shell = attempt(shell_env(1), AgentSpec(server.url, "jev-latest", kind="jev"), tmp_path)
    assert jev_in_shell.status == "error" and "cannot act in a terminal environment" in jev_in_shell.error


def test_attempts_round_trip_through_jsonl_and_bad_lines_are_named(server: ScriptedServer, tmp_path: Path) -> None:
    a = attempt(shell_env(3), AgentSpec(server.url, "solver-p1.0"), tmp_path)
    path = write_attempts(tmp_path / "run", [a])
    (back,) = read_attempts(path)
    assert back.to_dict() == a.to_dict() and back.transcript_sha256() == a.transcript_sha256()
    bad = tmp_path / "bad.jsonl"
    raw = a.to_dict()
    bad.write_text(json.dumps(raw) + "\n" + json.dumps({**raw, "turns": "three"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: field 'turns' must be int, got str"):
        read_attempts(bad)
    bad.write_text("{not json\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: not JSON"):
        read_attempts(bad)
    with pytest.raises(ValueError, match=r"passed=True contradicts status 'failed'"):
        Attempt.from_dict({**raw, "status": "failed"})
