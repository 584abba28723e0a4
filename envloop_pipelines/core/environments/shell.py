"""A small shell / file-system task family with terminal-state checks.

It exists to prove the environment protocol is not decision-only: the answer
is a bash script, it runs in the sandbox in a temporary directory seeded by
``reset(seed)``, and a terminal-state check (another sandboxed process, see
:mod:`envloop_pipelines.core.verify.terminal`) decides from the files it left.

Families (picked by the seed, with names and contents drawn from it):

* ``create_file``: create a named file whose content is one given line.
* ``rename_ext``: rename every ``*.txt`` to ``*.md``, keeping contents; other files stay.
* ``count_lines``: write the number of lines of a file into ``out.txt``.

The task shows the prompt and the starting files; the expected final state is
recomputed from the seed at verify time and never leaves the verifier side.
"""

from __future__ import annotations

import random
import shlex
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from envloop_pipelines.core.environments.base import Score, Task, check_seed
from envloop_pipelines.core.sandbox import Sandbox, SandboxCall, SandboxLimits, make_sandbox
from envloop_pipelines.core.verify.terminal import TerminalStateCheck, expect_files_params

SHELL_FAMILIES: tuple[str, ...] = ("create_file", "rename_ext", "count_lines")
#: An answer is a script, not a payload: 64 KiB is far more than any of these tasks needs.
MAX_ANSWER_BYTES = 64 * 1024
DEFAULT_ANSWER_LIMITS = SandboxLimits(cpu_s=5.0, mem_mb=256, wall_s=10.0, fsize_mb=1, nofile=64, nproc=32)
_WORDS = (
    "amber", "basil", "cedar", "delta", "ember", "fjord", "grove", "harbor", "iris", "juniper", "kelp", "lumen",
    "maple", "nectar", "onyx", "pebble", "quartz", "raven", "sage", "tundra", "umber", "violet", "willow", "yarrow",
)


@dataclass(frozen=True)
class ShellSpec:
    """Everything a seed determines: what the model sees, what the check expects and a reference solution."""

    family: str
    prompt: str
    files: Mapping[str, str]
    check_params: Mapping[str, Any] = field(default_factory=dict)
    solution: str = ""  # a bash script that passes the check (the verifier side; Harbor's solution/solve.sh)


def _words(rng: random.Random, n: int) -> list[str]:
    return [rng.choice(_WORDS) for _ in range(n)]


def shell_spec(seed: int, families: Sequence[str] = SHELL_FAMILIES) -> ShellSpec:
    """The task for ``seed`` (``random.Random(seed)``: stable across Python versions for these calls)."""
    rng = random.Random(check_seed(seed))
    family = families[rng.randrange(len(families))]
    if family == "create_file":
        name = f"{rng.choice(_WORDS)}_{rng.randrange(100)}.txt"
        line = " ".join(_words(rng, 4))
        decoy = {"notes.txt": " ".join(_words(rng, 6)) + "\n"}
        return ShellSpec(
            family,
            f"Create a file named {name} in the current directory whose content is exactly the line: {line}",
            decoy,
            expect_files_params(stripped={name: line}, unchanged=decoy),
            f"printf '%s\\n' {shlex.quote(line)} > {shlex.quote(name)}\n",
        )
    if family == "rename_ext":
        stems = rng.sample(_WORDS, rng.randint(3, 5))
        texts = {f"{s}.txt": " ".join(_words(rng, 5)) + "\n" for s in stems}
        others = {"keep.log": " ".join(_words(rng, 3)) + "\n", "data.csv": "a,b\n1,2\n"}
        return ShellSpec(
            family,
            "Rename every file in the current directory whose name ends in .txt so that it ends in .md "
            "instead, keeping each file's content; leave all other files as they are.",
            {**texts, **others},
            expect_files_params(expect={n[:-4] + ".md": c for n, c in texts.items()}, absent=sorted(texts),
                                no_glob=["*.txt"], unchanged=others),
            'for f in *.txt; do mv -- "$f" "${f%.txt}.md"; done\n',
        )
    if family == "count_lines":
        name = f"{rng.choice(_WORDS)}.log"
        n_lines = rng.randint(5, 40)
        content = "".join(" ".join(_words(rng, rng.randint(1, 6))) + "\n" for _ in range(n_lines))
        return ShellSpec(
            family,
            f"Count the lines of the file {name} and write the number alone into a file named out.txt.",
            {name: content},
            expect_files_params(stripped={"out.txt": str(n_lines)}, unchanged={name: content}),
            f"wc -l < {shlex.quote(name)} | tr -d ' ' > out.txt\n",
        )
    raise ValueError(f"unknown shell family {family!r}; allowed: {', '.join(SHELL_FAMILIES)}")


