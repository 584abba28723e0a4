"""Issue 34, "the gate's promise across calls": no redraw on test, no split run, no silent edit.

Each test is one door the issue's audit walked through on ebf721d, refused here with the field or file named and
nothing written. The holdout's doors use the real verifier on an imported task (``test_verifier_doors``'s helpers).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import pytest

from envloop_pipelines.core.ledger.event_log import EVENT_HOLDOUT_READ, EVENT_HOLDOUT_SLOT, LedgerError
from envloop_pipelines.core.ledger.hypothesis import Gate
from envloop_pipelines.core.ledger.ledger import Ledger
from envloop_pipelines.core.ledger.reads import HoldoutAlreadyReadError
from envloop_pipelines.core.loop.promotion import NoiseFloor, decide_promotion
from envloop_pipelines.core.verify.labels import read_hidden_labels
from envloop_pipelines.core.verify.protocol import write_predictions
from envloop_pipelines.core.ledger.reads import holdout_read_key
from envloop_pipelines.core.verify.runner import HiddenSplitQueryError, verify_task

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
    from envloop_pipelines.core.ledger.reads import open_holdout_slot  # the release step's own

    caplog.set_level(logging.INFO, logger=LABEL_LOG)
    home = _home(tmp_path)
    ledger = Ledger(TASK, home)
    labels = read_hidden_labels(TASK, "holdout", home=home)
    path = write_predictions(tmp_path / "h.jsonl", oracle(labels))
    caplog.clear()
    open_holdout_slot(ledger, 1, holdout_read_key(path), by="release step")
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
            open_holdout_slot(ledger, 1, holdout_read_key(predictions), by="release step")
    with pytest.raises(HoldoutAlreadyReadError, match="stored read .* is gone"):
        ledger.read_holdout_once(1, lambda: {"taken": True}, key=holdout_read_key(path))
    assert label_reads(caplog) == 1 and len(list(ledger.events(EVENT_HOLDOUT_SLOT))) == 1
    assert len(list(ledger.events(EVENT_HOLDOUT_READ))) == 1 and not marker.exists()


# --------------------------------------------------------------------------- no guard skipped by a missing value

def _floor(floor: float = 0.01, values: tuple[float, ...] = (0.60, 0.61), family: float = 0.02) -> NoiseFloor:
    return NoiseFloor(key="k", metric="family_macro_accuracy", values=values, floor=floor,
                      family_floors={"billing": family})


CLEAR = {"delta": 0.20, "ci_low": 0.15, "ci_high": 0.25}
CANDIDATE = {"family_macro_accuracy": 0.80, "ece": 0.02, "acc/billing": 0.8, "acc/fraud": 0.9, "fnr/fraud": 0.05}
CHAMPION = {"family_macro_accuracy": 0.60, "acc/billing": 0.6, "acc/fraud": 0.9, "fnr/fraud": 0.05}


def test_a_clear_candidate_with_every_value_promotes() -> None:  # the control of the refusals below
    assert decide_promotion(Gate(), CLEAR, _floor(), CANDIDATE, CHAMPION, ("fraud",)).promote
    # A declared safety family with no question on test at all (no acc/<family>) has nothing to guard there.
    assert decide_promotion(Gate(), CLEAR, _floor(), {**CANDIDATE, "fnr/approval": None}, CHAMPION,
                            ("fraud", "approval"), paired={"safety": {}}).promote


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
    from envloop_pipelines.core.decision_loop.registered_hypothesis import proposal_errors
    from envloop_pipelines.core.ledger.hypothesis import draw_seeds

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
    from envloop_pipelines.core.ledger.reads import TestReadBudgetError

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


def test_a_candidate_that_answers_as_its_champion_is_eligible_to_be_rejected(tmp_path: Path) -> None:
    # a4f1932's CI: a one-step candidate (warm-up learning rate 0) predicted exactly as its champion, whose
    # predictions the setup had read; the round raised "no decision" instead of rejecting a change that moved nothing.
    home = _home(tmp_path)
    rows = oracle(read_hidden_labels(TASK, "test", home=home))
    champion = write_predictions(tmp_path / "champion.jsonl", rows)
    assert verify_task(TASK, "test", champion, home=home).ok  # read before the round (the setup's noise arm)
    ledger = _registered(home)
    assert verify_task(TASK, "test", champion, home=home, reader="round:r0001", baseline_predictions=champion).ok
    assert ledger.candidate_answers_as_champion("r0001")
    ledger.require_unread_candidate("r0001")  # nothing to select from: the gate decides, and can only reject
    # The control: a previewed candidate that differs from its champion stays ineligible.
    other = write_predictions(tmp_path / "other.jsonl", [{**r, "probs": [1 / len(r["probs"])] * len(r["probs"])}
                                                         for r in rows])
    assert verify_task(TASK, "test", other, home=home).ok
    _registered(home, "r0002")
    assert verify_task(TASK, "test", other, home=home, reader="round:r0002", baseline_predictions=champion).ok
    assert not ledger.candidate_answers_as_champion("r0002")
    with pytest.raises(LedgerError, match=r"round r0002: no decision: the candidate's test predictions"):
        ledger.require_unread_candidate("r0002")


# --------------------------------------------------------------------------- tamper evidence: the hash chain

def _lines(ledger: Ledger) -> list[bytes]:
    return ledger.events_path.read_bytes().splitlines(keepends=True)


def _write(ledger: Ledger, lines: list[bytes]) -> None:
    ledger.events_path.write_bytes(b"".join(lines))


def _verify_cli(home: Path) -> Any:
    from click.testing import CliRunner

    from envloop_pipelines.cli import main

    return CliRunner().invoke(main, ["ledger", "verify", "--task", TASK], env={"ENVLOOP_HOME": str(home),
                                                                                "MLFLOW_TRACKING_URI": ""})


@pytest.fixture
def chained(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A home whose ledger has a round (hypothesis, trained candidate, its read), release 1 and the head anchored."""
    from envloop_pipelines.core.ledger.anchor import anchor_head
    from envloop_pipelines.core.tracking import MlflowTracker

    home = _home(tmp_path)
    monkeypatch.setenv("ENVLOOP_HOME", str(home))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    ledger = _registered(home)
    path = write_predictions(tmp_path / "t.jsonl", oracle(read_hidden_labels(TASK, "test", home=home)))
    assert verify_task(TASK, "test", path, home=home, reader="round:r0001").ok
    ledger.write_release_card(1, {"release": 1, "round": None, "checkpoint_sha256": "c0"}, "# release 1\n")
    tracker = MlflowTracker(home=home)
    anchor_head(ledger, tracker)
    return {"home": home, "ledger": ledger, "tracker": tracker, "predictions": path}


