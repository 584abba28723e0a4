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
* **A link resolves as in the agent's world** (:func:`sever_links`): a link of the final state that would
  reach what only the verifier has (``/tests``, ``/logs``, ``/proc``, the temp dirs, the episode folder)
  points nowhere when the tests run, as it did for the agent; links inside the working directory stay.
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

import base64
import json
import logging
import os
import re
import stat
import tempfile
from pathlib import Path, PurePosixPath
from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

from envloop_pipelines.core.environments.base import Score
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
from envloop_pipelines.core.sandbox.tree import remove_tree, walk
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
#: The snapshot stops listing after this many folders and files (a tree of millions is cut, not walked).
FINAL_STATE_MAX_ENTRIES = 20_000
_BASH = ("/bin/bash", "--noprofile", "--norc", "-c")
#: An episode's folder (the working directory, then the verifier's copy of the tests and its logs) is a tmpfs of
#: this size where the host allows it: the attempt's disk use is bounded in total, and a bind of its working
#: directory shows ``/work`` in ``/proc/self/mountinfo``, never the folder's host path. A tmpfs takes memory
#: only for what is written.
EPISODE_DISK_MB = 256
#: Where the tests of a Harbor task and its logs are, in the verifier's phase only (Harbor's paths).
TESTS_PATH, LOGS_PATH = "/tests", "/logs"
#: The verifier's own HOME, made empty in its private /tmp: nothing the agent wrote is a dotfile there.
VERIFIER_HOME = "/tmp/home"
#: What a link of the final state that would reach the verifier's own world points to instead (nowhere).
SEVERED_LINK = "/.envloop-severed-link"

log = logging.getLogger(__name__)


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
    """Delete every planted reward file under ``root`` (never following links, no recursion); returns their paths."""
    removed = []
    for dirpath, dirnames, filenames in walk(root):
        for name in [*filenames, *dirnames]:
            if name in REWARD_FILES:
                path = Path(dirpath) / name
                try:
                    remove_tree(path)
                except OSError:
                    log.warning("could not remove the planted %s", path)
                removed.append(os.path.relpath(path, root))
        dirnames[:] = [d for d in dirnames if d not in REWARD_FILES]
    return sorted(removed)


def _json_size(value: Any) -> int:
    """Bytes ``value`` takes in ``attempts.jsonl`` (escapes included: a NUL is six bytes there)."""
    return len(json.dumps(value, ensure_ascii=True, separators=(",", ":")))


def snapshot_files(root: Path) -> dict[str, Any]:
    """The bounded final state of a working directory (see ``docs/agents.md``, "What an attempt is").

    Files in walk order (sorted, top-down, never following links, no recursion), at most
    :data:`FINAL_STATE_FILES` of them and :data:`FINAL_STATE_TOTAL_BYTES` of JSON in all (names, escapes and
    all: the cap holds for what is stored). Each file: ``bytes`` (its size) and its first
    :data:`FINAL_STATE_FILE_BYTES` bytes as ``text`` (UTF-8 without NUL) or ``base64`` (anything else), with
    ``truncated`` when the file is longer; past the total, ``sha256_head`` alone. A name that is not UTF-8 is
    kept as Python's ``os.fsdecode`` gives it (each undecodable byte 0xXY as the lone surrogate U+DCXY,
    stored as the JSON escape ``\\udcXY``; ``os.fsencode`` gives the bytes back). Symlinks give their
    target, other special files ``special``.
    """
    files: dict[str, Any] = {}
    used = 0
    truncated = False
    visited = 0
    for dirpath, dirnames, filenames in walk(root):
        visited += 1 + len(filenames)
        if visited > FINAL_STATE_MAX_ENTRIES or len(files) >= FINAL_STATE_FILES:
            truncated = True
            break
        for name in filenames:
            if len(files) >= FINAL_STATE_FILES or used >= FINAL_STATE_TOTAL_BYTES:
                truncated = True
                break
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root)
            entry = _file_entry(path)
            sha = entry.pop("_sha", None)
            cost = _json_size({rel: entry})
            if used + cost > FINAL_STATE_TOTAL_BYTES:
                truncated = True
                if sha is None:
                    break
                entry = {"bytes": entry["bytes"], "truncated": entry["truncated"], "sha256_head": sha}
                cost = _json_size({rel: entry})
                if used + cost > FINAL_STATE_TOTAL_BYTES:
                    break
            files[rel] = entry
            used += cost
    return {"files": files, "truncated": truncated}


def _file_entry(path: str) -> dict[str, Any]:
    try:
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            return {"symlink": os.readlink(path)[:1024]}
        if not stat.S_ISREG(st.st_mode):
            return {"special": True}
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as fh:
            head = fh.read(FINAL_STATE_FILE_BYTES)
    except OSError as exc:
        return {"unreadable": exc.strerror or type(exc).__name__}
    entry: dict[str, Any] = {"bytes": st.st_size, "truncated": st.st_size > len(head),
                             "_sha": sha256_bytes(head)}
    text = None
    if b"\0" not in head:
        try:
            text = head.decode("utf-8")
        except UnicodeDecodeError as exc:
            # A multi-byte character cut at the cap is still text.
            if len(head) == FINAL_STATE_FILE_BYTES and exc.start >= len(head) - 3 and exc.reason == "unexpected end of data":
                text = head[: exc.start].decode("utf-8")
    if text is not None:
        entry["text"] = text
    else:
        entry["base64"] = base64.b64encode(head).decode("ascii")
    return entry


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


