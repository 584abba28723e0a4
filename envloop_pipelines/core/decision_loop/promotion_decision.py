"""The round's promotion decision (the asset ``promotion_decision``): the registered gate applied; a release on promotion.

A round is decided once: the decision record rides on the round's ``round_decided`` ledger event
(``Ledger.round_decision``), and a retry returns it unchanged instead of deciding and publishing again.
The step's record at ``rounds/<round>/promotion_decision.json`` is the IO manager's to write, from the
value this function returns (core writes no step record at the IO manager's path).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from envloop_pipelines.core.data.snapshots import TaskSnapshot, require_same_benchmark
from envloop_pipelines.core.decision_loop.champion_noise_floor import gating_floor_error
from envloop_pipelines.core.decision_loop.training_dataset_snapshot import snapshot_rows
from envloop_pipelines.core.release.card import benchmark_limitations
from envloop_pipelines.core.ledger.event_log import (
    EVENT_CANDIDATE_REJECTED,
    EVENT_HYPOTHESIS_REFUTED,
    EVENT_ROUND_DECIDED,
    LedgerError,
)
from envloop_pipelines.core.ledger.ledger import Ledger
from envloop_pipelines.core.ledger.anchor import anchor_head, verify_ledger
from envloop_pipelines.core.loop.config import LoopConfig
from envloop_pipelines.core.loop.operating_point import measured_operating_point
from envloop_pipelines.core.loop.promotion import PromotionDecision, decide_promotion
from envloop_pipelines.core.release.publish import champion, publish_release, tfidf_baseline
from envloop_pipelines.core.decision_loop.step_records import (
    MeasuredNoiseFloor,
    Reevaluation,
    RegisteredHypothesis,
    RoundDecision,
    TrainedCheckpoint,
    TrainingSnapshot,
)
from envloop_pipelines.core.ledger.store import RoundStore
from envloop_pipelines.core.sandbox import SandboxSettings
from envloop_pipelines.core.tracking import Tracker

PROMOTION_DECISION = "promotion_decision"


def decide_round(config: LoopConfig, task: TaskSnapshot, hypothesis: RegisteredHypothesis, snapshot: TrainingSnapshot,
                 candidate: TrainedCheckpoint, reeval: Reevaluation, noise_floor: MeasuredNoiseFloor,
                 tracker: Tracker, *, run_tags: Mapping[str, str] | None = None,
                 sandbox: SandboxSettings | None = None) -> RoundDecision:
    """Apply the registered (or amended) gate; on promotion read the holdout once and publish a release.

    ``task`` is the task's snapshot the step opened: on promotion its holdout is read and its train rows fit
    the card's TF-IDF baseline.
    ``sandbox``: the deployment's sandbox, where the verifier reads the holdout (default: the local backend).
    """
    key = reeval.round
    store = RoundStore(config.task, config.home)
    ledger = Ledger(config.task, config.home)
    verify_ledger(ledger, tracker)  # a broken chain or a removed tail: no decision (issue 34)
    decided = ledger.round_decision(key)
    if decided is not None:
        return RoundDecision.from_dict(decided)  # decided once; a retry reports the same decision
    existing = store.load(PROMOTION_DECISION, RoundDecision, key)  # a round decided before the ledger carried it
    if existing is not None:
        return existing
    registered = ledger.require_hypothesis(key)
    gate = ledger.effective_gate(key)
    ledger.require_fresh_seed(key, candidate.seed)  # after an amendment: a candidate on fresh seeds only
    champ = champion(config)
    require_same_benchmark(reeval.benchmark_version, registered.benchmark_version, champ["benchmark_version"],
                           noise_floor.benchmark_version)
    mismatch = floor_recipe_error(noise_floor, registered.recipe_hash, champ) or gating_floor_error(
        noise_floor, champ) or candidate_recipe_error(config, registered, candidate)
    if mismatch:
        raise FloorRecipeError(f"round {key}: no decision: {mismatch}")  # before anything is written
    ledger.require_unread_candidate(key)  # no redraw on test: a candidate someone else read is ineligible
    edited = reeval_result_error(ledger, reeval)
    if edited:
        raise LedgerError(f"round {key}: no decision: {edited}")  # before anything is written
    delta = reeval.delta(gate.primary_metric)
    verdict = decide_promotion(gate, delta, noise_floor.floor, reeval.candidate, reeval.champion,
                               config.guarded_families(task), paired=reeval.paired,
                               answers_as_champion=ledger.candidate_answers_as_champion(key))
    scores = {"champion_score": reeval.champion.get(gate.primary_metric),
              "candidate_score": reeval.candidate.get(gate.primary_metric)}
    verdict = PromotionDecision(verdict.promote, verdict.reasons,
                                {**verdict.checks, **power_checks(registered, delta), **scores,
                                 "noise_floor_source": noise_floor.source})
    decision = RoundDecision.of(key, verdict, delta=delta, noise_floor=noise_floor.floor.floor, hypothesis=registered,
                                gate=gate)
    if verdict.promote:
        # The bench measures the gate over a control-arm champion and its control floor: a round gated by a
        # lineage floor is another design, whose operating point is not on record.
        point = measured_operating_point(noise_floor.benchmark_version, noise_floor.recipe_hash,
                                         len(noise_floor.floor.values), registered.gate.__dict__) \
            if noise_floor.source == "control" else None
        limitations = [*benchmark_limitations(task), floor_limitation(point, registered.change, noise_floor)]

        def card(release: int, holdout: dict[str, Any]) -> dict[str, Any]:
            return {
                "round": key, "task": config.task, "parent_release": champ["release"],
                "benchmark_version": reeval.benchmark_version, "data_snapshot": snapshot.sha256,
                "recipe_hash": registered.recipe_hash, "checkpoint_dir": candidate.checkpoint,
                "checkpoint_sha256": candidate.checkpoint_sha256,
                "parent_checkpoint_sha256": champ["checkpoint_sha256"],
                "test": reeval.candidate, "parent_test": reeval.champion,
                "tfidf_baseline_test": reeval.tfidf_baseline, "paired_deltas": reeval.deltas,
                "gate": registered.gate.__dict__, "effective_gate": gate.__dict__,
                "amendments": ledger.amendments(key), "noise_floor": noise_floor.floor.floor,
                "noise_floor_source": floor_source(noise_floor), "guards": verdict.checks,
                "hypothesis_hash": registered.hash, "predicted_delta": registered.predicted_delta,
                "power": registered.power,
                "change": {"kind": registered.change.get("kind"), "clusters": registered.change.get("clusters"),
                           "n_new_examples": registered.change.get("n_new_examples"),
                           **{k: registered.change[k] for k in ("lever", "recipe_diff", "init", "prediction")
                              if k in registered.change}},
                "observed_delta": delta["delta"], "train_s": candidate.train_s,
                "gate_operating_point": point, "limitations": limitations,
            }

        release = publish_release(config, tracker, checkpoint=Path(candidate.checkpoint), snapshot=task,
                                  tfidf=tfidf_baseline(config, task, snapshot_rows(snapshot)),
                                  holdout_out=store.round_dir(key) / "candidate_holdout_predictions.parquet",
                                  card=card, round_key=key, run_tags=run_tags, sandbox=sandbox)
        decision = _with_release(decision, release.release, release.model_version)
    else:
        ledger.append(EVENT_CANDIDATE_REJECTED, {"round": key, "reasons": list(verdict.reasons), "delta": delta,
                                                 "noise_floor": noise_floor.floor.floor,
                                                 "checkpoint_sha256": candidate.checkpoint_sha256,
                                                 "candidate": reeval.candidate, "champion": reeval.champion},
                      key=f"rejected:{key}")
        ledger.append(EVENT_HYPOTHESIS_REFUTED, {"round": key, "hash": registered.hash}, key=f"refuted:{key}")
    ledger.append(EVENT_ROUND_DECIDED, {"round": key, "promoted": verdict.promote, "observed_delta": delta["delta"],
                                        "release": decision.release, "decision": decision.to_dict(),
                                        "lever": registered.change.get("lever") or registered.change.get("kind"),
                                        "train_s": candidate.train_s,
                                        "champion_checkpoint_sha256": champ["checkpoint_sha256"]},
                  key=f"decided:{key}")
    anchor_head(ledger, tracker)
    return decision


def floor_source(floor: MeasuredNoiseFloor) -> dict[str, Any]:
    """The card's ``noise_floor_source``: which floor gated the round (``control`` or ``lineage``), its key and
    values, and for a lineage floor the champion and the making its arms repeated."""
    out: dict[str, Any] = {"source": floor.source, "key": floor.floor.key, "values": list(floor.floor.values),
                           "floor": floor.floor.floor}
    if floor.source != "control":
        out.update({"control_key": floor.control_key, "champion_checkpoint_sha256": floor.champion_checkpoint_sha256,
                    "making": dict(floor.making or {})})
    return out


def floor_limitation(point: Mapping[str, Any] | None, change: Mapping[str, Any],
                     floor: MeasuredNoiseFloor | None = None) -> str:
    """What the card says of the floor that gated the round (issue 45, item 2).

    A lineage floor (the champion was made by a round, ``champion_noise_floor``): its K values, the champion and
    its making repeated with fresh seeds. The control floor (the champion is release 1, its control arm): measured
    on the control recipe from the base model, and whether that floor is shown to bound the seed spread at a
    longer lineage (the budget lever's 324-step champion, measured by ``bench/bench_gate_evidence.py`` at this
    design), or not measured there."""
    if floor is not None and floor.source != "control":
        making = floor.making or {}
        values = ", ".join(f"{v:.4f}" for v in floor.floor.values)
        started = (f"from release {making.get('parent_release')}" if making.get("init") != "base"
                   else "from the base model")
        return (f"The noise floor that gated this round was measured at the champion's own making: release "
                f"{making.get('release')} (round {making.get('round')}, recipe_diff "
                f"{dict(making.get('recipe_diff') or {})}, trained {started} on snapshot "
                f"{str(making.get('training_snapshot'))[:12]}) and {len(floor.floor.values) - 1} lineage arm(s) "
                f"repeating it with fresh seeds, {floor.floor.metric} {values} on test: spread "
                f"{floor.floor.floor:.4f} (the control recipe's floor does not bound such a lineage at the README "
                f"demo's design, bench/bench_gate_evidence.py).")
    text = "The noise floor measures seed variance of the control recipe trained from the base model"
    spread = (point or {}).get("lineage_spread")
    if spread:
        verdict = "bounds" if spread["bounded"] else "does not bound"
        return (f"{text}; at this design the seed sd at the {spread['lineage_steps']}-step lineage of one budget "
                f"round is {spread['lineage_sd']:.4f} against {spread['control_sd']:.4f} at the control recipe "
                f"(n = {spread['n_lineage']} and {spread['n_control']}), so the control floor {verdict} it "
                f"({point.get('measured', 'undated')}, bench/bench_gate_evidence.py).")
    lineage = "trained on from its parent" if change.get("init") != "base" else "retrained with another recipe"
    return (f"{text}; this release is {lineage}, and no seed spread at such a lineage is on record at this design "
            f"to show that floor bounds it (bench/bench_gate_evidence.py measures it).")


class FloorRecipeError(LedgerError):
    """The noise floor handed to a decision measures another recipe than the candidate's parent."""


