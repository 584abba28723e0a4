"""The HTTP pieces both servers share (the decision model's :mod:`~envloop_pipelines.core.serve.app` and the
policy's :mod:`~envloop_pipelines.core.serve.generation`): errors, bearer keys, request bodies and the
OpenAI chat-completion body.

* :class:`APIError`: an error answered with its status, ``error_type`` and message;
* :class:`Auth`: ``Authorization: Bearer <key>`` checked in constant time against the configured keys
  (or accepted and ignored with auth off);
* :func:`read_json_body`: the body size-limited, decompressed (gzip, deflate, zstd where a module is
  installed) and decoded (duplicate keys caught, lone surrogates and deep nesting refused);
* :func:`chat_completion_body`: the ``chat.completion`` object of one choice.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import time
import zlib
from typing import Any, Callable, Protocol

from fastapi import Request

from envloop_pipelines.core.data.json_text import decode_json
from envloop_pipelines.core.serve.schemas import MAX_JSON_DEPTH, RequestValidationFailed, nesting_within


class APIError(Exception):
    """An error answered as ``{"detail": {"error_type", "message"}}`` with ``status``."""

    def __init__(self, status: int, error_type: str, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.error_type = error_type
        self.message = message
        self.headers = headers or {}


def _zstd_decompressor() -> Callable[[bytes, int], bytes] | None:
    """``decompress(data, max_length)`` from whichever zstd module is installed, or None."""
    for name in ("compression.zstd", "backports.zstd"):
        try:
            module = __import__(name, fromlist=["ZstdDecompressor"])
        except ImportError:
            continue

        def stdlib(data: bytes, limit: int, _m: Any = module) -> bytes:
            out = bytearray()
            while data:
                d = _m.ZstdDecompressor()
                out += d.decompress(data, max_length=limit + 1 - len(out))
                if len(out) > limit or not d.eof:
                    break
                data = d.unused_data
            return bytes(out)

        return stdlib
    try:
        import zstandard
    except ImportError:
        return None

    def third_party(data: bytes, limit: int) -> bytes:
        reader = zstandard.ZstdDecompressor().stream_reader(data, read_across_frames=True)
        return reader.read(limit + 1)

    return third_party


_ZSTD = _zstd_decompressor()


def _decompress(data: bytes, encoding: str, limit: int) -> bytes:
    enc = encoding.strip().lower()
    if enc in ("", "identity"):
        return data
    try:
        if enc in ("gzip", "x-gzip", "deflate"):
            d = zlib.decompressobj(wbits=31 if "gzip" in enc else 15)
            out = d.decompress(data, limit + 1)
        elif enc == "zstd":
            if _ZSTD is None:
                raise APIError(415, "unknown", "Content-Encoding zstd is not supported by this server (no zstd module installed); send the body uncompressed")
            out = _ZSTD(data, limit)
        else:
            raise APIError(415, "unknown", f"unsupported Content-Encoding {encoding!r}; use gzip, deflate, zstd or none")
    except APIError:
        raise
    except Exception as exc:  # noqa: BLE001 - any decoder failure is a bad body
        raise APIError(400, "unknown", f"the body is not valid {enc} data: {exc}") from None
    if len(out) > limit:
        raise APIError(413, "unknown", f"the decompressed body is over {limit} bytes")
    return out


async def read_json_body(request: Request, max_bytes: int) -> Any:
    """The request's JSON body (size-limited, decompressed, duplicate keys recorded).

    Raises:
        APIError: 413 too large, 415 multipart or unknown encoding, 400 undecodable compression.
        RequestValidationFailed: the body is not JSON (422 ``json_invalid``).
    """
    content_type = request.headers.get("content-type", "").lower()
    if content_type.startswith("multipart/"):
        raise APIError(415, "unknown", "multipart bodies (image assets) are not supported: send application/json")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise APIError(413, "unknown", f"the body is {declared} bytes, over the limit of {max_bytes}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise APIError(413, "unknown", f"the body is over the limit of {max_bytes} bytes")
        chunks.append(chunk)
    raw = _decompress(b"".join(chunks), request.headers.get("content-encoding", ""), max_bytes)
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise RequestValidationFailed([{"loc": ["body", exc.start], "msg": "the body is not UTF-8", "type": "json_invalid"}]) from None
    try:
        body = decode_json(text)
    except json.JSONDecodeError as exc:
        raise RequestValidationFailed(
            [{"loc": ["body", exc.pos], "msg": f"JSON decode error: {exc.msg}", "type": "json_invalid"}]
        ) from None
    except (ValueError, RecursionError) as exc:  # an integer of > 4300 digits; nesting past the decoder's stack
        raise RequestValidationFailed([{"loc": ["body"], "msg": f"JSON decode error: {exc}", "type": "json_invalid"}]) from None
    if not nesting_within(body, MAX_JSON_DEPTH):
        raise RequestValidationFailed(
            [{"loc": ["body"], "msg": f"JSON nested deeper than {MAX_JSON_DEPTH} levels", "type": "json_too_deep"}]
        )
    if "\\u" in text and re.search(r"\\u[dD][89a-fA-F]", text):
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise RequestValidationFailed(
                [{"loc": ["body"], "msg": "a string holds a lone UTF-16 surrogate (not valid Unicode)", "type": "string_unicode"}]
            ) from None
    return body


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


class Auth:
    """Bearer keys compared in constant time (every key is compared, on equal-length digests).

    Called with a request, it returns the caller's identity or raises :class:`APIError` 401.
    """

    def __init__(self, settings: AuthSettings) -> None:
        self.off = settings.auth_off
        self._digests = tuple(_digest(k) for k in settings.api_keys)

    def __call__(self, request: Request) -> str:
        """The caller's identity for per-key limits (a key digest, or the client address with auth off)."""
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        token = token.strip()
        if self.off:
            if scheme.lower() == "bearer" and token:
                return "key:" + _digest(token).hex()[:16]
            return "addr:" + (request.client.host if request.client else "?")
        if scheme.lower() != "bearer" or not token:
            raise APIError(401, "authentication_error", "missing bearer key: send Authorization: Bearer <key>",
                           {"WWW-Authenticate": "Bearer"})
        candidate = _digest(token)
        ok = False
        for d in self._digests:
            ok |= hmac.compare_digest(candidate, d)
        if not ok:
            raise APIError(401, "authentication_error", "invalid API key", {"WWW-Authenticate": "Bearer"})
        return "key:" + candidate.hex()[:16]


