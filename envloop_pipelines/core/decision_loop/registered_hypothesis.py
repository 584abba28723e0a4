"""The asset ``registered_hypothesis``: the round's hypothesis, written to the ledger and MLflow before training.

A person's proposal is checked at every door by :func:`proposal_errors`; without a change the loop proposes its
own experiment (:func:`propose_change`, the levers of ``core/decision_loop/proposer.py``). The registration
records the test's power (rule 2): the minimum detectable effect at the measured paired noise
(:func:`paired_noise`) beside the predicted delta.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from envloop_pipelines.core.data.snapshots import TaskSnapshot
from envloop_pipelines.core.decision_loop.noise_floor import PRIMARY_METRIC, continuation_path, current_noise_floor, setup_reader
from envloop_pipelines.core.decision_loop.proposer import (
    PRIORS,
    Choice,
    Prediction,
    choose,
    diagnose,
    lever_records,
    predict_levers,
    refuted_on,
)
from envloop_pipelines.core.decision_loop.step_records import (
    EnvironmentSynthesis,
    MeasuredNoiseFloor,
    Reevaluation,
    RegisteredHypothesis,
)
from envloop_pipelines.core.ledger.anchor import anchor_head, verify_ledger
from envloop_pipelines.core.ledger.event_log import EVENT_ROUND_DECIDED, LedgerError
from envloop_pipelines.core.ledger.hypothesis import Gate, Hypothesis, draw_seeds
from envloop_pipelines.core.ledger.ledger import Ledger
from envloop_pipelines.core.ledger.store import RoundStore
from envloop_pipelines.core.loop.config import LoopConfig
from envloop_pipelines.core.loop.promotion import hypothesis_power
from envloop_pipelines.core.release.publish import champion
from envloop_pipelines.core.release.tracked_runs import child_run, verify_predictions
from envloop_pipelines.core.sandbox import SandboxSettings
from envloop_pipelines.core.storage import atomic_write_json
from envloop_pipelines.core.tracking import (
    KIND_HYPOTHESIS,
    TAG_HYPOTHESIS,
    TAG_KIND,
    TAG_ROUND,
    TAG_UNDERPOWERED,
    Tracker,
)

log = logging.getLogger(__name__)


#: Keys a person's hypothesis proposal may set.
PROPOSAL_KEYS = ("change", "predicted_delta", "gate", "seeds", "rationale")

def proposal_errors(proposal: Mapping[str, Any]) -> list[str]:
    """Everything wrong with a person's hypothesis proposal, checked before anything is registered or launched.

    The one check every door calls (CLI ``--hypothesis``, the SDK, the launchpad's ``proposal_json``, the
    registration step). Unknown fields; ``change`` (a non-empty object of kind ``data`` or ``recipe``, a
    ``recipe_diff`` with the recipe's fields only, not the loop's ``recipe_overrides``); ``predicted_delta``
    a finite number; ``seeds`` a list of distinct integers; a ``gate`` with unknown fields, bad values or
    any field looser than the default (:func:`~envloop_pipelines.core.ledger.hypothesis.gate_errors`), or on a
    metric the floor does not measure. Each message names the field. Fields left out are derived.
    """
    from envloop_pipelines.core.ledger.hypothesis import PROPOSAL_CHANGE_KINDS, hypothesis_errors, seed_count_errors

    if not isinstance(proposal, Mapping):
        return ["hypothesis: must be a JSON object (change, predicted_delta, gate, seeds, rationale)"]
    errors = [f"unknown field {k!r} (allowed: {', '.join(PROPOSAL_KEYS)})" for k in proposal if k not in PROPOSAL_KEYS]
    # What is left out is derived (a valid placeholder here); what is given is checked as registered.
    errors += hypothesis_errors(change=proposal.get("change", {"kind": "data"}),
                                predicted_delta=proposal.get("predicted_delta", 0.0),
                                seeds=[0], gate=proposal.get("gate", {}),
                                kinds=PROPOSAL_CHANGE_KINDS) + seed_count_errors(proposal.get("seeds", 1))
    if "rationale" in proposal and not isinstance(proposal["rationale"], str):
        errors.append(f"rationale: must be text, got {json.dumps(proposal['rationale'], default=str)}")
    if "gate" in proposal:
        errors += _unmeasured_metric(proposal["gate"])
    return errors

def _unmeasured_metric(gate: Any) -> list[str]:
    """A gate on a metric the noise floor does not measure would be held to a floor in another metric's units."""
    metric = gate.get("primary_metric", PRIMARY_METRIC) if isinstance(gate, Mapping) else PRIMARY_METRIC
    if metric == PRIMARY_METRIC:
        return []
    return [f"gate.primary_metric: the noise floor's null arms measure {PRIMARY_METRIC} only, so a gate on "
            f"{metric!r} would have no floor in its own units; got {metric!r}"]

