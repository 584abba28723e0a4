"""Both clients' ``predict``: a release's answers to Jev requests, from a served release or in this process.

With a URL the request goes to a running server (``envloop serve``, ``POST <url>/v1/systemone``); without,
the release's checkpoint is answered in this process by the same server code (``core/serve/app.py``
behind FastAPI's test client), so the numbers are the ones ``envloop serve`` gives. The clients differ only
in where a release's checkpoint comes from: the remote :class:`~envloop_pipelines.sdk.Client` downloads it
from MLflow, the :class:`~envloop_pipelines.sdk.local.LocalClient` reads it from the home's release chain.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from envloop_pipelines.console import quiet_third_party
from envloop_pipelines.core.serve.settings import settings_for
from envloop_pipelines.sdk.errors import ClientError, NotFoundError, RefusedError, UnavailableError

JEV_PATH = "/v1/systemone"


def jev_body(request: Mapping[str, Any]) -> dict[str, Any]:
    """A Jev request from a request or a labelled decision record (labels, ids and meta left out).

    Raises:
        RefusedError: the request has no ``state`` or no ``questions``.
    """
    if not isinstance(request, Mapping) or "questions" not in request or "state" not in request:
        raise RefusedError("request: a Jev request needs 'state' and 'questions' (a decision record works too)")
    questions = {qid: {k: v for k, v in q.items() if k in ("type", "instructions", "criteria")} if isinstance(q, Mapping)
                 else q for qid, q in dict(request["questions"]).items()}
    return {"model": request.get("model", "jev-latest"), "state": request["state"], "questions": questions}


def answer(post: Callable[..., Any], body: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The server's answer to one Jev body; its refusal as the SDK's error (4xx named by kind, 5xx unavailable)."""
    import httpx  # not a dependency of the package (pyproject's test extra): only a prediction needs it

    try:
        response = post(JEV_PATH, json=body)
    except httpx.HTTPError as exc:
        raise UnavailableError(f"the server at {where} did not answer: {type(exc).__name__}: {exc}") from None
    if response.status_code == 200:
        return response.json()
    try:
        detail = response.json()
    except ValueError:
        detail = response.text[:300]
    kind = (RefusedError if response.status_code in (400, 413, 422) else NotFoundError if response.status_code == 404
            else UnavailableError if response.status_code >= 500 else ClientError)
    raise kind(f"the server at {where} answered {response.status_code}: {refusal_text(detail)}")


def refusal_text(detail: Any) -> str:
    """A server's error body in words: each schema failure as ``field.path: reason`` (the request's own fields,
    ``body`` left out), an error's message, or the body's JSON as a last resort (shortened).

    The server's errors (``core/serve/app.py``): ``{"detail": [{"loc", "msg", "type"}]}`` for a request that
    fails the schema (422), ``{"detail": {"error_type", "message"}}`` for the rest.
    """
    inner = detail.get("detail") if isinstance(detail, Mapping) else None
    if isinstance(inner, list) and inner and all(isinstance(d, Mapping) for d in inner):
        parts = []
        for d in inner:
            loc = [str(p) for p in (d.get("loc") or []) if p != "body"]
            parts.append(f"{'.'.join(loc) or 'request'}: {d.get('msg') or d.get('type') or 'invalid'}")
        return "; ".join(parts)[:1000]
    if isinstance(inner, Mapping) and inner.get("message"):
        return f"{inner['message']}" + (f" ({inner['error_type']})" if inner.get("error_type") else "")
    if isinstance(inner, str):
        return inner[:500]
    return json.dumps(detail)[:500]


class Answerer:
    """Answers Jev requests over HTTP or in this process; keeps one in-process server per checkpoint until closed.

    Args:
        timeout_s: Per HTTP request to a served release.
    """

    def __init__(self, timeout_s: float = 60.0) -> None:
        self.timeout_s = float(timeout_s)
        self._servers: dict[str, Any] = {}

    def predict(self, request: Mapping[str, Any] | Sequence[Mapping[str, Any]], *, url: str | None,
                api_key: str | None, source: Callable[[], Any]) -> Any:
        """The answers to ``request`` (one, or a list: a list back); ``source`` gives the
        :class:`~envloop_pipelines.core.serve.settings.ModelSource` answered in process when ``url`` is ``None``."""
        many = not isinstance(request, Mapping)
        bodies = [jev_body(r) for r in (request if many else [request])]
        if url is None:
            quiet_third_party()  # the CLI's filters: a model loads here (its "Loading weights" bars, a FutureWarning)
            server = self._server(source())
            answers = [answer(server.post, body, "in process") for body in bodies]
        else:
            import httpx  # only a prediction needs it (see answer)

            headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
            with httpx.Client(base_url=url.rstrip("/"), timeout=self.timeout_s, headers=headers) as http:
                answers = [answer(http.post, body, url) for body in bodies]
        return answers if many else answers[0]

    def _server(self, source: Any) -> Any:
        """The server app for a model source, in this process (one per checkpoint, kept)."""
        # Starlette's TestClient needs httpx (see answer), and the server app loads torch and the model's code
        # (seconds): both imported when a release is first answered here
        from fastapi.testclient import TestClient

        from envloop_pipelines.core.serve.app import create_app

        name = str(source.checkpoint_dir)
        if name not in self._servers:
            settings = settings_for(source, auth_off=True, preload=False, micro_batching=False, idle_timeout_s=None)
            server = TestClient(create_app(settings))
            server.__enter__()  # the app's lifespan: tokenizer, batcher, model holder (closed by close())
            self._servers[name] = server
        return self._servers[name]

    def close(self) -> None:
        """Stop the in-process servers (their models are unloaded)."""
        servers, self._servers = self._servers, {}
        for server in servers.values():
            server.__exit__(None, None, None)


__all__ = ["Answerer", "JEV_PATH", "answer", "jev_body", "refusal_text"]
