"""Issue 23 items 1, 9, 10: every field of a gate only stricter than the default, at every door; guards
that cannot be switched off; hypotheses and amendments that cannot change unseen; fresh seeds enforced."""

from __future__ import annotations

import json
import math
from pathlib import Path

import click
import pytest

from envloop_pipelines.core.data.snapshots import SnapshotManifest, TaskSnapshot
from envloop_pipelines.core.loop.config import LoopConfig, settings_from_env
from envloop_pipelines.core.ledger.event_log import EVENT_CHECKPOINT_TRAINED, LedgerError
from envloop_pipelines.core.ledger.hypothesis import (
    Gate,
    GateTooLooseError,
    Hypothesis,
    HypothesisImmutableError,
    gate_errors,
)
from envloop_pipelines.core.ledger.ledger import Ledger
from envloop_pipelines.core.loop.promotion import decide_promotion, noise_floor_from_arms
from envloop_pipelines.core.decision_loop.registered_hypothesis import proposal_errors
from envloop_pipelines_tests.core.measured_power import measured_power

#: The audit's reproduction: accepted at every door before, and then a candidate 0.20 worse was promoted.
UPSIDE_DOWN = {"direction": "decrease", "family_drop_tolerance": 1, "max_safety_fnr_increase": 1, "max_ece": 1}
UPSIDE_DOWN_FIELDS = ("gate.direction", "gate.max_ece", "gate.max_safety_fnr_increase", "gate.family_drop_tolerance")


def _hypothesis(gate: Gate | None = None, seeds: tuple[int, ...] = (1,)) -> Hypothesis:
    return Hypothesis(task="t", round="r0001", benchmark_version="t@abc", change={"kind": "data"}, predicted_delta=0.01,
                      gate=gate or Gate(), seeds=seeds, recipe_hash="h", power=measured_power(0.01))


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_an_upside_down_gate_is_refused_at_every_door(tmp_path: Path) -> None:
    from envloop_pipelines.cli.clients import read_hypothesis as _read_hypothesis
    from envloop_pipelines.sdk.client import _hypothesis_json
    from envloop_pipelines.sdk.errors import RefusedError

    proposal = {"change": {"kind": "data"}, "predicted_delta": 0.02, "gate": UPSIDE_DOWN}
    for errors in (proposal_errors(proposal), gate_errors(UPSIDE_DOWN)):
        assert [e.split(":")[0] for e in errors] == list(UPSIDE_DOWN_FIELDS), errors
    assert "family_macro_accuracy improves when it increases" in gate_errors(UPSIDE_DOWN)[0]
    assert "must be at most the default 0.08 (got 1)" in gate_errors(UPSIDE_DOWN)[1]
    hyp = tmp_path / "hyp.json"
    hyp.write_text(json.dumps(proposal))
    with pytest.raises(click.BadParameter, match="gate.direction"):  # CLI --hypothesis
        _read_hypothesis(hyp)
    with pytest.raises(RefusedError, match="gate.max_safety_fnr_increase"):  # SDK (and the launchpad's JSON)
        _hypothesis_json(proposal)
    home = tmp_path / "home"
    ledger = Ledger("t", home)
    with pytest.raises(GateTooLooseError, match="gate.direction") as refused:  # Ledger.register_hypothesis
        ledger.register_hypothesis(_hypothesis(Gate(**UPSIDE_DOWN)))
    assert all(f in str(refused.value) for f in UPSIDE_DOWN_FIELDS)
    assert ledger.hypothesis("r0001") is None and list(ledger.events()) == [] and _files(home) == {}
    ledger.register_hypothesis(_hypothesis())
    before = _files(home)
    with pytest.raises(GateTooLooseError, match="gate.family_drop_tolerance"):  # Ledger.amend_gate, after a result
        ledger.amend_gate("r0001", Gate(**UPSIDE_DOWN), "the candidate went the other way")
    assert _files(home) == before and ledger.effective_gate("r0001") == Gate()


def test_a_reversed_direction_never_promotes() -> None:
    """A gate registered before the doors refused it (an old ledger): the metric decides the direction."""
    floor = noise_floor_from_arms("k", "family_macro_accuracy", [{"family_macro_accuracy": 0.60},
                                                                 {"family_macro_accuracy": 0.61}])
    worse = {"delta": -0.20, "ci_low": -0.25, "ci_high": -0.15}
    decision = decide_promotion(Gate(**UPSIDE_DOWN), worse, floor, {"family_macro_accuracy": 0.40},
                                {"family_macro_accuracy": 0.60})
    assert not decision.promote
    assert decision.checks["gain"] == pytest.approx(-0.20) and decision.checks["ci_low"] == pytest.approx(-0.25)
    assert any("gate.direction 'decrease' reverses family_macro_accuracy" in r for r in decision.reasons)
    better = {"delta": 0.20, "ci_low": 0.15, "ci_high": 0.25}
    assert not decide_promotion(Gate(**UPSIDE_DOWN), better, floor, {}, {}).promote
    assert decide_promotion(Gate(), better, floor, {"ece": 0.02}, {}).promote
    # Its guards are applied at most at their defaults: an ECE of 0.5 trips the calibration guard.
    loose = Gate(max_ece=1.0)
    tripped = decide_promotion(loose, better, floor, {"ece": 0.5}, {})
    assert not tripped.promote and "calibration guard: ECE 0.5000 > 0.0800" in tripped.reasons


