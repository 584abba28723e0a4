"""Asset checks: the loop's guards. The snapshot checks block training in the same run."""


import json
from pathlib import Path

import dagster as dg

from envloop_pipelines.core.loop import round as core
from envloop_pipelines.defs.rounds.assets import independent_reeval, lora_checkpoint, training_dataset_snapshot
from envloop_pipelines.resources.loop import LoopResource


def _round_json(loop: LoopResource, partition: str, name: str) -> dict:
    cfg = loop.config()
    return json.loads((core.RoundPaths(cfg).round_dir(partition) / f"{name}.json").read_text())


@dg.asset_check(asset=training_dataset_snapshot, blocking=True)
def snapshot_schema_is_valid(context: dg.AssetCheckExecutionContext, loop: LoopResource) -> dg.AssetCheckResult:
    """The snapshot has the training schema (questions, labels, provenance per row)."""
    result = _round_json(loop, context.partition_key, "training_dataset_snapshot")
    return dg.AssetCheckResult(passed=bool(result["schema_ok"]), severity=dg.AssetCheckSeverity.ERROR,
                               metadata={"n_rows": result["n_rows"], "sha256": result["sha256"]})


@dg.asset_check(asset=training_dataset_snapshot, blocking=True)
def snapshot_is_uncontaminated(context: dg.AssetCheckExecutionContext, loop: LoopResource) -> dg.AssetCheckResult:
    """No snapshot row repeats or nearly repeats a test or holdout state (exact, near-duplicate, 13-gram overlap)."""
    result = _round_json(loop, context.partition_key, "training_dataset_snapshot")
    report = result["contamination"]
    return dg.AssetCheckResult(
        passed=bool(report["clean"]), severity=dg.AssetCheckSeverity.ERROR,
        metadata={"n_flagged": report["n_flagged"], "exact": len(report["exact"]),
                  "near_duplicate": len(report["near_duplicate"]), "ngram_overlap": len(report["ngram_overlap"]),
                  "removed_before_check": result["n_removed"],
                  "report": dg.MetadataValue.path(str(Path(result["path"]).with_suffix(".contamination.json")))},
    )


@dg.asset_check(asset=lora_checkpoint)
def checkpoint_reproduces(context: dg.AssetCheckExecutionContext, loop: LoopResource) -> dg.AssetCheckResult:
    """Re-scoring the checkpoint from disk gives exactly its end-of-training predictions."""
    result = _round_json(loop, context.partition_key, "lora_checkpoint")
    val = core.open_task(loop.task, home=loop.home).table("val")
    outcome = core.rescore_matches(result["checkpoint"], val)
    return dg.AssetCheckResult(passed=outcome["identical"], severity=dg.AssetCheckSeverity.ERROR,
                               metadata={"n_questions": outcome["n_questions"], "max_abs_diff": outcome["max_abs_diff"]})


@dg.asset_check(asset=independent_reeval)
def candidate_is_calibrated(context: dg.AssetCheckExecutionContext, loop: LoopResource) -> dg.AssetCheckResult:
    """The candidate's test ECE is within the registered gate's calibration guard."""
    from envloop_pipelines.core.loop.ledger import Ledger

    cfg = loop.config()
    result = _round_json(loop, context.partition_key, "independent_reeval")
    gate = Ledger(cfg.task, cfg.home).effective_gate(context.partition_key)
    ece = result["candidate"].get("ece")
    return dg.AssetCheckResult(passed=ece is not None and ece <= gate.max_ece, severity=dg.AssetCheckSeverity.WARN,
                               metadata={"ece": ece, "max_ece": gate.max_ece})


ROUND_CHECKS = [snapshot_schema_is_valid, snapshot_is_uncontaminated, checkpoint_reproduces, candidate_is_calibrated]
