"""The typed step values: JSON round trip through the round store, and the store's layout."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from envloop_pipelines.core.ledger.hypothesis import Gate, Hypothesis
from envloop_pipelines.core.loop.promotion import NoiseFloor, PromotionDecision
from envloop_pipelines.core.decision_loop.step_records import (
    STEP_RECORDS,
    BaselineEval,
    Benchmark,
    EnvironmentSynthesis,
    FailureMining,
    MeasuredNoiseFloor,
    Reevaluation,
    RegisteredHypothesis,
    RoundDecision,
    TrainedCheckpoint,
    TrainingSnapshot,
)
from envloop_pipelines.core.ledger.store import RoundStore

HYP = Hypothesis(task="t", round="r0001", benchmark_version="t@abc", change={"kind": "recipe", "recipe_diff": {"x": 1}},
                 predicted_delta=0.02, gate=Gate(min_delta=0.01), seeds=(1001,), recipe_hash="f" * 64, created_at=1.0)
FLOOR = NoiseFloor(key="k", metric="family_macro_accuracy", values=(0.5, 0.52), floor=0.02,
                   family_floors={"route": 0.03}, arms=({"seed": 0, "checkpoint": "/c"},))
SAMPLES = {
    "task_benchmark": Benchmark(task="t", snapshot_id="s", benchmark_version="t@abc", splits={"train": {"records": 3}}),
    "noise_floor": MeasuredNoiseFloor(floor=FLOOR, benchmark_version="t@abc", recipe_hash="f" * 64, identity="i",
                                      mlflow_run_id="m", mlflow_url="u"),
    "baseline_eval": BaselineEval(round="r0001", champion_release=1, checkpoint_sha256="c", checkpoint_dir="/c",
                                  benchmark_version="t@abc", metrics={"brier": 0.4}, predictions="/p",
                                  automation_threshold=math.inf),
    # The floor that gates the round over a champion a round made: its lineage floor (issue 45).
    "champion_noise_floor": MeasuredNoiseFloor(floor=FLOOR, benchmark_version="t@abc", recipe_hash="f" * 64,
                                               identity="i", mlflow_run_id="m", mlflow_url="u", source="lineage",
                                               champion_checkpoint_sha256="c", control_key="k0",
                                               making={"round": "r0000", "recipe_diff": {"max_steps": 300}}),
    "failure_mining": FailureMining(round="r0001", n_questions=10, n_errors=3, n_confident_errors=1, error_rate=0.3,
                                    threshold=None, clusters=({"key": {"family": "route"}, "n": 3},), by_family={}),
    "environment_synthesis": EnvironmentSynthesis(round="r0001", generator="g", n_rows=2, per_cluster={"a": 2},
                                                  clusters=("a",), path="/s", sha256="d"),
    "registered_hypothesis": RegisteredHypothesis(hypothesis=HYP, hash=HYP.hash, mlflow_run_id="m", mlflow_url="u"),
    "training_dataset_snapshot": TrainingSnapshot(round="r0001", sha256="d", path="/d", n_rows=5, n_base=3,
                                                  n_synthesized=2, n_removed=0,
                                                  contamination={"clean": True, "n_flagged": 0}, schema_ok=True,
                                                  benchmark_version="t@abc"),
    "lora_checkpoint": TrainedCheckpoint(round="r0001", checkpoint="/c2", checkpoint_sha256="c2", init_from="c",
                                         snapshot_sha256="d", seed=1001, train_s=1.5, metrics={"val": {"brier": 0.3}},
                                         mlflow_run_id="m", mlflow_url="u", hypothesis_hash=HYP.hash),
    "independent_reeval": Reevaluation(round="r0001", benchmark_version="t@abc", candidate={"ece": 0.01},
                                       champion={"ece": 0.02}, tfidf_baseline={}, paired={"deltas": {
                                           "family_macro_accuracy": {"delta": 0.03, "ci_low": 0.01, "ci_high": 0.05}}},
                                       complete=True, verifier_pid=7, verifier={"backend": "local"},
                                       candidate_checkpoint_sha256="c2", champion_checkpoint_sha256="c"),
    "promotion_decision": RoundDecision.of("r0001", PromotionDecision(True, ("cleared",), {"gain": 0.03}),
                                           delta={"delta": 0.03, "ci_low": 0.01, "ci_high": 0.05}, noise_floor=0.02,
                                           hypothesis=HYP, gate=HYP.gate),
}


def test_every_step_has_a_sample() -> None:
    assert set(SAMPLES) == set(STEP_RECORDS)


@pytest.mark.parametrize("step", sorted(SAMPLES))
def test_a_step_value_round_trips_through_the_store(step: str, tmp_path: Path) -> None:
    value = SAMPLES[step]
    assert isinstance(value, STEP_RECORDS[step])
    store = RoundStore("t", tmp_path)
    key = None if step in ("task_benchmark", "noise_floor") else "r0001"
    path = store.save(step, value, key)
    assert path == tmp_path / "loops" / "t" / ("rounds/r0001" if key else "") / f"{step}.json"
    json.loads(path.read_text())  # plain JSON a person can read
    assert store.load(step, STEP_RECORDS[step], key) == value


def test_a_missing_step_loads_as_none(tmp_path: Path) -> None:
    assert RoundStore("t", tmp_path).load("lora_checkpoint", TrainedCheckpoint, "r0002") is None


def test_snapshot_problems_name_the_reason() -> None:
    bad = TrainingSnapshot.from_dict({**SAMPLES["training_dataset_snapshot"].to_dict(), "schema_ok": False,
                                      "contamination": {"clean": False, "n_flagged": 2}})
    assert bad.problems() == ["schema differs from SNAPSHOT_SCHEMA", "2 rows overlap test/holdout"]
    assert SAMPLES["training_dataset_snapshot"].problems() == []


def test_the_decision_file_keeps_its_flat_shape() -> None:
    """``promotion_decision.json`` reads as it did before the records (the CLI and people read it)."""
    d = SAMPLES["promotion_decision"].to_dict()
    assert d["promote"] is True and d["reasons"] == ["cleared"] and d["delta"]["delta"] == 0.03
    assert d["gate"]["min_delta"] == 0.01 and d["release"] is None