class ShellEnvironment:
    """Shell tasks: ``reset(seed)`` gives the task, ``verify(task, script)`` runs and checks it.

    Args:
        sandbox: where answers and checks run (default: the local sandbox).
        answer_limits: limits of the answer script.
        check: the terminal-state check runner.
        families: the families to draw from.
        work_root: where the temporary task directories are made.
    """

    name = "shell"

    def __init__(
        self,
        sandbox: Sandbox | None = None,
        *,
        answer_limits: SandboxLimits = DEFAULT_ANSWER_LIMITS,
        check: TerminalStateCheck | None = None,
        families: Sequence[str] = SHELL_FAMILIES,
        work_root: str | Path | None = None,
    ) -> None:
        unknown = [f for f in families if f not in SHELL_FAMILIES]
        if not families or unknown:
            raise ValueError(f"families must be a non-empty subset of {', '.join(SHELL_FAMILIES)}, got {list(families)}")
        self.sandbox = sandbox or make_sandbox("local")
        self.answer_limits = answer_limits
        self.check = check or TerminalStateCheck()
        self.families = tuple(families)
        self.work_root = work_root

    def reset(self, seed: int) -> Task:
        spec = shell_spec(seed, self.families)
        return Task(env=self.name, seed=seed, task_id=f"shell/{spec.family}/{seed}", prompt=spec.prompt,
                    inputs={"family": spec.family, "files": dict(spec.files)})

    def verify(self, task: Task, answer: Any) -> Score:
        """Run the script ``answer`` in a fresh directory seeded from ``task.seed``, then check the state."""
        if task.env != self.name or task.fingerprint() != self.reset(task.seed).fingerprint():
            return Score(0.0, False, "invalid", "terminal", {"error": f"task {task.task_id} is not seed {task.seed} of {self.name}"})
        if not isinstance(answer, str) or not answer.strip():
            return Score(0.0, False, "invalid", "terminal", {"error": "an answer is a non-empty bash script (a string)"})
        if len(answer.encode("utf-8")) > MAX_ANSWER_BYTES:
            return Score(0.0, False, "invalid", "terminal", {"error": f"the script is over {MAX_ANSWER_BYTES} bytes"})
        spec = shell_spec(task.seed, self.families)
        workdir = Path(tempfile.mkdtemp(prefix="envloop-shell-", dir=self.work_root))
        try:
            ran = self.sandbox.run(["/bin/bash", "--noprofile", "--norc", "-c", answer], SandboxCall(
                limits=self.answer_limits, workdir=workdir, files={k: v.encode() for k, v in spec.files.items()}))
            # The check decides from the state alone; the answer's exit status is reported, not scored.
            verdict = self.check.run(self.sandbox, workdir, spec.check_params)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        details = {
            "family": spec.family,
            "answer": {"status": ran.status, "exit_code": ran.exit_code, "detail": ran.detail,
                       "stdout_tail": ran.stdout_tail[-1000:], "stderr_tail": ran.stderr_tail[-1000:]},
            "check": verdict.to_dict(),
        }
        if verdict.status == "error":
            return Score(0.0, False, "error", "terminal", {**details, "error": verdict.error}, sandbox=verdict.sandbox)
        # Binary: the share of sub-checks that held (in details) credits untouched decoy files too.
        return Score(1.0 if verdict.passed else 0.0, verdict.passed, "scored", "terminal", details, sandbox=verdict.sandbox)


__all__ = ["DEFAULT_ANSWER_LIMITS", "MAX_ANSWER_BYTES", "SHELL_FAMILIES", "ShellEnvironment", "ShellSpec", "shell_spec"]
