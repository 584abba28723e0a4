"""The asset ``champion_noise_floor``: the floor that gates a round, measured at the champion's own making.

The setup's floor (``noise_floor``) is the seed spread of the control recipe trained from the base model, and
release 1 is its control arm. A champion a round promoted was made otherwise: trained on from its parent with
its round's ``recipe_diff`` (the budget lever: 300 steps more) on its round's training snapshot. At the README
demo's design the seed sd of such a lineage is 0.0075 against the control recipe's 0.0039
(``bench/bench_gate_evidence.py``, issue 45), so the control floor does not bound it, and a round over such a
champion is gated by a floor measured at the champion's making: the **lineage floor**.

Its K values (``noise_arms``) are the champion's own test score and K − 1 **lineage arms**: the champion's
making repeated with fresh seeds (the same parent or base init, recipe, ``recipe_diff`` and rows; the identity
checked before any compute, rule 2), each scored on test by the verifier under its own read budget
(reader ``floor:<key>``). The champion is one draw of its making as release 1 is one of the control floor's
arms. The bar is the promotion rule's, unchanged (:func:`~envloop_pipelines.core.loop.promotion.gate_bar`):
the spread of the K values, and their seed bound minus the champion's score. Cached per (control floor,
champion checkpoint, K) under ``noise/lineage/``: only the first round over a champion trains its arms.

While the champion is release 1 (the control arm) the control floor gates, as before.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from envloop_pipelines.core.data.snapshots import TaskSnapshot
from envloop_pipelines.core.decision_loop.lora_checkpoint import candidate_rows, train_into_store
from envloop_pipelines.core.decision_loop.noise_floor import PRIMARY_METRIC
from envloop_pipelines.core.decision_loop.step_records import MeasuredNoiseFloor, TrainingSnapshot
from envloop_pipelines.core.ledger.event_log import EVENT_CHECKPOINT_TRAINED, LedgerError
from envloop_pipelines.core.ledger.hypothesis import recipe_diff
from envloop_pipelines.core.ledger.ledger import Ledger
from envloop_pipelines.core.ledger.store import RoundStore
from envloop_pipelines.core.loop.config import LoopConfig
from envloop_pipelines.core.loop.promotion import check_arm_identity, noise_floor_from_arms
from envloop_pipelines.core.release.publish import champion
from envloop_pipelines.core.release.tracked_runs import verify_predictions, write_predictions
from envloop_pipelines.core.sandbox import SandboxSettings
from envloop_pipelines.core.storage import atomic_write_json, canonical_json, envloop_home, sha256_bytes
from envloop_pipelines.core.tracking import KIND_LINEAGE_FLOOR, TAG_KIND, TAG_NOISE_KEY, Tracker

#: Where a floor came from (``MeasuredNoiseFloor.source``): the setup's null arms of the control recipe, or the
#: champion's making repeated (this module).
SOURCE_CONTROL = "control"
SOURCE_LINEAGE = "lineage"
#: Seeds of the lineage arms start here, past the null arms' (recipe seed + i), the candidates' (+ 1000 + the
#: round's number) and the continuation arms' (+ 5000 + i).
LINEAGE_SEED_OFFSET = 7_000


class LineageFloorError(LedgerError):
    """The champion's making cannot be repeated (its round, hypothesis, snapshot or parent is not on record),
    or the floor handed to a round is not the one that gates it."""


def champion_is_control_arm(champ: Mapping[str, Any]) -> bool:
    """Whether the champion is release 1, the control arm of the loop's floor (the control floor gates): the one
    release the setup publishes (``round: "bootstrap"``); every later one is a round's candidate."""
    return champ.get("round") == "bootstrap"


def lineage_floor_key(control: MeasuredNoiseFloor, champ: Mapping[str, Any], config: LoopConfig) -> str:
    """The cache key of a lineage floor: the control floor it stands beside, the champion's checkpoint, K."""
    return sha256_bytes(canonical_json({"control": control.floor.key, "champion": champ.get("checkpoint_sha256"),
                                        "arms": config.noise_arms}))[:16]


