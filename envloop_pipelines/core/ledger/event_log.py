"""The ledger's event log: one task's append-only ``ledger.jsonl``, its hash chain and its event kinds.

Every event is one JSON line, written once (an event id is its content hash, or the caller's key) and
carrying ``prev``, the sha256 of every byte before it, so an edited, removed or inserted line breaks the
chain (:func:`chain_break`) and every reader refuses the file (:class:`LedgerChainError`). The event kinds
are spelled here only (``docs/concepts.md``). :class:`LedgerError`, the error of every loop rule, lives
with the log, below the rules that raise it (``hypothesis.py``, ``reads.py``, ``ledger.py``).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Iterator, Mapping

from envloop_pipelines.core.ledger.store import loop_dir
from envloop_pipelines.core.storage import canonical_json, sha256_bytes

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
EVENT_TEST_READ = "test_read"
EVENT_HOLDOUT_SLOT = "holdout_slot_opened"
EVENT_KINDS = (EVENT_LOOP_STARTED, EVENT_LOOP_STOPPED, EVENT_NULL_ARM, EVENT_HYPOTHESIS_REGISTERED,
               EVENT_HYPOTHESIS_REFUTED, EVENT_GATE_AMENDED, EVENT_CHECKPOINT_TRAINED, EVENT_CANDIDATE_REJECTED,
               EVENT_ROUND_DECIDED, EVENT_ROUND_FAILED, EVENT_HOLDOUT_READ, EVENT_RELEASE_PROMOTED, EVENT_ERRATUM,
               EVENT_TEST_READ, EVENT_HOLDOUT_SLOT)
#: Kinds only the holdout's one read writes (the release step's slot and the read itself): :meth:`Ledger.append`
#: refuses them, so no caller opens a release's holdout slot for predictions of its own (issue 34).
LEDGER_OWN_KINDS = (EVENT_HOLDOUT_SLOT, EVENT_HOLDOUT_READ)
#: Kinds written by earlier versions, read under their current name (the line on disk is never rewritten).
LEGACY_EVENT_KINDS = {"arm_trained": EVENT_CHECKPOINT_TRAINED}


class LedgerError(RuntimeError):
    """A loop rule was about to be broken."""


class LedgerChainError(LedgerError):
    """The ledger's hash chain is broken: a line was edited, removed or inserted (the first broken link named)."""


#: The field in which each event carries the digest of the ledger before it (sha256 of every byte of
#: ``ledger.jsonl`` before its line): each event binds all the ones before it.
CHAIN_FIELD = "prev"


def chain_break(raw: bytes, path: Any = "ledger.jsonl") -> str | None:
    """The first broken link of a ledger file's hash chain, as one message; ``None`` when every link holds.

    Each event written since the chain exists carries ``prev``, the sha256 of every byte of the file
    before its line. Lines before the first chained event were written before the chain existed (an
    existing home): they are read as they are, and the first chained event's ``prev`` binds them all (the
    chain starts there; nothing is migrated or rewritten). After it, every line must carry its ``prev`` and
    match: an edited or removed line changes the digest every later event recorded, an inserted line has
    none or a wrong one. A torn last line (a crash mid-write, no newline) is not an event. A truncated tail
    (the last events deleted) leaves a chain that holds: the head anchored in MLflow (:func:`anchor_head`)
    tells that.
    """
    import hashlib

    digest = hashlib.sha256()
    started = False
    lines = raw.split(b"\n")
    for n, line in enumerate(lines, 1):
        last = n == len(lines)
        if last:
            break  # after the final newline: empty, or a torn line
        text = line.decode("utf-8", errors="replace")
        if text.strip():
            try:
                event = json.loads(text)
            except json.JSONDecodeError:
                event = None
            what = (f"{path} line {n}" if not isinstance(event, dict) else
                    f"{path} line {n} (event {event.get('event_id')}, {event.get('kind')})")
            if not isinstance(event, dict):
                if started:
                    return f"ledger chain broken at {what}: not a JSON event; a line was edited by hand"
            elif CHAIN_FIELD in event:
                expected = digest.hexdigest()
                if event[CHAIN_FIELD] != expected:
                    return (f"ledger chain broken at {what}: it records prev {str(event[CHAIN_FIELD])[:16]}, but the "
                            f"{n - 1} lines before it hash to {expected[:16]}: a line before it was edited, removed "
                            f"or inserted")
                started = True
            elif started:
                return (f"ledger chain broken at {what}: no {CHAIN_FIELD} digest after the chain started; the line "
                        f"was inserted or rewritten by hand")
        digest.update(line + b"\n")
    return None


