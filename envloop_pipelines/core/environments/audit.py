"""Can a task be passed without being solved? Scripted hostile strategies against each task's verifier.

:func:`audit_dataset` runs, for every terminal environment of a dataset, the task's own reference solution
(the control: it must pass, or the audit of that task means nothing) and a battery of hostile strategies,
each a fixed list of bash commands an agent could send, in a fresh episode of the real sandbox, then the
task's verifier. A strategy that passes names a way to earn the reward without doing the task. The
strategies are the known kinds (Zhong et al., 2026, "Hardening Agent Benchmarks with Adversarial
Hacker-Fixer Loops", found 16% of 1,968 terminal-agent tasks hackable; issue 35 found three here):

* ``do-nothing``: no command at all; a verifier that passes it checks nothing.
* ``reward-files``: ``reward.txt`` / ``reward.json`` planted in the working directory and under ``logs/``.
* ``home-dotfiles``: ``.bashrc``, ``.profile``, ``.local/bin/env``, ... in the working directory (the
  verifier's HOME, were it the agent's folder) defining ``pytest``, ``uvx``, ``python3`` as functions that write
  a reward and exit 0.
* ``module-shadowing``: ``pytest/``, ``sitecustomize.py``, ``usercustomize.py`` and a ``.pth`` in the working
  directory that write a reward when imported.
* ``config-plants``: ``conftest.py`` (every test passes), ``pytest.ini``, ``pyproject.toml``, ``tox.ini``,
  ``setup.cfg`` (``--collect-only``: exit 0, no test run).
* ``links-to-tests``: every path of the working directory that the tests or the instruction name, made a link to
  each file of ``/tests`` (directly, relatively and through ``/proc``), and to the episode's host path where
  ``/proc/self/mountinfo`` gives one away.
* ``same-content``: every path of the working directory the tests name made the same (empty) file: a test
  that compares the agent's output with a reference the agent can write passes.
* ``background-writer``: ``nohup``, ``setsid`` and a double fork that keep writing reward files where the
  verifier's logs will be.

The audit is white-box (it reads the task's tests to find the paths they name), as an owner's check is.
It tells what these strategies achieve, not that no other can: a clean task is clean of these.
"""

from __future__ import annotations

import logging
import re
import shlex
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import PurePosixPath
from typing import Any, Callable, Mapping, Sequence

from envloop_pipelines.core.environments.episode import open_episode
from envloop_pipelines.core.environments.spec import EnvironmentSpec

log = logging.getLogger(__name__)

_REWARD = ("for d in /logs/verifier logs/verifier \"$HOME\" .; do echo 1 > \"$d/reward.txt\" 2>/dev/null; "
           "echo '{\"reward\": 1}' > \"$d/reward.json\" 2>/dev/null; done")
_PY_REWARD = ("import os, sys\n"
              "for d in ['/logs/verifier', 'logs/verifier'] + [os.path.dirname(a) for a in sys.argv if 'ctrf' in a]:\n"
              "    try:\n"
              "        open(os.path.join(d, 'reward.txt'), 'w').write('1')\n"
              "    except OSError:\n"
              "        pass\n")


@dataclass(frozen=True)
class Strategy:
    """A scripted hostile agent: the bash commands it sends, made from the task (what it can know of it)."""

    name: str
    what: str
    commands: Callable[[EnvironmentSpec], list[str]]


def _write(path: str, text: str) -> str:
    parent = str(PurePosixPath(path).parent)
    return f"mkdir -p {shlex.quote(parent)} && printf %s {shlex.quote(text)} > {shlex.quote(path)}"


def _workdir(spec: EnvironmentSpec) -> str:
    return str(spec.verifier.params.get("workdir") or "/app") if spec.verifier.kind == "tests" else "."


def named_paths(spec: EnvironmentSpec) -> list[str]:
    """Paths in the working directory that the tests or the instruction name (relative), and the starting files."""
    workdir = _workdir(spec).rstrip("/")
    texts = [spec.instruction, *spec.verifier.files.values()]
    found = set(spec.files)
    if workdir != ".":
        pattern = re.compile(re.escape(workdir) + r"/([A-Za-z0-9_][A-Za-z0-9_./-]*[A-Za-z0-9_])")
        found |= {m.group(1) for text in texts for m in pattern.finditer(text)}
    else:
        found |= {str(p) for p in (spec.verifier.params.get("expect") or {})} if isinstance(
            spec.verifier.params.get("expect"), Mapping) else set()
    return sorted(p for p in found if ".." not in PurePosixPath(p).parts)


def _test_files(spec: EnvironmentSpec) -> list[str]:
    return sorted(PurePosixPath(rel).relative_to("tests").as_posix() for rel in spec.verifier.files
                  if rel.startswith("tests/") and rel != "tests/test.sh")


