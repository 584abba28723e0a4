"""The loop's unpartitioned steps: the task benchmark and the noise floor (which makes release 1).

The floor is cached per (benchmark version, recipe hash, K) under the loop's
``noise/`` folder, so a second loop on the same benchmark and recipe reuses it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

from envloop_pipelines.core.data.snapshots import TaskSnapshot, open_task
from envloop_pipelines.core.loop.cards import benchmark_limitations
from envloop_pipelines.core.loop.config import LoopConfig
from envloop_pipelines.core.loop.ledger import EVENT_NULL_ARM, Ledger, LedgerError
from envloop_pipelines.core.loop.promotion import check_arm_identity, noise_floor_from_arms
from envloop_pipelines.core.loop.release import publish_release, tfidf_baseline
from envloop_pipelines.core.loop.results import Benchmark, MeasuredNoiseFloor
from envloop_pipelines.core.storage import envloop_home
from envloop_pipelines.core.loop.runs import verify_predictions, write_predictions
from envloop_pipelines.core.loop.store import RoundStore
from envloop_pipelines.core.loop.candidate import train_into_store
from envloop_pipelines.core.storage import atomic_write_json, atomic_write_parquet, canonical_json, sha256_bytes
from envloop_pipelines.core.tracking import (
    KIND_NOISE_FLOOR,
    KIND_NULL_ARM,
    TAG_KIND,
    TAG_NOISE_KEY,
    Tracker,
)

PRIMARY_METRIC = "family_macro_accuracy"


def ensure_task_benchmark(config: LoopConfig) -> Benchmark:
    """The task's current snapshot; the built-in benchmark is generated on first use."""
    return _benchmark(config.task, _open_or_generate(config))


def _open_or_generate(config: LoopConfig) -> TaskSnapshot:
    try:
        return open_task(config.task, home=envloop_home(config.home))
    except FileNotFoundError:
        if config.generator != "builtin_targeted":
            raise
    from envloop_pipelines.core.data.datasets import generate_builtin_task

    generate_builtin_task(task=config.task, n_users=config.builtin_users,
                          records_per_user=config.builtin_records_per_user, home=envloop_home(config.home))
    return open_task(config.task, home=envloop_home(config.home))


def _benchmark(task: str, snapshot: TaskSnapshot) -> Benchmark:
    summary = snapshot.summary()
    return Benchmark(task=task, snapshot_id=snapshot.snapshot_id,
                     benchmark_version=snapshot.benchmark_version, splits=summary["splits"])


def noise_floor_key(benchmark_version: str, config: LoopConfig) -> str:
    """The cache key of a floor: benchmark version, the loop's recipe hash, K."""
    return sha256_bytes(canonical_json({"benchmark": benchmark_version, "recipe": config.recipe_hash(),
                                        "arms": config.noise_arms}))[:16]


def measure_noise_floor(config: LoopConfig, tracker: Tracker, *,
                        run_tags: Mapping[str, str] | None = None) -> MeasuredNoiseFloor:
    """K null arms of the loop's recipe on the base data, scored on test by the verifier.

    Cached per (benchmark version, recipe, K). When the loop has no champion
    yet, the control arm (the recipe's own seed) becomes release 1.
    """
    snapshot = _open_or_generate(config)
    store = RoundStore(config.task, config.home)
    key = noise_floor_key(snapshot.benchmark_version, config)
    cache = store.noise / f"{key}.json"
    if cache.exists():
        result = MeasuredNoiseFloor.from_dict({**json.loads(cache.read_text(encoding="utf-8")), "cached": True})
    else:
        result = _measure(config, tracker, snapshot, store, key, run_tags)
        atomic_write_json(cache, result.to_dict(), overwrite=True)
    if not Ledger(config.task, config.home).releases():
        _release_control_arm(config, tracker, result, snapshot, store, run_tags)
    return result


