"""The loop's core pieces: mining, synthesis, contamination, promotion, budget, ledger."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from envloop_pipelines.core.loop.budget import LoopBudget, next_round, start_loop
from envloop_pipelines.core.data.contamination import check_contamination
from envloop_pipelines.core.ledger.event_log import LedgerError
from envloop_pipelines.core.ledger.hypothesis import Gate, GateTooLooseError, Hypothesis, gate_errors
from envloop_pipelines.core.ledger.ledger import Ledger
from envloop_pipelines.core.decision_loop.failure_mining import cluster_failures, cluster_failures_with_fallback
from envloop_pipelines.core.loop.promotion import (
    ArmIdentityError,
    check_arm_identity,
    decide_promotion,
    noise_floor_from_arms,
)
from envloop_pipelines.core.decision_loop.synthesis import SNAPSHOT_SCHEMA, SynthesisRequest, VariantGenerator, allocate, load_generator
from envloop_pipelines.core.data.question_table import QUESTION_SCHEMA
from envloop_pipelines_tests.core.measured_power import measured_power


def question_rows(n: int = 12) -> list[dict]:
    rows = []
    for i in range(n):
        fam = "route" if i % 2 else "refund"
        keys = ["billing", "shipping", "account"] if fam == "route" else ["true", "false"]
        rows.append({"record_id": f"r{i}", "question_id": fam, "family": fam, "type": "choice" if fam == "route" else "noul",
                     "group": f"u{i}", "state_text": f"state number {i} " * 5, "instructions_text": f"question about {fam}?",
                     "option_keys": keys, "option_texts": [None] * len(keys), "variant": "clean" if i < 8 else "buried",
                     "renderer": "a", "label": 0, "soft_label": None})
    return rows


def predictions_for(rows: list[dict], wrong: set[int], confidence: float = 0.9) -> pa.Table:
    out = []
    for i, r in enumerate(rows):
        k = len(r["option_keys"])
        target = 1 if i in wrong else 0
        probs = [(1 - confidence) / (k - 1)] * k
        probs[target] = confidence
        out.append({"record_id": r["record_id"], "question_id": r["question_id"], "option_keys": r["option_keys"],
                    "probs": probs})
    return pa.Table.from_pylist(out)


def test_mining_ranks_the_cluster_with_excess_errors_first() -> None:
    rows = question_rows(12)
    # Every "route" question (odd i) is wrong: route errors are in excess, refund has none.
    wrong = {i for i in range(12) if i % 2}
    report = cluster_failures(pa.Table.from_pylist(rows, schema=QUESTION_SCHEMA), predictions_for(rows, wrong),
                           threshold=0.8, group_by=("family", "transition"))
    assert report.n_errors == 6 and report.n_confident_errors == 6 and report.error_rate == 0.5
    top = report.clusters[0]
    assert top.key == {"family": "route", "transition": "billing->shipping"}
    # 6 route questions, all wrong; the overall rate predicts 3: excess 3.
    assert (top.n, top.errors, top.excess_errors) == (6, 6, 3.0)
    assert report.by_family["refund"]["errors"] == 0 and len(top.example_ids) == 5


def test_mining_falls_back_to_coarser_groups_on_small_data() -> None:
    rows = question_rows(6)
    for i, row in enumerate(rows):
        row["renderer"] = f"renderer{i}"  # every question alone in its finest cluster
    table = pa.Table.from_pylist(rows, schema=QUESTION_SCHEMA)
    preds = predictions_for(rows, {1, 3})
    assert not cluster_failures(table, preds, threshold=0.99, min_cluster_size=3).clusters
    report = cluster_failures_with_fallback(table, preds, threshold=0.99, min_cluster_size=3)
    assert report.clusters and set(report.clusters[0].key) == {"family", "type", "transition", "variant"}


def test_variant_generator_preserves_labels() -> None:
    rows = question_rows(12)
    table = pa.Table.from_pylist(rows, schema=QUESTION_SCHEMA)
    report = cluster_failures(table, predictions_for(rows, {1, 3, 5}), threshold=0.5, group_by=("family",))
    request = SynthesisRequest(round="r0001", clusters=report.clusters, n_examples=40, seed=1)
    out = VariantGenerator().synthesize(request, table)
    assert out.schema.equals(SNAPSHOT_SCHEMA) and out.num_rows == 40
    originals = {r["record_id"]: r for r in rows}
    kinds = set()
    for row in out.to_pylist():
        provenance = json.loads(row["provenance"])
        kinds.add(provenance["kind"])
        source = originals[provenance["source_record"]]
        assert provenance["cluster"] == "family=route" and row["family"] == "route"
        # The labelled option is the same option, wherever it moved.
        assert row["option_keys"][row["label"]] == source["option_keys"][source["label"]]
    assert {"option_permutation", "paraphrase"} <= kinds


def test_noul_negation_flips_the_label() -> None:
    row = question_rows(1)[0]
    rng = np.random.default_rng(0)
    for _ in range(20):
        r = dict(row)
        if VariantGenerator._vary(r, rng, "~x") == "negation":
            assert r["label"] == 1 - row["label"] and r["instructions_text"].startswith("Is the following false?")
            break
    else:
        pytest.fail("no negation drawn in 20 tries")


def test_allocation_follows_excess_errors() -> None:
    from envloop_pipelines.core.decision_loop.failure_mining import FailureCluster

    clusters = [FailureCluster({"family": "a"}, 10, 8, 2, 0.8, 6.0, ()), FailureCluster({"family": "b"}, 10, 3, 0, 0.3, 1.0, ())]
    counts = allocate(clusters, 90)
    assert sum(counts) == 90 and counts[0] > counts[1] >= 1


def test_generator_plugins_resolve_by_name_and_path() -> None:
    assert load_generator("label_preserving_variants").name == "label_preserving_variants"
    assert load_generator("envloop_pipelines.core.decision_loop.synthesis:VariantGenerator").name == "label_preserving_variants"
    with pytest.raises(ValueError, match="unknown environment generator 'nope'"):
        load_generator("nope")


def test_contamination_exact_near_and_ngram() -> None:
    story = ("Paolo asked the agent to pay Ben for the ski trip deposit, and the agent knows that Paolo allows payments "
             "to Ben and Wren without asking as long as they stay under the spending limit of two hundred and fifty "
             "dollars, while any other recipient needs an explicit approval first, and quiet hours run from nine at "
             "night until six in the morning with nothing louder than a digest during them except at noon sharp.")
    reference = [("test/1", story),
                 ("test/2", "Completely different words about invoices, refunds and a billing address in Lisbon.")]
    near = reference[0][1].replace("noon", "dusk")
    rows = [("a", reference[0][1].upper()), ("b", near), ("c", "Nothing in common with anything else here at all"),
            ("d", " ".join(story.split()[:40]) + " and then " + " ".join(f"word{i}" for i in range(18)))]
    report = check_contamination(rows, reference)
    assert [f["id"] for f in report.exact] == ["a"]
    assert [f["id"] for f in report.near_duplicate] == ["b"]
    assert [f["id"] for f in report.ngram_overlap] == ["d"]
    assert report.flagged_rows == {0, 1, 3} and not report.clean


def test_arm_identity_is_checked_before_compute() -> None:
    recipe = {"lr": 1e-3, "seed": 0}
    assert check_arm_identity([(recipe, "d"), ({**recipe, "seed": 1}, "d")])
    with pytest.raises(ArmIdentityError, match="but for the seed"):
        check_arm_identity([(recipe, "d"), ({**recipe, "seed": 1, "lr": 2e-3}, "d")])
    with pytest.raises(ArmIdentityError, match="but for the seed"):
        check_arm_identity([(recipe, "d"), ({**recipe, "seed": 1}, "other-data")])
    with pytest.raises(ArmIdentityError, match="distinct seeds"):
        check_arm_identity([(recipe, "d"), (recipe, "d")])


def test_noise_floor_and_promotion_gate() -> None:
    floor = noise_floor_from_arms("k", "family_macro_accuracy",
                                  [{"family_macro_accuracy": 0.60, "acc/a": 0.5}, {"family_macro_accuracy": 0.63, "acc/a": 0.58}])
    assert floor.floor == pytest.approx(0.03) and floor.family_floors["a"] == pytest.approx(0.08)
    gate = Gate(min_delta=0.01)
    champion = {"ece": 0.03, "acc/a": 0.6, "fnr/needs_approval": 0.10}
    good = {"ece": 0.03, "acc/a": 0.61, "fnr/needs_approval": 0.10}
    assert decide_promotion(gate, {"delta": 0.05, "ci_low": 0.01, "ci_high": 0.09}, floor, good, champion,
                            ["needs_approval"]).promote
    # Within the floor: not a result.
    small = decide_promotion(gate, {"delta": 0.02, "ci_low": 0.005, "ci_high": 0.04}, floor, good, champion)
    assert not small.promote and "noise floor 0.0300" in small.reasons[0]
    # CI crossing zero.
    assert "CI lower end" in decide_promotion(gate, {"delta": 0.05, "ci_low": -0.01, "ci_high": 0.1}, floor, good,
                                              champion).reasons[0]
    # Guards: calibration, safety FNR, a family falling more than its own noise.
    bad = {"ece": 0.2, "acc/a": 0.4, "fnr/needs_approval": 0.2}
    reasons = decide_promotion(gate, {"delta": 0.05, "ci_low": 0.01, "ci_high": 0.09}, floor, bad, champion,
                               ["needs_approval"]).reasons
    assert any("calibration guard" in r for r in reasons)
    assert any("safety guard" in r for r in reasons)
    assert any("family guard: a" in r for r in reasons)


def test_seed_bound_refuses_a_null_candidate_that_clears_the_spread_over_a_low_champion() -> None:
    # Three null arms; the champion is the lowest (release 1 is the control arm, here an unlucky seed).
    floor = noise_floor_from_arms("k", "family_macro_accuracy",
                                  [{"family_macro_accuracy": v} for v in (0.60, 0.63, 0.66)])
    # mean 0.63, sd 0.03, t(0.95, 2) = 2.919986, sqrt(1 + 1/3): the bound a fresh seed stays under 95% of the time.
    assert floor.seed_bound() == pytest.approx(0.63 + 2.919986 * 0.03 * (4 / 3) ** 0.5, abs=1e-6)
    assert floor.seed_bound("decrease") == pytest.approx(0.63 - 2.919986 * 0.03 * (4 / 3) ** 0.5, abs=1e-6)
    gate = Gate()
    low_champion = {"family_macro_accuracy": 0.60}
    # +0.08 clears the spread (0.06) with a CI above zero: the old gate promoted this, but a fresh seed of the
    # champion's own recipe reaches 0.68 often; the bar is the bound minus the champion.
    lucky = decide_promotion(gate, {"delta": 0.08, "ci_low": 0.02, "ci_high": 0.14}, floor,
                             {"family_macro_accuracy": 0.68, "ece": 0.03}, low_champion)
    assert not lucky.promote
    assert lucky.checks["bar"] == pytest.approx(floor.seed_bound() - 0.60) and lucky.checks["noise_floor"] == pytest.approx(0.06)
    assert "seed bound 0.7312 minus the champion's 0.6000" in lucky.reasons[0]
    real = decide_promotion(gate, {"delta": 0.15, "ci_low": 0.09, "ci_high": 0.21}, floor,
                            {"family_macro_accuracy": 0.75, "ece": 0.03}, low_champion)
    assert real.promote, real.reasons
    # A champion already above the bound (a real promotion): the bound adds nothing, the spread decides.
    high = decide_promotion(gate, {"delta": 0.07, "ci_low": 0.02, "ci_high": 0.12}, floor,
                            {"family_macro_accuracy": 0.87, "ece": 0.03}, {"family_macro_accuracy": 0.80})
    assert high.promote and high.checks["bar"] == pytest.approx(0.06) and high.checks["seed_gap"] < 0
    # No hypothesis loosens it: a stricter multiplier only raises the larger of the two.
    assert decide_promotion(Gate(floor_multiplier=3.0), {"delta": 0.15, "ci_low": 0.09, "ci_high": 0.21}, floor,
                            {"ece": 0.03}, low_champion).checks["bar"] == pytest.approx(0.18)
    # A floor of the candidate's own seeds (the RL round's): no bound, the spread is the bar.
    assert decide_promotion(gate, {"delta": 0.08, "ci_low": 0.02, "ci_high": 0.14}, floor, {"ece": 0.03}, low_champion,
                            apply_seed_bound=False).promote
    # A gate on a metric the arms did not measure has no floor in its units: never promoted, and refused at
    # registration with the field named.
    other = decide_promotion(Gate(primary_metric="nll", direction="decrease"),
                             {"delta": -0.5, "ci_low": -0.7, "ci_high": -0.3}, floor, {"ece": 0.03}, {"nll": 1.2})
    assert not other.promote and other.checks["seed_bound"] is None
    assert other.reasons == ("no noise floor on nll: the null arms measured family_macro_accuracy",)
    from envloop_pipelines.core.decision_loop.registered_hypothesis import proposal_errors

    assert proposal_errors({"gate": {"primary_metric": "nll", "direction": "decrease"}}) == [
        "gate.primary_metric: the noise floor's null arms measure family_macro_accuracy only, so a gate on 'nll' "
        "would have no floor in its own units; got 'nll'"]
    assert proposal_errors({"gate": {"primary_metric": "family_macro_accuracy"}}) == []


def _ci(delta: float, low: float, high: float, level: float = 0.95) -> dict[str, float]:
    return {"delta": delta, "ci_low": low, "ci_high": high, "confidence_level": level}


def test_family_and_safety_guards_decide_on_paired_cis_not_point_drops() -> None:
    floor = noise_floor_from_arms("k", "family_macro_accuracy",
                                  [{"family_macro_accuracy": 0.60, "acc/a": 0.50, "acc/b": 0.70},
                                   {"family_macro_accuracy": 0.61, "acc/a": 0.53, "acc/b": 0.71}])
    gate = Gate()  # family_drop_tolerance 0.05 > both family floors; max_safety_fnr_increase 0.02
    primary = {"delta": 0.05, "ci_low": 0.01, "ci_high": 0.09}
    champion = {"ece": 0.03, "acc/a": 0.60, "acc/b": 0.70, "fnr/needs_approval": 0.10}
    candidate = {"ece": 0.03, "acc/a": 0.51, "acc/b": 0.58, "fnr/needs_approval": 0.16}
    # Point drops of 0.09 (a) and 0.12 (b), an FNR rise of 0.06: the old point rule trips all three.
    point = decide_promotion(gate, primary, floor, candidate, champion, ["needs_approval"])
    assert sorted(r.split(":")[0] for r in point.reasons) == ["family guard", "family guard", "safety guard"]
    # A noisy small family: a's drop of 0.09 has a CI reaching +0.04 (not significant); b's CI is wholly
    # below -0.05 (a significant drop beyond its noise). The FNR rise's one-sided bound is below +0.02.
    paired = {"families": {"a": _ci(-0.09, -0.22, 0.04), "b": _ci(-0.12, -0.18, -0.06)},
              "safety": {"needs_approval": _ci(0.06, -0.03, 0.15, level=0.90)}}
    verdict = decide_promotion(gate, primary, floor, candidate, champion, ["needs_approval"], paired=paired)
    assert not verdict.promote
    (reason,) = verdict.reasons
    assert reason.startswith("family guard: b accuracy fell 0.1200, significantly more than its noise 0.0500")
    assert "[-0.1800, -0.0600], upper end below -0.0500" in reason
    assert verdict.checks["family_guards"]["a"]["test"] == "paired"
    assert verdict.checks["fnr/needs_approval"]["lower_bound"] == -0.03
    # b's CI only just reaching past its allowance does not trip (the drop is not significantly beyond its noise).
    paired["families"]["b"] = _ci(-0.12, -0.20, -0.04)
    assert decide_promotion(gate, primary, floor, candidate, champion, ["needs_approval"], paired=paired).promote
    # A significant FNR rise: the one-sided 95% lower bound +0.03 is above the limit +0.02.
    paired["safety"]["needs_approval"] = _ci(0.06, 0.03, 0.09, level=0.90)
    unsafe = decide_promotion(gate, primary, floor, candidate, champion, ["needs_approval"], paired=paired)
    assert unsafe.reasons == ("safety guard: fnr/needs_approval rose +0.0600 (0.1000 -> 0.1600); its one-sided 95% "
                              "lower bound +0.0300 is above the limit +0.0200",)
    # A family the verifier gave no CI for (an old re-evaluation) keeps the stricter point rule.
    del paired["families"]["a"]
    reasons = decide_promotion(gate, primary, floor, candidate, champion, ["needs_approval"], paired=paired).reasons
    assert any(r.startswith("family guard: a accuracy fell 0.0900 (> its noise 0.0500; point comparison") for r in reasons)


def test_snapshot_rows_overlapping_test_or_holdout_are_removed_base_rows_too(tmp_path: Path) -> None:
    from envloop_pipelines.core.data.datasets import import_file
    from envloop_pipelines.core.loop.config import LoopConfig
    from envloop_pipelines.core.decision_loop.step_records import EnvironmentSynthesis
    from envloop_pipelines.core.decision_loop.training_dataset_snapshot import build_training_snapshot
    from envloop_pipelines.core.decision_loop.synthesis import SNAPSHOT_SCHEMA
    from envloop_pipelines.core.storage import atomic_write_parquet

    from .data.test_records import good_record, write_lines

    # 30 users x 2 records; each user's first record has one shared state (so the train users' copies match
    # a test or holdout state exactly), the second a state of its own.
    records = []
    for u in range(30):
        for k in range(2):
            rec = good_record(f"r{u}-{k}", user=f"u{u}")
            rec["state"] = "the shared state of every first ticket" if k == 0 else f"ticket {u} of user u{u}"
            records.append(rec)
    home = tmp_path / "home"
    snap = import_file(write_lines(tmp_path / "d.jsonl", records), "tickets", home=home)
    train = snap.table("train")
    shared = sum(1 for s in train.column("state_text").to_pylist() if s.startswith("the shared"))
    assert 0 < shared < train.num_rows
    empty = atomic_write_parquet(tmp_path / "synth.parquet", SNAPSHOT_SCHEMA.empty_table())
    synthesis = EnvironmentSynthesis(round="r0001", generator="g", n_rows=0, per_cluster={}, clusters=(),
                                     path=str(empty), sha256="e")
    kept = build_training_snapshot(LoopConfig(task="tickets", home=str(home)), snap, synthesis)
    assert kept.n_removed == shared and kept.n_base == train.num_rows - shared and kept.contamination["clean"]
    assert kept.problems() == []
    report = json.loads(Path(kept.path).with_suffix(".contamination.json").read_text())
    assert report["removed_base_rows"] == shared and report["checked"]["n_flagged"] == shared
    refused = build_training_snapshot(LoopConfig(task="tickets", home=str(home), contamination_policy="refuse"),
                                      snap, synthesis)
    assert refused.n_removed == 0 and refused.problems() == [f"{shared} rows overlap test/holdout"]


def test_the_card_shows_safety_fnr_beside_tfidf_with_the_deferral_rate_and_the_power() -> None:
    from envloop_pipelines.core.release.card import render_card

    card = {"release": 2, "task": "t", "round": "r0001", "parent_release": 1, "benchmark_version": "b",
            "data_snapshot": "d", "recipe_hash": "r", "checkpoint_sha256": "c", "holdout": {"brier": 0.3},
            "test": {"brier": 0.3, "fnr/needs_approval": 0.52, "fnr_automated/needs_approval": 0.08,
                     "defer_rate/needs_approval": 0.41},
            "parent_test": {"brier": 0.31, "fnr/needs_approval": 0.55},
            "tfidf_baseline_test": {"brier": 0.35, "fnr/needs_approval": 0.34, "fnr_automated/needs_approval": 0.09,
                                    "defer_rate/needs_approval": 0.6},
            "gate": {}, "noise_floor": 0.01, "predicted_delta": 0.01,
            "power": {"metric": "family_macro_accuracy", "mde": 0.019, "se": 0.0068, "power": 0.8,
                      "underpowered": True}}
    text = render_card(card)
    assert "| needs_approval | release | 0.5200 | 0.0800 | 0.4100 |" in text
    assert "| needs_approval | TF-IDF + LR | 0.3400 | 0.0900 | 0.6000 |" in text
    assert "| needs_approval | parent | 0.5500 | — | — |" in text
    assert ("- power: predicted 0.0100 on family_macro_accuracy; minimum detectable effect 0.0190 at 80% power "
            "(se 0.0068); **underpowered**") in text


def test_the_card_puts_tfidf_beside_the_release_on_the_holdout_with_the_paired_delta() -> None:
    from envloop_pipelines.core.release.card import render_card

    base = {"release": 1, "task": "t", "round": "bootstrap", "parent_release": None, "benchmark_version": "b",
            "data_snapshot": "d", "recipe_hash": "r", "checkpoint_sha256": "c", "test": {}, "gate": {},
            "noise_floor": 0.01}
    card = {**base, "holdout": {"family_macro_accuracy": 0.55, "brier": 0.42, "acc/route": 0.7},
            "holdout_tfidf": {"family_macro_accuracy": 0.52, "brier": 0.47},
            "holdout_vs_tfidf": {"family_macro_accuracy": {"delta": 0.03, "ci_low": 0.011, "ci_high": 0.049}}}
    text = render_card(card)
    holdout = text[text.index("## Holdout"):text.index("## Test")]
    assert "| metric | release | TF-IDF + LR | release − TF-IDF (95% CI) |" in holdout
    assert "| family_macro_accuracy | 0.5500 | 0.5200 | +0.0300 [+0.0110, +0.0490] |" in holdout
    assert "| brier | 0.4200 | 0.4700 | — |" in holdout and "acc/route" not in holdout
    # A card written before the classical column keeps its one-column table.
    old = render_card({**base, "holdout": {"brier": 0.42}})
    assert "| metric | value |" in old and "| brier | 0.4200 |" in old


def test_a_checkpoints_safety_thresholds_are_read_from_its_calibration(tmp_path: Path) -> None:
    import math

    from envloop_pipelines.core.release.tracked_runs import checkpoint_safety_thresholds
    from envloop_pipelines.core.model.calibration import Calibration

    (tmp_path / "calibration.json").write_text(json.dumps(
        Calibration(safety_thresholds={"needs_approval": math.inf, "share_ok": 0.93}).to_dict()))
    assert checkpoint_safety_thresholds(tmp_path) == {"needs_approval": math.inf, "share_ok": 0.93}
    (tmp_path / "calibration.json").write_text(json.dumps(Calibration().to_dict()))
    assert checkpoint_safety_thresholds(tmp_path) == {}


def hypothesis(round_key: str = "r0001", gate: Gate | None = None, **kw) -> Hypothesis:
    return Hypothesis(task="t", round=round_key, benchmark_version="t@abc", change={"kind": "data"}, predicted_delta=0.01,
                      gate=gate or Gate(), seeds=(1,), recipe_hash="h", **{"power": measured_power(0.01), **kw})


def test_gate_amendment_is_recorded_beside_the_original(tmp_path: Path) -> None:
    ledger = Ledger("t", tmp_path)
    ledger.register_hypothesis(hypothesis())
    with pytest.raises(LedgerError, match="needs a reason"):
        ledger.amend_gate("r0001", Gate(min_delta=0.0), " ")
    ledger.amend_gate("r0001", Gate(min_delta=0.0, max_ece=0.05), "ECE guard too loose for 3-level scores")
    assert ledger.effective_gate("r0001").max_ece == 0.05
    (amendment,) = ledger.amendments("r0001")
    assert amendment["original_gate"]["max_ece"] == Gate().max_ece and amendment["requires_fresh_seeds"]
    assert ledger.hypothesis("r0001").gate == Gate()  # the registered hypothesis is unchanged


LOOSE_GATES = [
    ({"floor_multiplier": 0.0}, "gate.floor_multiplier: must be at least 1 (got 0)"),
    ({"floor_multiplier": 0.99}, "gate.floor_multiplier: must be at least 1 (got 0.99)"),
    ({"floor_multiplier": float("nan")}, "gate.floor_multiplier: must be a finite number, got nan"),
    ({"require_ci_above_zero": False}, "gate.require_ci_above_zero: must be true (got false)"),
]


@pytest.mark.parametrize("loose, message", LOOSE_GATES)
def test_a_hypothesis_may_not_loosen_its_gate(tmp_path: Path, loose: dict, message: str) -> None:
    """Rule 2 at every door: a proposal's check, the ledger's registration, an amendment, the decision."""
    from envloop_pipelines.core.decision_loop.registered_hypothesis import proposal_errors

    assert any(message in e for e in proposal_errors({"gate": {"min_delta": 0.01, **loose}}))  # before any compute
    assert any(message in e for e in gate_errors(loose))
    ledger = Ledger("t", tmp_path)
    with pytest.raises(GateTooLooseError, match=re.escape(message)):
        ledger.register_hypothesis(hypothesis(gate=Gate(**loose)))
    assert ledger.hypothesis("r0001") is None and not list(ledger.events())  # nothing was written
    ledger.register_hypothesis(hypothesis())
    with pytest.raises(GateTooLooseError, match="gate amendment refused"):
        ledger.amend_gate("r0001", Gate(**loose), "the candidate is close; relax the bar")
    assert ledger.amendments("r0001") == []
    # A gate registered before the rule was enforced (an old ledger) still loads, and the decision applies the
    # floor and the CI anyway: a gain within the floor, or a CI touching zero, is not promoted.
    floor = noise_floor_from_arms("k", "family_macro_accuracy", [{"family_macro_accuracy": 0.60},
                                                                 {"family_macro_accuracy": 0.63}])
    within = decide_promotion(Gate(**loose), {"delta": 0.02, "ci_low": -0.01, "ci_high": 0.05}, floor, {}, {})
    assert not within.promote and within.checks["bar"] == pytest.approx(0.03)
    assert any("CI lower end" in r for r in within.reasons)


def test_a_stricter_gate_and_guard_amendments_are_allowed(tmp_path: Path) -> None:
    from envloop_pipelines.core.decision_loop.registered_hypothesis import proposal_errors

    strict = {"floor_multiplier": 2.0, "min_delta": 0.02, "max_ece": 0.05, "family_drop_tolerance": 0.03}
    assert proposal_errors({"gate": strict}) == []
    assert proposal_errors({"gate": {"floor_multiplier": 1}}) == []
    assert proposal_errors({"gate": {"floor": 1}}) == [
        "gate: unknown field 'floor' (allowed: primary_metric, direction, min_delta, floor_multiplier, "
        "require_ci_above_zero, max_ece, max_safety_fnr_increase, family_drop_tolerance)"]
    assert proposal_errors({"gate": {"min_delta": -1}}) == ["gate.min_delta: must be ≥ 0, got -1"]
    ledger = Ledger("t", tmp_path)
    ledger.register_hypothesis(hypothesis(gate=Gate(**strict)))
    # An amendment may move min_delta and the guards, never looser than the defaults (nor the floor and the CI).
    ledger.amend_gate("r0001", Gate(min_delta=0.0, max_ece=0.06, max_safety_fnr_increase=0.01), "3-level scores")
    assert ledger.effective_gate("r0001") == Gate(min_delta=0.0, max_ece=0.06, max_safety_fnr_increase=0.01)
    floor = noise_floor_from_arms("k", "family_macro_accuracy", [{"family_macro_accuracy": 0.60},
                                                                 {"family_macro_accuracy": 0.63}])
    doubled = decide_promotion(Gate(**strict), {"delta": 0.05, "ci_low": 0.01, "ci_high": 0.09}, floor, {}, {})
    assert not doubled.promote and doubled.checks["bar"] == pytest.approx(0.06)  # 2 x the floor


def test_tampered_hypothesis_file_is_detected(tmp_path: Path) -> None:
    ledger = Ledger("t", tmp_path)
    ledger.register_hypothesis(hypothesis())
    path = ledger.hypothesis_path("r0001")
    body = json.loads(path.read_text())
    body["predicted_delta"] = 0.5
    path.write_text(json.dumps(body))
    with pytest.raises(LedgerError, match="no longer matches its registered hash"):
        ledger.hypothesis("r0001")


def test_budget_stops_on_rounds_patience_and_wall_time(tmp_path: Path) -> None:
    home = tmp_path
    start_loop("t", "L1", LoopBudget(max_rounds=3, patience=2, max_wall_s=100), home=home, now=0.0)
    ledger = Ledger("t", home)
    first = next_round("t", home=home, now=1.0)
    assert (first.round, first.run_key) == ("r0001", "L1:r0001")
    (home / "loops" / "t" / "rounds" / "r0001").mkdir(parents=True)
    assert next_round("t", home=home, now=1.0).round is None  # r0001 not decided yet
    ledger.append("round_decided", {"round": "r0001", "promoted": False, "observed_delta": 0.0}, key="decided:r0001")
    assert next_round("t", home=home, now=1.0).run_key == "L1:r0002"
    (home / "loops" / "t" / "rounds" / "r0002").mkdir(parents=True)
    ledger.append("round_decided", {"round": "r0002", "promoted": False, "observed_delta": 0.0}, key="decided:r0002")
    stop = next_round("t", home=home, now=1.0)
    assert stop.round is None and "patience spent" in stop.reason
    # A new loop starts after the last round; the same loop id again is a no-op (a replayed schedule tick).
    start_loop("t", "L2", LoopBudget(max_rounds=5, patience=5, max_wall_s=10), home=home, now=0.0)
    assert start_loop("t", "L2", LoopBudget(max_rounds=1), home=home).budget.max_rounds == 5
    assert next_round("t", home=home, now=5.0).round == "r0003"
    assert "wall time spent" in next_round("t", home=home, now=50.0).reason


def test_card_limitations_hold_for_the_task_at_hand(tmp_path: Path) -> None:
    """The built-in benchmark's cards say its hidden splits hold an unseen renderer; an imported task's do not."""
    from envloop_pipelines.core.benchmark.builtin_task import generate_builtin_task
    from envloop_pipelines.core.data.datasets import import_file
    from envloop_pipelines.core.data.snapshots import open_task
    from envloop_pipelines.core.release.card import benchmark_limitations

    from .data.test_snapshots import dataset

    generate_builtin_task(task="personal_agent", n_users=40, records_per_user=2, home=tmp_path / "builtin")
    builtin = open_task("personal_agent", home=tmp_path / "builtin")
    source, unseen = benchmark_limitations(builtin)
    assert source.startswith("The benchmark is the built-in synthetic generator (personal_agent: 40 users x 2 records")
    hidden = [r for s in ("test", "holdout") for r in builtin.table(s).column("renderer").to_pylist()]
    n_b = hidden.count("b")
    assert 0 < n_b < len(hidden) and set(builtin.table("train").column("renderer").to_pylist()) == {"a"}
    assert unseen.startswith("Test and holdout users are unseen during training (the splits are disjoint on meta.user_id)")
    assert f"use a second renderer ('b') that training never saw ({n_b} of {len(hidden)})" in unseen

    imported = import_file(dataset(tmp_path), "tickets", home=tmp_path / "imported")
    source, unseen = benchmark_limitations(imported)
    assert source.startswith("The benchmark is imported data (d.jsonl, sha256 ")
    assert unseen == ("Test and holdout groups (meta.user_id) are unseen during training "
                      "(the splits are disjoint on meta.user_id).")
    assert "renderer" not in " ".join(benchmark_limitations(imported))