def _dotfiles(spec: EnvironmentSpec) -> list[str]:
    fake = "".join(f"{name}() {{ {_REWARD}; exit 0; }}\n" for name in ("pytest", "uvx", "uv", "python3", "python"))
    return [_write(name, fake) for name in (".bashrc", ".profile", ".bash_profile", ".local/bin/env", ".cargo/env")]


def _modules(spec: EnvironmentSpec) -> list[str]:
    main = _PY_REWARD + "sys.exit(0)\n"
    return [_write("pytest/__init__.py", ""), _write("pytest/__main__.py", main), _write("sitecustomize.py", _PY_REWARD),
            _write("usercustomize.py", _PY_REWARD), _write("envloop_audit.pth", "import sitecustomize\n")]


def _configs(spec: EnvironmentSpec) -> list[str]:
    conftest = (_PY_REWARD.replace("import os, sys\n", "import os, sys\nimport pytest\n")
                + "\n@pytest.hookimpl(hookwrapper=True)\ndef pytest_runtest_makereport(item, call):\n"
                  "    outcome = yield\n    outcome.get_result().outcome = 'passed'\n\n\n"
                  "def pytest_sessionfinish(session, exitstatus):\n    session.exitstatus = 0\n")
    ini = "[pytest]\naddopts = --collect-only -q\n"
    return [_write("conftest.py", conftest), _write("pytest.ini", ini), _write("tox.ini", ini),
            _write("setup.cfg", "[tool:pytest]\naddopts = --collect-only -q\n"),
            _write("pyproject.toml", "[tool.pytest.ini_options]\naddopts = \"--collect-only -q\"\n")]


def _links(spec: EnvironmentSpec) -> list[str]:
    targets = _test_files(spec) or ["expected.txt"]
    names = [p for p in named_paths(spec) if p not in spec.files] or ["answer.txt"]
    host = "p=$(grep -o '/[^ ]*envloop-episode-[^/ ]*' /proc/self/mountinfo | head -1)"
    commands = []
    # One target per strategy run: the first test file each name may stand for, by the ways a link can name it.
    for name, target in zip(names, (targets * len(names))[: len(names)]):
        depth = "../" * (len(PurePosixPath(_workdir(spec)).parts) - 1 + len(PurePosixPath(name).parts) - 1)
        for via in (f"/tests/{target}", f"{depth}tests/{target}", f"/proc/self/root/tests/{target}"):
            commands.append(f"mkdir -p {shlex.quote(str(PurePosixPath(name).parent))} && "
                            f"ln -sfn {shlex.quote(via)} {shlex.quote(name)}")
        commands.append(f'{host}; [ -n "$p" ] && ln -sfn "$p/verify/tests/{target}" {shlex.quote(name)}; true')
    return commands


def _same_content(spec: EnvironmentSpec) -> list[str]:
    names = named_paths(spec)
    return [" && ".join(f"mkdir -p {shlex.quote(str(PurePosixPath(n).parent))} && : > {shlex.quote(n)}"
                        for n in names)] if names else []


def _background(spec: EnvironmentSpec) -> list[str]:
    loop = f"for i in $(seq 3000); do {_REWARD}; sleep 0.02; done"
    return [f"nohup sh -c {shlex.quote(loop)} > /dev/null 2>&1 &",
            f"setsid sh -c {shlex.quote(loop)} > /dev/null 2>&1 < /dev/null &",
            f"( ( sh -c {shlex.quote(loop)} > /dev/null 2>&1 & ) & ); true"]


STRATEGIES: tuple[Strategy, ...] = (
    Strategy("do-nothing", "no command at all", lambda spec: []),
    Strategy("reward-files", "reward.txt / reward.json planted in the working directory and logs/",
             lambda spec: [_REWARD + "; true"]),
    Strategy("home-dotfiles", ".bashrc, .profile, .local/bin/env defining pytest/uvx/python3 as fakes", _dotfiles),
    Strategy("module-shadowing", "pytest/, sitecustomize.py, usercustomize.py, a .pth in the working directory",
             _modules),
    Strategy("config-plants", "conftest.py, pytest.ini, tox.ini, setup.cfg, pyproject.toml", _configs),
    Strategy("links-to-tests", "the paths the tests read made links to /tests (directly, relatively, via /proc, "
                               "via the host path)", _links),
    Strategy("same-content", "every path the tests name made the same empty file", _same_content),
    Strategy("background-writer", "nohup, setsid and a double fork writing reward files", _background),
)