def lineage_path(store: RoundStore, key: str) -> Path:
    """Where a lineage floor is cached: ``noise/lineage/<key>.json``."""
    return store.noise / "lineage" / f"{key}.json"


def champion_making(config: LoopConfig, champ: Mapping[str, Any]) -> dict[str, Any]:
    """How the champion was made, from the ledger and the round store: its round, change, parent, rows, seed.

    Raises:
        LineageFloorError: a piece is not on record (the message names it).
    """
    from envloop_pipelines.core.model.checkpoint import read_recipe

    key, release = champ.get("round"), champ.get("release")
    ledger, store = Ledger(config.task, config.home), RoundStore(config.task, config.home)
    hypothesis = ledger.hypothesis(key) if key else None
    if hypothesis is None:
        raise LineageFloorError(f"release {release}: its making cannot be repeated for a lineage floor: round "
                                f"{key!r} has no registered hypothesis in {ledger.events_path}")
    snapshot = store.load("training_dataset_snapshot", TrainingSnapshot, key)
    if snapshot is None or not Path(snapshot.path).is_file():
        raise LineageFloorError(f"release {release}: its making cannot be repeated for a lineage floor: round {key}'s "
                                f"training snapshot ({store.step_path('training_dataset_snapshot', key)}) is missing")
    init = hypothesis.change.get("init")
    parent = None
    if init != "base":
        parents = [r for r in ledger.releases() if r.get("release") == champ.get("parent_release")]
        if not parents or not Path(str(parents[0].get("checkpoint_dir"))).is_dir():
            raise LineageFloorError(f"release {release}: its making cannot be repeated for a lineage floor: its "
                                    f"parent release {champ.get('parent_release')!r} has no checkpoint on disk")
        parent = parents[0]
    recipe = read_recipe(champ["checkpoint_dir"])
    return {"round": key, "release": release, "change": dict(hypothesis.change),
            "recipe_diff": recipe_diff(hypothesis.change), "snapshot": snapshot,
            "parent_release": parent.get("release") if parent else None,
            "parent_checkpoint": parent.get("checkpoint_dir") if parent else None,
            "parent_checkpoint_sha256": parent.get("checkpoint_sha256") if parent else None,
            "init": "base" if parent is None else "parent", "seed": recipe.seed}


def measure_champion_noise_floor(config: LoopConfig, task: TaskSnapshot, control: MeasuredNoiseFloor,
                                 tracker: Tracker, *, run_tags: Mapping[str, str] | None = None,
                                 sandbox: SandboxSettings | None = None) -> MeasuredNoiseFloor:
    """The floor that gates a round over the task's champion: ``control`` while the champion is its control arm,
    else the champion's lineage floor, measured once (cached).

    Raises:
        LineageFloorError: the champion's making cannot be repeated.
    """
    champ = _champion_or_none(config)
    if champ is None or champion_is_control_arm(champ) or control.recipe_hash != config.recipe_hash():
        # Release 1 is the control arm; a floor of another recipe gates nothing (registration and the decision
        # refuse it, naming the recipe) and no lineage is measured beside it.
        return control
    store = RoundStore(config.task, config.home)
    key = lineage_floor_key(control, champ, config)
    cached = lineage_path(store, key)
    if cached.is_file():
        return MeasuredNoiseFloor.from_dict({**json.loads(cached.read_text(encoding="utf-8")), "cached": True})
    measured = _measure_lineage(config, task, control, champ, key, store, tracker, run_tags, sandbox)
    atomic_write_json(cached, measured.to_dict(), overwrite=True)
    return measured


