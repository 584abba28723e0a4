"""A terminal environment's attempt: a working directory, a bash tool, and the verifier after the agent.

:class:`TerminalEpisode` owns a fresh working directory seeded with the starting files; every
``run(command)`` is one bash process in the sandbox with the spec's limits, in that directory; ``verify()``
strips planted rewards (:mod:`.final_state`) and runs the spec's verifier: the terminal-state check, or a
Harbor task's tests in the verifier's own world (:mod:`.harbor_verifier`).

Threat model (the hostile agent of issue 17), on top of the sandbox's own
(:mod:`envloop_pipelines.core.sandbox.local`):

* **Hidden tests and expected states** are never in the working directory: the
  verifier side of a spec lives in the dataset's owner-only ``verifier/``
  folder, and every agent command runs with ``<home>/environments`` (and any
  ``hidden_paths`` given) masked, as a fresh uid that could not open those
  owner-only files anyway.
* **Hidden tests are copied in only for verification**, after the last agent
  process is gone, into a fresh folder beside the final state, and run as a
  fresh sandbox process.
* **A planted reward is ignored**: every ``reward.txt`` / ``reward.json`` in the
  working directory is deleted before verification; the terminal check's
  verdict comes only from the sandbox's result channel, and hidden tests write
  their reward into a ``logs/verifier`` folder made fresh for that one run.
  (``/logs`` outside the working directory is not writable by a sandboxed uid.)
* **Limits per command**: CPU, address space, processes (a fork bomb hits
  RLIMIT_NPROC), file size (a disk filler hits RLIMIT_FSIZE), wall time; the
  network namespace has no usable interface. Every process of the command's
  uid is killed when it returns, so no background job outlives a ``run``, and
  the next command runs as another uid.
* **Other attempts**: each episode has its own directory (0700, owned by the
  running uid) and each command its own uid and its own ``/tmp``, ``/var/tmp``,
  ``/dev/shm`` and ``/run/lock``, so one attempt cannot read or signal another's
  processes or files. The source checkout and the EnvLoop home are concealed
  from commands (only the interpreter's files come back).
* **The verifier's phase is its own world** (a Harbor task's tests, issue 35): the final state is data at the
  task's working directory, never code the verifier's tools pick up by convention. The tests run with a fresh,
  empty ``HOME`` (``/tmp/home``, in its private ``/tmp``: no dotfile of the agent's is sourced), ``TMPDIR=/tmp``,
  the project's ``PATH`` and ``PYTHONSAFEPATH=1`` (``python3 -m pytest`` from ``/app`` does not import a
  ``pytest/`` the agent left there). The tests are at ``/tests`` and the logs at ``/logs`` in that phase
  only, as Harbor has them (no path in the test files is rewritten; test output names ``/tests/...``).
* **The episode's host path cannot be named**: its folder is a tmpfs of its own (:data:`EPISODE_DISK_MB`), the
  agent's commands see their working directory at ``/app`` only, in their own PID namespace with their own
  ``/proc``, and neither ``ps`` nor ``/proc/self/mountinfo`` shows the folder's host path or another attempt.
  In the verifier's phase the folder is not at its host path either.
* **A link resolves as in the agent's world** (:func:`~.harbor_verifier.sever_links`): a link of the final
  state that would reach what only the verifier has (``/tests``, ``/logs``, ``/proc``, the temp dirs, the
  episode folder) points nowhere when the tests run, as it did for the agent; links inside the working
  directory stay.
* **Teardown** removes the episode folder through folder descriptors, without
  recursion (:func:`~envloop_pipelines.core.sandbox.tree.remove_tree`): no tree an
  agent can make (deep, wide, mode 000, immutable) keeps it on the host; an episode on its own tmpfs is
  unmounted at once.

Not covered: the tests of an imported Harbor task run the agent's code with
the same uid that writes the reward file (as in Harbor itself), so a task
whose tests execute the agent's programs (``bash /app/run.sh``, ``import solution``)
can be gamed by those programs; ``envloop env audit`` tries the known ways and
names the tasks they pass. The working directory of the tests is the task's
(Harbor runs ``test.sh`` there), so a tool that reads its configuration from
the working directory by its own convention (``npm test`` and ``package.json``,
``make``) reads the agent's. A link severed because it reaches ``/proc`` (a link to
``/proc/cpuinfo``) is severed even where it would read the same. Without a mount
namespace (another backend, no root) the tests see the episode's host paths
instead of ``/tests`` and ``/logs`` (mapped in every file of the tests). A process
killed before an episode's ``close`` leaves its tmpfs mounted on the host (``umount`` it; memory holds only
what was written).
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Any, Mapping, Sequence

from envloop_pipelines.core.environments.base import Score
from envloop_pipelines.core.environments.episode_base import EpisodeBase
from envloop_pipelines.core.environments.final_state import snapshot_files, strip_rewards
from envloop_pipelines.core.environments.harbor_verifier import (
    LOGS_PATH,
    TESTS_PATH,
    VERIFIER_HOME,
    map_paths,
    offline_reason,
    read_reward,
    sever_links,
    verifier_breakage,
)
from envloop_pipelines.core.environments.spec import EnvironmentSpec
from envloop_pipelines.core.sandbox import (
    LocalSandbox,
    Sandbox,
    SandboxCall,
    SandboxResult,
    make_sandbox,
    probe_host,
    setup_error,
)
from envloop_pipelines.core.sandbox.mounts import PRIVATE_TMP_DIRS, mount_scratch, unmount_scratch
from envloop_pipelines.core.sandbox.tree import remove_tree
from envloop_pipelines.core.storage import envloop_home
from envloop_pipelines.core.verify.terminal import TerminalStateCheck

#: One bash command: 64 KiB of script is far more than a tool call needs.
MAX_COMMAND_BYTES = 64 * 1024
_BASH = ("/bin/bash", "--noprofile", "--norc", "-c")
#: An episode's folder (the working directory, then the verifier's copy of the tests and its logs) is a tmpfs of
#: this size where the host allows it: the attempt's disk use is bounded in total, and a bind of its working
#: directory shows ``/work`` in ``/proc/self/mountinfo``, never the folder's host path. A tmpfs takes memory
#: only for what is written.
EPISODE_DISK_MB = 256

log = logging.getLogger(__name__)


class TerminalEpisode(EpisodeBase):
    """A terminal environment's attempt: a working directory and a bash tool (see the module's threat model).

    Args:
        spec: a terminal spec.
        sandbox: where commands and the verifier run (default: the local sandbox).
        work_root: where the working directory is made (default: the system temp dir).
        hidden_paths: more paths masked from the agent's commands (``<home>/environments`` always is).
        home: the EnvLoop home whose ``environments`` folder is masked.
    """

    def __init__(self, spec: EnvironmentSpec, *, sandbox: Sandbox | None = None, work_root: str | Path | None = None,
                 hidden_paths: Sequence[str | Path] = (), home: str | Path | None = None) -> None:
        if spec.kind != "terminal":
            raise ValueError(f"{spec.id}: a TerminalEpisode needs a terminal spec, got kind {spec.kind!r}")
        super().__init__(spec)
        self.sandbox = sandbox or make_sandbox("local")
        self.hidden_paths = [envloop_home(home) / "environments", *(Path(p) for p in hidden_paths)]
        # The local sandbox also conceals the checkout and the home, and shows a Harbor task's working
        # directory where its instruction says (/app); other backends run in their own image (and ignore both).
        self._local = isinstance(self.sandbox, LocalSandbox)
        self._conceal = [envloop_home(home), *([_checkout()] if _checkout() else [])]
        self.task_workdir = (str(spec.verifier.params.get("workdir") or "/app").rstrip("/") or "/app"
                             if spec.verifier.kind == "tests" else None)
        self._at_task_workdir = bool(self.task_workdir and self._local and probe_host().mount_namespace)
        self._root = Path(tempfile.mkdtemp(prefix="envloop-episode-", dir=work_root))
        self._scratch = self._local and probe_host().mount_namespace and mount_scratch(self._root, EPISODE_DISK_MB)
        self.workdir = self._root / "work"
        self.workdir.mkdir(mode=0o700)
        for rel, text in spec.files.items():
            path = self.workdir / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
        self.commands = 0
        self._state: dict[str, Any] | None = None

    def run(self, command: str) -> SandboxResult:
        """Run ``command`` with bash in the working directory; a bad command is an ``error`` result, never a raise."""
        self._check_open()
        limits = self.spec.limits
        if self._score is not None:
            return setup_error(self.sandbox.backend, "the episode was verified; no more commands", limits)
        if not isinstance(command, str) or not command.strip():
            return setup_error(self.sandbox.backend, "a command is a non-empty bash script (a string)", limits)
        try:
            # surrogateescape: a lone surrogate U+DCXY (how a file name that is not UTF-8 is stored) is the byte 0xXY.
            size = len(command.encode("utf-8", "surrogateescape"))
        except UnicodeEncodeError as exc:
            return setup_error(self.sandbox.backend, f"the command is not text: {exc.reason} at character {exc.start} "
                                                     f"({command[exc.start]!a})", limits)
        if "\0" in command:
            return setup_error(self.sandbox.backend, "the command holds a NUL character (bash cannot take it)", limits)
        if size > MAX_COMMAND_BYTES:
            return setup_error(self.sandbox.backend, f"the command is over {MAX_COMMAND_BYTES} bytes", limits)
        self.commands += 1
        shown = {self.task_workdir: self.workdir} if self._at_task_workdir else {}
        return self.sandbox.run([*_BASH, command], SandboxCall(
            limits=limits, workdir=self.workdir, hidden_paths=self.hidden_paths, conceal=self._conceal, binds=shown,
            cwd=self.task_workdir if shown else None))

    def verify(self) -> Score:
        """Strip planted rewards, then run the spec's verifier in a fresh sandbox process (once)."""
        self._check_open()
        if self._score is None:
            planted = strip_rewards(self.workdir)
            self._state = snapshot_files(self.workdir)
            if self.spec.verifier.kind == "terminal":
                score = self._verify_terminal()
            else:
                score = self._verify_tests()
            self._score = Score(score.value, score.passed, score.status, score.verifier,
                                {**score.details, "planted_rewards_removed": planted, "commands": self.commands},
                                sandbox=score.sandbox)
        return self._score

    def _verify_terminal(self) -> Score:
        check = TerminalStateCheck(limits=self.spec.verifier.limits)
        verdict = check.run(self.sandbox, self.workdir, self.spec.verifier.params)
        details = {"check": verdict.to_dict()}
        if verdict.status == "error":
            return Score(0.0, False, "error", "terminal", {**details, "error": verdict.error}, sandbox=verdict.sandbox)
        return Score(1.0 if verdict.passed else 0.0, verdict.passed, "scored", "terminal", details, sandbox=verdict.sandbox)

    def _verify_tests(self) -> Score:
        """Harbor's contract in the verifier's own world: the final state at the task's working directory, the tests
        at ``/tests``, a fresh ``/logs/verifier``, the verifier's own HOME, TMPDIR and PATH, Python in safe-path mode;
        then ``test.sh`` and the reward it wrote."""
        verify_root = self._root / "verify"
        verify_root.mkdir(mode=0o700)
        app = verify_root / "app"
        os.rename(self.workdir, app)  # the agent is gone (every run swept its uid); same filesystem: O(1)
        self.workdir = app
        logs = verify_root / "logs" / "verifier"
        logs.mkdir(parents=True)
        workdir_name = self.task_workdir or "/app"
        own_world = self._at_task_workdir
        # Where the sandbox cannot show the verifier's world at Harbor's paths (another backend, no mount
        # namespace), every file of the tests gets /tests, /logs and the working directory mapped to local folders.
        mapping = {} if own_world else {TESTS_PATH: verify_root / "tests", LOGS_PATH: verify_root / "logs",
                                        workdir_name: app}
        for rel, text in self.spec.verifier.files.items():
            path = verify_root / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(map_paths(text, mapping), encoding="utf-8")
        severed = sever_links(app, workdir_name, [TESTS_PATH, LOGS_PATH, "/proc", *PRIVATE_TMP_DIRS, str(self._root)])
        env: dict[str, str] = {}
        if self._local:  # the verifier's own HOME and TMPDIR are folders of this host; a container has its own
            home = VERIFIER_HOME if own_world else str(verify_root / "home")
            tmp = "/tmp" if own_world else str(verify_root / "tmp")
            # PYTHONSAFEPATH: `python3 -m pytest` from the working directory does not put it on sys.path (a
            # pytest/ package the agent left there is data, not the verifier's pytest).
            env = {"HOME": home, "TMPDIR": tmp, "PYTHONSAFEPATH": "1"}
        world = ({workdir_name: app, TESTS_PATH: verify_root / "tests", LOGS_PATH: verify_root / "logs"}
                 if own_world else {})
        start = workdir_name if own_world else str(app)
        test_sh = f"{TESTS_PATH}/test.sh" if own_world else str(verify_root / "tests" / "test.sh")
        prepare = 'mkdir -p -m 700 "$HOME" "$TMPDIR" && ' if self._local else ""
        script = f"{prepare}cd {_quote(start)} && exec /bin/bash {_quote(test_sh)}"
        ran = self.sandbox.run([*_BASH, script], SandboxCall(
            limits=self.spec.verifier.limits, workdir=verify_root, hidden_paths=self.hidden_paths, env=env,
            conceal=self._conceal, binds=world, cwd=workdir_name if own_world else None))
        details: dict[str, Any] = {"tests": {"status": ran.status, "exit_code": ran.exit_code, "detail": ran.detail,
                                             "stdout_tail": ran.stdout_tail[-2000:], "stderr_tail": ran.stderr_tail[-2000:]}}
        if severed:
            details["links_severed"] = severed
        try:
            reward = read_reward(logs)
        except ValueError as exc:
            offline = self.spec.verifier.params.get("needs_network")
            why = offline_reason(offline) if offline else f"{exc} ({ran.status}: {ran.detail})"
            return Score(0.0, False, "error", "tests", {**details, "error": why}, sandbox=ran)
        details["reward"] = reward
        value = max(0.0, min(1.0, reward))
        broke = verifier_breakage(ran.stdout_tail + "\n" + ran.stderr_tail) if reward < 1.0 else None
        if reward < 1.0 and self.spec.verifier.params.get("needs_network"):
            broke = offline_reason(self.spec.verifier.params["needs_network"])
        if broke:
            return Score(0.0, False, "error", "tests", {**details, "error": broke}, sandbox=ran)
        return Score(value, reward >= 1.0, "scored", "tests", details, sandbox=ran)

    def final_state(self) -> Mapping[str, Any]:
        """The working directory's files (bounded), and the final text the agent submitted."""
        state = self._state if self._state is not None else (snapshot_files(self.workdir) if not self._closed else {"files": {}})
        return {**state, "answer": self.answer}

    def close(self) -> None:
        """Remove the episode's folder, whatever the agent left in it (each command's processes were killed when
        it returned); a removal that fails is logged, and the episode is closed all the same."""
        if not self._closed:
            self._closed = True
            try:
                if self._state is None and self.workdir.exists():
                    self._state = snapshot_files(self.workdir)
            except Exception:  # the snapshot never keeps the folder on the host
                log.exception("the final state of %s could not be read", self.environment_id)
                self._state = {"files": {}, "truncated": True}
            try:
                if self._scratch:
                    unmount_scratch(self._root)  # the tmpfs and everything on it, at once
                    self._root.rmdir()
                else:
                    remove_tree(self._root)
            except OSError:
                log.exception("could not remove the episode folder %s", self._root)


def _checkout() -> Path | None:
    """The source checkout this package runs from (a folder with ``pyproject.toml``), or None when installed."""
    import envloop_pipelines

    root = Path(envloop_pipelines.__file__).resolve().parent.parent
    return root if (root / "pyproject.toml").is_file() else None


def _quote(path: Path | str) -> str:
    import shlex

    return shlex.quote(str(path))


__all__ = ["EPISODE_DISK_MB", "MAX_COMMAND_BYTES", "TerminalEpisode"]
