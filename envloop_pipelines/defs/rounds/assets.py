"""The assets of a round. Each body resolves config, calls one core function, returns metadata."""


import json

import dagster as dg
import pyarrow.parquet as pq

from envloop_pipelines.core.loop import round as core
from envloop_pipelines.defs.rounds.metadata import metrics_table, mlflow_link, run_tags
from envloop_pipelines.defs.rounds.partitions import rounds
from envloop_pipelines.resources.loop import LoopResource, MlflowResource

ROUND_GROUP = "round"


@dg.asset(group_name="benchmark")
def task_benchmark(loop: LoopResource) -> dg.MaterializeResult:
    """The task's versioned, group-disjoint splits (the built-in benchmark is generated on first use)."""
    snapshot = core.ensure_task_benchmark(loop.config())
    summary = snapshot.summary()
    rows = {s: {"groups": v["groups"], "records": v["records"], "questions": v["questions"]}
            for s, v in summary["splits"].items()}
    return dg.MaterializeResult(metadata={
        "benchmark_version": snapshot.benchmark_version,
        "snapshot_id": snapshot.snapshot_id,
        "splits": metrics_table(rows),
        "n_questions": sum(v["questions"] for v in summary["splits"].values()),
    }, data_version=dg.DataVersion(snapshot.snapshot_id))


@dg.asset(group_name="benchmark", deps=[task_benchmark])
def noise_floor(context: dg.AssetExecutionContext, loop: LoopResource, mlflow: MlflowResource) -> dg.MaterializeResult:
    """Spread of the primary metric over K null arms of the control recipe; cached per benchmark version and recipe."""
    result = core.measure_noise_floor(loop.config(), mlflow.tracker(), run_tags=run_tags(context))
    arms = {f"seed {a['seed']}": a["metrics"] for a in result["arms"]}
    return dg.MaterializeResult(metadata={
        "noise_floor": result["floor"],
        "key": result["key"],
        "cached": result["cached"],
        "benchmark_version": result["benchmark_version"],
        "recipe_hash": result["recipe_hash"],
        "arms": metrics_table(arms),
        **mlflow_link(result),
    }, data_version=dg.DataVersion(result["key"]))


@dg.asset(partitions_def=rounds, group_name=ROUND_GROUP, deps=[noise_floor])
def baseline_eval(context: dg.AssetExecutionContext, loop: LoopResource) -> dg.MaterializeResult:
    """The champion on dev: per-question predictions and metrics."""
    from envloop_pipelines.core.loop.plots import reliability_diagram

    result = core.baseline_eval(loop.config(), context.partition_key)
    preds = pq.read_table(result["predictions"]).to_pylist()
    dev = {(r["record_id"], r["question_id"]): r for r in core.open_task(loop.task, home=loop.home).table("dev").to_pylist()}
    hard = [(p, dev[(p["record_id"], p["question_id"])]) for p in preds
            if dev[(p["record_id"], p["question_id"])]["soft_label"] is None]
    plot = reliability_diagram([max(p["probs"]) for p, _ in hard],
                               [p["probs"].index(max(p["probs"])) == q["label"] for p, q in hard],
                               title=f"champion release {result['champion_release']} on dev")
    return dg.MaterializeResult(metadata={
        "champion_release": result["champion_release"],
        "checkpoint_sha256": result["checkpoint_sha256"],
        "metrics": metrics_table({"champion (dev)": result["metrics"]}),
        "family_macro_accuracy": result["metrics"].get("family_macro_accuracy"),
        "reliability": dg.MetadataValue.md(plot),
    })


@dg.asset(partitions_def=rounds, group_name=ROUND_GROUP, deps=[baseline_eval])
def failure_mining(context: dg.AssetExecutionContext, loop: LoopResource) -> dg.MaterializeResult:
    """The champion's dev errors and confident errors, clustered and ranked by excess error."""
    result = core.failure_mining(loop.config(), context.partition_key)
    top = result["clusters"][:10]
    lines = ["| cluster | n | errors | confident | excess | examples |", "|---|---|---|---|---|---|"]
    lines += [f"| {c['name']} | {c['n']} | {c['errors']} | {c['confident_errors']} | {c['excess_errors']:.1f} | "
              f"{', '.join(c['example_ids'][:2])} |" for c in top]
    return dg.MaterializeResult(metadata={
        "n_errors": result["n_errors"],
        "n_confident_errors": result["n_confident_errors"],
        "error_rate": result["error_rate"],
        "n_clusters": len(result["clusters"]),
        "top_clusters": dg.MetadataValue.md("\n".join(lines)),
    })


