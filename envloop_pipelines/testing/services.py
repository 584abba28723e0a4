"""Real services the tests and the benches start on loopback: a free port, ``mlflow server``, ``dagster-webserver``."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from envloop_pipelines.names import ROUND_JOB



def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def mlflow_server(root: Path, backend_store_uri: str, *, startup_timeout: float = 180.0) -> Iterator[str]:
    """A real ``mlflow server`` (one worker, artifacts served from ``root/artifacts``); yields its URL.

    Raises :class:`RuntimeError` with the tail of the server's log when it exits or does not answer
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
                raise RuntimeError(f"mlflow server ({backend_store_uri.split(':')[0]} backend) did not come up: "
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


#: A Dagster instance for a webserver without a daemon: runs launch as soon as they are submitted
#: (the default queued coordinator waits for dagster-daemon), with the shipped file's python_logs.
WEBSERVER_INSTANCE = {
    "storage": {"sqlite": {"base_dir": {"env": "DAGSTER_HOME"}}},
    "run_coordinator": {"module": "dagster._core.run_coordinator", "class": "DefaultRunCoordinator"},
    "telemetry": {"enabled": False},
    "nux": {"enabled": False},
}


@contextmanager
def dagster_webserver(root: Path, env: dict[str, str], *, startup_timeout: float = 240.0,
                      instance: dict | None = None) -> Iterator[str]:
    """A real ``dagster-webserver`` serving ``envloop_pipelines.definitions`` on loopback; yields its URL.

    ``root`` gets the Dagster home (``root/dagster``, :data:`WEBSERVER_INSTANCE` plus the shipped instance
    file's ``python_logs``, then ``instance``'s sections) and the server's log. ``env`` is the code location's environment (the
    ``ENVLOOP_*`` settings, ``ENVLOOP_HOME``, ``MLFLOW_TRACKING_URI``); runs inherit it. The server answers
    once the code location has loaded (``round_job`` is listed), else :class:`RuntimeError` with the tail of
    its log; it is terminated with its process group.
    """
    import json
    import os
    import signal

    import yaml

    from envloop_pipelines.sdk.instance import INSTANCE_FILE

    dagster_home = root / "dagster"
    dagster_home.mkdir(parents=True, exist_ok=True)
    shipped = yaml.safe_load(INSTANCE_FILE.read_text(encoding="utf-8"))
    (dagster_home / "dagster.yaml").write_text(yaml.safe_dump({**WEBSERVER_INSTANCE, "python_logs": shipped["python_logs"],
                                                               **(instance or {})}))
    port = free_port()
    log_path = root / "webserver.log"
    full_env = {**env, "DAGSTER_HOME": str(dagster_home)}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [str(Path(sys.executable).with_name("dagster-webserver")), "-m", "envloop_pipelines.definitions",
             "-h", "127.0.0.1", "-p", str(port)],
            stdout=log, stderr=subprocess.STDOUT, env=full_env, cwd=str(root), start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    query = json.dumps({"query": "{ repositoriesOrError { ... on RepositoryConnection { nodes { jobs { name } } } } }"})
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            try:
                request = urllib.request.Request(f"{url}/graphql", data=query.encode(),
                                                 headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(request, timeout=5) as r:
                    nodes = json.loads(r.read())["data"]["repositoriesOrError"].get("nodes") or []
                    if any(j["name"] == ROUND_JOB for n in nodes for j in n["jobs"]):
                        break
            except (OSError, KeyError, ValueError):
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"dagster-webserver did not load the code location: {log_path.read_text(errors='replace')[-3000:]}")
            time.sleep(1.0)
        yield url
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
