"""Executable, replayable environments: ``reset(seed) -> Task``, ``verify(task, answer) -> Score``.

Two families prove the protocol: decision tasks over a snapshot's questions
(:mod:`.decision`, scored by the rule verifier) and shell / file-system tasks
(:mod:`.shell`, scored by a terminal-state check in the sandbox).

An environment as a value is an :class:`~.spec.EnvironmentSpec` (agent side and verifier side), an attempt
at one is an :mod:`.episode`; specs are stored as versioned datasets (:mod:`.dataset`), built by the
generators of :mod:`.generators` and exported to and imported from Harbor task folders (:mod:`.harbor_export`,
:mod:`.harbor_import`).
"""

from envloop_pipelines.core.environments.base import Environment, Score, Task

__all__ = ["Environment", "Score", "Task"]