def floor_recipe_error(noise_floor: MeasuredNoiseFloor, round_recipe_hash: str,
                       champ: Mapping[str, Any]) -> str | None:
    """Why ``noise_floor`` cannot gate this round, or ``None`` when it can.

    The floor's arms are seeds of one recipe (``noise_floor.recipe_hash``); its spread and seed bound say
    how far that recipe's seeds land apart and where the champion, a descendant of its control arm, sits.
    They gate a round only when the champion (the candidate's parent, its release card's ``recipe_hash``)
    and the round (the recipe its candidate is trained with, ``hypothesis.recipe_hash``) are that recipe.
    """
    floor_hash = noise_floor.recipe_hash
    parent = champ.get("recipe_hash")
    if parent is not None and parent != floor_hash:
        return (f"noise_floor.recipe_hash {str(floor_hash)[:16]} is not the recipe of the candidate's parent "
                f"(release {champ.get('release')}, recipe_hash {str(parent)[:16]}): the floor measures another "
                f"recipe's seed noise; measure the floor with the champion's recipe (recipe, recipe_overrides)")
    if round_recipe_hash != floor_hash:
        return (f"noise_floor.recipe_hash {str(floor_hash)[:16]} is not the round's recipe (hypothesis.recipe_hash "
                f"{str(round_recipe_hash)[:16]}): the round ran with another recipe or recipe_overrides "
                f"than the floor was measured with; run it with the floor's")
    return None


