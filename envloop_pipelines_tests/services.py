"""Real services the tests start on loopback: a free port and an ``mlflow server``."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def mlflow_server(root: Path, backend_store_uri: str, *, startup_timeout: float = 180.0) -> Iterator[str]:
    """A real ``mlflow server`` (one worker, artifacts served from ``root/artifacts``); yields its URL.

    Fails the test with the tail of the server's log when it exits or does not answer
    ``/health`` in time; terminated (then killed) on exit.
    """
    root.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log_path = root / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [str(Path(sys.executable).with_name("mlflow")), "server", "--backend-store-uri", backend_store_uri,
             "--artifacts-destination", (root / "artifacts").as_uri(), "--host", "127.0.0.1", "--port", str(port),
             "--workers", "1"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"mlflow server ({backend_store_uri.split(':')[0]} backend) did not come up: "
                            f"{log_path.read_text(errors='replace')[-3000:]}")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
