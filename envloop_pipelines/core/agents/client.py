"""Agents as HTTP endpoints: an OpenAI-compatible chat with tools, or a Jev API decision endpoint.

An agent is named by where it answers (base URL), what it is (model) and an
optional key read from an environment variable when the run starts (never
stored with the results). Two kinds:

* ``chat``: ``POST {base_url}/chat/completions`` through the ``openai``
  package (any OpenAI-compatible server: vLLM, ``envloop serve``, a hosted
  API). Each call returns the assistant message exactly as the chat format
  spells it (``role``, ``content``, ``tool_calls``) and the token usage.
* ``jev``: ``POST {base_url}/systemone`` (``envloop serve``'s Jev API, see
  ``docs/serving.md``) for decision environments: one typed question, an
  answer distribution back.

Every way a call can go wrong (connection refused, an HTTP error status, a
timeout, a body that is not a chat completion) raises :class:`AgentError`
with the reason in words, so the runner records it as that attempt's failure.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Literal, Mapping, Sequence

AgentKind = Literal["chat", "jev", "oracle"]
AGENT_KINDS: tuple[str, ...] = ("chat", "jev", "oracle")
#: The oracle agent (like Harbor's): no endpoint; it runs each task's own reference solution.
ORACLE_URL = "oracle:"
#: The most bytes one completion's body may have (a reply past it is that attempt's error, not stored).
MAX_REPLY_BYTES = 1024 * 1024


class AgentError(Exception):
    """The agent's endpoint did not give a usable answer (the attempt fails with this reason)."""


@dataclass(frozen=True)
class AgentSpec:
    """Where an agent answers.

    Attributes:
        base_url: the API root, e.g. ``http://127.0.0.1:8000/v1``.
        model: the model name sent with each request.
        api_key_env: the environment variable holding the bearer key (read at call time; None: no key).
        kind: ``chat`` (OpenAI-compatible chat with tools), ``jev`` (``/systemone``, decision environments) or
            ``oracle`` (:meth:`oracle`: no endpoint; it runs the task's reference solution).
    """

    base_url: str
    model: str
    api_key_env: str | None = None
    kind: AgentKind = "chat"

    def __post_init__(self) -> None:
        if self.kind == "oracle":
            if self.base_url != ORACLE_URL:
                raise ValueError(f"the oracle agent has no endpoint: its base_url is {ORACLE_URL!r}, got {self.base_url!r}")
        elif not isinstance(self.base_url, str) or not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"AgentSpec.base_url must be an http(s) URL, got {self.base_url!r}")
        if not isinstance(self.model, str) or not self.model.strip():
            raise ValueError(f"AgentSpec.model must be a non-empty model name, got {self.model!r}")
        if self.kind not in AGENT_KINDS:
            raise ValueError(f"AgentSpec.kind must be one of {', '.join(AGENT_KINDS)}, got {self.kind!r}")

    @classmethod
    def oracle(cls) -> "AgentSpec":
        """The oracle agent: one tool call per attempt, the task's own reference solution (``solution/solve.sh``)."""
        return cls(ORACLE_URL, "oracle", kind="oracle")

    @property
    def label(self) -> str:
        """``model@base_url``: the agent's name in tables and partition keys."""
        return f"{self.model}@{self.base_url.rstrip('/')}"

    @classmethod
    def from_label(cls, label: str, *, api_key_env: str | None = None, kind: AgentKind = "chat") -> "AgentSpec":
        """The agent named by :attr:`label` (``model@base_url``, e.g. a Dagster partition key).

        Raises:
            ValueError: ``label`` is not ``<model>@http(s)://...``.
        """
        model, sep, rest = label.partition("@http")
        if not sep or not model:
            raise ValueError(f"an agent is named <model>@<base_url> (e.g. my-model@http://127.0.0.1:8000/v1), got {label!r}")
        return cls("http" + rest, model, api_key_env, kind)

    def to_dict(self) -> dict[str, Any]:
        """What an attempt records about its agent (never the key)."""
        return {"base_url": self.base_url.rstrip("/"), "model": self.model, "kind": self.kind}

    def api_key(self) -> str:
        if self.api_key_env is None:
            return "none"  # the openai client insists on a key; servers without auth ignore it
        key = os.environ.get(self.api_key_env)
        if not key:
            raise AgentError(f"the agent's key variable ${self.api_key_env} is not set")
        return key


