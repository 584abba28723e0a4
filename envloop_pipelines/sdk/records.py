"""What both clients answer with: runs, their steps and errors, rounds and releases, as frozen values.

The remote :class:`~envloop_pipelines.sdk.client.Client` builds them from the webserver's and MLflow's answers,
the :class:`~envloop_pipelines.sdk.local.LocalClient` from the local instance and home; the CLI prints them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from envloop_pipelines.core.decision_loop.step_records import RoundDecision
from envloop_pipelines.names import PARTITION_TAG

#: Run statuses that are final.
FINISHED = ("SUCCESS", "FAILURE", "CANCELED")
#: Run statuses of a run that has not ended (queued, starting, running, being cancelled).
UNFINISHED = ("QUEUED", "NOT_STARTED", "STARTING", "STARTED", "CANCELING")


@dataclass(frozen=True)
class RunError:
    """Why a run failed: the failed step (``None`` for a run that failed outside a step), its own error message
    (the exception the step raised, not Dagster's wrapper) and the exception's class."""

    step: str | None
    message: str
    error_class: str | None = None

    def __str__(self) -> str:
        return f"{self.step}: {self.message}" if self.step else self.message


@dataclass(frozen=True)
class StepInfo:
    """One step of a run: its key (an asset or a check), status and times (epoch seconds)."""

    key: str
    status: str
    start_time: float | None
    end_time: float | None


@dataclass(frozen=True)
class RunInfo:
    """A Dagster run as the webserver reports it."""

    run_id: str
    job: str
    status: str
    partition: str | None
    start_time: float | None
    end_time: float | None
    created: float | None
    tags: Mapping[str, str]
    steps: tuple[StepInfo, ...]
    #: The steps this run executes when it runs a subset of its job (a retry from the failed step); else None.
    step_keys: tuple[str, ...] | None = None

    @property
    def finished(self) -> bool:
        return self.status in FINISHED

    @property
    def success(self) -> bool:
        return self.status == "SUCCESS"

    @property
    def first_step_start(self) -> float | None:
        """When the first step of the run started (epoch seconds), if one has."""
        starts = [s.start_time for s in self.steps if s.start_time]
        return min(starts) if starts else None

    @classmethod
    def from_graphql(cls, raw: Mapping[str, Any]) -> RunInfo:
        tags = {t["key"]: t["value"] for t in raw.get("tags") or []}
        steps = tuple(StepInfo(s["stepKey"], s["status"], s.get("startTime"), s.get("endTime"))
                      for s in raw.get("stepStats") or [])
        return cls(run_id=raw["runId"], job=raw.get("jobName") or "", status=raw["status"],
                   partition=tags.get(PARTITION_TAG), start_time=raw.get("startTime"), end_time=raw.get("endTime"),
                   created=raw.get("creationTime"), tags=tags, steps=steps,
                   step_keys=tuple(raw["stepKeysToExecute"]) if raw.get("stepKeysToExecute") else None)


@dataclass(frozen=True)
class RoundRun:
    """A round the client launched: its key (the ``rounds`` partition) and its Dagster run."""

    key: str
    run_id: str
    launched_at: float


@dataclass(frozen=True)
class RoundInfo:
    """A round: its key, its latest run (if any) and its decision (once decided)."""

    key: str
    run: RunInfo | None
    decision: RoundDecision | None

    @property
    def status(self) -> str:
        """``decided``, or the latest run's status (``STARTED``, ``FAILURE`` ...), or ``not started``."""
        if self.decision is not None:
            return "decided"
        return self.run.status if self.run is not None else "not started"


@dataclass(frozen=True)
class ReleaseInfo:
    """A release: the registered model version in MLflow, its holdout metrics, and its card."""

    release: int
    model_version: str
    round: str | None
    checkpoint_sha256: str | None
    mlflow_run_id: str | None
    holdout: Mapping[str, float]
    champion: bool
    card: Mapping[str, Any] | None = field(default=None, compare=False)


__all__ = ["FINISHED", "UNFINISHED", "ReleaseInfo", "RoundInfo", "RoundRun", "RunError", "RunInfo", "StepInfo"]
