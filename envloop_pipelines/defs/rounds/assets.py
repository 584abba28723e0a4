"""The assets of a round. Each body resolves config, calls one core function, returns its typed value.

The values are frozen records (``core/decision_loop/step_records.py``) that the ``RoundStoreIOManager``
stores and hands to the downstream assets, so the graph's edges are the data flow. ``task_benchmark`` pins
the task's benchmark version; every later step takes its record, opens the task once
(``LoopResource.task_snapshot``: refused if the task was re-imported since) and hands that snapshot to core.
"""


from typing import NoReturn

import dagster as dg
import pyarrow.parquet as pq

# One core module per asset, named after it: the asset graph is the map of core/decision_loop/ (test_asset_modules).
from envloop_pipelines.core.decision_loop.task_benchmark import ensure_task_benchmark
from envloop_pipelines.core.decision_loop.noise_floor import measure_noise_floor
from envloop_pipelines.core.decision_loop.baseline_eval import evaluate_champion
from envloop_pipelines.core.decision_loop.champion_noise_floor import measure_champion_noise_floor
from envloop_pipelines.core.decision_loop.failure_mining import mine_failures
from envloop_pipelines.core.decision_loop.environment_synthesis import synthesize_environments
from envloop_pipelines.core.decision_loop.registered_hypothesis import register_hypothesis
from envloop_pipelines.core.decision_loop.training_dataset_snapshot import build_training_snapshot
from envloop_pipelines.core.decision_loop.lora_checkpoint import train_candidate
from envloop_pipelines.core.decision_loop.independent_reeval import reevaluate
from envloop_pipelines.core.decision_loop.promotion_decision import decide_round
from envloop_pipelines.core.decision_loop.step_records import (
    BaselineEval,
    Benchmark,
    EnvironmentSynthesis,
    FailureMining,
    MeasuredNoiseFloor,
    Reevaluation,
    RegisteredHypothesis,
    RoundDecision,
    TrainedCheckpoint,
    TrainingSnapshot,
)
from envloop_pipelines.defs.rounds.metadata import (
    DECISION,
    PROMOTION_WARNING,
    decision_numbers,
    ledger_metadata,
    metrics_table,
    mlflow_link,
    run_tags,
)
from envloop_pipelines.defs.rounds.partitions import rounds
from envloop_pipelines.core.tracking import RUN_FAILED, RUN_FINISHED, close_round_runs
from envloop_pipelines import names
from envloop_pipelines.names import GPU_POOL_TAG, NO_RETRY_TAG, REFUSED_TAG
from envloop_pipelines.resources.loop import LoopResource, MlflowResource
from envloop_pipelines.resources.sandbox import SandboxResource

ROUND_GROUP = "round"

# Run tags of a run whose hypothesis was refused (names.py): Dagster's own NO_RETRY_TAG keeps the instance's run
# retries (``run_retries`` in dagster.yaml) from launching it again (a refusal fails the same way every time);
# REFUSED_TAG tells the failed-round sensor to write nothing (a refusal writes nothing).


def refuse_bad_proposal(context: dg.AssetExecutionContext, proposal_json: str) -> dict | None:
    """The person's hypothesis of this run (``registered_hypothesis``'s ``proposal_json``), checked.

    A refusal (``proposal_errors``, every problem named) tags the run so that it is not retried
    and raises ``dg.Failure(allow_retries=False)`` with the reasons; called by the round's first step
    as well, so a refused round stops before anything of it is written (no file, ledger event or MLflow
    run), and its partition, used by no other run, is removed again.
    """
    if not proposal_json.strip():
        return None
    from envloop_pipelines.core.decision_loop.proposals import ProposalError, parse_proposal

    try:
        return parse_proposal(proposal_json, source="proposal_json", text_only=True)
    except ProposalError as exc:
        json_error = exc.errors[0].startswith("line ")  # where in the text: say which text
        refuse(context, f"round {context.partition_key}: hypothesis refused: " + (str(exc) if json_error else
                                                                                  "; ".join(exc.errors)))


