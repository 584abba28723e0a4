"""The agent client over real HTTP: a scripted OpenAI-compatible server on loopback, and every way a call fails."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from envloop_pipelines.core.agents.client import AgentError, AgentSpec, ChatClient, JevClient, jev_question
from envloop_pipelines.core.agents.runner import BASH_TOOL
from envloop_pipelines.testing.scripted_agents import ScriptedServer, scripted_server
from envloop_pipelines.testing.services import free_port


@pytest.fixture(scope="module")
def server() -> Iterator[ScriptedServer]:
    with scripted_server() as s:
        yield s


def test_a_completion_with_a_tool_call_comes_back_in_the_chat_format(server: ScriptedServer) -> None:
    client = ChatClient(AgentSpec(server.url, "solver-p1.0"))
    turn = client.complete([{"role": "user", "content": "Count the lines of the file a.log and write the number alone"}],
                           tools=[BASH_TOOL], seed=7, max_tokens=100)
    assert turn.message == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls -la"}'}}]}
    assert turn.completion_tokens == 12 and turn.prompt_tokens > 0 and turn.finish_reason == "tool_calls"
    sent = server.requests[-1]
    assert sent["seed"] == 7 and sent["max_tokens"] == 100 and sent["tools"] == [BASH_TOOL]


@pytest.mark.parametrize("model,message", [
    ("http-error", "HTTP 503 from"),
    ("not-a-completion", "not a chat completion"),
    ("no-such-model", "HTTP 404 from"),
])
def test_endpoint_failures_are_agent_errors(server: ScriptedServer, model: str, message: str) -> None:
    with pytest.raises(AgentError, match=message):
        ChatClient(AgentSpec(server.url, model)).complete([{"role": "user", "content": "hi"}])


def test_a_dead_endpoint_and_a_timeout_are_agent_errors(server: ScriptedServer) -> None:
    with pytest.raises(AgentError, match="connection failed"):
        ChatClient(AgentSpec(f"http://127.0.0.1:{free_port()}/v1", "m")).complete([{"role": "user", "content": "hi"}])
    with pytest.raises(AgentError, match="timeout"):
        ChatClient(AgentSpec(server.url, "slow"), timeout_s=0.3).complete([{"role": "user", "content": "hi"}])


def test_the_key_comes_from_its_variable_and_is_never_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    agent = AgentSpec("http://127.0.0.1:1/v1", "m", api_key_env="ENVLOOP_TEST_AGENT_KEY")
    with pytest.raises(AgentError, match=r"\$ENVLOOP_TEST_AGENT_KEY is not set"):
        agent.api_key()
    monkeypatch.setenv("ENVLOOP_TEST_AGENT_KEY", "sk-secret")
    assert agent.api_key() == "sk-secret" and "sk-secret" not in str(agent.to_dict())
    with pytest.raises(ValueError, match="base_url must be an http"):
        AgentSpec("localhost:8000", "m")
    with pytest.raises(ValueError, match="kind must be one of chat, jev"):
        AgentSpec("http://x/v1", "m", kind="grpc")  # type: ignore[arg-type]


def test_a_jev_endpoint_answers_a_distribution(server: ScriptedServer) -> None:
    question = {"type": "choice", "instructions_text": "Which team?", "state_text": "charged twice",
                "option_keys": ["billing", "other"], "option_texts": ["Charges", None]}
    assert jev_question(question) == {"type": "choice", "instructions": "Which team?",
                                      "criteria": {"billing": "Charges", "other": None}}
    jev = JevClient(AgentSpec(server.url, "jev-latest", kind="jev"))
    raw, probs, tokens = jev.answer(jev.request(question), question)
    assert probs == {"billing": 0.5, "other": 0.5} and tokens == 20
    noul = {"type": "noul", "instructions_text": "Refund?", "option_keys": ["true", "false"], "option_texts": [None, None]}
    assert jev.answer(jev.request(noul), noul)[1] == {"true": 0.5, "false": 0.5}
