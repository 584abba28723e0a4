"""RL from verified attempts, as a round of the loop: sample, keep what the verifier passed, SFT, re-evaluate, gate.

A round over an environment dataset whose environments are split ``train`` / ``heldout`` is seven
typed steps (:mod:`~envloop_pipelines.core.rl_loop.round_steps`, one Dagster asset each in ``defs/rl/assets.py``;
their records in :mod:`~envloop_pipelines.core.rl_loop.step_records`; :func:`run_rl_round` calls them in order
without Dagster):

1. **Hypothesis** (``rl_hypothesis``, rule 1): the change, the predicted gain in held-out pass@1, the gate,
   the seeds, the test's minimum detectable effect and the parent policy are registered in the ledger and
   MLflow before any attempt is sampled; the gate may be stricter, never looser, than the measured floor and
   a paired CI above zero (rule 2, :meth:`Ledger.register_hypothesis`).
2. **Sampling** (``rl_sampled_attempts``): K attempts per training environment by the sampler (a given
   agent, else the parent policy served by the caller's :class:`~.round_steps.PolicyServer`), each in its own
   sandbox.
3. **SFT snapshot** (``rl_sft_snapshot``, rule 7): the passed attempts as chat rows with provenance,
   contamination-checked against the held-out environments, content-addressed.
4. **Training** (``rl_policy_checkpoint``): LoRA SFT of the base model on the snapshot, on the hypothesis's
   seed or, after a gate amendment, the fresh seed it requires (:meth:`Ledger.candidate_seeds`, rule 3).
5. **Noise floor** (``rl_noise_floor``, rule 2): ``noise_arms`` null arms (the candidate's recipe and
   snapshot, other seeds; identity checked before any compute), each scored on the held-out environments;
   their spread is the floor.
6. **Re-evaluation** (``rl_heldout_reeval``, rule 4): candidate and parent, each served, K attempts per
   held-out environment with the same sampling seeds; only aggregates leave (each arm's pass@1 with its CI,
   the paired delta with a percentile-bootstrap CI over environments, both from ``agents/stats.py``).
7. **Decision** (``rl_decision``): the registered (or amended) gate, the floor and the CI through the
   decision loop's :func:`~envloop_pipelines.core.loop.promotion.decide_promotion`; a rejection is recorded
   (``candidate_rejected``, ``hypothesis_refuted``); a promotion is published as the decision loop's are
   (:func:`~envloop_pipelines.core.release.publish.release_checkpoint`): the held-out split read once for the
   release (:meth:`Ledger.read_holdout_once`), the policy checkpoint logged as the release run's artifact,
   registered as a version of the task's model and given the champion alias, and the release card naming the
   policy checkpoint the next round samples with. ``round_decided`` either way, carrying the decision record.

A round with no verified attempt has nothing to train on: steps 4 to 6 are skipped and it is decided as a
rejection with that reason. Limitations: the environment datasets have two splits, so a release's one
holdout read is of the same held-out split the gate used (counted once per release, as rule 4 asks); the
floor is measured per round, on that round's snapshot.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from envloop_pipelines.core.loop.config import round_key
from envloop_pipelines.core.ledger.event_log import (
    EVENT_CANDIDATE_REJECTED,
    EVENT_HYPOTHESIS_REFUTED,
    EVENT_ROUND_DECIDED,
)
from envloop_pipelines.core.ledger.ledger import Ledger
from envloop_pipelines.core.loop.promotion import decide_promotion
from envloop_pipelines.core.rl_loop.round_config import CHANGE_KIND, RL_METRIC, RlRoundConfig
from envloop_pipelines.core.rl_loop.step_records import (
    HoldoutComparison,
    RlCandidate,
    RlHypothesis,
    RlNoiseFloor,
    RlReevaluation,
    RlRoundResult,
    RlSampling,
    RlSnapshot,
)
from envloop_pipelines.core.rl_loop.round_steps import (
    PolicyServer,
    build_rl_snapshot,
    measure_rl_noise_floor,
    reevaluate_rl,
    register_rl_hypothesis,
    sample_attempts,
    train_rl_candidate,
)
from envloop_pipelines.core.release.card import paired_text
from envloop_pipelines.core.release.publish import HoldoutRead, release_checkpoint
from envloop_pipelines.core.release.tracked_runs import round_run
from envloop_pipelines.core.ledger.store import RoundStore
from envloop_pipelines.core.model.causal_sft import RECIPE_FILE, read_policy_checkpoint
from envloop_pipelines.core.tracking import Tracker

#: The decision step (under Dagster the RL IO manager stores its record as ``rounds/<round>/rl_decision.json``;
#: the decision itself lives in the ledger's ``round_decided`` event).
RL_DECISION = "rl_decision"


def next_rl_round(config: RlRoundConfig) -> str:
    """The next round key of the task (after every started or registered round)."""
    store, ledger = RoundStore(config.task, config.home), Ledger(config.task, config.home)
    registered = {int(p.stem[1:]) for p in (ledger.root / "hypotheses").glob("r*.json") if p.stem[1:].isdigit()}
    return round_key(max(set(store.started_rounds()) | registered | {0}) + 1)


def run_rl_round(config: RlRoundConfig, dataset: Any, tracker: Tracker, serve: PolicyServer, *,
                 key: str | None = None) -> RlRoundResult:
    """One RL round without Dagster: the steps of :mod:`.round_steps` in order, each handed the records it needs.

    The steps' records are not stored here (under Dagster the RL IO manager stores them): the round's
    artifacts are content-addressed or kept by the steps themselves (the sampled attempts, the SFT
    snapshot, the policy checkpoints) and its decision lives in the ledger (:func:`decided_rl_round`).

    Args:
        config: the round's settings.
        dataset: the environment dataset (``name``, ``version``, ``environments`` with ``split`` train / heldout).
        tracker: MLflow.
        serve: serves a policy checkpoint or the base model (``defs/rl/serving.py``: ``envloop serve``'s app).
        key: the round key (default: the next one of this task).

    Returns:
        The decision; a retry of a decided round returns the ledger's without sampling again.
    """
    key = key or next_rl_round(config)
    done = decided_rl_round(config, key)
    if done is not None:
        return done
    hypothesis = register_rl_hypothesis(config, dataset, key, tracker)
    sampling = sample_attempts(config, dataset, hypothesis, tracker, serve)
    snapshot = build_rl_snapshot(config, dataset, sampling, tracker)
    candidate = train_rl_candidate(config, hypothesis, snapshot, tracker)
    floor = measure_rl_noise_floor(config, dataset, snapshot, candidate, tracker, serve)
    reeval = reevaluate_rl(config, dataset, hypothesis, candidate, tracker, serve)
    return decide_rl_round(config, tracker, hypothesis, sampling, snapshot, candidate, floor, reeval)


def decided_rl_round(config: RlRoundConfig, key: str) -> RlRoundResult | None:
    """The round's decision, or ``None`` while it is undecided: the record its ``round_decided`` ledger event
    carries (:meth:`Ledger.round_decision`), else, for a round decided before the event carried it, the
    record stored as ``rounds/<round>/rl_decision.json``."""
    raw = Ledger(config.task, config.home).round_decision(key)
    if raw is not None:
        return RlRoundResult.from_dict(raw)
    return RoundStore(config.task, config.home).load(RL_DECISION, RlRoundResult, key)


def decide_rl_round(config: RlRoundConfig, tracker: Tracker, hypothesis: RlHypothesis, sampling: RlSampling,
                    snapshot: RlSnapshot, candidate: RlCandidate, floor: RlNoiseFloor,
                    reeval: RlReevaluation) -> RlRoundResult:
    """Apply the round's registered (or amended) gate to the held-out comparison and the floor; record the outcome.

    A rejection is written to the ledger with its numbers (``candidate_rejected``, ``hypothesis_refuted``); a
    promotion reads the held-out split once for the new release and writes its card (rules 4 and 6).
    ``round_decided`` either way, carrying the decision record, so that a retry returns it
    (:func:`decided_rl_round`); nothing is written at the IO manager's path. After a gate
    amendment the candidate must have been trained on the fresh seeds it requires (rule 3): its seed is
    read from its policy checkpoint's recipe (:func:`candidate_seed`).

    Raises:
        LedgerError: after an amendment, a candidate trained on a seed used before it (nothing is recorded).
    """
    key = hypothesis.round
    done = decided_rl_round(config, key)
    if done is not None:
        return done  # decided once
    ledger = Ledger(config.task, config.home)
    registered = ledger.require_hypothesis(key)
    name, _, version = registered.benchmark_version.rpartition("@")
    seconds = {"sampling": sampling.seconds, "training": candidate.seconds, "noise_floor": floor.seconds,
               "reevaluation": reeval.seconds}
    result = RlRoundResult(round=key, task=config.task, dataset=name, dataset_version=version,
                           hypothesis_hash=registered.hash, sampler=dict(hypothesis.sampler),
                           snapshot={k: v for k, v in snapshot.to_dict().items() if k != "round"}, promoted=False,
                           reasons=(candidate.skipped,) if candidate.skipped else (), seconds=seconds)
    parent_run_id = round_run(tracker, config.loop_config(), key).run_id
    if candidate.skipped or reeval.comparison is None or floor.floor is None:
        return _record_rejection(ledger, tracker, parent_run_id, result)
    if ledger.amendments(key):  # rule 3: an amended gate is passed on fresh seeds only
        ledger.require_fresh_seed(key, candidate_seed(candidate))
    comparison = reeval.comparison
    # The arms are seeds of the candidate's recipe, not draws of the parent: the spread is the floor, and
    # the seed bound (arms' prediction bound minus the parent) does not apply.
    verdict = decide_promotion(ledger.effective_gate(key), comparison.delta, floor.floor,
                               {RL_METRIC: comparison.candidate.pass_at_1}, {RL_METRIC: comparison.parent.pass_at_1},
                               apply_seed_bound=False, calibrated=False)  # pass@1: no probabilities, no ECE
    result = replace(result, promoted=verdict.promote, reasons=tuple(verdict.reasons), comparison=comparison.to_dict(),
                     noise_floor=floor.floor.to_dict(), checks=dict(verdict.checks),
                     candidate={"checkpoint_sha256": candidate.checkpoint_sha256, "path": candidate.path,
                                "model": candidate.model, "seed": candidate.seed, "first_loss": candidate.first_loss,
                                "last_loss": candidate.last_loss})
    tracker.log_metrics(parent_run_id, {f"candidate.{RL_METRIC}": comparison.candidate.pass_at_1,
                                        f"champion.{RL_METRIC}": comparison.parent.pass_at_1,
                                        f"delta.{RL_METRIC}": comparison.delta["delta"], "noise_floor": floor.floor.floor})
    if not verdict.promote:
        return _record_rejection(ledger, tracker, parent_run_id, result)
    return _publish(config, ledger, tracker, parent_run_id, result, comparison)


def candidate_seed(candidate: RlCandidate | Mapping[str, Any] | None) -> Any:
    """The seed a candidate policy was trained on: its checkpoint's recipe (the manifest checked), else the
    ``seed`` the record gives; ``None`` when neither says."""
    raw = candidate.to_dict() if isinstance(candidate, RlCandidate) else dict(candidate or {})
    if raw.get("path"):
        import yaml

        checkpoint = read_policy_checkpoint(raw["path"])  # refuses a checkpoint whose files changed
        return yaml.safe_load((Path(checkpoint.path) / RECIPE_FILE).read_text(encoding="utf-8")).get("seed")
    return raw.get("seed")


def _record_rejection(ledger: Ledger, tracker: Tracker, parent_run_id: str,
                      result: RlRoundResult) -> RlRoundResult:
    key = result.round
    delta = (result.comparison or {}).get("delta")
    ledger.append(EVENT_CANDIDATE_REJECTED, {
        "round": key, "reasons": list(result.reasons), "delta": delta,
        "noise_floor": (result.noise_floor or {}).get("floor"),
        "checkpoint_sha256": (result.candidate or {}).get("checkpoint_sha256"),
        "candidate": (result.comparison or {}).get("candidate"), "champion": (result.comparison or {}).get("parent"),
        "sft_snapshot": result.snapshot.get("sha256"), "change_kind": CHANGE_KIND}, key=f"rejected:{key}")
    ledger.append(EVENT_HYPOTHESIS_REFUTED, {"round": key, "hash": result.hypothesis_hash}, key=f"refuted:{key}")
    ledger.append(EVENT_ROUND_DECIDED, {"round": key, "promoted": False,
                                        "observed_delta": None if delta is None else delta["delta"], "release": None,
                                        "decision": result.to_dict()}, key=f"decided:{key}")
    tracker.end_run(parent_run_id)
    return result


def _publish(config: RlRoundConfig, ledger: Ledger, tracker: Tracker, parent_run_id: str,
             result: RlRoundResult, comparison: HoldoutComparison) -> RlRoundResult:
    """The release, through the loops' one publishing path (:func:`~envloop_pipelines.core.release.publish.release_checkpoint`):
    the held-out split read once for it, the policy checkpoint as its run's artifact, registered as a version of
    the task's model and made champion, and its card naming the policy checkpoint."""
    key = result.round
    hypothesis = ledger.require_hypothesis(key)
    candidate = dict(result.candidate or {})

    def read(ledger: Ledger, release: int) -> HoldoutRead:
        # Keyed by the checkpoint: a retry after a crash between this read and the card finishes from the stored read.
        return HoldoutRead(metrics=ledger.read_holdout_once(
            release, lambda: {"candidate": comparison.candidate.to_dict(), "parent": comparison.parent.to_dict()},
            key=f"checkpoint:{candidate['checkpoint_sha256']}"))

    recipe = config.load_recipe()

    def card(release: int, holdout: HoldoutRead) -> dict[str, Any]:
        return {
            "round": key, "task": config.task, "kind": CHANGE_KIND, "dataset": f"{result.dataset}@{result.dataset_version}",
            "data_snapshot": result.snapshot["sha256"], "recipe_hash": recipe.hash,
            "checkpoint_sha256": candidate["checkpoint_sha256"], "policy_checkpoint": candidate["path"],
            "base_model": recipe.base_model, "test": comparison.to_dict(),
            "gate": asdict(hypothesis.gate), "effective_gate": asdict(ledger.effective_gate(key)),
            "amendments": ledger.amendments(key), "noise_floor": (result.noise_floor or {}).get("floor"),
            "guards": dict(result.checks), "hypothesis_hash": hypothesis.hash,
            "predicted_delta": hypothesis.predicted_delta,
            "limitations": ["The held-out split is both the gate's test and the release's one holdout read (the "
                            "environment dataset has two splits).",
                            "The noise floor is the spread of null arms trained on this round's snapshot."],
        }

    published = release_checkpoint(config.loop_config(), tracker, checkpoint=Path(candidate["path"]), read_holdout=read,
                                   card=card, render=render_rl_card, round_key=key)
    result = replace(result, release=published.release, model_version=published.model_version)
    ledger.append(EVENT_ROUND_DECIDED, {"round": key, "promoted": True, "observed_delta": comparison.delta["delta"],
                                        "release": published.release, "decision": result.to_dict()},
                  key=f"decided:{key}")
    tracker.end_run(parent_run_id)
    return result


def render_rl_card(card: Mapping[str, Any]) -> str:
    """An RL release card as Markdown: the held-out pass@1 of the release and its parent (the one holdout read),
    the paired delta and the floor, the gate, the limitations."""
    holdout, delta = card["holdout"], (card.get("test") or {}).get("delta") or {}

    def arm(name: str, score: Mapping[str, Any]) -> str:
        return (f"| {name} | {score['pass_at_1']:.4f} | [{score['ci_low']:.4f}, {score['ci_high']:.4f}] | "
                f"{score['n_environments']} | {score['n_attempts']} |")

    floor = card.get("noise_floor")
    lines = [f"# Release {card['release']} — {card['task']} ({card['kind']})", "",
             f"- round: `{card['round']}`  dataset: `{card['dataset']}`  SFT snapshot: `{str(card['data_snapshot'])[:16]}`",
             f"- recipe: `{str(card['recipe_hash'])[:16]}`  base model: `{card['base_model']}`",
             f"- policy checkpoint: `{str(card['checkpoint_sha256'])[:16]}` (`{card['policy_checkpoint']}`)",
             f"- MLflow model version: {card.get('model_version')}", "", "## Held-out pass@1 (read once)", "",
             "| policy | pass@1 | 95% CI | environments | attempts |", "|---|---|---|---|---|",
             arm("release", holdout["candidate"]), arm("parent", holdout["parent"]), "",
             f"- paired delta release − parent: {paired_text(delta) or '—'}",
             f"- noise floor: {'—' if floor is None else f'{floor:.4f}'}", "", "## Gate", "",
             f"- registered: `{json.dumps(card.get('gate'), default=str)}`",
             f"- effective: `{json.dumps(card.get('effective_gate'), default=str)}`"]
    for a in card.get("amendments") or []:
        lines.append(f"- amendment: `{json.dumps(a['amended_gate'])}`, reason: {a['reason']}")
    lines += ["", "## Limitations", ""] + [f"- {x}" for x in card.get("limitations", [])]
    return "\n".join(lines) + "\n"


__all__ = ["RL_DECISION", "candidate_seed", "decide_rl_round", "decided_rl_round", "next_rl_round", "render_rl_card",
           "run_rl_round"]