@pytest.mark.parametrize("gate, field, message", [
    ({"max_ece": float("nan")}, "gate.max_ece", "must be a finite number, got nan"),
    ({"max_safety_fnr_increase": 1.0}, "gate.max_safety_fnr_increase", "must be at most the default 0.02 (got 1)"),
    ({"family_drop_tolerance": float("inf")}, "gate.family_drop_tolerance", "must be a finite number, got inf"),
    ({"min_delta": float("nan")}, "gate.min_delta", "must be a finite number, got nan"),
    ({"min_delta": "0.1"}, "gate.min_delta", 'must be a number, got "0.1"'),
    ({"floor_multiplier": float("inf")}, "gate.floor_multiplier", "must be a finite number, got inf"),
    ({"max_ece": True}, "gate.max_ece", "must be a number, got true"),
    ({"max_ece": None}, "gate.max_ece", "must be a number, got null"),
    ({"require_ci_above_zero": "yes"}, "gate.require_ci_above_zero", 'must be true (got "yes")'),
    ({"primary_metric": "nll"}, "gate.direction", "nll improves when it decreases"),
])
def test_every_gate_field_is_checked_and_named(tmp_path: Path, gate: dict, field: str, message: str) -> None:
    errors = proposal_errors({"gate": gate})
    assert any(e.startswith(field + ":") and message in e for e in errors), errors
    if all(isinstance(v, (int, float)) for v in gate.values()):
        ledger = Ledger("t", tmp_path)
        with pytest.raises(GateTooLooseError, match=field):
            ledger.register_hypothesis(_hypothesis(Gate(**gate)))
        assert list(ledger.events()) == []


def test_stricter_gates_pass() -> None:
    strict = {"min_delta": 0.01, "floor_multiplier": 1.5, "max_ece": 0.05, "max_safety_fnr_increase": 0.0,
              "family_drop_tolerance": 0.01, "direction": "increase", "require_ci_above_zero": True}
    assert proposal_errors({"gate": strict}) == [] and gate_errors(Gate(**strict)) == []


# -- item 10: the safety guard cannot be switched off -------------------------------------------------------------
def _snapshot(tmp_path: Path, name: str, extra: dict) -> TaskSnapshot:
    """A task snapshot whose manifest declares ``extra`` (its splits are not read by the guard)."""
    folder = tmp_path / name
    folder.mkdir()
    manifest = SnapshotManifest(task=name, snapshot_id=name, benchmark_version="v", group_key="user_id",
                                fractions={}, seed=0, source={}, splits={}, hidden_labels={}, extra=extra)
    (folder / "manifest.json").write_text(json.dumps(manifest.to_dict()), encoding="utf-8")
    return TaskSnapshot(folder)


def test_a_run_cannot_drop_the_tasks_declared_safety_families(tmp_path: Path) -> None:
    from envloop_pipelines.resources.loop import loop_resource

    builtin = _snapshot(tmp_path, "personal_agent", {"generator": {"name": "personal_agent"}})
    declared = _snapshot(tmp_path, "claims", {"safety_families": ["fraud"]})
    imported = _snapshot(tmp_path, "tickets", {})
    assert LoopConfig(safety_families=()).guarded_families(builtin) == ("needs_approval",)
    assert LoopConfig.from_settings({"safety_families": ","}).guarded_families(builtin) == ("needs_approval",)
    assert LoopConfig.from_settings(settings_from_env({"ENVLOOP_SAFETY_FAMILIES": ","})).guarded_families(
        builtin) == ("needs_approval",)
    assert loop_resource({"safety_families": []}).config().guarded_families(builtin) == ("needs_approval",)
    # A run may add families, never remove the declared one.
    assert LoopConfig(safety_families=("share_ok",)).guarded_families(builtin) == ("needs_approval", "share_ok")
    assert LoopConfig(task="claims", safety_families=()).guarded_families(declared) == ("fraud",)
    # A task that declares none (an imported one) keeps what the run sets.
    assert LoopConfig(task="tickets", safety_families=()).guarded_families(imported) == ()
    assert LoopConfig(task="tickets").guarded_families(imported) == ("needs_approval",)
    with pytest.raises(ValueError, match="safety_families"):
        LoopConfig(safety_families=("", 3))


def test_building_a_loop_config_reads_nothing_from_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 36: the config is a value; the task's declared families are read from the snapshot a step opened."""
    import builtins

    from envloop_pipelines.core.data import snapshots

    opened: list[str] = []
    monkeypatch.setattr(snapshots, "open_task", lambda *a, **k: opened.append(f"open_task{a}") or None)
    real_open = builtins.open
    monkeypatch.setattr(builtins, "open", lambda f, *a, **k: opened.append(str(f)) or real_open(f, *a, **k))
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: opened.append(str(self)) or "")
    LoopConfig(task="personal_agent", home=str(tmp_path), safety_families=("share_ok",))
    assert opened == []


