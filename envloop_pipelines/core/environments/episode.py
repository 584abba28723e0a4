"""The Episode: the live environment of one attempt.

:func:`open_episode` turns an :class:`~.spec.EnvironmentSpec` into an
:class:`Episode`. A terminal episode (:mod:`.terminal_episode`, with its threat model) owns a fresh working
directory seeded with the starting files; every ``run(command)`` is one bash process in the sandbox
with the spec's limits, in that directory. A decision episode (:mod:`.decision_episode`) takes one
``submit(answer)``. ``verify()`` gives the verifier's :class:`~.base.Score`; ``final_state()`` what is stored
with the transcript (:mod:`.final_state`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

from envloop_pipelines.core.environments.base import Score
from envloop_pipelines.core.environments.decision_episode import DecisionEpisode
from envloop_pipelines.core.environments.spec import EnvironmentSpec
from envloop_pipelines.core.environments.terminal_episode import TerminalEpisode
from envloop_pipelines.core.sandbox import Sandbox, SandboxResult


@runtime_checkable
class Episode(Protocol):
    """The live environment of one attempt.

    Attributes:
        environment_id: the spec's id.
        instruction: the task in words.
        tools: ``("bash",)`` for terminal environments; ``()`` for decision ones (answer only).
        question: decision environments: ``state_text``, ``instructions_text``, ``option_keys``,
            ``option_texts``, ``type``; None for terminal ones.
    """

    environment_id: str
    instruction: str
    tools: tuple[str, ...]
    question: Mapping[str, Any] | None

    def run(self, command: str) -> SandboxResult:
        """One bash tool call inside this attempt's sandbox working directory, with the spec's limits."""
        ...

    def submit(self, answer: Any) -> None:
        """The answer: a decision's option key or ``{option: prob}``; a terminal episode's optional final text."""
        ...

    def verify(self) -> Score:
        """The verifier's verdict on the final state or answer (computed once, then the same Score)."""
        ...

    def final_state(self) -> Mapping[str, Any]:
        """The files (bounded) or the answer, to store with the transcript."""
        ...

    def close(self) -> None:
        """Remove the working directory; no process of the attempt survives."""
        ...


def open_episode(spec: EnvironmentSpec, *, sandbox: Sandbox | None = None, work_root: Path | None = None,
                 hidden_paths: Sequence[str | Path] = (), home: str | Path | None = None) -> Episode:
    """The live environment of one attempt at ``spec``.

    Args:
        spec: the environment (from a dataset: :func:`envloop_pipelines.core.environments.dataset.open_dataset`).
        sandbox: where commands and the verifier run (default: the local sandbox).
        work_root: where a terminal episode's working directory is made.
        hidden_paths: more host paths the agent's commands must not read.
        home: the EnvLoop home (its ``environments`` folder is masked from commands).
    """
    if spec.kind == "terminal":
        return TerminalEpisode(spec, sandbox=sandbox, work_root=work_root, hidden_paths=hidden_paths, home=home)
    return DecisionEpisode(spec)


__all__ = ["Episode", "open_episode"]