def refuse(context: dg.AssetExecutionContext, message: str, reason: str = "hypothesis") -> NoReturn:
    """Fail the step with a refusal: the run tagged never to be retried (``REFUSED_TAG``: ``reason``), and
    ``dg.Failure(allow_retries=False)`` with ``message``; a round that has written nothing yet and has no other run
    gives its partition back."""
    key = context.partition_key
    instance = context.instance
    instance.add_run_tags(context.run_id, {NO_RETRY_TAG: "false", REFUSED_TAG: reason})
    runs = instance.get_runs_count(dg.RunsFilter(tags={names.PARTITION_TAG: key}))
    if runs <= 1 and not _round_started(context, key):
        instance.delete_dynamic_partition(rounds.name, key)
        message += f" (nothing of round {key} was written; its partition is removed)"
    raise dg.Failure(description=message, allow_retries=False)


#: ``REFUSED_TAG`` of a run refused because another run of the task's loop (its setup or a round) held the claim.
BUSY = names.REFUSED_BUSY


def claim_the_loop(context: dg.AssetExecutionContext, loop: LoopResource, what: str) -> None:
    """Claim the task's loop for this run (``core/loop/round_claim.py``) before anything of it is written:
    ``what`` is the round's key, or ``SETUP`` in the setup's steps.

    The first step of a round or of the setup does it for every door: a run launched while another run of the
    task's loop runs (by the remote ``Client``, the HTTP job API, the UI's launchpad, the sensor, the schedule) is
    refused naming that run, its door and how to follow or cancel it (tagged ``REFUSED_TAG`` busy, never retried,
    and ``BUSY_WITH_TAG`` the run that held the claim), having written nothing: no file, ledger event or MLflow
    run, and no data generated. A run whose door claimed for it already (``LocalClient``, ``envloop round start``)
    takes its claim over.
    """
    from envloop_pipelines.defs.rounds.recovery import worker_pid
    from envloop_pipelines.resources.round_claim import SETUP, RoundBusy, claim_round_on

    try:
        claim_round_on(context.instance, loop.config(), what, run_id=context.run.run_id, door=run_door(context.run),
                       pid=worker_pid(context.run))
    except RoundBusy as exc:
        context.instance.add_run_tags(context.run.run_id, {names.BUSY_WITH_TAG: exc.claim.run_id})
        if what != SETUP:
            refuse(context, f"round {what}: refused: {exc}", reason=BUSY)
        context.instance.add_run_tags(context.run.run_id, {NO_RETRY_TAG: "false", REFUSED_TAG: BUSY})
        raise dg.Failure(description=f"setup: refused: {exc}", allow_retries=False) from None


def claim_the_round(context: dg.AssetExecutionContext, loop: LoopResource) -> None:
    """Claim the task's loop for this round's run (:func:`claim_the_loop`, the round's first step)."""
    claim_the_loop(context, loop, context.partition_key)


def claim_the_setup(context: dg.AssetExecutionContext, loop: LoopResource) -> None:
    """Claim the task's loop for this setup's run (:func:`claim_the_loop`): in each of the setup's steps, since a
    launch may materialize the noise floor alone; the second is the same run's claim, taken over."""
    from envloop_pipelines.resources.round_claim import SETUP

    claim_the_loop(context, loop, SETUP)


def run_door(run: dg.DagsterRun) -> str:
    """Who launched ``run``, in words: the sensor or schedule that requested it, the SDK's ``Client``, or a launch of
    its job (the HTTP job API, the UI's launchpad)."""
    tags = run.tags
    if tags.get(names.SENSOR_NAME_TAG):
        return f"sensor {tags[names.SENSOR_NAME_TAG]}"
    if tags.get(names.SCHEDULE_NAME_TAG):
        return f"schedule {tags[names.SCHEDULE_NAME_TAG]}"
    if tags.get(names.CLIENT_TAG) == "sdk":
        return "Client.setup" if run.job_name == names.SETUP_JOB else "Client.start_round"
    return f"a launch of {run.job_name}"