class EventLog:
    """One task's ``ledger.jsonl``: append an event once, read the events after verifying their chain."""

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
            LedgerError: ``kind`` is not one of ``EVENT_KINDS`` (one spelling per event), or the payload names
                a field the ledger writes itself (``kind``, ``task``, ``event_id``): it would have replaced the
                event's own (an event of one kind written as another). Nothing is written.
        """
        if kind in LEDGER_OWN_KINDS:
            raise LedgerError(f"{kind} events are written only by the release step's own read "
                              f"(Ledger.read_holdout_once, core/release/publish.py), never appended by a caller")
        return self._append(kind, payload, key=key)

    def _append(self, kind: str, payload: Mapping[str, Any], *, key: str | None = None) -> dict[str, Any]:
        """:meth:`append` without the refusal of :data:`LEDGER_OWN_KINDS` (the ledger's and the release step's own)."""
        if kind not in EVENT_KINDS:
            raise LedgerError(f"unknown ledger event kind {kind!r}; allowed: {', '.join(EVENT_KINDS)}")
        reserved = sorted(set(payload) & {"kind", "task", "event_id", CHAIN_FIELD})
        if reserved:
            raise LedgerError(f"{kind} event: payload field(s) {', '.join(reserved)} are the ledger's own "
                              f"(kind, task, event_id, {CHAIN_FIELD}); name them otherwise")
        import fcntl

        body = {"kind": kind, "task": self.task, **payload}
        event_id = key or sha256_bytes(canonical_json(body))[:16]
        # One appender at a time (an exclusive lock, released by the OS if its holder dies): each event's
        # ``prev`` is the digest of every line before it, so two appenders must not write after the same head.
        lock = os.open(self.root / "ledger.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            raw = self._verified_bytes()  # refuses to append to a broken chain
            for existing in self._parsed(raw):
                if existing.get("event_id") == event_id:
                    return existing
            committed = raw[:raw.rfind(b"\n") + 1]  # a torn last line (a crash mid-write) is not part of the chain
            event = {"event_id": event_id, "at": time.time(), **body, CHAIN_FIELD: sha256_bytes(committed)}
            line = json.dumps(event, sort_keys=True, ensure_ascii=False, default=str) + "\n"
            fd = os.open(self.events_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                if committed != raw:
                    os.ftruncate(fd, len(committed))
                os.write(fd, line.encode("utf-8"))
                os.fsync(fd)
            finally:
                os.close(fd)
        finally:
            os.close(lock)
        return event

    # -- the chain (issue 34: tamper evidence) ------------------------------------------------
    def _verified_bytes(self) -> bytes:
        """The ledger file's bytes, after :func:`chain_break` found no broken link.

        Raises:
            LedgerChainError: the first broken link, named (the same message for every reader).
        """
        raw = self.events_path.read_bytes() if self.events_path.exists() else b""
        broken = chain_break(raw, self.events_path)
        if broken:
            raise LedgerChainError(broken)
        return raw

    def verify(self) -> dict[str, Any]:
        """The chain's head when every link holds: ``{"events", "chained", "head"}``.

        ``head`` is the sha256 of the whole file (what :func:`anchor_head` records in MLflow).

        Raises:
            LedgerChainError: the first broken link (:func:`chain_break`).
        """
        raw = self._verified_bytes()
        events = self._parsed(raw)
        return {"events": len(events), "chained": sum(1 for e in events if CHAIN_FIELD in e),
                "head": sha256_bytes(raw)}

    @staticmethod
    def _parsed(raw: bytes) -> list[dict[str, Any]]:
        out = []
        for line in raw.decode("utf-8", errors="replace").splitlines():
            if not line.strip():
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a torn last line from a crash mid-write is not an event
        return out

    def events(self, kind: str | None = None) -> Iterator[dict[str, Any]]:
        """The ledger's events, oldest first (of ``kind``), once its chain is verified.

        Raises:
            LedgerChainError: a broken link (:func:`chain_break`): an edited, removed or inserted line.
        """
        if not self.events_path.exists():
            return
        for event in self._parsed(self._verified_bytes()):
            if event.get("kind") in LEGACY_EVENT_KINDS:
                event["kind"] = LEGACY_EVENT_KINDS[event["kind"]]
            if kind is None or event.get("kind") == kind:
                yield event
