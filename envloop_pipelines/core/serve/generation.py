"""Serving a policy: a local causal LM (+ its LoRA adapter) on the OpenAI-compatible chat, with tool calls.

``envloop serve --policy DIR`` (a policy checkpoint from
:func:`~envloop_pipelines.core.model.causal_sft.train_causal_sft`, read and rendered with
:mod:`~envloop_pipelines.core.model.policy`, as training renders: the base
model named by its recipe, its adapter and its chat template) or
``envloop serve --base-model DIR`` (the base LM alone) answers:

========================================  ====================================================
``POST /v1/chat/completions``             OpenAI chat completion; ``tools`` rendered by the chat template
``GET  /v1/models``                       the OpenAI listing (one model)
``GET  /health``                          liveness
========================================  ====================================================

Generation runs through ``transformers`` (``model.generate``) with the adapter
merged into the base weights, one request at a time (a lock; fine for the small
models this path is for; a GPU deployment serves the same adapter with vLLM,
see ``README.md``). The prompt is the conversation rendered by the checkpoint's
chat template with the generation prompt; generation stops at the end-of-turn
token. ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks in
the output become the message's OpenAI ``tool_calls`` (``arguments`` as JSON
text, an id each) and are removed from ``content``; a block that is not JSON
stays in ``content``, as vLLM's ``hermes`` parser leaves it.

Sampling: ``temperature`` (default 1, as OpenAI's; 0 is greedy), ``top_p``,
and ``seed`` (the same seed, messages and settings give the same completion).
``max_tokens`` (or ``max_completion_tokens``) is clamped to the server's
``max_tokens`` cap; a completion that reaches it ends with
``finish_reason: "length"``.

Errors are 4xx, never 5xx, for anything a request can get wrong: a body that
is not JSON or not a chat request (422, ``detail`` naming the field, and
OpenAI's ``error`` beside it), an unknown model (404), ``stream: true`` or
``n > 1`` (400: not supported), a prompt that leaves no room to answer in the
model's context (400 ``context_length_exceeded``), a missing or wrong key
(401), a body over the limit (413).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Literal, Mapping, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from envloop_pipelines.core.serve.http import APIError, Auth, chat_completion_body, read_json_body
from envloop_pipelines.core.serve.schemas import RequestValidationFailed, validation_details

log = logging.getLogger(__name__)

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


# --------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class PolicySettings:
    """What a policy server is started with.

    Attributes:
        base_model: the local causal LM directory.
        adapter_dir: the LoRA adapter to apply (None: the base model alone).
        chat_template: the template to render with (None: the tokenizer's own, else the Qwen-style default).
        model_id: the name requests use and answers carry.
        checkpoint_sha256: the policy checkpoint's identity (in ``system_fingerprint``), when serving one.
        api_keys, auth_off, host, port, port_file, max_body_bytes, request_timeout_s, graceful_shutdown_s,
        torch_threads, log_level: as for the decision-model server (``ServeSettings``).
        max_tokens: the most tokens one completion may generate (requests asking for more are clamped).
    """

    base_model: Path
    model_id: str
    adapter_dir: Path | None = None
    chat_template: str | None = None
    checkpoint_sha256: str | None = None
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    auth_off: bool = False
    host: str = "127.0.0.1"
    port: int = 8000
    port_file: Path | None = None
    max_tokens: int = 512
    max_body_bytes: int = 4 * 1024 * 1024
    request_timeout_s: float = 120.0
    graceful_shutdown_s: float = 30.0
    torch_threads: int | None = None
    log_level: str = "info"
    device: str | None = None

    def __post_init__(self) -> None:
        if not (Path(self.base_model) / "config.json").is_file():
            raise ValueError(f"serve setting 'base_model': {self.base_model} is not a local model directory with a config.json")
        if self.adapter_dir is not None and not (Path(self.adapter_dir) / "adapter_config.json").is_file():
            raise ValueError(f"serve setting 'adapter_dir': {self.adapter_dir} has no adapter_config.json")
        if not self.api_keys and not self.auth_off:
            raise ValueError("serve setting 'api_keys': no API key given; pass --keys-file / $ENVLOOP_SERVE_KEYS, "
                             "or --auth-off to serve every route without a key")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"serve setting 'max_tokens': expected a positive integer, got {self.max_tokens!r}")


def policy_settings(policy_dir: str | Path | None = None, *, base_model: str | Path | None = None,
                    model_id: str | None = None, **kwargs: Any) -> PolicySettings:
    """Settings for a policy checkpoint (verified; base model from its recipe) or for a bare base model.

    Raises:
        ValueError: neither or both given; a checkpoint whose manifest does not verify (the file named).
    """
    if policy_dir is None and base_model is None:
        raise ValueError("nothing to serve: give a policy checkpoint directory or a base model directory")
    if policy_dir is not None:
        from envloop_pipelines.core.model.policy import read_policy_checkpoint

        ckpt = read_policy_checkpoint(policy_dir)
        base = Path(base_model or ckpt.base_model).expanduser()
        return PolicySettings(base_model=base, adapter_dir=ckpt.adapter_dir, chat_template=ckpt.chat_template,
                              checkpoint_sha256=ckpt.sha256,
                              model_id=model_id or f"envloop-policy-{ckpt.sha256[:12]}", **kwargs)
    base = Path(str(base_model)).expanduser()
    return PolicySettings(base_model=base, model_id=model_id or f"envloop-base-{base.name}", **kwargs)


# --------------------------------------------------------------------------- requests


class _Function(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolSpec(BaseModel):
    """An OpenAI tool definition (functions only)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["function"]
    function: _Function


class _CallFunction(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    arguments: str | dict[str, Any]


class _ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str
    type: Literal["function"] = "function"
    function: _CallFunction


class ChatMessage(BaseModel):
    """One message of the conversation (text content; content parts of type ``text`` are joined)."""

    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[_ToolCall] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            parts = []
            for n, part in enumerate(self.content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise RequestValidationFailed([{"loc": ["body", "messages", "content", n],
                                                    "msg": "only text content parts are supported", "type": "value_error"}])
                parts.append(part["text"])
            return "".join(parts)
        return self.content or ""


class PolicyChatRequest(BaseModel):
    """The fields of an OpenAI chat request this server reads; others are accepted and ignored."""

    model_config = ConfigDict(extra="allow")
    model: str = Field(min_length=1)
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolSpec] | None = None
    tool_choice: Any = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = None
    n: int | None = Field(default=None, ge=1)
    stream: bool | None = None

    def chat_messages(self) -> list[dict[str, Any]]:
        """The conversation as plain chat-format dicts (``developer`` read as ``system``)."""
        out = []
        for m in self.messages:
            msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            if m.tool_calls:
                msg["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.function.name, "arguments": c.function.arguments}}
                                     for c in m.tool_calls]
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            out.append(msg)
        return out


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """``(content, tool_calls)`` of generated text: each well-formed ``<tool_call>{json}</tool_call>`` becomes a call.

    A block whose body is not ``{"name": str, "arguments": object}`` stays in the content.
    """
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    last = 0
    for match in _TOOL_CALL.finditer(text):
        try:
            body = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            continue
        args = body.get("arguments", {})
        if isinstance(args, str):
            arguments = args
        else:
            arguments = json.dumps(args, ensure_ascii=False)
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": body["name"], "arguments": arguments}})
        kept.append(text[last:match.start()])
        last = match.end()
    kept.append(text[last:])
    content = "".join(kept).strip() if calls else text.strip()
    return (content or None), calls


# --------------------------------------------------------------------------- generation


@dataclass(frozen=True)
class Generation:
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str


class ContextTooLong(ValueError):
    """The prompt leaves no room for an answer in the model's context."""


class PolicyGenerator:
    """The causal LM (adapter merged) and its tokenizer; :meth:`generate` one completion at a time."""

    def __init__(self, settings: PolicySettings) -> None:
        import torch

        from envloop_pipelines.core.model.policy import END_OF_TURN_TOKENS, load_policy, load_tokenizer

        self.settings = settings
        self.tokenizer = load_tokenizer(settings.base_model, settings.chat_template)
        self.model = load_policy(settings.base_model, settings.adapter_dir, device=settings.device)
        self.device = next(self.model.parameters()).device
        self._torch = torch
        self._lock = threading.Lock()
        vocab = self.tokenizer.get_vocab()
        stops = {self.tokenizer.eos_token_id} | {vocab[t] for t in END_OF_TURN_TOKENS if t in vocab}
        self.stop_ids = sorted(i for i in stops if i is not None)
        self.context = int(getattr(self.model.config, "max_position_embeddings", 0) or 0) or None

    def prompt_ids(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]) -> list[int]:
        from envloop_pipelines.core.model.policy import render

        text = render(self.tokenizer, messages, tools, add_generation_prompt=True)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def generate(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]], *, max_tokens: int,
                 temperature: float, top_p: float, seed: int | None) -> Generation:
        torch = self._torch
        ids = self.prompt_ids(messages, tools)
        if self.context is not None:
            room = self.context - len(ids)
            if room < 1:
                raise ContextTooLong(f"the prompt is {len(ids)} tokens; the model's context is {self.context}")
            max_tokens = min(max_tokens, room)
        kwargs: dict[str, Any] = {"max_new_tokens": max_tokens, "eos_token_id": self.stop_ids,
                                  "pad_token_id": self.tokenizer.pad_token_id, "max_time": self.settings.request_timeout_s}
        if temperature > 0:
            kwargs.update(do_sample=True, temperature=temperature, top_p=top_p, top_k=0)
        else:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        with self._lock, torch.no_grad():
            if seed is not None:
                torch.manual_seed(seed)
            input_ids = torch.tensor([ids], device=self.device)
            out = self.model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), **kwargs)
        new = out[0, len(ids):].tolist()
        stopped = bool(new) and new[-1] in self.stop_ids
        text = self.tokenizer.decode(new[:-1] if stopped else new, skip_special_tokens=True)
        return Generation(text, len(ids), len(new), "stop" if stopped else "length")


