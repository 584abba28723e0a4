"""Run a server process: uvicorn on a socket we bind ourselves, with graceful shutdown.

:func:`serve_forever` is the one runner of both servers (``run(settings)`` for the decision model,
:func:`~envloop_pipelines.core.serve.generation.run_policy` for a policy): it binds ``host:port`` first (``port=0`` picks a free port), writes
the bound port to ``settings.port_file`` when asked (so a supervisor or a test
knows where to connect without racing for a port), and serves until SIGTERM or
SIGINT. On either signal uvicorn stops accepting connections, lets in-flight
requests finish for up to ``graceful_shutdown_s`` seconds, and only then runs
the app's shutdown (the batcher drains, the model unloads).
"""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path
from typing import Any, Callable, Protocol

from envloop_pipelines.core.serve.settings import ServeSettings

log = logging.getLogger(__name__)


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening-ready TCP socket bound to ``host:port`` (IPv6 when the host is an IPv6 address)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def _write_port_file(path: Path, port: int) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(f"{port}\n", encoding="ascii")
    tmp.replace(path)  # atomic: a reader never sees a half-written port


class RunSettings(Protocol):
    """What :func:`serve_forever` reads of a server's settings (``ServeSettings`` and ``PolicySettings`` alike)."""

    host: str
    port: int
    port_file: Path | None
    log_level: str
    torch_threads: int | None
    graceful_shutdown_s: float
    model_id: str


def serve_forever(make_app: Callable[[], Any], settings: RunSettings, *, what: str = "model") -> None:
    """Serve the app ``make_app()`` builds until SIGTERM/SIGINT (blocking): the one runner of both servers.

    Logging is configured (when nothing has) and torch's threads set before the app is built; the socket is
    bound first, the bound port written to ``settings.port_file`` when asked, then uvicorn serves on it.

    Args:
        make_app: builds the ASGI app (after logging and threads are set).
        settings: the server's settings.
        what: names the served thing in the "listening" log line (``model``, ``policy``).
    """
    import uvicorn

    if not logging.getLogger().handlers:
        logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if settings.torch_threads is not None:
        import torch

        torch.set_num_threads(settings.torch_threads)
    app = make_app()
    sock = bind_socket(settings.host, settings.port)
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        app,
        log_level=settings.log_level,
        access_log=False,
        timeout_graceful_shutdown=max(1, int(round(settings.graceful_shutdown_s))),
        lifespan="on",
    )
    server = uvicorn.Server(config)
    if settings.port_file is not None:
        sock.listen(2048)
        _write_port_file(settings.port_file, port)
    log.info("listening on http://%s:%d (%s %s)", settings.host, port, what, settings.model_id)
    server.run(sockets=[sock])


def run(settings: ServeSettings) -> None:
    """Serve the decision model of ``settings`` until SIGTERM/SIGINT (blocking)."""
    from envloop_pipelines.core.serve.app import create_app

    serve_forever(lambda: create_app(settings), settings, what="model")


__all__ = ["RunSettings", "bind_socket", "run", "serve_forever"]
