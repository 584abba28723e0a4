"""The typed values the steps of an RL round hand each other (as ``decision_loop/step_records.py`` is for the decision round).

Each step of :mod:`~envloop_pipelines.core.rl_loop.round_steps` takes the records of the steps it
depends on and returns its own frozen record; Dagster's ``RlStoreIOManager`` (``resources/rl.py``)
stores each at ``<home>/loops/<task>/rounds/<round>/<asset>.json`` and hands it downstream, and
:func:`~envloop_pipelines.core.rl_loop.run_round.run_rl_round` calls the same steps with the values
directly. Attempts, SFT snapshots and policy checkpoints stay content-addressed on disk, referenced
here by hash and path. Per-environment held-out results never enter a record (rule 4): only each
arm's pass@1 with its CI and the paired delta. Every record is a :class:`~envloop_pipelines.core.ledger.store.JsonRecord`,
which converts the records nested in it (the hypothesis, the floor, the comparison and its arms) both ways.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from envloop_pipelines.core.ledger.hypothesis import Hypothesis
from envloop_pipelines.core.loop.promotion import NoiseFloor
from envloop_pipelines.core.ledger.store import JsonRecord
from envloop_pipelines.core.rl_loop.sft_snapshot import SftSnapshot


@dataclass(frozen=True)
class RlHypothesis(JsonRecord):
    """``rl_hypothesis``: the hypothesis as registered, and the parent policy the round samples and compares with.

    ``parent``: ``model`` (the served name), ``checkpoint_sha256`` and ``path`` of the latest RL release's
    policy, both ``None`` for the base model (``base_model``).
    """

    hypothesis: Hypothesis
    hash: str
    parent: Mapping[str, Any]
    mlflow_run_id: str = ""

    @property
    def round(self) -> str:
        return self.hypothesis.round

    @property
    def sampler(self) -> Mapping[str, Any]:
        return self.hypothesis.change["sampler"]


@dataclass(frozen=True)
class RlSampling(JsonRecord):
    """``rl_sampled_attempts``: the training attempts, stored as ``attempts.jsonl`` (transcripts and verdicts)."""

    round: str
    attempts_path: str
    n_attempts: int
    n_passed: int
    seconds: float = 0.0


@dataclass(frozen=True, kw_only=True)
class RlSnapshot(SftSnapshot):
    """``rl_sft_snapshot``: the round's SFT snapshot (:class:`~.sft_snapshot.SftSnapshot`: the verified attempts as
    chat rows, their hash and contamination report), with the round it belongs to; stored flat, its fields beside
    ``round``."""

    round: str

    @property
    def empty(self) -> bool:
        """No verified attempt survived: nothing to train on (the round is decided as a rejection)."""
        return self.n_rows == 0


@dataclass(frozen=True)
class RlCandidate(JsonRecord):
    """``rl_policy_checkpoint``: the candidate policy, or ``skipped`` (why) when the snapshot is empty."""

    round: str
    checkpoint_sha256: str | None = None
    path: str | None = None
    model: str | None = None
    seed: int | None = None
    first_loss: float | None = None
    last_loss: float | None = None
    seconds: float = 0.0
    skipped: str | None = None


@dataclass(frozen=True)
class RlNoiseFloor(JsonRecord):
    """``rl_noise_floor``: the spread of the null arms' held-out pass@1 (``None`` when nothing was trained)."""

    round: str
    floor: NoiseFloor | None
    seconds: float = 0.0


@dataclass(frozen=True)
class ArmScore(JsonRecord):
    """One policy's held-out aggregate: pass@1 with its CI (never per environment)."""

    pass_at_1: float
    ci_low: float
    ci_high: float
    n_environments: int
    n_attempts: int


@dataclass(frozen=True)
class HoldoutComparison(JsonRecord):
    """Candidate against parent on the held-out environments: aggregates and the paired delta only."""

    candidate: ArmScore
    parent: ArmScore
    delta: Mapping[str, float]
    attempts_per_environment: int


@dataclass(frozen=True)
class RlReevaluation(JsonRecord):
    """``rl_heldout_reeval``: candidate and parent on the held-out environments (``None`` when nothing was trained)."""

    round: str
    comparison: HoldoutComparison | None
    seconds: float = 0.0


@dataclass(frozen=True)
class RlRoundResult(JsonRecord):
    """``rl_decision``: what the round decided, and what it made on the way (on promotion, ``release`` and its
    registered ``model_version``)."""

    round: str
    task: str
    dataset: str
    dataset_version: str
    hypothesis_hash: str
    sampler: Mapping[str, Any]
    snapshot: Mapping[str, Any]
    promoted: bool
    reasons: tuple[str, ...]
    candidate: Mapping[str, Any] | None = None
    comparison: Mapping[str, Any] | None = None
    noise_floor: Mapping[str, Any] | None = None
    checks: Mapping[str, Any] = field(default_factory=dict)
    release: int | None = None
    seconds: Mapping[str, float] = field(default_factory=dict)
    model_version: str | None = None


#: The record type of each RL step's value, by step (asset) name: what the RL IO manager loads.
RL_STEP_RECORDS: dict[str, type] = {
    "rl_hypothesis": RlHypothesis,
    "rl_sampled_attempts": RlSampling,
    "rl_sft_snapshot": RlSnapshot,
    "rl_policy_checkpoint": RlCandidate,
    "rl_noise_floor": RlNoiseFloor,
    "rl_heldout_reeval": RlReevaluation,
    "rl_decision": RlRoundResult,
}

__all__ = ["ArmScore", "HoldoutComparison", "RL_STEP_RECORDS", "RlCandidate", "RlHypothesis", "RlNoiseFloor",
           "RlReevaluation", "RlRoundResult", "RlSampling", "RlSnapshot"]
