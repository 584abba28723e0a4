"""Asset checks: the loop's guards. The snapshot checks block training in the same run.

Each check receives its asset's typed record for the run's round as an input, loaded by the round
store's IO manager like any downstream step's (``checkpoint_reproduces`` also receives the loop's
``task_benchmark``). The checks are partitioned by round (``partitions_def=rounds``), so the UI and
the instance keep each round's check result apart. That is also what gives a check its round's record: an
unpartitioned check's input is the whole of ``rounds`` (Dagster 1.13.27: "the number of input partitions
!= 1: 'AllPartitionsSubset(...)'" when the IO manager asks for the partition key). ``partitions_def`` on a
check is a Dagster preview: importing this module raises a ``PreviewWarning``, which the entry points'
filters drop (``envloop_pipelines/console.py``).
"""


from pathlib import Path

import dagster as dg

from envloop_pipelines.core.decision_loop.step_records import (
    Benchmark,
    Reevaluation,
    TrainedCheckpoint,
    TrainingSnapshot,
)
from envloop_pipelines.defs.rounds.assets import (
    independent_reeval,
    lora_checkpoint,
    task_benchmark,
    training_dataset_snapshot,
)
from envloop_pipelines.defs.rounds.partitions import rounds
from envloop_pipelines.resources.loop import LoopResource


@dg.asset_check(asset=training_dataset_snapshot, blocking=True, partitions_def=rounds)
def snapshot_schema_is_valid(training_dataset_snapshot: TrainingSnapshot) -> dg.AssetCheckResult:
    """The snapshot has the training schema (questions, labels, provenance per row)."""
    snap = training_dataset_snapshot
    return dg.AssetCheckResult(passed=bool(snap.schema_ok), severity=dg.AssetCheckSeverity.ERROR,
                               metadata={"n_rows": snap.n_rows, "sha256": snap.sha256})


@dg.asset_check(asset=training_dataset_snapshot, blocking=True, partitions_def=rounds)
def snapshot_is_uncontaminated(training_dataset_snapshot: TrainingSnapshot) -> dg.AssetCheckResult:
    """No snapshot row repeats or nearly repeats a test or holdout state (exact, near-duplicate, 13-gram overlap
    both ways: the row's 13-grams in test/holdout, a hidden record's 13-grams contained in the row)."""
    snap = training_dataset_snapshot
    report = snap.contamination
    return dg.AssetCheckResult(
        passed=bool(report["clean"]), severity=dg.AssetCheckSeverity.ERROR,
        metadata={"n_flagged": report["n_flagged"], "exact": len(report["exact"]),
                  "near_duplicate": len(report["near_duplicate"]), "ngram_overlap": len(report["ngram_overlap"]),
                  "containment": len(report.get("containment", [])),
                  "removed_before_check": snap.n_removed,
                  "report": dg.MetadataValue.path(str(Path(snap.path).with_suffix(".contamination.json")))},
    )


@dg.asset_check(asset=lora_checkpoint, additional_ins={"task_benchmark": dg.AssetIn(task_benchmark.key)},
                partitions_def=rounds)
def checkpoint_reproduces(lora_checkpoint: TrainedCheckpoint, task_benchmark: Benchmark,
                          loop: LoopResource) -> dg.AssetCheckResult:
    """Re-scoring the checkpoint from disk gives exactly its end-of-training predictions."""
    from envloop_pipelines.core.model.predict import rescore_matches

    outcome = rescore_matches(lora_checkpoint.checkpoint, loop.task_snapshot(task_benchmark).table("val"))
    return dg.AssetCheckResult(passed=outcome["identical"], severity=dg.AssetCheckSeverity.ERROR,
                               metadata={"n_questions": outcome["n_questions"], "max_abs_diff": outcome["max_abs_diff"]})


@dg.asset_check(asset=independent_reeval, partitions_def=rounds)
def candidate_is_calibrated(independent_reeval: Reevaluation, loop: LoopResource) -> dg.AssetCheckResult:
    """The candidate's test ECE is within the registered gate's calibration guard."""
    from envloop_pipelines.core.ledger.ledger import Ledger

    cfg = loop.config()
    gate = Ledger(cfg.task, cfg.home).effective_gate(independent_reeval.round)
    ece = independent_reeval.candidate.get("ece")
    return dg.AssetCheckResult(passed=ece is not None and ece <= gate.max_ece, severity=dg.AssetCheckSeverity.WARN,
                               metadata={"ece": ece, "max_ece": gate.max_ece})


ROUND_CHECKS = [snapshot_schema_is_valid, snapshot_is_uncontaminated, checkpoint_reproduces, candidate_is_calibrated]
