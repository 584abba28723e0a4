"""A sensor tick replayed after a crash creates no second run: the real sensor daemon, a persistent instance.

``next_round_sensor`` is evaluated by Dagster's own daemon code (``execute_sensor_iteration``) against a SQLite
instance, the way ``dagster-daemon`` does it, with the code location loaded in-process. Runs are queued by a
``QueuedRunCoordinator`` and never dequeued (no run queue daemon, ``max_concurrent_runs: 0``), so they are created
but a round never executes.

The crash: the daemon created the run for r0002 and then died before the sensor's cursor was stored. Restoring the
sensor's instigator state to its pre-tick value replays that: the next tick reads the same materialization and asks
for r0002 again. Only the run key ``<loop id>:r0002`` stops a second run.

Checked that this test can fail: with ``run_key`` dropped from the sensor's ``RunRequest`` (a pytest plugin that
replaced ``dg.RunRequest`` in ``defs/rounds/sensors.py`` for the test process), tick 1 already fails on its
``run_keys``; with those two tick-1 asserts removed as well, the replayed tick 2 creates a second run for r0002 and
the test fails on the run count.

Dagster internals this relies on (may move on an upgrade): ``dagster._daemon.sensor.execute_sensor_iteration``,
``dagster._core.test_utils.create_test_daemon_workspace_context`` / ``freeze_time`` / ``instance_for_test``,
``dagster._core.workspace.load_target.InProcessWorkspaceLoadTarget``,
``dagster._core.remote_origin.InProcessCodeLocationOrigin``,
``dagster._core.types.loadable_target_origin.LoadableTargetOrigin``, ``InstigatorState`` / ``InstigatorTick``
fields (``instigator_data.cursor``, ``run_ids``, ``run_keys``, ``dynamic_partitions_request_results``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import pytest
from dagster._core.remote_origin import InProcessCodeLocationOrigin
from dagster._core.scheduler.instigation import (
    InstigatorState,
    InstigatorTick,
    InstigatorType,
    TickStatus,
)
from dagster._core.storage.tags import RUN_KEY_TAG
from dagster._core.test_utils import (
    create_test_daemon_workspace_context,
    freeze_time,
    instance_for_test,
)
from dagster._core.types.loadable_target_origin import LoadableTargetOrigin
from dagster._core.workspace.context import WorkspaceProcessContext
from dagster._core.workspace.load_target import InProcessWorkspaceLoadTarget
from dagster._daemon.sensor import execute_sensor_iteration

from envloop_pipelines.core.loop.budget import LoopBudget, next_round, start_loop
from envloop_pipelines.core.ledger.ledger import Ledger
from envloop_pipelines.core.ledger.store import RoundStore
from envloop_pipelines.definitions import defs as load_code_location
defs = load_code_location()

SENSOR = "next_round_sensor"
LOOP_ID = "replay-loop"
# The task the code location's LoopResource runs ($ENVLOOP_TASK when definitions.py was imported).
TASK: str = defs.resources["loop"].config().task
# Sensor ticks are spaced further apart than the sensor's minimum_interval_seconds (30), on a frozen clock.
STEP_S = 40.0
LOGGER = logging.getLogger("envloop.test_sensor_replay")


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The loop's home, read by ``LoopResource(home=None)`` through ``$ENVLOOP_HOME`` when the sensor runs."""
    path = tmp_path / "envloop"
    monkeypatch.setenv("ENVLOOP_HOME", str(path))
    return path


@pytest.fixture
def instance(tmp_path: Path) -> Iterator[dg.DagsterInstance]:
    """A persistent SQLite instance whose runs are queued and never launched."""
    overrides = {"run_coordinator": {"module": "dagster._core.run_coordinator", "class": "QueuedRunCoordinator",
                                     "config": {"max_concurrent_runs": 0}}}
    dagster_home = tmp_path / "dagster_home"
    dagster_home.mkdir()
    with instance_for_test(overrides=overrides, temp_dir=str(dagster_home)) as inst:
        yield inst


@pytest.fixture
def workspace(instance: dg.DagsterInstance) -> Iterator[WorkspaceProcessContext]:
    """The project's code location, loaded in-process (so ``$ENVLOOP_HOME`` and the frozen clock reach the sensor)."""
    origin = InProcessCodeLocationOrigin(
        LoadableTargetOrigin(module_name="envloop_pipelines.definitions", attribute="defs"),
        location_name="envloop_pipelines",
    )
    with create_test_daemon_workspace_context(InProcessWorkspaceLoadTarget(origin), instance) as context:
        yield context


