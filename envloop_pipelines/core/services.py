"""A server a door will use is probed before any work: a dead URL fails in seconds, in one line.

Issue 37: with ``MLFLOW_TRACKING_URI`` pointing at nothing, ``envloop round start`` spent 261 s and 296 lines of
urllib3 retries and tracebacks before saying ``Connection refused``, and ``--remote`` ran a whole round before
failing on MLflow. Every door (the CLI, ``LocalClient``, the remote ``Client``) asks each server it will use one
plain HTTP request, with no retries and a short timeout, first; the error names the URL and the setting that
gave it (``MLFLOW_TRACKING_URI``, ``--mlflow``, ``mlflow_uri``, ``dagster_url``) and says what happened: refused
at once, or no answer within the timeout.
"""

from __future__ import annotations

import socket
import urllib.error
import urllib.request

#: The most a probe waits for an answer (seconds); a refused connection fails at once.
PROBE_TIMEOUT_S = 5.0


class ServiceUnavailable(ConnectionError):
    """A server did not answer its probe; the message names it, its URL and the setting that gave the URL."""


def probe(url: str, *, name: str, setting: str, path: str = "", timeout_s: float = PROBE_TIMEOUT_S,
          http_error_fails: bool = True) -> None:
    """One GET of ``url + path`` (no retries, at most ``timeout_s``).

    Args:
        url: The server's base URL (``http(s)://host:port``).
        name: What it is, for the message (``the MLflow server``).
        setting: Where the URL came from (``MLFLOW_TRACKING_URI``, ``--mlflow`` ...).
        path: The path asked (``/health``).
        timeout_s: The most to wait.
        http_error_fails: Whether an HTTP error status counts as no answer (else any answer shows it is up).

    Raises:
        ServiceUnavailable: refused, unreachable, silent for ``timeout_s``, or (``http_error_fails``) an error status.
    """
    where = f"{name} at {url} (from {setting})"
    target = f"{url.rstrip('/')}{path}"
    try:
        with urllib.request.urlopen(target, timeout=timeout_s):
            return
    except urllib.error.HTTPError as exc:
        if http_error_fails:
            raise ServiceUnavailable(f"{where} answered {path or '/'} with HTTP {exc.code}") from None
        return
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        if isinstance(reason, (socket.timeout, TimeoutError)):
            raise ServiceUnavailable(f"{where} did not answer {path or '/'} within {timeout_s:g}s") from None
        raise ServiceUnavailable(f"{where} is not reachable: {type(reason).__name__}: {reason}") from None


def probe_tracking_uri(uri: str | None, setting: str, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Probe an MLflow tracking server's ``/health``; a local store (``sqlite:///...``, a path) needs none.

    Raises:
        ServiceUnavailable: the server did not answer (the message names ``uri`` and ``setting``).
    """
    if uri and uri.startswith(("http://", "https://")):
        probe(uri, name="the MLflow server", setting=setting, path="/health", timeout_s=timeout_s)


__all__ = ["PROBE_TIMEOUT_S", "ServiceUnavailable", "probe", "probe_tracking_uri"]