# --------------------------------------------------------------------------- the app


def _openai_error(status: int, error_type: str, message: str, detail: Any = None,
                  headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": error_type, "code": status},
            "detail": detail if detail is not None else {"error_type": error_type, "message": message}}
    return JSONResponse(body, status_code=status, headers=headers)


def create_policy_app(settings: PolicySettings, *, generator: PolicyGenerator | None = None) -> FastAPI:
    """The policy server (see the module docstring); the model loads at startup unless ``generator`` is given."""
    authenticate = Auth(settings)
    state: dict[str, Any] = {"generator": generator}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):  # noqa: ANN202 - an async generator context
        if state["generator"] is None:
            state["generator"] = await asyncio.to_thread(PolicyGenerator, settings)
        log.info("serving policy %s (base %s, adapter %s)", settings.model_id, settings.base_model, settings.adapter_dir)
        yield

    app = FastAPI(title="EnvLoop policy server", version="1", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return _openai_error(exc.status, exc.error_type, exc.message, headers=exc.headers)

    @app.exception_handler(RequestValidationFailed)
    async def _invalid(request: Request, exc: RequestValidationFailed) -> JSONResponse:
        return _openai_error(422, "invalid_request_error", str(exc), detail=exc.details)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _openai_error(exc.status_code, "invalid_request_error" if exc.status_code < 500 else "server_error",
                             str(exc.detail))

    @app.get("/health", include_in_schema=False)
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": settings.model_id, "state": "warm" if state["generator"] else "loading"}

    def model_object() -> dict[str, Any]:
        return {"id": settings.model_id, "object": "model", "created": 0, "owned_by": "envloop"}

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        authenticate(request)
        return {"object": "list", "data": [model_object()]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> JSONResponse:
        authenticate(request)
        body = await read_json_body(request, settings.max_body_bytes)
        try:
            chat_request = PolicyChatRequest.model_validate(body)
        except ValidationError as exc:
            raise RequestValidationFailed(validation_details(exc)) from None
        if chat_request.model != settings.model_id:
            raise APIError(404, "not_found_error", f"unknown model {chat_request.model!r}; this server serves "
                                                   f"{settings.model_id!r}")
        if chat_request.stream:
            raise APIError(400, "invalid_request_error", "stream: true is not supported by this server")
        if chat_request.n not in (None, 1):
            raise APIError(400, "invalid_request_error", f"n={chat_request.n}: this server returns one choice")
        messages = chat_request.chat_messages()
        tools = [t.model_dump(exclude_none=True) for t in chat_request.tools or []]
        if chat_request.tool_choice == "none":
            tools = []
        requested = chat_request.max_completion_tokens or chat_request.max_tokens or settings.max_tokens
        temperature = 1.0 if chat_request.temperature is None else chat_request.temperature
        top_p = 1.0 if chat_request.top_p is None else chat_request.top_p
        gen: PolicyGenerator = state["generator"]
        from envloop_pipelines.core.model.policy import ChatTemplateError

        try:
            out = await asyncio.to_thread(gen.generate, messages, tools, max_tokens=min(requested, settings.max_tokens),
                                          temperature=temperature, top_p=top_p, seed=chat_request.seed)
        except ContextTooLong as exc:
            raise APIError(400, "context_length_exceeded", str(exc)) from None
        except ChatTemplateError as exc:
            raise APIError(400, "invalid_request_error", str(exc)) from None
        except Exception as exc:  # a template that cannot render this conversation: the request's fault
            if type(exc).__module__.startswith("jinja2"):
                raise APIError(400, "invalid_request_error", f"the chat template cannot render these messages: {exc}") from None
            raise
        content, calls = parse_tool_calls(out.text) if tools else (out.text.strip() or None, [])
        message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
        if calls:
            message["tool_calls"] = calls
        finish = "tool_calls" if calls else out.finish_reason
        return JSONResponse(chat_completion_body(
            completion_id=uuid.uuid4().hex, model=settings.model_id, fingerprint=settings.checkpoint_sha256,
            message=message, finish_reason=finish, prompt_tokens=out.prompt_tokens,
            completion_tokens=out.completion_tokens,
        ))

    app.state.settings = settings
    app.state.policy = state
    return app


def run_policy(settings: PolicySettings) -> None:
    """Serve ``settings`` until SIGTERM/SIGINT (blocking), with the decision server's runner
    (:func:`~envloop_pipelines.core.serve.server.serve_forever`: socket bound first, port file written;
    ``/health`` answers once the model is loaded)."""
    from envloop_pipelines.core.serve.server import serve_forever

    serve_forever(lambda: create_policy_app(settings), settings, what="policy")


@contextlib.contextmanager
def serving_policy(settings: PolicySettings, *, startup_timeout_s: float = 120.0) -> Iterator[str]:
    """Serve ``settings`` from a thread of this process (the same app and HTTP as ``envloop serve --policy``).

    Yields the OpenAI base URL (``http://host:port/v1``) once the model is loaded; stops the server on exit.
    For a round that samples and re-evaluates with a local policy without starting another Python process.
    """
    import uvicorn

    from envloop_pipelines.core.serve.server import bind_socket

    app = create_policy_app(settings)
    sock = bind_socket(settings.host, settings.port)
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name=f"policy-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout_s
    try:
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the policy server {settings.model_id} did not start (see the log above)")
            time.sleep(0.02)
        yield f"http://{settings.host}:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


__all__ = ["ContextTooLong", "Generation", "PolicyChatRequest", "PolicyGenerator", "PolicySettings",
           "create_policy_app", "parse_tool_calls", "policy_settings", "run_policy", "serving_policy"]
