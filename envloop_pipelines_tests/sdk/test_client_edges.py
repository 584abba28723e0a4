"""The client's and the CLI's edges without a deployment (issue 27): dead servers fail fast and say which,
bad arguments are refused naming what is allowed, progress reaches a person, MLflow runs are closed,
``envloop ui`` takes its children with it, and ``--json`` commands keep stdout JSON."""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from envloop_pipelines.cli import main
from envloop_pipelines.sdk.client import Client
from envloop_pipelines.sdk.errors import RefusedError, UnavailableError
from envloop_pipelines.testing.services import free_port


def test_a_dead_mlflow_url_fails_at_once_naming_the_server() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(UnavailableError, match=rf"the MLflow server at {dead} \(from mlflow_uri\) is not reachable"):
        Client("http://127.0.0.1:9", mlflow_uri=dead, timeout_s=5).releases()
    assert time.monotonic() - started < 5  # was 248 s: MLflow's own retries


def test_an_mlflow_server_that_never_answers_fails_after_the_clients_timeout() -> None:
    with socket.socket() as silent:  # accepts connections (the backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        uri = f"http://127.0.0.1:{silent.getsockname()[1]}"
        started = time.monotonic()
        with pytest.raises(UnavailableError, match="did not answer /health within 2s"):
            Client("http://127.0.0.1:9", mlflow_uri=uri, timeout_s=2).champion()
        assert 1.5 < time.monotonic() - started < 10


def test_a_dead_dagster_url_is_unavailable_and_a_bad_kind_is_refused_before_any_request() -> None:
    client = Client(f"http://127.0.0.1:{free_port()}")
    with pytest.raises(UnavailableError, match="did not answer"):
        client.round_keys()
    with pytest.raises(RefusedError, match=r"kind: 'arm_finished' is not a ledger event kind; allowed: .*round_decided"):
        client.ledger(kind="arm_finished")


def test_releases_remote_without_mlflow_names_the_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    result = CliRunner().invoke(main, ["releases", "--remote", "http://127.0.0.1:9"])
    assert result.exit_code == 2 and "--mlflow" in result.output and "mlflow_uri" not in result.output, result.output


PROGRESS = """
import sys, time
from envloop_pipelines.core.progress import Progress, ensure_shown
print(ensure_shown(), flush=True)
bar = Progress("round r0001", total=4, unit="step", quiet_s=0.0)
for _ in range(4):
    time.sleep(0.05)
    bar.update(1)
bar.close()
"""


