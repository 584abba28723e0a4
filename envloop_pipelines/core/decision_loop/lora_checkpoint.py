"""The asset ``lora_checkpoint``: the round's candidate, LoRA SFT from the champion on the round's snapshot.

:func:`train_into_store` is the one way a checkpoint is trained into the task's store (the candidate, the noise
floor's arms, the benches' pools): in a staging directory, published under its content hash.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa

from envloop_pipelines.core.data.snapshots import TaskSnapshot, require_same_benchmark
from envloop_pipelines.core.decision_loop.step_records import RegisteredHypothesis, TrainedCheckpoint, TrainingSnapshot
from envloop_pipelines.core.decision_loop.training_dataset_snapshot import snapshot_rows
from envloop_pipelines.core.ledger.anchor import verify_ledger
from envloop_pipelines.core.ledger.event_log import EVENT_CHECKPOINT_TRAINED, LedgerError
from envloop_pipelines.core.ledger.hypothesis import recipe_diff
from envloop_pipelines.core.ledger.ledger import Ledger
from envloop_pipelines.core.ledger.store import RoundStore
from envloop_pipelines.core.loop.config import LoopConfig
from envloop_pipelines.core.release.publish import champion
from envloop_pipelines.core.release.tracked_runs import child_run, flat_metrics
from envloop_pipelines.core.storage import publish_dir, staging_dir
from envloop_pipelines.core.tracking import KIND_HYPOTHESIS, KIND_TRAINING, TAG_HYPOTHESIS, TAG_KIND, TAG_ROUND, Tracker


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


__all__ = ["candidate_rows", "loop_recipe_error", "train_candidate", "train_into_store"]
