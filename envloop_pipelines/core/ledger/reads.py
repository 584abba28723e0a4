"""What the ledger lets the loop read of the labels it keeps back: the holdout and ``test`` (rule 4).

The holdout is read once per release, only for the release being published now: the read is a write-once
marker and a ``holdout_read`` event (:meth:`HeldOutReads.read_holdout_once`). Every read of ``test`` is a
``test_read`` event naming its reader; a round or the loop's setup reads test only within its budget of
distinct predictions files (:func:`reader_budget`, :meth:`HeldOutReads.reading_test`), and predictions read
outside their round never become its candidate (:meth:`HeldOutReads.require_unread_candidate`).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Mapping

from envloop_pipelines.core.ledger.event_log import (
    EVENT_CHECKPOINT_TRAINED,
    EVENT_GATE_AMENDED,
    EVENT_HOLDOUT_READ,
    EVENT_HOLDOUT_SLOT,
    EVENT_HYPOTHESIS_REGISTERED,
    EVENT_ROUND_DECIDED,
    EVENT_TEST_READ,
    LedgerError,
)
from envloop_pipelines.core.storage import atomic_write_bytes, canonical_json, sha256_file


class HoldoutAlreadyReadError(LedgerError):
    """A second holdout read for the same release."""


class HoldoutSlotError(LedgerError):
    """A holdout read for a release other than the one being published now (the next release number)."""


class TestReadBudgetError(LedgerError, PermissionError):
    """A loop reader's read of ``test`` beyond its budget of distinct predictions files (rule 4).

    Raised before any label is read; nothing is appended to the ledger.
    """

    __test__ = False  # an exception, not a pytest test class


#: Who reads ``test`` when no loop step does: a person's CLI, SDK or environment call (logged, not limited).
ADHOC_READER = "adhoc"
#: What a round reads of ``test`` (``candidate.reevaluate``): its candidate, its champion (the candidate's
#: paired baseline) and the TF-IDF baseline, three distinct predictions files; one more per gate amendment of
#: the round (its candidate is trained again on the amendment's fresh seeds, rule 3, and read again).
ROUND_TEST_READ_BUDGET = 3
#: What each kind of loop reader reads of ``test``, for the refusal's message.
_READER_READS = {"round": "its candidate, its champion and the TF-IDF baseline",
                 "setup": "its null arms, its continuation arms and the TF-IDF baseline of release 1",
                 "floor": "its lineage arms (the champion's making repeated with fresh seeds)"}


def reader_budget(reader: Any, budget: Any = None) -> int | None:
    """How many distinct predictions files ``reader`` may score on ``test``; ``None`` when not limited.

    ``adhoc`` (a person's call): not limited, each read logged. ``round:<round key>``:
    :data:`ROUND_TEST_READ_BUDGET`, fixed (``budget`` may not change it; :meth:`Ledger.reading_test` adds one
    per gate amendment of the round, whose fresh-seed candidate is a new file). ``setup:<noise floor key>``: the
    ``budget`` the loop's setup counts (``setup.setup_reader``: its null arms, continuation arms
    and TF-IDF baseline). ``floor:<lineage floor key>``: the ``budget`` of a champion's lineage floor (its
    lineage arms, ``champion_noise_floor``).

    Raises:
        ValueError: an unknown reader, or a budget that is missing, not a positive integer or not the round's.
    """
    if reader == ADHOC_READER:
        if budget is not None:
            raise ValueError(f"read_budget: an {ADHOC_READER} read is not limited; got a budget of {budget!r}")
        return None
    kind, _, name = reader.partition(":") if isinstance(reader, str) else ("", "", "")
    if kind not in _READER_READS or not name:
        raise ValueError(f"reader: must be {ADHOC_READER!r}, 'round:<round key>', 'setup:<noise floor key>' or "
                         f"'floor:<lineage floor key>', "
                         f"got {reader!r}")
    if kind == "round":
        if budget is not None and budget != ROUND_TEST_READ_BUDGET:
            raise ValueError(f"read_budget: a round reads test for at most {ROUND_TEST_READ_BUDGET} predictions files "
                             f"({_READER_READS['round']}); its budget is not settable (got {budget!r})")
        return ROUND_TEST_READ_BUDGET
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"read_budget: the {kind} reader {reader!r} needs its budget, a positive integer "
                         f"({_READER_READS[kind]}), got {budget!r}")
    return budget


def _answers_as_baseline(read: Mapping[str, Any] | None) -> bool:
    """Whether a round's paired ``test_read`` scored predictions identical to its baseline's (same sha256)."""
    return read is not None and read["predictions_sha256"] == read.get("baseline_sha256")


class HeldOutReads:
    """The ledger's holdout slot and test-read budget, mixed into :class:`~envloop_pipelines.core.ledger.ledger.Ledger`.

    The ledger supplies its event log (:class:`~envloop_pipelines.core.ledger.event_log.EventLog`: ``task``,
    ``root``, ``events_path``, ``events``, ``append``), its releases (``release_dir``,
    ``next_release_number``) and its hypotheses' events (``_registered_event``).
    """

    def holdout_slot(self, release: int) -> dict[str, Any] | None:
        """The release's open holdout slot (the latest one the release step opened,
        :func:`open_holdout_slot`), or None."""
        slots = [e for e in self.events(EVENT_HOLDOUT_SLOT) if e.get("release") == release]
        return slots[-1] if slots else None

    def require_publishable(self, release: Any) -> None:
        """Refuse a release that is published or is not the one being published now (the holdout's only slot).

        Raises:
            HoldoutAlreadyReadError: the release is published (it read its holdout).
            HoldoutSlotError: not an integer, or not :meth:`next_release_number`.
        """
        if isinstance(release, bool) or not isinstance(release, int):
            raise HoldoutSlotError(f"release: must be an integer release number, got {release!r}")
        d = self.release_dir(release)
        if (d / "card.json").exists():
            if (d / "holdout.json").exists():
                raise HoldoutAlreadyReadError(
                    f"release {release} already read the holdout ({d / 'holdout.json'}); each release reads it once")
            raise HoldoutAlreadyReadError(
                f"release {release} is published ({d / 'card.json'}); a release reads the holdout only when it is "
                f"published, once")
        expected = self.next_release_number()
        if release != expected:
            raise HoldoutSlotError(
                f"release {release}: the holdout is read only for the release being published now, release "
                f"{expected} of task {self.task!r} (the release step reads it when it publishes)")

    def read_holdout_once(self, release: int, read: Any, *, key: str | None = None) -> Any:
        """Call ``read()`` for the release's one holdout read and record it.

        The slot opens only for the release being published now (:meth:`next_release_number`), so no
        read is taken for a release that is published (it read its holdout) or further ahead (which
        would block the real publish). ``key`` names what is read (the verifier passes the sha256 of
        the predictions it scores): when a read for this release is already stored under the same key
        and its card is not written yet (the process died between the read and the card), the stored
        result is returned and nothing is read again; a read under another key is refused. Two
        processes never read at once (an exclusive lock, released by the OS if its holder dies).

        Raises:
            HoldoutAlreadyReadError: the release already consumed its holdout (its card is written, or
                its read is stored under another key, or another process holds the slot now).
            HoldoutSlotError: ``release`` is not the release being published now.
        """
        import fcntl

        self.require_publishable(release)
        d = self.release_dir(release)
        marker = d / "holdout.json"
        self.require_read_marker(release, marker)
        d.mkdir(parents=True, exist_ok=True)
        fd = os.open(d / "holdout.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise HoldoutAlreadyReadError(
                    f"release {release}: another process is reading the holdout now; each release reads it once"
                ) from None
            if marker.exists():
                stored = json.loads(marker.read_text(encoding="utf-8"))
                if key is None or stored.get("key") != key:
                    raise HoldoutAlreadyReadError(
                        f"release {release} already read the holdout ({marker}) for other predictions; each "
                        f"release reads it once")
                result = stored["result"]  # the same read, stored before a crash: finish from it
            else:
                result = read()  # raises: nothing stored, the holdout is not consumed
                atomic_write_bytes(marker, canonical_json({"release": release, "at": time.time(), "key": key,
                                                           "result": result}))
                marker.chmod(0o444)
        finally:
            os.close(fd)  # releases the lock
        self._append(EVENT_HOLDOUT_READ, {"release": release, "read_key": key}, key=f"holdout:{release}")
        return result

    def require_read_marker(self, release: int, marker: Path) -> None:
        """Refuse a read of a release whose ``holdout_read`` event exists but whose stored read is gone.

        The ledger's events are the record of the read, not the file beside them: deleting
        ``holdout.json`` does not give a release its holdout read back.

        Raises:
            HoldoutAlreadyReadError: naming the event and the missing file.
        """
        event = next((e for e in self.events(EVENT_HOLDOUT_READ) if e.get("release") == release), None)
        if event is not None and not marker.exists():
            raise HoldoutAlreadyReadError(
                f"release {release} already read the holdout (the {EVENT_HOLDOUT_READ} event {event.get('event_id')} "
                f"in {self.events_path}), and its stored read {marker} is gone; the ledger's event is the record: "
                f"each release reads the holdout once")

    def holdout_result(self, release: int) -> Any:
        """The stored result of the release's one holdout read, or None."""
        marker = self.release_dir(release) / "holdout.json"
        return json.loads(marker.read_text())["result"] if marker.exists() else None

    # -- test reads --------------------------------------------------------------------------
    def test_files_read(self, reader: str) -> dict[str, str | None]:
        """The distinct predictions files ``reader`` has scored on ``test``: sha256 → the path it was read from.

        Both files of a paired read count (the predictions and their baseline). Reads recorded before
        readers were named are ``adhoc``'s.
        """
        seen: dict[str, str | None] = {}
        for event in self.events(EVENT_TEST_READ):
            if event.get("reader", ADHOC_READER) != reader:
                continue
            for sha, path in ((event.get("predictions_sha256"), event.get("predictions")),
                              (event.get("baseline_sha256"), event.get("baseline"))):
                if sha and sha not in seen:
                    seen[sha] = path
        return seen

    @contextmanager
    def reading_test(self, reader: str, predictions_sha256: str, baseline_sha256: str | None = None, *,
                     budget: int | None = None, predictions: str | None = None,
                     baseline: str | None = None) -> Iterator[Callable[..., dict[str, Any]]]:
        """Hold ``reader``'s budget of ``test`` reads around one read (rule 4): refuse it first, or record it after.

        A read is within the budget when the distinct predictions files ``reader`` has scored on test
        (:meth:`test_files_read`), with this read's predictions and baseline added, number at most
        ``budget`` (``None``: not limited, an ``adhoc`` read; :func:`reader_budget`), plus, for a round, one
        per ``gate_amended`` event of the round (the candidate it trains again on fresh seeds). Beyond it
        :class:`TestReadBudgetError` is raised before the body runs (before any label is read) and
        nothing is appended. Within it the body reads and calls the yielded ``record(status, **fields)``,
        which appends the ``test_read`` event keyed by reader, predictions sha256 and baseline sha256: a
        retry of the same read is not a new event and never counts twice (a failed read's event also
        carries its status, so the retry that succeeds is recorded beside it). Two processes of one
        limited reader never check and read at once (an exclusive lock, released by the OS if its holder
        dies).

        Raises:
            TestReadBudgetError: the read would exceed ``reader``'s budget; names the reader, the budget and
                what it has read.
        """
        import fcntl

        fd = None
        if budget is not None:
            fd = os.open(self.root / "test_reads.lock", os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            kind, _, name = reader.partition(":")
            if kind == "round":
                self._require_round_reader(reader, name)
            amended = 0 if kind != "round" else sum(1 for e in self.events(EVENT_GATE_AMENDED) if e.get("round") == name)
            if budget is not None:
                budget += amended
            read = self.test_files_read(reader)
            wanted = {predictions_sha256: predictions, **({baseline_sha256: baseline} if baseline_sha256 else {})}
            new = {sha: path for sha, path in wanted.items() if sha not in read}
            if budget is not None and len(read) + len(new) > budget:
                why = _READER_READS.get(kind, "its own") + (
                    f", and a fresh-seed candidate for each of its {amended} gate amendments" if amended else "")
                listed = "; ".join(f"{path or '?'} ({sha[:12]})" for sha, path in read.items()) or "nothing"
                adding = "; ".join(f"{path or '?'} ({sha[:12]})" for sha, path in new.items())
                raise TestReadBudgetError(
                    f"reader {reader!r}: test read refused before any label is read: its budget is {budget} distinct "
                    f"predictions files on test ({why}) and it has read {len(read)}: "
                    f"{listed}; this read would add {len(new)}: {adding}")

            def record(status: str, **fields: Any) -> dict[str, Any]:
                key = f"test_read:{reader}:{predictions_sha256}:{baseline_sha256 or '-'}"
                return self.append(EVENT_TEST_READ, {
                    "split": "test", "reader": reader, "status": status, "predictions_sha256": predictions_sha256,
                    "baseline_sha256": baseline_sha256, "predictions": predictions, "baseline": baseline, **fields},
                    key=key if status == "ok" else f"{key}:{status}")

            yield record
        finally:
            if fd is not None:
                os.close(fd)  # releases the lock

    def _require_round_reader(self, reader: str, round_key: str) -> None:
        """Refuse a ``round:<key>`` read that is not the round's own re-evaluation (issue 34).

        A round's budget is spent only by its own run: after its hypothesis is registered and its candidate
        trained (a ``lora_checkpoint_trained`` event of the round), before it is decided. A caller naming a
        future round (or a decided one) as its reader is refused before any label is read, so a person's read
        never spends a round's budget (theirs is ``adhoc``: logged, not limited).

        Raises:
            TestReadBudgetError: naming the reader and the event the round lacks (or its decision).
        """
        if self._registered_event(round_key) is None:
            lacking = f"no {EVENT_HYPOTHESIS_REGISTERED} event"
        elif not any(e.get("round") == round_key for e in self.events(EVENT_CHECKPOINT_TRAINED)):
            lacking = f"no {EVENT_CHECKPOINT_TRAINED} event (its candidate is not trained)"
        elif any(e.get("round") == round_key for e in self.events(EVENT_ROUND_DECIDED)):
            lacking = f"a {EVENT_ROUND_DECIDED} event (it is decided)"
        else:
            return
        raise TestReadBudgetError(
            f"reader {reader!r}: test read refused before any label is read: a round's reads come from its own "
            f"re-evaluation (independent_reeval), after its candidate is trained and before its decision, and round "
            f"{round_key} has {lacking} in {self.events_path}; a person's read is {ADHOC_READER!r} (logged, not "
            f"limited, and what it reads can no longer become a round's candidate)")

    def round_candidate_read(self, round_key: str) -> dict[str, Any] | None:
        """The round's own paired read of its candidate on test (its latest ``test_read`` event with a baseline)."""
        own = f"round:{round_key}"
        mine = [e for e in self.events(EVENT_TEST_READ) if e.get("reader") == own and e.get("baseline_sha256")
                and e.get("status", "ok") == "ok"]
        return mine[-1] if mine else None

    def candidate_answers_as_champion(self, round_key: str) -> bool:
        """Whether the round's candidate predicted every test question exactly as its champion (same sha256).

        Such a candidate changed nothing the test sees (a training step at a zero learning rate, a lever that
        moved no weight): it cannot be promoted, and rejecting it selects nothing, so the predictions the
        setup or another round read before (the champion's) do not make it ineligible.
        """
        return _answers_as_baseline(self.round_candidate_read(round_key))

    def require_unread_candidate(self, round_key: str) -> None:
        """Refuse a round's candidate whose test predictions anyone else read on test (issue 34: no redraw on test).

        The candidate's predictions are the ones the round's own paired read scored (``round:<key>``, with its
        champion as the baseline; the latest, after an amendment). A ``test_read`` event of another reader
        (a person's ``adhoc`` read, another round, the setup) of the same sha256 means someone saw this
        candidate's test score outside the round: it may have been picked for it (best-of-k on test), so it
        cannot be the round's candidate. Person reads stay possible; they make what they read ineligible.

        Raises:
            LedgerError: naming the earlier read (its event id, reader, file and time).
        """
        own = f"round:{round_key}"
        read = self.round_candidate_read(round_key)
        if read is None or _answers_as_baseline(read):
            return  # the champion's own predictions: the gate can only reject them (decide_round says so)
        candidate = read["predictions_sha256"]
        for event in self.events(EVENT_TEST_READ):
            if event.get("reader", ADHOC_READER) == own:
                continue
            if candidate in (event.get("predictions_sha256"), event.get("baseline_sha256")):
                at = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(float(event.get("at") or 0)))
                raise LedgerError(
                    f"round {round_key}: no decision: the candidate's test predictions (sha256 {candidate[:12]}) were "
                    f"read on test before, by {event.get('reader', ADHOC_READER)!r} (test_read event "
                    f"{event.get('event_id')}, {event.get('predictions') or event.get('baseline')}, {at} UTC); "
                    f"predictions seen on test outside their round cannot become its candidate")


def holdout_read_key(predictions: str | Path, baseline: str | Path | None = None) -> str:
    """What a holdout read scores: the predictions' sha256 and the baseline's (the slot's key; a retry of the same read)."""
    return f"{sha256_file(predictions)}:{'-' if baseline is None else sha256_file(baseline)}"


def open_holdout_slot(ledger: Any, release: int, key: str, *, by: str) -> dict[str, Any]:
    """Open the release's holdout slot for one read: the predictions (and baseline) that ``key`` names.

    Only the release step opens a slot (``core/release/publish.py``'s ``holdout_metrics``, right before its
    read): the ledger has no method that opens one (``Ledger.append`` refuses its event kind), so a person's
    read of a release's holdout finds no slot for its predictions and is refused before any label is read
    (issue 34: an early opener's own read wedged the round). Opening again before the read replaces the slot
    (the latest open is the slot). The slot, its key and the read it admits (:meth:`HeldOutReads.read_holdout_once`)
    are this module's.

    Raises:
        HoldoutAlreadyReadError / HoldoutSlotError: a published release, a release whose read the ledger
            records (its stored read deleted or not), or not the release being published now.
    """
    ledger.require_publishable(release)
    ledger.require_read_marker(release, ledger.release_dir(release) / "holdout.json")
    return ledger._append(EVENT_HOLDOUT_SLOT, {"release": release, "read_key": key, "by": by},
                          key=f"holdout_slot:{release}:{uuid.uuid4().hex}")