def _measure(config: LoopConfig, tracker: Tracker, snapshot: TaskSnapshot, store: RoundStore, key: str,
             run_tags: Mapping[str, str] | None) -> MeasuredNoiseFloor:
    from envloop_pipelines.core.model.recipe import recipe_to_dict

    ledger = Ledger(config.task, config.home)
    recipe = config.load_recipe()
    recipe_hash = config.recipe_hash()
    arms = [recipe.replace(seed=recipe.seed + i) for i in range(config.noise_arms)]
    identity = check_arm_identity([(recipe_to_dict(a), snapshot.snapshot_id) for a in arms])  # before any compute
    train, val, test = snapshot.table("train"), snapshot.table("val"), snapshot.table("test")
    parent = tracker.start_run(config.task, f"noise floor {key}", tags={TAG_KIND: KIND_NOISE_FLOOR, TAG_NOISE_KEY: key,
                                                                       **(run_tags or {})})
    tracker.log_params(parent.run_id, {"arms": config.noise_arms, "benchmark_version": snapshot.benchmark_version,
                                       "recipe_hash": recipe_hash, "identity": identity})
    arm_metrics, arm_info = [], []
    for arm in arms:
        started = time.perf_counter()
        ckpt = train_into_store(store, train, val, arm, data_hash=snapshot.snapshot_id,
                                safety_families=config.safety_families, safety_fnr_target=config.safety_fnr_target)
        preds = write_predictions(store.noise / key / f"arm-seed{arm.seed}-test.parquet", ckpt, test,
                                  home=envloop_home(config.home))
        run = verify_predictions(config, "test", preds, checkpoint=ckpt)
        metrics = dict(run.report.metrics)
        child = tracker.start_run(config.task, f"null arm seed {arm.seed}", parent_run_id=parent.run_id,
                                  tags={TAG_KIND: KIND_NULL_ARM, TAG_NOISE_KEY: key})
        tracker.log_params(child.run_id, {"seed": arm.seed, "checkpoint": ckpt.name})
        tracker.log_metrics(child.run_id, {k: v for k, v in metrics.items() if isinstance(v, (int, float))})
        tracker.end_run(child.run_id)
        arm_metrics.append(metrics)
        arm_info.append({"seed": arm.seed, "checkpoint": str(ckpt), "checkpoint_sha256": ckpt.name,
                         "test_predictions": str(preds), "train_s": round(time.perf_counter() - started, 2),
                         "verifier_pid": run.worker_pid, "metrics": metrics})
        ledger.append(EVENT_NULL_ARM, {"noise_key": key, "seed": arm.seed, "checkpoint_sha256": ckpt.name,
                                       PRIMARY_METRIC: metrics.get(PRIMARY_METRIC)}, key=f"null_arm:{key}:{arm.seed}")
    floor = noise_floor_from_arms(key, PRIMARY_METRIC, arm_metrics, arm_info)
    tracker.log_metrics(parent.run_id, {"noise_floor": floor.floor})
    tracker.end_run(parent.run_id)
    return MeasuredNoiseFloor(floor=floor, benchmark_version=snapshot.benchmark_version, recipe_hash=recipe_hash,
                              identity=identity, mlflow_run_id=parent.run_id, mlflow_url=parent.url)


def _release_control_arm(config: LoopConfig, tracker: Tracker, measured: MeasuredNoiseFloor, snapshot: TaskSnapshot,
                         store: RoundStore, run_tags: Mapping[str, str] | None) -> None:
    """Release 1: the control arm of the floor (the recipe's own seed), which passed no gate."""
    from pathlib import Path

    control = measured.floor.arms[0]
    # TF-IDF + LR on the same test split, so release 1's card says what the classical model gives too.
    tfidf = tfidf_baseline(config, snapshot)
    tfidf_preds = atomic_write_parquet(store.noise / "tfidf-test.parquet", tfidf.predict_table(snapshot.table("test")),
                                       overwrite=True)
    tfidf_test = dict(verify_predictions(config, "test", tfidf_preds,
                                         safety_thresholds=tfidf.calibration.safety_thresholds).report.metrics)
    limitations = ["The first champion is the control recipe on the base data; it passed no gate.",
                   *benchmark_limitations(snapshot)]

    def card(release: int, holdout: dict[str, Any]) -> dict[str, Any]:
        return {
            "round": "bootstrap", "task": config.task, "parent_release": None,
            "benchmark_version": snapshot.benchmark_version, "data_snapshot": snapshot.snapshot_id,
            "recipe_hash": measured.recipe_hash, "checkpoint_dir": control["checkpoint"],
            "checkpoint_sha256": control["checkpoint_sha256"], "test": control["metrics"],
            "tfidf_baseline_test": tfidf_test,
            "gate": "bootstrap: the control arm of the noise floor; no parent to beat",
            "noise_floor": measured.floor.floor, "paired_deltas": None, "guards": None, "amendments": [],
            "limitations": limitations,
        }

    release = Ledger(config.task, config.home).next_release_number()
    publish_release(config, tracker, checkpoint=Path(control["checkpoint"]), snapshot=snapshot,
                    holdout_out=store.noise / f"release{release}-holdout.parquet", card=card, run_tags=run_tags,
                    tfidf=tfidf)


def current_noise_floor(config: LoopConfig) -> MeasuredNoiseFloor:
    """The floor measured for the task's current benchmark and the loop's recipe.

    Raises:
        LedgerError: it has not been measured (materialize ``noise_floor`` first).
    """
    snapshot = open_task(config.task, home=envloop_home(config.home))
    cache = RoundStore(config.task, config.home).noise / f"{noise_floor_key(snapshot.benchmark_version, config)}.json"
    if not cache.exists():
        raise LedgerError(f"{cache} is missing: materialize noise_floor first")
    return MeasuredNoiseFloor.from_dict(json.loads(cache.read_text(encoding="utf-8")))


__all__ = ["PRIMARY_METRIC", "current_noise_floor", "ensure_task_benchmark", "measure_noise_floor",
           "noise_floor_key"]
