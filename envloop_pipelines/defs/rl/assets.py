"""The RL round asset: sample, keep the verified attempts, SFT a causal LM, re-evaluate, apply the registered gate.

A round's steps run inside one asset (``core/loop/rl_round.py`` records each in the ledger and MLflow): the
sampled attempts, the SFT snapshot and the policy checkpoints are content-addressed under the EnvLoop home,
and a retry of a decided round returns its stored decision.
"""

import dagster as dg

from envloop_pipelines.resources.loop import LoopResource, MlflowResource

RL_GROUP = "rl"
rl_rounds = dg.DynamicPartitionsDefinition(name="rl_rounds")


class RlRoundAssetConfig(dg.Config):
    """What a person picks when launching an RL round (the partition is the round key, ``r0001``)."""

    dataset: str  # the environment dataset, <name>@<version> (envloop env list)
    recipe: str = "packaged:causal_sft_qwen_gpu.yaml"  # a causal-SFT recipe: packaged:<file> or a path
    task: str | None = None  # the loop's name (ledger, MLflow experiment); default rl-<dataset name>
    sampler_url: str | None = None  # an OpenAI-compatible agent that samples; unset: the current policy, served
    sampler_model: str | None = None
    sampler_key_env: str | None = None
    attempts: int = 4
    eval_attempts: int = 4
    noise_arms: int = 2
    predicted_delta: float = 0.05
    max_turns: int = 8
    max_tokens: int = 2048
    wall_s: float = 300.0
    completion_tokens: int = 512  # the served policy's cap per completion
    workers: int = 2


@dg.asset(partitions_def=rl_rounds, group_name=RL_GROUP)
def rl_round(context: dg.AssetExecutionContext, config: RlRoundAssetConfig, loop: LoopResource,
             mlflow: MlflowResource) -> dg.MaterializeResult:
    """An RL round: verified attempts become SFT data for a causal LM, re-evaluated on held-out environments and gated."""
    from envloop_pipelines.core.agents.client import AgentSpec
    from envloop_pipelines.core.agents.runner import AttemptLimits
    from envloop_pipelines.core.environments.dataset import open_dataset
    from envloop_pipelines.core.loop.rl_round import RlRoundConfig, run_rl_round
    from envloop_pipelines.core.model.causal_sft import load_causal_sft_recipe

    home = loop.config().home
    dataset = open_dataset(config.dataset, home=home)
    if (config.sampler_url is None) != (config.sampler_model is None):
        raise dg.Failure("sampler_url and sampler_model go together (or neither: the current policy samples)")
    sampler = None if config.sampler_url is None else AgentSpec(config.sampler_url, config.sampler_model,  # type: ignore[arg-type]
                                                                api_key_env=config.sampler_key_env)
    round_config = RlRoundConfig(
        task=config.task or f"rl-{dataset.name}", recipe=load_causal_sft_recipe(config.recipe), attempts=config.attempts,
        eval_attempts=config.eval_attempts, noise_arms=config.noise_arms, predicted_delta=config.predicted_delta,
        limits=AttemptLimits(max_turns=config.max_turns, max_tokens=config.max_tokens, wall_s=config.wall_s,
                             request_timeout_s=min(120.0, config.wall_s)),
        max_tokens=config.completion_tokens, workers=config.workers, home=home)
    result = run_rl_round(round_config, dataset, mlflow.tracker(), sampler=sampler, key=context.partition_key)
    comparison = result.comparison or {}
    metadata: dict = {
        "promoted": result.promoted,
        "reasons": dg.MetadataValue.md("\n".join(f"- {r}" for r in result.reasons)),
        "sampled_attempts": result.snapshot["n_attempts"],
        "verified_attempts": result.snapshot["n_passed"],
        "sft_rows": result.snapshot["n_rows"],
        "sft_snapshot": result.snapshot["sha256"],
        "hypothesis_hash": result.hypothesis_hash,
    }
    if comparison:
        metadata.update({
            "candidate_pass_at_1": dg.MetadataValue.float(comparison["candidate"]["pass_at_1"]),
            "parent_pass_at_1": dg.MetadataValue.float(comparison["parent"]["pass_at_1"]),
            "delta_pass_at_1": dg.MetadataValue.float(comparison["delta"]["delta"]),
            "delta_ci": f"[{comparison['delta']['ci_low']:+.3f}, {comparison['delta']['ci_high']:+.3f}]",
            "noise_floor": dg.MetadataValue.float((result.noise_floor or {}).get("floor", 0.0)),
            "policy_checkpoint": dg.MetadataValue.path(result.candidate["path"]),  # type: ignore[index]
        })
    if result.release is not None:
        metadata["release"] = result.release
    return dg.MaterializeResult(metadata=metadata)


rl_round_job = dg.define_asset_job("rl_round_job", selection=[rl_round], partitions_def=rl_rounds)
RL_ASSETS = [rl_round]