@dataclass(frozen=True)
class ChatTurn:
    """One assistant turn.

    Attributes:
        message: the assistant message in the chat format (``role``, ``content``, ``tool_calls`` when any).
        prompt_tokens: the server's count of prompt tokens (0 when it reports none).
        completion_tokens: the server's count of completion tokens (0 when it reports none).
        finish_reason: the server's finish reason.
    """

    message: dict[str, Any]
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str | None


def _assistant_message(raw: Any) -> dict[str, Any]:
    """The assistant message as plain chat-format JSON (only the fields the format defines)."""
    if not isinstance(raw, Mapping) or raw.get("role", "assistant") != "assistant":
        raise AgentError(f"the completion's message is not an assistant message: {str(raw)[:200]}")
    content = raw.get("content")
    if content is not None and not isinstance(content, str):
        raise AgentError(f"the assistant message's content is not text: {type(content).__name__}")
    out: dict[str, Any] = {"role": "assistant", "content": content}
    calls = raw.get("tool_calls")
    if calls:
        if not isinstance(calls, list):
            raise AgentError("the assistant message's tool_calls is not a list")
        out["tool_calls"] = []
        for n, call in enumerate(calls):
            fn = call.get("function") if isinstance(call, Mapping) else None
            if not isinstance(fn, Mapping) or not isinstance(call.get("id"), str):
                raise AgentError(f"tool_calls[{n}] is not a function call with an id: {str(call)[:200]}")
            out["tool_calls"].append({"id": call["id"], "type": "function",
                                      "function": {"name": fn.get("name"), "arguments": fn.get("arguments")}})
    return out


class ChatClient:
    """``/chat/completions`` of one agent through the ``openai`` package (no retries: a failure is recorded).

    Args:
        agent: the agent.
        timeout_s: the most one request may take.
    """

    def __init__(self, agent: AgentSpec, *, timeout_s: float = 60.0) -> None:
        import openai

        self.agent = agent
        self._openai = openai
        self._client = openai.OpenAI(base_url=agent.base_url, api_key=agent.api_key(), timeout=timeout_s, max_retries=0)

    def complete(self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] = (),
                 max_tokens: int | None = None, seed: int | None = None, timeout_s: float | None = None) -> ChatTurn:
        """One completion; raises :class:`AgentError` for anything but a chat completion with one choice."""
        openai = self._openai
        kwargs: dict[str, Any] = {"model": self.agent.model, "messages": list(messages)}
        if tools:
            kwargs["tools"] = list(tools)
        if max_tokens is not None:
            kwargs["max_tokens"] = int(max_tokens)
        if seed is not None:
            kwargs["seed"] = int(seed)
        if timeout_s is not None:
            kwargs["timeout"] = max(0.1, float(timeout_s))
        try:
            # The raw body, not the SDK's object: the SDK builds objects without validating them, so a
            # body that is not a completion would surface later as an AttributeError deep in the runner.
            response = self._client.chat.completions.with_raw_response.create(**kwargs)
            raw = response.http_response.content
            if len(raw) > MAX_REPLY_BYTES:
                raise AgentError(f"reply too large: {len(raw)} bytes from {self.agent.base_url}, over {MAX_REPLY_BYTES}")
            body = json.loads(raw)
        except openai.APITimeoutError as exc:
            raise AgentError(f"timeout: no answer from {self.agent.base_url} in time ({exc})") from None
        except openai.APIConnectionError as exc:
            raise AgentError(f"connection failed: {self.agent.base_url}: {exc.__cause__ or exc}") from None
        except openai.APIStatusError as exc:
            raise AgentError(f"HTTP {exc.status_code} from {self.agent.base_url}: {exc.response.text[:300]}") from None
        except UnicodeEncodeError as exc:
            # Text the endpoint sent earlier (a lone surrogate from a "\\ud800" escape) cannot go back as UTF-8.
            raise AgentError(f"the conversation cannot be sent: it holds text that is not valid Unicode ({exc.reason} "
                             f"at {exc.start}, {exc.object[exc.start:exc.start + 1]!a})") from None
        except (ValueError, openai.APIError) as exc:
            raise AgentError(f"not a chat completion: {exc}") from None
        choices = body.get("choices") if isinstance(body, Mapping) else None
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], Mapping):
            raise AgentError(f"not a chat completion (no choices): {str(body)[:200]}")
        usage = body.get("usage") if isinstance(body.get("usage"), Mapping) else {}
        return ChatTurn(_assistant_message(choices[0].get("message")),
                        _count(usage.get("prompt_tokens")), _count(usage.get("completion_tokens")),
                        choices[0].get("finish_reason"))

    def close(self) -> None:
        self._client.close()