def current_gating_floor(config: LoopConfig, task: TaskSnapshot) -> MeasuredNoiseFloor:
    """The floor that gates a round over the task's champion, as measured (nothing is trained).

    Raises:
        LedgerError: the control floor is not measured, or the champion's lineage floor is not
            (materialize ``noise_floor``, then the round's ``champion_noise_floor``).
    """
    from envloop_pipelines.core.decision_loop.noise_floor import current_noise_floor

    control = current_noise_floor(config, task)
    champ = _champion_or_none(config)
    if champ is None or champion_is_control_arm(champ):
        return control
    path = lineage_path(RoundStore(config.task, config.home), lineage_floor_key(control, champ, config))
    if not path.is_file():
        raise LedgerError(f"{path} is missing: the champion (release {champ.get('release')}) is not the control "
                          f"arm, so a round over it is gated by its lineage floor: materialize champion_noise_floor "
                          f"first")
    return MeasuredNoiseFloor.from_dict(json.loads(path.read_text(encoding="utf-8")))


def _champion_or_none(config: LoopConfig) -> Mapping[str, Any] | None:
    """The champion's card, or ``None`` before release 1 (then the control floor gates, as it makes release 1)."""
    try:
        return champion(config)
    except LedgerError:
        return None


def gating_floor_error(floor: MeasuredNoiseFloor, champ: Mapping[str, Any]) -> str | None:
    """Why ``floor`` cannot gate a round over ``champ``, or ``None`` when it can: the control floor over the control
    arm (:func:`champion_is_control_arm`), the champion's own lineage floor over any other champion."""
    if champion_is_control_arm(champ):
        if floor.source == SOURCE_CONTROL:
            return None
        return (f"noise_floor {floor.floor.key}: a lineage floor (of checkpoint "
                f"{str(floor.champion_checkpoint_sha256)[:12]}) cannot gate a round over release "
                f"{champ.get('release')}, the control arm: the control floor gates it")
    if floor.source == SOURCE_LINEAGE and floor.champion_checkpoint_sha256 == champ.get("checkpoint_sha256"):
        return None
    got = ("the control floor" if floor.source == SOURCE_CONTROL
           else f"the lineage floor of checkpoint {str(floor.champion_checkpoint_sha256)[:12]}")
    return (f"noise_floor {floor.floor.key} is {got}; a round over release {champ.get('release')} (checkpoint "
            f"{str(champ.get('checkpoint_sha256'))[:12]}, made by round {champ.get('round')}) is gated by that "
            f"champion's lineage floor: materialize champion_noise_floor for the round")


