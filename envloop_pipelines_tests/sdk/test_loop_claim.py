"""One claim for a task's whole loop, its setup and its rounds, at every door (issue 47).

Two ``envloop round start`` on one fresh home, 1.5 s apart: the second was not refused; it generated the benchmark
and trained both null arms beside the first and failed 110 s later inside ``noise_floor`` with
``HoldoutAlreadyReadError`` (134 lines, 37 of them traceback), and the ledger had two ``holdout_slot_opened`` events
for release 1. Here the doors are real processes and real Dagster runs on a SQLite instance under a temporary
``$DAGSTER_HOME``, the claim the real ``<home>/loops/<task>/round.claim``:

- a door holding the loop of a fresh home (as ``envloop round start`` does from its setup to its last round): the
  CLI, ``LocalClient`` and a launch of ``setup_job`` (the step a run of the remote ``Client``, the HTTP job API and
  the UI's launchpad comes to) are refused in one line naming its run, having written nothing; once its process is
  gone, its claim is taken over;
- two setups started together from two processes: one runs, the other is refused and leaves no run, no holdout slot
  and no null arm;
- a setup beside a running round (``LocalClient.start_round``'s worker): refused at every door.

The refusal's own time is measured in the refused process, from the start to the refusal (its CPU time too: on a
machine whose cores are busy a refusal may wait for the CPU, but it does not compute).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from envloop_pipelines.core.ledger.event_log import EVENT_HOLDOUT_SLOT, EVENT_NULL_ARM
from envloop_pipelines.core.ledger.ledger import Ledger
from envloop_pipelines.core.loop.round_claim import claim_path, read_claim
from envloop_pipelines.names import BUSY_WITH_TAG, CLIENT_TAG, REFUSED_TAG, SETUP_JOB
from envloop_pipelines.sdk.errors import BusyError, RefusedError

pytestmark = [pytest.mark.integration]

TASK = "personal_agent"
ENVLOOP = str(Path(sys.executable).with_name("envloop"))
# The issue's command: the built-in benchmark of 40 users, 2 null arms of 2 optimizer steps.
CLI_ARGS = ["--task", TASK, "--builtin-users", "40", "--recipe-override", "max_steps=2", "--noise-arms", "2",
            "--rounds", "1"]
SETTINGS = {"task": TASK, "builtin_users": 40, "noise_arms": 2, "recipe_overrides": {"max_steps": 2}}
# A round that trains long enough to run beside the doors (3,000 optimizer steps: minutes), then is cancelled.
LONG = {"change": {"kind": "recipe", "recipe_diff": {"max_steps": 3000}}, "predicted_delta": 0.1,
        "rationale": "a round that runs while a setup is started beside it"}
# The refusal reads the claim (and the instance's unfinished runs); it does no work of the loop. Its CPU time is
# well under a second; its wall time is given room for a starved CPU, and stays far below a setup's minutes.
REFUSAL_CPU_S = 5.0
REFUSAL_WALL_S = 30.0

# A door in a process of its own: it opens its client, says "ready", waits for the start (a line on stdin, given to
# every door at once), then holds the loop (until stdin closes) or runs the setup; refused, it prints the error and
# how long the refusal took, and exits 2.
DOOR = r"""
import json, sys, time
from envloop_pipelines.sdk import BusyError, LocalClient

what, settings = sys.argv[1], json.loads(sys.argv[2])
client = LocalClient(settings)
client.instance  # opened before the start: the doors race, not their imports
print("ready", flush=True)
sys.stdin.readline()
began, cpu = time.monotonic(), time.process_time()
try:
    if what == "hold":
        with client.hold_loop():
            print(json.dumps({"held": True}), flush=True)
            sys.stdin.readline()
    else:
        print(json.dumps({"ran": client.setup(progress=False).run_id}), flush=True)
except BusyError as exc:
    print(json.dumps({"busy": str(exc), "run_id": exc.run_id, "s": time.monotonic() - began,
                      "cpu_s": time.process_time() - cpu}), flush=True)
    raise SystemExit(2)