def _agent_world_trail(path: str, app: Path, workdir: str, max_links: int = 40) -> list[str]:
    """Every path that resolving ``path`` passes through in the agent's world, the last one where it ends.

    The agent's world is this host's filesystem with the final state at ``workdir`` (read from ``app``) and
    empty private temp dirs; links are followed as the kernel follows them (at most ``max_links``).
    """
    parts = list(PurePosixPath(path).parts[1:])
    cur, trail, hops = "/", [], 0
    while parts:
        part = parts.pop(0)
        if part in ("", "."):
            continue
        nxt = os.path.dirname(cur) if part == ".." else os.path.join(cur, part)
        host = (app / os.path.relpath(nxt, workdir)) if _is_below(nxt, workdir) else Path(nxt)
        trail.append(nxt)
        try:
            st = os.lstat(host)
            if any(_is_below(nxt, t) for t in PRIVATE_TMP_DIRS) and not _is_below(nxt, workdir):
                raise FileNotFoundError(nxt)  # empty for the agent: its temp dirs were its own commands' own
        except OSError:
            cur = nxt
            continue
        if stat.S_ISLNK(st.st_mode):
            hops += 1
            if hops > max_links:
                break
            target = os.readlink(host)
            parts = [*PurePosixPath(target).parts[1 if target.startswith("/") else 0:], *parts]
            cur = "/" if target.startswith("/") else cur
            continue
        cur = nxt
    return trail


def _is_below(path: str, top: str) -> bool:
    top = top.rstrip("/") or "/"
    return path == top or path.startswith(top + "/") or top == "/"


def sever_links(app: Path, workdir: str, verifier_only: Sequence[str]) -> list[dict[str, str]]:
    """Make every link of the final state resolve as in the agent's world before the verifier runs.

    A link whose resolution in the agent's world passes through one of ``verifier_only`` (``/tests``, ``/logs``,
    ``/proc``, the temp dirs, the episode's own folder: what is there for the verifier is not what the agent
    had) would name the verifier's files, so it is pointed at :data:`SEVERED_LINK`, where nothing is: reading
    it fails as it did for the agent. Links that stay inside the working directory, or reach the host's
    shared files, are kept as they are. Returns ``[{"path", "target", "reaches"}]`` of the severed links.
    """
    severed = []
    for dirpath, _dirs, files in walk(app):
        for name in files:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):
                continue
            rel = os.path.relpath(path, app)
            trail = _agent_world_trail(os.path.join(workdir, rel), app, workdir)
            reached = next((t for t in trail if any(_is_below(t, v) for v in verifier_only)), None)
            if reached is None:
                continue
            target = os.readlink(path)
            os.unlink(path)
            os.symlink(SEVERED_LINK, path)
            severed.append({"path": rel, "target": target, "reaches": reached})
    return severed


def _checkout() -> Path | None:
    """The source checkout this package runs from (a folder with ``pyproject.toml``), or None when installed."""
    import envloop_pipelines

    root = Path(envloop_pipelines.__file__).resolve().parent.parent
    return root if (root / "pyproject.toml").is_file() else None


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


#: What a test run prints when the tests themselves could not run (the verifier broke, not the agent's work).
_BREAKAGE = (
    (re.compile(r"(?m)^(?:pytest|[\w./-]*pytest[\w.-]*): error: (.*)$"), "pytest refused its command line: {0}"),
    (re.compile(r"(?m)^ERROR: usage: .*$"), "pytest refused its command line"),
    (re.compile(r"(?m)^ERROR: file or directory not found: (.*)$"), "the tests are not where test.sh looks: {0}"),
    (re.compile(r"(?m)^INTERNALERROR>.*$"), "pytest crashed (INTERNALERROR)"),
    (re.compile(r"(?m)^ImportError while importing test module '([^']*)'"),
     "the test module {0} could not be imported (a package the tests need is not installed here)"),
    (re.compile(r"(?m)^(?:.*: )?(pytest|py\.test|uvx|uv|pip3?|python3?|apt-get|curl): (?:command )?not found$"),
     "{0} is not installed here"),
    (re.compile(r"(?m)^=+ no tests ran in .*$"), "pytest found no tests"),
)


def verifier_breakage(output: str) -> str | None:
    """Why the tests could not run, from their output (pytest's usage errors, a missing program), or None.

    A reward of 0 with one of these is the verifier's error, not the agent's failure.
    """
    for pattern, message in _BREAKAGE:
        m = pattern.search(output)
        if m:
            return "the tests could not run: " + message.format(*(g.strip() for g in m.groups()))
    return None


def offline_reason(lines: Sequence[str]) -> str:
    """Why tests that need the network could not judge the attempt (``file:line: command`` of the first)."""
    more = f" (and {len(lines) - 1} more)" if len(lines) > 1 else ""
    return f"the tests could not run: they need the network, which environments here do not have: {lines[0]}{more}"


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


__all__ = ["DecisionEpisode", "EPISODE_DISK_MB", "Episode", "EpisodeClosedError", "REWARD_FILES", "TerminalEpisode",
           "map_paths", "open_episode", "read_reward", "sever_links", "snapshot_files", "verifier_breakage"]
