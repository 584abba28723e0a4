"""Attempts: one agent's try at one environment, with its whole transcript, stored as JSONL.

An :class:`Attempt` is what the runner records after an agent acted in an
environment's sandbox and the verifier judged the final state. ``messages`` is
the conversation in the OpenAI chat format, exactly as it went over the wire
(system, user, assistant turns with their ``tool_calls``, ``tool`` results),
so the passed attempts of training environments are SFT rows as they stand.

Attempts of one evaluation are stored together as ``attempts.jsonl`` in a
content-addressed folder (:func:`write_attempts`); :func:`read_attempts`
reads them back with errors that name the file, the line and the field.

Every string is stored as it is, whatever an agent or its endpoint produced
(:func:`attempt_json`): a line is UTF-8 JSON, and a line whose strings are not
all valid Unicode (a lone surrogate from a reply's ``"\\ud800"`` escape, a file
name that is not UTF-8, which ``os.fsdecode`` turns into surrogates
U+DC80..U+DCFF) is written with ASCII escapes instead (``\\ud800``), which JSON
allows and which read back to the same strings.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

from envloop_pipelines.core.storage import atomic_write_bytes, canonical_json, read_jsonl, sha256_bytes

AttemptStatus = Literal["passed", "failed", "error"]
ATTEMPT_STATUSES: tuple[str, ...] = ("passed", "failed", "error")
ATTEMPTS_FILE = "attempts.jsonl"


@dataclass(frozen=True)
class Attempt:
    """One attempt of an agent at an environment.

    Attributes:
        dataset: the environment dataset's name.
        dataset_version: its version (content hash).
        environment_id: the environment within the dataset.
        split: the environment's split (``train``, ``heldout``, ...).
        seed: the environment's seed (what replays the same task).
        attempt: the attempt's index for this environment (0, 1, ...).
        sampling_seed: the ``seed`` sent with every chat request of this attempt.
        agent: the agent (``base_url``, ``model``, ``kind``); never its key.
        messages: the OpenAI chat messages of the attempt, in order.
        tools: the tool definitions offered (OpenAI ``tools`` format; empty for decision environments).
        final_state: what the environment looked like at the end (files or the submitted answer).
        score: the verifier's verdict (``Score.to_dict()``), or None when verification itself failed.
        passed: the verifier passed the final state and the attempt ended without an agent error.
        status: ``passed``, ``failed`` (the verifier said no, or a limit ran out) or ``error`` (the agent's
            endpoint failed, or it sent a malformed tool call).
        error: what went wrong, in words ("" when nothing did).
        prompt_tokens: prompt tokens over all calls, as the endpoint reported them.
        completion_tokens: completion tokens over all calls.
        turns: model calls made.
        tool_calls: tool calls run in the sandbox.
        wall_s: seconds from the episode's start to the verdict.
    """

    dataset: str
    dataset_version: str
    environment_id: str
    split: str
    seed: int
    attempt: int
    sampling_seed: int
    agent: Mapping[str, Any]
    messages: Sequence[Mapping[str, Any]]
    tools: Sequence[Mapping[str, Any]] = ()
    final_state: Mapping[str, Any] = field(default_factory=dict)
    score: Mapping[str, Any] | None = None
    passed: bool = False
    status: AttemptStatus = "failed"
    error: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    turns: int = 0
    tool_calls: int = 0
    wall_s: float = 0.0

    def __post_init__(self) -> None:
        if self.status not in ATTEMPT_STATUSES:
            raise ValueError(f"Attempt.status must be one of {', '.join(ATTEMPT_STATUSES)}, got {self.status!r}")
        if self.passed != (self.status == "passed"):
            raise ValueError(f"Attempt.passed={self.passed} contradicts status {self.status!r}")
        if not isinstance(self.messages, (list, tuple)) or not all(isinstance(m, Mapping) and "role" in m for m in self.messages):
            raise ValueError("Attempt.messages must be a list of chat messages, each with a role")

    @property
    def key(self) -> tuple[str, int]:
        """``(environment_id, attempt)``: unique within one evaluation."""
        return (self.environment_id, self.attempt)

    def transcript_sha256(self) -> str:
        """sha256 of the canonical JSON of ``messages``: the transcript's identity (SFT rows cite it)."""
        return sha256_bytes(attempt_json(list(self.messages)))

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["messages"] = [dict(m) for m in self.messages]
        out["tools"] = [dict(t) for t in self.tools]
        return out

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], *, where: str = "attempt") -> "Attempt":
        """An attempt from its JSON object; errors name ``where`` and the field.

        Raises:
            ValueError: a missing or unknown field, or a field of the wrong type.
        """
        if not isinstance(raw, Mapping):
            raise ValueError(f"{where}: an attempt is a JSON object, got {type(raw).__name__}")
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {unknown}")
        required = [n for n, f in known.items() if f.default is MISSING and f.default_factory is MISSING]
        missing = [n for n in required if n not in raw]
        if missing:
            raise ValueError(f"{where}: missing field(s) {missing}")
        types = {"dataset": str, "dataset_version": str, "environment_id": str, "split": str, "seed": int, "attempt": int,
                 "sampling_seed": int, "agent": dict, "messages": list, "tools": list, "final_state": dict,
                 "passed": bool, "status": str, "error": str, "prompt_tokens": int, "completion_tokens": int,
                 "turns": int, "tool_calls": int, "wall_s": (int, float)}
        for name, typ in types.items():
            if name in raw and (not isinstance(raw[name], typ) or (typ is int and isinstance(raw[name], bool))):
                raise ValueError(f"{where}: field {name!r} must be {getattr(typ, '__name__', 'a number')}, "
                                 f"got {type(raw[name]).__name__}")
        if raw.get("score") is not None and not isinstance(raw["score"], dict):
            raise ValueError(f"{where}: field 'score' must be an object or null")
        try:
            return cls(**dict(raw))
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None


