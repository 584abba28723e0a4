"""The agent evaluation asset: pass@k of one agent on one environment dataset version."""

import dagster as dg

from envloop_pipelines.core.agents.client import AgentSpec
from envloop_pipelines.core.agents.evaluate import evaluate_agent, load_environments, track_evaluation
from envloop_pipelines.core.agents.runner import AttemptLimits
from envloop_pipelines.defs.agents.partitions import agent_evaluation_partitions
from envloop_pipelines.resources.loop import LoopResource, MlflowResource

AGENTS_GROUP = "agents"


class AgentEvaluationConfig(dg.Config):
    """What a person picks when launching an evaluation (the partition names the dataset version and the agent)."""

    attempts: int = 1
    split: str | None = None
    max_turns: int = 16
    max_tokens: int = 8192
    wall_s: float = 300.0
    workers: int = 4
    api_key_env: str | None = None
    agent_kind: str = "chat"


@dg.asset(partitions_def=agent_evaluation_partitions, group_name=AGENTS_GROUP)
def agent_evaluation(context: dg.AssetExecutionContext, config: AgentEvaluationConfig, loop: LoopResource,
                     mlflow: MlflowResource) -> dg.MaterializeResult:
    """An agent's pass@1 and pass@k (with CIs) on a dataset version's environments, each attempt sandboxed and verified."""
    keys = context.partition_key.keys_by_dimension
    home = loop.config().home
    dataset = load_environments(keys["dataset_version"], home=home)
    agent = AgentSpec.from_label(keys["agent"], api_key_env=config.api_key_env, kind=config.agent_kind)  # type: ignore[arg-type]
    limits = AttemptLimits(max_turns=config.max_turns, max_tokens=config.max_tokens, wall_s=config.wall_s,
                           request_timeout_s=min(60.0, config.wall_s))
    result = evaluate_agent(dataset, agent, attempts=config.attempts, split=config.split, limits=limits,
                            workers=config.workers, home=home)
    run = track_evaluation(result, mlflow.tracker())
    metadata: dict = {f"pass_at_{p.k}": dg.MetadataValue.float(p.value) for p in result.pass_at_k}
    metadata.update({
        "pass_at_1_ci": f"[{result.pass_at_1.ci_low:.3f}, {result.pass_at_1.ci_high:.3f}] ({result.pass_at_1.method})",
        "n_environments": result.n_environments,
        "n_attempts": result.n_attempts,
        "errors": result.statuses["error"],
        "seconds_per_attempt": dg.MetadataValue.float(result.cost.mean_attempt_s),
        "tokens_per_attempt": dg.MetadataValue.float(float(result.cost.tokens_per_attempt)),
        "run_dir": dg.MetadataValue.path(result.run_dir),
        "mlflow_run": dg.MetadataValue.url(run.url),
    })
    if result.aggregate_only:
        metadata["per_environment"] = dg.MetadataValue.md("Held-out environments: aggregates only (rule 4).")
    else:
        lines = ["| environment | attempts | passed | rate |", "|---|---|---|---|"]
        lines += [f"| {r.environment_id} | {r.attempts} | {r.passed} | {r.pass_rate:.2f} |" for r in result.per_environment]
        metadata["per_environment"] = dg.MetadataValue.md("\n".join(lines))
    return dg.MaterializeResult(metadata=metadata)


AGENT_ASSETS = [agent_evaluation]
