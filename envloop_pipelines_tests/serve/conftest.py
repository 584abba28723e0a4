"""Fixtures: one small real checkpoint per session, and the server as a real process on loopback."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from envloop_pipelines.testing.serve import ServerProcess, build_checkpoint, start_server

API_KEY = "serve-test-key"
OTHER_KEY = "serve-test-other-key"
#: The session server's body limit: small, so the 413 test sends little.
MAX_BODY_BYTES = 1024 * 1024


@pytest.fixture(scope="session")
def serve_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real checkpoint: decision head on MiniLM, 2 steps, max_length 128, calibrated on val."""
    return build_checkpoint(tmp_path_factory.mktemp("serve-ckpt") / "ckpt")


@pytest.fixture(scope="session")
def server(serve_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The default server: micro-batching on, no idle unload, two keys."""
    proc = start_server(
        serve_checkpoint, tmp_path_factory.mktemp("serve-main"),
        "--idle-timeout", "0", "--max-body-bytes", str(MAX_BODY_BYTES),
        keys=(API_KEY, OTHER_KEY),
    )
    yield proc
    code = proc.stop()
    # uvicorn re-raises the SIGTERM it handled once shutdown is complete: -15 is a clean, graceful exit
    assert code in (0, -signal.SIGTERM), proc.log_text()[-3000:]
    assert "Application shutdown complete" in proc.log_text()


@pytest.fixture(scope="session")
def client(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers=server.headers(), timeout=120) as c:
        yield c


@pytest.fixture(scope="session")
def model_id(client: httpx.Client) -> str:
    names = [m["name"] for m in client.get("/v1/models").json()["models"]]
    return next(n for n in names if n.startswith("envloop-"))