def _measure_lineage(config: LoopConfig, task: TaskSnapshot, control: MeasuredNoiseFloor, champ: Mapping[str, Any],
                     key: str, store: RoundStore, tracker: Tracker, run_tags: Mapping[str, str] | None,
                     sandbox: SandboxSettings | None) -> MeasuredNoiseFloor:
    from envloop_pipelines.core.model.checkpoint import read_recipe
    from envloop_pipelines.core.model.recipe import recipe_to_dict

    making = champion_making(config, champ)
    snapshot: TrainingSnapshot = making["snapshot"]
    base = config.load_recipe().replace(**making["recipe_diff"])
    seeds = [base.seed + LINEAGE_SEED_OFFSET + i for i in range(config.noise_arms)]
    seeds = [s for s in seeds if s != making["seed"]][:config.noise_arms - 1]
    arms = [base.replace(seed=s) for s in seeds]
    rows, data_hash = candidate_rows(snapshot, making["change"])
    # Rule 2: the arms are the champion's making but for the seed, checked before any compute.
    identity = check_arm_identity([(recipe_to_dict(read_recipe(champ["checkpoint_dir"])), data_hash),
                                   *[(recipe_to_dict(a), data_hash) for a in arms]])
    val, test = task.table("val"), task.table("test")
    families = config.guarded_families(task)
    init_from = Path(making["parent_checkpoint"]) if making["parent_checkpoint"] else None
    provenance = {k: making[k] for k in ("round", "release", "recipe_diff", "parent_release",
                                         "parent_checkpoint_sha256", "init", "seed")}
    provenance["training_snapshot"] = snapshot.sha256
    run = tracker.start_run(config.task, f"lineage floor {key} (release {champ.get('release')})",
                            tags={TAG_KIND: KIND_LINEAGE_FLOOR, TAG_NOISE_KEY: key, **(run_tags or {})})
    tracker.log_params(run.run_id, {"arms": config.noise_arms, "control_noise_key": control.floor.key,
                                    "champion_release": champ.get("release"),
                                    "champion_checkpoint": champ.get("checkpoint_sha256"), "identity": identity,
                                    "making": json.dumps(provenance, sort_keys=True)})
    ledger = Ledger(config.task, config.home)
    metrics = [dict(champ.get("test") or {})]
    info: list[dict[str, Any]] = [{"seed": making["seed"], "checkpoint": champ.get("checkpoint_dir"),
                                   "checkpoint_sha256": champ.get("checkpoint_sha256"), "role": "champion",
                                   "metrics": metrics[0]}]
    reader = {"reader": f"floor:{key}", "read_budget": max(1, len(arms))}
    for arm in arms:
        started = time.perf_counter()
        ckpt = train_into_store(store, rows, val, arm, data_hash=data_hash, init_from=init_from,
                                safety_families=families, safety_fnr_target=config.safety_fnr_target)
        preds = write_predictions(store.noise / "lineage" / key / f"arm-seed{arm.seed}-test.parquet", ckpt, test,
                                  home=envloop_home(config.home))
        scored = dict(verify_predictions(config, "test", preds, checkpoint=ckpt, sandbox=sandbox, **reader).report.metrics)
        metrics.append(scored)
        info.append({"seed": arm.seed, "checkpoint": str(ckpt), "checkpoint_sha256": ckpt.name, "role": "lineage_arm",
                     "training_snapshot": data_hash, "test_predictions": str(preds),
                     "train_s": round(time.perf_counter() - started, 2), "metrics": scored})
        tracker.log_metrics(run.run_id, {f"seed{arm.seed}.{k}": v for k, v in scored.items()
                                         if isinstance(v, (int, float))})
        # Rule 5: every trained arm stays in the ledger with its number.
        ledger.append(EVENT_CHECKPOINT_TRAINED, {"role": "lineage_arm", "noise_key": key, "seed": arm.seed,
                                                 "init_from": making["parent_checkpoint_sha256"] or "base",
                                                 "champion_checkpoint_sha256": champ.get("checkpoint_sha256"),
                                                 "checkpoint_sha256": ckpt.name,
                                                 PRIMARY_METRIC: scored.get(PRIMARY_METRIC)},
                      key=f"lineage_arm:{key}:{arm.seed}")
    if any(not isinstance(m.get(PRIMARY_METRIC), (int, float)) for m in metrics):
        raise LineageFloorError(f"release {champ.get('release')}: its card has no test {PRIMARY_METRIC} to stand "
                                f"beside its lineage arms")
    floor = noise_floor_from_arms(key, PRIMARY_METRIC, metrics, info)
    tracker.log_metrics(run.run_id, {"noise_floor": floor.floor})
    tracker.end_run(run.run_id)
    return MeasuredNoiseFloor(floor=floor, benchmark_version=control.benchmark_version, recipe_hash=control.recipe_hash,
                              identity=identity, mlflow_run_id=run.run_id, mlflow_url=run.url, source=SOURCE_LINEAGE,
                              champion_checkpoint_sha256=champ.get("checkpoint_sha256"),
                              control_key=control.floor.key, making=provenance)


__all__ = ["LINEAGE_SEED_OFFSET", "LineageFloorError", "SOURCE_CONTROL", "SOURCE_LINEAGE", "champion_is_control_arm",
           "champion_making", "current_gating_floor", "gating_floor_error", "lineage_floor_key", "lineage_path",
           "measure_champion_noise_floor"]