def _count(value: Any) -> int:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def jev_question(question: Mapping[str, Any]) -> dict[str, Any]:
    """A decision environment's question as one Jev API question (``type``, ``instructions``, ``criteria``)."""
    qtype = question["type"]
    keys = [str(k) for k in question["option_keys"]]
    texts = list(question.get("option_texts") or [None] * len(keys))
    if qtype == "noul":
        criteria: Any = {k: t for k, t in zip(keys, texts) if t} or None
    elif qtype == "score":
        criteria = [t if t else k for k, t in zip(keys, texts)]
    else:
        criteria = {k: t for k, t in zip(keys, texts)}
    return {"type": qtype, "instructions": question.get("instructions_text") or "", "criteria": criteria}


class JevClient:
    """``POST {base_url}/systemone`` with one question; the answer as ``{option: probability}``."""

    def __init__(self, agent: AgentSpec, *, timeout_s: float = 60.0) -> None:
        import httpx

        self.agent = agent
        self._httpx = httpx
        self._client = httpx.Client(timeout=timeout_s, headers={"Authorization": f"Bearer {agent.api_key()}"})

    def request(self, question: Mapping[str, Any]) -> dict[str, Any]:
        """The request body for one question of a decision environment."""
        return {"model": self.agent.model, "state": question.get("state_text") or "", "questions": {"q": jev_question(question)}}

    def answer(self, body: Mapping[str, Any], question: Mapping[str, Any], *,
               timeout_s: float | None = None) -> tuple[dict[str, Any], dict[str, float], int]:
        """Send ``body``; returns (the raw answer, ``{option: probability}``, input tokens)."""
        httpx = self._httpx
        url = self.agent.base_url.rstrip("/") + "/systemone"
        try:
            r = self._client.post(url, json=body, timeout=timeout_s)
        except httpx.TimeoutException as exc:
            raise AgentError(f"timeout: no answer from {url} in time ({exc})") from None
        except httpx.HTTPError as exc:
            raise AgentError(f"connection failed: {url}: {exc}") from None
        if r.status_code != 200:
            raise AgentError(f"HTTP {r.status_code} from {url}: {r.text[:300]}")
        try:
            data = r.json()
            answer = data["answers"]["q"]
        except (ValueError, KeyError, TypeError):
            raise AgentError(f"not a Jev answer: {r.text[:200]}") from None
        keys = [str(k) for k in question["option_keys"]]
        if answer.get("type") == "noul" and isinstance(answer.get("noul"), (int, float)):
            p = float(answer["noul"])
            probs = {"true": p, "false": 1.0 - p}
        elif isinstance(answer.get("probabilities"), Mapping):
            probs = {str(k): float(v) for k, v in answer["probabilities"].items()}
        else:
            raise AgentError(f"a Jev answer without probabilities: {str(answer)[:200]}")
        if sorted(probs) != sorted(keys):
            raise AgentError(f"the answer's options {sorted(probs)} are not the question's {sorted(keys)}")
        usage = data.get("usage") if isinstance(data.get("usage"), Mapping) else {}
        return dict(answer), {k: probs[k] for k in keys}, _count(usage.get("input_tokens"))

    def close(self) -> None:
        self._client.close()


__all__ = ["AGENT_KINDS", "AgentError", "AgentKind", "AgentSpec", "ChatClient", "ChatTurn", "JevClient",
           "MAX_REPLY_BYTES", "ORACLE_URL", "jev_question"]
