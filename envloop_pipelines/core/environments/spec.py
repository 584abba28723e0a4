"""One environment of a dataset: what the agent sees, how it is verified, its limits.

An :class:`EnvironmentSpec` is a value (frozen, JSON round-trip). Its agent
side (id, kind, instruction, starting files or decision question, limits, seed,
split) is what an attempt starts from; its :class:`VerifierSpec` (the expected
state, a hidden label, hidden ``tests/``) and its reference solution are the
verifier side, stored apart in a dataset (:mod:`.dataset`) and never written
into an attempt's working directory.

Verifier kinds:

* ``terminal``: the terminal-state check :data:`~envloop_pipelines.core.verify.terminal.EXPECT_FILES`
  with ``params`` (expected files, absent files, globs that must match nothing).
* ``tests``: hidden test files (``files``, with ``tests/test.sh``) run in a fresh sandbox process
  against the final working directory, which write a reward file (Harbor's contract).
* ``rule``: a decision question's label row (``params["label"]``), scored by the rule verifier.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

from envloop_pipelines.core.sandbox import SandboxLimits
from envloop_pipelines.core.storage import canonical_json, sha256_bytes

EnvironmentKind = Literal["terminal", "decision"]
KINDS: tuple[str, ...] = ("terminal", "decision")
VERIFIER_KINDS: tuple[str, ...] = ("terminal", "tests", "rule")
#: The split a loop trains on and samples its training attempts from.
TRAIN_SPLIT = "train"
#: The split a loop holds out: only aggregates leave an evaluation that touches it (rule 4). The constant has the
#: project's name for the concept (holdout); its value stays the token ``heldout`` that is stored: every stored
#: environment carries it (hashed into its dataset's version), exports write it into ``task.toml``, and the
#: CLI's ``--split`` takes it.
HOLDOUT_SPLIT = "heldout"
#: Environment splits: a loop trains and samples on ``train`` and holds ``heldout`` out.
ENV_SPLITS: tuple[str, ...] = (TRAIN_SPLIT, HOLDOUT_SPLIT)
#: Per bash command: a shell, coreutils and a small Python fit in 512 MiB of address space; 16 processes
#: stop a fork bomb; 8 MiB per file stops a disk filler early (files of a task are a few KiB).
DEFAULT_COMMAND_LIMITS = SandboxLimits(cpu_s=10.0, mem_mb=512, wall_s=30.0, fsize_mb=8, nofile=64, nproc=16)
#: The verifier's own process (a check script or tests/test.sh with its Python).
DEFAULT_VERIFY_LIMITS = SandboxLimits(cpu_s=30.0, mem_mb=1024, wall_s=60.0, fsize_mb=8, nofile=128, nproc=32)
#: Starting files are text of at most 1 MiB each, 256 files: an environment is a bundle, not a data set.
MAX_FILE_BYTES = 1 << 20
MAX_FILES = 256


class SpecError(ValueError):
    """An environment spec is malformed; the message names where (file, environment) and the field."""


def _fail(where: str, name: str, message: str) -> SpecError:
    return SpecError(f"{where}: field {name!r}: {message}")


def _text_files(where: str, name: str, raw: Any) -> dict[str, str]:
    if not isinstance(raw, Mapping):
        raise _fail(where, name, f"must be a mapping relative path -> text, got {type(raw).__name__}")
    if len(raw) > MAX_FILES:
        raise _fail(where, name, f"{len(raw)} files, more than {MAX_FILES}")
    out: dict[str, str] = {}
    for path, text in raw.items():
        parts = str(path).split("/")
        if not path or str(path).startswith("/") or any(p in ("", ".", "..") for p in parts):
            raise _fail(where, f"{name}[{path!r}]", "must be a relative path without '.', '..' or empty parts")
        if not isinstance(text, str):
            raise _fail(where, f"{name}[{path!r}]", f"must be text (str), got {type(text).__name__}")
        if len(text.encode("utf-8")) > MAX_FILE_BYTES:
            raise _fail(where, f"{name}[{path!r}]", f"more than {MAX_FILE_BYTES} bytes")
        out[str(path)] = text
    return out


@dataclass(frozen=True)
class VerifierSpec:
    """How an environment is verified (the verifier side: never in the agent's working directory).

    Attributes:
        kind: ``terminal``, ``tests`` or ``rule`` (see the module docstring).
        params: ``terminal``: the check's parameters; ``rule``: ``{"label": <label row>}`` and the question's
            provenance; ``tests``: ``{"workdir": "/app"}``, the absolute working directory the tests name, and for
            an imported Harbor task ``task_files`` (every file of its folder as it came, for the export) and
            ``needs_network`` (``file:line: command`` of each line of the tests that reaches the network).
        files: ``tests``: the hidden test files (``tests/test.sh`` and what it uses), path -> text.
        limits: the verifier process's sandbox limits.
    """

    kind: str
    params: Mapping[str, Any] = field(default_factory=dict)
    files: Mapping[str, str] = field(default_factory=dict)
    limits: SandboxLimits = DEFAULT_VERIFY_LIMITS

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "params": dict(self.params), "files": dict(self.files), "limits": self.limits.to_dict()}

    @classmethod
    def from_dict(cls, raw: Any, where: str = "verifier") -> "VerifierSpec":
        if not isinstance(raw, Mapping):
            raise _fail(where, "verifier", f"must be a mapping, got {type(raw).__name__}")
        unknown = sorted(set(raw) - {"kind", "params", "files", "limits"})
        if unknown:
            raise _fail(where, f"verifier.{unknown[0]}", "unknown field; allowed: kind, params, files, limits")
        kind = raw.get("kind")
        if kind not in VERIFIER_KINDS:
            raise _fail(where, "verifier.kind", f"must be one of {', '.join(VERIFIER_KINDS)}, got {kind!r}")
        params = raw.get("params", {})
        if not isinstance(params, Mapping):
            raise _fail(where, "verifier.params", f"must be a mapping, got {type(params).__name__}")
        files = _text_files(where, "verifier.files", raw.get("files", {}))
        if kind == "tests" and "tests/test.sh" not in files:
            raise _fail(where, "verifier.files", "a tests verifier needs tests/test.sh")
        if kind == "rule" and not isinstance(params.get("label"), Mapping):
            raise _fail(where, "verifier.params.label", "a rule verifier needs the question's label row")
        return cls(kind, dict(params), files, _limits(where, "verifier.limits", raw.get("limits"), DEFAULT_VERIFY_LIMITS))


def _limits(where: str, name: str, raw: Any, default: SandboxLimits) -> SandboxLimits:
    if raw is None:
        return default
    if not isinstance(raw, Mapping):
        raise _fail(where, name, f"must be a mapping of SandboxLimits fields, got {type(raw).__name__}")
    try:
        return SandboxLimits.from_dict({**default.to_dict(), **raw})
    except (TypeError, ValueError) as exc:
        raise _fail(where, name, str(exc)) from None


@dataclass(frozen=True)
class EnvironmentSpec:
    """One executable, replayable environment.

    Attributes:
        id: unique within its dataset (``[A-Za-z0-9._-]`` and ``/``).
        kind: ``terminal`` (the agent acts with a bash tool in a working directory) or ``decision``
            (the agent answers one question with an option).
        instruction: the task in words.
        files: terminal: the starting files of the working directory (relative path -> text).
        question: decision: ``state_text``, ``instructions_text``, ``option_keys``, ``option_texts``, ``type``.
        verifier: the verifier side (:class:`VerifierSpec`).
        limits: per bash command (cpu, memory, wall time, file size, processes); the network is always off.
        seed: the generator seed the environment came from (replay: the same seed rebuilds it).
        split: ``train`` or ``heldout``.
        solution: a reference solution (a bash script for terminal environments, an option key for
            decision ones), verifier side; None when unknown.
        meta: provenance (generator, family, source task and snapshot, Harbor metadata).
    """

    id: str
    kind: str
    instruction: str
    verifier: VerifierSpec
    files: Mapping[str, str] = field(default_factory=dict)
    question: Mapping[str, Any] | None = None
    limits: SandboxLimits = DEFAULT_COMMAND_LIMITS
    seed: int = 0
    split: str = TRAIN_SPLIT
    solution: Any = None
    meta: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_spec(self, f"environment {self.id!r}")

    @property
    def tools(self) -> tuple[str, ...]:
        """The tools an agent gets: ``("bash",)`` in a terminal environment, none in a decision one."""
        return ("bash",) if self.kind == "terminal" else ()

    def agent_view(self) -> dict[str, Any]:
        """What the agent may see (no verifier, no solution): the dataset's public record."""
        return {"id": self.id, "kind": self.kind, "instruction": self.instruction, "files": dict(self.files),
                "question": None if self.question is None else dict(self.question), "limits": self.limits.to_dict(),
                "network": False, "seed": self.seed, "split": self.split, "meta": dict(self.meta)}

    def verifier_view(self) -> dict[str, Any]:
        """The verifier side, stored apart: the verifier and the reference solution."""
        return {"id": self.id, "verifier": self.verifier.to_dict(), "solution": self.solution}

    def to_dict(self) -> dict[str, Any]:
        return {**self.agent_view(), **self.verifier_view()}

    def fingerprint(self) -> str:
        """sha256 of the canonical JSON of both sides: equal for equal environments."""
        return sha256_bytes(canonical_json(self.to_dict()))

    @classmethod
    def from_dict(cls, raw: Any, where: str = "<spec>") -> "EnvironmentSpec":
        """Build and validate a spec; every error names ``where`` and the field."""
        if not isinstance(raw, Mapping):
            raise SpecError(f"{where}: an environment must be a JSON object, got {type(raw).__name__}")
        allowed = {"id", "kind", "instruction", "files", "question", "limits", "network", "seed", "split", "meta",
                   "verifier", "solution"}
        unknown = sorted(set(raw) - allowed)
        if unknown:
            raise _fail(where, unknown[0], f"unknown field; allowed: {', '.join(sorted(allowed))}")
        for name in ("id", "kind", "instruction", "verifier"):
            if name not in raw:
                raise _fail(where, name, "missing")
        if raw.get("network", False) is not False:
            raise _fail(where, "network", "environments run with the network off; only false is allowed")
        env_where = f"{where}: environment {raw['id']!r}"
        return cls(
            id=raw["id"], kind=raw["kind"], instruction=raw["instruction"],
            verifier=VerifierSpec.from_dict(raw["verifier"], env_where),
            files=_text_files(env_where, "files", raw.get("files") or {}),
            question=raw.get("question"), limits=_limits(env_where, "limits", raw.get("limits"), DEFAULT_COMMAND_LIMITS),
            seed=raw.get("seed", 0), split=raw.get("split", TRAIN_SPLIT), solution=raw.get("solution"),
            meta=raw.get("meta") or {},
        )


_QUESTION_KEYS = ("state_text", "instructions_text", "option_keys", "option_texts", "type")


def check_spec(spec: EnvironmentSpec, where: str) -> None:
    """Validate a spec's fields (called by the constructor); raises :class:`SpecError` naming the field."""
    if not isinstance(spec.id, str) or not re.fullmatch(r"[A-Za-z0-9._/#-]{1,200}", spec.id) or ".." in spec.id:
        raise _fail(where, "id", "must be 1-200 characters of letters, digits, '.', '_', '-', '/', '#' (no '..')")
    if spec.kind not in KINDS:
        raise _fail(where, "kind", f"must be one of {', '.join(KINDS)}, got {spec.kind!r}")
    if not isinstance(spec.instruction, str) or not spec.instruction.strip():
        raise _fail(where, "instruction", "must be non-empty text")
    if not isinstance(spec.verifier, VerifierSpec):
        raise _fail(where, "verifier", "must be a VerifierSpec")
    if spec.split not in ENV_SPLITS:
        raise _fail(where, "split", f"must be one of {', '.join(ENV_SPLITS)}, got {spec.split!r}")
    if isinstance(spec.seed, bool) or not isinstance(spec.seed, int) or spec.seed < 0:
        raise _fail(where, "seed", f"must be a non-negative integer, got {spec.seed!r}")
    if not isinstance(spec.meta, Mapping):
        raise _fail(where, "meta", "must be a mapping")
    _text_files(where, "files", spec.files)
    if spec.kind == "terminal":
        if spec.verifier.kind not in ("terminal", "tests"):
            raise _fail(where, "verifier.kind", f"a terminal environment is verified by terminal or tests, not {spec.verifier.kind!r}")
        if spec.question is not None:
            raise _fail(where, "question", "only decision environments have a question")
        if spec.solution is not None and not isinstance(spec.solution, str):
            raise _fail(where, "solution", "a terminal environment's solution is a bash script (text)")
    else:
        if spec.verifier.kind != "rule":
            raise _fail(where, "verifier.kind", f"a decision environment is verified by rule, not {spec.verifier.kind!r}")
        if spec.files:
            raise _fail(where, "files", "a decision environment has no starting files")
        q = spec.question
        if not isinstance(q, Mapping) or any(k not in q for k in _QUESTION_KEYS):
            raise _fail(where, "question", f"must be a mapping with {', '.join(_QUESTION_KEYS)}")
        keys = q["option_keys"]
        if not isinstance(keys, (list, tuple)) or len(keys) < 2 or len(set(keys)) != len(keys):
            raise _fail(where, "question.option_keys", "must be at least two distinct option keys")
        if spec.solution is not None and spec.solution not in keys:
            raise _fail(where, "solution", f"must be one of the option keys {list(keys)}")
    for name in ("wall_s", "cpu_s"):
        if not math.isfinite(getattr(spec.limits, name)):
            raise _fail(where, f"limits.{name}", "must be finite")


__all__ = [
    "DEFAULT_COMMAND_LIMITS", "DEFAULT_VERIFY_LIMITS", "ENV_SPLITS", "HOLDOUT_SPLIT", "EnvironmentKind", "EnvironmentSpec",
    "KINDS", "SpecError", "TRAIN_SPLIT", "VERIFIER_KINDS", "VerifierSpec", "check_spec",
]
