"""The assets of an RL round, one per step. Each body resolves its settings, calls one core step, returns its record.

The steps are :mod:`envloop_pipelines.core.rl_loop.round_steps`; their frozen records
(``core/rl_loop/step_records.py``) go through ``RlStoreIOManager`` (``resources/rl.py``),
so the graph's edges are the data flow. The policy server the steps use is
``defs/rl/serving.py``'s (``envloop serve``'s policy app).
"""

from typing import Any

import dagster as dg

from envloop_pipelines.core.rl_loop import run_round as rl_round, round_steps as rl_steps
from envloop_pipelines.core.rl_loop.step_records import (
    RlCandidate,
    RlHypothesis,
    RlNoiseFloor,
    RlReevaluation,
    RlRoundResult,
    RlSampling,
    RlSnapshot,
)
from envloop_pipelines.resources.rl import RlResource
from envloop_pipelines.defs.rl.serving import serve_policy
from envloop_pipelines.resources.loop import MlflowResource

RL_GROUP = "rl"
RL_IO = "rl_io_manager"
rl_rounds = dg.DynamicPartitionsDefinition(name="rl_rounds")


def _dataset(rl: Any) -> Any:
    from envloop_pipelines.core.environments.dataset import open_dataset

    cfg = rl.config()
    if not cfg.dataset:
        raise dg.Failure("resources.rl.config.dataset is not set: name the environment dataset (<name>@<version>)",
                         allow_retries=False)
    return open_dataset(cfg.dataset, home=cfg.home)


def _asset(**kwargs: Any) -> Any:
    return dg.asset(partitions_def=rl_rounds, group_name=RL_GROUP, io_manager_key=RL_IO, **kwargs)


@_asset()
def rl_hypothesis(context: dg.AssetExecutionContext, rl: RlResource, mlflow: MlflowResource) -> dg.Output[RlHypothesis]:
    """The RL round's hypothesis (change, predicted pass@1 gain, gate, seeds, MDE, parent policy), registered first."""
    from envloop_pipelines.core.ledger.hypothesis import GateTooLooseError, HypothesisRefusedError

    config, dataset = rl.config(), _dataset(rl)
    try:
        result = rl_steps.register_rl_hypothesis(config, dataset, context.partition_key, mlflow.tracker())
    except (GateTooLooseError, HypothesisRefusedError, ValueError) as exc:  # refused: the same next time
        raise dg.Failure(description=f"round {context.partition_key}: hypothesis refused: {exc}", allow_retries=False) from None
    h = result.hypothesis
    return dg.Output(result, metadata={
        "hash": result.hash, "predicted_delta": h.predicted_delta, "gate": dg.MetadataValue.json(h.gate.__dict__),
        "parent": dg.MetadataValue.json(dict(result.parent)), "sampler": dg.MetadataValue.json(dict(result.sampler)),
        **({"mde": h.power["mde"], "underpowered": h.underpowered} if h.power and h.power.get("mde") is not None else {}),
    }, data_version=dg.DataVersion(result.hash))


@_asset()
def rl_sampled_attempts(rl: RlResource, mlflow: MlflowResource, rl_hypothesis: RlHypothesis) -> dg.Output[RlSampling]:
    """K attempts per training environment by the sampler (the parent policy, served, unless an agent is named)."""
    result = rl_steps.sample_attempts(rl.config(), _dataset(rl), rl_hypothesis, mlflow.tracker(), serve_policy)
    return dg.Output(result, metadata={"n_attempts": result.n_attempts, "n_passed": result.n_passed,
                                       "attempts": dg.MetadataValue.path(result.attempts_path)})


@_asset()
def rl_sft_snapshot(rl: RlResource, mlflow: MlflowResource, rl_sampled_attempts: RlSampling) -> dg.Output[RlSnapshot]:
    """The verified attempts as chat rows with provenance, contamination-checked, content-addressed."""
    result = rl_steps.build_rl_snapshot(rl.config(), _dataset(rl), rl_sampled_attempts, mlflow.tracker())
    return dg.Output(result, metadata={"sha256": result.sha256, "n_rows": result.n_rows, "n_passed": result.n_passed,
                                       "n_removed_as_contaminated": result.n_removed},
                     data_version=dg.DataVersion(result.sha256))


