"""Executable, replayable environments: ``reset(seed) -> Task``, ``verify(task, answer) -> Score``.

Two families prove the protocol: decision tasks over a snapshot's questions
(:mod:`.decision`, scored by the rule verifier) and shell / file-system tasks
(:mod:`.shell`, scored by a terminal-state check in the sandbox).
"""

from envloop_pipelines.core.environments.base import Environment, Score, Task

__all__ = ["Environment", "Score", "Task"]
