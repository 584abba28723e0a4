"""The Episode: the live environment of one attempt.

:func:`open_episode` turns an :class:`~.spec.EnvironmentSpec` into an
:class:`Episode`. A terminal episode owns a fresh working directory seeded with
the starting files; every ``run(command)`` is one bash process in the sandbox
with the spec's limits, in that directory. A decision episode takes one
``submit(answer)``. ``verify()`` gives the verifier's :class:`~.base.Score`.

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
  running uid) and each command its own uid, so one attempt cannot read or
  signal another's processes or files.

Not covered: the tests of an imported Harbor task run the agent's code with
the same uid that writes the reward file (as in Harbor itself), so a task
whose tests execute the agent's programs can be gamed by those programs;
absolute paths in ``tests/test.sh`` other than ``/tests``, ``/logs`` and the
task's working directory are not mapped; the disk is bounded per file, not in
total (see the sandbox's threat model).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

from envloop_pipelines.core.environments.base import Score
from envloop_pipelines.core.environments.spec import EnvironmentSpec
from envloop_pipelines.core.sandbox import Sandbox, SandboxResult, make_sandbox, setup_error
from envloop_pipelines.core.storage import envloop_home, sha256_bytes
from envloop_pipelines.core.verify.terminal import TerminalStateCheck

#: Files an agent might plant to claim a reward; removed before any verification.
REWARD_FILES: frozenset[str] = frozenset({"reward.txt", "reward.json"})
#: One bash command: 64 KiB of script is far more than a tool call needs.
MAX_COMMAND_BYTES = 64 * 1024
#: final_state keeps at most this many files, bytes per file and bytes in all (stored with the transcript).
FINAL_STATE_FILES = 200
FINAL_STATE_FILE_BYTES = 16 * 1024
FINAL_STATE_TOTAL_BYTES = 512 * 1024
_BASH = ("/bin/bash", "--noprofile", "--norc", "-c")


class EpisodeClosedError(RuntimeError):
    """A closed episode was used."""


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


def _strip_rewards(root: Path) -> list[str]:
    """Delete every planted reward file under ``root`` (never following links); returns their paths."""
    removed = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in [*filenames, *dirnames]:
            if name in REWARD_FILES:
                path = Path(dirpath) / name
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)
                removed.append(str(path.relative_to(root)))
    return sorted(removed)


def snapshot_files(root: Path) -> dict[str, Any]:
    """The bounded final state of a working directory: text files inline, the rest by size and hash."""
    files: dict[str, Any] = {}
    total = 0
    truncated = False
    for dirpath, dirnames, filenames in sorted(os.walk(root, followlinks=False)):
        dirnames.sort()
        for name in sorted(filenames):
            path = Path(dirpath) / name
            rel = str(path.relative_to(root))
            if len(files) >= FINAL_STATE_FILES:
                truncated = True
                break
            st = path.lstat()
            if stat.S_ISLNK(st.st_mode):
                files[rel] = {"symlink": os.readlink(path)}
                continue
            if not stat.S_ISREG(st.st_mode):
                files[rel] = {"special": True}
                continue
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            with os.fdopen(fd, "rb") as fh:
                head = fh.read(FINAL_STATE_FILE_BYTES + 1)
            entry: dict[str, Any] = {"bytes": st.st_size}
            try:
                text = head[:FINAL_STATE_FILE_BYTES].decode("utf-8")
                if total + len(text) <= FINAL_STATE_TOTAL_BYTES:
                    entry["text"] = text
                    entry["truncated"] = st.st_size > FINAL_STATE_FILE_BYTES
                    total += len(text)
                else:
                    truncated = True
            except UnicodeDecodeError:
                entry["sha256_head"] = sha256_bytes(head[:FINAL_STATE_FILE_BYTES])
            files[rel] = entry
    return {"files": files, "truncated": truncated}


class _BaseEpisode:
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

    def __enter__(self) -> "_BaseEpisode":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()  # type: ignore[attr-defined]


class TerminalEpisode(_BaseEpisode):
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
        self._root = Path(tempfile.mkdtemp(prefix="envloop-episode-", dir=work_root))
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
        if len(command.encode("utf-8")) > MAX_COMMAND_BYTES:
            return setup_error(self.sandbox.backend, f"the command is over {MAX_COMMAND_BYTES} bytes", limits)
        self.commands += 1
        return self.sandbox.run([*_BASH, command], limits=limits, workdir=self.workdir, hidden_paths=self.hidden_paths)

    def verify(self) -> Score:
        """Strip planted rewards, then run the spec's verifier in a fresh sandbox process (once)."""
        self._check_open()
        if self._score is None:
            planted = _strip_rewards(self.workdir)
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
        """Harbor's contract in our sandbox: tests/ beside the final state, a fresh logs/verifier, test.sh, the reward."""
        verify_root = self._root / "verify"
        verify_root.mkdir(mode=0o700)
        app = verify_root / "app"
        os.rename(self.workdir, app)  # the agent is gone (every run swept its uid); same filesystem: O(1)
        self.workdir = app
        logs = verify_root / "logs" / "verifier"
        logs.mkdir(parents=True)
        workdir_name = str(self.spec.verifier.params.get("workdir", "/app")).rstrip("/") or "/app"
        for rel, text in self.spec.verifier.files.items():
            path = verify_root / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            if rel.endswith(".sh"):
                text = map_paths(text, {"/tests": verify_root / "tests", "/logs": verify_root / "logs",
                                        workdir_name: app})
            path.write_text(text, encoding="utf-8")
        script = f"cd {_quote(app)} && exec /bin/bash {_quote(verify_root / 'tests' / 'test.sh')}"
        ran = self.sandbox.run([*_BASH, script], limits=self.spec.verifier.limits, workdir=verify_root,
                               hidden_paths=self.hidden_paths)
        details: dict[str, Any] = {"tests": {"status": ran.status, "exit_code": ran.exit_code, "detail": ran.detail,
                                             "stdout_tail": ran.stdout_tail[-2000:], "stderr_tail": ran.stderr_tail[-2000:]}}
        try:
            reward = read_reward(logs)
        except ValueError as exc:
            return Score(0.0, False, "error", "tests", {**details, "error": str(exc)}, sandbox=ran)
        details["reward"] = reward
        value = max(0.0, min(1.0, reward))
        return Score(value, reward >= 1.0, "scored", "tests", details, sandbox=ran)

    def final_state(self) -> Mapping[str, Any]:
        """The working directory's files (bounded), and the final text the agent submitted."""
        state = self._state if self._state is not None else (snapshot_files(self.workdir) if not self._closed else {"files": {}})
        return {**state, "answer": self.answer}

    def close(self) -> None:
        """Remove the working directory (each command's processes were killed when it returned)."""
        if not self._closed:
            if self._state is None and self.workdir.exists():
                self._state = snapshot_files(self.workdir)
            shutil.rmtree(self._root, ignore_errors=True)
            self._closed = True