def attempt_json(value: Any) -> bytes:
    """Canonical JSON bytes of ``value`` (sorted keys, no spaces, UTF-8); ASCII escapes where a string is not
    valid Unicode (lone surrogates), so every string is stored and reads back the same."""
    try:
        return canonical_json(value)
    except UnicodeEncodeError:
        return json.dumps(value, sort_keys=True, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def attempts_jsonl(attempts: Sequence[Attempt]) -> bytes:
    """The JSONL bytes of ``attempts`` in (environment, attempt) order: one canonical JSON object per line."""
    ordered = sorted(attempts, key=lambda a: a.key)
    return b"".join(attempt_json(a.to_dict()) + b"\n" for a in ordered)


def chat_rows(attempts: Sequence[Attempt], statuses: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Attempts as chat-format training rows (``messages``, ``tools``, ``metadata``), those of ``statuses`` only.

    What ``harbor traces export`` gives Harbor users, and what an SFT or RL snapshot reads: the transcript as
    it went over the wire, and the verdict beside it.
    """
    wanted = None if statuses is None else set(statuses)
    unknown = sorted((wanted or set()) - set(ATTEMPT_STATUSES))
    if unknown:
        raise ValueError(f"statuses {unknown} are not among {', '.join(ATTEMPT_STATUSES)}")
    return [{"messages": [dict(m) for m in a.messages], "tools": [dict(t) for t in a.tools],
             "metadata": {"dataset": a.dataset, "dataset_version": a.dataset_version, "environment_id": a.environment_id,
                          "split": a.split, "attempt": a.attempt, "status": a.status, "passed": a.passed,
                          "reward": None if a.score is None else a.score.get("value"), "error": a.error,
                          "agent": dict(a.agent), "transcript_sha256": a.transcript_sha256()}}
            for a in sorted(attempts, key=lambda x: x.key) if wanted is None or a.status in wanted]


def write_attempts(directory: str | Path, attempts: Sequence[Attempt]) -> Path:
    """Write ``attempts`` to ``directory/attempts.jsonl`` (atomic, never overwritten)."""
    return atomic_write_bytes(Path(directory) / ATTEMPTS_FILE, attempts_jsonl(attempts))


def read_attempts(path: str | Path) -> list[Attempt]:
    """Attempts from a JSONL file (or a folder holding ``attempts.jsonl``).

    Raises:
        ValueError: a line that is not JSON or not an attempt, naming the file, line and field.
    """
    path = Path(path)
    if path.is_dir():
        path = path / ATTEMPTS_FILE
    return [Attempt.from_dict(raw, where=f"{path}:{n}") for n, raw in read_jsonl(path)]


__all__ = ["ATTEMPTS_FILE", "ATTEMPT_STATUSES", "Attempt", "AttemptStatus", "attempt_json", "attempts_jsonl", "chat_rows", "read_attempts", "write_attempts"]