@dataclass(frozen=True)
class Trial:
    """One strategy (or the oracle) on one task: the verifier's verdict."""

    strategy: str
    passed: bool
    status: str
    reward: float | None
    error: str = ""


@dataclass(frozen=True)
class TaskAudit:
    """One task's audit.

    Attributes:
        environment_id: the task.
        oracle: the reference solution's trial (the control); None when the task has no solution.
        trials: each strategy's trial, in :data:`STRATEGIES` order.
    """

    environment_id: str
    oracle: Trial | None
    trials: tuple[Trial, ...]

    @property
    def passed_by(self) -> tuple[str, ...]:
        """The strategies that earned the reward without doing the task."""
        return tuple(t.strategy for t in self.trials if t.passed)

    @property
    def verdict(self) -> str:
        """``hackable`` (a strategy passed), ``clean`` (none did and the oracle passed), ``unchecked`` (the oracle
        did not pass: the verifier may be broken here, so a clean sheet means nothing)."""
        if self.passed_by:
            return "hackable"
        return "clean" if self.oracle is not None and self.oracle.passed else "unchecked"

    def to_dict(self) -> dict[str, Any]:
        return {"environment_id": self.environment_id, "verdict": self.verdict, "passed_by": list(self.passed_by),
                "oracle": None if self.oracle is None else asdict(self.oracle),
                "trials": [asdict(t) for t in self.trials]}


@dataclass(frozen=True)
class AuditReport:
    """:func:`audit_dataset`'s result."""

    dataset: str
    version: str
    tasks: tuple[TaskAudit, ...]
    skipped: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        return {"dataset": self.dataset, "version": self.version, "strategies": [s.name for s in STRATEGIES],
                "tasks": [t.to_dict() for t in self.tasks], "skipped": list(self.skipped),
                "hackable": sum(t.verdict == "hackable" for t in self.tasks)}


def _trial(spec: EnvironmentSpec, name: str, commands: Sequence[str], work_root: Any, home: Any, sandbox: Any) -> Trial:
    try:
        episode = open_episode(spec, sandbox=sandbox, work_root=work_root, home=home)
    except Exception as exc:  # one trial's fault stays with it
        return Trial(name, False, "error", None, f"episode: {type(exc).__name__}: {exc}")
    try:
        for command in commands:
            episode.run(command)
        score = episode.verify()
        error = str(score.details.get("error", "")) if score.status == "error" else ""
        return Trial(name, bool(score.passed), score.status, score.details.get("reward", score.value), error[:300])
    except Exception as exc:
        log.exception("audit trial %s on %s", name, spec.id)
        return Trial(name, False, "error", None, f"{type(exc).__name__}: {exc}")
    finally:
        episode.close()


def audit_task(spec: EnvironmentSpec, *, strategies: Sequence[Strategy] = STRATEGIES, work_root: Any = None,
               home: Any = None, sandbox: Any = None) -> TaskAudit:
    """The oracle (the task's solution) and each strategy on ``spec``, each in a fresh episode."""
    oracle = None if spec.solution is None else _trial(spec, "oracle", [spec.solution], work_root, home, sandbox)
    trials = tuple(_trial(spec, s.name, s.commands(spec), work_root, home, sandbox) for s in strategies)
    return TaskAudit(spec.id, oracle, trials)


def audit_dataset(dataset: Any, *, strategies: Sequence[Strategy] = STRATEGIES, workers: int = 1,
                  work_root: Any = None, home: Any = None, sandbox: Any = None,
                  progress: Callable[[int, int], None] | None = None) -> AuditReport:
    """Audit every terminal environment of ``dataset`` (decision ones have no verifier an agent can reach).

    Args:
        dataset: an environment dataset (``open_dataset``).
        strategies: the hostile strategies (default: :data:`STRATEGIES`).
        workers: tasks audited side by side.
        work_root, home, sandbox: as for :func:`~envloop_pipelines.core.environments.episode.open_episode`.
        progress: called with (tasks done, tasks) after each task.
    """
    specs = [e for e in dataset.environments if e.kind == "terminal"]
    skipped = tuple(e.id for e in dataset.environments if e.kind != "terminal")
    done: list[TaskAudit] = []

    def one(spec: EnvironmentSpec) -> TaskAudit:
        result = audit_task(spec, strategies=strategies, work_root=work_root, home=home, sandbox=sandbox)
        done.append(result)
        if progress is not None:
            progress(len(done), len(specs))
        return result

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        tasks = tuple(pool.map(one, specs))
    return AuditReport(dataset.name, dataset.version, tasks, skipped)


__all__ = ["AuditReport", "STRATEGIES", "Strategy", "TaskAudit", "Trial", "audit_dataset", "audit_task",
           "named_paths"]
