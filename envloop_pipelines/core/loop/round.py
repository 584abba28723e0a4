"""One round of the loop, as plain functions the Dagster assets call one each.

``baseline_eval → failure_mining → environment_synthesis → registered_hypothesis
→ training_dataset_snapshot → lora_checkpoint → independent_reeval →
promotion_decision``, plus the unpartitioned ``task_benchmark`` and
``noise_floor``. Every step reads what the previous steps wrote under
``<home>/loops/<task>/rounds/<round>/`` and writes its own outputs there
atomically; large artifacts (snapshots, checkpoints) are content-addressed
under ``<home>/artifacts/`` and never overwritten, so a step re-run after a
crash finds or recreates exactly the same files.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from envloop_pipelines.core.loop.contamination import check_contamination
from envloop_pipelines.core.loop.ledger import Gate, Hypothesis, Ledger, LedgerError
from envloop_pipelines.core.loop.mining import (
    FailureCluster,
    mine_failures_with_fallback,
)
from envloop_pipelines.core.loop.promotion import (
    NoiseFloor,
    PromotionDecision,
    check_arm_identity,
    decide_promotion,
    noise_floor_from_arms,
)
from envloop_pipelines.core.loop.synthesis import (
    SNAPSHOT_SCHEMA,
    SynthesisRequest,
    load_generator,
    with_provenance,
)
from envloop_pipelines.core.data.snapshots import (
    TaskSnapshot,
    open_task,
    require_same_benchmark,
)
from envloop_pipelines.core.storage import (
    atomic_write_bytes,
    atomic_write_json,
    canonical_json,
    envloop_home,
    publish_dir,
    sha256_bytes,
    sha256_file,
    staging_dir,
    sweep_stale,
)
from envloop_pipelines.core.tracking import MlflowTracker, TrackedRun

log = logging.getLogger(__name__)

ROUND_KEY_WIDTH = 4
PACKAGED_RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def round_key(n: int) -> str:
    return f"r{n:0{ROUND_KEY_WIDTH}d}"


def round_number(key: str) -> int:
    if not (key.startswith("r") and key[1:].isdigit()):
        raise ValueError(f"round key {key!r} must look like r0001")
    return int(key[1:])


def resolve_recipe_path(spec: str) -> Path:
    """``packaged:<file>`` (a shipped recipe) or a path."""
    if spec.startswith("packaged:"):
        path = PACKAGED_RECIPES / spec.split(":", 1)[1]
    else:
        path = Path(spec)
    if not path.exists():
        shipped = ", ".join(f"packaged:{p.name}" for p in sorted(PACKAGED_RECIPES.glob("*.yaml")))
        raise FileNotFoundError(f"recipe {spec!r} not found; shipped recipes: {shipped}")
    return path


@dataclass(frozen=True)
class LoopConfig:
    """What a person chooses for a loop; everything else comes from the recipe file.

    Attributes:
        task: the task (its current snapshot is the benchmark).
        recipe: recipe file (``packaged:decision_head_cpu.yaml`` or a path).
        recipe_overrides: recipe fields to override (for example a step budget for a demo).
        noise_arms: K null arms of the noise floor.
        top_clusters: failure clusters a round targets.
        n_synthesized: new training examples per round.
        generator: environment generator (``builtin_targeted`` for the built-in benchmark,
            ``label_preserving_variants`` for imported data, or ``module:attribute``).
        safety_families: families whose false-negative rate is guarded.
        contamination_policy: ``remove`` drops flagged synthesized rows; ``refuse`` keeps them so the
            blocking check refuses the snapshot.
        builtin_users / builtin_records_per_user: size of the built-in benchmark when it is generated.
        home: the EnvLoop home (default ``$ENVLOOP_HOME`` or ``./.envloop``).
    """

    task: str = "personal_agent"
    recipe: str = "packaged:decision_head_cpu.yaml"
    recipe_overrides: Mapping[str, Any] = field(default_factory=dict)
    noise_arms: int = 3
    top_clusters: int = 4
    n_synthesized: int = 120
    generator: str = "builtin_targeted"
    safety_families: tuple[str, ...] = ("needs_approval",)
    contamination_policy: str = "remove"
    builtin_users: int | None = None
    builtin_records_per_user: int | None = None
    home: str | None = None

    def __post_init__(self) -> None:
        if self.noise_arms < 2:
            raise ValueError(f"noise_arms must be ≥ 2 (a spread needs two arms), got {self.noise_arms}")
        if self.contamination_policy not in ("remove", "refuse"):
            raise ValueError(f"contamination_policy must be 'remove' or 'refuse', got {self.contamination_policy!r}")
        if self.top_clusters < 1 or self.n_synthesized < 0:
            raise ValueError("top_clusters must be ≥ 1 and n_synthesized ≥ 0")

    def load_recipe(self) -> Any:
        from envloop_pipelines.core.model.recipe import load_recipe

        recipe = load_recipe(resolve_recipe_path(self.recipe))
        return recipe.replace(**dict(self.recipe_overrides)) if self.recipe_overrides else recipe

    def recipe_hash(self) -> str:
        from envloop_pipelines.core.model.recipe import recipe_hash

        return recipe_hash(self.load_recipe())

    @property
    def model_name(self) -> str:
        return f"envloop-{self.task}"


class RoundPaths:
    """Where a loop's files live."""

    def __init__(self, config: LoopConfig) -> None:
        self.home = envloop_home(config.home)
        self.loop = self.home / "loops" / config.task
        self.checkpoints = self.home / "artifacts" / "checkpoints"
        self.snapshots = self.home / "artifacts" / "snapshots"
        self.noise = self.loop / "noise"

    def round_dir(self, key: str) -> Path:
        path = self.loop / "rounds" / key
        path.mkdir(parents=True, exist_ok=True)
        return path


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def _require(path: Path, step: str) -> Any:
    if not path.exists():
        raise LedgerError(f"{path} is missing: materialize {step} first")
    return _read_json(path)


