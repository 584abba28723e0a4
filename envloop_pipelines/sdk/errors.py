"""The SDK's errors, shared by both clients (:mod:`envloop_pipelines.sdk` exports them)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # for the annotations only: records.py does not import the errors
    from envloop_pipelines.sdk.records import RunError, RunInfo


class ClientError(RuntimeError):
    """A request the deployment refused, or an answer it could not give; the message says which and why."""


class PromotionOutOfReach(UserWarning):
    """The measured noise floor puts the bar above what the metric can still gain: no round can promote."""


class RefusedError(ClientError):
    """Bad input, refused before anything was launched or written (a hypothesis, a key, a kind): the message names the field."""


class BusyError(RefusedError):
    """Another run of the task's loop (its setup or a round) runs: a second start, from whichever door, is refused
    before anything of it runs or is written. The message, one line, names that run, its door and how to follow or
    cancel it; ``run_id`` is that run's id (``None`` when the refusal did not say)."""

    def __init__(self, message: str, run_id: str | None = None) -> None:
        super().__init__(message)
        self.run_id = run_id


class NotFoundError(ClientError):
    """No such round, run, release or step at the deployment."""


class UnavailableError(ClientError):
    """The Dagster webserver or the MLflow server did not answer (within ``timeout_s``)."""


class RoundFailed(ClientError):
    """A round's (or the setup's) run ended without a decision; ``reason`` is the failed step's own error."""

    def __init__(self, message: str, run: RunInfo, reason: RunError | None = None) -> None:
        super().__init__(message)
        self.run = run
        self.reason = reason


__all__ = ["BusyError", "ClientError", "NotFoundError", "PromotionOutOfReach", "RefusedError", "RoundFailed", "UnavailableError"]