def _round_started(context: dg.AssetExecutionContext, key: str) -> bool:
    """Whether anything of round ``key`` is on disk (an earlier run's steps)."""
    from envloop_pipelines.core.ledger.store import RoundStore

    cfg = context.resources.loop.config()
    return (RoundStore(cfg.task, cfg.home).loop / "rounds" / key).exists()  # round_dir() would create it


def _run_proposal_json(context: dg.AssetExecutionContext) -> str:
    """The hypothesis config of this run's ``registered_hypothesis`` step ('' when none)."""
    ops = (context.run.run_config or {}).get("ops") or {}
    return str(((ops.get("registered_hypothesis") or {}).get("config") or {}).get("proposal_json") or "")

# The label store's own volume on a cluster (k8s/storage.yaml: PVC envloop-verifier), mounted over
# <ENVLOOP_HOME>/verifier (ENVLOOP_HOME=/envloop-home, k8s/dagster/values.yaml) only in the step pods that
# write or score labels: task_benchmark (writes them), noise_floor (scores its arms on test, reads release 1's
# holdout), independent_reeval (test) and promotion_decision (a release's holdout). The training step, the
# other steps, the code server and the inference server never mount it (k8s_job_executor: a pod per step).
VERIFIER_VOLUME = "envloop-verifier"
VERIFIER_MOUNT_PATH = "/envloop-home/verifier"
VERIFIER_POD = {"dagster-k8s/config": {
    "pod_spec_config": {"volumes": [{"name": VERIFIER_VOLUME, "persistent_volume_claim": {"claim_name": VERIFIER_VOLUME}}]},
    "container_config": {"volume_mounts": [{"name": VERIFIER_VOLUME, "mount_path": VERIFIER_MOUNT_PATH}]},
}}


@dg.asset(group_name="benchmark", op_tags=VERIFIER_POD)
def task_benchmark(context: dg.AssetExecutionContext, loop: LoopResource) -> dg.Output[Benchmark]:
    """The task's versioned, group-disjoint splits (the built-in benchmark is generated on first use)."""
    claim_the_setup(context, loop)  # before any data is generated: a second setup beside a run of the loop is refused
    bench = ensure_task_benchmark(loop.config())
    rows = {s: {"groups": v["groups"], "records": v["records"], "questions": v["questions"]}
            for s, v in bench.splits.items()}
    return dg.Output(bench, metadata={
        "benchmark_version": bench.benchmark_version,
        "snapshot_id": bench.snapshot_id,
        "splits": metrics_table(rows),
        "n_questions": sum(v["questions"] for v in bench.splits.values()),
    }, data_version=dg.DataVersion(bench.snapshot_id))


@dg.asset(group_name="benchmark", op_tags=VERIFIER_POD)
def noise_floor(context: dg.AssetExecutionContext, loop: LoopResource, mlflow: MlflowResource,
                sandbox: SandboxResource, task_benchmark: Benchmark) -> dg.Output[MeasuredNoiseFloor]:
    """Spread of the primary metric over K null arms of the control recipe; cached per benchmark version and recipe."""
    from envloop_pipelines.core.loop.promotion import champion_out_of_reach

    claim_the_setup(context, loop)  # before any arm or holdout slot: this run's own claim, or a launch of this step alone
    cfg = loop.config()
    result = measure_noise_floor(cfg, loop.task_snapshot(task_benchmark), mlflow.tracker(),
                                       run_tags=run_tags(context), sandbox=sandbox.settings())
    arms = {f"seed {a['seed']}": a["metrics"] for a in result.floor.arms}
    out_of_reach = champion_out_of_reach(cfg.task, cfg.home, result.floor)
    if out_of_reach:
        context.log.warning(f"task {cfg.task}: {out_of_reach}")
    return dg.Output(result, metadata={
        "noise_floor": result.floor.floor,
        "key": result.floor.key,
        "cached": result.cached,
        "benchmark_version": result.benchmark_version,
        "recipe_hash": result.recipe_hash,
        "arms": metrics_table(arms),
        **({PROMOTION_WARNING: out_of_reach} if out_of_reach else {}),
        **mlflow_link(result),
        # the null arms and the bootstrap release (release 1, the control arm), for clients (docs/http-api.md)
        **ledger_metadata(cfg.task, cfg.home, noise_key=result.floor.key, release=1),
    }, data_version=dg.DataVersion(result.floor.key))


