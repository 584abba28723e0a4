"""The loop's claim, its setup's or a round's (``core/loop/round_claim.py``), judged against a Dagster instance: a
claim whose run has finished there is stale (a hold's, when its process is gone). Every door takes it through
here; the core never sees the instance."""

from __future__ import annotations

import dagster as dg

from envloop_pipelines.core.loop.config import LoopConfig
from envloop_pipelines.core.loop.round_claim import (
    SETUP,
    RoundBusy,
    RoundClaim,
    RunFinished,
    claim_round,
    live_claim,
    release_hold,
    release_round,
    watch_or_cancel,
)

__all__ = ["SETUP", "RoundBusy", "RoundClaim", "claim_round_on", "live_claim_on", "release_hold_of", "release_round_of",
           "run_finished_on", "watch_or_cancel"]


def run_finished_on(instance: dg.DagsterInstance) -> RunFinished:
    """Whether a run has finished on ``instance`` (``None``: no such run there)."""

    def finished(run_id: str) -> bool | None:
        run = instance.get_run_by_id(run_id)
        return None if run is None else run.is_finished

    return finished


def claim_round_on(instance: dg.DagsterInstance, cfg: LoopConfig, round_key: str, *, run_id: str, door: str,
                   pid: int | None, holder: str | None = None) -> RoundClaim:
    """Claim ``cfg.task``'s loop for ``run_id``, a round or the setup (``round_key`` :data:`SETUP`)
    (:func:`~envloop_pipelines.core.loop.round_claim.claim_round`; ``holder``: the hold it belongs to).

    Raises:
        RoundBusy: a live claim of another run holds it (the message names its round, run and door).
    """
    return claim_round(cfg.task, cfg.home, round_key, run_id=run_id, door=door, pid=pid, holder=holder,
                       run_finished=run_finished_on(instance))


def live_claim_on(instance: dg.DagsterInstance, cfg: LoopConfig) -> RoundClaim | None:
    """The task's live claim (``None`` when a round may start)."""
    return live_claim(cfg.task, cfg.home, run_finished_on(instance))


def release_round_of(cfg: LoopConfig, run_id: str) -> bool:
    """Give the task's claim back once ``run_id``'s run has ended (only when that run holds it)."""
    return release_round(cfg.task, cfg.home, run_id)


def release_hold_of(cfg: LoopConfig, holder: str) -> bool:
    """Give the task's claim back once the hold ``holder`` is done (only when that hold has it)."""
    return release_hold(cfg.task, cfg.home, holder)