def decide_round_one(home: Path) -> None:
    """A loop of three rounds whose first round r0001 was run and decided, as the real round code leaves it."""
    start_loop(TASK, LOOP_ID, LoopBudget(max_rounds=3, patience=3), home=home)
    # promotion_decision(...) leaves the round directory (it holds the round's step outputs) and appends this event.
    RoundStore(TASK, str(home)).round_dir("r0001")
    Ledger(TASK, home).append("round_decided", {"round": "r0001", "promoted": False, "observed_delta": 0.0,
                                                "release": None}, key="decided:r0001")
    assert next_round(TASK, home=home).run_key == f"{LOOP_ID}:r0002"


def report_decision(instance: dg.DagsterInstance, partition: str) -> int:
    """A ``promotion_decision`` materialization of ``partition``; returns its event storage id."""
    instance.report_runless_asset_event(dg.AssetMaterialization(asset_key="promotion_decision", partition=partition))
    record = instance.fetch_materializations(dg.AssetKey("promotion_decision"), limit=1).records[0]
    return record.storage_id


def sensor_state(instance: dg.DagsterInstance) -> InstigatorState:
    (state,) = [s for s in instance.all_instigator_state(instigator_type=InstigatorType.SENSOR)
                if s.instigator_name == SENSOR]
    return state


def tick(workspace: WorkspaceProcessContext, at: float) -> InstigatorTick:
    """One sensor daemon iteration at time ``at``; the sensor's tick it made."""
    with freeze_time(at):
        # No thread pools: the daemon evaluates every running sensor synchronously in this thread.
        list(execute_sensor_iteration(workspace, LOGGER, threadpool_executor=None, submit_threadpool_executor=None))
    instance = workspace.instance
    state = sensor_state(instance)
    latest = instance.get_ticks(state.instigator_origin_id, state.selector_id, limit=1)[0]
    assert latest.timestamp == pytest.approx(at), "the sensor did not tick (minimum interval?)"
    assert latest.error is None, latest.error
    return latest


def runs_for(instance: dg.DagsterInstance, partition: str) -> list[dg.DagsterRun]:
    return list(instance.get_runs(filters=dg.RunsFilter(tags={"dagster/partition": partition})))


def added_and_skipped(t: InstigatorTick) -> tuple[list[str], list[str]]:
    (result,) = t.tick_data.dynamic_partitions_request_results
    assert result.partitions_def_name == "rounds"
    return list(result.added_partitions or []), list(result.skipped_partitions or [])


def test_replayed_tick_creates_no_second_run(home: Path, instance: dg.DagsterInstance,
                                             workspace: WorkspaceProcessContext) -> None:
    decide_round_one(home)
    instance.add_dynamic_partitions("rounds", ["r0001"])
    t0 = time.time()

    # Tick 0, before any decision: nothing to do. It leaves the sensor's state as the daemon keeps it.
    first = tick(workspace, t0)
    assert first.status == TickStatus.SKIPPED and not first.run_ids
    assert "No new materialization events" in (first.skip_reason or "")
    before = sensor_state(instance)
    assert before.instigator_data.cursor is None

    storage_id = report_decision(instance, "r0001")

    # Tick 1: exactly one run for r0002, keyed by the loop, and the partition added.
    one = tick(workspace, t0 + STEP_S)
    assert one.status == TickStatus.SUCCESS
    (run,) = runs_for(instance, "r0002")
    assert one.run_ids == [run.run_id] and one.run_keys == [f"{LOOP_ID}:r0002"]
    assert run.tags[RUN_KEY_TAG] == f"{LOOP_ID}:r0002" and run.tags["dagster/sensor_name"] == SENSOR
    assert run.job_name == "round_job"
    assert run.status == dg.DagsterRunStatus.QUEUED  # created, never launched
    assert added_and_skipped(one) == (["r0002"], [])
    assert instance.get_dynamic_partitions("rounds") == ["r0001", "r0002"]
    assert sensor_state(instance).instigator_data.cursor == str(storage_id)

    # The crash: the run exists but the cursor never got stored. Put the sensor's state back as it was.
    instance.update_instigator_state(before)
    assert sensor_state(instance).instigator_data.cursor is None

    # Tick 2 re-reads the same materialization and asks for r0002 again; the run key stops a second run.
    two = tick(workspace, t0 + 2 * STEP_S)
    assert [r.run_id for r in runs_for(instance, "r0002")] == [run.run_id]
    assert len(instance.get_runs()) == 1
    assert two.status == TickStatus.SKIPPED
    assert two.run_ids == [] and two.run_keys == [f"{LOOP_ID}:r0002"]
    assert added_and_skipped(two) == ([], ["r0002"])
    assert instance.get_dynamic_partitions("rounds") == ["r0001", "r0002"]
    assert sensor_state(instance).instigator_data.cursor == str(storage_id)

    # A fresh decision event for r0001 (a re-materialization) after the run exists: still the one run.
    fresh_id = report_decision(instance, "r0001")
    assert fresh_id > storage_id
    three = tick(workspace, t0 + 3 * STEP_S)
    assert three.status == TickStatus.SKIPPED
    assert three.run_ids == [] and three.run_keys == [f"{LOOP_ID}:r0002"]
    assert [r.run_id for r in runs_for(instance, "r0002")] == [run.run_id]
    assert len(instance.get_runs()) == 1
    assert instance.get_dynamic_partitions("rounds") == ["r0001", "r0002"]
    assert sensor_state(instance).instigator_data.cursor == str(fresh_id)

    # And without a new event the sensor does not evaluate the loop at all.
    quiet = tick(workspace, t0 + 4 * STEP_S)
    assert quiet.status == TickStatus.SKIPPED and "No new materialization events" in (quiet.skip_reason or "")
    assert len(instance.get_runs()) == 1


