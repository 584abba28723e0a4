"""The HTTP server: the Jev API, the OpenAI-compatible chat, health and metrics (``docs/jev-api.md``).

Routes (every route but ``/health`` needs ``Authorization: Bearer <key>``
unless auth is explicitly off; with auth off a bearer header is accepted and ignored):

========================================  ====================================================
``POST /v1/systemone``                    typed questions about one state (Jev API)
``GET  /v1/models``                       ``{"models": [{"name", "description", "release_date"}]}`` (Jev shape)
``POST /v1/chat/completions``             OpenAI-compatible chat: one question per completion
``GET  /openai/v1/models``                the OpenAI listing ``{"object": "list", "data": [...]}``
``GET  /openai/v1/models/{model}``        one OpenAI model object
``POST /openai/v1/chat/completions``      the same chat, under the OpenAI prefix
``GET  /health``                          liveness and readiness: ``warm``, ``loading`` or ``cold`` (scaled to zero)
``GET  /metrics``                         Prometheus exposition
``GET  /openapi.json``                    the OpenAPI schema
========================================  ====================================================

Why ``/openai/v1``: both APIs list models at ``GET /v1/models`` in different
shapes, and both official clients call exactly that path. ``/v1/models`` keeps
the Jev shape (what ``typesafe-sdk``'s ``models.list()`` parses); an OpenAI
client pointed at ``http://host/openai/v1`` gets the OpenAI listing *and* the
chat; pointed at ``http://host/v1`` its chat works too, only ``models.list()``
would read the Jev shape.

Errors (never a 5xx for a bad request; clients retry 5xx):

* schema failures: 422 ``{"detail": [{"loc", "msg", "type"}]}`` (also malformed JSON, as FastAPI
  does, and more than ``max_questions`` questions in one request);
* everything else: ``{"detail": {"error_type", "message"}}`` with ``error_type`` one of
  ``authentication_error`` (401), ``tokens_exceeded`` (400), ``timeout`` (504) or
  ``unknown`` (404 unknown model or route, 405, 413 body too large, 415 unsupported
  media type or encoding, 429 too many requests in flight for a key, 529 queue full);
* the chat routes add OpenAI's ``{"error": {"message", "type", "code"}}`` beside ``detail``,
  so the ``openai`` client shows the message;
* 429 and 529 carry ``Retry-After`` (seconds) and ``retry-after-ms``.

Every response carries the request id in ``x-typesafe-request-id`` (what
``typesafe-sdk`` reads) and ``x-request-id`` (a client's own ``x-request-id``
is echoed when it is a short printable token).

Request bodies: at most ``max_body_bytes`` (413), before and after
decompression; ``Content-Encoding`` ``gzip``, ``deflate`` and, where a zstd
module is installed (Python 3.14's ``compression.zstd``, ``backports.zstd`` or
``zstandard``), ``zstd``, which ``typesafe-sdk`` uses for bodies ≥ 1 KiB when it
has zstd itself; anything else is 415. Multipart bodies (image assets) are 415.
JSON is decoded with :func:`~envloop_pipelines.core.data.json_text.decode_json`, so
duplicate option keys are caught; strings with lone surrogates are refused
(they could not be sent back as UTF-8), and so is nesting deeper than
``MAX_JSON_DEPTH`` (128) levels.

Token budget: the state plus the longest question at most
``state_token_budget`` (32k) and the whole request at most
``request_token_budget`` (64k) tokens of the packaged tokenizer
(:func:`~envloop_pipelines.core.tokens.count_tokens`); over either is 400
``tokens_exceeded`` before the model runs. ``usage.input_tokens`` is the
request's token count by the same measure (state once, plus every question);
``usage.output_tokens`` is one per answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
import uuid
from collections import Counter
from datetime import datetime, timezone
from typing import Any, Callable, Iterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.datastructures import MutableHeaders
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from envloop_pipelines.core.model.predict import DecisionModel
from envloop_pipelines.core.serve.answers import (
    ModelAnswer,
    chosen_option,
    finite_or_none,
    jev_answer,
    option_logprobs,
)
from envloop_pipelines.core.serve.batcher import MicroBatcher, Overloaded
from envloop_pipelines.core.serve.http import APIError, Auth, chat_completion_body, read_json_body
from envloop_pipelines.core.serve.inference import WindowError
from envloop_pipelines.core.serve.lifecycle import ModelHolder, resident_bytes
from envloop_pipelines.core.serve.prometheus import ServeMetrics
from envloop_pipelines.core.serve.schemas import (
    ChatCompletionRequest,
    RequestValidationFailed,
    ServedQuestion,
    ServedRequest,
    chat_question,
    parse_systemone,
    served_request,
    validation_details,
)
from envloop_pipelines.core.serve.settings import MODEL_ALIASES, ServeSettings

log = logging.getLogger(__name__)

REQUEST_ID_HEADERS = ("x-typesafe-request-id", "x-request-id")
_CLIENT_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_ROUTES = (
    "/v1/systemone", "/v1/models", "/v1/chat/completions", "/openai/v1/models", "/openai/v1/chat/completions",
    "/health", "/metrics", "/openapi.json",
)
#: Texts longer than this (characters) are tokenized off the event loop.
_TOKENIZE_INLINE_CHARS = 20_000


def _retry_headers(seconds: float) -> dict[str, str]:
    return {"Retry-After": str(max(1, int(round(seconds)))), "retry-after-ms": str(max(1000, int(seconds * 1000)))}


def _is_openai_path(path: str) -> bool:
    return path.endswith("/chat/completions") or path.startswith("/openai/")


def _error_response(request: Request | None, status: int, detail: Any, headers: dict[str, str] | None = None) -> JSONResponse:
    body: dict[str, Any] = {"detail": detail}
    if request is not None and _is_openai_path(request.url.path):
        if isinstance(detail, dict):
            body["error"] = {"message": detail["message"], "type": detail["error_type"], "param": None, "code": detail["error_type"]}
        else:
            message = "; ".join(f"{'.'.join(str(x) for x in d.get('loc', []))}: {d.get('msg')}" for d in detail)
            body["error"] = {"message": message, "type": "invalid_request_error", "param": None, "code": "validation_error"}
    return JSONResponse(body, status_code=status, headers=headers)


# --------------------------------------------------------------------------- request id, metrics, last-resort 500


class _RequestContext:
    """Pure ASGI middleware: request id header on every response, request metrics, and a contract-shaped 500."""

    def __init__(self, app: ASGIApp, metrics: ServeMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        incoming = dict(scope.get("headers") or []).get(b"x-request-id", b"").decode("latin-1")
        rid = incoming if _CLIENT_REQUEST_ID.fullmatch(incoming) else f"req_{uuid.uuid4().hex}"
        scope.setdefault("state", {})["request_id"] = rid
        path = scope.get("path", "")
        route = path if path in _ROUTES else ("/openai/v1/models/{model}" if path.startswith("/openai/v1/models/") else "other")
        status = {"code": 500, "started": False}

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"], status["started"] = message["status"], True
                headers = MutableHeaders(scope=message)
                for name in REQUEST_ID_HEADERS:
                    headers[name] = rid
            await send(message)

        t0 = time.perf_counter()
        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            log.exception("request %s %s failed", rid, path)
            if status["started"]:
                raise
            response = JSONResponse(
                {"detail": {"error_type": "unknown", "message": f"internal server error (request id {rid})"}}, status_code=500
            )
            await response(scope, receive, send_with_id)
        finally:
            self.metrics.requests.labels(route=route, status=str(status["code"])).inc()
            self.metrics.latency.labels(route=route).observe(time.perf_counter() - t0)


# --------------------------------------------------------------------------- auth and per-key limits


class _KeyLimiter:
    """At most ``limit`` requests in flight per caller (None: no limit)."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.in_flight: Counter[str] = Counter()

    @contextlib.contextmanager
    def hold(self, who: str, retry_after_s: Callable[[], float], metrics: ServeMetrics) -> Iterator[None]:
        if self.limit is not None and self.in_flight[who] >= self.limit:
            metrics.shed.labels(status="429").inc()
            raise APIError(429, "unknown", f"too many requests in flight for this key (limit {self.limit}); retry later",
                           _retry_headers(retry_after_s()))
        self.in_flight[who] += 1
        try:
            yield
        finally:
            self.in_flight[who] -= 1
            if self.in_flight[who] <= 0:
                del self.in_flight[who]