def paired_noise(config: LoopConfig, task: TaskSnapshot, *,
                 sandbox: SandboxSettings | None = None) -> dict[str, Any] | None:
    """The standard error of a candidate-vs-champion paired delta on test: the noise a round's test works at.

    Pooled (root mean square of each pair's ``se``, per metric) over every pair of this loop's kind known
    before the round trains:

    - each **continuation arm** of the floor (``setup.measure_continuation_arms``: the loop's recipe, a
      fresh seed, trained from the control arm as a candidate is from its champion), paired with the
      control arm on test by the verifier (record-clustered bootstrap, aggregates only; once per floor,
      kept as ``noise/<key>.continuation-power.json``);
    - each **earlier round** of this ledger on the same benchmark and recipe: its candidate paired with
      its champion in its re-evaluation.

    The floor is the one of ``task``'s benchmark version (the snapshot the step opened).

    The null arms are not used: two seeds trained from the base model can nearly agree (the demo's hybrid
    readout: se 0.0027) while a candidate trained from the champion moves much further (se ~0.017).
    ``sandbox``: the deployment's sandbox, where the verifier pairs the arms (default: the local backend).

    Returns:
        ``{"noise_key", "source", "pairs": [...], "deltas": {metric: {"se", "confidence_level",
        "n_questions", "n_clusters", "n_pairs"}}}``, or ``None`` when the floor is not measured for this
        config or no pair exists.
    """
    try:
        measured = current_noise_floor(config, task)
    except LedgerError:
        return None
    store = RoundStore(config.task, config.home)
    pairs: list[dict[str, Any]] = []
    cache = store.noise / f"{measured.floor.key}.continuation-power.json"
    listed = continuation_path(store, measured.floor.key)
    arms = [a for a in json.loads(listed.read_text(encoding="utf-8"))["arms"]
            if a.get("test_predictions") and Path(a["test_predictions"]).is_file()] if listed.is_file() else []
    kept = json.loads(cache.read_text(encoding="utf-8")) if cache.is_file() else None
    if kept is not None and kept.get("seeds") == [a.get("seed") for a in arms]:
        pairs += kept["pairs"]
    elif arms and measured.floor.arms and measured.floor.arms[0].get("test_predictions"):
        control = measured.floor.arms[0]
        measured_pairs = []
        for i, arm in enumerate(arms, 1):
            # The setup's reads of test (the floor's), not the round's, though a round's registration asks.
            run = verify_predictions(config, "test", Path(arm["test_predictions"]),
                                     baseline=Path(control["test_predictions"]), seed=i, sandbox=sandbox,
                                     **setup_reader(config, measured.floor.key))
            measured_pairs.append({"source": f"continuation arm seed {arm.get('seed')} (trained from the control "
                                             f"arm, seed {control.get('seed')}) vs the control arm",
                                   "deltas": dict(run.paired["deltas"])})
        if measured_pairs:
            atomic_write_json(cache, {"noise_key": measured.floor.key, "seeds": [a.get("seed") for a in arms],
                                      "pairs": measured_pairs}, overwrite=True)
        pairs += measured_pairs
    ledger = Ledger(config.task, config.home)
    for event in ledger.events(EVENT_ROUND_DECIDED):
        key = event.get("round")
        hypothesis = ledger.hypothesis(key) if key else None
        reeval = store.load("independent_reeval", Reevaluation, key) if hypothesis is not None else None
        if (reeval is None or hypothesis.recipe_hash != measured.recipe_hash
                or reeval.benchmark_version != measured.benchmark_version):
            continue
        pairs.append({"source": f"round {key}: candidate vs champion", "deltas": dict(reeval.paired["deltas"])})
    if not pairs:
        return None
    deltas: dict[str, Any] = {}
    for metric in pairs[0]["deltas"]:
        rows = [p["deltas"].get(metric) or {} for p in pairs]
        ses = [r.get("se") for r in rows]
        if any(se is None or not math.isfinite(float(se)) for se in ses):
            continue
        first = rows[0]
        deltas[metric] = {"se": math.sqrt(float(np.mean(np.square(ses)))),
                          "confidence_level": first.get("confidence_level", 0.95),
                          "n_questions": first.get("n_questions"), "n_clusters": first.get("n_clusters"),
                          "n_pairs": len(ses)}
    return {"noise_key": measured.floor.key, "deltas": deltas, "pairs": [p["source"] for p in pairs],
            "source": "candidate-vs-champion paired se on test, root mean square over " + "; ".join(
                p["source"] for p in pairs)}

