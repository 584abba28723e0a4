"""The steps of an RL round, each a function from the records of the steps it depends on to its own record.

One asset per step (``defs/rl/assets.py``); :func:`~envloop_pipelines.core.rl_loop.run_round.run_rl_round`
calls the same functions without Dagster. Policies are served by a :class:`PolicyServer` the caller
passes in (``defs/rl/serving.py`` wraps ``envloop serve``'s policy app): the loop does not import the
serving layer.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from envloop_pipelines.core.agents.client import AgentSpec
from envloop_pipelines.core.environments.spec import HOLDOUT_SPLIT, TRAIN_SPLIT
from envloop_pipelines.core.ledger.event_log import EVENT_CHECKPOINT_TRAINED, EVENT_NULL_ARM
from envloop_pipelines.core.ledger.hypothesis import Hypothesis
from envloop_pipelines.core.ledger.ledger import Ledger
from envloop_pipelines.core.loop.promotion import check_arm_identity, noise_floor_from_arms
from envloop_pipelines.core.rl_loop.round_config import CHANGE_KIND, CONFIDENCE_LEVEL, RL_METRIC, RlRoundConfig
from envloop_pipelines.core.rl_loop.step_records import (
    ArmScore,
    HoldoutComparison,
    RlCandidate,
    RlHypothesis,
    RlNoiseFloor,
    RlReevaluation,
    RlSampling,
    RlSnapshot,
)
from envloop_pipelines.core.release.tracked_runs import child_run, flat_metrics, round_run
from envloop_pipelines.core.rl_loop.sft_snapshot import build_sft_snapshot, environment_text
from envloop_pipelines.core.ledger.store import RoundStore
from envloop_pipelines.core.metrics.paired import DEFAULT_POWER, minimum_detectable_effect
from envloop_pipelines.core.model.causal_sft import PolicyCheckpoint, read_policy_checkpoint, train_causal_sft
from envloop_pipelines.core.storage import staging_dir
from envloop_pipelines.core.tracking import (
    KIND_HYPOTHESIS,
    KIND_NOISE_FLOOR,
    KIND_NULL_ARM,
    KIND_REEVAL,
    KIND_TRAINING,
    TAG_CHECKPOINT,
    TAG_HYPOTHESIS,
    TAG_UNDERPOWERED,
    Tracker,
)

log = logging.getLogger(__name__)

#: The folder of a round's sampled attempts (``attempts.jsonl``) under ``rounds/<round>/``.
SAMPLED_ATTEMPTS = "sampled_attempts"


class PolicyServer(Protocol):
    """Serves a policy checkpoint (``policy``: its folder) or, with ``policy=None``, the base model, on
    loopback; the context yields the OpenAI base URL (``http://host:port/v1``) and stops the server on exit."""

    def __call__(self, policy: str | None, *, base_model: str, model_id: str,
                 max_tokens: int) -> AbstractContextManager[str]: ...


@contextmanager
def served(serve: PolicyServer, config: RlRoundConfig, policy: str | None, model_id: str) -> Iterator[AgentSpec]:
    """A policy (or the base model) served by ``serve``, as an agent."""
    base = str(config.load_recipe().base_model)
    with serve(policy, base_model=base, model_id=model_id, max_tokens=config.completion_tokens) as url:
        yield AgentSpec(base_url=url, model=model_id)


# --------------------------------------------------------------------------- policies


def current_policy(config: RlRoundConfig) -> PolicyCheckpoint | None:
    """The latest RL release's policy checkpoint (what the next round samples with), or None (the base model)."""
    for card in reversed(Ledger(config.task, config.home).releases()):
        if card.get("policy_checkpoint"):
            return read_policy_checkpoint(card["policy_checkpoint"])
    return None


def train_policy(rows: Sequence[Mapping[str, Any]], recipe: Any, root: Path, data_hash: str) -> PolicyCheckpoint:
    """Train a policy and store it under ``root/<sha256>`` (content-addressed; an equal one is kept)."""
    root.mkdir(parents=True, exist_ok=True)
    stage = staging_dir(root)
    try:
        trained = train_causal_sft(rows, recipe, stage / "policy", data_hash=data_hash)
        final = root / trained.sha256
        if final.exists():
            shutil.rmtree(trained.path, ignore_errors=True)
        else:
            os.rename(trained.path, final)
        return read_policy_checkpoint(final)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def null_arm_seeds(config: RlRoundConfig) -> tuple[int, ...]:
    """The null arms' seeds: distinct from the candidate's and from each other."""
    seed = config.load_recipe().seed
    return tuple(seed + 1000 + i for i in range(config.noise_arms))


# --------------------------------------------------------------------------- 1. the hypothesis


def rl_hypothesis_power(config: RlRoundConfig, n_environments: int) -> dict[str, Any]:
    """The RL round's minimum detectable effect before registration, analytic from its held-out evaluation's size.

    The round's floor is measured after registration (its null arms train on this round's snapshot), so
    the MDE registered with the hypothesis comes from the size of the held-out comparison alone. Each
    arm's pass@1 is a mean over ``n = n_environments · eval_attempts`` attempts, each a pass or a fail;
    at the worst case ``p = 0.5`` an attempt's variance is ``p(1 − p) = 0.25``, and with no credit for
    the pairing (the same sampling seeds for both arms only lowers it), the paired difference of the two
    pass rates has

        ``se = sqrt(2 · 0.25 / n) = sqrt(0.5 / n)``,  ``MDE = (z_{1−α/2} + z_{0.8}) · se``

    with ``1 − α`` the gate's confidence level (:data:`CONFIDENCE_LEVEL`, 0.95: ``z = 1.96``) and
    ``z_{0.8} = 0.84`` for 80% power (:func:`~envloop_pipelines.core.metrics.paired.minimum_detectable_effect`
    with no bar: ``2.80 · se``). The bar (the floor) is not known yet, so it is not in this MDE. The
    hypothesis is ``underpowered`` when ``predicted_delta < mde``. With no held-out environment there is
    no MDE (``mde`` is ``None``) and the ledger refuses the hypothesis.
    """
    n = n_environments * config.eval_attempts
    out: dict[str, Any] = {"metric": RL_METRIC, "predicted_effect": float(config.predicted_delta),
                           "power": DEFAULT_POWER, "confidence_level": CONFIDENCE_LEVEL,
                           "n_environments": n_environments, "attempts_per_environment": config.eval_attempts,
                           "method": "analytic: worst-case p = 0.5 over the held-out attempts, before the floor",
                           "formula": "se = sqrt(2 * 0.25 / (n_environments * eval_attempts)); "
                                      "mde = (z_(1-alpha/2) + z_power) * se", "mde": None, "underpowered": None}
    if n < 1:
        out["why_unmeasured"] = "no held-out environment to evaluate on"
        return out
    se = float(np.sqrt(2 * 0.25 / n))
    mde = minimum_detectable_effect(se, confidence_level=CONFIDENCE_LEVEL, power=DEFAULT_POWER)
    return {**out, "se": se, "mde": mde, "underpowered": bool(config.predicted_delta < mde)}


def register_rl_hypothesis(config: RlRoundConfig, dataset: Any, key: str, tracker: Tracker, *,
                           sampler: Mapping[str, Any] | None = None, rationale: str = "") -> RlHypothesis:
    """Write the round's hypothesis to the ledger and MLflow before any attempt is sampled (rules 1 and 2).

    It names the parent policy (the latest RL release's, else the base model) the round samples with
    (unless ``config`` names a sampler) and compares against, and records the test's power
    (:func:`rl_hypothesis_power`: the MDE from the held-out evaluation's size, ``underpowered`` when the
    predicted delta is below it); a retry of a round registered before the MDE was required re-registers
    it as it was. ``sampler``: what the hypothesis records as the sampler (default: ``config``'s agent, else
    the parent policy).

    Raises:
        ValueError: the dataset has no environment in ``train`` (nothing to sample).
        GateTooLooseError: a gate looser than the floor and a CI above zero (rule 2).
        HypothesisRefusedError: no MDE, as with no environment in ``heldout`` (:meth:`Ledger.register_hypothesis`).
    """
    if not any(e.split == TRAIN_SPLIT for e in dataset.environments):
        raise ValueError(f"{dataset.name}@{dataset.version}: an RL round needs environments in the split "
                         f"{TRAIN_SPLIT!r} to sample and in {HOLDOUT_SPLIT!r} to evaluate on")
    recipe = config.load_recipe()
    policy = current_policy(config)
    parent = {"model": f"policy-{policy.sha256[:12]}" if policy else f"base-{Path(recipe.base_model).name}",
              "checkpoint_sha256": policy.sha256 if policy else None, "path": policy.path if policy else None}
    agent = config.sampler()
    if sampler is None:
        sampler = agent.to_dict() if agent is not None else {"kind": "current_policy", "model": parent["model"],
                                                              "checkpoint_sha256": parent["checkpoint_sha256"]}
    seeds = (recipe.seed, *null_arm_seeds(config))
    n_holdout = sum(1 for e in dataset.environments if e.split == HOLDOUT_SPLIT)
    gate = config.gate()
    hypothesis = Hypothesis(
        task=config.task, round=key, benchmark_version=f"{dataset.name}@{dataset.version}",
        change={"kind": CHANGE_KIND, "sampler": dict(sampler), "attempts_per_environment": config.attempts,
                "eval_attempts": config.eval_attempts, "recipe": recipe.to_dict(),
                "contamination_policy": config.contamination_policy},
        predicted_delta=config.predicted_delta, gate=gate, seeds=seeds, recipe_hash=recipe.hash,
        rationale=rationale or "SFT on the attempts the verifier passed raises held-out pass@1",
        power=rl_hypothesis_power(config, n_holdout))
    ledger = Ledger(config.task, config.home)
    registered = ledger.hypothesis(key)
    if registered is not None and registered.power is None:
        hypothesis = replace(hypothesis, power=None)  # registered before the MDE was required: compared as it was
    h = ledger.register_hypothesis(hypothesis)
    if hypothesis.underpowered:
        log.warning("round %s: hypothesis underpowered: predicted %+.4f held-out pass@1, below the test's minimum "
                    "detectable effect %.4f (80%% power, %d held-out environments x %d attempts)", key,
                    config.predicted_delta, hypothesis.power["mde"], n_holdout, config.eval_attempts)
    run = child_run(tracker, config.loop_config(), key, KIND_HYPOTHESIS, {TAG_HYPOTHESIS: h})
    tracker.log_params(run.run_id, {"change.kind": CHANGE_KIND, "predicted_delta": config.predicted_delta,
                                    "gate": json.dumps(asdict(gate)), "seeds": list(seeds),
                                    "dataset": hypothesis.benchmark_version, "recipe_hash": recipe.hash})
    if hypothesis.power is not None and hypothesis.power.get("mde") is not None:
        tracker.log_params(run.run_id, {"mde": hypothesis.power["mde"], "mde_se": hypothesis.power["se"]})
        tracker.set_tags(run.run_id, {TAG_UNDERPOWERED: str(hypothesis.underpowered).lower()})
    tracker.end_run(run.run_id)
    return RlHypothesis(hypothesis=ledger.require_hypothesis(key), hash=h, parent=parent, mlflow_run_id=run.run_id)


# --------------------------------------------------------------------------- 2. sampling; 3. the SFT snapshot


def sample_attempts(config: RlRoundConfig, dataset: Any, hypothesis: RlHypothesis, tracker: Tracker,
                    serve: PolicyServer) -> RlSampling:
    """K attempts per training environment by the sampler (``config``'s agent, else the parent policy served),
    each in its own sandbox, stored with their transcripts as ``rounds/<round>/sampled_attempts/``; a retry of
    the step reads the stored attempts instead of sampling again."""
    from envloop_pipelines.core.agents.attempts import read_attempts, write_attempts
    from envloop_pipelines.core.agents.evaluate import run_attempts

    key = hypothesis.round
    t = time.monotonic()
    agent = config.sampler()
    folder = RoundStore(config.task, config.home).round_dir(key) / SAMPLED_ATTEMPTS
    path = folder / "attempts.jsonl"

    def run(spec: AgentSpec) -> list[Any]:
        return run_attempts(dataset, spec, attempts=config.attempts, split=TRAIN_SPLIT, limits=config.limits(),
                            workers=config.workers, home=config.home)

    if path.exists():
        attempts = read_attempts(path)
    elif agent is None:
        with served(serve, config, hypothesis.parent["path"], hypothesis.parent["model"]) as policy_agent:
            attempts = run(policy_agent)
    else:
        attempts = run(agent)
    if not path.exists():
        write_attempts(folder, attempts)
    passed = sum(a.passed for a in attempts)
    tracker.log_metrics(round_run(tracker, config.loop_config(), key).run_id,
                        {"sampled_attempts": len(attempts), "sampled_pass_rate": passed / len(attempts) if attempts else 0.0})
    return RlSampling(round=key, attempts_path=str(path), n_attempts=len(attempts), n_passed=passed,
                      seconds=round(time.monotonic() - t, 3))


def _environment_texts(dataset: Any, split: str) -> dict[str, str]:
    return {e.id: environment_text(e) for e in dataset.environments if e.split == split}


def build_rl_snapshot(config: RlRoundConfig, dataset: Any, sampling: RlSampling, tracker: Tracker) -> RlSnapshot:
    """The attempts the verifier passed as chat rows with provenance, contamination-checked against the
    held-out environments, content-addressed (rule 7; :func:`~.sft_snapshot.build_sft_snapshot`)."""
    from envloop_pipelines.core.agents.attempts import read_attempts

    store = RoundStore(config.task, config.home)
    snap = build_sft_snapshot(read_attempts(sampling.attempts_path), train_texts=_environment_texts(dataset, TRAIN_SPLIT),
                              holdout_texts=_environment_texts(dataset, HOLDOUT_SPLIT), root=store.snapshots / "sft",
                              policy=config.contamination_policy)
    tracker.log_metrics(round_run(tracker, config.loop_config(), sampling.round).run_id,
                        {"verified_attempts": snap.n_passed, "sft_rows": snap.n_rows, "sft_rows_removed": snap.n_removed})
    return RlSnapshot(round=sampling.round, **snap.to_dict())


# --------------------------------------------------------------------------- 4. the candidate; 5. the noise floor


def train_rl_candidate(config: RlRoundConfig, hypothesis: RlHypothesis, snapshot: RlSnapshot,
                       tracker: Tracker) -> RlCandidate:
    """LoRA SFT of the base model on the snapshot, on the hypothesis's seed or, after a gate amendment, the
    fresh seed it requires (:meth:`Ledger.candidate_seeds`, rule 3); the candidate's identity is its
    checkpoint hash. An empty snapshot trains nothing (``skipped``)."""
    key = hypothesis.round
    if snapshot.empty:
        return RlCandidate(round=key, skipped=(
            f"no verified attempt to train on: the sampler passed {snapshot.n_passed} of {snapshot.n_attempts} attempts "
            f"and {snapshot.n_removed} were removed as contamination"))
    ledger = Ledger(config.task, config.home)
    store = RoundStore(config.task, config.home)
    t = time.monotonic()
    recipe = config.load_recipe().replace(seed=ledger.candidate_seeds(key)[0])
    candidate = train_policy(snapshot.rows(), recipe, store.checkpoints / "policies", snapshot.sha256)
    seconds = round(time.monotonic() - t, 3)
    metrics = candidate.metrics()
    run = child_run(tracker, config.loop_config(), key, KIND_TRAINING,
                    {TAG_CHECKPOINT: candidate.sha256, TAG_HYPOTHESIS: hypothesis.hash})
    tracker.log_params(run.run_id, {f"recipe.{k}": v for k, v in recipe.to_dict().items()} | {"sft_snapshot": snapshot.sha256})
    for step, loss in enumerate(metrics["loss_per_step"]):
        tracker.log_metrics(run.run_id, {"loss": loss}, step=step)
    tracker.log_metrics(run.run_id, {k: metrics[k] for k in ("steps", "rows", "tokens", "assistant_tokens")})
    tracker.end_run(run.run_id)
    ledger.append(EVENT_CHECKPOINT_TRAINED, {"round": key, "checkpoint_sha256": candidate.sha256, "policy_checkpoint": candidate.path,
                                             "sft_snapshot": snapshot.sha256, "seed": recipe.seed,
                                             "first_loss": metrics["first_loss"], "last_loss": metrics["last_loss"]},
                  key=f"trained:{key}:{candidate.sha256}")
    return RlCandidate(round=key, checkpoint_sha256=candidate.sha256, path=str(candidate.path),
                       model=f"policy-{candidate.sha256[:12]}", seed=recipe.seed, first_loss=metrics["first_loss"],
                       last_loss=metrics["last_loss"], seconds=seconds)


def measure_rl_noise_floor(config: RlRoundConfig, dataset: Any, snapshot: RlSnapshot, candidate: RlCandidate,
                           tracker: Tracker, serve: PolicyServer) -> RlNoiseFloor:
    """``noise_arms`` null arms, the candidate's recipe and snapshot with other seeds (identity checked before
    any compute), each served and scored on the held-out environments; the spread of their pass@1 is the
    floor (rule 2), through the decision loop's :func:`~.promotion.noise_floor_from_arms`."""
    key = candidate.round
    if candidate.skipped:
        return RlNoiseFloor(round=key, floor=None)
    recipe = config.load_recipe()
    arm_recipes = [recipe.replace(seed=s) for s in null_arm_seeds(config)]
    check_arm_identity([(r.to_dict(), snapshot.sha256) for r in arm_recipes])
    ledger = Ledger(config.task, config.home)
    root = RoundStore(config.task, config.home).checkpoints / "policies"
    loop = config.loop_config()
    t = time.monotonic()
    rows = snapshot.rows()
    floor_run = child_run(tracker, loop, key, KIND_NOISE_FLOOR)
    arms = []
    for arm_recipe in arm_recipes:
        arm = train_policy(rows, arm_recipe, root, snapshot.sha256)
        with served(serve, config, str(arm.path), f"policy-{arm.sha256[:12]}") as agent:
            score = holdout_score(dataset, agent, config)
        arms.append({RL_METRIC: score.pass_at_1, "seed": arm_recipe.seed, "checkpoint_sha256": arm.sha256})
        arm_run = child_run(tracker, loop, key, KIND_NULL_ARM, {TAG_CHECKPOINT: arm.sha256})
        tracker.log_params(arm_run.run_id, {"seed": arm_recipe.seed})
        tracker.log_metrics(arm_run.run_id, {RL_METRIC: score.pass_at_1})
        tracker.end_run(arm_run.run_id)
        ledger.append(EVENT_NULL_ARM, {"round": key, "seed": arm_recipe.seed, "checkpoint_sha256": arm.sha256,
                                       RL_METRIC: score.pass_at_1, "sft_snapshot": snapshot.sha256},
                      key=f"null_arm:{key}:{arm_recipe.seed}")
    floor = noise_floor_from_arms(f"{dataset.name}@{dataset.version}:{snapshot.sha256[:12]}:{recipe.hash[:12]}",
                                  RL_METRIC, arms, arms=arms)
    tracker.log_metrics(floor_run.run_id, {"floor": floor.floor})
    tracker.end_run(floor_run.run_id)
    return RlNoiseFloor(round=key, floor=floor, seconds=round(time.monotonic() - t, 3))


# --------------------------------------------------------------------------- 6. the held-out comparison


def _arm_score(counts: Mapping[str, tuple[int, int]], seed: int) -> ArmScore:
    from envloop_pipelines.core.agents.stats import pass_at_k_summary

    [p1] = pass_at_k_summary(counts, [1], confidence_level=CONFIDENCE_LEVEL, seed=seed)
    return ArmScore(p1.value, p1.ci_low, p1.ci_high, p1.n_environments, sum(n for n, _ in counts.values()))


def _holdout_counts(dataset: Any, agent: AgentSpec, config: RlRoundConfig) -> dict[str, tuple[int, int]]:
    """Per held-out environment ``(attempts, passes)``: for the aggregates of this module only, never returned further.

    The agent runner with the same per-attempt sampling seeds for every arm: attempt *i* at environment *e*
    sends the same ``seed`` whichever policy answers (common random numbers).
    """
    from envloop_pipelines.core.agents.evaluate import pass_counts

    return pass_counts(dataset, agent, attempts=config.eval_attempts, split=HOLDOUT_SPLIT, limits=config.limits(),
                       workers=config.workers, home=config.home)


def holdout_score(dataset: Any, agent: AgentSpec, config: RlRoundConfig) -> ArmScore:
    """One policy's held-out pass@1 with its CI (a null arm's)."""
    return _arm_score(_holdout_counts(dataset, agent, config), config.bootstrap_seed)


def holdout_comparison(dataset: Any, candidate: AgentSpec, parent: AgentSpec, config: RlRoundConfig) -> HoldoutComparison:
    """Candidate and parent on the held-out environments; aggregates and the paired delta only (rule 4).

    Each arm's pass@1 and CI as ``agents/stats.py`` computes an evaluation's; the delta is the mean over
    environments of the paired difference of pass rates, with the same stats module's percentile bootstrap
    over environments (:func:`~envloop_pipelines.core.agents.stats.mean_ci`).
    """
    from envloop_pipelines.core.agents.stats import mean_ci

    cand, par = _holdout_counts(dataset, candidate, config), _holdout_counts(dataset, parent, config)
    if sorted(cand) != sorted(par):
        raise RuntimeError("the two arms were scored on different held-out environments")
    diffs = [cand[k][1] / cand[k][0] - par[k][1] / par[k][0] for k in sorted(cand)]
    low, high = mean_ci(diffs, confidence_level=CONFIDENCE_LEVEL, seed=config.bootstrap_seed)
    delta = {"delta": float(np.mean(diffs)), "ci_low": low, "ci_high": high, "confidence_level": CONFIDENCE_LEVEL,
             "n_environments": len(diffs)}
    return HoldoutComparison(_arm_score(cand, config.bootstrap_seed), _arm_score(par, config.bootstrap_seed), delta,
                             config.eval_attempts)


def reevaluate_rl(config: RlRoundConfig, dataset: Any, hypothesis: RlHypothesis, candidate: RlCandidate,
                  tracker: Tracker, serve: PolicyServer) -> RlReevaluation:
    """The candidate and the parent policy, each served, on the held-out environments (rule 4): aggregates only."""
    key = candidate.round
    if candidate.skipped:
        return RlReevaluation(round=key, comparison=None)
    t = time.monotonic()
    with served(serve, config, candidate.path, candidate.model or "") as cand_agent, \
            served(serve, config, hypothesis.parent["path"], hypothesis.parent["model"]) as parent_agent:
        comparison = holdout_comparison(dataset, cand_agent, parent_agent, config)
    run = child_run(tracker, config.loop_config(), key, KIND_REEVAL, {TAG_CHECKPOINT: candidate.checkpoint_sha256 or ""})
    tracker.log_metrics(run.run_id, {f"candidate.{RL_METRIC}": comparison.candidate.pass_at_1,
                                     f"champion.{RL_METRIC}": comparison.parent.pass_at_1,
                                     **flat_metrics(comparison.delta, f"delta.{RL_METRIC}.")})
    tracker.end_run(run.run_id)
    return RlReevaluation(round=key, comparison=comparison, seconds=round(time.monotonic() - t, 3))


__all__ = ["PolicyServer", "SAMPLED_ATTEMPTS", "build_rl_snapshot", "current_policy", "holdout_comparison", "holdout_score",
           "measure_rl_noise_floor", "null_arm_seeds", "reevaluate_rl", "register_rl_hypothesis", "rl_hypothesis_power",
           "sample_attempts", "served", "train_policy", "train_rl_candidate"]