# --------------------------------------------------------------------------- the app


def create_app(settings: ServeSettings, *, loader: Callable[[], DecisionModel] | None = None) -> FastAPI:
    """The server for one checkpoint (see the module docstring).

    Args:
        settings: What to serve and how.
        loader: Builds the model (default: ``DecisionModel.load(settings.checkpoint_dir)``), called at each cold start.
    """
    from envloop_pipelines.core.tokens import count_tokens

    metrics = ServeMetrics(settings.model_id)
    holder = ModelHolder(
        loader or (lambda: DecisionModel.load(settings.checkpoint_dir, batch_size=settings.resolved_forward_batch())),
        idle_timeout_s=settings.idle_timeout_s,
        expected_checkpoint_sha256=settings.expected_checkpoint_sha256,
        on_load=metrics.on_load,
        on_unload=metrics.on_unload,
    )
    batcher = MicroBatcher(
        holder,
        max_batch=settings.max_batch,
        forward_batch=settings.resolved_forward_batch(),
        max_wait_s=settings.max_wait_ms / 1000.0,
        max_queue=settings.max_queue,
        enabled=settings.micro_batching,
        on_batch=metrics.on_batch,
    )
    authenticate = Auth(settings)
    limiter = _KeyLimiter(settings.max_inflight_per_key)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):  # noqa: ANN202 - an async generator context
        await asyncio.to_thread(count_tokens, ["warm up"])  # loads the tokenizer now, not in the first request
        await batcher.start()
        await holder.start(preload=settings.preload)
        log.info("serving %s from %s (auth %s, micro-batching %s, idle timeout %s s)", settings.model_id,
                 settings.checkpoint_dir, "off" if settings.auth_off else f"{len(settings.api_keys)} key(s)",
                 "on" if settings.micro_batching else "off", settings.idle_timeout_s)
        yield
        await batcher.stop(timeout_s=settings.graceful_shutdown_s)
        await holder.stop()

    app = FastAPI(
        title="EnvLoop decision model server",
        description="The Jev API (POST /v1/systemone) and an OpenAI-compatible chat for a released decision model.",
        version="1",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.settings = settings
    app.state.holder = holder
    app.state.batcher = batcher
    app.state.metrics = metrics
    app.add_middleware(_RequestContext, metrics=metrics)

    # ------------------------------------------------------------------ error handlers

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return _error_response(request, exc.status, {"error_type": exc.error_type, "message": exc.message}, exc.headers)

    @app.exception_handler(RequestValidationFailed)
    async def _invalid(request: Request, exc: RequestValidationFailed) -> JSONResponse:
        return _error_response(request, 422, exc.details)

    @app.exception_handler(RequestValidationError)
    async def _fastapi_invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        details = [{"loc": list(e.get("loc", [])), "msg": str(e.get("msg", "")), "type": str(e.get("type", ""))} for e in exc.errors()]
        return _error_response(request, 422, details)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail, default=str)
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        return _error_response(request, exc.status_code, {"error_type": "unknown", "message": message}, dict(exc.headers or {}))

    # ------------------------------------------------------------------ shared steps

    def check_size(parsed: Any) -> None:
        n = len(parsed.questions)
        if n > settings.max_questions:
            raise RequestValidationFailed([{
                "loc": ["body", "questions"], "type": "too_long", "ctx": {"max_length": settings.max_questions},
                "msg": f"at most {settings.max_questions} questions per request, got {n}: split the request",
            }])

    def check_model(name: str) -> None:
        if name not in settings.accepted_models:
            raise APIError(404, "unknown", f"model {name!r} is not served here; use {settings.model_id!r} or an alias "
                                           f"({', '.join(MODEL_ALIASES)})")

    async def token_usage(served: ServedRequest) -> int:
        texts = [served.state_text] + [q.budget_text for q in served.questions]
        if sum(len(t) for t in texts) > _TOKENIZE_INLINE_CHARS:
            counts = await asyncio.to_thread(count_tokens, texts)
        else:
            counts = count_tokens(texts)
        inner = [max(0, c - 2) for c in counts]  # each count includes [CLS] and [SEP]; count them once per request
        state, questions = inner[0], inner[1:]
        state_plus_longest = state + max(questions) + 2
        total = state + sum(questions) + 2
        if state_plus_longest > settings.state_token_budget:
            raise APIError(400, "tokens_exceeded", f"the state plus the longest question is {state_plus_longest} tokens, "
                                                   f"over the budget of {settings.state_token_budget}")
        if total > settings.request_token_budget:
            raise APIError(400, "tokens_exceeded", f"the request is {total} tokens, over the budget of {settings.request_token_budget}")
        return total

    async def answer(served: ServedRequest, who: str) -> list[ModelAnswer]:
        with limiter.hold(who, batcher.retry_after_s, metrics):
            try:
                future = batcher.submit(served.inputs)
            except Overloaded as exc:
                metrics.shed.labels(status="529").inc()
                raise APIError(529, "unknown", str(exc), _retry_headers(exc.retry_after_s)) from None
            metrics.queued.set(batcher.queued_questions)
            try:
                return await asyncio.wait_for(future, settings.request_timeout_s)
            except asyncio.TimeoutError:
                raise APIError(504, "timeout", f"no answer within {settings.request_timeout_s:g} s") from None
            except WindowError as exc:
                raise APIError(400, "tokens_exceeded", str(exc)) from None
            finally:
                metrics.queued.set(batcher.queued_questions)

    def x_fields() -> dict[str, Any]:
        threshold = holder.automation_threshold
        out: dict[str, Any] = {"x_automation_threshold": None if threshold is None else finite_or_none(threshold)}
        if holder.safety_thresholds:
            out["x_safety_thresholds"] = {f: finite_or_none(t) for f, t in holder.safety_thresholds.items()}
        out["x_checkpoint_sha256"] = holder.checkpoint_sha256
        return out

    def safety_threshold(question: ServedQuestion) -> float | None:
        """The threshold of the safety family a noul question is keyed by, if it is one."""
        return holder.safety_thresholds.get(question.id) if question.type == "noul" else None

    def count_questions(served: ServedRequest) -> None:
        for q in served.questions:
            metrics.questions.labels(type=q.type).inc()

    # ------------------------------------------------------------------ routes

    @app.get("/health", include_in_schema=False)
    async def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "model": settings.model_id,
            "state": holder.state,
            "loaded": holder.state == "warm",
            "queued_questions": batcher.queued_questions,
            "running_questions": batcher.running_questions,
            "cold_starts": holder.cold_starts,
            "last_cold_start_s": holder.last_cold_start_s,
            "unloads": holder.unloads,
            "idle_timeout_s": settings.idle_timeout_s,
            "idle_s": round(holder.idle_seconds, 3),
            "rss_bytes": resident_bytes(),
        }

    @app.get("/metrics", include_in_schema=False)
    async def prometheus(request: Request) -> Response:
        authenticate(request)
        metrics.queued.set(batcher.queued_questions)
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(request: Request) -> JSONResponse:
        authenticate(request)
        return JSONResponse(app.openapi())

    def model_cards() -> list[dict[str, str]]:
        what = (f"release {settings.release} of task {settings.task!r}" if settings.release is not None
                else f"checkpoint {settings.checkpoint_dir.name}")
        sha = (settings.expected_checkpoint_sha256 or "")[:12]
        base = f"EnvLoop decision model, {what}" + (f" (checkpoint sha256 {sha}…)" if sha else "")
        cards = [{"name": settings.model_id, "description": base + ".", "release_date": settings.release_date}]
        for alias in MODEL_ALIASES:
            cards.append({"name": alias, "description": f"Alias of {settings.model_id}: {base}.", "release_date": settings.release_date})
        return cards

    @app.get("/v1/models", summary="List models (Jev shape)")
    async def jev_models(request: Request) -> dict[str, Any]:
        authenticate(request)
        return {"models": model_cards()}

    def openai_model(name: str) -> dict[str, Any]:
        created = int(datetime.strptime(settings.release_date, "%Y-%m-%d").replace(tzinfo=timezone.utc).timestamp())
        return {"id": name, "object": "model", "created": created, "owned_by": "envloop"}

    @app.get("/openai/v1/models", summary="List models (OpenAI shape)")
    async def openai_models(request: Request) -> dict[str, Any]:
        authenticate(request)
        return {"object": "list", "data": [openai_model(c["name"]) for c in model_cards()]}

    @app.get("/openai/v1/models/{model}", summary="One model (OpenAI shape)")
    async def openai_model_route(request: Request, model: str) -> dict[str, Any]:
        authenticate(request)
        check_model(model)
        return openai_model(model)

    @app.post("/v1/systemone", summary="Answer typed questions about one state (Jev API)")
    async def systemone(request: Request) -> JSONResponse:
        who = authenticate(request)
        with batcher.arriving():  # a batch being gathered waits (boundedly) for this request
            parsed = parse_systemone(await read_json_body(request, settings.max_body_bytes))
            check_size(parsed)
            check_model(parsed.model)
            served = served_request(parsed)
            input_tokens = await token_usage(served)
        results = await answer(served, who)
        threshold = holder.automation_threshold if holder.automation_threshold is not None else float("inf")
        answers = {q.id: jev_answer(q, a, automation_threshold=threshold, safety_threshold=safety_threshold(q))
                   for q, a in zip(served.questions, results)}
        count_questions(served)
        metrics.input_tokens.inc(input_tokens)
        return JSONResponse({
            "model": settings.model_id,
            "answers": answers,
            "usage": {"input_tokens": int(input_tokens), "output_tokens": len(answers)},
            **x_fields(),
        })

    async def chat_completions(request: Request) -> JSONResponse:
        who = authenticate(request)
        with batcher.arriving():
            body = await read_json_body(request, settings.max_body_bytes)
            try:
                chat = ChatCompletionRequest.model_validate(body)
            except ValidationError as exc:
                raise RequestValidationFailed(validation_details(exc)) from None
            check_model(chat.model)
            parsed, _ = chat_question(chat)
            served = served_request(parsed)
            input_tokens = await token_usage(served)
        [result] = await answer(served, who)
        question = served.questions[0]
        threshold = holder.automation_threshold if holder.automation_threshold is not None else float("inf")
        content = chosen_option(question, result.probs)
        count_questions(served)
        metrics.input_tokens.inc(input_tokens)
        rid = request.scope.get("state", {}).get("request_id", uuid.uuid4().hex)
        return JSONResponse(chat_completion_body(
            completion_id=rid, model=settings.model_id, fingerprint=holder.checkpoint_sha256,
            message={"role": "assistant", "content": content, "refusal": None}, finish_reason="stop",
            prompt_tokens=input_tokens, completion_tokens=1,
            logprobs=option_logprobs(question, result.probs, chat.top_logprobs) if chat.logprobs else None,
            x_answer=jev_answer(question, result, automation_threshold=threshold),
            **x_fields(),
        ))

    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"], summary="OpenAI-compatible chat completion")
    app.add_api_route("/openai/v1/chat/completions", chat_completions, methods=["POST"], include_in_schema=False)
    return app


__all__ = ["APIError", "create_app", "read_json_body"]