class UnmeasuredPowerError(LedgerError, ValueError):
    """A hypothesis whose minimum detectable effect cannot be measured; it is not registered."""

def _measured_power(config: LoopConfig, task: TaskSnapshot, key: str, gate: Gate, predicted: float,
                    sandbox: SandboxSettings | None, floor: MeasuredNoiseFloor | None = None) -> dict[str, Any]:
    """:func:`hypothesis_power` at the floor that gates the round (``floor``, the round's ``champion_noise_floor``;
    ``None``: as measured, ``current_gating_floor``), the champion and the paired noise; refused without an MDE."""
    from envloop_pipelines.core.decision_loop.champion_noise_floor import current_gating_floor

    if floor is not None and floor.recipe_hash != config.recipe_hash():
        floor = None  # the floor handed in measures another recipe: this recipe's is looked up (and may be missing)
    try:
        measured = floor if floor is not None else current_gating_floor(config, task)
    except LedgerError as exc:
        raise UnmeasuredPowerError(f"round {key}: hypothesis not registered: no minimum detectable effect: no noise "
                                   f"floor for this loop's recipe (recipe_hash {config.recipe_hash()[:16]}) and "
                                   f"benchmark ({exc}); materialize noise_floor with the round's recipe, "
                                   f"recipe_overrides and noise_arms") from None
    try:
        held = (champion(config).get("test") or {}).get(measured.floor.metric)
    except LedgerError:
        held = None
    power = hypothesis_power(paired_noise(config, task, sandbox=sandbox), gate, predicted, floor=measured.floor,
                             champion_score=float(held) if isinstance(held, (int, float)) else None)
    if power.get("mde") is None:
        raise UnmeasuredPowerError(f"round {key}: hypothesis not registered: no minimum detectable effect: "
                                   f"{power.get('why_unmeasured')} (noise floor {measured.floor.key}); materialize "
                                   f"noise_floor again: it trains the floor's continuation arm")
    return power