# --------------------------------------------------------------------------- task and tracking


def ensure_task_benchmark(config: LoopConfig) -> TaskSnapshot:
    """The task's snapshot; the built-in benchmark is generated on first use."""
    try:
        return open_task(config.task, home=config.home)
    except FileNotFoundError:
        if config.generator != "builtin_targeted":
            raise
    from envloop_pipelines.core.data.datasets import generate_builtin_task

    generate_builtin_task(task=config.task, n_users=config.builtin_users,
                          records_per_user=config.builtin_records_per_user, home=config.home)
    return open_task(config.task, home=config.home)


def round_run(tracker: MlflowTracker, config: LoopConfig, key: str, tags: Mapping[str, str] | None = None) -> TrackedRun:
    """The round's parent MLflow run (found again on a retry)."""
    found = tracker.find_run(config.task, {"envloop.round": key, "envloop.kind": "round"})
    if found is not None:
        return found
    return tracker.start_run(config.task, f"round {key}", tags={"envloop.round": key, "envloop.kind": "round",
                                                                  **(tags or {})})


def child_run(tracker: MlflowTracker, config: LoopConfig, key: str, kind: str,
              tags: Mapping[str, str] | None = None) -> TrackedRun:
    """A fresh child run of the round's parent run.

    A step that died mid-way (its worker killed) left its run RUNNING; the retry closes it as
    KILLED, tagged ``envloop.superseded_by``, so each step of a round has one finished run.
    """
    parent = round_run(tracker, config, key, tags)
    for stale in tracker.running_runs(config.task, {"envloop.round": key, "envloop.kind": kind}):
        tracker.set_tags(stale, {"envloop.superseded": "a retry of the step started a new run"})
        tracker.end_run(stale, "KILLED")
        log.warning("round %s: closed the %s run %s left RUNNING by a dead worker", key, kind, stale)
    return tracker.start_run(config.task, f"{key} {kind}", parent_run_id=parent.run_id,
                             tags={"envloop.round": key, "envloop.kind": kind, **(tags or {})})


# --------------------------------------------------------------------------- model helpers


def _questions(table: pa.Table) -> list[Any]:
    from envloop_pipelines.core.model.readout import questions_from_table

    return questions_from_table(table)


def predict_table(checkpoint: Path, table: pa.Table) -> pa.Table:
    """The checkpoint's calibrated predictions on a question table (inputs only are needed)."""
    from envloop_pipelines.core.model.predict import DecisionModel, predictions_table

    model = DecisionModel.load(checkpoint)
    return predictions_table(model.predict(_questions(table)))


def write_table(path: Path, table: pa.Table) -> Path:
    import io

    sink = io.BytesIO()
    pq.write_table(table, sink, compression="zstd")
    atomic_write_bytes(path, sink.getvalue(), overwrite=True)
    return path


def train_into_store(paths: RoundPaths, train: pa.Table, val: pa.Table, recipe: Any, *, data_hash: str,
                     init_from: Path | None = None) -> Path:
    """Train a checkpoint in a staging directory and publish it under its content hash.

    A crash mid-training leaves only a staging directory (never read); a retry
    trains again and, being deterministic, publishes the same hash.
    """
    from envloop_pipelines.core.model.checkpoint import checkpoint_hash
    from envloop_pipelines.core.model.training import train_checkpoint

    staged = staging_dir(paths.checkpoints)
    ckpt = train_checkpoint(train, val, recipe, staged / "checkpoint", data_hash=data_hash, init_from=init_from)
    digest = checkpoint_hash(ckpt)
    final = paths.checkpoints / digest
    if final.exists():
        shutil.rmtree(staged, ignore_errors=True)
        return final
    publish_dir(ckpt, final)
    shutil.rmtree(staged, ignore_errors=True)
    return final


def rescore_matches(checkpoint: str | Path, table: pa.Table) -> dict[str, Any]:
    """Re-score a checkpoint from disk on its eval questions and compare with its end-of-training predictions."""
    saved = pq.read_table(Path(checkpoint) / "predictions.parquet").to_pylist()
    wanted = {(r["record_id"], r["question_id"]) for r in saved}
    rows = [i for i, (r, q) in enumerate(zip(table.column("record_id").to_pylist(), table.column("question_id").to_pylist()))
            if (r, q) in wanted]
    fresh = {(p["record_id"], p["question_id"]): p["probs"]
             for p in predict_table(Path(checkpoint), table.take(pa.array(rows, pa.int64()))).to_pylist()}
    diffs = [float(np.max(np.abs(np.asarray(fresh[(r["record_id"], r["question_id"])]) - np.asarray(r["probs"]))))
             if (r["record_id"], r["question_id"]) in fresh else float("inf") for r in saved]
    identical = all(fresh.get((r["record_id"], r["question_id"])) == r["probs"] for r in saved)
    return {"identical": identical, "n_questions": len(saved), "max_abs_diff": max(diffs) if diffs else 0.0}


