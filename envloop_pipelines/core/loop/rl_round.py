"""RL from verified attempts, as a round of the loop: sample, keep what the verifier passed, SFT, re-evaluate, gate.

One round (:func:`run_rl_round`) over an environment dataset whose environments
are split ``train`` / ``heldout``:

1. **Hypothesis** (rule 1): the change (SFT of the recipe's causal LM on this round's verified attempts),
   the predicted gain in held-out pass@1, the gate, the seeds and the test's minimum detectable effect
   (:func:`rl_hypothesis_power`, analytic from the held-out evaluation's size) are registered in the ledger
   and MLflow before any attempt is sampled. The gate may be stricter, never looser, than the measured
   floor and a paired CI above zero (rule 2, enforced by :meth:`Ledger.register_hypothesis`).
2. **Sampling**: K attempts per training environment by the sampler: by default the current policy (the
   latest RL release's adapter, else the base model) served by ``envloop serve``'s policy app
   (:func:`~envloop_pipelines.core.serve.generation.serving_policy`), driven by the agent runner
   (:func:`~envloop_pipelines.core.agents.evaluate.run_attempts`; each attempt in its own sandbox).
3. **SFT snapshot** (rule 7): the attempts the verifier passed, as chat rows with provenance,
   contamination-checked against the held-out environments, content-addressed
   (:mod:`~envloop_pipelines.core.loop.sft_snapshot`).
4. **Training**: LoRA SFT of the base model on the snapshot, loss on the assistant's tokens
   (:func:`~envloop_pipelines.core.model.causal_sft.train_causal_sft`), on the hypothesis's seed or, after a
   gate amendment, the fresh seed it requires (:meth:`Ledger.candidate_seeds`; the decision refuses a
   candidate trained on another, rule 3); the candidate's identity is its checkpoint hash.
5. **Noise floor** (rule 2): ``noise_arms`` null arms, the candidate's recipe and snapshot with other seeds
   (identity checked before any compute), each re-evaluated like the candidate; the spread of their
   held-out pass@1 is the floor.
6. **Re-evaluation** (rule 4): base (the parent policy) and candidate, each served, K attempts per held-out
   environment with the same sampling seeds (common random numbers); only aggregates leave: each arm's
   pass@1 with its CI, and the paired delta with a percentile-bootstrap CI over environments. The
   per-environment pass rates the pairing needs live inside :func:`heldout_comparison` and are never
   returned, logged or stored.
7. **Decision**: the registered gate, the floor and the CI through the decision loop's
   :func:`~envloop_pipelines.core.loop.promotion.decide_promotion`; a rejection is recorded
   (``candidate_rejected``, ``hypothesis_refuted``) with its numbers; a promotion reads the held-out
   split once for the release (:meth:`Ledger.read_holdout_once`) and writes the release card, which
   names the policy checkpoint the next round samples with. ``round_decided`` either way, and MLflow runs
   of the loop's kinds (``round``, ``registered_hypothesis``, ``lora_checkpoint``, ``noise_floor``,
   ``null_arm``, ``independent_reeval``, ``release``).

A round with no verified attempt has nothing to train on: it is decided as a rejection with that reason,
after the hypothesis and the (empty) snapshot are recorded.

Limitations: the environment datasets have two splits, so a release's one holdout read is of the same
held-out split the gate used (counted once per release, as rule 4 asks); the floor is measured per
round, on that round's snapshot.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from envloop_pipelines.core.agents.client import AgentSpec
from envloop_pipelines.core.agents.runner import AttemptLimits
from envloop_pipelines.core.loop.config import LoopConfig, round_key
from envloop_pipelines.core.loop.ledger import (
    EVENT_CANDIDATE_REJECTED,
    EVENT_CHECKPOINT_TRAINED,
    EVENT_HYPOTHESIS_REFUTED,
    EVENT_NULL_ARM,
    EVENT_ROUND_DECIDED,
    Gate,
    Hypothesis,
    Ledger,
)
from envloop_pipelines.core.loop.promotion import NoiseFloor, PromotionDecision, check_arm_identity, decide_promotion, noise_floor_from_arms
from envloop_pipelines.core.loop.runs import child_run, flat_metrics, round_run
from envloop_pipelines.core.loop.sft_snapshot import build_sft_snapshot, environment_text
from envloop_pipelines.core.loop.store import RoundStore
from envloop_pipelines.core.metrics import DEFAULT_POWER, minimum_detectable_effect
from envloop_pipelines.core.model.causal_sft import (
    RECIPE_FILE,
    CausalSftRecipe,
    PolicyCheckpoint,
    read_policy_checkpoint,
    train_causal_sft,
)
from envloop_pipelines.core.storage import staging_dir
from envloop_pipelines.core.tracking import (
    KIND_HYPOTHESIS,
    KIND_NOISE_FLOOR,
    KIND_NULL_ARM,
    KIND_REEVAL,
    KIND_RELEASE,
    KIND_TRAINING,
    TAG_CHECKPOINT,
    TAG_HYPOTHESIS,
    TAG_RELEASE,
    TAG_UNDERPOWERED,
    Tracker,
)

log = logging.getLogger(__name__)

PRIMARY_METRIC = "pass_at_1"
#: The change kind a round of this type registers (``Hypothesis.change["kind"]``).
CHANGE_KIND = "rl_from_verified_attempts"
TRAIN_SPLIT = "train"
HELDOUT_SPLIT = "heldout"
RL_DECISION = "rl_decision"
SAMPLED_ATTEMPTS = "sampled_attempts"
#: The confidence level of the held-out comparison's CIs (the gate's CI above zero is at this level).
CONFIDENCE_LEVEL = 0.95


@dataclass(frozen=True)
class RlRoundConfig:
    """What a person chooses for an RL round.

    Attributes:
        task: the loop's name: its ledger (``<home>/loops/<task>/``) and MLflow experiment.
        recipe: the causal-SFT recipe (its ``base_model`` is the policy's base).
        attempts: K, sampled attempts per training environment.
        eval_attempts: attempts per held-out environment and arm in the re-evaluation.
        noise_arms: null arms of the floor (≥ 2).
        predicted_delta: the registered prediction of the held-out pass@1 gain.
        gate: the registered gate (primary metric ``pass_at_1``).
        limits: each attempt's turns, tokens and wall time.
        max_tokens: the policy server's cap on one completion.
        workers: attempts run side by side.
        contamination_policy: ``remove`` or ``refuse`` (see :mod:`.sft_snapshot`).
        home: the EnvLoop home.
        bootstrap_seed: the seed of the paired bootstrap.
    """

    task: str
    recipe: CausalSftRecipe
    attempts: int = 4
    eval_attempts: int = 4
    noise_arms: int = 2
    predicted_delta: float = 0.05
    gate: Gate = field(default_factory=lambda: Gate(primary_metric=PRIMARY_METRIC))
    limits: AttemptLimits = field(default_factory=lambda: AttemptLimits(max_turns=6, max_tokens=1024, wall_s=120.0))
    max_tokens: int = 128
    workers: int = 2
    contamination_policy: str = "remove"
    home: str | None = None
    bootstrap_seed: int = 0

    def __post_init__(self) -> None:
        for name in ("attempts", "eval_attempts", "max_tokens", "workers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"RlRoundConfig.{name} must be a positive integer, got {value!r}")
        if isinstance(self.noise_arms, bool) or not isinstance(self.noise_arms, int) or self.noise_arms < 2:
            raise ValueError(f"RlRoundConfig.noise_arms must be ≥ 2 (a spread needs two arms), got {self.noise_arms!r}")
        if self.gate.primary_metric != PRIMARY_METRIC:
            raise ValueError(f"RlRoundConfig.gate.primary_metric must be {PRIMARY_METRIC!r} (what the round measures), "
                             f"got {self.gate.primary_metric!r}")
        if self.contamination_policy not in ("remove", "refuse"):
            raise ValueError(f"RlRoundConfig.contamination_policy must be 'remove' or 'refuse', got {self.contamination_policy!r}")

    def loop_config(self) -> LoopConfig:
        """The loop settings the shared MLflow helpers read (the task and the home)."""
        return LoopConfig(task=self.task, home=self.home)


@dataclass(frozen=True)
class ArmScore:
    """One policy's held-out aggregate: pass@1 with its CI (never per environment)."""

    pass_at_1: float
    ci_low: float
    ci_high: float
    n_environments: int
    n_attempts: int


@dataclass(frozen=True)
class HeldoutComparison:
    """Candidate against parent on the held-out environments: aggregates and the paired delta only."""

    candidate: ArmScore
    parent: ArmScore
    delta: Mapping[str, float]
    attempts_per_environment: int

    def to_dict(self) -> dict[str, Any]:
        return {"candidate": asdict(self.candidate), "parent": asdict(self.parent), "delta": dict(self.delta),
                "attempts_per_environment": self.attempts_per_environment}


@dataclass(frozen=True)
class RlRoundResult:
    """What a round decided, and what it made on the way."""

    round: str
    task: str
    dataset: str
    dataset_version: str
    hypothesis_hash: str
    sampler: Mapping[str, Any]
    snapshot: Mapping[str, Any]
    promoted: bool
    reasons: tuple[str, ...]
    candidate: Mapping[str, Any] | None = None
    comparison: Mapping[str, Any] | None = None
    noise_floor: Mapping[str, Any] | None = None
    checks: Mapping[str, Any] = field(default_factory=dict)
    release: int | None = None
    seconds: Mapping[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["reasons"] = list(self.reasons)
        return out

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "RlRoundResult":
        data = dict(raw)
        data["reasons"] = tuple(data["reasons"])
        return cls(**data)


# --------------------------------------------------------------------------- policies


def current_policy(config: RlRoundConfig) -> PolicyCheckpoint | None:
    """The latest RL release's policy checkpoint (what the next round samples with), or None (the base model)."""
    releases = Ledger(config.task, config.home).releases()
    for card in reversed(releases):
        path = card.get("policy_checkpoint")
        if path:
            return read_policy_checkpoint(path)
    return None


@contextmanager
def serving(config: RlRoundConfig, policy: PolicyCheckpoint | None, model_id: str) -> Iterator[AgentSpec]:
    """A policy (or the base model) served on loopback by ``envloop serve``'s policy app, as an agent."""
    from envloop_pipelines.core.serve.generation import policy_settings, serving_policy

    settings = policy_settings(policy.path if policy else None, base_model=config.recipe.base_model if policy is None else None,
                               model_id=model_id, auth_off=True, port=0, max_tokens=config.max_tokens)
    with serving_policy(settings) as url:
        yield AgentSpec(base_url=url, model=model_id)


def _store_policy(trained: PolicyCheckpoint, root: Path) -> PolicyCheckpoint:
    """Move a freshly trained checkpoint under its identity (content-addressed; an equal one is kept)."""
    import os
    import shutil

    final = root / trained.sha256
    if final.exists():
        shutil.rmtree(trained.path, ignore_errors=True)
    else:
        os.rename(trained.path, final)
    return read_policy_checkpoint(final)


def train_policy(rows: Sequence[Mapping[str, Any]], recipe: CausalSftRecipe, root: Path, data_hash: str) -> PolicyCheckpoint:
    """Train and store a policy checkpoint under ``root/<sha256>``."""
    root.mkdir(parents=True, exist_ok=True)
    stage = staging_dir(root)
    trained = train_causal_sft(rows, recipe, stage / "policy", data_hash=data_hash)
    try:
        return _store_policy(trained, root)
    finally:
        import shutil

        shutil.rmtree(stage, ignore_errors=True)


# --------------------------------------------------------------------------- the held-out comparison


def _pass_rates(attempts: Sequence[Any]) -> dict[str, float]:
    counts: dict[str, list[int]] = {}
    for a in attempts:
        counts.setdefault(a.environment_id, []).append(int(a.passed))
    return {env: float(np.mean(v)) for env, v in counts.items()}


def _mean_ci(values: np.ndarray, seed: int, confidence: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap CI of the mean over environments (a point when every value is the same)."""
    from scipy.stats import bootstrap

    if len(values) < 2 or float(np.ptp(values)) == 0.0:
        mean = float(np.mean(values)) if len(values) else float("nan")
        return mean, mean
    res = bootstrap((values,), np.mean, confidence_level=confidence, n_resamples=2000, method="percentile",
                    random_state=np.random.default_rng(seed))
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def _arm_score(rates: Mapping[str, float], n_attempts: int, seed: int) -> ArmScore:
    values = np.array([rates[k] for k in sorted(rates)], dtype=float)
    low, high = _mean_ci(values, seed)
    return ArmScore(float(values.mean()), low, high, len(values), n_attempts)


def heldout_attempts(dataset: Any, agent: AgentSpec, config: RlRoundConfig) -> list[Any]:
    """Attempts on the held-out environments: for the aggregates of this module only, never returned further.

    The agent evaluation's runner (the one that ``evaluate_agent`` uses) with the same per-attempt sampling
    seeds for every arm: attempt *i* at environment *e* sends the same ``seed`` whichever policy answers.
    """
    from envloop_pipelines.core.agents.evaluate import _environments, _run

    envs = _environments(dataset, HELDOUT_SPLIT, None)
    return _run(dataset, envs, agent, config.eval_attempts, config.limits, config.workers, None, None, config.home)


def heldout_comparison(dataset: Any, candidate: AgentSpec, parent: AgentSpec, config: RlRoundConfig,
                       *, candidate_attempts: Sequence[Any] | None = None) -> HeldoutComparison:
    """Candidate and parent on the held-out environments; aggregates and the paired delta only (rule 4)."""
    cand = list(candidate_attempts) if candidate_attempts is not None else heldout_attempts(dataset, candidate, config)
    par = heldout_attempts(dataset, parent, config)
    c_rates, p_rates = _pass_rates(cand), _pass_rates(par)
    if sorted(c_rates) != sorted(p_rates):
        raise RuntimeError("the two arms were scored on different held-out environments")
    diffs = np.array([c_rates[k] - p_rates[k] for k in sorted(c_rates)], dtype=float)
    low, high = _mean_ci(diffs, config.bootstrap_seed, CONFIDENCE_LEVEL)
    delta = {"delta": float(diffs.mean()), "ci_low": low, "ci_high": high, "confidence_level": CONFIDENCE_LEVEL,
             "n_environments": len(diffs)}
    return HeldoutComparison(_arm_score(c_rates, len(cand), config.bootstrap_seed),
                             _arm_score(p_rates, len(par), config.bootstrap_seed), delta, config.eval_attempts)


def heldout_score(dataset: Any, agent: AgentSpec, config: RlRoundConfig) -> ArmScore:
    """One policy's held-out pass@1 with its CI (a null arm's)."""
    attempts = heldout_attempts(dataset, agent, config)
    return _arm_score(_pass_rates(attempts), len(attempts), config.bootstrap_seed)


# --------------------------------------------------------------------------- the round


def _next_round(store: RoundStore, ledger: Ledger) -> str:
    started = set(store.started_rounds())
    registered = {int(p.stem[1:]) for p in (ledger.root / "hypotheses").glob("r*.json") if p.stem[1:].isdigit()}
    return round_key(max(started | registered | {0}) + 1)


def _environment_texts(dataset: Any, split: str) -> dict[str, str]:
    return {e.id: environment_text(e) for e in dataset.environments if e.split == split}


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
    ``z_{0.8} = 0.84`` for 80% power (:func:`~envloop_pipelines.core.metrics.minimum_detectable_effect`
    with no bar: ``2.80 · se``). The bar (the floor) is not known yet, so it is not in this MDE. The
    hypothesis is ``underpowered`` when ``predicted_delta < mde``. With no held-out environment there is
    no MDE (``mde`` is ``None``) and the ledger refuses the hypothesis.
    """
    n = n_environments * config.eval_attempts
    out: dict[str, Any] = {"metric": PRIMARY_METRIC, "predicted_effect": float(config.predicted_delta),
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


def register_rl_hypothesis(config: RlRoundConfig, dataset: Any, key: str, sampler: Mapping[str, Any],
                           tracker: Tracker, *, rationale: str = "") -> Hypothesis:
    """Write the round's hypothesis to the ledger and MLflow before any attempt is sampled (rules 1 and 2).

    It records the test's power (:func:`rl_hypothesis_power`: the MDE from the held-out evaluation's size,
    ``underpowered`` when the predicted delta is below it); a retry of a round registered before the MDE
    was required re-registers it as it was.
    """
    seeds = (config.recipe.seed, *null_arm_seeds(config))
    n_heldout = sum(1 for e in dataset.environments if e.split == HELDOUT_SPLIT)
    hypothesis = Hypothesis(
        task=config.task, round=key, benchmark_version=f"{dataset.name}@{dataset.version}",
        change={"kind": CHANGE_KIND, "sampler": dict(sampler), "attempts_per_environment": config.attempts,
                "eval_attempts": config.eval_attempts, "recipe": config.recipe.to_dict(),
                "contamination_policy": config.contamination_policy},
        predicted_delta=config.predicted_delta, gate=config.gate, seeds=seeds, recipe_hash=config.recipe.hash,
        rationale=rationale or "SFT on the attempts the verifier passed raises held-out pass@1",
        power=rl_hypothesis_power(config, n_heldout))
    ledger = Ledger(config.task, config.home)
    registered = ledger.hypothesis(key)
    if registered is not None and registered.power is None:
        hypothesis = replace(hypothesis, power=None)  # registered before the MDE was required: compared as it was
    h = ledger.register_hypothesis(hypothesis)
    if hypothesis.underpowered:
        log.warning("round %s: hypothesis underpowered: predicted %+.4f held-out pass@1, below the test's minimum "
                    "detectable effect %.4f (80%% power, %d held-out environments x %d attempts)", key,
                    config.predicted_delta, hypothesis.power["mde"], n_heldout, config.eval_attempts)
    run = child_run(tracker, config.loop_config(), key, KIND_HYPOTHESIS, {TAG_HYPOTHESIS: h})
    tracker.log_params(run.run_id, {"change.kind": CHANGE_KIND, "predicted_delta": config.predicted_delta,
                                    "gate": json.dumps(asdict(config.gate)), "seeds": list(seeds),
                                    "dataset": hypothesis.benchmark_version, "recipe_hash": config.recipe.hash})
    if hypothesis.power is not None and hypothesis.power.get("mde") is not None:
        tracker.log_params(run.run_id, {"mde": hypothesis.power["mde"], "mde_se": hypothesis.power["se"]})
        tracker.set_tags(run.run_id, {TAG_UNDERPOWERED: str(hypothesis.underpowered).lower()})
    tracker.end_run(run.run_id)
    return ledger.require_hypothesis(key)


def null_arm_seeds(config: RlRoundConfig) -> tuple[int, ...]:
    """The null arms' seeds: distinct from the candidate's and from each other."""
    return tuple(config.recipe.seed + 1000 + i for i in range(config.noise_arms))


def run_rl_round(
    config: RlRoundConfig,
    dataset: Any,
    tracker: Tracker,
    *,
    sampler: AgentSpec | None = None,
    key: str | None = None,
) -> RlRoundResult:
    """One RL round (see the module docstring).

    Args:
        config: the round's settings.
        dataset: the environment dataset (``name``, ``version``, ``environments`` with ``split`` train / heldout).
        tracker: MLflow (the real one by default in callers).
        sampler: the agent that samples the training attempts; None: the current policy, served here.
        key: the round key (default: the next one of this task).

    Returns:
        The decision and what led to it; also stored as ``rounds/<key>/rl_decision.json``.
    """
    t0 = time.monotonic()
    seconds: dict[str, float] = {}
    store = RoundStore(config.task, config.home)
    ledger = Ledger(config.task, config.home)
    key = key or _next_round(store, ledger)
    done = store.load(RL_DECISION, RlRoundResult, key)
    if done is not None:
        return done  # decided once; a retry reports the same decision
    if not any(e.split == TRAIN_SPLIT for e in dataset.environments) or not any(e.split == HELDOUT_SPLIT for e in dataset.environments):
        raise ValueError(f"{dataset.name}@{dataset.version}: an RL round needs environments in both splits "
                         f"{TRAIN_SPLIT!r} and {HELDOUT_SPLIT!r}")
    loop = config.loop_config()
    parent_policy = current_policy(config)
    parent_id = f"policy-{parent_policy.sha256[:12]}" if parent_policy else f"base-{Path(config.recipe.base_model).name}"
    sampler_info = sampler.to_dict() if sampler is not None else {"kind": "current_policy", "model": parent_id,
                                                                   "checkpoint_sha256": parent_policy.sha256 if parent_policy else None}
    parent_run = round_run(tracker, loop, key)
    hypothesis = register_rl_hypothesis(config, dataset, key, sampler_info, tracker)

    # 2. sampling on the training environments
    from envloop_pipelines.core.agents.attempts import write_attempts
    from envloop_pipelines.core.agents.evaluate import run_attempts

    t = time.monotonic()
    if sampler is None:
        with serving(config, parent_policy, parent_id) as agent:
            attempts = run_attempts(dataset, agent, attempts=config.attempts, split=TRAIN_SPLIT, limits=config.limits,
                                    workers=config.workers, home=config.home)
    else:
        attempts = run_attempts(dataset, sampler, attempts=config.attempts, split=TRAIN_SPLIT, limits=config.limits,
                                workers=config.workers, home=config.home)
    seconds["sampling"] = round(time.monotonic() - t, 3)
    attempts_dir = store.round_dir(key) / SAMPLED_ATTEMPTS
    if not (attempts_dir / "attempts.jsonl").exists():
        write_attempts(attempts_dir, attempts)

    # 3. the SFT snapshot
    snapshot = build_sft_snapshot(attempts, train_texts=_environment_texts(dataset, TRAIN_SPLIT),
                                  heldout_texts=_environment_texts(dataset, HELDOUT_SPLIT),
                                  root=store.snapshots / "sft", policy=config.contamination_policy)
    sampled = {"sampled_attempts": len(attempts), "verified_attempts": snapshot.n_passed,
               "sft_rows": snapshot.n_rows, "sft_rows_removed": snapshot.n_removed,
               "sampled_pass_rate": snapshot.n_passed / len(attempts) if attempts else 0.0}
    tracker.log_metrics(parent_run.run_id, sampled)
    base = {"round": key, "task": config.task, "dataset": dataset.name, "dataset_version": dataset.version,
            "hypothesis_hash": hypothesis.hash, "sampler": sampler_info, "snapshot": snapshot.to_dict()}
    if snapshot.n_rows == 0:
        reasons = (f"no verified attempt to train on: the sampler passed {snapshot.n_passed} of {len(attempts)} attempts "
                   f"and {snapshot.n_removed} were removed as contamination",)
        result = RlRoundResult(**base, promoted=False, reasons=reasons, seconds={**seconds, "total": round(time.monotonic() - t0, 3)})
        return _record_rejection(config, ledger, store, tracker, parent_run.run_id, result, hypothesis)

    # 4. the candidate; 5. the null arms (identity checked before any compute)
    rows = snapshot.rows()
    arm_recipes = [config.recipe.replace(seed=s) for s in null_arm_seeds(config)]
    check_arm_identity([(r.to_dict(), snapshot.sha256) for r in arm_recipes])
    t = time.monotonic()
    # The hypothesis's seed, or after a gate amendment the fresh seed it requires (rule 3).
    recipe = config.recipe.replace(seed=ledger.candidate_seeds(key)[0])
    candidate = train_policy(rows, recipe, store.checkpoints / "policies", snapshot.sha256)
    seconds["training"] = round(time.monotonic() - t, 3)
    metrics = candidate.metrics()
    run = child_run(tracker, loop, key, KIND_TRAINING, {TAG_CHECKPOINT: candidate.sha256, TAG_HYPOTHESIS: hypothesis.hash})
    tracker.log_params(run.run_id, {f"recipe.{k}": v for k, v in recipe.to_dict().items()} | {"sft_snapshot": snapshot.sha256})
    for step, loss in enumerate(metrics["loss_per_step"]):
        tracker.log_metrics(run.run_id, {"loss": loss}, step=step)
    tracker.log_metrics(run.run_id, {k: metrics[k] for k in ("steps", "rows", "tokens", "assistant_tokens")})
    tracker.end_run(run.run_id)
    ledger.append(EVENT_CHECKPOINT_TRAINED, {"round": key, "checkpoint_sha256": candidate.sha256, "policy_checkpoint": candidate.path,
                                             "sft_snapshot": snapshot.sha256, "seed": recipe.seed,
                                             "first_loss": metrics["first_loss"], "last_loss": metrics["last_loss"]},
                  key=f"trained:{key}:{candidate.sha256}")
    candidate_id = f"policy-{candidate.sha256[:12]}"

    # 6. re-evaluation on the held-out environments, and the null arms' spread
    t = time.monotonic()
    with serving(config, candidate, candidate_id) as cand_agent, serving(config, parent_policy, parent_id) as parent_agent:
        comparison = heldout_comparison(dataset, cand_agent, parent_agent, config)
    seconds["reevaluation"] = round(time.monotonic() - t, 3)
    t = time.monotonic()
    arm_scores = []
    floor_run = child_run(tracker, loop, key, KIND_NOISE_FLOOR)
    for recipe in arm_recipes:
        arm = train_policy(rows, recipe, store.checkpoints / "policies", snapshot.sha256)
        with serving(config, arm, f"policy-{arm.sha256[:12]}") as agent:
            score = heldout_score(dataset, agent, config)
        arm_scores.append({PRIMARY_METRIC: score.pass_at_1, "seed": recipe.seed, "checkpoint_sha256": arm.sha256})
        arm_run = child_run(tracker, loop, key, KIND_NULL_ARM, {TAG_CHECKPOINT: arm.sha256})
        tracker.log_params(arm_run.run_id, {"seed": recipe.seed})
        tracker.log_metrics(arm_run.run_id, {PRIMARY_METRIC: score.pass_at_1})
        tracker.end_run(arm_run.run_id)
        ledger.append(EVENT_NULL_ARM, {"round": key, "seed": recipe.seed, "checkpoint_sha256": arm.sha256,
                                       PRIMARY_METRIC: score.pass_at_1, "sft_snapshot": snapshot.sha256},
                      key=f"null_arm:{key}:{recipe.seed}")
    seconds["noise_floor"] = round(time.monotonic() - t, 3)
    floor = noise_floor_from_arms(f"{dataset.name}@{dataset.version}:{snapshot.sha256[:12]}:{config.recipe.hash[:12]}",
                                  PRIMARY_METRIC, arm_scores, arms=arm_scores)
    tracker.log_metrics(floor_run.run_id, {"floor": floor.floor})
    tracker.end_run(floor_run.run_id)
    reeval_run = child_run(tracker, loop, key, KIND_REEVAL, {TAG_CHECKPOINT: candidate.sha256})
    tracker.log_metrics(reeval_run.run_id, {f"candidate.{PRIMARY_METRIC}": comparison.candidate.pass_at_1,
                                            f"champion.{PRIMARY_METRIC}": comparison.parent.pass_at_1,
                                            **flat_metrics(comparison.delta, f"delta.{PRIMARY_METRIC}.")})
    tracker.end_run(reeval_run.run_id)

    # 7. the registered gate
    undecided = RlRoundResult(**base, promoted=False, reasons=(),
                              candidate={"checkpoint_sha256": candidate.sha256, "path": candidate.path, "model": candidate_id,
                                         "seed": recipe.seed, "first_loss": metrics["first_loss"],
                                         "last_loss": metrics["last_loss"]},
                              seconds={**seconds, "total": round(time.monotonic() - t0, 3)})
    return decide_rl_round(config, tracker, undecided, comparison, floor, parent_run_id=parent_run.run_id)


def decide_rl_round(config: RlRoundConfig, tracker: Tracker, result: RlRoundResult, comparison: HeldoutComparison,
                    floor: NoiseFloor, *, parent_run_id: str | None = None) -> RlRoundResult:
    """Apply the round's registered (or amended) gate to the held-out comparison and the floor; record the outcome.

    A rejection is written to the ledger with its numbers (``candidate_rejected``, ``hypothesis_refuted``); a
    promotion reads the held-out split once for the new release and writes its card (rule 4, rule 6).
    ``round_decided`` either way, and the decision is stored so that a retry returns it. After a gate
    amendment the candidate must have been trained on the fresh seeds it requires (rule 3): its seed is
    read from its policy checkpoint's recipe (:func:`candidate_seed`).

    Raises:
        LedgerError: after an amendment, a candidate trained on a seed used before it (nothing is recorded).
    """
    key = result.round
    store = RoundStore(config.task, config.home)
    done = store.load(RL_DECISION, RlRoundResult, key)
    if done is not None:
        return done  # decided once
    ledger = Ledger(config.task, config.home)
    hypothesis = ledger.require_hypothesis(key)
    gate = ledger.effective_gate(key)
    if ledger.amendments(key):  # rule 3: an amended gate is passed on fresh seeds only
        ledger.require_fresh_seed(key, candidate_seed(result.candidate))
    # The arms are seeds of the candidate's recipe, not draws of the parent: the spread is the floor, and
    # the seed bound (arms' prediction bound minus the parent) does not apply.
    verdict = decide_promotion(gate, comparison.delta, floor, {PRIMARY_METRIC: comparison.candidate.pass_at_1},
                               {PRIMARY_METRIC: comparison.parent.pass_at_1}, apply_seed_bound=False)
    result = replace(result, promoted=verdict.promote, reasons=tuple(verdict.reasons), comparison=comparison.to_dict(),
                     noise_floor=floor.to_dict(), checks=dict(verdict.checks))
    parent_run_id = parent_run_id or round_run(tracker, config.loop_config(), key).run_id
    tracker.log_metrics(parent_run_id, {f"candidate.{PRIMARY_METRIC}": comparison.candidate.pass_at_1,
                                        f"champion.{PRIMARY_METRIC}": comparison.parent.pass_at_1,
                                        f"delta.{PRIMARY_METRIC}": comparison.delta["delta"], "noise_floor": floor.floor})
    if not verdict.promote:
        return _record_rejection(config, ledger, store, tracker, parent_run_id, result, hypothesis)
    return _publish(config, ledger, store, tracker, parent_run_id, result, hypothesis, comparison, floor, verdict)


def candidate_seed(candidate: Mapping[str, Any] | None) -> Any:
    """The seed a candidate policy was trained on: its checkpoint's recipe (the manifest checked), else the
    ``seed`` the result records; ``None`` when neither says."""
    if candidate and candidate.get("path"):
        import yaml

        checkpoint = read_policy_checkpoint(candidate["path"])  # refuses a checkpoint whose files changed
        return yaml.safe_load((Path(checkpoint.path) / RECIPE_FILE).read_text(encoding="utf-8")).get("seed")
    return (candidate or {}).get("seed")


def _record_rejection(config: RlRoundConfig, ledger: Ledger, store: RoundStore, tracker: Tracker, parent_run_id: str,
                      result: RlRoundResult, hypothesis: Hypothesis) -> RlRoundResult:
    key = result.round
    delta = (result.comparison or {}).get("delta")
    ledger.append(EVENT_CANDIDATE_REJECTED, {
        "round": key, "reasons": list(result.reasons), "delta": delta,
        "noise_floor": (result.noise_floor or {}).get("floor"),
        "checkpoint_sha256": (result.candidate or {}).get("checkpoint_sha256"),
        "candidate": (result.comparison or {}).get("candidate"), "champion": (result.comparison or {}).get("parent"),
        "sft_snapshot": result.snapshot.get("sha256"), "change_kind": CHANGE_KIND}, key=f"rejected:{key}")
    ledger.append(EVENT_HYPOTHESIS_REFUTED, {"round": key, "hash": hypothesis.hash}, key=f"refuted:{key}")
    ledger.append(EVENT_ROUND_DECIDED, {"round": key, "promoted": False,
                                        "observed_delta": None if delta is None else delta["delta"], "release": None},
                  key=f"decided:{key}")
    tracker.end_run(parent_run_id)
    store.save(RL_DECISION, result, key)
    return result


def _publish(config: RlRoundConfig, ledger: Ledger, store: RoundStore, tracker: Tracker, parent_run_id: str,
             result: RlRoundResult, hypothesis: Hypothesis, comparison: HeldoutComparison, floor: NoiseFloor,
             verdict: PromotionDecision) -> RlRoundResult:
    key = result.round
    release = ledger.next_release_number()
    # Keyed by the checkpoint: a retry after a crash between this read and the card finishes from the stored read.
    holdout = ledger.read_holdout_once(release, lambda: {"candidate": asdict(comparison.candidate),
                                                         "parent": asdict(comparison.parent)},
                                       key=f"checkpoint:{(result.candidate or {}).get('checkpoint_sha256')}")
    candidate = dict(result.candidate or {})
    card = {
        "round": key, "task": config.task, "kind": CHANGE_KIND, "dataset": f"{result.dataset}@{result.dataset_version}",
        "data_snapshot": result.snapshot["sha256"], "recipe_hash": config.recipe.hash,
        "checkpoint_sha256": candidate["checkpoint_sha256"], "policy_checkpoint": candidate["path"],
        "base_model": config.recipe.base_model, "holdout": holdout, "test": comparison.to_dict(),
        "gate": asdict(hypothesis.gate), "effective_gate": asdict(ledger.effective_gate(key)),
        "amendments": ledger.amendments(key), "noise_floor": floor.floor, "guards": dict(verdict.checks),
        "hypothesis_hash": hypothesis.hash, "predicted_delta": hypothesis.predicted_delta,
        "limitations": ["The held-out split is both the gate's test and the release's one holdout read (the "
                        "environment dataset has two splits).",
                        "The noise floor is the spread of null arms trained on this round's snapshot."],
    }
    markdown = (f"# Release {release} ({config.task}, {CHANGE_KIND})\n\n"
                f"- held-out pass@1: {comparison.candidate.pass_at_1:.4f} (parent {comparison.parent.pass_at_1:.4f}, "
                f"delta {comparison.delta['delta']:+.4f} [{comparison.delta['ci_low']:+.4f}, {comparison.delta['ci_high']:+.4f}])\n"
                f"- noise floor: {floor.floor:.4f}\n- policy checkpoint: {candidate['checkpoint_sha256']}\n")
    ledger.write_release_card(release, card, markdown)
    run = child_run(tracker, config.loop_config(), key, KIND_RELEASE, {TAG_RELEASE: str(release),
                                                                       TAG_CHECKPOINT: candidate["checkpoint_sha256"]})
    tracker.log_metrics(run.run_id, {f"holdout.{PRIMARY_METRIC}": comparison.candidate.pass_at_1})
    tracker.end_run(run.run_id)
    ledger.append(EVENT_ROUND_DECIDED, {"round": key, "promoted": True, "observed_delta": comparison.delta["delta"],
                                        "release": release}, key=f"decided:{key}")
    tracker.end_run(parent_run_id)
    result = replace(result, release=release)
    store.save(RL_DECISION, result, key)
    return result


__all__ = ["ArmScore", "CHANGE_KIND", "CONFIDENCE_LEVEL", "HeldoutComparison", "PRIMARY_METRIC", "RlRoundConfig",
           "RlRoundResult", "candidate_seed", "current_policy", "decide_rl_round", "heldout_comparison", "heldout_score",
           "null_arm_seeds", "register_rl_hypothesis", "rl_hypothesis_power", "run_rl_round", "serving", "train_policy"]