@dg.asset(partitions_def=rounds, group_name=ROUND_GROUP, deps=[failure_mining])
def environment_synthesis(context: dg.AssetExecutionContext, loop: LoopResource) -> dg.MaterializeResult:
    """New training examples aimed at the top failure clusters, each with provenance to its cluster."""
    result = core.environment_synthesis(loop.config(), context.partition_key)
    return dg.MaterializeResult(metadata={
        "generator": result["generator"],
        "n_rows": result["n_rows"],
        "per_cluster": dg.MetadataValue.json(result["per_cluster"]),
        "sha256": result["sha256"],
    })


class HypothesisConfig(dg.Config):
    """A person's hypothesis for the round (JSON); empty means derive it from the mined failures.

    Keys: ``change`` (object), ``predicted_delta`` (number), ``gate`` (Gate fields such as
    ``min_delta``, ``primary_metric``), ``seeds`` (list), ``rationale`` (text).
    """

    proposal_json: str = ""


@dg.asset(partitions_def=rounds, group_name=ROUND_GROUP, deps=[environment_synthesis])
def registered_hypothesis(context: dg.AssetExecutionContext, config: HypothesisConfig, loop: LoopResource,
                          mlflow: MlflowResource) -> dg.MaterializeResult:
    """The round's hypothesis (change, predicted delta, gate, seeds), in MLflow and the ledger before training; immutable."""
    proposal = json.loads(config.proposal_json) if config.proposal_json.strip() else None
    result = core.registered_hypothesis(loop.config(), context.partition_key, mlflow.tracker(), proposal=proposal,
                                        run_tags=run_tags(context))
    return dg.MaterializeResult(metadata={
        "hash": result["hash"],
        "author": result["author"],
        "predicted_delta": result["predicted_delta"],
        "gate": dg.MetadataValue.json(result["gate"]),
        "change": dg.MetadataValue.json(result["change"]),
        **mlflow_link(result),
    }, data_version=dg.DataVersion(result["hash"]))


@dg.asset(partitions_def=rounds, group_name=ROUND_GROUP, deps=[environment_synthesis])
def training_dataset_snapshot(context: dg.AssetExecutionContext, loop: LoopResource) -> dg.MaterializeResult:
    """Base train plus synthesized rows as content-addressed Parquet, with its contamination report."""
    result = core.training_dataset_snapshot(loop.config(), context.partition_key)
    return dg.MaterializeResult(metadata={
        "sha256": result["sha256"],
        "path": dg.MetadataValue.path(result["path"]),
        "n_rows": result["n_rows"],
        "n_synthesized": result["n_synthesized"],
        "n_removed_as_contaminated": result["n_removed"],
    }, data_version=dg.DataVersion(result["sha256"]))


