"""The asset ``independent_reeval``: the candidate beside the champion on the hidden test set, by the sandboxed verifier.

The round's reads of test are its whole budget (reader ``round:<key>``); TF-IDF + LR answers the same questions
beside them.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Mapping
from pathlib import Path

from envloop_pipelines.core.data.snapshots import TaskSnapshot
from envloop_pipelines.core.decision_loop.step_records import Reevaluation, TrainedCheckpoint, TrainingSnapshot
from envloop_pipelines.core.decision_loop.training_dataset_snapshot import snapshot_rows
from envloop_pipelines.core.ledger.anchor import anchor_head
from envloop_pipelines.core.ledger.ledger import Ledger
from envloop_pipelines.core.ledger.store import RoundStore
from envloop_pipelines.core.loop.config import LoopConfig, round_number
from envloop_pipelines.core.release.publish import champion, tfidf_baseline
from envloop_pipelines.core.release.tracked_runs import child_run, flat_metrics, verify_predictions, write_predictions
from envloop_pipelines.core.sandbox import SandboxSettings
from envloop_pipelines.core.storage import atomic_write_parquet, envloop_home
from envloop_pipelines.core.tracking import KIND_REEVAL, Tracker


def reevaluate(config: LoopConfig, task: TaskSnapshot, candidate: TrainedCheckpoint, snapshot: TrainingSnapshot,
               tracker: Tracker, *, run_tags: Mapping[str, str] | None = None,
               sandbox: SandboxSettings | None = None) -> Reevaluation:
    """Candidate vs champion on the hidden test set through the sandboxed verifier, with the TF-IDF baseline.

    The round's reads of test (reader ``round:<key>``): the candidate's predictions paired with the
    champion's, and the TF-IDF baseline's, three files, its whole budget
    (:data:`~envloop_pipelines.core.ledger.reads.ROUND_TEST_READ_BUDGET`, one more per gate amendment, whose
    fresh-seed candidate is a new file); a retry reads the same files again and is not counted twice.
    ``task`` is the task's snapshot the step opened: its test inputs are answered, its train rows fit TF-IDF.
    ``sandbox``: the deployment's sandbox, where the verifier runs (default: the local backend).
    """
    key = candidate.round
    d = RoundStore(config.task, config.home).round_dir(key)
    champ = champion(config)
    test = task.table("test")
    # Reused by (checkpoint, inputs): the champion answered this test split when it was a candidate.
    cand_preds = write_predictions(d / "candidate_test_predictions.parquet", candidate.checkpoint, test,
                                   home=envloop_home(config.home))
    champ_preds = write_predictions(d / "champion_test_predictions.parquet", champ["checkpoint_dir"], test,
                                    home=envloop_home(config.home))
    reader = f"round:{key}"
    run = verify_predictions(config, "test", cand_preds, baseline=champ_preds, seed=round_number(key),
                             checkpoint=candidate.checkpoint, baseline_checkpoint=champ["checkpoint_dir"],
                             reader=reader, sandbox=sandbox)
    tfidf = tfidf_baseline(config, task, snapshot_rows(snapshot))
    tfidf_preds = atomic_write_parquet(d / "tfidf_test_predictions.parquet", tfidf.predict_table(test), overwrite=True)
    tfidf_run = verify_predictions(config, "test", tfidf_preds, safety_thresholds=tfidf.calibration.safety_thresholds,
                                   reader=reader, sandbox=sandbox)
    anchor_head(Ledger(config.task, config.home), tracker)  # the round's test reads, anchored in MLflow
    mrun = child_run(tracker, config, key, KIND_REEVAL, run_tags)
    result = Reevaluation(
        round=key, benchmark_version=task.benchmark_version, candidate=dict(run.report.metrics),
        champion=dict(run.baseline_report.metrics), tfidf_baseline=dict(tfidf_run.report.metrics),
        paired=run.paired, complete=run.report.complete and run.baseline_report.complete,
        verifier_pid=run.worker_pid,
        verifier={"network_isolated": run.sandbox.network_isolated,
                  "hidden_paths_masked": run.sandbox.hidden_paths_masked, "backend": run.sandbox.backend},
        candidate_checkpoint_sha256=candidate.checkpoint_sha256, champion_checkpoint_sha256=champ["checkpoint_sha256"],
        mlflow_run_id=mrun.run_id, mlflow_url=mrun.url)
    tracker.log_metrics(mrun.run_id, {**flat_metrics(result.candidate, "candidate."),
                                      **flat_metrics(result.champion, "champion."),
                                      **flat_metrics(result.tfidf_baseline, "tfidf."),
                                      **{f"delta.{k}": v["delta"] for k, v in result.deltas.items()
                                         if v["delta"] is not None}})
    # The step's record is the IO manager's to store (defs); MLflow gets its own copy.
    with tempfile.TemporaryDirectory() as tmp:
        record = Path(tmp) / f"{KIND_REEVAL}.json"
        record.write_text(json.dumps(result.to_dict(), indent=2, sort_keys=True), encoding="utf-8")
        tracker.log_artifact(mrun.run_id, record)
    tracker.log_artifact(mrun.run_id, cand_preds, "predictions")
    tracker.end_run(mrun.run_id)
    return result


__all__ = ["reevaluate"]