class AuthSettings(Protocol):
    """What :class:`Auth` reads of a server's settings."""

    auth_off: bool
    api_keys: tuple[str, ...]


def chat_completion_body(*, completion_id: str, model: str, fingerprint: str | None, message: dict[str, Any],
                         finish_reason: str, prompt_tokens: int, completion_tokens: int, logprobs: Any = None,
                         **extra: Any) -> dict[str, Any]:
    """An OpenAI ``chat.completion`` object with one choice.

    Args:
        completion_id: the id after ``chatcmpl-``.
        model: the served model's id.
        fingerprint: the checkpoint's sha256 (its first 12 characters go in ``system_fingerprint``), or
            None when no checkpoint is served (``envloop-base``).
        message: the assistant message (``role``, ``content``, ``refusal``, ``tool_calls`` when any).
        finish_reason: ``stop``, ``length`` or ``tool_calls``.
        prompt_tokens, completion_tokens: the usage (``total_tokens`` is their sum).
        logprobs: the choice's ``logprobs`` (None when not asked for).
        extra: further top-level fields (the decision server's ``x_`` fields).
    """
    return {
        "id": f"chatcmpl-{completion_id}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": f"envloop-{(fingerprint or 'base')[:12]}",
        "choices": [{"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}],
        "usage": {"prompt_tokens": int(prompt_tokens), "completion_tokens": int(completion_tokens),
                  "total_tokens": int(prompt_tokens) + int(completion_tokens)},
        **extra,
    }


__all__ = ["APIError", "Auth", "AuthSettings", "chat_completion_body", "read_json_body"]
