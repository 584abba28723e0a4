"""The ledger: hypotheses, arms, rejected candidates, releases, all kept.

Rules enforced here (``docs/rsi-rules.md``):

1. A hypothesis is written before training, hashed and immutable: the file is
   write-once, a second registration with other content is refused.
2. A gate, registered or amended, is never looser than the measured noise floor and a paired
   CI above zero (:meth:`Gate.require_not_loose`).
3. A gate moves only as a recorded amendment, shown beside the original.
4. The holdout is read once per release: the read is a write-once marker.
5. Every arm, hypothesis and rejected candidate stays with its numbers.
6. Release cards are never rewritten; corrections are appended as errata.

Layout under ``<home>/loops/<task>/``::

    ledger.jsonl                 append-only events (idempotent: an event id is its content hash)
    hypotheses/<round>.json      write-once registered hypotheses
    amendments/<round>-<n>.json  gate amendments
    releases/<NNNN>/card.json    release cards (write-once) and card.md
    releases/<NNNN>/holdout.json the one holdout read of the release
    releases/<NNNN>/errata/<n>.json  appended corrections
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Iterator, Mapping

from envloop_pipelines.core.loop.store import loop_dir
from envloop_pipelines.core.storage import atomic_write_bytes, canonical_json, sha256_bytes

# -- the ledger's event kinds: the only spelling (docs/concepts.md) -------------------------------------------
EVENT_LOOP_STARTED = "loop_started"
EVENT_LOOP_STOPPED = "loop_stopped"
EVENT_NULL_ARM = "null_arm"
EVENT_HYPOTHESIS_REGISTERED = "hypothesis_registered"
EVENT_HYPOTHESIS_REFUTED = "hypothesis_refuted"
EVENT_GATE_AMENDED = "gate_amended"
EVENT_CHECKPOINT_TRAINED = "lora_checkpoint_trained"
EVENT_CANDIDATE_REJECTED = "candidate_rejected"
EVENT_ROUND_DECIDED = "round_decided"
EVENT_ROUND_FAILED = "round_failed"
EVENT_HOLDOUT_READ = "holdout_read"
EVENT_RELEASE_PROMOTED = "release_promoted"
EVENT_ERRATUM = "erratum"
EVENT_KINDS = (EVENT_LOOP_STARTED, EVENT_LOOP_STOPPED, EVENT_NULL_ARM, EVENT_HYPOTHESIS_REGISTERED,
               EVENT_HYPOTHESIS_REFUTED, EVENT_GATE_AMENDED, EVENT_CHECKPOINT_TRAINED, EVENT_CANDIDATE_REJECTED,
               EVENT_ROUND_DECIDED, EVENT_ROUND_FAILED, EVENT_HOLDOUT_READ, EVENT_RELEASE_PROMOTED, EVENT_ERRATUM)
#: Kinds written by earlier versions, read under their current name (the line on disk is never rewritten).
LEGACY_EVENT_KINDS = {"arm_trained": EVENT_CHECKPOINT_TRAINED}


class LedgerError(RuntimeError):
    """A loop rule was about to be broken."""


class HypothesisImmutableError(LedgerError):
    """A registered hypothesis would change."""


class HoldoutAlreadyReadError(LedgerError):
    """A second holdout read for the same release."""


class ReleaseCardExistsError(LedgerError):
    """A release card would be rewritten."""


class GateTooLooseError(LedgerError, ValueError):
    """A gate would be looser than the measured noise floor and a paired CI above zero (rule 2)."""


#: The loosest gate any hypothesis or amendment may set (rule 2): the gain must clear at least the measured
#: noise floor itself (``floor_multiplier`` ≥ 1) and the paired CI's lower end must be above zero.
MIN_FLOOR_MULTIPLIER = 1.0


@dataclass(frozen=True)
class Gate:
    """The bar a candidate must clear, fixed before training.

    A candidate is promoted when its paired delta on ``primary_metric`` (in the
    registered direction) exceeds both ``min_delta`` and the noise floor times
    ``floor_multiplier``, and the lower end of its CI is above zero.
    """

    primary_metric: str = "family_macro_accuracy"
    direction: str = "increase"
    min_delta: float = 0.0
    floor_multiplier: float = 1.0
    require_ci_above_zero: bool = True
    #: Guards: calibrated ECE ceiling, safety FNR may not rise by more than this, families may not drop by
    #: more than their own noise (their per-family floor, or ``family_drop_tolerance`` when none is measured).
    max_ece: float = 0.08
    max_safety_fnr_increase: float = 0.02
    family_drop_tolerance: float = 0.05

    def __post_init__(self) -> None:
        if self.direction not in ("increase", "decrease"):
            raise ValueError(f"gate.direction must be 'increase' or 'decrease', got {self.direction!r}")
        for name in ("min_delta", "floor_multiplier", "max_ece", "max_safety_fnr_increase", "family_drop_tolerance"):
            if getattr(self, name) < 0:
                raise ValueError(f"gate.{name} must be ≥ 0, got {getattr(self, name)}")

    def loosening(self) -> list[str]:
        """Why this gate is looser than rule 2 allows, one message per field (empty when it is not).

        A gate may be stricter than the default (a larger ``floor_multiplier`` or ``min_delta``),
        never looser than the measured floor and a paired CI above zero. Gates registered before
        this rule still load (the ledger is never rewritten); they are refused only when written.
        """
        errors = []
        if not self.floor_multiplier >= MIN_FLOOR_MULTIPLIER:
            errors.append(f"gate.floor_multiplier: must be at least {MIN_FLOOR_MULTIPLIER:g} (got {self.floor_multiplier:g}); "
                          f"a hypothesis may make its gate stricter, never looser than the measured noise floor")
        if self.require_ci_above_zero is not True:
            errors.append(f"gate.require_ci_above_zero: must be true (got {json.dumps(self.require_ci_above_zero, default=str)}); "
                          f"every promotion needs the paired CI's lower end above zero")
        return errors

    def require_not_loose(self, what: str) -> "Gate":
        """Return the gate, or raise :class:`GateTooLooseError` naming each loosened field."""
        errors = self.loosening()
        if errors:
            raise GateTooLooseError(f"{what} refused: " + "; ".join(errors))
        return self


def gate_errors(raw: Any) -> list[str]:
    """What is wrong with a proposal's ``gate`` object, before any compute: unknown fields, bad values, loosening."""
    if not isinstance(raw, Mapping):
        return ["gate: must be an object"]
    allowed = [f.name for f in fields(Gate)]
    unknown = [f"gate: unknown field {k!r} (allowed: {', '.join(allowed)})" for k in raw if k not in allowed]
    if unknown:
        return unknown
    try:
        gate = Gate(**raw)
    except (TypeError, ValueError) as exc:
        return [str(exc)]
    return gate.loosening()


