"""What every episode shares: its spec, the submitted answer, the verdict once computed, open or closed."""

from __future__ import annotations

from typing import Any, Mapping

from envloop_pipelines.core.environments.base import Score
from envloop_pipelines.core.environments.spec import EnvironmentSpec


class EpisodeClosedError(RuntimeError):
    """A closed episode was used."""


class EpisodeBase:
    """The state every episode keeps: its spec and agent view, the submitted answer, the verdict once computed,
    whether it is closed (a closed episode raises :class:`EpisodeClosedError`); a context manager that closes it."""

    def __init__(self, spec: EnvironmentSpec) -> None:
        self.spec = spec
        self.environment_id = spec.id
        self.instruction = spec.instruction
        self.tools = spec.tools
        self.question: Mapping[str, Any] | None = None if spec.question is None else dict(spec.question)
        self.answer: Any = None
        self._score: Score | None = None
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise EpisodeClosedError(f"episode of {self.environment_id} is closed")

    def submit(self, answer: Any) -> None:
        self._check_open()
        self.answer = answer

    def __enter__(self) -> "EpisodeBase":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()  # type: ignore[attr-defined]


__all__ = ["EpisodeBase", "EpisodeClosedError"]