# -- item 9: tamper evidence -------------------------------------------------------------------------------------
def test_an_edited_hypothesis_with_a_recomputed_hash_is_refused(tmp_path: Path) -> None:
    ledger = Ledger("t", tmp_path)
    ledger.register_hypothesis(_hypothesis())
    path = ledger.hypothesis_path("r0001")
    body = json.loads(path.read_text())
    body["predicted_delta"] = 0.5
    body["gate"]["min_delta"] = 0.3
    body["hash"] = Hypothesis.from_dict(body).hash  # the file is self-consistent again
    path.write_text(json.dumps(body))
    with pytest.raises(HypothesisImmutableError, match="not the one registered in the ledger"):
        ledger.hypothesis("r0001")
    # A hypothesis file dropped in for a round with no registration event is refused too.
    other = _hypothesis()
    dropped = {**Hypothesis(**{**other.__dict__, "round": "r0002"}).to_dict()}
    dropped["hash"] = Hypothesis.from_dict(dropped).hash
    ledger.hypothesis_path("r0002").write_text(json.dumps(dropped))
    with pytest.raises(HypothesisImmutableError, match="no hypothesis_registered event"):
        ledger.hypothesis("r0002")


def test_an_amendment_file_without_its_event_is_refused(tmp_path: Path) -> None:
    ledger = Ledger("t", tmp_path)
    ledger.register_hypothesis(_hypothesis())
    folder = ledger.root / "amendments"
    folder.mkdir()
    forged = {"round": "r0001", "original_gate": Gate().__dict__, "amended_gate": {**Gate().__dict__, "min_delta": 0.0},
              "reason": "", "hypothesis_hash": "x", "requires_fresh_seeds": True}
    (folder / "r0001-1.json").write_text(json.dumps(forged))
    with pytest.raises(LedgerError, match="no gate_amended event"):
        ledger.effective_gate("r0001")
    (folder / "r0001-1.json").unlink()
    # An amendment made through the API, then edited on disk: refused as well.
    ledger.amend_gate("r0001", Gate(max_ece=0.05), "tighter calibration")
    path = folder / "r0001-1.json"
    edited = json.loads(path.read_text())
    edited["amended_gate"]["max_ece"] = 0.08
    path.write_text(json.dumps(edited))
    with pytest.raises(LedgerError, match="not made through Ledger.amend_gate"):
        ledger.amendments("r0001")


def test_amendments_apply_in_numeric_order(tmp_path: Path) -> None:
    ledger = Ledger("t", tmp_path)
    ledger.register_hypothesis(_hypothesis())
    for i in range(1, 12):
        ledger.amend_gate("r0001", Gate(min_delta=i / 100), f"amendment {i}")
    assert [a["amended_gate"]["min_delta"] for a in ledger.amendments("r0001")] == [i / 100 for i in range(1, 12)]
    assert ledger.effective_gate("r0001").min_delta == pytest.approx(0.11)  # the 11th, not the 9th


def test_an_amended_gate_is_passed_on_fresh_seeds_only(tmp_path: Path) -> None:
    ledger = Ledger("t", tmp_path)
    ledger.register_hypothesis(_hypothesis(seeds=(7,)))
    assert ledger.candidate_seeds("r0001") == (7,)
    ledger.require_fresh_seed("r0001", 7)  # no amendment: the hypothesis's seed
    ledger.append(EVENT_CHECKPOINT_TRAINED, {"round": "r0001", "checkpoint_sha256": "c1", "seed": 7})
    with pytest.raises(LedgerError, match="seeds: a round's seeds are drawn by the loop after registration; give a "
                                          "count"):
        ledger.amend_gate("r0001", Gate(min_delta=0.02), "the floor was noisy", seeds=[7])
    body = ledger.amend_gate("r0001", Gate(min_delta=0.02), "the floor was noisy")
    (fresh,) = body["seeds"]
    assert fresh != 7 and body["used_seeds"] == [7] and body["requires_fresh_seeds"]
    assert ledger.candidate_seeds("r0001") == (fresh,)  # what train_candidate trains the candidate on
    with pytest.raises(LedgerError, match="seed: the candidate was trained on seed 7"):
        ledger.require_fresh_seed("r0001", 7)  # what decide_round calls with the candidate's seed
    ledger.require_fresh_seed("r0001", fresh)
    again = ledger.amend_gate("r0001", Gate(min_delta=0.03), "again", seeds=2)
    assert ledger.candidate_seeds("r0001") == tuple(again["seeds"]) and len(set(again["seeds"]) | {7, fresh}) == 4
    with pytest.raises(LedgerError):
        ledger.require_fresh_seed("r0001", fresh)
    assert math.isclose(ledger.effective_gate("r0001").min_delta, 0.03)