def open_metrics(table: pa.Table, predictions: pa.Table, safety_families: Sequence[str]) -> dict[str, Any]:
    """Metrics on an open split (train/val/dev), where the training side holds the labels."""
    from envloop_pipelines.core.model.predict import (
        predictions_from_table,
        score_predictions,
    )

    return score_predictions(predictions_from_table(predictions), _questions(table), safety_families=safety_families)


def verify_predictions(config: LoopConfig, split: str, predictions: Path, baseline: Path | None = None,
                       seed: int = 0) -> Any:
    """Score predictions on a hidden split in the sandboxed verifier (a separate process)."""
    from envloop_pipelines.core.verify.runner import verify_task

    run = verify_task(config.task, split, predictions, home=config.home, safety_families=config.safety_families,
                      baseline_predictions=baseline, seed=seed)
    if not run.ok:
        raise RuntimeError(f"verifier on {split} failed ({run.status}): {run.error}; "
                           f"worker stderr: {run.sandbox.stderr_tail[-1000:]!r}")
    return run


# --------------------------------------------------------------------------- noise floor and the first champion


def noise_floor_key(snapshot: TaskSnapshot, config: LoopConfig) -> str:
    return sha256_bytes(canonical_json({"benchmark": snapshot.benchmark_version, "recipe": config.recipe_hash(),
                                        "arms": config.noise_arms}))[:16]


def measure_noise_floor(config: LoopConfig, tracker: MlflowTracker, *, run_tags: Mapping[str, str] | None = None) -> dict[str, Any]:
    """K null arms of the control recipe on the base data, scored on test by the verifier.

    Cached per (benchmark version, recipe, K). When the loop has no champion
    yet, the control arm (the recipe's own seed) becomes release 1.
    """
    from envloop_pipelines.core.model.recipe import recipe_to_dict

    snapshot = ensure_task_benchmark(config)
    paths = RoundPaths(config)
    key = noise_floor_key(snapshot, config)
    cache = paths.noise / f"{key}.json"
    ledger = Ledger(config.task, config.home)
    if cache.exists():
        result = _read_json(cache)
        result["cached"] = True
    else:
        recipe = config.load_recipe()
        arms = [recipe.replace(seed=recipe.seed + i) for i in range(config.noise_arms)]
        identity = check_arm_identity([(recipe_to_dict(a), snapshot.snapshot_id) for a in arms])
        train, val, test = snapshot.table("train"), snapshot.table("val"), snapshot.table("test")
        parent = tracker.start_run(config.task, f"noise floor {key}", tags={"envloop.kind": "noise_floor",
                                                                           "envloop.noise_key": key, **(run_tags or {})})
        tracker.log_params(parent.run_id, {"arms": config.noise_arms, "benchmark_version": snapshot.benchmark_version,
                                           "recipe_hash": config.recipe_hash(), "identity": identity})
        arm_metrics, arm_info = [], []
        for arm in arms:
            started = time.perf_counter()
            ckpt = train_into_store(paths, train, val, arm, data_hash=snapshot.snapshot_id)
            preds_path = write_table(paths.noise / key / f"arm-seed{arm.seed}-test.parquet", predict_table(ckpt, test))
            run = verify_predictions(config, "test", preds_path)
            metrics = dict(run.report.metrics)
            child = tracker.start_run(config.task, f"null arm seed {arm.seed}", parent_run_id=parent.run_id,
                                      tags={"envloop.kind": "null_arm", "envloop.noise_key": key})
            tracker.log_params(child.run_id, {"seed": arm.seed, "checkpoint": ckpt.name})
            tracker.log_metrics(child.run_id, {k: v for k, v in metrics.items() if isinstance(v, (int, float))})
            tracker.end_run(child.run_id)
            arm_metrics.append(metrics)
            arm_info.append({"seed": arm.seed, "checkpoint": str(ckpt), "checkpoint_sha256": ckpt.name,
                             "test_predictions": str(preds_path), "train_s": round(time.perf_counter() - started, 2),
                             "verifier_pid": run.worker_pid, "metrics": metrics})
            ledger.append("null_arm", {"noise_key": key, "seed": arm.seed, "checkpoint_sha256": ckpt.name,
                                       "family_macro_accuracy": metrics.get("family_macro_accuracy")},
                          key=f"null_arm:{key}:{arm.seed}")
        floor = noise_floor_from_arms(key, "family_macro_accuracy", arm_metrics, arm_info)
        tracker.log_metrics(parent.run_id, {"noise_floor": floor.floor})
        tracker.end_run(parent.run_id)
        result = {**floor.to_dict(), "benchmark_version": snapshot.benchmark_version,
                  "recipe_hash": config.recipe_hash(), "identity": identity, "mlflow_run_id": parent.run_id,
                  "mlflow_url": parent.url}
        atomic_write_json(cache, result, overwrite=True)
        result["cached"] = False
    if not ledger.releases():
        _release_bootstrap_champion(config, tracker, result, snapshot)
    return result