def candidate_recipe_error(config: LoopConfig, registered: Any, candidate: TrainedCheckpoint) -> str | None:
    """Why the candidate was not trained with the round's registered recipe, or ``None`` when it was (issue 34).

    One recipe from registration to card: the loop's recipe of this run (``config``: its recipe file and
    ``recipe_overrides``) must be the one the hypothesis registered (``hypothesis.recipe_hash``, the floor's,
    checked by :func:`floor_recipe_error`), and the recipe recorded in the checkpoint must be that recipe with
    the hypothesis's ``recipe_diff`` and the candidate's seed. A split run (the hypothesis registered under
    one recipe, the candidate trained or decided under other ``recipe_overrides``) is refused, naming both.
    """
    from envloop_pipelines.core.decision_loop.lora_checkpoint import loop_recipe_error
    from envloop_pipelines.core.ledger.hypothesis import recipe_diff
    from envloop_pipelines.core.model.checkpoint import read_recipe
    from envloop_pipelines.core.model.recipe import recipe_hash

    split = loop_recipe_error(config, registered)
    if split:
        return split
    expected = recipe_hash(config.load_recipe().replace(**recipe_diff(registered.change), seed=candidate.seed))
    trained = recipe_hash(read_recipe(candidate.checkpoint))
    if trained != expected:
        return (f"recipe_hash: the candidate checkpoint {candidate.checkpoint_sha256[:12]} was trained with recipe_hash "
                f"{trained[:16]}, not the hypothesis's recipe with its recipe_diff and seed {candidate.seed} "
                f"({expected[:16]}; hypothesis.recipe_hash {str(registered.recipe_hash)[:16]}): train the candidate "
                f"again under the registration's recipe")
    return None


