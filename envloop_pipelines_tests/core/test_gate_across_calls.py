"""Issue 34, "the gate's promise across calls": no redraw on test, no split run, no silent edit.

Each test is one door the issue's audit walked through on ebf721d, refused here with the field or file named and
nothing written. The holdout's doors use the real verifier on an imported task (``test_verifier_doors``'s helpers).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest

from envloop_pipelines.core.ledger.ledger import (
    EVENT_HOLDOUT_READ,
    EVENT_HOLDOUT_SLOT,
    HoldoutAlreadyReadError,
    Gate,
    Ledger,
    LedgerError,
    draw_seeds,
)
from envloop_pipelines.core.ledger.promotion import NoiseFloor, decide_promotion
from envloop_pipelines.core.release.publish import _open_holdout_slot
from envloop_pipelines.core.verify.labels import read_hidden_labels
from envloop_pipelines.core.verify.protocol import write_predictions
from envloop_pipelines.core.verify.runner import HiddenSplitQueryError, holdout_read_key, verify_task

from .test_verifier_doors import LABEL_LOG, TASK, _home, label_reads, oracle


# --------------------------------------------------------------------------- the holdout opens only in the release step

def test_no_public_method_opens_a_releases_holdout_slot(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LABEL_LOG)
    home = _home(tmp_path)
    ledger = Ledger(TASK, home)
    path = write_predictions(tmp_path / "h.jsonl", oracle(read_hidden_labels(TASK, "holdout", home=home)))
    caplog.clear()  # the test's own read of the labels to write its predictions
    assert not hasattr(ledger, "open_holdout_slot")  # ebf721d: public, a person opened the next release's slot
    before = ledger.events_path.read_bytes() if ledger.events_path.exists() else b""
    for kind in (EVENT_HOLDOUT_SLOT, EVENT_HOLDOUT_READ):  # nor through the ledger's public append
        with pytest.raises(LedgerError, match=f"{kind} events are written only by the release step"):
            ledger.append(kind, {"release": 1, "read_key": holdout_read_key(path), "by": "a person"})
    assert (ledger.events_path.read_bytes() if ledger.events_path.exists() else b"") == before
    with pytest.raises(HiddenSplitQueryError, match="no holdout slot is open for these predictions"):
        verify_task(TASK, "holdout", path, home=home, release=1)
    assert label_reads(caplog) == 0 and ledger.holdout_result(1) is None


def test_a_deleted_holdout_json_does_not_give_the_release_its_read_back(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LABEL_LOG)
    home = _home(tmp_path)
    ledger = Ledger(TASK, home)
    labels = read_hidden_labels(TASK, "holdout", home=home)
    path = write_predictions(tmp_path / "h.jsonl", oracle(labels))
    caplog.clear()
    _open_holdout_slot(ledger, 1, holdout_read_key(path), by="release step")
    assert verify_task(TASK, "holdout", path, home=home, holdout_slot=ledger, release=1).ok
    assert label_reads(caplog) == 1
    marker = ledger.release_dir(1) / "holdout.json"
    marker.chmod(0o644)
    marker.unlink()  # the home's owner deletes the stored read (ebf721d: two more reads were accepted)
    rows = oracle(labels)
    rows[0] = {**rows[0], "probs": list(reversed(rows[0]["probs"]))}
    other = write_predictions(tmp_path / "other.jsonl", rows)
    for predictions in (path, other):
        with pytest.raises(HoldoutAlreadyReadError, match=r"release 1 already read the holdout \(the holdout_read "
                                                          r"event .* and its stored read .*holdout.json is gone"):
            _open_holdout_slot(ledger, 1, holdout_read_key(predictions), by="release step")
    with pytest.raises(HoldoutAlreadyReadError, match="stored read .* is gone"):
        ledger.read_holdout_once(1, lambda: {"taken": True}, key=holdout_read_key(path))
    assert label_reads(caplog) == 1 and len(list(ledger.events(EVENT_HOLDOUT_SLOT))) == 1
    assert len(list(ledger.events(EVENT_HOLDOUT_READ))) == 1 and not marker.exists()


# --------------------------------------------------------------------------- no guard skipped by a missing value

def _floor(floor: float = 0.01, values: tuple[float, ...] = (0.60, 0.61), family: float = 0.02) -> NoiseFloor:
    return NoiseFloor(key="k", metric="family_macro_accuracy", values=values, floor=floor,
                      family_floors={"billing": family})


CLEAR = {"delta": 0.20, "ci_low": 0.15, "ci_high": 0.25}
CANDIDATE = {"family_macro_accuracy": 0.80, "ece": 0.02, "acc/billing": 0.8, "fnr/fraud": 0.05}
CHAMPION = {"family_macro_accuracy": 0.60, "acc/billing": 0.6, "fnr/fraud": 0.05}


def test_a_clear_candidate_with_every_value_promotes() -> None:  # the control of the refusals below
    assert decide_promotion(Gate(), CLEAR, _floor(), CANDIDATE, CHAMPION, ("fraud",)).promote


@pytest.mark.parametrize("floor, candidate, champion, paired, field", [
    (_floor(floor=math.nan), CANDIDATE, CHAMPION, None, "noise_floor.floor"),  # ebf721d: a bar of 0
    (_floor(values=(0.6, math.nan)), CANDIDATE, CHAMPION, None, "noise_floor.values"),
    (_floor(family=math.nan), CANDIDATE, CHAMPION, None, "noise_floor.family_floors: billing"),
    (_floor(), {k: v for k, v in CANDIDATE.items() if k != "ece"}, CHAMPION, None, "ece:"),  # guard skipped before
    (_floor(), {**CANDIDATE, "ece": math.nan}, CHAMPION, None, "ece:"),
    (_floor(), {k: v for k, v in CANDIDATE.items() if k != "fnr/fraud"}, CHAMPION, None, "safety guard: fnr/fraud"),
    # a safety family missing from the paired CIs (ebf721d: "no positive of this family", guard skipped)
    (_floor(), {**CANDIDATE, "fnr/fraud": math.nan}, {**CHAMPION, "fnr/fraud": math.nan}, {"safety": {}},
     "safety guard: fnr/fraud"),
])
def test_a_missing_or_nan_value_refuses_the_decision_naming_its_field(floor: NoiseFloor, candidate: dict,
                                                                      champion: dict, paired: dict | None,
                                                                      field: str) -> None:
    decision = decide_promotion(Gate(), CLEAR, floor, candidate, champion, ("fraud",), paired=paired)
    assert not decision.promote
    assert any(r.startswith(field) for r in decision.reasons), decision.reasons


# --------------------------------------------------------------------------- no redraw on test

def test_the_loop_draws_a_rounds_seeds_a_person_says_how_many() -> None:
    from envloop_pipelines.core.decision_loop.before_training import proposal_errors

    # ebf721d: {"seeds": [3004]} registered the one seed of four previewed on test whose CI was above zero.
    assert proposal_errors({"seeds": [3004]}) == [
        "seeds: a round's seeds are drawn by the loop after registration; give a count (how many, e.g. "
        "\"seeds\": 1), not values (got [3004])"]
    assert proposal_errors({"seeds": 3}) == []
    drawn = draw_seeds(3, used={5, 6})
    assert len(set(drawn)) == 3 and not set(drawn) & {5, 6} and all(1 <= s < 2**31 for s in drawn)


def _registered(home: Path, key: str = "r0001") -> Ledger:
    from .test_gate_leftovers_test_reads import trained_round

    trained_round(home, key)
    return Ledger(TASK, home)


def test_an_amendment_identical_to_the_gate_in_force_is_refused(tmp_path: Path) -> None:
    ledger = _registered(tmp_path)
    before = ledger.events_path.read_bytes()
    with pytest.raises(LedgerError, match=r"round r0001: gate amendment refused: gate: identical to the gate in force "
                                          r"\(the registered hypothesis\)"):
        ledger.amend_gate("r0001", Gate(), "once more")  # ebf721d: accepted 5x, each a fresh seed and a test read
    assert ledger.events_path.read_bytes() == before and not (ledger.root / "amendments").exists()
    ledger.amend_gate("r0001", Gate(min_delta=0.02), "a stricter bar")
    with pytest.raises(LedgerError, match=r"identical to the gate in force \(amendment 1\)"):
        ledger.amend_gate("r0001", Gate(min_delta=0.02), "the same again")
    assert len(ledger.amendments("r0001")) == 1


def test_a_persons_read_cannot_spend_a_rounds_budget(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from envloop_pipelines.core.ledger.ledger import TestReadBudgetError

    home = _home(tmp_path)
    path = write_predictions(tmp_path / "t.jsonl", oracle(read_hidden_labels(TASK, "test", home=home)))
    caplog.set_level(logging.INFO, logger=LABEL_LOG)
    caplog.clear()
    ledger = Ledger(TASK, home)
    # ebf721d: reader="round:r0002" spent a future round's budget; that round then failed at independent_reeval.
    with pytest.raises(TestReadBudgetError, match=r"reader 'round:r0002': test read refused before any label is "
                                                  r"read: a round's reads come from its own re-evaluation .* round "
                                                  r"r0002 has no hypothesis_registered event"):
        verify_task(TASK, "test", path, home=home, reader="round:r0002")
    assert label_reads(caplog) == 0 and not ledger.events_path.exists()
    _registered(home, "r0002")
    assert verify_task(TASK, "test", path, home=home, reader="round:r0002").ok  # its own re-evaluation's read


def test_predictions_read_on_test_outside_their_round_cannot_become_its_candidate(tmp_path: Path) -> None:
    home = _home(tmp_path)
    labels = read_hidden_labels(TASK, "test", home=home)
    rows = oracle(labels)
    champion = write_predictions(tmp_path / "champion.jsonl", [{**r, "probs": [1 / len(r["probs"])] * len(r["probs"])}
                                                               for r in rows])
    previewed = write_predictions(tmp_path / "previewed.jsonl", rows)
    assert verify_task(TASK, "test", previewed, home=home).ok  # a person's preview, before any hypothesis
    ledger = _registered(home)
    # The round's own re-evaluation scores the same predictions (a byte-identical candidate) with its champion.
    assert verify_task(TASK, "test", previewed, home=home, reader="round:r0001", baseline_predictions=champion).ok
    before = ledger.events_path.read_bytes()
    with pytest.raises(LedgerError, match=r"round r0001: no decision: the candidate's test predictions \(sha256 "
                                          r"\w{12}\) were read on test before, by 'adhoc' \(test_read event "
                                          r".*previewed.jsonl"):
        ledger.require_unread_candidate("r0001")
    assert ledger.events_path.read_bytes() == before
    # The control: a candidate nobody else read is eligible.
    fresh = write_predictions(tmp_path / "fresh.jsonl", [{**r, "probs": [round(p * 0.99 + 0.01 / len(r["probs"]), 6)
                                                                         for p in r["probs"]]} for r in rows])
    _registered(home, "r0002")
    assert verify_task(TASK, "test", fresh, home=home, reader="round:r0002", baseline_predictions=champion).ok
    ledger.require_unread_candidate("r0002")