def current_noise_floor(config: LoopConfig) -> NoiseFloor:
    snapshot = open_task(config.task, home=config.home)
    cache = RoundPaths(config).noise / f"{noise_floor_key(snapshot, config)}.json"
    return NoiseFloor.from_dict(_require(cache, "noise_floor"))


def champion(config: LoopConfig) -> dict[str, Any]:
    """The latest release card (the champion)."""
    releases = Ledger(config.task, config.home).releases()
    if not releases:
        raise LedgerError(f"task {config.task!r} has no champion yet: materialize noise_floor first")
    return releases[-1]


def _holdout_metrics(config: LoopConfig, checkpoint: Path, snapshot: TaskSnapshot, out: Path) -> dict[str, Any]:
    preds = write_table(out, predict_table(checkpoint, snapshot.table("holdout")))
    return dict(verify_predictions(config, "holdout", preds).report.metrics)


def _release_bootstrap_champion(config: LoopConfig, tracker: MlflowTracker, floor: Mapping[str, Any],
                                snapshot: TaskSnapshot) -> None:
    ledger = Ledger(config.task, config.home)
    control = floor["arms"][0]
    release = ledger.next_release_number()
    ckpt = Path(control["checkpoint"])
    holdout = ledger.read_holdout_once(
        release, lambda: _holdout_metrics(config, ckpt, snapshot, RoundPaths(config).noise / f"release{release}-holdout.parquet"))
    run = tracker.start_run(config.task, f"release {release} (bootstrap)", tags={"envloop.kind": "release",
                                                                                 "envloop.release": str(release)})
    tracker.log_metrics(run.run_id, {f"holdout_{k}": v for k, v in holdout.items() if isinstance(v, (int, float))})
    tracker.log_artifact(run.run_id, ckpt, "checkpoint")
    version = tracker.register_version(config.model_name, f"{tracker.client.get_run(run.run_id).info.artifact_uri}/checkpoint",
                                       run.run_id, tags={"envloop.release": str(release), "envloop.checkpoint_sha256": ckpt.name})
    tracker.set_champion(config.model_name, version)
    tracker.end_run(run.run_id)
    card = {
        "release": release, "round": "bootstrap", "task": config.task, "parent_release": None,
        "benchmark_version": snapshot.benchmark_version, "data_snapshot": snapshot.snapshot_id,
        "recipe_hash": floor["recipe_hash"], "checkpoint_dir": str(ckpt), "checkpoint_sha256": ckpt.name,
        "model_version": version, "holdout": holdout, "test": control["metrics"],
        "gate": "bootstrap: the control arm of the noise floor; no parent to beat",
        "noise_floor": floor["floor"], "paired_deltas": None, "guards": None, "amendments": [],
        "limitations": ["The first champion is the control recipe on the base data; it passed no gate."],
        "mlflow_run_id": run.run_id,
    }
    ledger.write_release_card(release, card, render_card(card))


# --------------------------------------------------------------------------- the round's steps


def baseline_eval(config: LoopConfig, key: str) -> dict[str, Any]:
    """The champion on dev: per-question predictions and metrics."""
    snapshot = open_task(config.task, home=config.home)
    champ = champion(config)
    require_same_benchmark(champ["benchmark_version"], snapshot.benchmark_version)
    dev = snapshot.table("dev")
    d = RoundPaths(config).round_dir(key)
    preds = write_table(d / "dev_predictions.parquet", predict_table(Path(champ["checkpoint_dir"]), dev))
    metrics = open_metrics(dev, pq.read_table(preds), config.safety_families)
    result = {"round": key, "champion_release": champ["release"], "checkpoint_sha256": champ["checkpoint_sha256"],
              "benchmark_version": snapshot.benchmark_version, "metrics": metrics,
              "predictions": str(preds), "automation_threshold": _threshold(Path(champ["checkpoint_dir"]))}
    atomic_write_json(d / "baseline_eval.json", result, overwrite=True)
    return result


def _threshold(checkpoint: Path) -> float:
    cal = _read_json(checkpoint / "calibration.json")
    value = cal.get("automation_threshold")
    return float("inf") if value is None else float(value)


def failure_mining(config: LoopConfig, key: str) -> dict[str, Any]:
    """Cluster the champion's dev errors."""
    d = RoundPaths(config).round_dir(key)
    base = _require(d / "baseline_eval.json", "baseline_eval")
    dev = open_task(config.task, home=config.home).table("dev")
    report = mine_failures_with_fallback(dev, pq.read_table(base["predictions"]), threshold=base["automation_threshold"])
    result = {"round": key, **report.to_dict()}
    atomic_write_json(d / "failure_mining.json", result, overwrite=True)
    return result


def _clusters(mined: Mapping[str, Any], k: int) -> tuple[FailureCluster, ...]:
    out = []
    for c in mined["clusters"][:k]:
        out.append(FailureCluster(key=c["key"], n=c["n"], errors=c["errors"], confident_errors=c["confident_errors"],
                                  error_rate=c["error_rate"], excess_errors=c["excess_errors"],
                                  example_ids=tuple(c["example_ids"])))
    return tuple(out)