def reeval_result_error(ledger: Ledger, reeval: Reevaluation) -> str | None:
    """Why the re-evaluation handed to the decision is not what the verifier answered, or ``None`` (issue 34).

    The verifier's paired read of the candidate records the sha256 of its aggregates on the round's own
    ``test_read`` event (``result_sha256``); the decision recomputes it from the re-evaluation's candidate,
    champion and paired numbers, so an edited ``independent_reeval.json`` is refused, not promoted. A read
    recorded before the digest existed is not checked.
    """
    from envloop_pipelines.core.verify.runner import read_result_digest

    read = ledger.round_candidate_read(reeval.round)
    if read is None:
        return (f"independent_reeval: the round has no paired test read of its candidate in {ledger.events_path}; "
                f"its re-evaluation is not the verifier's")
    recorded = read.get("result_sha256")
    if recorded is None:
        return None
    got = read_result_digest(reeval.candidate, reeval.champion, reeval.paired)
    if got != recorded:
        return (f"independent_reeval: its numbers hash to {got[:16]}, not the verifier's recorded result "
                f"(test_read event {read.get('event_id')}, result_sha256 {recorded[:16]}): the re-evaluation's "
                f"record was edited; materialize independent_reeval again")
    return None


def power_checks(registered: Any, delta: Mapping[str, Any]) -> dict[str, Any]:
    """The registered MDE beside the round's own CI half-width (printed on the round's line)."""
    power = registered.power or {}
    low, high = delta.get("ci_low"), delta.get("ci_high")
    half = (float(high) - float(low)) / 2 if isinstance(low, (int, float)) and isinstance(high, (int, float)) else None
    return {"mde": power.get("mde"), "mde_se": power.get("se"), "ci_half_width": half}


def _with_release(decision: RoundDecision, release: int, model_version: str) -> RoundDecision:
    from dataclasses import replace

    return replace(decision, release=release, model_version=model_version)


__all__ = ["PROMOTION_DECISION", "FloorRecipeError", "candidate_recipe_error", "decide_round", "floor_recipe_error", "power_checks"]
