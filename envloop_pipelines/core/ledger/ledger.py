"""The ledger: hypotheses, arms, rejected candidates, releases, all kept.

Rules enforced here (``docs/loop-rules.md``), on the event log (``event_log.py``):

1. A hypothesis is written before training, hashed and immutable: the file is
   write-once, a second registration with other content is refused.
2. A gate, registered or amended, is in every field only stricter than the default: the metric's
   own direction, the measured noise floor, a paired CI above zero, guards at most their defaults
   (``hypothesis.py``: :func:`gate_value_errors`, :meth:`Gate.require_not_loose`).
3. A gate moves only as a recorded amendment (:meth:`Ledger.amend_gate`, a reason, a ``gate_amended``
   event with the file's sha256), shown beside the original, passed on fresh seeds; every read of a
   hypothesis or an amendment is checked against its ledger event.
4. The holdout is read once per release: the read is a write-once marker. Every read of ``test`` is a
   ``test_read`` event naming its reader; a round or the loop's setup reads test only within its budget
   of distinct predictions files (``reads.py``, whose :class:`HeldOutReads` gives the ledger
   :meth:`Ledger.read_holdout_once` and :meth:`Ledger.reading_test`).
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
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Mapping

from envloop_pipelines.core.ledger.event_log import (
    EVENT_CHECKPOINT_TRAINED,
    EVENT_ERRATUM,
    EVENT_GATE_AMENDED,
    EVENT_HOLDOUT_READ,
    EVENT_HYPOTHESIS_REGISTERED,
    EVENT_RELEASE_PROMOTED,
    EVENT_ROUND_DECIDED,
    EventLog,
    LedgerChainError,
    LedgerError,
)
from envloop_pipelines.core.ledger.hypothesis import (
    Gate,
    GateTooLooseError,
    Hypothesis,
    HypothesisImmutableError,
    HypothesisRefusedError,
    draw_seeds,
    gate_errors,
    hypothesis_errors,
    power_errors,
    seed_count_errors,
)
from envloop_pipelines.core.ledger.reads import HeldOutReads
from envloop_pipelines.core.storage import atomic_write_bytes, canonical_json, sha256_bytes


class ReleaseCardExistsError(LedgerError):
    """A release card would be rewritten."""


def _amendment_matches(event: Mapping[str, Any], name: str, payload: bytes, body: Mapping[str, Any]) -> bool:
    """Whether a ``gate_amended`` event records this amendment file: its name and sha256 (events written before
    the sha256 was recorded: the same content)."""
    if "sha256" in event:
        return event.get("file") == name and event["sha256"] == sha256_bytes(payload)
    return all(event.get(k) == v for k, v in body.items())


def _write_once(path: Path, payload: bytes) -> bool:
    """Create ``path`` with ``payload`` unless it exists. True when written, False when it
    already held exactly this payload; raise when it holds something else."""
    if path.exists():
        if path.read_bytes() == payload:
            return False
        raise FileExistsError(str(path))
    atomic_write_bytes(path, payload)
    return True


class Ledger(HeldOutReads, EventLog):
    """The append-only record of one task's loop."""

    # -- hypotheses --------------------------------------------------------------------------
    def hypothesis_path(self, round_key: str) -> Path:
        return self.root / "hypotheses" / f"{round_key}.json"

    def register_hypothesis(self, hypothesis: Hypothesis) -> str:
        """Write the hypothesis once; re-registering the same content is a no-op.

        The hypothesis is checked first (:func:`hypothesis_errors`: its change, predicted delta, seeds and
        a gate no looser than the default; :func:`power_errors`: a minimum detectable effect, ``power.mde``),
        so nothing is written for one that is refused. A hypothesis registered before the MDE was required
        is still read, and re-registering it unchanged is still a no-op.

        Raises:
            HypothesisImmutableError: the round already has a different hypothesis.
            GateTooLooseError: its gate is looser than the default in any field (rule 2).
            HypothesisRefusedError: another field is invalid, or it has no MDE (``power.mde``), each named.
        """
        path = self.hypothesis_path(hypothesis.round)
        if path.exists():
            existing = Hypothesis.from_dict(json.loads(path.read_text(encoding="utf-8")))
            if existing.hash != hypothesis.hash:
                raise HypothesisImmutableError(
                    f"round {hypothesis.round} already registered hypothesis {existing.hash[:12]}; "
                    f"a registered hypothesis is immutable (record an amendment instead)"
                )
            if self._registered_event(hypothesis.round) is None:  # a crash between the file and its event
                self._append_registered(hypothesis)
            return existing.hash
        errors = hypothesis_errors(change=hypothesis.change, predicted_delta=hypothesis.predicted_delta,
                                   seeds=list(hypothesis.seeds), gate=hypothesis.gate,
                                   require_kind=False)  # for every caller
        errors += power_errors(hypothesis.power)
        if errors:
            what = f"round {hypothesis.round}: hypothesis refused: " + "; ".join(errors)
            raise (GateTooLooseError if any(e.startswith("gate") for e in errors) else HypothesisRefusedError)(what)
        body = {**hypothesis.to_dict(), "hash": hypothesis.hash}
        atomic_write_bytes(path, (json.dumps(body, sort_keys=True, indent=2, ensure_ascii=False) + "\n").encode())
        self._append_registered(hypothesis)
        return hypothesis.hash

    def _append_registered(self, hypothesis: Hypothesis) -> None:
        power = hypothesis.power or {}
        self.append(EVENT_HYPOTHESIS_REGISTERED, {"round": hypothesis.round, "hash": hypothesis.hash,
                                                  "predicted_delta": hypothesis.predicted_delta,
                                                  "mde": power.get("mde"), "underpowered": hypothesis.underpowered,
                                                  "change": dict(hypothesis.change),
                                                  # the design the gate decides at (core.loop.operating_point)
                                                  "benchmark_version": hypothesis.benchmark_version,
                                                  "recipe_hash": hypothesis.recipe_hash,
                                                  "gate": dict(hypothesis.gate.__dict__)},
                    key=f"hypothesis:{hypothesis.round}")

    def _registered_event(self, round_key: str) -> dict[str, Any] | None:
        return next((e for e in self.events(EVENT_HYPOTHESIS_REGISTERED) if e.get("round") == round_key), None)

    def hypothesis(self, round_key: str) -> Hypothesis | None:
        """The round's registered hypothesis, or ``None``; every read checks it against its ledger event.

        Raises:
            HypothesisImmutableError: the file's content does not hash to the hash its ``hypothesis_registered``
                event recorded (an edited file, even with its ``hash`` field recomputed), or it has no event.
        """
        path = self.hypothesis_path(round_key)
        if not path.exists():
            return None
        raw = json.loads(path.read_text(encoding="utf-8"))
        hyp = Hypothesis.from_dict(raw)
        if hyp.hash != raw.get("hash"):
            raise HypothesisImmutableError(f"{path}: content no longer matches its registered hash")
        event = self._registered_event(round_key)
        if event is None:
            raise HypothesisImmutableError(f"{path}: no {EVENT_HYPOTHESIS_REGISTERED} event for round {round_key} in "
                                           f"{self.events_path}; a hypothesis is registered only through "
                                           f"Ledger.register_hypothesis")
        if event.get("hash") != hyp.hash:
            raise HypothesisImmutableError(f"{path}: content hash {hyp.hash[:12]} is not the one registered in the "
                                           f"ledger ({str(event.get('hash'))[:12]}); the file was changed after "
                                           f"registration")
        return hyp

    def require_hypothesis(self, round_key: str) -> Hypothesis:
        hyp = self.hypothesis(round_key)
        if hyp is None:
            raise LedgerError(
                f"round {round_key} has no registered hypothesis; training refuses to start without one "
                f"(materialize registered_hypothesis first)"
            )
        return hyp

    def amend_gate(self, round_key: str, new_gate: Gate, reason: str, *, seeds: int = 1) -> dict[str, Any]:
        """Record a gate amendment (shown beside the original on the card), with the fresh seeds it requires.

        The candidate must then pass on seeds not used before the amendment (rule 3): ``seeds`` says how
        many, and the ledger draws them (:func:`draw_seeds`), none of the hypothesis's, an earlier
        amendment's or a trained checkpoint's of this round; training then uses them (:meth:`candidate_seeds`)
        and the decision refuses a candidate trained on another (:meth:`require_fresh_seed`). An amendment
        identical to the gate in force is refused (each one grants a fresh seed and one more test read: a
        recorded redraw with nothing amended). The file and a ``gate_amended`` event carrying its sha256 are
        written; an amendment file without its event is refused on every read (:meth:`amendments`).

        Raises:
            LedgerError: no reason, seed values instead of a count, or a gate identical to the one in force.
            GateTooLooseError: the amended gate is looser than the default in any field (rule 2).
        """
        if not isinstance(reason, str) or not reason.strip():
            raise LedgerError("reason: a gate amendment needs a reason")
        errors = gate_errors(new_gate) + seed_count_errors(seeds)
        if errors:
            raise (GateTooLooseError if errors[0].startswith("gate") else LedgerError)(
                f"round {round_key}: gate amendment refused: " + "; ".join(errors))
        original = self.require_hypothesis(round_key)
        existing = self.amendments(round_key)  # refuses a tampered folder before anything is added
        in_force = self.effective_gate(round_key)
        if asdict(in_force) == asdict(new_gate):
            where = f"amendment {len(existing)}" if existing else "the registered hypothesis"
            raise LedgerError(f"round {round_key}: gate amendment refused: gate: identical to the gate in force "
                              f"({where}); an amendment changes the gate (a copy would only draw a fresh seed and "
                              f"one more test read)")
        used = sorted(self.used_seeds(round_key))
        fresh = list(draw_seeds(seeds, used))
        n = len(existing) + 1
        name = f"{round_key}-{n}.json"
        body = {"round": round_key, "original_gate": asdict(original.gate), "amended_gate": asdict(new_gate),
                "reason": reason, "hypothesis_hash": original.hash, "requires_fresh_seeds": True,
                "seeds": fresh, "used_seeds": used}
        payload = canonical_json(body)
        atomic_write_bytes(self.root / "amendments" / name, payload)
        self.append(EVENT_GATE_AMENDED, {**body, "amendment": n, "file": name, "sha256": sha256_bytes(payload)})
        return body

    def used_seeds(self, round_key: str) -> set[int]:
        """Every seed of this round so far: the hypothesis's, its amendments', its trained checkpoints'."""
        used = set(self.require_hypothesis(round_key).seeds)
        for amendment in self.amendments(round_key):
            used.update(amendment.get("seeds") or ())
        for event in self.events(EVENT_CHECKPOINT_TRAINED):
            if event.get("round") == round_key and isinstance(event.get("seed"), int):
                used.add(event["seed"])
        return used

    def candidate_seeds(self, round_key: str) -> tuple[int, ...]:
        """The seeds the round's candidate trains on: the latest amendment's fresh seeds, else the hypothesis's."""
        for amendment in reversed(self.amendments(round_key)):
            if amendment.get("seeds"):
                return tuple(amendment["seeds"])
        return self.require_hypothesis(round_key).seeds

    def require_fresh_seed(self, round_key: str, seed: Any) -> None:
        """Refuse a candidate trained on a seed used before the round's latest amendment (rule 3).

        Raises:
            LedgerError: naming the seed, the amendment and the seeds it requires.
        """
        amendments = self.amendments(round_key)
        if not amendments:
            return
        latest = amendments[-1]
        allowed = latest.get("seeds")
        stale = (seed not in allowed) if allowed else (seed in self.require_hypothesis(round_key).seeds)
        if stale:
            wanted = allowed if allowed else "other than the hypothesis's"
            raise LedgerError(f"round {round_key}: seed: the candidate was trained on seed {seed!r}, not on the fresh "
                              f"seeds ({wanted}) its gate amendment {len(amendments)} requires (reason: "
                              f"{latest.get('reason')!r}); train the candidate again (it uses Ledger.candidate_seeds)")

    def amendments(self, round_key: str) -> list[dict[str, Any]]:
        """The round's gate amendments in numeric order (``-10`` after ``-9``), each checked against its event.

        Raises:
            LedgerError: a file in ``amendments/`` with no ``gate_amended`` event of the same content (one
                dropped in or edited by hand), or an event whose file is gone; amendments are made only
                through :meth:`amend_gate`.
        """
        folder = self.root / "amendments"
        numbered = []
        for path in folder.glob(f"{round_key}-*.json"):
            suffix = path.stem[len(round_key) + 1:]
            if not suffix.isdigit():
                raise LedgerError(f"{path}: not an amendment of round {round_key} written by Ledger.amend_gate "
                                  f"(expected {round_key}-<n>.json); remove it")
            numbered.append((int(suffix), path))
        numbered.sort()
        events = [e for e in self.events(EVENT_GATE_AMENDED) if e.get("round") == round_key]
        out = []
        for n, path in numbered:
            payload = path.read_bytes()
            body = json.loads(payload)
            if not any(_amendment_matches(e, path.name, payload, body) for e in events):
                raise LedgerError(f"{path}: no {EVENT_GATE_AMENDED} event in {self.events_path} records this "
                                  f"amendment's content; it was not made through Ledger.amend_gate (with a reason "
                                  f"and an event) and is refused")
            out.append(body)
        if len(events) > len(out):
            raise LedgerError(f"round {round_key}: {len(events)} {EVENT_GATE_AMENDED} events but {len(out)} "
                              f"amendment files in {folder}; an amendment file was removed")
        return out

    def effective_gate(self, round_key: str) -> Gate:
        """The latest amendment's gate, else the registered one (as written; the decision applies rule 2's floor)."""
        amendments = self.amendments(round_key)
        if amendments:
            return Gate(**amendments[-1]["amended_gate"])
        return self.require_hypothesis(round_key).gate

    def round_decision(self, round_key: str) -> dict[str, Any] | None:
        """The decision record the round's ``round_decided`` event carries (its ``decision``), or ``None``.

        A decided round's decision lives here, so a retry of its decision step returns it without deciding
        (or publishing) again. ``None`` when the round is undecided, or was decided before the event carried
        its record (the reader then falls back to the record stored beside the round's steps).
        """
        event = next((e for e in self.events(EVENT_ROUND_DECIDED) if e.get("round") == round_key), None)
        return None if event is None else event.get("decision")

    # -- releases ----------------------------------------------------------------------------
    def release_dir(self, release: int) -> Path:
        return self.root / "releases" / f"{release:04d}"

    def releases(self) -> list[dict[str, Any]]:
        """Every release card, oldest first, with its errata; each bound to the ledger (issue 34).

        A card is a release only with its ``release_promoted`` event, whose ``card_sha256`` (events written
        before the digest was recorded: its release number) it must match; a card whose event is not written
        yet is read only as the last card of a release that read its holdout (a crash between the card and
        its event, which the release step's retry writes).

        Raises:
            LedgerChainError: the chain is broken, or a card was dropped in or edited (the file named).
        """
        promoted = {e.get("release"): e for e in self.events(EVENT_RELEASE_PROMOTED)}
        read = {e.get("release") for e in self.events(EVENT_HOLDOUT_READ)}
        cards = sorted((self.root / "releases").glob("*/card.json"))
        out = []
        for i, card in enumerate(cards):
            payload = card.read_bytes()
            body = json.loads(payload)
            event = promoted.get(body.get("release"))
            if event is None and not (i == len(cards) - 1 and body.get("release") in read):
                raise LedgerChainError(f"release card {card}: no {EVENT_RELEASE_PROMOTED} event in {self.events_path} "
                                       f"and no holdout read of its release: it was not published by the release "
                                       f"step (a card dropped in by hand) and is refused")
            if event is not None and event.get("card_sha256") not in (None, sha256_bytes(payload)):
                raise LedgerChainError(f"release card {card}: its sha256 {sha256_bytes(payload)[:16]} is not the one "
                                       f"its {EVENT_RELEASE_PROMOTED} event recorded ({event['card_sha256'][:16]}): "
                                       f"the card was edited")
            body["errata"] = [json.loads(p.read_text()) for p in sorted((card.parent / "errata").glob("*.json"))]
            out.append(body)
        return out

    def release_of_round(self, round_key: str) -> dict[str, Any] | None:
        """The card of the release ``round_key`` published (without its errata), or ``None``.

        A round publishes at most one release; a retry of its decision after a crash between the card and
        ``round_decided`` finds it here instead of publishing the checkpoint again as the next release.
        """
        for card in self.releases():
            if card.get("round") == round_key:
                card.pop("errata", None)
                return card
        return None

    def next_release_number(self) -> int:
        return len(self.releases()) + 1  # only cards bound to the ledger count

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
        self.record_release_promoted(release, card)
        return d

    def record_release_promoted(self, release: int, card: Mapping[str, Any]) -> dict[str, Any]:
        """The ``release_promoted`` event of a written card, once, with the card file's sha256 (a retry after a
        crash between the card and its event writes it; a second call returns the first)."""
        path = self.release_dir(release) / "card.json"
        digest = sha256_bytes(path.read_bytes()) if path.exists() else None
        return self.append(EVENT_RELEASE_PROMOTED, {"release": release, "round": card.get("round"),
                                                    "checkpoint_sha256": card.get("checkpoint_sha256"),
                                                    "card_sha256": digest},
                           key=f"release:{release}")

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