@dg.asset(partitions_def=rounds, group_name=ROUND_GROUP, deps=[noise_floor])
def baseline_eval(context: dg.AssetExecutionContext, loop: LoopResource,
                  task_benchmark: Benchmark) -> dg.Output[BaselineEval]:
    """The champion on dev: per-question predictions and metrics."""
    from envloop_pipelines.core.decision_loop.plots import reliability_diagram

    refuse_bad_proposal(context, _run_proposal_json(context))  # before anything of the round is written
    claim_the_round(context, loop)
    task = loop.task_snapshot(task_benchmark)
    result = evaluate_champion(loop.config(), task, context.partition_key)
    preds = pq.read_table(result.predictions).to_pylist()
    dev = {(r["record_id"], r["question_id"]): r for r in task.table("dev").to_pylist()}
    hard = [(p, dev[(p["record_id"], p["question_id"])]) for p in preds
            if dev[(p["record_id"], p["question_id"])]["soft_label"] is None]
    plot = reliability_diagram([max(p["probs"]) for p, _ in hard],
                               [p["probs"].index(max(p["probs"])) == q["label"] for p, q in hard],
                               title=f"champion release {result.champion_release} on dev")
    return dg.Output(result, metadata={
        "champion_release": result.champion_release,
        "checkpoint_sha256": result.checkpoint_sha256,
        "metrics": metrics_table({"champion (dev)": result.metrics}),
        "family_macro_accuracy": result.metrics.get("family_macro_accuracy"),
        "reliability": dg.MetadataValue.md(plot),
    })


@dg.asset(partitions_def=rounds, group_name=ROUND_GROUP, op_tags=VERIFIER_POD)
def champion_noise_floor(context: dg.AssetExecutionContext, loop: LoopResource, mlflow: MlflowResource,
                         sandbox: SandboxResource, task_benchmark: Benchmark, noise_floor: MeasuredNoiseFloor,
                         baseline_eval: BaselineEval) -> dg.Output[MeasuredNoiseFloor]:
    """The floor that gates the round: the control floor over release 1, else the champion's lineage floor (its
    making repeated with fresh seeds)."""
    from envloop_pipelines.core.loop.promotion import unreachable_bar

    cfg = loop.config()
    result = measure_champion_noise_floor(cfg, loop.task_snapshot(task_benchmark), noise_floor, mlflow.tracker(),
                                          run_tags=run_tags(context), sandbox=sandbox.settings())
    if result.champion_checkpoint_sha256 not in (None, baseline_eval.checkpoint_sha256):
        raise dg.Failure(description=f"round {context.partition_key}: the champion changed during the round "
                                     f"(baseline_eval evaluated {baseline_eval.checkpoint_sha256[:12]}, the floor is "
                                     f"{result.champion_checkpoint_sha256[:12]}'s)")
    held = next((a["metrics"].get(result.floor.metric) for a in result.floor.arms if a.get("role") == "champion"), None)
    out_of_reach = unreachable_bar(result.floor, float(held)) if isinstance(held, (int, float)) else None
    if out_of_reach:
        context.log.warning(f"round {context.partition_key}: {out_of_reach}")
    return dg.Output(result, metadata={
        "source": result.source,
        "noise_floor": result.floor.floor,
        "key": result.floor.key,
        "cached": result.cached,
        "values": dg.MetadataValue.json(list(result.floor.values)),
        "champion_release": baseline_eval.champion_release,
        **({"making": dg.MetadataValue.json(dict(result.making))} if result.making else {}),
        **({PROMOTION_WARNING: out_of_reach} if out_of_reach else {}),
        **mlflow_link(result),
    }, data_version=dg.DataVersion(result.floor.key))