def _refused_everywhere(env: dict[str, Any], message: str) -> None:
    """`envloop ledger verify`, the next round's check, the releases (CLI, serving, the SDK) refuse with ``message``."""
    from envloop_pipelines.core.ledger.anchor import verify_ledger
    from envloop_pipelines.core.ledger.event_log import LedgerChainError
    from envloop_pipelines.sdk.local import LocalClient

    result = _verify_cli(env["home"])
    assert result.exit_code == 1 and message in result.output, result.output
    ledger = Ledger(TASK, env["home"])
    for read in (lambda: verify_ledger(ledger, env["tracker"]), ledger.releases,
                 lambda: LocalClient(task=TASK).release_cards()):
        with pytest.raises(LedgerChainError) as refused:
            read()
        assert message in str(refused.value)


def test_ledger_verify_on_an_untouched_home_is_ok(chained: dict[str, Any]) -> None:
    result = _verify_cli(chained["home"])
    assert result.exit_code == 0, result.output
    # The hypothesis, the trained candidate, its test read, release 1.
    assert result.output.startswith("ledger ok: 4 events (4 chained), head ")
    assert "the head anchored in MLflow" in result.output and "is its beginning" in result.output


def test_a_hypothesis_rewritten_with_its_event_breaks_the_chain(chained: dict[str, Any]) -> None:
    ledger = chained["ledger"]
    lines = _lines(ledger)
    n = next(i for i, line in enumerate(lines) if b'"hypothesis_registered"' in line)
    lines[n] = lines[n].replace(b'"predicted_delta": 0.01', b'"predicted_delta": 0.9')  # ebf721d: accepted
    _write(ledger, lines)
    _refused_everywhere(chained, f"ledger chain broken at {ledger.events_path} line {n + 2} (event ")