def _quote(path: Path | str) -> str:
    import shlex

    return shlex.quote(str(path))


def map_paths(script: str, mapping: Mapping[str, Path]) -> str:
    """Replace the absolute paths a Harbor script names (``/tests``, ``/logs``, its workdir) by local ones.

    A path is replaced where it stands alone or starts a longer path (``/tests/x``), not inside another
    path (``/opt/tests``) or a word.
    """
    for prefix in sorted(mapping, key=len, reverse=True):
        pattern = re.compile(r"(?<![\w./-])" + re.escape(prefix) + r"(?=/|[\s\"'`;:)|&<>]|$)", re.MULTILINE)
        script = pattern.sub(lambda _m, p=str(mapping[prefix]): p, script)
    return script


def read_reward(logs: Path) -> float:
    """The reward the tests wrote: ``reward.json`` (its ``reward`` key, or its only number) wins over ``reward.txt``.

    Raises:
        ValueError: no reward file, or one that is not a regular file, too large or not a number.
    """
    for name in ("reward.json", "reward.txt"):
        path = logs / name
        if not os.path.lexists(path):
            continue
        st = path.lstat()
        if not stat.S_ISREG(st.st_mode) or st.st_size > 4096:
            raise ValueError(f"{path}: not a regular file of at most 4096 bytes")
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as fh:
            text = fh.read().decode("utf-8", errors="replace").strip()
        try:
            if name == "reward.txt":
                return float(text)
            raw = json.loads(text)
            numbers = {k: v for k, v in raw.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
            if "reward" in numbers:
                return float(numbers["reward"])
            if len(numbers) == 1:
                return float(next(iter(numbers.values())))
            raise ValueError(f"no 'reward' key among {sorted(numbers)}")
        except (ValueError, AttributeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: not a reward: {exc}") from None
    raise ValueError(f"the tests wrote no reward file in {logs}")


class DecisionEpisode(_BaseEpisode):
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


__all__ = ["DecisionEpisode", "Episode", "EpisodeClosedError", "REWARD_FILES", "TerminalEpisode", "map_paths",
           "open_episode", "read_reward", "snapshot_files"]