@_asset()
def rl_policy_checkpoint(rl: RlResource, mlflow: MlflowResource, rl_hypothesis: RlHypothesis,
                         rl_sft_snapshot: RlSnapshot) -> dg.Output[RlCandidate]:
    """LoRA SFT of the base model on the snapshot, on the registered (or fresh, after an amendment) seed."""
    result = rl_steps.train_rl_candidate(rl.config(), rl_hypothesis, rl_sft_snapshot, mlflow.tracker())
    meta = {"skipped": result.skipped} if result.skipped else {
        "checkpoint_sha256": result.checkpoint_sha256, "checkpoint": dg.MetadataValue.path(result.path or ""),
        "seed": result.seed, "first_loss": result.first_loss, "last_loss": result.last_loss}
    return dg.Output(result, metadata=meta)


@_asset()
def rl_noise_floor(rl: RlResource, mlflow: MlflowResource, rl_sft_snapshot: RlSnapshot,
                   rl_policy_checkpoint: RlCandidate) -> dg.Output[RlNoiseFloor]:
    """The spread of held-out pass@1 over null arms: the candidate's recipe and snapshot, other seeds."""
    result = rl_steps.measure_rl_noise_floor(rl.config(), _dataset(rl), rl_sft_snapshot, rl_policy_checkpoint,
                                             mlflow.tracker(), serve_policy)
    return dg.Output(result, metadata={} if result.floor is None else {"noise_floor": result.floor.floor})


@_asset()
def rl_heldout_reeval(rl: RlResource, mlflow: MlflowResource, rl_hypothesis: RlHypothesis,
                      rl_policy_checkpoint: RlCandidate) -> dg.Output[RlReevaluation]:
    """Candidate and parent policy on the held-out environments, same sampling seeds: aggregates only."""
    result = rl_steps.reevaluate_rl(rl.config(), _dataset(rl), rl_hypothesis, rl_policy_checkpoint, mlflow.tracker(),
                                    serve_policy)
    comp = result.comparison
    return dg.Output(result, metadata={} if comp is None else {
        "candidate_pass_at_1": comp.candidate.pass_at_1, "parent_pass_at_1": comp.parent.pass_at_1,
        "delta_pass_at_1": comp.delta["delta"], "delta_ci": f"[{comp.delta['ci_low']:+.3f}, {comp.delta['ci_high']:+.3f}]"})


@_asset()
def rl_decision(rl: RlResource, mlflow: MlflowResource, rl_hypothesis: RlHypothesis, rl_sampled_attempts: RlSampling,
                rl_sft_snapshot: RlSnapshot, rl_policy_checkpoint: RlCandidate, rl_noise_floor: RlNoiseFloor,
                rl_heldout_reeval: RlReevaluation) -> dg.Output[RlRoundResult]:
    """The registered gate applied: a release card naming the policy on promotion, a refuted hypothesis otherwise."""
    result = rl_round.decide_rl_round(rl.config(), mlflow.tracker(), rl_hypothesis, rl_sampled_attempts, rl_sft_snapshot,
                                      rl_policy_checkpoint, rl_noise_floor, rl_heldout_reeval)
    return dg.Output(result, metadata={"promoted": result.promoted,
                                       "reasons": dg.MetadataValue.md("\n".join(f"- {r}" for r in result.reasons)),
                                       **({"release": result.release} if result.release is not None else {})})


RL_ASSETS = [rl_hypothesis, rl_sampled_attempts, rl_sft_snapshot, rl_policy_checkpoint, rl_noise_floor, rl_heldout_reeval,
             rl_decision]
rl_round_job = dg.define_asset_job("rl_round_job", selection=dg.AssetSelection.assets(*RL_ASSETS),  # partitioned as its assets (rl_rounds)
                                   description="One RL round (RL from verified attempts), for one partition of `rl_rounds`.")

__all__ = ["RL_ASSETS", "RL_GROUP", "rl_round_job", "rl_rounds"]