def propose_change(config: LoopConfig, task: TaskSnapshot, key: str, gate: Gate, synthesis: EnvironmentSynthesis,
                   sandbox: SandboxSettings | None, floor: MeasuredNoiseFloor | None = None) -> Choice | None:
    """The proposer's experiment for round ``key``: every lever predicted from the champion's diagnostics and
    the ledger's record, the best gain per CPU-second that clears the round's MDE (``core/decision_loop/proposer.py``).
    Nothing is written: the caller registers the choice. ``None`` without a champion (nothing to diagnose: a
    loop always has one, release 1 is the floor's control arm)."""
    from envloop_pipelines.core.model.recipe import recipe_to_dict

    ledger = Ledger(config.task, config.home)
    try:
        champ = champion(config)
    except LedgerError:
        return None
    mde = _measured_power(config, task, key, gate, 0.0, sandbox, floor).get("mde")
    recipe = config.load_recipe()
    diag = diagnose(champ, ledger.releases(), gate.primary_metric, recipe_to_dict(recipe))
    predictions = predict_levers(diag, loop_steps=int(recipe.max_steps or 0) or 24, records=lever_records(ledger.events()),
                                 n_clusters=len(synthesis.clusters) if synthesis.n_rows else 0,
                                 n_train=task.table("train").num_rows)
    chosen = choose(predictions, mde, refuted_on(ledger, str(champ.get("checkpoint_sha256"))),
                    max_seconds=config.max_lever_seconds)
    if chosen is None:  # every lever refuted on this champion: the failure clusters' data, as before the proposer
        data = Prediction(lever="data", change={"kind": "data", "lever": "data"}, predicted_delta=PRIORS["data"],
                          low=0.0, high=2 * PRIORS["data"], predicted_seconds=0.0, basis="prior",
                          rationale="every lever is refuted on this champion or over the round's compute cap")
        chosen = choose([data], mde)
    return chosen

def proposed_change(choice: Choice) -> dict[str, Any]:
    """The registered ``change`` of the proposer's choice: the lever's change and its prediction (range, seconds)."""
    p = choice.chosen
    return {**dict(p.change), "prediction": {"low": p.low, "high": p.high, "seconds": p.predicted_seconds,
                                             "basis": p.basis}}

