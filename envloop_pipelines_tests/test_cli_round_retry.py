"""`envloop round retry` when there is nothing to retry, and orphaned-run reaping on a real instance."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest

from envloop_pipelines.defs.rounds.recovery import HOST_TAG, PID_TAG, reap_orphaned_runs, worker_tags

ENVLOOP = str(Path(sys.executable).with_name("envloop"))


def test_retry_with_no_round_says_so(tmp_path: Path) -> None:
    env = {**os.environ, "ENVLOOP_HOME": str(tmp_path / "home"), "DAGSTER_HOME": str(tmp_path / "dagster")}
    out = subprocess.run([ENVLOOP, "round", "retry"], env=env, capture_output=True, text=True, check=False, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "no undecided round to retry" in out.stdout


@pytest.fixture
def instance(tmp_path: Path):
    with dg.instance_for_test(temp_dir=str(tmp_path)) as inst:
        yield inst


def _created_run(instance: dg.DagsterInstance, tags: dict[str, str]) -> dg.DagsterRun:
    """A run of a one-op job, created with ``tags`` and never started (NOT_STARTED)."""
    @dg.op
    def noop() -> None: ...

    @dg.job
    def some_job() -> None:
        noop()

    return instance.create_run_for_job(some_job, tags=tags)


def _started_run(instance: dg.DagsterInstance, tags: dict[str, str]) -> dg.DagsterRun:
    run = _created_run(instance, tags)
    instance.handle_run_event(run.run_id, dg.DagsterEvent(
        event_type_value=dg.DagsterEventType.RUN_START.value, job_name=run.job_name, message="started"))
    return instance.get_run_by_id(run.run_id)


def test_reaps_only_runs_whose_worker_is_gone(instance: dg.DagsterInstance) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    orphan = _started_run(instance, {**worker_tags(), PID_TAG: str(dead.pid)})
    mine = _started_run(instance, worker_tags())  # this process: alive
    elsewhere = _started_run(instance, {HOST_TAG: "another-host", PID_TAG: str(dead.pid)})  # cannot be checked here
    assert {r.status for r in (orphan, mine, elsewhere)} == {dg.DagsterRunStatus.STARTED}
    reaped = reap_orphaned_runs(instance)
    assert [r.run_id for r in reaped] == [orphan.run_id]
    assert instance.get_run_by_id(orphan.run_id).status == dg.DagsterRunStatus.FAILURE
    assert instance.get_run_by_id(mine.run_id).status == dg.DagsterRunStatus.STARTED
    assert instance.get_run_by_id(elsewhere.run_id).status == dg.DagsterRunStatus.STARTED
    assert reap_orphaned_runs(instance) == []  # idempotent


def test_a_local_retry_that_fails_again_exits_1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``envloop round retry`` (local) whose round fails again says so and exits 1, as ``--remote`` does (it
    exited 0 before). The round's failed run is one of a task that was never set up, so its retry fails at once."""
    import json
    import shutil

    from envloop_pipelines.core.loop.config import LoopConfig
    from envloop_pipelines.core.ledger.store import RoundStore
    from envloop_pipelines.names import PARTITION_TAG, ROUND_JOB, SETTINGS_TAG
    from envloop_pipelines.sdk.instance import INSTANCE_FILE

    home, dagster_home = tmp_path / "home", tmp_path / "dagster"
    dagster_home.mkdir()
    shutil.copy(INSTANCE_FILE, dagster_home / "dagster.yaml")
    monkeypatch.setenv("DAGSTER_HOME", str(dagster_home))
    RoundStore("personal_agent", home).round_dir("r0001")  # the round was started: its folder exists
    settings = LoopConfig(task="personal_agent", home=str(home)).to_settings()

    @dg.op
    def noop() -> None: ...

    @dg.job(name=ROUND_JOB)
    def round_job() -> None:
        noop()

    with dg.DagsterInstance.get() as instance:
        run = instance.create_run_for_job(round_job, tags={PARTITION_TAG: "r0001", SETTINGS_TAG: json.dumps(settings)})
        instance.report_run_failed(run)
    env = {**os.environ, "ENVLOOP_HOME": str(home), "DAGSTER_HOME": str(dagster_home)}
    out = subprocess.run([ENVLOOP, "round", "retry"], env=env, capture_output=True, text=True, check=False, timeout=600)
    assert "retrying round r0001" in out.stdout, out.stdout + out.stderr
    assert "round r0001 failed" in out.stdout + out.stderr
    assert out.returncode == 1, out.stdout + out.stderr


def test_a_created_run_whose_worker_died_before_it_started_is_reaped_and_ends_a_wait(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An in-process run is created (NOT_STARTED) with its worker's tags before it starts: a worker killed in
    between left a run nobody reaped, and ``LocalClient.wait`` on it looped forever (a CI run hung on it)."""
    import threading

    from envloop_pipelines.sdk.local import LocalClient

    monkeypatch.setenv("ENVLOOP_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster"))
    client = LocalClient(task="personal_agent")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    created = _created_run(client.instance, {**worker_tags(), PID_TAG: str(dead.pid)})
    assert client.instance.get_run_by_id(created.run_id).status == dg.DagsterRunStatus.NOT_STARTED
    ended: list = []
    waiter = threading.Thread(target=lambda: ended.append(client.wait(created.run_id, progress=False, poll_s=0.2,
                                                                      timeout_s=30)), daemon=True)
    waiter.start()
    waiter.join(timeout=60)
    assert ended and ended[0].status == "FAILURE"
    assert reap_orphaned_runs(client.instance) == []  # reaped once, by the wait
