"""The round claim (``core/loop/round_claim.py``) judged against a Dagster instance: a claim whose run has
finished there is stale. Every door takes it through here; the core never sees the instance."""

from __future__ import annotations

import dagster as dg

from envloop_pipelines.core.loop.config import LoopConfig
from envloop_pipelines.core.loop.round_claim import (
    RoundBusy,
    RoundClaim,
    RunFinished,
    claim_round,
    live_claim,
    release_round,
)

__all__ = ["RoundBusy", "RoundClaim", "claim_round_on", "live_claim_on", "release_round_of", "run_finished_on"]


def run_finished_on(instance: dg.DagsterInstance) -> RunFinished:
    """Whether a run has finished on ``instance`` (``None``: no such run there)."""

    def finished(run_id: str) -> bool | None:
        run = instance.get_run_by_id(run_id)
        return None if run is None else run.is_finished

    return finished


def claim_round_on(instance: dg.DagsterInstance, cfg: LoopConfig, round_key: str, *, run_id: str, door: str,
                   pid: int | None) -> RoundClaim:
    """Claim ``cfg.task``'s round for ``run_id`` (:func:`~envloop_pipelines.core.loop.round_claim.claim_round`).

    Raises:
        RoundBusy: a live claim of another run holds it (the message names its round, run and door).
    """
    return claim_round(cfg.task, cfg.home, round_key, run_id=run_id, door=door, pid=pid,
                       run_finished=run_finished_on(instance))


def live_claim_on(instance: dg.DagsterInstance, cfg: LoopConfig) -> RoundClaim | None:
    """The task's live claim (``None`` when a round may start)."""
    return live_claim(cfg.task, cfg.home, run_finished_on(instance))


def release_round_of(cfg: LoopConfig, run_id: str) -> bool:
    """Give the task's claim back once ``run_id``'s run has ended (only when that run holds it)."""
    return release_round(cfg.task, cfg.home, run_id)
