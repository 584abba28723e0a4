"""The candidate of a round: trained from the champion (``lora_checkpoint``), then re-evaluated
beside it on the hidden test set by the sandboxed verifier (``independent_reeval``).
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from envloop_pipelines.core.data.snapshots import TaskSnapshot, require_same_benchmark
from envloop_pipelines.core.loop.config import LoopConfig, round_number
from envloop_pipelines.core.ledger.anchor import anchor_head, verify_ledger
from envloop_pipelines.core.ledger.event_log import EVENT_CHECKPOINT_TRAINED, LedgerError
from envloop_pipelines.core.ledger.ledger import Ledger
from envloop_pipelines.core.release.publish import champion, tfidf_baseline
from envloop_pipelines.core.decision_loop.step_records import Reevaluation, RegisteredHypothesis, TrainedCheckpoint, TrainingSnapshot
from envloop_pipelines.core.storage import envloop_home
from envloop_pipelines.core.release.tracked_runs import child_run, flat_metrics, verify_predictions, write_predictions
from envloop_pipelines.core.sandbox import SandboxSettings
from envloop_pipelines.core.ledger.store import RoundStore
from envloop_pipelines.core.storage import atomic_write_parquet, publish_dir, staging_dir
from envloop_pipelines.core.tracking import (
    KIND_HYPOTHESIS,
    KIND_REEVAL,
    KIND_TRAINING,
    TAG_HYPOTHESIS,
    TAG_KIND,
    TAG_ROUND,
    Tracker,
)

#: Hypothesis change keys: the round's own recipe change, and the name hypotheses registered before used for it.
RECIPE_DIFF = "recipe_diff"
LEGACY_RECIPE_DIFF = "recipe_overrides"


def train_into_store(store: RoundStore, train: pa.Table, val: pa.Table, recipe: Any, *, data_hash: str,
                     init_from: Path | None = None, safety_families: tuple[str, ...] = (),
                     safety_fnr_target: float | None = None) -> Path:
    """Train a checkpoint in a staging directory and publish it under its content hash.

    A crash mid-training leaves only a staging directory (never read); a retry
    trains again and, being deterministic, publishes the same hash. ``safety_families`` get their
    automation thresholds fitted on ``val`` for ``safety_fnr_target`` (the loop's settings).
    """
    from envloop_pipelines.core.model.checkpoint import checkpoint_hash
    from envloop_pipelines.core.model.training import train_checkpoint

    staged = staging_dir(store.checkpoints)
    safety: dict[str, Any] = {"safety_families": tuple(safety_families)}
    if safety_fnr_target is not None:
        safety["safety_fnr_target"] = safety_fnr_target
    ckpt = train_checkpoint(train, val, recipe, staged / "checkpoint", data_hash=data_hash, init_from=init_from,
                            **safety)
    final = store.checkpoints / checkpoint_hash(ckpt)
    if not final.exists():
        publish_dir(ckpt, final)
    shutil.rmtree(staged, ignore_errors=True)
    return final


def snapshot_rows(snapshot: TrainingSnapshot, *, base_only: bool = False) -> pa.Table:
    """The training rows of a round's snapshot (without their provenance column); ``base_only``: the task's
    train rows alone, without the synthesized ones (a hypothesis whose change says ``"data": "train"``)."""
    table = pq.read_table(snapshot.path)
    if base_only:
        kinds = [json.loads(p).get("kind") == "base" for p in table.column("provenance").to_pylist()]
        table = table.filter(pa.array(kinds, pa.bool_()))
    return table.drop_columns(["provenance"])


def candidate_rows(snapshot: TrainingSnapshot, change: Mapping[str, Any]) -> tuple[pa.Table, str]:
    """The rows a round's candidate trains on and their hash: the whole snapshot, or for a change that says
    ``"data": "train"`` (the proposer's recipe levers: the round measures the recipe change, not it and new data
    together) the snapshot's base rows, hashed on their own. The snapshot is checked for contamination whole,
    so its base rows are checked rows."""
    if change.get("data") != "train":
        return snapshot_rows(snapshot), snapshot.sha256
    from envloop_pipelines.core.storage import parquet_bytes, sha256_bytes

    rows = snapshot_rows(snapshot, base_only=True)
    return rows, sha256_bytes(parquet_bytes(rows))


def recipe_diff(change: Mapping[str, Any]) -> dict[str, Any]:
    """The recipe change a hypothesis tests (read under its old name for hypotheses registered before)."""
    if change.get("kind") == "recipe" and RECIPE_DIFF not in change:
        return dict(change.get(LEGACY_RECIPE_DIFF) or {})
    return dict(change.get(RECIPE_DIFF) or {})


def loop_recipe_error(config: LoopConfig, registered: Any) -> str | None:
    """Why this run's loop recipe is not the one the round's hypothesis registered, or ``None`` (issue 34).

    A round runs under one recipe from registration to card: ``config.recipe_hash()`` (the recipe file with
    the loop's ``recipe_overrides``) must be ``hypothesis.recipe_hash``; both are named.
    """
    loop_hash = config.recipe_hash()
    if loop_hash == registered.recipe_hash:
        return None
    return (f"recipe_hash: this run's loop recipe (recipe, recipe_overrides) hashes to {loop_hash[:16]}, not the recipe "
            f"the hypothesis registered (hypothesis.recipe_hash {str(registered.recipe_hash)[:16]}); a round runs under "
            f"one recipe from registration to card: run it with the registration's recipe_overrides")


def train_candidate(config: LoopConfig, task: TaskSnapshot, hypothesis: RegisteredHypothesis,
                    snapshot: TrainingSnapshot, tracker: Tracker, *,
                    run_tags: Mapping[str, str] | None = None) -> TrainedCheckpoint:
    """LoRA SFT from the champion on the round's snapshot, with the hypothesis's recipe change and seed.

    ``task`` is the task's snapshot the step opened (calibration reads its val split); it must be the
    benchmark version the hypothesis was registered on.

    Raises:
        LedgerError: the round has no registered hypothesis in the ledger and MLflow (rule 1), the
            hypothesis handed in is not the registered one, or the snapshot is refused.
    """
    from envloop_pipelines.core.model.recipe import recipe_to_dict

    key = snapshot.round
    verify_ledger(Ledger(config.task, config.home), tracker)  # a broken chain or a removed tail: no training
    registered = Ledger(config.task, config.home).require_hypothesis(key)  # rule 1: no hypothesis, no training
    if registered.hash != hypothesis.hash or hypothesis.round != key:
        raise LedgerError(f"round {key}: hypothesis {hypothesis.hash[:12]} is not the one registered "
                          f"({registered.hash[:12]}); training refuses to start")
    if tracker.find_run(config.task, {TAG_ROUND: key, TAG_KIND: KIND_HYPOTHESIS}) is None:
        raise LedgerError(f"round {key}: the hypothesis is not in MLflow; training refuses to start")
    split = loop_recipe_error(config, registered)  # a split run: refused before any compute (issue 34)
    if split:
        raise LedgerError(f"round {key}: training refuses to start: {split}")
    problems = snapshot.problems()
    if problems:
        raise LedgerError(f"round {key}: training snapshot {snapshot.sha256[:12]} refused: {'; '.join(problems)}")
    require_same_benchmark(registered.benchmark_version, task.benchmark_version)
    champ = champion(config)
    # The hypothesis's seed, or after a gate amendment the fresh seed it requires (rule 3).
    seed = Ledger(config.task, config.home).candidate_seeds(key)[0]
    recipe = config.load_recipe().replace(**recipe_diff(registered.change), seed=seed)
    # A lever that changes what a checkpoint is made of (frozen layers, the family head) starts from the base model.
    init_from = None if registered.change.get("init") == "base" else Path(champ["checkpoint_dir"])
    run = child_run(tracker, config, key, KIND_TRAINING, {**(run_tags or {}), TAG_HYPOTHESIS: registered.hash})
    tracker.log_params(run.run_id, {**{f"recipe.{k}": v for k, v in recipe_to_dict(recipe).items()},
                                    "snapshot_sha256": snapshot.sha256,
                                    "init_from": champ["checkpoint_sha256"] if init_from else "base",
                                    "hypothesis_hash": registered.hash})
    started = time.perf_counter()
    rows, data_hash = candidate_rows(snapshot, registered.change)
    ckpt = train_into_store(RoundStore(config.task, config.home), rows, task.table("val"), recipe,
                            data_hash=data_hash, init_from=init_from,
                            safety_families=config.guarded_families(task), safety_fnr_target=config.safety_fnr_target)
    train_s = time.perf_counter() - started
    train_metrics = json.loads((ckpt / "metrics.json").read_text(encoding="utf-8"))
    tracker.log_metrics(run.run_id, flat_metrics(train_metrics))
    tracker.log_artifact(run.run_id, ckpt, "checkpoint")
    tracker.end_run(run.run_id)
    Ledger(config.task, config.home).append(
        EVENT_CHECKPOINT_TRAINED, {"round": key, "checkpoint_sha256": ckpt.name, "seed": recipe.seed,
                                   "hypothesis_hash": registered.hash}, key=f"arm:{key}:{ckpt.name}")
    return TrainedCheckpoint(round=key, checkpoint=str(ckpt), checkpoint_sha256=ckpt.name,
                             init_from=champ["checkpoint_sha256"] if init_from else "base",
                             snapshot_sha256=snapshot.sha256, seed=recipe.seed,
                             train_s=round(train_s, 2), metrics=train_metrics, mlflow_run_id=run.run_id,
                             mlflow_url=run.url, hypothesis_hash=registered.hash)


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


__all__ = ["RECIPE_DIFF", "candidate_rows", "loop_recipe_error", "recipe_diff", "reevaluate", "snapshot_rows",
           "train_candidate", "train_into_store"]