def environment_synthesis(config: LoopConfig, key: str) -> dict[str, Any]:
    """New training rows aimed at the top clusters, each with provenance to its cluster."""
    d = RoundPaths(config).round_dir(key)
    mined = _require(d / "failure_mining.json", "failure_mining")
    snapshot = open_task(config.task, home=config.home)
    clusters = _clusters(mined, config.top_clusters)
    kwargs: dict[str, Any] = {}
    if config.generator == "builtin_targeted":
        from envloop_pipelines.core.benchmark import BenchmarkConfig

        gen_cfg = snapshot.manifest.extra.get("generator", {})
        kwargs["benchmark_config"] = BenchmarkConfig(seed=int(gen_cfg.get("seed", 0)))
    generator = load_generator(config.generator, **kwargs)
    request = SynthesisRequest(round=key, clusters=clusters, n_examples=config.n_synthesized,
                               seed=round_number(key))
    table = generator.synthesize(request, snapshot.table("train")) if clusters else SNAPSHOT_SCHEMA.empty_table()
    path = write_table(d / "synthesized.parquet", table)
    per_cluster: dict[str, int] = {}
    for p in table.column("provenance").to_pylist():
        name = json.loads(p)["cluster"]
        per_cluster[name] = per_cluster.get(name, 0) + 1
    result = {"round": key, "generator": getattr(generator, "name", config.generator), "n_rows": table.num_rows,
              "per_cluster": per_cluster, "clusters": [c.name for c in clusters], "path": str(path),
              "sha256": sha256_file(path)}
    atomic_write_json(d / "environment_synthesis.json", result, overwrite=True)
    return result


def _past_deltas(ledger: Ledger) -> list[float]:
    return [e["observed_delta"] for e in ledger.events("round_decided") if e.get("observed_delta") is not None]


