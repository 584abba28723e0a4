"""Automation: the next round after each decision, and failed rounds into the ledger."""


import dagster as dg

from envloop_pipelines.core.loop.budget import next_round
from envloop_pipelines.core.ledger.event_log import EVENT_ROUND_FAILED
from envloop_pipelines.core.ledger.ledger import Ledger
from envloop_pipelines.core.tracking import RUN_KILLED, close_round_runs
from envloop_pipelines.defs.rounds.assets import REFUSED_TAG, promotion_decision, round_job
from envloop_pipelines.defs.rounds.partitions import rounds
from envloop_pipelines.names import LOOP_TAG, PARTITION_TAG
from envloop_pipelines.resources.loop import LoopResource, MlflowResource
from envloop_pipelines.resources.round_claim import live_claim_on


@dg.asset_sensor(asset_key=promotion_decision.key, job=round_job, minimum_interval_seconds=30,
                 default_status=dg.DefaultSensorStatus.RUNNING)
def next_round_sensor(context: dg.SensorEvaluationContext, asset_event: dg.EventLogEntry,
                      loop: LoopResource) -> dg.SensorResult | dg.SkipReason:
    """After a round is decided, add the next partition and request its run while the loop's budget lasts (not while
    another round of the task runs: the tick is skipped naming it)."""
    cfg = loop.config()
    claim = live_claim_on(context.instance, cfg)
    if claim is not None:
        return dg.SkipReason(f"{claim.describe()}: the next round waits for it")
    nxt = next_round(cfg.task, home=cfg.home)
    if nxt.round is None:
        return dg.SkipReason(nxt.reason)
    return dg.SensorResult(
        run_requests=[dg.RunRequest(partition_key=nxt.round, run_key=nxt.run_key, tags={LOOP_TAG: nxt.run_key})],
        dynamic_partitions_requests=[rounds.build_add_request([nxt.round])],
    )


@dg.run_failure_sensor(monitored_jobs=[round_job], default_status=dg.DefaultSensorStatus.RUNNING)
def failed_round_sensor(context: dg.RunFailureSensorContext, loop: LoopResource) -> None:
    """Record a failed round in the ledger (with the Dagster run and its error); a refused hypothesis writes nothing."""
    cfg = loop.config()
    run = context.dagster_run
    if run.tags.get(REFUSED_TAG):
        return
    Ledger(cfg.task, cfg.home).append(
        EVENT_ROUND_FAILED,
        {"round": run.tags.get(PARTITION_TAG), "dagster_run_id": run.run_id,
         "error": context.failure_event.message if context.failure_event else None},
        key=f"failed:{run.run_id}",
    )


@dg.run_status_sensor(run_status=dg.DagsterRunStatus.CANCELED, monitored_jobs=[round_job],
                      default_status=dg.DefaultSensorStatus.RUNNING)
def canceled_round_sensor(context: dg.RunStatusSensorContext, loop: LoopResource, mlflow: MlflowResource) -> None:
    """A cancelled round: its MLflow runs still RUNNING (the parent, the interrupted step's) end KILLED."""
    key = context.dagster_run.tags.get(PARTITION_TAG)
    if key:
        cfg = loop.config()
        close_round_runs(mlflow.tracker(), cfg.task, key, RUN_KILLED)
