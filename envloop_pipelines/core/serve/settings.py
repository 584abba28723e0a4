"""What a server is started with: :class:`ServeSettings`, and where its model comes from.

A server serves exactly one checkpoint under one *versioned* model id. The
checkpoint comes either from a directory (``--checkpoint``) or from the release
chain of a task (``--release N|champion --task NAME``): the release card names
the checkpoint directory and its sha256 (its identity,
:func:`~envloop_pipelines.core.model.checkpoint.checkpoint_hash`), which is
checked again at every load.

Model ids: a release answers as ``envloop-<task>-r<NNNN>`` (``NNNN`` = the
release number, zero-padded); a bare checkpoint as
``envloop-<directory name>-<first 12 hex of its checkpoint hash>``. Clients
may also ask for the aliases ``jev-latest`` and ``jev-preview``; the answer
always names the versioned id.

API keys come from a file (one key per line, ``#`` comments and blank lines
ignored) and/or the environment variable ``ENVLOOP_SERVE_KEYS`` (comma or
whitespace separated). A server without keys refuses to start unless
``auth_off`` says, explicitly, that every route is open.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal, Mapping

#: The aliases every server accepts in a request's ``model`` (besides its versioned id).
MODEL_ALIASES: tuple[str, ...] = ("jev-latest", "jev-preview")
#: Environment variable holding API keys (comma or whitespace separated).
KEYS_ENV = "ENVLOOP_SERVE_KEYS"
#: ``docs/jev-api.md``: 64k tokens per request, 32k for the state plus the longest question.
DEFAULT_REQUEST_TOKEN_BUDGET = 65_536
DEFAULT_STATE_TOKEN_BUDGET = 32_768


class SettingsError(ValueError):
    """A serve setting is invalid; the message names the field and the allowed values."""


def _fail(name: str, allowed: str, got: Any) -> None:
    raise SettingsError(f"serve setting {name!r}: expected {allowed}, got {got!r}")


@dataclass(frozen=True)
class ServeSettings:
    """Everything a server needs; validated where it is built.

    Attributes:
        checkpoint_dir: The checkpoint to serve.
        model_id: The versioned id answers carry (see the module docstring).
        release: The release number when served from the release chain.
        task: The task name when served from the release chain.
        release_date: ``YYYY-MM-DD`` shown by ``GET /v1/models``.
        expected_checkpoint_sha256: The release card's checkpoint sha256, checked at every load.
        api_keys: Accepted bearer keys (never printed).
        auth_off: Serve every route without a key (must be explicit).
        host, port: Where to listen; ``port=0`` picks a free port (see ``port_file``).
        port_file: Where to write the bound port once listening (for supervisors and tests).
        idle_timeout_s: Unload the model after this many idle seconds; ``None`` never unloads.
        preload: Load the model at startup (else on the first request).
        micro_batching: Gather concurrent requests into one forward pass.
        max_batch: Questions per gathered batch (one ``predict`` call).
        forward_batch: Questions per forward pass inside that call (sorted by length, so each pass pads little);
            None: ``max_batch`` on a CUDA device, 16 on CPU. Why 16 on CPU: MiniLM at max_length 256, one
            torch thread of a shared 2-core machine, 48 benchmark questions: 15.5 q/s one question per pass,
            ~18 q/s at 4 to 16 per pass, 13 q/s at 48 per pass (padding to the longest and a larger working
            set cost more than batching saves there); a GPU gains from every question it gets at once.
        max_wait_ms: How long the first request of a batch waits for company.
        max_queue: Questions allowed to wait for the model; beyond it requests get 529.
        max_inflight_per_key: Requests in flight per API key; beyond it 429. ``None``: no limit.
        max_body_bytes: Largest request body (before and after decompression); beyond it 413.
        max_questions: Questions per request; beyond it 422. A request is answered in one batch, so this
            bounds how long one request can hold the model (128 questions ≈ 8 s on 2 CPU cores).
        request_token_budget: Tokens per request (state plus every question).
        state_token_budget: Tokens for the state plus the longest question.
        request_timeout_s: Longest wait for an answer before a 504 ``timeout``.
        graceful_shutdown_s: On SIGTERM, how long in-flight requests may take to finish.
        torch_threads: ``torch.set_num_threads`` for the server process (None: torch's default).
        log_level: Python/uvicorn log level.
    """

    checkpoint_dir: Path
    model_id: str
    release: int | None = None
    task: str | None = None
    release_date: str = field(default_factory=lambda: datetime.now(timezone.utc).strftime("%Y-%m-%d"))
    expected_checkpoint_sha256: str | None = None
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    auth_off: bool = False
    host: str = "127.0.0.1"
    port: int = 8000
    port_file: Path | None = None
    idle_timeout_s: float | None = 900.0
    preload: bool = True
    micro_batching: bool = True
    max_batch: int = 64
    forward_batch: int | None = None
    max_wait_ms: float = 5.0
    max_queue: int = 256
    max_inflight_per_key: int | None = None
    max_body_bytes: int = 4 * 1024 * 1024
    max_questions: int = 128
    request_token_budget: int = DEFAULT_REQUEST_TOKEN_BUDGET
    state_token_budget: int = DEFAULT_STATE_TOKEN_BUDGET
    request_timeout_s: float = 120.0
    graceful_shutdown_s: float = 30.0
    torch_threads: int | None = None
    log_level: str = "info"

    def __post_init__(self) -> None:
        object.__setattr__(self, "checkpoint_dir", Path(self.checkpoint_dir))
        if self.port_file is not None:
            object.__setattr__(self, "port_file", Path(self.port_file))
        if not isinstance(self.model_id, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}", self.model_id):
            _fail("model_id", "1-128 characters of [A-Za-z0-9._:/-], starting alphanumeric", self.model_id)
        if self.model_id in MODEL_ALIASES:
            _fail("model_id", f"a versioned id, not one of the aliases {MODEL_ALIASES}", self.model_id)
        if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", self.release_date or ""):
            _fail("release_date", "a YYYY-MM-DD date", self.release_date)
        keys = tuple(self.api_keys)
        for k in keys:
            if not k or not k.isascii() or not k.isprintable() or " " in k:
                raise SettingsError("serve setting 'api_keys': every key must be printable ASCII without whitespace")
        object.__setattr__(self, "api_keys", keys)
        if not isinstance(self.auth_off, bool):
            _fail("auth_off", "true or false", self.auth_off)
        if not self.auth_off and not keys:
            raise SettingsError(
                f"serve setting 'api_keys': no API keys; pass a keys file, set {KEYS_ENV}, or turn auth off explicitly (auth_off=True)"
            )
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            _fail("port", "an integer in [0, 65535]", self.port)
        if self.idle_timeout_s is not None and (not _finite(self.idle_timeout_s) or self.idle_timeout_s <= 0):
            _fail("idle_timeout_s", "a positive number of seconds, or None to never unload", self.idle_timeout_s)
        if self.forward_batch is not None and (
            isinstance(self.forward_batch, bool) or not isinstance(self.forward_batch, int) or self.forward_batch < 1
        ):
            _fail("forward_batch", "an integer ≥ 1, or None for the device's default", self.forward_batch)
        for name, low in (("max_batch", 1), ("max_queue", 1), ("max_body_bytes", 1024), ("max_questions", 1),
                          ("request_token_budget", 16), ("state_token_budget", 16)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                _fail(name, f"an integer ≥ {low}", value)
        if self.max_inflight_per_key is not None and (
            isinstance(self.max_inflight_per_key, bool) or not isinstance(self.max_inflight_per_key, int) or self.max_inflight_per_key < 1
        ):
            _fail("max_inflight_per_key", "an integer ≥ 1, or None for no limit", self.max_inflight_per_key)
        if self.state_token_budget > self.request_token_budget:
            _fail("state_token_budget", f"at most request_token_budget ({self.request_token_budget})", self.state_token_budget)
        for name in ("max_wait_ms", "request_timeout_s", "graceful_shutdown_s"):
            value = getattr(self, name)
            if not _finite(value) or value < 0:
                _fail(name, "a finite number ≥ 0", value)
        if self.torch_threads is not None and (not isinstance(self.torch_threads, int) or self.torch_threads < 1):
            _fail("torch_threads", "an integer ≥ 1, or None", self.torch_threads)
        if self.log_level not in ("critical", "error", "warning", "info", "debug"):
            _fail("log_level", "one of critical, error, warning, info, debug", self.log_level)

    def resolved_forward_batch(self) -> int:
        """Questions per forward pass: ``forward_batch``, else ``max_batch`` on CUDA and ``min(16, max_batch)`` on CPU."""
        if self.forward_batch is not None:
            return self.forward_batch
        import torch

        return self.max_batch if torch.cuda.is_available() else min(16, self.max_batch)

    @property
    def accepted_models(self) -> tuple[str, ...]:
        """The names a request's ``model`` may take."""
        return (*MODEL_ALIASES, self.model_id)

    def replace(self, **changes: Any) -> "ServeSettings":
        """A copy with ``changes`` applied, validated again."""
        return dataclasses.replace(self, **changes)


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# --------------------------------------------------------------------------- keys


def load_api_keys(keys_file: str | Path | None = None, *, environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """Keys from ``keys_file`` (one per line, ``#`` comments) and ``$ENVLOOP_SERVE_KEYS``, deduplicated, in order.

    Raises:
        FileNotFoundError: the keys file does not exist.
    """
    env = os.environ if environ is None else environ
    keys: list[str] = []
    if keys_file is not None:
        for line in Path(keys_file).read_text(encoding="utf-8").splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                keys.append(line)
    keys.extend(k for k in re.split(r"[\s,]+", env.get(KEYS_ENV, "")) if k)
    return tuple(dict.fromkeys(keys))


# --------------------------------------------------------------------------- where the model comes from


@dataclass(frozen=True)
class ModelSource:
    """A resolved checkpoint with its identity."""

    checkpoint_dir: Path
    model_id: str
    release: int | None
    task: str | None
    release_date: str
    expected_checkpoint_sha256: str | None


def _slug(text: str) -> str:
    s = re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-._")
    return s or "model"


def release_model_id(task: str, release: int) -> str:
    """The id a release answers as, wherever its checkpoint was read from (``envloop-<task>-r<NNNN>``)."""
    return f"envloop-{_slug(task)}-r{int(release):04d}"


def source_from_release_checkpoint(checkpoint_dir: str | Path, task: str, release: int) -> ModelSource:
    """A release's checkpoint read from elsewhere (the remote client's download from MLflow) served as that
    release: the id, task and release number a home's release chain gives it (:func:`source_from_release`).

    Raises:
        FileNotFoundError: the directory has no ``manifest.json``.
    """
    return dataclasses.replace(source_from_checkpoint(checkpoint_dir), model_id=release_model_id(task, release),
                               release=int(release), task=task)


def source_from_checkpoint(checkpoint_dir: str | Path, *, model_id: str | None = None) -> ModelSource:
    """A checkpoint directory served under ``envloop-<dir>-<sha[:12]>`` (or ``model_id``).

    Raises:
        FileNotFoundError: the directory has no ``manifest.json``.
    """
    from envloop_pipelines.core.model.checkpoint import MANIFEST, checkpoint_hash

    path = Path(checkpoint_dir).expanduser().resolve()
    manifest = path / MANIFEST
    if not manifest.is_file():
        raise FileNotFoundError(f"{path} is not a checkpoint directory (no {MANIFEST})")
    sha = checkpoint_hash(path)
    date = datetime.fromtimestamp(manifest.stat().st_mtime, timezone.utc).strftime("%Y-%m-%d")
    return ModelSource(
        checkpoint_dir=path,
        model_id=model_id or f"envloop-{_slug(path.name)}-{sha[:12]}",
        release=None,
        task=None,
        release_date=date,
        expected_checkpoint_sha256=sha,
    )


def source_from_release(
    task: str, release: int | Literal["champion"] | str = "champion", *, home: str | Path | None = None,
    model_id: str | None = None,
) -> ModelSource:
    """Resolve ``release`` (a number or ``"champion"`` = the latest card) of ``task``'s release chain.

    Raises:
        LookupError: the task has no releases, or not that one.
        ValueError: ``release`` is neither a positive integer nor ``"champion"``.
    """
    from envloop_pipelines.core.ledger.ledger import Ledger

    ledger = Ledger(task, home)
    cards = ledger.releases()
    if not cards:
        raise LookupError(f"task {task!r} has no releases yet under {ledger.root} (promote a candidate first)")
    if release == "champion":
        card = cards[-1]
    else:
        try:
            number = int(release)
        except (TypeError, ValueError):
            raise ValueError(f"release must be a positive integer or 'champion', got {release!r}") from None
        matching = [c for c in cards if int(c.get("release", -1)) == number]
        if not matching:
            have = ", ".join(str(c.get("release")) for c in cards)
            raise LookupError(f"task {task!r} has no release {number} (releases: {have})")
        card = matching[-1]
    number = int(card["release"])
    ckpt = Path(card["checkpoint_dir"])
    if not ckpt.is_absolute():
        ckpt = (ledger.root / ckpt).resolve()
    card_file = ledger.release_dir(number) / "card.json"
    date = card.get("release_date") or card.get("date")
    if not (isinstance(date, str) and re.fullmatch(r"\d{4}-\d{2}-\d{2}", date)):
        when = card_file.stat().st_mtime if card_file.exists() else datetime.now(timezone.utc).timestamp()
        date = datetime.fromtimestamp(when, timezone.utc).strftime("%Y-%m-%d")
    return ModelSource(
        checkpoint_dir=ckpt,
        model_id=model_id or release_model_id(task, number),
        release=number,
        task=task,
        release_date=date,
        expected_checkpoint_sha256=card.get("checkpoint_sha256"),
    )


def settings_for(source: ModelSource, **options: Any) -> ServeSettings:
    """:class:`ServeSettings` for a resolved model source plus any other settings."""
    return ServeSettings(
        checkpoint_dir=source.checkpoint_dir,
        model_id=source.model_id,
        release=source.release,
        task=source.task,
        release_date=source.release_date,
        expected_checkpoint_sha256=source.expected_checkpoint_sha256,
        **options,
    )


__all__ = [
    "DEFAULT_REQUEST_TOKEN_BUDGET",
    "DEFAULT_STATE_TOKEN_BUDGET",
    "KEYS_ENV",
    "MODEL_ALIASES",
    "ModelSource",
    "ServeSettings",
    "SettingsError",
    "load_api_keys",
    "release_model_id",
    "settings_for",
    "source_from_checkpoint",
    "source_from_release",
    "source_from_release_checkpoint",
]