@dg.asset(partitions_def=rounds, group_name=ROUND_GROUP)
def failure_mining(loop: LoopResource, task_benchmark: Benchmark,
                   baseline_eval: BaselineEval) -> dg.Output[FailureMining]:
    """The champion's dev errors and confident errors, clustered and ranked by excess error."""
    result = mine_failures(loop.config(), loop.task_snapshot(task_benchmark), baseline_eval)
    lines = ["| cluster | n | errors | confident | excess | examples |", "|---|---|---|---|---|---|"]
    lines += [f"| {c['name']} | {c['n']} | {c['errors']} | {c['confident_errors']} | {c['excess_errors']:.1f} | "
              f"{', '.join(c['example_ids'][:2])} |" for c in result.clusters[:10]]
    return dg.Output(result, metadata={
        "n_errors": result.n_errors,
        "n_confident_errors": result.n_confident_errors,
        "error_rate": result.error_rate,
        "n_clusters": len(result.clusters),
        "top_clusters": dg.MetadataValue.md("\n".join(lines)),
    })


@dg.asset(partitions_def=rounds, group_name=ROUND_GROUP)
def environment_synthesis(loop: LoopResource, sandbox: SandboxResource, task_benchmark: Benchmark,
                          failure_mining: FailureMining) -> dg.Output[EnvironmentSynthesis]:
    """New training examples aimed at the top failure clusters, each with provenance to its cluster, also stored as
    an environment dataset."""
    result = synthesize_environments(loop.config(), loop.task_snapshot(task_benchmark), failure_mining,
                                           sandbox=sandbox.settings())
    return dg.Output(result, metadata={
        "generator": result.generator,
        "n_rows": result.n_rows,
        "per_cluster": dg.MetadataValue.json(dict(result.per_cluster)),
        "sha256": result.sha256,
        **({"environment_dataset": result.environment_dataset} if result.environment_dataset else {}),
    })


class HypothesisConfig(dg.Config):
    """A person's hypothesis for the round (JSON); empty means derive it from the mined failures.

    Keys: ``change`` (object; a recipe change is ``{"kind": "recipe", "recipe_diff": {...}}``),
    ``predicted_delta`` (number), ``gate`` (Gate fields such as ``min_delta``, ``primary_metric``),
    ``seeds`` (list), ``rationale`` (text).
    """

    proposal_json: str = ""


@dg.asset(partitions_def=rounds, group_name=ROUND_GROUP)
def registered_hypothesis(context: dg.AssetExecutionContext, config: HypothesisConfig, loop: LoopResource,
                          mlflow: MlflowResource, sandbox: SandboxResource, task_benchmark: Benchmark,
                          environment_synthesis: EnvironmentSynthesis,
                          champion_noise_floor: MeasuredNoiseFloor) -> dg.Output[RegisteredHypothesis]:
    """The round's hypothesis (change, predicted delta, gate, seeds), in MLflow and the ledger before training; immutable."""
    from envloop_pipelines.core.ledger.hypothesis import GateTooLooseError, HypothesisRefusedError

    proposal = refuse_bad_proposal(context, config.proposal_json)
    task = loop.task_snapshot(task_benchmark)
    try:
        result = register_hypothesis(loop.config(), task, environment_synthesis, mlflow.tracker(),
                                     proposal=proposal, run_tags=run_tags(context), sandbox=sandbox.settings(),
                                     noise_floor=champion_noise_floor)
    except (GateTooLooseError, HypothesisRefusedError) as exc:  # refused at registration: the same next time
        refuse(context, str(exc))
    h = result.hypothesis
    return dg.Output(result, metadata={
        "hash": result.hash,
        "author": h.author,
        "predicted_delta": h.predicted_delta,
        **({"mde": h.power["mde"], "underpowered": h.underpowered}
           if h.power is not None and h.power.get("mde") is not None else {}),
        "gate": dg.MetadataValue.json(h.gate.__dict__),
        "change": dg.MetadataValue.json(dict(h.change)),
        **mlflow_link(result),
    }, data_version=dg.DataVersion(result.hash))


