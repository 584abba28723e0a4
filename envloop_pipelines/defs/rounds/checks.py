"""Asset checks: the loop's guards. The snapshot checks block training in the same run.

Each check reads its asset's typed value for the run's partition from the round store, where
the IO manager wrote it (checks of a partitioned asset get no per-partition input of their own).
"""


from pathlib import Path
from typing import Any

import dagster as dg

from envloop_pipelines.core.decision_loop.step_records import (
    STEP_RECORDS,
    Benchmark,
    Reevaluation,
    TrainedCheckpoint,
    TrainingSnapshot,
)
from envloop_pipelines.core.ledger.store import RoundStore
from envloop_pipelines.defs.rounds.assets import independent_reeval, lora_checkpoint, training_dataset_snapshot
from envloop_pipelines.resources.loop import LoopResource


def _value(context: dg.AssetCheckExecutionContext, loop: LoopResource, step: str, *, per_round: bool = True) -> Any:
    """``step``'s stored value: the run's round's, or the loop's (``per_round=False``: ``task_benchmark``)."""
    cfg = loop.config()
    key = context.partition_key if per_round else None
    value = RoundStore(cfg.task, cfg.home).load(step, STEP_RECORDS[step], key)
    if value is None:
        raise dg.DagsterInvariantViolationError(f"{step} has no value" + (f" for round {key}" if key else ""))
    return value


@dg.asset_check(asset=training_dataset_snapshot, blocking=True)
def snapshot_schema_is_valid(context: dg.AssetCheckExecutionContext, loop: LoopResource) -> dg.AssetCheckResult:
    """The snapshot has the training schema (questions, labels, provenance per row)."""
    snap: TrainingSnapshot = _value(context, loop, "training_dataset_snapshot")
    return dg.AssetCheckResult(passed=bool(snap.schema_ok), severity=dg.AssetCheckSeverity.ERROR,
                               metadata={"n_rows": snap.n_rows, "sha256": snap.sha256})


@dg.asset_check(asset=training_dataset_snapshot, blocking=True)
def snapshot_is_uncontaminated(context: dg.AssetCheckExecutionContext, loop: LoopResource) -> dg.AssetCheckResult:
    """No snapshot row repeats or nearly repeats a test or holdout state (exact, near-duplicate, 13-gram overlap
    both ways: the row's 13-grams in test/holdout, a hidden record's 13-grams contained in the row)."""
    snap: TrainingSnapshot = _value(context, loop, "training_dataset_snapshot")
    report = snap.contamination
    return dg.AssetCheckResult(
        passed=bool(report["clean"]), severity=dg.AssetCheckSeverity.ERROR,
        metadata={"n_flagged": report["n_flagged"], "exact": len(report["exact"]),
                  "near_duplicate": len(report["near_duplicate"]), "ngram_overlap": len(report["ngram_overlap"]),
                  "containment": len(report.get("containment", [])),
                  "removed_before_check": snap.n_removed,
                  "report": dg.MetadataValue.path(str(Path(snap.path).with_suffix(".contamination.json")))},
    )


@dg.asset_check(asset=lora_checkpoint)
def checkpoint_reproduces(context: dg.AssetCheckExecutionContext, loop: LoopResource) -> dg.AssetCheckResult:
    """Re-scoring the checkpoint from disk gives exactly its end-of-training predictions."""
    from envloop_pipelines.core.model.predict import rescore_matches

    lora_checkpoint: TrainedCheckpoint = _value(context, loop, "lora_checkpoint")
    benchmark: Benchmark = _value(context, loop, "task_benchmark", per_round=False)
    outcome = rescore_matches(lora_checkpoint.checkpoint, loop.task_snapshot(benchmark).table("val"))
    return dg.AssetCheckResult(passed=outcome["identical"], severity=dg.AssetCheckSeverity.ERROR,
                               metadata={"n_questions": outcome["n_questions"], "max_abs_diff": outcome["max_abs_diff"]})


@dg.asset_check(asset=independent_reeval)
def candidate_is_calibrated(context: dg.AssetCheckExecutionContext, loop: LoopResource) -> dg.AssetCheckResult:
    """The candidate's test ECE is within the registered gate's calibration guard."""
    from envloop_pipelines.core.ledger.ledger import Ledger

    cfg = loop.config()
    independent_reeval: Reevaluation = _value(context, loop, "independent_reeval")
    gate = Ledger(cfg.task, cfg.home).effective_gate(independent_reeval.round)
    ece = independent_reeval.candidate.get("ece")
    return dg.AssetCheckResult(passed=ece is not None and ece <= gate.max_ece, severity=dg.AssetCheckSeverity.WARN,
                               metadata={"ece": ece, "max_ece": gate.max_ece})


ROUND_CHECKS = [snapshot_schema_is_valid, snapshot_is_uncontaminated, checkpoint_reproduces, candidate_is_calibrated]