def registered_hypothesis(config: LoopConfig, key: str, tracker: MlflowTracker, *,
                          proposal: Mapping[str, Any] | None = None, run_tags: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Write the round's hypothesis to MLflow and the ledger before any training.

    ``proposal`` (from a person, as run config) may set ``change``, ``predicted_delta``,
    ``gate`` (``Gate`` fields), ``seeds`` and ``rationale``; anything not given is derived
    from the mined failures and past rounds.
    """
    d = RoundPaths(config).round_dir(key)
    synth = _require(d / "environment_synthesis.json", "environment_synthesis")
    snapshot = open_task(config.task, home=config.home)
    ledger = Ledger(config.task, config.home)
    recipe = config.load_recipe()
    proposal = dict(proposal or {})
    past = _past_deltas(ledger)
    # Predicted delta: the mean observed gain of past rounds, or a modest +0.01 for the first.
    predicted = float(proposal.get("predicted_delta", np.mean(past) if past else 0.01))
    hypothesis = Hypothesis(
        task=config.task,
        round=key,
        benchmark_version=snapshot.benchmark_version,
        change=proposal.get("change") or {"kind": "data", "generator": synth["generator"], "clusters": synth["clusters"],
                                          "n_new_examples": synth["n_rows"], "synthesis_sha256": synth["sha256"],
                                          "loop_recipe_overrides": dict(config.recipe_overrides)},
        predicted_delta=predicted,
        gate=Gate(**proposal.get("gate", {})),
        seeds=tuple(proposal.get("seeds") or (recipe.seed + 1000 + round_number(key),)),
        recipe_hash=config.recipe_hash(),
        author="person" if proposal else "auto",
        rationale=proposal.get("rationale", f"target the top {len(synth['clusters'])} failure clusters of the champion on dev"),
    )
    existing = ledger.hypothesis(key)
    if existing is not None:
        hypothesis = existing  # immutable: a retry reuses what was registered
    digest = ledger.register_hypothesis(hypothesis)
    run = tracker.find_run(config.task, {"envloop.round": key, "envloop.kind": "hypothesis"})
    if run is None:
        run = child_run(tracker, config, key, "hypothesis", {**(run_tags or {}), "envloop.hypothesis_hash": digest})
        tracker.log_params(run.run_id, {"hash": digest, "predicted_delta": hypothesis.predicted_delta,
                                        "primary_metric": hypothesis.gate.primary_metric,
                                        "direction": hypothesis.gate.direction, "min_delta": hypothesis.gate.min_delta,
                                        "seeds": list(hypothesis.seeds), "author": hypothesis.author,
                                        "change": json.dumps(dict(hypothesis.change), sort_keys=True)})
        hyp_file = d / "hypothesis.json"
        atomic_write_json(hyp_file, {**hypothesis.to_dict(), "hash": digest}, overwrite=True)
        tracker.log_artifact(run.run_id, hyp_file)
        tracker.end_run(run.run_id)
    result = {"round": key, "hash": digest, **hypothesis.to_dict(), "mlflow_run_id": run.run_id, "mlflow_url": run.url}
    return result


def training_dataset_snapshot(config: LoopConfig, key: str) -> dict[str, Any]:
    """Base train + synthesized rows as content-addressed Parquet, checked for contamination."""
    paths = RoundPaths(config)
    d = paths.round_dir(key)
    synth_info = _require(d / "environment_synthesis.json", "environment_synthesis")
    snapshot = open_task(config.task, home=config.home)
    base = with_provenance(snapshot.table("train"), json.dumps({"kind": "base", "snapshot": snapshot.snapshot_id}))
    synth = pq.read_table(synth_info["path"])
    reference = []
    for split in ("test", "holdout"):
        t = snapshot.table(split)
        reference += [(f"{split}/{r}", s) for r, s in zip(t.column("record_id").to_pylist(), t.column("state_text").to_pylist())]
    synth_report = check_contamination(list(zip(synth.column("record_id").to_pylist(), synth.column("state_text").to_pylist())),
                                       reference)
    removed = sorted(synth_report.flagged_rows) if config.contamination_policy == "remove" else []
    if removed:
        keep = [i for i in range(synth.num_rows) if i not in set(removed)]
        synth = synth.take(pa.array(keep, pa.int64()))
    table = pa.concat_tables([base, synth.cast(SNAPSHOT_SCHEMA)])
    final_report = check_contamination(list(zip(table.column("record_id").to_pylist(), table.column("state_text").to_pylist())),
                                       reference)
    import io

    sink = io.BytesIO()
    pq.write_table(table, sink, compression="zstd")
    data = sink.getvalue()
    digest = sha256_bytes(data)
    sweep_stale(paths.snapshots)  # temp files of a writer that was killed mid-write
    path = paths.snapshots / f"{digest}.parquet"
    if not path.exists():
        atomic_write_bytes(path, data)
    report = {"synthesized": synth_report.to_dict(), "removed_rows": removed, "final": final_report.to_dict(),
              "policy": config.contamination_policy}
    atomic_write_json(paths.snapshots / f"{digest}.contamination.json", report, overwrite=True)
    result = {"round": key, "sha256": digest, "path": str(path), "n_rows": table.num_rows, "n_base": base.num_rows,
              "n_synthesized": synth.num_rows, "n_removed": len(removed), "contamination": final_report.to_dict(),
              "schema_ok": table.schema.equals(SNAPSHOT_SCHEMA), "benchmark_version": snapshot.benchmark_version}
    atomic_write_json(d / "training_dataset_snapshot.json", result, overwrite=True)
    return result


def snapshot_problems(result: Mapping[str, Any]) -> list[str]:
    """Why a training snapshot must not be used (empty when it is fine)."""
    problems = []
    if not result.get("schema_ok"):
        problems.append("schema differs from SNAPSHOT_SCHEMA")
    if not result["contamination"]["clean"]:
        problems.append(f"{result['contamination']['n_flagged']} rows overlap test/holdout")
    return problems


def lora_checkpoint(config: LoopConfig, key: str, tracker: MlflowTracker, *, run_tags: Mapping[str, str] | None = None) -> dict[str, Any]:
    """LoRA SFT from the champion on the round's snapshot; refuses without a registered hypothesis."""
    from envloop_pipelines.core.model.recipe import recipe_to_dict

    ledger = Ledger(config.task, config.home)
    hypothesis = ledger.require_hypothesis(key)  # rule 1: no hypothesis, no training
    paths = RoundPaths(config)
    d = paths.round_dir(key)
    if tracker.find_run(config.task, {"envloop.round": key, "envloop.kind": "hypothesis"}) is None:
        raise LedgerError(f"round {key}: the hypothesis is not in MLflow; training refuses to start")
    snap = _require(d / "training_dataset_snapshot.json", "training_dataset_snapshot")
    problems = snapshot_problems(snap)
    if problems:
        raise LedgerError(f"round {key}: training snapshot {snap['sha256'][:12]} refused: {'; '.join(problems)}")
    snapshot = open_task(config.task, home=config.home)
    require_same_benchmark(hypothesis.benchmark_version, snapshot.benchmark_version)
    champ = champion(config)
    # The hypothesis may change the recipe (a recipe diff is a hypothesis too); the seed is the registered one.
    recipe = config.load_recipe().replace(**dict(hypothesis.change.get("recipe_overrides") or {}), seed=hypothesis.seeds[0])
    run = child_run(tracker, config, key, "training", {**(run_tags or {}), "envloop.hypothesis_hash": hypothesis.hash})
    tracker.log_params(run.run_id, {**{f"recipe.{k}": v for k, v in recipe_to_dict(recipe).items()},
                                    "snapshot_sha256": snap["sha256"], "init_from": champ["checkpoint_sha256"],
                                    "hypothesis_hash": hypothesis.hash})
    started = time.perf_counter()
    train = pq.read_table(snap["path"]).drop_columns(["provenance"])
    ckpt = train_into_store(paths, train, snapshot.table("val"), recipe, data_hash=snap["sha256"],
                            init_from=Path(champ["checkpoint_dir"]))
    train_s = time.perf_counter() - started
    train_metrics = _read_json(ckpt / "metrics.json")
    tracker.log_metrics(run.run_id, {k: v for k, v in _flat(train_metrics).items()})
    tracker.log_artifact(run.run_id, ckpt, "checkpoint")
    tracker.end_run(run.run_id)
    result = {"round": key, "checkpoint": str(ckpt), "checkpoint_sha256": ckpt.name, "init_from": champ["checkpoint_sha256"],
              "snapshot_sha256": snap["sha256"], "seed": recipe.seed, "train_s": round(train_s, 2),
              "metrics": train_metrics, "mlflow_run_id": run.run_id, "mlflow_url": run.url}
    atomic_write_json(d / "lora_checkpoint.json", result, overwrite=True)
    ledger.append("arm_trained", {"round": key, "checkpoint_sha256": ckpt.name, "seed": recipe.seed,
                                  "hypothesis_hash": hypothesis.hash}, key=f"arm:{key}:{ckpt.name}")
    return result


def _flat(d: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    out: dict[str, float] = {}
    for k, v in d.items():
        name = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(_flat(v, name + "."))
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and np.isfinite(v):
            out[name.replace("/", ".")] = float(v)
    return out


def independent_reeval(config: LoopConfig, key: str, tracker: MlflowTracker, *, run_tags: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Candidate vs champion on the hidden test set through the sandboxed verifier, with the classical baseline."""
    from envloop_pipelines.core.baseline import TfidfBaseline

    d = RoundPaths(config).round_dir(key)
    cand = _require(d / "lora_checkpoint.json", "lora_checkpoint")
    snap = _require(d / "training_dataset_snapshot.json", "training_dataset_snapshot")
    snapshot = open_task(config.task, home=config.home)
    champ = champion(config)
    test = snapshot.table("test")
    cand_preds = write_table(d / "candidate_test_predictions.parquet", predict_table(Path(cand["checkpoint"]), test))
    champ_preds = write_table(d / "champion_test_predictions.parquet", predict_table(Path(champ["checkpoint_dir"]), test))
    run = verify_predictions(config, "test", cand_preds, baseline=champ_preds, seed=round_number(key))
    train = pq.read_table(snap["path"]).drop_columns(["provenance"])
    tfidf = TfidfBaseline().fit(train, snapshot.table("val"))
    tfidf_preds = write_table(d / "tfidf_test_predictions.parquet", tfidf.predict_table(test))
    tfidf_run = verify_predictions(config, "test", tfidf_preds)
    result = {
        "round": key,
        "benchmark_version": snapshot.benchmark_version,
        "candidate": dict(run.report.metrics),
        "champion": dict(run.baseline_report.metrics),
        "tfidf_baseline": dict(tfidf_run.report.metrics),
        "paired": run.paired,
        "complete": run.report.complete and run.baseline_report.complete,
        "verifier_pid": run.worker_pid,
        "verifier": {"network_isolated": run.sandbox.network_isolated,
                     "hidden_paths_masked": run.sandbox.hidden_paths_masked, "backend": run.sandbox.backend},
        "candidate_checkpoint_sha256": cand["checkpoint_sha256"],
        "champion_checkpoint_sha256": champ["checkpoint_sha256"],
    }
    mrun = child_run(tracker, config, key, "evaluation", run_tags)
    tracker.log_metrics(mrun.run_id, {**{f"candidate.{k}": v for k, v in _flat(result["candidate"]).items()},
                                      **{f"champion.{k}": v for k, v in _flat(result["champion"]).items()},
                                      **{f"tfidf.{k}": v for k, v in _flat(result["tfidf_baseline"]).items()},
                                      **{f"delta.{k}": v["delta"] for k, v in run.paired["deltas"].items()
                                         if v["delta"] is not None}})
    atomic_write_json(d / "independent_reeval.json", result, overwrite=True)
    tracker.log_artifact(mrun.run_id, d / "independent_reeval.json")
    tracker.log_artifact(mrun.run_id, cand_preds, "predictions")
    tracker.end_run(mrun.run_id)
    result["mlflow_run_id"], result["mlflow_url"] = mrun.run_id, mrun.url
    atomic_write_json(d / "independent_reeval.json", result, overwrite=True)
    return result


def promotion_decision(config: LoopConfig, key: str, tracker: MlflowTracker, *, run_tags: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Apply the registered gate; on promotion read the holdout once, append a release card and move the alias."""
    d = RoundPaths(config).round_dir(key)
    existing = d / "promotion_decision.json"
    if existing.exists():
        return _read_json(existing)  # decided once; a retry reports the same decision
    ledger = Ledger(config.task, config.home)
    hypothesis = ledger.require_hypothesis(key)
    gate = ledger.effective_gate(key)
    reeval = _require(d / "independent_reeval.json", "independent_reeval")
    cand = _require(d / "lora_checkpoint.json", "lora_checkpoint")
    snap = _require(d / "training_dataset_snapshot.json", "training_dataset_snapshot")
    floor = current_noise_floor(config)
    champ = champion(config)
    require_same_benchmark(reeval["benchmark_version"], hypothesis.benchmark_version, champ["benchmark_version"])
    delta = reeval["paired"]["deltas"][gate.primary_metric]
    decision: PromotionDecision = decide_promotion(gate, delta, floor, reeval["candidate"], reeval["champion"],
                                                   config.safety_families)
    result: dict[str, Any] = {"round": key, **decision.to_dict(), "delta": delta, "noise_floor": floor.floor,
                              "hypothesis_hash": hypothesis.hash, "predicted_delta": hypothesis.predicted_delta,
                              "gate": gate.__dict__, "release": None}
    if decision.promote:
        snapshot = open_task(config.task, home=config.home)
        release = ledger.next_release_number()
        ckpt = Path(cand["checkpoint"])
        holdout = ledger.read_holdout_once(
            release, lambda: _holdout_metrics(config, ckpt, snapshot, d / "candidate_holdout_predictions.parquet"))
        mrun = child_run(tracker, config, key, "release", run_tags)
        tracker.log_artifact(mrun.run_id, ckpt, "checkpoint")
        version = tracker.register_version(
            config.model_name, f"{tracker.client.get_run(mrun.run_id).info.artifact_uri}/checkpoint", mrun.run_id,
            tags={"envloop.release": str(release), "envloop.round": key, "envloop.checkpoint_sha256": ckpt.name})
        tracker.set_champion(config.model_name, version)
        tracker.log_metrics(mrun.run_id, {f"holdout.{k}": v for k, v in _flat(holdout).items()})
        tracker.end_run(mrun.run_id)
        card = {
            "release": release, "round": key, "task": config.task, "parent_release": champ["release"],
            "benchmark_version": snapshot.benchmark_version, "data_snapshot": snap["sha256"],
            "recipe_hash": hypothesis.recipe_hash, "checkpoint_dir": str(ckpt), "checkpoint_sha256": ckpt.name,
            "parent_checkpoint_sha256": champ["checkpoint_sha256"], "model_version": version,
            "holdout": holdout, "test": reeval["candidate"], "parent_test": reeval["champion"],
            "tfidf_baseline_test": reeval["tfidf_baseline"], "paired_deltas": reeval["paired"]["deltas"],
            "gate": hypothesis.gate.__dict__, "effective_gate": gate.__dict__,
            "amendments": ledger.amendments(key), "noise_floor": floor.floor, "guards": decision.checks,
            "hypothesis_hash": hypothesis.hash, "predicted_delta": hypothesis.predicted_delta,
            "limitations": [
                "Test and holdout users are unseen during training; half of them use a second renderer.",
                "The noise floor measures seed variance of the control recipe trained from the base model.",
            ],
            "mlflow_run_id": mrun.run_id,
        }
        ledger.write_release_card(release, card, render_card(card))
        result["release"] = release
        result["model_version"] = version
    else:
        ledger.append("candidate_rejected", {"round": key, "reasons": list(decision.reasons), "delta": delta,
                                             "noise_floor": floor.floor, "checkpoint_sha256": cand["checkpoint_sha256"],
                                             "candidate": reeval["candidate"], "champion": reeval["champion"]},
                      key=f"rejected:{key}")
        ledger.append("hypothesis_refuted", {"round": key, "hash": hypothesis.hash}, key=f"refuted:{key}")
    ledger.append("round_decided", {"round": key, "promoted": decision.promote, "observed_delta": delta["delta"],
                                    "release": result["release"]}, key=f"decided:{key}")
    atomic_write_json(existing, result)
    return result


# --------------------------------------------------------------------------- cards


def _fmt(x: Any) -> str:
    if isinstance(x, float):
        return f"{x:.4f}"
    return "—" if x is None else str(x)


def render_card(card: Mapping[str, Any]) -> str:
    """The release card as Markdown: holdout first, then test beside the parent and the classical baseline."""
    lines = [f"# Release {card['release']} — {card['task']}", "",
             f"- round: `{card['round']}`  parent release: {_fmt(card.get('parent_release'))}",
             f"- benchmark: `{card['benchmark_version']}`  data snapshot: `{str(card['data_snapshot'])[:16]}`",
             f"- recipe: `{str(card['recipe_hash'])[:16]}`  checkpoint: `{str(card['checkpoint_sha256'])[:16]}`",
             f"- MLflow model version: {card.get('model_version')}", "", "## Holdout (read once)", "",
             "| metric | value |", "|---|---|"]
    for k, v in (card.get("holdout") or {}).items():
        if not k.startswith("acc/"):
            lines.append(f"| {k} | {_fmt(v)} |")
    lines += ["", "## Test", "", "| metric | release | parent | TF-IDF + LR |", "|---|---|---|---|"]
    parent, tfidf = card.get("parent_test") or {}, card.get("tfidf_baseline_test") or {}
    for k, v in (card.get("test") or {}).items():
        lines.append(f"| {k} | {_fmt(v)} | {_fmt(parent.get(k))} | {_fmt(tfidf.get(k))} |")
    if card.get("paired_deltas"):
        lines += ["", "## Paired deltas vs parent (record-clustered bootstrap, 95%)", "",
                  "| metric | delta | CI |", "|---|---|---|"]
        for k, v in card["paired_deltas"].items():
            lines.append(f"| {k} | {_fmt(v['delta'])} | [{_fmt(v['ci_low'])}, {_fmt(v['ci_high'])}] |")
    lines += ["", "## Gate", "", f"- registered: `{json.dumps(card.get('gate'), default=str)}`",
              f"- noise floor: {_fmt(card.get('noise_floor'))}"]
    for a in card.get("amendments") or []:
        lines.append(f"- amendment: `{json.dumps(a['amended_gate'])}` (original `{json.dumps(a['original_gate'])}`), reason: {a['reason']}")
    if card.get("guards"):
        lines += ["", "## Guards", "", f"```json\n{json.dumps(card['guards'], indent=2, default=str)}\n```"]
    lines += ["", "## Limitations", ""] + [f"- {x}" for x in card.get("limitations", [])]
    return "\n".join(lines) + "\n"
