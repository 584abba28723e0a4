"""Terminal-state checks: a script run in the sandbox against the state an answer produced.

The check is a Python program (stdlib only) that runs with the answer's
working directory as its cwd, reads its parameters (the expected state) as
JSON on stdin, inspects the files, and writes one JSON verdict to the result
channel (``$ENVLOOP_RESULT_FD``)::

    {"passed": true, "score": 1.0, "checks": [{"name": "...", "ok": true, "detail": "..."}]}

The verdict comes only from that channel: whatever the answer printed, and any
``reward.json`` it left in the directory, is ignored. The check runs in a
fresh sandboxed process after every process of the answer is gone, so nothing
of the answer runs while the state is inspected.

:data:`EXPECT_FILES` is the generic check most tasks need: expected files with
their contents, files that must be gone, globs that must match nothing.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

from envloop_pipelines.core.sandbox import Sandbox, SandboxCall, SandboxLimits, SandboxResult

CheckStatus = Literal["passed", "failed", "error"]
DEFAULT_CHECK_LIMITS = SandboxLimits(cpu_s=10.0, mem_mb=512, wall_s=20.0, fsize_mb=1, nofile=64, nproc=8)

#: Parameters: {"expect": [{"path", "content", "match": "exact"|"stripped"}], "absent": [path],
#: "no_glob": [pattern], "unchanged": [{"path", "content"}]}. Files are opened without following
#: symlinks and must be regular files of at most 1 MiB (a FIFO or a link to /etc is a failure).
EXPECT_FILES = r'''
import fnmatch, json, os, stat, sys

MAX = 1 << 20
params = json.load(sys.stdin)
checks = []

def read(path):
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise ValueError("not a regular file")
    if st.st_size > MAX:
        raise ValueError(f"{st.st_size} bytes, more than {MAX}")
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as fh:
        return fh.read(MAX + 1).decode("utf-8")

def inside(path):
    full = os.path.realpath(path)
    return full == os.getcwd() or full.startswith(os.getcwd() + os.sep)

for exp in params.get("expect", []) + [dict(e, match="exact") for e in params.get("unchanged", [])]:
    name, want, how = exp["path"], exp["content"], exp.get("match", "exact")
    try:
        if not inside(name):
            raise ValueError("outside the working directory")
        got = read(name)
        ok = got.strip() == want.strip() if how == "stripped" else got == want
        detail = "matches" if ok else f"content differs: {got[:80]!r}"
    except FileNotFoundError:
        ok, detail = False, "missing"
    except Exception as exc:
        ok, detail = False, f"{type(exc).__name__}: {exc}"
    checks.append({"name": f"content:{name}", "ok": ok, "detail": detail})
for name in params.get("absent", []):
    gone = not os.path.lexists(name)
    checks.append({"name": f"absent:{name}", "ok": gone, "detail": "absent" if gone else "still there"})
for pattern in params.get("no_glob", []):
    hits = sorted(n for n in os.listdir(".") if fnmatch.fnmatch(n, pattern))
    checks.append({"name": f"no_glob:{pattern}", "ok": not hits, "detail": f"matches {hits[:10]}" if hits else "none"})
passed = bool(checks) and all(c["ok"] for c in checks)
score = sum(c["ok"] for c in checks) / len(checks) if checks else 0.0
out = json.dumps({"passed": passed, "score": score, "checks": checks}).encode()
fd = int(os.environ["ENVLOOP_RESULT_FD"])
while out:
    out = out[os.write(fd, out):]
'''


@dataclass(frozen=True)
class CheckResult:
    """The verdict of one terminal-state check.

    Attributes:
        status: ``passed``, ``failed`` (the state is wrong) or ``error`` (the check could not
            decide: it crashed, timed out or sent no verdict; see ``error``).
        score: the share of sub-checks that held (0 on an error).
        checks: the sub-checks, each ``{"name", "ok", "detail"}``.
        sandbox: the check process's sandbox result.
    """

    status: CheckStatus
    score: float
    checks: tuple[Mapping[str, Any], ...]
    sandbox: SandboxResult
    error: str | None = None

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    def to_dict(self) -> dict[str, Any]:
        return {"status": self.status, "passed": self.passed, "score": self.score, "checks": [dict(c) for c in self.checks],
                "error": self.error, "sandbox": self.sandbox.to_dict(include_channel=False)}


@dataclass(frozen=True)
class TerminalStateCheck:
    """A check script and how to run it.

    Args:
        script: Python source (stdlib only) following the module's contract.
        limits: the check's sandbox limits.
        python: the interpreter (default: this one on the local backend, ``python`` in a container).
    """

    script: str = EXPECT_FILES
    limits: SandboxLimits = field(default_factory=lambda: DEFAULT_CHECK_LIMITS)
    python: str | None = None

    def run(self, sandbox: Sandbox, workdir: str | Path, params: Mapping[str, Any]) -> CheckResult:
        """Run the check in ``sandbox`` against ``workdir``; never raises for what the state holds."""
        python = self.python or (sys.executable if sandbox.backend == "local" else "python")
        # -I: isolated mode, so nothing the answer left (a sitecustomize.py, a PYTHONPATH) is imported.
        result = sandbox.run([python, "-I", "-c", self.script], SandboxCall(
            limits=self.limits, workdir=workdir, stdin=json.dumps(params).encode(), result_channel=True))
        if not result.ok:
            return CheckResult("error", 0.0, (), result, error=f"check {result.status}: {result.detail}; {result.stderr_tail[-500:]}")
        try:
            verdict = json.loads(result.channel or "")
            passed, score, checks = verdict["passed"], float(verdict["score"]), tuple(verdict["checks"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            return CheckResult("error", 0.0, (), result, error=f"the check sent no usable verdict: {exc!r}")
        if not isinstance(passed, bool) or not 0.0 <= score <= 1.0:
            return CheckResult("error", 0.0, (), result, error=f"malformed verdict passed={passed!r} score={score!r}")
        return CheckResult("passed" if passed else "failed", score, checks, result)


def expect_files_params(
    *,
    expect: Mapping[str, str] | None = None,
    stripped: Mapping[str, str] | None = None,
    absent: Sequence[str] = (),
    no_glob: Sequence[str] = (),
    unchanged: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Parameters of :data:`EXPECT_FILES`."""
    return {
        "expect": [{"path": p, "content": c, "match": "exact"} for p, c in (expect or {}).items()]
        + [{"path": p, "content": c, "match": "stripped"} for p, c in (stripped or {}).items()],
        "absent": list(absent),
        "no_glob": list(no_glob),
        "unchanged": [{"path": p, "content": c} for p, c in (unchanged or {}).items()],
    }


__all__ = ["CheckResult", "DEFAULT_CHECK_LIMITS", "EXPECT_FILES", "TerminalStateCheck", "expect_files_params"]