def test_deleted_test_read_lines_break_the_chain(chained: dict[str, Any]) -> None:
    ledger = chained["ledger"]
    lines = _lines(ledger)
    kept = [line for line in lines if b'"test_read"' not in line]  # ebf721d: the round's budget restored
    assert len(kept) == len(lines) - 1
    _write(ledger, kept)
    _refused_everywhere(chained, "a line before it was edited, removed or inserted")
    with pytest.raises(LedgerError, match="ledger chain broken"):
        verify_task(TASK, "test", chained["predictions"], home=chained["home"], reader="round:r0001")


def test_a_deleted_last_event_is_told_by_the_head_anchored_in_mlflow(chained: dict[str, Any]) -> None:
    ledger = chained["ledger"]
    _write(ledger, _lines(ledger)[:-1])  # the chain that is left holds; the anchor does not
    assert ledger.verify()["events"] == 3
    result = _verify_cli(chained["home"])
    assert result.exit_code == 1 and "the head anchored in MLflow (experiment 'tickets'" in result.output
    assert "events were removed or rewritten after it was anchored" in result.output


def test_a_card_dropped_into_releases_is_no_release(chained: dict[str, Any]) -> None:
    ledger = chained["ledger"]
    dropped = ledger.release_dir(2) / "card.json"
    dropped.parent.mkdir(parents=True)
    dropped.write_text('{"release": 2, "round": "r0001", "checkpoint_sha256": "rejected"}')  # ebf721d: the champion
    _refused_everywhere(chained, f"release card {dropped}: no release_promoted event")
    with pytest.raises(LedgerError, match="a card dropped in by hand"):
        ledger.next_release_number()


def test_an_edited_card_is_refused(chained: dict[str, Any]) -> None:
    ledger = chained["ledger"]
    card = ledger.release_dir(1) / "card.json"
    card.chmod(0o644)
    card.write_text(card.read_text().replace('"c0"', '"c9"'))
    _refused_everywhere(chained, "the card was edited")


def test_a_log_written_before_the_chain_is_read_and_bound_by_its_first_chained_event(tmp_path: Path) -> None:
    ledger = Ledger(TASK, tmp_path)
    legacy = [b'{"event_id": "a", "at": 0, "kind": "loop_started", "task": "tickets"}\n',
              b'{"event_id": "b", "at": 1, "kind": "null_arm", "task": "tickets", "seed": 1}\n']
    _write(ledger, legacy)
    assert [e["event_id"] for e in ledger.events()] == ["a", "b"]  # an existing home reads as before
    ledger.append("loop_stopped", {"reason": "budget"})
    assert ledger.verify() == {**ledger.verify(), "events": 3, "chained": 1}
    lines = _lines(ledger)
    lines[1] = lines[1].replace(b'"seed": 1', b'"seed": 2')  # an edit of a line written before the chain
    _write(ledger, lines)
    with pytest.raises(LedgerError, match=f"ledger chain broken at {ledger.events_path} line 3"):
        list(ledger.events())
    _write(ledger, [*legacy, lines[2], b'{"event_id": "x", "at": 2, "kind": "erratum", "task": "tickets"}\n'])
    with pytest.raises(LedgerError, match="line 4 .*no prev digest after the chain started"):
        ledger.verify()


def test_the_decision_checks_the_reevaluation_against_the_verifiers_recorded_result(tmp_path: Path) -> None:
    import json

    from envloop_pipelines.core.decision_loop.step_records import Reevaluation
    from envloop_pipelines.core.decision_loop.promotion_decision import reeval_result_error

    home = _home(tmp_path)
    rows = oracle(read_hidden_labels(TASK, "test", home=home))
    champion = write_predictions(tmp_path / "champion.jsonl", [{**r, "probs": [1 / len(r["probs"])] * len(r["probs"])}
                                                               for r in rows])
    candidate = write_predictions(tmp_path / "candidate.jsonl", rows)
    ledger = _registered(home)
    run = verify_task(TASK, "test", candidate, home=home, reader="round:r0001", baseline_predictions=champion)
    reeval = Reevaluation(round="r0001", benchmark_version="b", candidate=dict(run.report.metrics),
                          champion=dict(run.baseline_report.metrics), tfidf_baseline={}, paired=run.paired,
                          complete=True, verifier_pid=None, verifier={}, candidate_checkpoint_sha256="c",
                          champion_checkpoint_sha256="c0")
    stored = Reevaluation.from_dict(json.loads(json.dumps(reeval.to_dict())))  # as the IO manager stores it
    assert reeval_result_error(ledger, stored) is None
    edited = json.loads(json.dumps(reeval.to_dict()))
    edited["paired"]["deltas"]["family_macro_accuracy"]["delta"] = 0.9  # ebf721d: promoted as release 2
    message = reeval_result_error(ledger, Reevaluation.from_dict(edited))
    assert message is not None and message.startswith("independent_reeval: its numbers hash to ")
    assert "not the verifier's recorded result (test_read event" in message and "was edited" in message


