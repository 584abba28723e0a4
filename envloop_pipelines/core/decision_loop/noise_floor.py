"""The asset ``noise_floor``: the seed-to-seed spread of the loop's recipe (which makes release 1).

The floor is cached per (benchmark version, recipe hash, K) under the loop's
``noise/`` folder, so a second loop on the same benchmark and recipe reuses it.

It opens no task: ``task_benchmark`` (``core/decision_loop/task_benchmark.py``) pins the benchmark version and
the step hands the snapshot it opened once to :func:`measure_noise_floor`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from envloop_pipelines.core.data.snapshots import TaskSnapshot
from envloop_pipelines.core.release.card import benchmark_limitations
from envloop_pipelines.core.loop.config import LoopConfig
from envloop_pipelines.core.ledger.event_log import EVENT_CHECKPOINT_TRAINED, EVENT_NULL_ARM, LedgerError
from envloop_pipelines.core.ledger.ledger import Ledger
from envloop_pipelines.core.loop.promotion import check_arm_identity, noise_floor_from_arms
from envloop_pipelines.core.release.publish import publish_release, tfidf_baseline
from envloop_pipelines.core.decision_loop.step_records import MeasuredNoiseFloor, TrainingSnapshot
from envloop_pipelines.core.storage import envloop_home
from envloop_pipelines.core.release.tracked_runs import verify_predictions, write_predictions
from envloop_pipelines.core.sandbox import SandboxSettings
from envloop_pipelines.core.ledger.store import RoundStore
from envloop_pipelines.core.decision_loop.lora_checkpoint import train_into_store
from envloop_pipelines.core.decision_loop.synthesis import SNAPSHOT_SCHEMA
from envloop_pipelines.core.decision_loop.training_dataset_snapshot import checked_training_snapshot, snapshot_rows
from envloop_pipelines.core.storage import atomic_write_json, atomic_write_parquet, canonical_json, sha256_bytes
from envloop_pipelines.core.tracking import (
    KIND_NOISE_FLOOR,
    KIND_NULL_ARM,
    TAG_KIND,
    TAG_NOISE_KEY,
    Tracker,
)

PRIMARY_METRIC = "family_macro_accuracy"

#: Continuation arms the floor's measurement trains by default (``measure_noise_floor``): one costs a
#: candidate's training (~100 s at the demo's 24 steps on 2 cores).
CONTINUATION_ARMS = 1
#: Seeds of the continuation arms start here (the null arms use the recipe's seed, +1, +2, ...; candidates
#: the recipe's seed + 1000 + the round's number).
CONTINUATION_SEED_OFFSET = 5_000


def noise_floor_key(benchmark_version: str, config: LoopConfig) -> str:
    """The cache key of a floor: benchmark version, the loop's recipe hash, K, and how its data was checked.

    The arms train on the task's train rows after the contamination check (``base_training_snapshot``),
    a function of the benchmark, the check's thresholds and the policy; a floor measured on other data
    (an unchecked train split, before rule 7 covered the arms) is not reused.
    """
    from envloop_pipelines.core.data.contamination import ContaminationConfig

    data = {"train": "contamination-checked", "policy": config.contamination_policy,
            "check": dict(ContaminationConfig().__dict__)}
    return sha256_bytes(canonical_json({"benchmark": benchmark_version, "recipe": config.recipe_hash(),
                                        "arms": config.noise_arms, "data": data}))[:16]


def measure_noise_floor(config: LoopConfig, task: TaskSnapshot, tracker: Tracker, *,
                        run_tags: Mapping[str, str] | None = None,
                        continuation_arms: int = CONTINUATION_ARMS,
                        sandbox: SandboxSettings | None = None) -> MeasuredNoiseFloor:
    """K null arms of the loop's recipe on the base data (``task``, the snapshot the step opened), scored on test
    by the verifier.

    Cached per (benchmark version, recipe, K). When the loop has no champion
    yet, the control arm (the recipe's own seed) becomes release 1. Then
    ``continuation_arms`` arms are trained from the control arm as a candidate is from its champion
    (:func:`measure_continuation_arms`): the first rounds' minimum detectable effect comes from them.
    ``sandbox``: the deployment's sandbox, where the verifier scores the arms (default: the local backend).
    """
    store = RoundStore(config.task, config.home)
    key = noise_floor_key(task.benchmark_version, config)
    cache = store.noise / f"{key}.json"
    if cache.exists():
        result = MeasuredNoiseFloor.from_dict({**json.loads(cache.read_text(encoding="utf-8")), "cached": True})
    else:
        result = _measure(config, tracker, task, store, key, run_tags, sandbox)
        atomic_write_json(cache, result.to_dict(), overwrite=True)
    if not Ledger(config.task, config.home).releases():
        _release_control_arm(config, tracker, result, task, store, run_tags, sandbox)
    measure_continuation_arms(config, result, task, store, n=continuation_arms)
    return result



def setup_reader(config: LoopConfig, noise_key: str) -> dict[str, Any]:
    """The loop's setup as a reader of ``test`` (rule 4): ``{"reader": "setup:<noise key>", "read_budget": n}``.

    What the setup of one floor scores on test, each a distinct predictions file: its ``noise_arms`` null
    arms (``_measure``; the control arm among them is release 1, whose card shows that read, so release 1
    reads no test file of its own), its continuation arms, each paired with the control arm
    (``steps.paired_noise``: at least :data:`CONTINUATION_ARMS`, or as many as are listed), and the TF-IDF
    baseline of release 1 (``_release_control_arm``). Passed to ``runs.verify_predictions`` by each of them.
    """
    path = continuation_path(RoundStore(config.task, config.home), noise_key)
    listed = len(json.loads(path.read_text(encoding="utf-8"))["arms"]) if path.is_file() else 0
    return {"reader": f"setup:{noise_key}", "read_budget": config.noise_arms + max(CONTINUATION_ARMS, listed) + 1}


def continuation_path(store: RoundStore, noise_key: str) -> Path:
    """Where a floor's continuation arms are listed: ``noise/<key>.continuation.json``."""
    return store.noise / f"{noise_key}.continuation.json"


def measure_continuation_arms(config: LoopConfig, measured: MeasuredNoiseFloor, snapshot: TaskSnapshot,
                              store: RoundStore, *, n: int = CONTINUATION_ARMS) -> list[dict[str, Any]]:
    """Train ``n`` continuation arms from the floor's control arm, as a round's candidate is trained from its champion.

    A null arm pair says how far two seeds trained *from the base model* land apart; a candidate is trained
    *from the champion*, and how far that moves it is what a round's paired test sees (issue 23: with the
    demo's hybrid readout the null arms nearly agree, se 0.0027, while a round's paired se is ~0.017). A
    continuation arm is the loop's recipe (the same step budget), a fresh seed, trained from the control
    arm (release 1) on the arms' checked training data, with no new rows: a candidate of round 1 with no
    change. Its paired se against the control on test (``steps.paired_noise``) is the first rounds' noise.
    Listed in ``noise/<key>.continuation.json`` with their test predictions (not an MLflow run of its own:
    the hypotheses whose MDE it sizes name it); trained once per floor.
    """
    from envloop_pipelines.core.model.recipe import recipe_to_dict

    path = continuation_path(store, measured.floor.key)
    listed = json.loads(path.read_text(encoding="utf-8"))["arms"] if path.is_file() else []
    if len(listed) >= n or not measured.floor.arms:
        return listed
    control = measured.floor.arms[0]
    data = base_training_snapshot(config, snapshot)
    recipe = config.load_recipe()
    val, test = snapshot.table("val"), snapshot.table("test")
    train = snapshot_rows(data)
    arms = list(listed)
    families = config.guarded_families(snapshot)
    for i in range(len(listed), n):
        arm = recipe.replace(seed=recipe.seed + CONTINUATION_SEED_OFFSET + i)
        started = time.perf_counter()
        ckpt = train_into_store(store, train, val, arm, data_hash=data.sha256, init_from=Path(control["checkpoint"]),
                                safety_families=families, safety_fnr_target=config.safety_fnr_target)
        preds = write_predictions(store.noise / measured.floor.key / f"continuation-seed{arm.seed}-test.parquet", ckpt,
                                  test, home=envloop_home(config.home))
        arms.append({"seed": arm.seed, "init_from": control["checkpoint_sha256"], "init_seed": control.get("seed"),
                     "max_steps": recipe_to_dict(arm).get("max_steps"),
                     "checkpoint": str(ckpt), "checkpoint_sha256": ckpt.name, "training_snapshot": data.sha256,
                     "test_predictions": str(preds), "train_s": round(time.perf_counter() - started, 2)})
        # Rule 5: every trained arm stays in the ledger (no round: it belongs to the floor).
        Ledger(config.task, config.home).append(
            EVENT_CHECKPOINT_TRAINED, {"role": "continuation_arm", "noise_key": measured.floor.key, "seed": arm.seed,
                                       "init_from": control["checkpoint_sha256"], "checkpoint_sha256": ckpt.name},
            key=f"continuation_arm:{measured.floor.key}:{arm.seed}")
        atomic_write_json(path, {"noise_key": measured.floor.key, "arms": arms}, overwrite=True)
    return arms


def _measure(config: LoopConfig, tracker: Tracker, snapshot: TaskSnapshot, store: RoundStore, key: str,
             run_tags: Mapping[str, str] | None, sandbox: SandboxSettings | None) -> MeasuredNoiseFloor:
    from envloop_pipelines.core.model.recipe import recipe_to_dict

    ledger = Ledger(config.task, config.home)
    recipe = config.load_recipe()
    recipe_hash = config.recipe_hash()
    arms = [recipe.replace(seed=recipe.seed + i) for i in range(config.noise_arms)]
    # The arms (and release 1, the control arm) train on the checked snapshot, as every round's candidate does.
    data = base_training_snapshot(config, snapshot)
    identity = check_arm_identity([(recipe_to_dict(a), data.sha256) for a in arms])  # before any compute
    train, val, test = snapshot_rows(data), snapshot.table("val"), snapshot.table("test")
    families = config.guarded_families(snapshot)
    parent = tracker.start_run(config.task, f"noise floor {key}", tags={TAG_KIND: KIND_NOISE_FLOOR, TAG_NOISE_KEY: key,
                                                                       **(run_tags or {})})
    tracker.log_params(parent.run_id, {"arms": config.noise_arms, "benchmark_version": snapshot.benchmark_version,
                                       "recipe_hash": recipe_hash, "identity": identity})
    arm_metrics, arm_info = [], []
    for arm in arms:
        started = time.perf_counter()
        ckpt = train_into_store(store, train, val, arm, data_hash=data.sha256,
                                safety_families=families, safety_fnr_target=config.safety_fnr_target)
        preds = write_predictions(store.noise / key / f"arm-seed{arm.seed}-test.parquet", ckpt, test,
                                  home=envloop_home(config.home))
        run = verify_predictions(config, "test", preds, checkpoint=ckpt, sandbox=sandbox, **setup_reader(config, key))
        metrics = dict(run.report.metrics)
        child = tracker.start_run(config.task, f"null arm seed {arm.seed}", parent_run_id=parent.run_id,
                                  tags={TAG_KIND: KIND_NULL_ARM, TAG_NOISE_KEY: key})
        tracker.log_params(child.run_id, {"seed": arm.seed, "checkpoint": ckpt.name})
        tracker.log_metrics(child.run_id, {k: v for k, v in metrics.items() if isinstance(v, (int, float))})
        tracker.end_run(child.run_id)
        arm_metrics.append(metrics)
        arm_info.append({"seed": arm.seed, "checkpoint": str(ckpt), "checkpoint_sha256": ckpt.name,
                         "training_snapshot": data.sha256, "contamination_removed": data.n_removed,
                         "test_predictions": str(preds), "train_s": round(time.perf_counter() - started, 2),
                         "verifier_pid": run.worker_pid, "metrics": metrics})
        ledger.append(EVENT_NULL_ARM, {"noise_key": key, "seed": arm.seed, "checkpoint_sha256": ckpt.name,
                                       PRIMARY_METRIC: metrics.get(PRIMARY_METRIC)}, key=f"null_arm:{key}:{arm.seed}")
    floor = noise_floor_from_arms(key, PRIMARY_METRIC, arm_metrics, arm_info)
    tracker.log_metrics(parent.run_id, {"noise_floor": floor.floor})
    tracker.end_run(parent.run_id)
    return MeasuredNoiseFloor(floor=floor, benchmark_version=snapshot.benchmark_version, recipe_hash=recipe_hash,
                              identity=identity, mlflow_run_id=parent.run_id, mlflow_url=parent.url)


def base_training_snapshot(config: LoopConfig, snapshot: TaskSnapshot) -> TrainingSnapshot:
    """The null arms' and release 1's training data: the task's train rows, contamination-checked (rule 7).

    The same check as every round's snapshot (``checked_training_snapshot``): flagged rows are removed
    under ``remove``; under ``refuse`` a flagged row refuses the floor before any training. Stored under
    its sha256 beside the rounds' snapshots, with its report; the arms' data hash is that sha256.

    Raises:
        ContaminatedDataError: the check is not clean (policy ``refuse``).
    """
    data = checked_training_snapshot(config, snapshot, SNAPSHOT_SCHEMA.empty_table(), round="noise_floor")
    if data.problems():
        raise ContaminatedDataError(f"the null arms' training data {data.path} cannot be trained on: "
                                    f"{'; '.join(data.problems())} (contamination_policy="
                                    f"{config.contamination_policy!r}; report beside it: "
                                    f"{data.sha256}.contamination.json)")
    return data


class ContaminatedDataError(LedgerError):
    """The base training data overlaps test/holdout and the policy keeps the rows (``refuse``)."""


def _release_control_arm(config: LoopConfig, tracker: Tracker, measured: MeasuredNoiseFloor, snapshot: TaskSnapshot,
                         store: RoundStore, run_tags: Mapping[str, str] | None, sandbox: SandboxSettings | None) -> None:
    """Release 1: the control arm of the floor (the recipe's own seed), which passed no gate."""
    from pathlib import Path

    control = measured.floor.arms[0]
    data = base_training_snapshot(config, snapshot)  # what the control arm trained on (content-addressed: the same)
    # TF-IDF + LR on the same rows and test split, so release 1's card says what the classical model gives too.
    tfidf = tfidf_baseline(config, snapshot, train=snapshot_rows(data))
    tfidf_preds = atomic_write_parquet(store.noise / "tfidf-test.parquet", tfidf.predict_table(snapshot.table("test")),
                                       overwrite=True)
    tfidf_test = dict(verify_predictions(config, "test", tfidf_preds,
                                         safety_thresholds=tfidf.calibration.safety_thresholds, sandbox=sandbox,
                                         **setup_reader(config, measured.floor.key)).report.metrics)
    limitations = ["The first champion is the control recipe on the base data; it passed no gate.",
                   *benchmark_limitations(snapshot)]

    def card(release: int, holdout: dict[str, Any]) -> dict[str, Any]:
        return {
            "round": "bootstrap", "task": config.task, "parent_release": None,
            "benchmark_version": snapshot.benchmark_version, "data_snapshot": data.sha256,
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
                    tfidf=tfidf, sandbox=sandbox)


def current_noise_floor(config: LoopConfig, task: TaskSnapshot) -> MeasuredNoiseFloor:
    """The floor measured for ``task``'s benchmark version (the snapshot the step opened) and the loop's recipe.

    Raises:
        LedgerError: it has not been measured (materialize ``noise_floor`` first).
    """
    cache = RoundStore(config.task, config.home).noise / f"{noise_floor_key(task.benchmark_version, config)}.json"
    if not cache.exists():
        raise LedgerError(f"{cache} is missing: materialize noise_floor first")
    return MeasuredNoiseFloor.from_dict(json.loads(cache.read_text(encoding="utf-8")))


__all__ = ["CONTINUATION_ARMS", "PRIMARY_METRIC", "continuation_path", "current_noise_floor",
           "measure_continuation_arms", "measure_noise_floor", "noise_floor_key",
           "setup_reader"]