def test_a_tick_inside_the_minimum_interval_is_not_evaluated(home: Path, instance: dg.DagsterInstance,
                                                             workspace: WorkspaceProcessContext) -> None:
    decide_round_one(home)
    instance.add_dynamic_partitions("rounds", ["r0001"])
    t0 = time.time()
    tick(workspace, t0)
    report_decision(instance, "r0001")
    # 10 s later is inside minimum_interval_seconds=30: the daemon does not evaluate the sensor, no run yet.
    with freeze_time(t0 + 10):
        list(execute_sensor_iteration(workspace, LOGGER, threadpool_executor=None, submit_threadpool_executor=None))
    state = sensor_state(instance)
    assert len(instance.get_ticks(state.instigator_origin_id, state.selector_id)) == 1
    assert not runs_for(instance, "r0002")
    # Past the interval it is evaluated and the run appears.
    assert len(tick(workspace, t0 + STEP_S).run_ids) == 1
    assert len(runs_for(instance, "r0002")) == 1


def test_a_tick_while_another_door_runs_a_round_is_skipped_naming_it(home: Path, instance: dg.DagsterInstance,
                                                                     workspace: WorkspaceProcessContext) -> None:
    """Issue 37: one round at a time from every door. A round started from the SDK (its claim taken, its run not on
    the instance yet) makes the sensor skip, naming it; once the round is over, the next decision starts the next."""
    import os

    from envloop_pipelines.core.loop.round_claim import claim_round, release_round

    decide_round_one(home)
    instance.add_dynamic_partitions("rounds", ["r0001"])
    t0 = time.time()
    tick(workspace, t0)
    claim_round(TASK, home, "r0002", run_id="run-of-the-sdk", door="LocalClient.start_round",
                run_finished=lambda run_id: None, pid=os.getpid())
    report_decision(instance, "r0001")
    busy = tick(workspace, t0 + STEP_S)
    assert busy.status == TickStatus.SKIPPED and not busy.run_ids
    assert (f"round r0002 of task {TASK!r} is running (run run-of-the-sdk, started by LocalClient.start_round, pid "
            f"{os.getpid()}") in (busy.skip_reason or ""), busy.skip_reason
    assert not runs_for(instance, "r0002") and instance.get_dynamic_partitions("rounds") == ["r0001"]

    assert release_round(TASK, home, "run-of-the-sdk")  # the round's run ended; its decision is the next event
    report_decision(instance, "r0001")
    assert len(tick(workspace, t0 + 2 * STEP_S).run_ids) == 1
    assert len(runs_for(instance, "r0002")) == 1


def test_the_nightly_schedule_starts_no_loop_beside_a_running_round(home: Path, instance: dg.DagsterInstance) -> None:
    import datetime
    import os

    from envloop_pipelines.core.loop.budget import load_loop
    from envloop_pipelines.core.loop.round_claim import claim_round
    from envloop_pipelines.defs.rounds.schedules import nightly_loop
    from envloop_pipelines.resources.loop import loop_resource

    decide_round_one(home)
    claim_round(TASK, home, "r0002", run_id="run-of-the-cli", door="envloop round start",
                run_finished=lambda run_id: None, pid=os.getpid())
    context = dg.build_schedule_context(instance=instance, resources={"loop": loop_resource({"task": TASK,
                                                                                             "home": str(home)})},
                                        scheduled_execution_time=datetime.datetime(2026, 1, 2, 2, 0))
    skipped = nightly_loop(context)
    assert isinstance(skipped, dg.SkipReason)
    assert f"round r0002 of task {TASK!r} is running (run run-of-the-cli, started by envloop round start" in str(
        skipped.skip_message)
    assert load_loop(TASK, home).loop_id == LOOP_ID  # the active loop is not replaced
    assert not instance.get_dynamic_partitions("rounds")