# --------------------------------------------------------------------------- one source of truth for the champion

def test_a_champion_alias_moved_by_hand_is_refused_naming_both_versions(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from envloop_pipelines.core.ledger.anchor import verify_ledger
    from envloop_pipelines.core.ledger.projection import ChampionMismatchError
    from envloop_pipelines.core.tracking import TAG_RELEASE, MlflowTracker

    home = tmp_path / "home"
    monkeypatch.setenv("ENVLOOP_HOME", str(home))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    tracker = MlflowTracker(home=home)
    name = f"envloop-{TASK}"
    versions = []
    for release in (1, 2):  # release 1 published; version 2 a rejected candidate registered by hand
        run = tracker.start_run(TASK, f"release {release}")
        versions.append(tracker.register_version(name, f"{tracker.artifact_uri(run.run_id)}/checkpoint", run.run_id,
                                                 tags={TAG_RELEASE: str(release)}))
    tracker.set_champion(name, versions[0])
    ledger = Ledger(TASK, home)
    ledger.write_release_card(1, {"release": 1, "round": None, "model_version": versions[0]}, "# release 1\n")
    assert verify_ledger(ledger, tracker)["events"] == 1  # the alias on the ledger's champion: ok
    tracker.set_champion(name, versions[1])  # ebf721d: Client.releases() reported version 2 as champion
    with pytest.raises(ChampionMismatchError, match=f"the MLflow 'champion' alias of {name} points at model version "
                                                    f"{versions[1]}, but the ledger's champion is release 1, model "
                                                    f"version {versions[0]}"):
        verify_ledger(ledger, tracker)
    result = _verify_cli(home)
    assert result.exit_code == 1 and "release chain refused: the MLflow 'champion' alias" in result.output


def test_a_release_tag_the_ledger_does_not_have_is_refused() -> None:
    from envloop_pipelines.core.ledger.projection import projection_error

    cards = [{"release": 1, "model_version": "1"}]
    assert projection_error(cards, [("1", {"envloop.release": "1"})], "1", "m") is None
    assert projection_error(cards, [("1", {"envloop.release": "1"}), ("2", {"envloop.release": "2"})], "1", "m") == (
        "MLflow model version 2 of m is tagged envloop.release=2, but the ledger has no release 2: the registry is "
        "not the ledger's projection")
    assert "the ledger's release 1 is model version 1" in projection_error(cards, [("3", {"envloop.release": "1"})],
                                                                           "1", "m")


# --------------------------------------------------------------------------- contamination by near-duplicates

def test_a_test_state_with_every_12th_word_replaced_is_caught_and_train_states_are_not() -> None:
    import re

    from envloop_pipelines.core.benchmark.generator import BenchmarkConfig, generate_benchmark
    from envloop_pipelines.core.data.contamination import check_contamination

    records = generate_benchmark(BenchmarkConfig())  # the built-in benchmark, 240 users
    hidden = [(f"{r['meta']['split']}/{r['id']}", r["state"]) for r in records if r["meta"]["split"] in ("test", "holdout")]
    tests = [r for r in records if r["meta"]["split"] == "test"][:20]
    replaced = []
    for r in tests:
        words = re.findall(r"\S+", r["state"])
        replaced.append((r["id"], " ".join(f"other{i}" if i % 12 == 11 else w for i, w in enumerate(words))))
    report = check_contamination(replaced, hidden)
    assert report.flagged_rows == set(range(20))  # ebf721d: 0 of 20 flagged
    assert all(f["found_by"] == "minhash_lsh" and f["jaccard"] >= 0.5 for f in report.near_duplicate)
    assert {f["matches"] for f in report.near_duplicate} == {f"test/{r['id']}" for r in tests}
    # The control the threshold was measured on: no train state of the built-in benchmark is flagged by it.
    train = [(r["id"], r["state"]) for r in records if r["meta"]["split"] == "train"]
    assert check_contamination(train, hidden).near_duplicate == []