"""


def _env(root: Path) -> dict[str, str]:
    env = {**os.environ, "ENVLOOP_HOME": str(root / "home"), "DAGSTER_HOME": str(root / "dagster"),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("MLFLOW_TRACKING_URI", None)
    return env


def _door(root: Path, what: str, name: str) -> subprocess.Popen[str]:
    """A door process; its stderr (the setup's log lines) goes to ``<root>/<name>.log``, so that no pipe fills."""
    settings = {**SETTINGS, "home": str(root / "home")}
    with open(root / f"{name}.log", "w", encoding="utf-8") as log:
        return subprocess.Popen([sys.executable, "-c", DOOR, what, json.dumps(settings)], env=_env(root), text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, start_new_session=True)


def _log(root: Path, name: str) -> str:
    return (root / f"{name}.log").read_text(encoding="utf-8")[-3000:]


def _ready(door: subprocess.Popen[str], root: Path, name: str) -> None:
    line = door.stdout.readline()
    assert line.strip() == "ready", line + _log(root, name)


def _files(home: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``home`` with its size and modification time."""
    return {str(p.relative_to(home)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(home.rglob("*"))
            if p.is_file()}


def _refusal(run_id: str, what: str = "the setup", door: str = "LocalClient.hold_loop") -> str:
    """The one line a door refused by run ``run_id`` of this machine is told (after its own prefix)."""
    return (f"{what} of task {TASK!r} is running (run {run_id}, started by {door}, pid ")


def _follow(run_id: str) -> str:
    return f"wait for it (follow it in `envloop ui`) or cancel it (`envloop round cancel {run_id}`)"


@pytest.fixture()
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv("ENVLOOP_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    yield tmp_path


def _client(root: Path) -> Any:
    from envloop_pipelines.sdk.local import LocalClient

    return LocalClient({**SETTINGS, "home": str(root / "home")})


def _launch_setup_job(client: Any) -> Any:
    """``setup_job`` run on the instance as a launch from elsewhere runs it (no worker of this process named in its
    tags): the remote ``Client``'s door, the HTTP job API's and the launchpad's come to its first step."""
    from envloop_pipelines.sdk.instance import code_location_job

    return code_location_job(SETUP_JOB).execute_in_process(instance=client.instance, resources=client._resources,
                                                           tags={CLIENT_TAG: "sdk"}, raise_on_error=False)


def _assert_refused_run(client: Any, result: Any, holder_run: str, what: str, door: str) -> None:
    """A run of ``setup_job`` its first step refused as busy: tagged so, never retried, nothing after that step."""
    run = client.instance.get_run_by_id(result.dagster_run.run_id)
    assert not result.success and run.status == dg.DagsterRunStatus.FAILURE
    assert run.tags[REFUSED_TAG] == "busy" and run.tags[BUSY_WITH_TAG] == holder_run
    assert run.tags["dagster/retry_on_asset_or_op_failure"] == "false"
    error = client.run_error(run.run_id)
    assert error.step == "task_benchmark", error
    assert error.message.startswith(f"setup: refused: {_refusal(holder_run, what, door)}"), error
    assert error.message.endswith(_follow(holder_run)) and "\n" not in error.message, error
    started = {r.event_log_entry.dagster_event.step_key for r in client.instance.get_records_for_run(
        run.run_id, of_type=dg.DagsterEventType.STEP_START).records}
    assert started == {"task_benchmark"}  # the noise floor never ran


def test_a_door_holding_a_fresh_homes_loop_refuses_every_other_door_which_writes_nothing(root: Path) -> None:
    """The CLI (the issue's command), ``LocalClient.setup`` / ``run_loop`` / ``start_round`` and a launch of
    ``setup_job`` beside a door that holds the loop for its setup: each refused in one line naming the holder's run
    and ``envloop round cancel``, before anything is generated or written (the home's files unchanged, no run of the
    CLI's or the client's); the holder killed, its claim is taken over."""
    holder = _door(root, "hold", "holder")
    try:
        _ready(holder, root, "holder")
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert json.loads(holder.stdout.readline()) == {"held": True}, _log(root, "holder")
        claim = read_claim(TASK, root / "home")
        assert (claim.round, claim.door, claim.pid, claim.holder is not None) == (
            "setup", "LocalClient.hold_loop", holder.pid, True)
        home = root / "home"
        before = _files(home)
        assert set(before) == {f"loops/{TASK}/round.claim", f"loops/{TASK}/round.claim.lock"}  # a fresh home

        cli = subprocess.run([ENVLOOP, "round", "start", *CLI_ARGS], env=_env(root), capture_output=True, text=True,
                             timeout=600)
        lines = (cli.stdout + cli.stderr).strip().splitlines()
        assert cli.returncode == 2, cli.stdout + cli.stderr
        assert len(lines) == 1, lines  # one line: no setup, no traceback
        assert lines[0].startswith(f"Error: {_refusal(claim.run_id)}{holder.pid} on {socket.gethostname()})"), lines
        assert lines[0].endswith(_follow(claim.run_id)), lines
        assert _files(home) == before

        client = _client(root)
        for name, call in (("setup", lambda: client.setup(progress=False)),
                           ("run_loop", lambda: client.run_loop(rounds=1, progress=False)),
                           ("start_round", client.start_round)):
            began, cpu = time.monotonic(), time.process_time()
            with pytest.raises(BusyError) as busy:
                call()
            took, cpu_s = time.monotonic() - began, time.process_time() - cpu
            assert isinstance(busy.value, RefusedError) and busy.value.run_id == claim.run_id, name
            assert str(busy.value).startswith(_refusal(claim.run_id)), (name, str(busy.value))
            assert str(busy.value).endswith(_follow(claim.run_id)) and "\n" not in str(busy.value), name
            assert cpu_s < REFUSAL_CPU_S and took < REFUSAL_WALL_S, (name, took, cpu_s)
        assert _files(home) == before
        assert client.instance.get_runs() == []  # neither the CLI nor the client created a run

        result = _launch_setup_job(client)
        _assert_refused_run(client, result, claim.run_id, "the setup", "LocalClient.hold_loop")
        assert _files(home) == before  # no benchmark, no ledger, no MLflow store
        assert read_claim(TASK, home) == claim
    finally:
        holder.kill()
        holder.wait(timeout=60)

    # its process gone, the hold is stale: the next door takes it over (and gives it back when done)
    client = _client(root)
    with client.hold_loop():
        taken = read_claim(TASK, root / "home")
        assert taken.run_id != claim.run_id and taken.pid == os.getpid() and taken.holder not in (None, claim.holder)
    assert not claim_path(TASK, root / "home").exists()


@pytest.fixture(scope="module")
def raced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Two ``LocalClient.setup`` processes on one fresh home, started at once; the winner's setup run to its end."""
    root = tmp_path_factory.mktemp("raced")
    doors = [_door(root, "setup", f"door{i}") for i in range(2)]
    try:
        for i, door in enumerate(doors):
            _ready(door, root, f"door{i}")
        for door in doors:  # the start, to both at once
            door.stdin.write("\n")
            door.stdin.flush()
        answers = []
        for i, door in enumerate(doors):
            out, _ = door.communicate(timeout=5400)
            answers.append({"rc": door.returncode, "pid": door.pid, "out": out, "err": _log(root, f"door{i}")})
    finally:
        for door in doors:
            if door.poll() is None:
                os.killpg(door.pid, signal.SIGKILL)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ENVLOOP_HOME", str(root / "home"))
        mp.setenv("DAGSTER_HOME", str(root / "dagster"))
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        client = _client(root)
        yield {"root": root, "answers": answers, "client": client}
        client.close()


def test_of_two_setups_started_together_one_runs_and_the_other_is_refused_leaving_no_trace(
        raced: dict[str, Any]) -> None:
    answers = raced["answers"]
    won = [a for a in answers if a["rc"] == 0]
    lost = [a for a in answers if a["rc"] == 2]
    assert len(won) == 1 and len(lost) == 1, [(a["rc"], a["out"], a["err"][-2000:]) for a in answers]
    run_id = json.loads(won[0]["out"].strip().splitlines()[-1])["ran"]
    refused = json.loads(lost[0]["out"].strip().splitlines()[-1])
    assert refused["run_id"] == run_id
    assert refused["busy"] == (f"{_refusal(run_id, door='LocalClient.setup')}{won[0]['pid']} on "
                               f"{socket.gethostname()}): {_follow(run_id)}")
    assert refused["cpu_s"] < REFUSAL_CPU_S and refused["s"] < REFUSAL_WALL_S, refused
    assert "Traceback" not in lost[0]["err"], lost[0]["err"][-3000:]

    client = raced["client"]
    runs = client.instance.get_runs(filters=dg.RunsFilter(job_name=SETUP_JOB))
    assert [(r.run_id, r.status) for r in runs] == [(run_id, dg.DagsterRunStatus.SUCCESS)]  # the loser made none
    ledger = Ledger(TASK, raced["root"] / "home")
    slots = [e for e in ledger.events(EVENT_HOLDOUT_SLOT) if e.get("release") == 1]
    assert len(slots) == 1, slots
    assert len(list(ledger.events(EVENT_NULL_ARM))) == SETTINGS["noise_arms"]
    assert read_claim(TASK, raced["root"] / "home") is None  # given back when the setup ended


def test_a_setup_beside_a_running_round_is_refused_at_every_door(raced: dict[str, Any]) -> None:
    """A round started by ``LocalClient.start_round`` (its claim held by its worker): a setup from the CLI, from
    ``LocalClient.setup`` and a launch of ``setup_job`` are refused naming the round's run; none reads the test set
    or opens a holdout slot; then the round is cancelled."""
    root: Path = raced["root"]
    client = raced["client"]
    ledger = Ledger(TASK, root / "home")
    setup_events = lambda: [e for e in ledger.events() if e["kind"] in (EVENT_HOLDOUT_SLOT, EVENT_NULL_ARM)]
    before = setup_events()
    started = client.start_round(LONG)
    try:
        named = _refusal(started.run_id, f"round {started.key}", "LocalClient.start_round")

        other = _client(root)
        began, cpu = time.monotonic(), time.process_time()
        with pytest.raises(BusyError) as busy:
            other.setup(progress=False)
        took, cpu_s = time.monotonic() - began, time.process_time() - cpu
        assert str(busy.value).startswith(named) and str(busy.value).endswith(_follow(started.run_id)), str(busy.value)
        assert busy.value.run_id == started.run_id and cpu_s < REFUSAL_CPU_S and took < REFUSAL_WALL_S, (took, cpu_s)

        cli = subprocess.run([ENVLOOP, "round", "start", *CLI_ARGS], env=_env(root), capture_output=True, text=True,
                             timeout=600)
        lines = (cli.stdout + cli.stderr).strip().splitlines()
        assert cli.returncode == 2 and len(lines) == 1, cli.stdout + cli.stderr
        assert lines[0].startswith(f"Error: {named}") and lines[0].endswith(_follow(started.run_id)), lines

        result = _launch_setup_job(other)
        _assert_refused_run(other, result, started.run_id, f"round {started.key}", "LocalClient.start_round")
        assert setup_events() == before  # no holdout slot, no null arm
        assert not [e for e in ledger.events() if result.dagster_run.run_id in json.dumps(e)]
    finally:
        info = client.cancel(started.run_id, timeout_s=1800)
    assert info.status in ("CANCELED", "FAILURE"), info
    assert client._workers[started.run_id].wait(timeout=120) != 0
