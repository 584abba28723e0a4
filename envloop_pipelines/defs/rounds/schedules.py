"""The nightly loop."""


import dagster as dg

from envloop_pipelines.core.loop.budget import LoopBudget, next_round, start_loop
from envloop_pipelines.defs.rounds.assets import round_job
from envloop_pipelines.defs.rounds.partitions import rounds
from envloop_pipelines.names import LOOP_TAG
from envloop_pipelines.resources.loop import LoopResource
from envloop_pipelines.resources.round_claim import live_claim_on


@dg.schedule(cron_schedule="0 2 * * *", job=round_job, execution_timezone="UTC")
def nightly_loop(context: dg.ScheduleEvaluationContext, loop: LoopResource) -> dg.RunRequest | dg.SkipReason:
    """Each night, start a loop of rounds (two rounds, patience two, six hours); the sensor continues it. Skipped,
    naming it, while a round of the task runs (from any door)."""
    cfg = loop.config()
    claim = live_claim_on(context.instance, cfg)
    if claim is not None:
        return dg.SkipReason(f"{claim.describe()}: no nightly loop beside it")
    loop_id = f"nightly-{context.scheduled_execution_time:%Y%m%d}"
    start_loop(cfg.task, loop_id, LoopBudget(max_rounds=2, patience=2, max_wall_s=6 * 3600), home=cfg.home)
    nxt = next_round(cfg.task, home=cfg.home)
    if nxt.round is None:
        return dg.SkipReason(nxt.reason)
    context.instance.add_dynamic_partitions(rounds.name, [nxt.round])
    return dg.RunRequest(partition_key=nxt.round, run_key=nxt.run_key, tags={LOOP_TAG: nxt.run_key})