@dataclass(frozen=True)
class Hypothesis:
    """A round's registered proposal: the change, the predicted effect, the gate, the seeds."""

    task: str
    round: str
    benchmark_version: str
    change: Mapping[str, Any]
    predicted_delta: float
    gate: Gate
    seeds: tuple[int, ...]
    recipe_hash: str
    author: str = "auto"
    rationale: str = ""
    created_at: float = field(default_factory=time.time)
    #: The test's power for this hypothesis, measured at registration (rule 2: each hypothesis records the
    #: smallest effect its test set can detect): ``mde``, the ``se`` it comes from, ``underpowered`` (the
    #: predicted effect is below the MDE), how it was measured. ``None`` in hypotheses registered before
    #: (left out of their content, so their hashes are unchanged).
    power: Mapping[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["seeds"] = list(self.seeds)
        if self.power is None:
            d.pop("power")
        else:
            d["power"] = dict(self.power)
        return d

    @property
    def underpowered(self) -> bool:
        """Whether the predicted effect is below the minimum detectable effect measured at registration."""
        return bool(self.power and self.power.get("underpowered"))

    @property
    def hash(self) -> str:
        """Content hash (the registration time is not part of the content)."""
        body = self.to_dict()
        body.pop("created_at")
        return sha256_bytes(canonical_json(body))

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "Hypothesis":
        data = dict(raw)
        data.pop("hash", None)
        data["gate"] = Gate(**data["gate"])
        data["seeds"] = tuple(data["seeds"])
        return cls(**data)


def _write_once(path: Path, payload: bytes) -> bool:
    """Create ``path`` with ``payload`` unless it exists. True when written, False when it
    already held exactly this payload; raise when it holds something else."""
    if path.exists():
        if path.read_bytes() == payload:
            return False
        raise FileExistsError(str(path))
    atomic_write_bytes(path, payload)
    return True


class Ledger:
    """The append-only record of one task's loop."""

    def __init__(self, task: str, home: str | Path | None = None) -> None:
        self.task = task
        self.root = loop_dir(task, home)
        self.root.mkdir(parents=True, exist_ok=True)
        self.events_path = self.root / "ledger.jsonl"

    # -- events ------------------------------------------------------------------------------
    def append(self, kind: str, payload: Mapping[str, Any], *, key: str | None = None) -> dict[str, Any]:
        """Append one event; an event with the same ``key`` (default: content hash) is written once.

        Replaying a step after a crash therefore never duplicates an entry.

        Raises:
            LedgerError: ``kind`` is not one of ``EVENT_KINDS`` (one spelling per event).
        """
        if kind not in EVENT_KINDS:
            raise LedgerError(f"unknown ledger event kind {kind!r}; allowed: {', '.join(EVENT_KINDS)}")
        body = {"kind": kind, "task": self.task, **payload}
        event_id = key or sha256_bytes(canonical_json(body))[:16]
        for existing in self.events():
            if existing.get("event_id") == event_id:
                return existing
        event = {"event_id": event_id, "at": time.time(), **body}
        line = json.dumps(event, sort_keys=True, ensure_ascii=False, default=str) + "\n"
        # One write() of one line with O_APPEND: concurrent appenders never interleave a line.
        fd = os.open(self.events_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, line.encode("utf-8"))
            os.fsync(fd)
        finally:
            os.close(fd)
        return event

    def events(self, kind: str | None = None) -> Iterator[dict[str, Any]]:
        if not self.events_path.exists():
            return
        with open(self.events_path, encoding="utf-8") as fh:
            for line in fh:
                if not line.strip():
                    continue
                try:
                    event = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a torn last line from a crash mid-write is not an event
                if event.get("kind") in LEGACY_EVENT_KINDS:
                    event["kind"] = LEGACY_EVENT_KINDS[event["kind"]]
                if kind is None or event.get("kind") == kind:
                    yield event

    # -- hypotheses --------------------------------------------------------------------------
    def hypothesis_path(self, round_key: str) -> Path:
        return self.root / "hypotheses" / f"{round_key}.json"

    def register_hypothesis(self, hypothesis: Hypothesis) -> str:
        """Write the hypothesis once; re-registering the same content is a no-op.

        Raises:
            HypothesisImmutableError: the round already has a different hypothesis.
            GateTooLooseError: its gate is looser than the floor and a CI above zero (rule 2).
        """
        path = self.hypothesis_path(hypothesis.round)
        if path.exists():
            existing = Hypothesis.from_dict(json.loads(path.read_text(encoding="utf-8")))
            if existing.hash != hypothesis.hash:
                raise HypothesisImmutableError(
                    f"round {hypothesis.round} already registered hypothesis {existing.hash[:12]}; "
                    f"a registered hypothesis is immutable (record an amendment instead)"
                )
            return existing.hash
        hypothesis.gate.require_not_loose(f"round {hypothesis.round}: hypothesis")  # rule 2, for every caller
        body = {**hypothesis.to_dict(), "hash": hypothesis.hash}
        atomic_write_bytes(path, (json.dumps(body, sort_keys=True, indent=2, ensure_ascii=False) + "\n").encode())
        power = hypothesis.power or {}
        self.append(EVENT_HYPOTHESIS_REGISTERED, {"round": hypothesis.round, "hash": hypothesis.hash,
                                              "predicted_delta": hypothesis.predicted_delta,
                                              "mde": power.get("mde"), "underpowered": hypothesis.underpowered,
                                              "change": dict(hypothesis.change)},
                    key=f"hypothesis:{hypothesis.round}")
        return hypothesis.hash

    def hypothesis(self, round_key: str) -> Hypothesis | None:
        path = self.hypothesis_path(round_key)
        if not path.exists():
            return None
        raw = json.loads(path.read_text(encoding="utf-8"))
        hyp = Hypothesis.from_dict(raw)
        if hyp.hash != raw.get("hash"):
            raise HypothesisImmutableError(f"{path}: content no longer matches its registered hash")
        return hyp

    def require_hypothesis(self, round_key: str) -> Hypothesis:
        hyp = self.hypothesis(round_key)
        if hyp is None:
            raise LedgerError(
                f"round {round_key} has no registered hypothesis; training refuses to start without one "
                f"(materialize registered_hypothesis first)"
            )
        return hyp

    def amend_gate(self, round_key: str, new_gate: Gate, reason: str) -> dict[str, Any]:
        """Record a gate amendment (shown beside the original on the card).

        Raises:
            LedgerError: no reason is given.
            GateTooLooseError: the amended gate is looser than the floor and a CI above zero (rule 2);
                guards (``max_ece``, ...) and ``min_delta`` may move either way.
        """
        if not reason.strip():
            raise LedgerError("a gate amendment needs a reason")
        new_gate.require_not_loose(f"round {round_key}: gate amendment")
        original = self.require_hypothesis(round_key)
        existing = sorted((self.root / "amendments").glob(f"{round_key}-*.json"))
        body = {"round": round_key, "original_gate": asdict(original.gate), "amended_gate": asdict(new_gate),
                "reason": reason, "hypothesis_hash": original.hash, "requires_fresh_seeds": True}
        atomic_write_bytes(self.root / "amendments" / f"{round_key}-{len(existing) + 1}.json", canonical_json(body))
        self.append(EVENT_GATE_AMENDED, body)
        return body

    def amendments(self, round_key: str) -> list[dict[str, Any]]:
        return [json.loads(p.read_text()) for p in sorted((self.root / "amendments").glob(f"{round_key}-*.json"))]

    def effective_gate(self, round_key: str) -> Gate:
        """The latest amendment's gate, else the registered one (as written; the decision applies rule 2's floor)."""
        amendments = self.amendments(round_key)
        if amendments:
            return Gate(**amendments[-1]["amended_gate"])
        return self.require_hypothesis(round_key).gate

    # -- releases ----------------------------------------------------------------------------
    def release_dir(self, release: int) -> Path:
        return self.root / "releases" / f"{release:04d}"

    def releases(self) -> list[dict[str, Any]]:
        """Every release card, oldest first, with its errata."""
        out = []
        for card in sorted((self.root / "releases").glob("*/card.json")):
            body = json.loads(card.read_text(encoding="utf-8"))
            body["errata"] = [json.loads(p.read_text()) for p in sorted((card.parent / "errata").glob("*.json"))]
            out.append(body)
        return out

    def next_release_number(self) -> int:
        return len(list((self.root / "releases").glob("*/card.json"))) + 1

    def read_holdout_once(self, release: int, read: Any) -> Any:
        """Call ``read()`` for the release's one holdout read and record it.

        Raises:
            HoldoutAlreadyReadError: the release already consumed its holdout.
        """
        marker = self.release_dir(release) / "holdout.json"
        marker.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o444)
        except FileExistsError:
            raise HoldoutAlreadyReadError(
                f"release {release} already read the holdout ({marker}); each release reads it once"
            ) from None
        try:
            result = read()
            os.write(fd, canonical_json({"release": release, "at": time.time(), "result": result}))
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            marker.unlink(missing_ok=True)  # a failed read did not consume the holdout
            raise
        os.close(fd)
        self.append(EVENT_HOLDOUT_READ, {"release": release}, key=f"holdout:{release}")
        return result

    def holdout_result(self, release: int) -> Any:
        marker = self.release_dir(release) / "holdout.json"
        return json.loads(marker.read_text())["result"] if marker.exists() else None

    def write_release_card(self, release: int, card: Mapping[str, Any], markdown: str) -> Path:
        """Write a release card once; an identical retry is a no-op, any change is refused."""
        d = self.release_dir(release)
        payload = (json.dumps(card, sort_keys=True, indent=2, ensure_ascii=False, default=str) + "\n").encode()
        try:
            _write_once(d / "card.json", payload)
            _write_once(d / "card.md", markdown.encode("utf-8"))
        except FileExistsError as exc:
            raise ReleaseCardExistsError(f"release card {exc} exists and is never rewritten; append an erratum") from None
        for path in (d / "card.json", d / "card.md"):
            path.chmod(0o444)
        self.append(EVENT_RELEASE_PROMOTED, {"release": release, "round": card.get("round"),
                                         "checkpoint_sha256": card.get("checkpoint_sha256")}, key=f"release:{release}")
        return d

    def append_erratum(self, release: int, field_name: str, old: Any, new: Any, reason: str) -> dict[str, Any]:
        """Correct a card by appending; the old value stays visible beside the new one."""
        d = self.release_dir(release)
        if not (d / "card.json").exists():
            raise LedgerError(f"release {release} has no card")
        n = len(list((d / "errata").glob("*.json"))) + 1
        body = {"release": release, "erratum": n, "field": field_name, "old": old, "new": new, "reason": reason,
                "at": time.time()}
        atomic_write_bytes(d / "errata" / f"{n:03d}.json", canonical_json(body))
        self.append(EVENT_ERRATUM, body)
        return body
