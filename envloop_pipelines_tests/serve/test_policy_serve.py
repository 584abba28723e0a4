"""``envloop serve --policy``: a causal LM + LoRA adapter on the OpenAI chat with tool calls, over real HTTP.

The policy is a tiny Qwen2 (``test_causal_sft.tiny_chat_lm``) whose vocabulary
holds one whole tool call as a single token, LoRA-trained to emit it for one
prompt: a model this small cannot learn a 30-token call by heart in seconds,
and the point here is the server (chat template, generation, parsing
``<tool_call>`` blocks into OpenAI ``tool_calls``, bounds, errors), not the model.
The server runs as its own process (``python -m envloop_pipelines.cli.serve``)
on a loopback port.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from envloop_pipelines.core.model.causal_sft import CausalSftRecipe, read_policy_checkpoint, train_causal_sft
from envloop_pipelines.core.serve.generation import parse_tool_calls
from envloop_pipelines_tests.core.test_causal_sft import BASH_TOOL, LORA, call, corpus, tiny_chat_lm
from envloop_pipelines.testing.serve import ServerProcess, start_server

KEY = "policy-test-key"
CALL_BLOCK = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la"}}\n</tool_call>'
ROW = {"messages": [{"role": "user", "content": "List the files."},
                    {"role": "assistant", "content": None, "tool_calls": [call(0, "ls -la")]}], "tools": [BASH_TOOL]}
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_chat_lm(tmp_path_factory.mktemp("policy-lm") / "tiny", corpus([ROW]), whole_tokens=(CALL_BLOCK,))


@pytest.fixture(scope="module")
def policy_dir(lm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    recipe = CausalSftRecipe(base_model=str(lm_dir), max_length=512, lora=LORA, lr=2e-2, epochs=15, batch_size=1,
                             warmup_ratio=0.0, lr_scheduler="constant_with_warmup")
    return Path(train_causal_sft([ROW], recipe, tmp_path_factory.mktemp("policy") / "ckpt", data_hash="serve-test").path)


@pytest.fixture(scope="module")
def server(policy_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = start_server(None, tmp_path_factory.mktemp("policy-serve"), "--policy", str(policy_dir),
                        "--max-tokens", str(MAX_TOKENS), "--max-body-bytes", "65536", keys=(KEY,))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def model_id(policy_dir: Path) -> str:
    return f"envloop-policy-{read_policy_checkpoint(policy_dir).sha256[:12]}"


def test_generated_tool_call_blocks_come_back_as_openai_tool_calls(server: ServerProcess, model_id: str) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list()] == [model_id]
    out = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "List the files."}],
                                         tools=[BASH_TOOL], temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [tool_call] = choice.message.tool_calls
    assert tool_call.type == "function" and tool_call.function.name == "bash" and tool_call.id.startswith("call_")
    assert json.loads(tool_call.function.arguments) == {"command": "ls -la"}
    assert out.model == model_id and out.usage.completion_tokens == 2  # the call and the end of turn
    assert out.system_fingerprint == f"envloop-{model_id.rsplit('-', 1)[1]}"


def test_the_agent_runner_client_reads_the_policy(server: ServerProcess, model_id: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from envloop_pipelines.core.agents.client import AgentSpec, ChatClient

    monkeypatch.setenv("POLICY_TEST_KEY", KEY)
    client = ChatClient(AgentSpec(f"{server.url}/v1", model_id, api_key_env="POLICY_TEST_KEY"))
    try:
        turn = client.complete([{"role": "user", "content": "List the files."}], tools=[BASH_TOOL], seed=3, max_tokens=8192)
    finally:
        client.close()
    assert turn.message["tool_calls"][0]["function"] == {"name": "bash", "arguments": '{"command": "ls -la"}'}
    assert turn.finish_reason == "tool_calls" and turn.completion_tokens <= MAX_TOKENS


BAD_REQUESTS: list[tuple[str, Any, int, str]] = [
    ("not JSON", b"{nope", 422, "JSON decode error"),
    ("no messages", {"model": "M"}, 422, "messages"),
    ("empty messages", {"model": "M", "messages": []}, 422, "messages"),
    ("unknown role", {"model": "M", "messages": [{"role": "robot", "content": "hi"}]}, 422, "role"),
    ("max_tokens 0", {"model": "M", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 422, "max_tokens"),
    ("temperature 3", {"model": "M", "messages": [{"role": "user", "content": "hi"}], "temperature": 3}, 422, "temperature"),
    ("not a function tool", {"model": "M", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "retrieval"}]},
     422, "tools"),
    ("image part", {"model": "M", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     422, "only text content parts"),
    ("unknown model", {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}, 404, "unknown model 'gpt-4o'"),
    ("stream", {"model": "M", "messages": [{"role": "user", "content": "hi"}], "stream": True}, 400, "stream"),
    ("n 2", {"model": "M", "messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, "one choice"),
    ("arguments not JSON", {"model": "M", "tools": [BASH_TOOL], "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "bash", "arguments": "{oops"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}, 400, "arguments is not JSON"),
    ("past the context", {"model": "M", "messages": [{"role": "user", "content": "sandbox " * 2500}]}, 400,
     "the model's context is 2048"),
    ("over the body limit", {"model": "M", "messages": [{"role": "user", "content": "x" * 70000}]}, 413, "over the limit"),
]


@pytest.mark.parametrize("body,status,message", [b[1:] for b in BAD_REQUESTS], ids=[b[0] for b in BAD_REQUESTS])
def test_bad_requests_are_answered_4xx_with_a_reason(server: ServerProcess, model_id: str, body: Any, status: int,
                                                      message: str) -> None:
    if isinstance(body, dict) and body.get("model") == "M":
        body = {**body, "model": model_id}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{server.url}/v1/chat/completions", content=content, timeout=60,
                   headers={**server.headers(), "content-type": "application/json"})
    assert r.status_code == status, r.text
    assert message in r.json()["error"]["message"], r.text


def test_keys_are_required_and_unknown_routes_are_404(server: ServerProcess, model_id: str) -> None:
    body = {"model": model_id, "messages": [{"role": "user", "content": "hi"}]}
    assert httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30).status_code == 401
    wrong = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers={"Authorization": "Bearer nope"}, timeout=30)
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{server.url}/v1/nothing", headers=server.headers(), timeout=30).status_code == 404
    assert httpx.get(f"{server.url}/health", timeout=30).json()["state"] == "warm"
    assert "Traceback" not in server.log_text()


@pytest.fixture(scope="module")
def base_server(lm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = start_server(None, tmp_path_factory.mktemp("base-serve"), "--base-model", str(lm_dir),
                        "--max-tokens", str(MAX_TOKENS), keys=(), auth_off=True)
    yield proc
    proc.stop()


def test_a_base_model_serves_alone_with_seeded_sampling_and_bounded_tokens(base_server: ServerProcess, lm_dir: Path) -> None:
    models = httpx.get(f"{base_server.url}/v1/models", timeout=30).json()["data"]
    assert [m["id"] for m in models] == [f"envloop-base-{lm_dir.name}"]

    def ask(seed: int) -> dict[str, Any]:
        body = {"model": models[0]["id"], "messages": [{"role": "user", "content": "Tell me about the sandbox, at length."}],
                "max_tokens": 100000, "temperature": 1.0, "seed": seed, "tools": [BASH_TOOL]}
        r = httpx.post(f"{base_server.url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()

    a, b, c = ask(7), ask(7), ask(8)
    assert a["choices"][0]["message"] == b["choices"][0]["message"]  # the same seed, the same sample
    assert a["choices"][0]["message"] != c["choices"][0]["message"]  # another seed, another one (a random LM, ~600 tokens)
    for out in (a, c):
        n = out["usage"]["completion_tokens"]
        assert 1 <= n <= MAX_TOKENS and (n == MAX_TOKENS) == (out["choices"][0]["finish_reason"] == "length")


def test_parse_tool_calls_keeps_what_is_not_a_call() -> None:
    content, calls = parse_tool_calls('I will look.\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>')
    assert content == "I will look." and calls[0]["function"] == {"name": "bash", "arguments": '{"command": "ls"}'}
    content, calls = parse_tool_calls("<tool_call>\n{not json}\n</tool_call>")
    assert calls == [] and content == "<tool_call>\n{not json}\n</tool_call>"
    content, calls = parse_tool_calls('<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", '
                                      '"arguments": "{\\"x\\": 1}"}</tool_call>')
    assert content is None and [c["function"]["name"] for c in calls] == ["a", "b"]
    assert calls[1]["function"]["arguments"] == '{"x": 1}' and calls[0]["id"] != calls[1]["id"]
    assert parse_tool_calls("<tool_call>{\"name\": \"a\"")[1] == []  # cut off by max_tokens: not a call