def test_progress_reaches_a_notebook_whose_stderr_is_no_terminal() -> None:
    env = {k: v for k, v in os.environ.items() if k != "ENVLOOP_PROGRESS"}
    done = subprocess.run([sys.executable, "-c", PROGRESS], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True"
    assert any(line.startswith("round r0001: 100% 4/4 step [") for line in done.stderr.splitlines()), done.stderr


BAR = """
import os, time
os.environ.pop("ENVLOOP_PROGRESS", None)
from envloop_pipelines.core.progress import Progress
time.sleep(0.5)  # the parent sets the terminal's size meanwhile
bar = Progress("round r0001", total=3, unit="step", quiet_s=0.0)
for _ in range(3):
    time.sleep(0.3)
    bar.update(1)
bar.close()
"""


@pytest.mark.parametrize("rows,columns", [(0, 0), (0, 80), (24, 0)])
def test_a_terminal_of_any_reported_size_shows_the_bar(rows: int, columns: int) -> None:
    import fcntl
    import termios

    pid, fd = pty.fork()
    if pid == 0:  # the child: a fresh Python whose stderr is the pseudo-terminal, a bar on it
        os.execv(sys.executable, [sys.executable, "-c", BAR])
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    out = b""
    while True:
        ready, _, _ = select.select([fd], [], [], 60)
        if not ready:
            break
        try:
            data = os.read(fd, 4096)
        except OSError:
            break
        if not data:
            break
        out += data
    os.waitpid(pid, 0)
    assert b"round r0001: 100%" in out and b"3/3" in out, out[-500:]


def test_a_rounds_mlflow_runs_are_closed_with_its_status(tmp_path: Path) -> None:
    from envloop_pipelines.core.loop.config import LoopConfig
    from envloop_pipelines.core.release.tracked_runs import child_run
    from envloop_pipelines.core.tracking import MlflowTracker, close_round_runs

    tracker = MlflowTracker(f"sqlite:///{tmp_path / 'mlflow.db'}", home=tmp_path)
    config = LoopConfig(task="personal_agent", home=str(tmp_path))
    hypothesis = child_run(tracker, config, "r0001", "registered_hypothesis")
    tracker.end_run(hypothesis.run_id)
    training = child_run(tracker, config, "r0001", "lora_checkpoint")  # its step fails: left RUNNING
    other = child_run(tracker, config, "r0002", "lora_checkpoint")
    parent = tracker.find_run("personal_agent", {"envloop.round": "r0001", "envloop.kind": "round"})

    def status(run_id: str) -> str:
        return tracker.client.get_run(run_id).info.status

    assert status(parent.run_id) == "RUNNING"
    assert sorted(close_round_runs(tracker, "personal_agent", "r0001", "FAILED")) == sorted([parent.run_id, training.run_id])
    assert (status(parent.run_id), status(training.run_id), status(hypothesis.run_id)) == ("FAILED", "FAILED", "FINISHED")
    assert status(other.run_id) == "RUNNING"  # another round's runs are left alone
    # a decided round closes its parent only (its steps closed their own)
    parent2 = tracker.find_run("personal_agent", {"envloop.round": "r0002", "envloop.kind": "round"})
    assert close_round_runs(tracker, "personal_agent", "r0002", "FINISHED", parent_only=True) == [parent2.run_id]
    assert (status(parent2.run_id), status(other.run_id)) == ("FINISHED", "RUNNING")
    # a retry of the failed r0001 decides it: its parent, closed FAILED before, ends FINISHED
    assert close_round_runs(tracker, "personal_agent", "r0001", "FINISHED", parent_only=True) == [parent.run_id]
    assert status(parent.run_id) == "FINISHED"
    with pytest.raises(ValueError, match="status: 'DONE'"):
        close_round_runs(tracker, "personal_agent", "r0001", "DONE")


UI = """
import sys
from envloop_pipelines.cli.ui import run_process_group
sys.exit(run_process_group(["bash", "-c", "sleep 300 & echo $! > {pids}; sleep 300 & echo $! >> {pids}; wait"], grace_s=5))
"""


def test_stopping_ui_stops_the_children_of_its_server(tmp_path: Path) -> None:
    pids_file = tmp_path / "pids"
    proc = subprocess.Popen([sys.executable, "-c", UI.format(pids=pids_file)])
    deadline = time.monotonic() + 60
    while not (pids_file.exists() and len(pids_file.read_text().split()) == 2):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.1)
    children = [int(p) for p in pids_file.read_text().split()]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 130
    time.sleep(0.5)
    alive = []
    for pid in children:
        try:
            os.kill(pid, 0)
            alive.append(pid)
        except ProcessLookupError:
            pass
    for pid in alive:  # leave nothing behind, whatever the outcome
        os.kill(pid, signal.SIGKILL)
    assert alive == []


JSON_ONLY = """
import click, sys
from envloop_pipelines.cli.model import stdout_to_stderr
with stdout_to_stderr():
    print("[WARNING] a library's warning on stdout")
    import os; os.system("echo from a subprocess")
print('{"checkpoint": "x"}')
"""


def test_json_commands_keep_library_output_off_stdout() -> None:
    done = subprocess.run([sys.executable, "-c", JSON_ONLY], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"checkpoint": "x"}
    assert "a library's warning" in done.stderr and "from a subprocess" in done.stderr


@pytest.mark.slow
def test_train_prints_only_json_on_stdout(tmp_path: Path) -> None:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("ENVLOOP_")}, "ENVLOOP_HOME": str(tmp_path / "home"),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    envloop = str(Path(sys.executable).with_name("envloop"))
    generated = subprocess.run([envloop, "data", "generate", "--users", "20", "--records-per-user", "3"], env=env,
                               capture_output=True, text=True, timeout=600)
    assert generated.returncode == 0, generated.stderr[-2000:]
    out = tmp_path / "ckpt"
    done = subprocess.run([envloop, "train", "--task", "personal_agent", "--recipe", "packaged:decision_head_cpu.yaml",
                           "--out", str(out), "--recipe-override", "max_steps=2", "--recipe-override", "max_length=128"], env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout)["checkpoint"] == str(out), done.stdout[:500]  # `| jq .checkpoint` works
