"""The environment protocol: executable and replayable.

``reset(seed)`` gives a :class:`Task` (the same task for the same seed, on any
machine); ``verify(task, answer)`` sends the answer to the environment's
verifier and returns a :class:`Score`. A task carries only what the model may
see; what the verifier needs (labels, the expected state) is recomputed from
the seed or read on the verifier side, never shipped inside the task.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Protocol, runtime_checkable

from envloop_pipelines.core.sandbox.base import SandboxResult
from envloop_pipelines.core.storage import canonical_json, sha256_bytes

ScoreStatus = Literal["scored", "invalid", "error"]


@dataclass(frozen=True)
class Task:
    """One task instance.

    Attributes:
        env: the environment's name.
        seed: the seed ``reset`` was called with.
        task_id: a stable id (the same seed gives the same id).
        prompt: the instruction in words.
        inputs: what the model sees besides the prompt (a question and its options, the starting files).
    """

    env: str
    seed: int
    task_id: str
    prompt: str
    inputs: Mapping[str, Any] = field(default_factory=dict)

    def fingerprint(self) -> str:
        """sha256 of the task's canonical JSON: equal for equal tasks."""
        return sha256_bytes(canonical_json({"env": self.env, "seed": self.seed, "task_id": self.task_id,
                                            "prompt": self.prompt, "inputs": dict(self.inputs)}))


@dataclass(frozen=True)
class Score:
    """The verifier's verdict on one answer.

    Attributes:
        value: the score in [0, 1] (0 for an invalid answer or an error, with ``status`` saying so).
        passed: the answer is right (the option matches, the final state checks out).
        status: ``scored``; ``invalid`` (the answer could not be scored: malformed, for another task);
            ``error`` (the verifier could not decide: its sandbox failed; see ``details``).
        verifier: the verifier kind (``rule``, ``terminal``, ``grader``).
        details: per-check details, the verifier's report for this item.
        sandbox: the verifier's sandbox result, when it ran in one.
    """

    value: float
    passed: bool
    status: ScoreStatus
    verifier: str
    details: Mapping[str, Any] = field(default_factory=dict)
    sandbox: SandboxResult | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"value": self.value, "passed": self.passed, "status": self.status, "verifier": self.verifier,
                "details": dict(self.details), "sandbox": None if self.sandbox is None else self.sandbox.to_dict(include_channel=False)}


@runtime_checkable
class Environment(Protocol):
    """An executable, replayable environment."""

    name: str

    def reset(self, seed: int) -> Task:
        """The task for ``seed`` (deterministic)."""
        ...

    def verify(self, task: Task, answer: Any) -> Score:
        """Score ``answer`` to ``task`` with the environment's verifier; never raises for a bad answer."""
        ...


def check_seed(seed: int) -> int:
    """Seeds are non-negative integers (numpy's generators refuse the rest)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    return seed


__all__ = ["Environment", "Score", "ScoreStatus", "Task", "check_seed"]
