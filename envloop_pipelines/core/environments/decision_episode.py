"""A decision environment's attempt: one question, one submitted answer, scored by the rule verifier."""

from __future__ import annotations

from typing import Any, Mapping

from envloop_pipelines.core.environments.base import Score
from envloop_pipelines.core.environments.episode_base import EpisodeBase
from envloop_pipelines.core.environments.spec import EnvironmentSpec
from envloop_pipelines.core.sandbox import SandboxResult, setup_error


class DecisionEpisode(EpisodeBase):
    """A decision environment's attempt: one question, one submitted answer, the rule verifier's score."""

    def __init__(self, spec: EnvironmentSpec) -> None:
        if spec.kind != "decision":
            raise ValueError(f"{spec.id}: a DecisionEpisode needs a decision spec, got kind {spec.kind!r}")
        super().__init__(spec)

    def run(self, command: str) -> SandboxResult:
        """Decision environments take no commands: an ``error`` result (the agent answers with ``submit``)."""
        self._check_open()
        return setup_error("none", "a decision environment has no tools; submit an answer instead", self.spec.limits)

    def verify(self) -> Score:
        """The rule verifier on the submitted answer against the label (an invalid Score without an answer)."""
        self._check_open()
        if self._score is None:
            self._score = _score_decision(self.spec, self.answer)
        return self._score

    def final_state(self) -> Mapping[str, Any]:
        return {"answer": self.answer}

    def close(self) -> None:
        self._closed = True


def _score_decision(spec: EnvironmentSpec, answer: Any) -> Score:
    import pyarrow as pa

    from envloop_pipelines.core.environments.base import Task
    from envloop_pipelines.core.environments.decision import answer_row
    from envloop_pipelines.core.verify.rule import RuleVerifier

    label = dict(spec.verifier.params["label"])
    task = Task(env=spec.id, seed=spec.seed, task_id=spec.id, prompt=spec.instruction,
                inputs={**dict(spec.question or {}), "record_id": label["record_id"], "question_id": label["question_id"]})
    if answer is None:
        return Score(0.0, False, "invalid", "rule", {"error": "no answer was submitted"})
    try:
        row = answer_row(task, answer)
    except (ValueError, TypeError) as exc:
        return Score(0.0, False, "invalid", "rule", {"error": str(exc)})
    report = RuleVerifier().score([row], pa.Table.from_pylist([label]))
    item = report.items[0]
    passed = (bool(item.correct) if item.correct is not None else item.score >= 0.5) and item.status == "scored"
    return Score(item.score, passed, "scored" if item.status == "scored" else "invalid", "rule", item.to_dict())


__all__ = ["DecisionEpisode"]