@dg.asset(partitions_def=rounds, group_name=ROUND_GROUP)
def training_dataset_snapshot(loop: LoopResource, task_benchmark: Benchmark,
                              environment_synthesis: EnvironmentSynthesis) -> dg.Output[TrainingSnapshot]:
    """Base train plus synthesized rows as content-addressed Parquet, with its contamination report."""
    result = build_training_snapshot(loop.config(), loop.task_snapshot(task_benchmark), environment_synthesis)
    return dg.Output(result, metadata={
        "sha256": result.sha256,
        "path": dg.MetadataValue.path(result.path),
        "n_rows": result.n_rows,
        "n_synthesized": result.n_synthesized,
        "n_removed_as_contaminated": result.n_removed,
    }, data_version=dg.DataVersion(result.sha256))


# One GPU and memory for training when the run uses the k8s_job_executor (ignored locally). A GPU is an
# extended resource: its limit is also its request. The toleration lets the step pod onto GPU nodes tainted
# nvidia.com/gpu (the usual taint of a GPU node pool); it changes nothing where there is no such taint.
TRAINING_POD = {"dagster-k8s/config": {
    "container_config": {"resources": {
        "requests": {"cpu": "4", "memory": "16Gi"}, "limits": {"nvidia.com/gpu": "1", "memory": "32Gi"}}},
    "pod_spec_config": {"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]},
}}


@dg.asset(partitions_def=rounds, group_name=ROUND_GROUP, op_tags=TRAINING_POD)
def lora_checkpoint(context: dg.AssetExecutionContext, loop: LoopResource, mlflow: MlflowResource,
                    task_benchmark: Benchmark, training_dataset_snapshot: TrainingSnapshot,
                    registered_hypothesis: RegisteredHypothesis) -> dg.Output[TrainedCheckpoint]:
    """LoRA SFT from the champion on the round's snapshot, calibrated on val; refuses without a registered hypothesis."""
    result = train_candidate(loop.config(), loop.task_snapshot(task_benchmark), registered_hypothesis,
                                       training_dataset_snapshot, mlflow.tracker(), run_tags=run_tags(context))
    return dg.Output(result, metadata={
        "checkpoint_sha256": result.checkpoint_sha256,
        "checkpoint": dg.MetadataValue.path(result.checkpoint),
        "init_from": result.init_from,
        "train_s": result.train_s,
        "val_metrics": metrics_table({"candidate (val)": result.metrics.get("val", result.metrics)}),
        **mlflow_link(result),
    }, data_version=dg.DataVersion(result.checkpoint_sha256))


@dg.asset(partitions_def=rounds, group_name=ROUND_GROUP, op_tags=VERIFIER_POD)
def independent_reeval(context: dg.AssetExecutionContext, loop: LoopResource, mlflow: MlflowResource,
                       sandbox: SandboxResource, task_benchmark: Benchmark, lora_checkpoint: TrainedCheckpoint,
                       training_dataset_snapshot: TrainingSnapshot) -> dg.Output[Reevaluation]:
    """Candidate and champion scored on the hidden test set by the sandboxed verifier, beside a TF-IDF baseline."""
    result = reevaluate(loop.config(), loop.task_snapshot(task_benchmark), lora_checkpoint,
                                  training_dataset_snapshot, mlflow.tracker(), run_tags=run_tags(context),
                                  sandbox=sandbox.settings())
    lines = ["| metric | delta | 95% CI |", "|---|---|---|"]
    lines += [f"| {k} | {v['delta']:+.4f} | [{v['ci_low']:+.4f}, {v['ci_high']:+.4f}] |" for k, v in result.deltas.items()
              if v["delta"] is not None and v["ci_low"] is not None]
    return dg.Output(result, metadata={
        "test_metrics": metrics_table({"candidate": result.candidate, "champion": result.champion,
                                       "TF-IDF + LR": result.tfidf_baseline}),
        "paired_deltas": dg.MetadataValue.md("\n".join(lines)),
        "verifier_pid": result.verifier_pid,
        "verifier_isolation": dg.MetadataValue.json(dict(result.verifier)),
        **mlflow_link(result),
    })


@dg.asset(partitions_def=rounds, group_name=ROUND_GROUP, op_tags=VERIFIER_POD)
def promotion_decision(context: dg.AssetExecutionContext, loop: LoopResource, mlflow: MlflowResource,
                       sandbox: SandboxResource, task_benchmark: Benchmark, champion_noise_floor: MeasuredNoiseFloor,
                       registered_hypothesis: RegisteredHypothesis,
                       training_dataset_snapshot: TrainingSnapshot, lora_checkpoint: TrainedCheckpoint,
                       independent_reeval: Reevaluation) -> dg.Output[RoundDecision]:
    """The registered gate applied over the floor that gates the round (``champion_noise_floor``): a release card
    and the champion alias on promotion, a refuted hypothesis otherwise."""
    from envloop_pipelines.core.ledger.ledger import Ledger
    from envloop_pipelines.core.decision_loop.plots import metric_by_round

    cfg = loop.config()
    result = decide_round(cfg, loop.task_snapshot(task_benchmark), registered_hypothesis,
                                 training_dataset_snapshot, lora_checkpoint, independent_reeval, champion_noise_floor,
                                 mlflow.tracker(), run_tags=run_tags(context), sandbox=sandbox.settings())
    close_round_runs(mlflow.tracker(), cfg.task, context.partition_key, RUN_FINISHED, parent_only=True)
    releases = Ledger(cfg.task, cfg.home).releases()
    plot = metric_by_round([str(r["release"]) for r in releases],
                           {"holdout family-macro accuracy": [r["holdout"].get("family_macro_accuracy") for r in releases]},
                           "release chain")
    return dg.Output(result, metadata={
        "promoted": result.promote,
        "release": result.release,
        "reasons": dg.MetadataValue.md("\n".join(f"- {r}" for r in result.reasons)),
        **decision_numbers(result),
        "release_chain": dg.MetadataValue.md(plot),
        # the typed decision, the round's ledger events and its release card, for clients (docs/http-api.md)
        DECISION: dg.MetadataValue.json(result.to_dict()),
        **ledger_metadata(cfg.task, cfg.home, round_key=context.partition_key, release=result.release),
    })


ROUND_ASSETS = [baseline_eval, champion_noise_floor, failure_mining, environment_synthesis, registered_hypothesis,
                training_dataset_snapshot, lora_checkpoint, independent_reeval, promotion_decision]

# GPU_POOL_TAG, the run tag of the round (it trains): the cluster's run queue allows one running round per value
# (k8s/dagster/values.yaml, tagConcurrencyLimits); the local instance sets no tag limit.


@dg.failure_hook(required_resource_keys={"loop", "mlflow"})
def close_failed_round(context: dg.HookContext) -> None:
    """A step of a round failed: the round's MLflow runs still RUNNING (its parent, the step's) end FAILED."""
    run = context.instance.get_run_by_id(context.run_id)
    key = run.tags.get(names.PARTITION_TAG) if run is not None else None
    if key and run.tags.get(REFUSED_TAG) != BUSY:  # a run refused as busy: the round's MLflow runs are another's
        cfg = context.resources.loop.config()
        close_round_runs(context.resources.mlflow.tracker(), cfg.task, key, RUN_FAILED)


round_job = dg.define_asset_job(names.ROUND_JOB, selection=dg.AssetSelection.assets(*ROUND_ASSETS),
                                description="One round of the loop, for one partition of `rounds`.",
                                tags={GPU_POOL_TAG: "training"}, hooks={close_failed_round})
setup_job = dg.define_asset_job(names.SETUP_JOB, selection=dg.AssetSelection.assets(task_benchmark, noise_floor),
                                description="The benchmark and the noise floor (and the first champion).")

def with_upstream_sources(selected: list) -> list:
    """``selected`` assets and checks plus every other asset of the loop as a source, for ``dg.materialize``.

    A round's assets read their upstream values (the noise floor, or earlier steps of the same
    round) through the IO manager; ``dg.materialize`` needs those upstream assets named.
    """
    chosen = {id(a) for a in selected}
    return [*selected, *(a.to_source_asset() for a in (task_benchmark, noise_floor, *ROUND_ASSETS) if id(a) not in chosen)]


__all__ = ["with_upstream_sources", "ROUND_ASSETS", "TRAINING_POD", "VERIFIER_POD", "round_job", "setup_job",
           "task_benchmark", "noise_floor"]