def register_hypothesis(config: LoopConfig, task: TaskSnapshot, synthesis: EnvironmentSynthesis, tracker: Tracker, *,
                        proposal: Mapping[str, Any] | None = None,
                        run_tags: Mapping[str, str] | None = None,
                        sandbox: SandboxSettings | None = None,
                        noise_floor: MeasuredNoiseFloor | None = None) -> RegisteredHypothesis:
    """Write the round's hypothesis to MLflow and the ledger before any training.

    ``task`` is the snapshot the step opened: the hypothesis records its benchmark version, and its power is
    measured at the floor that gates the round: ``noise_floor`` (the round's ``champion_noise_floor``: the control
    floor while the champion is its control arm, else the champion's lineage floor), or as measured when ``None``.

    ``proposal`` (from a person) may set ``change`` (with ``recipe_diff`` for a recipe change),
    ``predicted_delta``, ``gate`` (``Gate`` fields), ``seeds`` and ``rationale``. Without a ``change`` the loop
    proposes its own (:func:`propose_change`): the lever with the best predicted gain per CPU-second that clears
    the round's MDE, its prediction (point, range, training seconds) and the diagnostics behind it in the
    change and the rationale.

    The registration records the test's power (rule 2): the minimum detectable effect of the primary
    metric at 80% power and the measured noise (:func:`paired_noise`, :func:`~envloop_pipelines.core.loop.promotion.hypothesis_power`)
    beside the predicted delta, and flags the hypothesis ``underpowered`` when its predicted effect is
    below it: in the hypothesis, its ledger event and its MLflow run (tag ``envloop.underpowered``).
    The flag changes no rule of the gate. A hypothesis whose MDE cannot be measured (no noise floor for
    this loop's recipe and benchmark, or no candidate-vs-champion pair to take the se from) is not
    registered: :class:`UnmeasuredPowerError`, naming why, before anything is written. ``sandbox``: the
    deployment's sandbox, where the verifier measures that noise (default: the local backend).

    Raises:
        ValueError: the proposal has an unknown field, names the loop's override as its change, or
            loosens the gate below the measured floor and a paired CI above zero (rule 2).
        UnmeasuredPowerError: no MDE for the hypothesis (nothing written: ledger, MLflow, files).
    """
    key = synthesis.round
    proposal = dict(proposal or {})
    errors = proposal_errors(proposal)
    if errors:
        raise ValueError(f"round {key}: hypothesis proposal refused: " + "; ".join(errors))
    ledger = Ledger(config.task, config.home)
    verify_ledger(ledger, tracker)  # a broken chain or a removed tail refuses the next round (issue 34)
    gate = Gate(**proposal.get("gate", {}))
    registered = ledger.hypothesis(key)
    data_change = {"kind": "data", "generator": synthesis.generator, "clusters": list(synthesis.clusters),
                   "n_new_examples": synthesis.n_rows, "synthesis_sha256": synthesis.sha256}
    power = None
    proposed = propose_change(config, task, key, gate, synthesis, sandbox, noise_floor) \
        if registered is None and not proposal.get("change") else None  # the loop proposes its own experiment
    if proposed is not None:
        change, rationale = {**(data_change if proposed.chosen.lever == "data" else {}), **proposed_change(proposed)}, \
            proposed.rationale()
        predicted = float(proposal.get("predicted_delta", proposed.chosen.predicted_delta))
    else:
        change = proposal.get("change") or data_change
        rationale = proposal.get("rationale", f"target the top {len(synthesis.clusters)} failure clusters of the "
                                              f"champion on dev")
        past = [e["observed_delta"] for e in ledger.events(EVENT_ROUND_DECIDED) if e.get("observed_delta") is not None]
        # A person's change without a prediction: the mean observed gain of past rounds, or +0.01 for the first.
        predicted = float(proposal.get("predicted_delta", np.mean(past) if past else 0.01))
    if registered is None:
        power = _measured_power(config, task, key, gate, predicted, sandbox, noise_floor)
    hypothesis = registered or Hypothesis(  # immutable: a retry reuses what was registered
        task=config.task,
        round=key,
        benchmark_version=task.benchmark_version,
        change=change,
        predicted_delta=predicted,
        gate=gate,
        seeds=draw_seeds(proposal.get("seeds", 1)),  # drawn here, after the proposal is fixed (issue 34)
        recipe_hash=config.recipe_hash(),
        author="person" if proposal else "auto",
        rationale=rationale,
        power=power,
    )
    digest = ledger.register_hypothesis(hypothesis)
    anchor_head(ledger, tracker)
    if hypothesis.underpowered:
        log.warning("round %s: hypothesis underpowered: predicted %+.4f on %s, below the test's minimum detectable "
                    "effect %.4f (80%% power); the gate is unchanged", key, hypothesis.predicted_delta,
                    hypothesis.gate.primary_metric, (hypothesis.power or {})["mde"])
    run = tracker.find_run(config.task, {TAG_ROUND: key, TAG_KIND: KIND_HYPOTHESIS})
    if run is None:
        run = child_run(tracker, config, key, KIND_HYPOTHESIS, {**(run_tags or {}), TAG_HYPOTHESIS: digest})
        tracker.log_params(run.run_id, {"hash": digest, "predicted_delta": hypothesis.predicted_delta,
                                        "primary_metric": hypothesis.gate.primary_metric,
                                        "direction": hypothesis.gate.direction, "min_delta": hypothesis.gate.min_delta,
                                        "seeds": list(hypothesis.seeds), "author": hypothesis.author,
                                        "change": json.dumps(dict(hypothesis.change), sort_keys=True)})
        if hypothesis.power is not None and hypothesis.power.get("mde") is not None:
            tracker.log_params(run.run_id, {"mde": hypothesis.power["mde"], "mde_se": hypothesis.power["se"]})
            tracker.log_metrics(run.run_id, {"mde": hypothesis.power["mde"],
                                             "predicted_delta": hypothesis.predicted_delta})
            tracker.set_tags(run.run_id, {TAG_UNDERPOWERED: str(hypothesis.underpowered).lower()})
        tracker.log_artifact(run.run_id, ledger.hypothesis_path(key))
        tracker.end_run(run.run_id)
    return RegisteredHypothesis(hypothesis=hypothesis, hash=digest, mlflow_run_id=run.run_id, mlflow_url=run.url)


__all__ = ["paired_noise", "proposal_errors", "PROPOSAL_KEYS", "propose_change", "proposed_change", "register_hypothesis", "UnmeasuredPowerError"]
