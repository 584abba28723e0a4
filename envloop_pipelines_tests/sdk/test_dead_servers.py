"""A dead server is found in seconds, in one line naming its URL and the setting that gave it, at every door
(issue 37): locally ``MLFLOW_TRACKING_URI=http://127.0.0.1:9 envloop round start`` took 261 s and 296 lines of
urllib3 retries; ``--remote D --mlflow <dead>`` ran a whole round first; the SDK said "did not answer /health
within 60s" when it had failed at once."""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from envloop_pipelines.cli import main
from envloop_pipelines.sdk.client import Client
from envloop_pipelines.sdk.errors import UnavailableError
from envloop_pipelines.sdk.local import LocalClient
from envloop_pipelines.testing.services import free_port

DEAD = "http://127.0.0.1:9"  # the discard port: nothing listens, the connection is refused at once
REFUSED = f"the MLflow server at {DEAD} (from {{setting}}) is not reachable: ConnectionRefusedError"
BOUND_S = 5.0


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("ENVLOOP_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", DEAD)
    return tmp_path / "home"


@pytest.fixture
def webserver() -> Iterator[str]:
    """Something that answers HTTP where the Dagster webserver would be (the probe only asks whether it is up)."""

    class Ok(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Ok)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _one_line(output: str) -> str:
    lines = [line for line in output.strip().splitlines() if line.strip()]
    assert len(lines) == 1, output
    return lines[0]


def test_envloop_round_start_with_a_dead_mlflow_fails_in_seconds_in_one_line(home: Path) -> None:
    started = time.monotonic()
    result = CliRunner().invoke(main, ["round", "start", "--task", "personal_agent"])
    took = time.monotonic() - started
    assert result.exit_code == 1, result.output
    assert _one_line(result.output).startswith("Error: " + REFUSED.format(setting="MLFLOW_TRACKING_URI"))
    assert took < BOUND_S, took
    assert not (home / "loops").exists()  # nothing was set up or started


def test_envloop_round_start_remote_with_a_dead_mlflow_fails_before_any_round(webserver: str,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    started = time.monotonic()
    result = CliRunner().invoke(main, ["round", "start", "--remote", webserver, "--mlflow", DEAD])
    took = time.monotonic() - started
    assert result.exit_code == 1, result.output
    assert _one_line(result.output).startswith("Error: " + REFUSED.format(setting="--mlflow"))
    assert took < BOUND_S, took


def test_envloop_round_start_remote_with_a_dead_webserver_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    dead = f"http://127.0.0.1:{free_port()}"
    result = CliRunner().invoke(main, ["round", "start", "--remote", dead])
    assert result.exit_code == 1, result.output
    assert _one_line(result.output).startswith(f"Error: the Dagster webserver at {dead} (from dagster_url) is not "
                                               f"reachable: ConnectionRefusedError")


def test_a_local_client_with_a_dead_mlflow_fails_in_seconds(home: Path) -> None:
    client = LocalClient({"task": "personal_agent"})
    for door in (client.setup, client.start_round, client.run_round, lambda: client.run_loop(rounds=1)):
        started = time.monotonic()
        with pytest.raises(UnavailableError) as failed:
            door()
        assert time.monotonic() - started < BOUND_S
        assert _one_line(str(failed.value)).startswith(REFUSED.format(setting="MLFLOW_TRACKING_URI"))
    assert not (home / "loops").exists()


def test_the_remote_client_says_it_was_refused_at_once_not_that_it_waited_60s(webserver: str) -> None:
    client = Client(webserver, mlflow_uri=DEAD)  # the default timeout_s, 60
    for door in (client.releases, client.setup, client.start_round):
        started = time.monotonic()
        with pytest.raises(UnavailableError) as failed:
            door()
        assert time.monotonic() - started < BOUND_S
        message = _one_line(str(failed.value))
        assert message.startswith(REFUSED.format(setting="mlflow_uri")) and "60s" not in message, message
    dead = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(UnavailableError, match=rf"^the Dagster webserver at {dead} \(from dagster_url\) is not "
                                               rf"reachable: ConnectionRefusedError"):
        Client(dead, mlflow_uri=DEAD).start_round()