# One GPU and memory for training when the run uses the k8s_job_executor (ignored locally). A GPU is an
# extended resource: its limit is also its request. The toleration lets the step pod onto GPU nodes tainted
# nvidia.com/gpu (the usual taint of a GPU node pool); it changes nothing where there is no such taint.
TRAINING_POD = {"dagster-k8s/config": {
    "container_config": {"resources": {
        "requests": {"cpu": "4", "memory": "16Gi"}, "limits": {"nvidia.com/gpu": "1", "memory": "32Gi"}}},
    "pod_spec_config": {"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]},
}}


@dg.asset(partitions_def=rounds, group_name=ROUND_GROUP, deps=[training_dataset_snapshot, registered_hypothesis],
          op_tags=TRAINING_POD)
def lora_checkpoint(context: dg.AssetExecutionContext, loop: LoopResource, mlflow: MlflowResource) -> dg.MaterializeResult:
    """LoRA SFT from the champion on the round's snapshot, calibrated on val; refuses without a registered hypothesis."""
    result = core.lora_checkpoint(loop.config(), context.partition_key, mlflow.tracker(), run_tags=run_tags(context))
    return dg.MaterializeResult(metadata={
        "checkpoint_sha256": result["checkpoint_sha256"],
        "checkpoint": dg.MetadataValue.path(result["checkpoint"]),
        "init_from": result["init_from"],
        "train_s": result["train_s"],
        "val_metrics": metrics_table({"candidate (val)": result["metrics"].get("val", result["metrics"])}),
        **mlflow_link(result),
    }, data_version=dg.DataVersion(result["checkpoint_sha256"]))


@dg.asset(partitions_def=rounds, group_name=ROUND_GROUP, deps=[lora_checkpoint])
def independent_reeval(context: dg.AssetExecutionContext, loop: LoopResource, mlflow: MlflowResource) -> dg.MaterializeResult:
    """Candidate and champion scored on the hidden test set by the sandboxed verifier, beside a TF-IDF baseline."""
    result = core.independent_reeval(loop.config(), context.partition_key, mlflow.tracker(), run_tags=run_tags(context))
    deltas = result["paired"]["deltas"]
    lines = ["| metric | delta | 95% CI |", "|---|---|---|"]
    lines += [f"| {k} | {v['delta']:+.4f} | [{v['ci_low']:+.4f}, {v['ci_high']:+.4f}] |" for k, v in deltas.items()
              if v["delta"] is not None and v["ci_low"] is not None]
    return dg.MaterializeResult(metadata={
        "test_metrics": metrics_table({"candidate": result["candidate"], "champion": result["champion"],
                                       "TF-IDF + LR": result["tfidf_baseline"]}),
        "paired_deltas": dg.MetadataValue.md("\n".join(lines)),
        "verifier_pid": result["verifier_pid"],
        "verifier_isolation": dg.MetadataValue.json(result["verifier"]),
        **mlflow_link(result),
    })


@dg.asset(partitions_def=rounds, group_name=ROUND_GROUP, deps=[independent_reeval])
def promotion_decision(context: dg.AssetExecutionContext, loop: LoopResource, mlflow: MlflowResource) -> dg.MaterializeResult:
    """The registered gate applied: a release card and the champion alias on promotion, a refuted hypothesis otherwise."""
    from envloop_pipelines.core.loop.ledger import Ledger
    from envloop_pipelines.core.loop.plots import metric_by_round

    cfg = loop.config()
    result = core.promotion_decision(cfg, context.partition_key, mlflow.tracker(), run_tags=run_tags(context))
    releases = Ledger(cfg.task, cfg.home).releases()
    plot = metric_by_round([str(r["release"]) for r in releases],
                           {"holdout family-macro accuracy": [r["holdout"].get("family_macro_accuracy") for r in releases]},
                           "release chain")
    return dg.MaterializeResult(metadata={
        "promoted": result["promote"],
        "release": result["release"],
        "reasons": dg.MetadataValue.md("\n".join(f"- {r}" for r in result["reasons"])),
        "delta": result["delta"]["delta"],
        "noise_floor": result["noise_floor"],
        "release_chain": dg.MetadataValue.md(plot),
    })


ROUND_ASSETS = [baseline_eval, failure_mining, environment_synthesis, registered_hypothesis,
                training_dataset_snapshot, lora_checkpoint, independent_reeval, promotion_decision]

# Run tag of the round (it trains): the cluster's run queue allows one running round per value
# (k8s/dagster/values.yaml, tagConcurrencyLimits); the local instance sets no tag limit.
GPU_POOL_TAG = "envloop/gpu-pool"
round_job = dg.define_asset_job("round_job", selection=dg.AssetSelection.assets(*ROUND_ASSETS),
                                description="One round of the loop, for one partition of `rounds`.",
                                tags={GPU_POOL_TAG: "training"})
setup_job = dg.define_asset_job("setup_job", selection=dg.AssetSelection.assets(task_benchmark, noise_floor),
                                description="The benchmark and the noise floor (and the first champion).")

__all__ = ["GPU_POOL_TAG", "ROUND_ASSETS", "TRAINING_POD", "round_job", "setup_job", "task_benchmark", "noise_floor"]
