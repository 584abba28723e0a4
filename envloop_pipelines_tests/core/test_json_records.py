"""Issue 25: ``JsonRecord`` converts nested frozen dataclasses both ways, so step records need no hand-written
``to_dict`` / ``from_dict``; the RL round's records keep the JSON shape their hand-written converters wrote."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from envloop_pipelines.core.ledger.hypothesis import Gate, Hypothesis
from envloop_pipelines.core.loop.promotion import noise_floor_from_arms
from envloop_pipelines.core.ledger.store import JsonRecord, RoundStore


@dataclass(frozen=True)
class Point:
    """A plain frozen dataclass (no converters of its own)."""

    x: float
    y: float


@dataclass(frozen=True)
class Labelled:
    """A dataclass with converters of its own, which JsonRecord must call instead of its fields."""

    name: str

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.name.upper()}

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "Labelled":
        return cls(raw["label"].lower())


@dataclass(frozen=True)
class Inner(JsonRecord):
    point: Point
    points: tuple[Point, ...]
    tags: tuple[str, ...] = ()


@dataclass(frozen=True)
class Outer(JsonRecord):
    inner: Inner
    labelled: Labelled
    maybe: Point | None
    meta: Mapping[str, Any] = field(default_factory=dict)


def test_nested_dataclasses_round_trip_through_json() -> None:
    record = Outer(inner=Inner(Point(1.0, 2.0), (Point(3.0, 4.0), Point(5.0, 6.5)), ("a", "b")),
                   labelled=Labelled("champion"), maybe=Point(0.5, 0.25), meta={"k": [1, 2]})
    raw = record.to_dict()
    assert raw == {"inner": {"point": {"x": 1.0, "y": 2.0}, "points": [{"x": 3.0, "y": 4.0}, {"x": 5.0, "y": 6.5}],
                             "tags": ["a", "b"]},
                   "labelled": {"label": "CHAMPION"}, "maybe": {"x": 0.5, "y": 0.25}, "meta": {"k": [1, 2]}}
    back = Outer.from_dict(json.loads(json.dumps(raw)))
    assert back == record and isinstance(back.inner.points, tuple) and isinstance(back.inner.points[0], Point)
    # An optional nested record left empty, a key missing (its default) and a key the record does not know.
    empty = Outer.from_dict({"inner": {"point": {"x": 0, "y": 0}, "points": []}, "labelled": {"label": "X"},
                             "maybe": None, "unknown": 1})
    assert empty == Outer(Inner(Point(0, 0), ()), Labelled("x"), None)


def _rl_records(tmp_path: Path) -> dict[str, Any]:
    from envloop_pipelines.core.rl_loop.step_records import (
        ArmScore,
        HoldoutComparison,
        RlCandidate,
        RlHypothesis,
        RlNoiseFloor,
        RlReevaluation,
        RlRoundResult,
        RlSampling,
        RlSnapshot,
    )

    hyp = Hypothesis(task="t", round="r0001", benchmark_version="shell@v1", change={"kind": "rl_from_verified_attempts",
                     "sampler": {"kind": "test"}}, predicted_delta=0.1, gate=Gate(primary_metric="pass_at_1"),
                     seeds=(7, 1007), recipe_hash="abc", created_at=1.0, power={"mde": 0.2})
    comparison = HoldoutComparison(ArmScore(0.5, 0.25, 0.75, 2, 4), ArmScore(0.25, 0.0, 0.5, 2, 4),
                                   {"delta": 0.25, "ci_low": 0.0, "ci_high": 0.5}, 2)
    floor = noise_floor_from_arms("k", "pass_at_1", [{"pass_at_1": 0.5}, {"pass_at_1": 0.75}])
    return {
        "rl_hypothesis": RlHypothesis(hyp, hyp.hash, {"model": "base-m", "checkpoint_sha256": None, "path": None}, "run1"),
        "rl_sampled_attempts": RlSampling("r0001", str(tmp_path / "attempts.jsonl"), 4, 2, 1.5),
        "rl_sft_snapshot": RlSnapshot(round="r0001", sha256="f" * 64, path="/snap", n_rows=2, n_attempts=4, n_passed=2,
                                      n_removed=0, contamination={"clean": True, "flagged": []}),
        "rl_policy_checkpoint": RlCandidate("r0001", "c" * 64, "/policy", "policy-c", 7, 2.0, 1.0, 3.0),
        "rl_noise_floor": RlNoiseFloor("r0001", floor, 2.0),
        "rl_heldout_reeval": RlReevaluation("r0001", comparison, 4.0),
        "rl_decision": RlRoundResult(round="r0001", task="t", dataset="shell", dataset_version="v1", hypothesis_hash="h",
                                     sampler={"kind": "test"}, snapshot={"sha256": "f" * 64}, promoted=False,
                                     reasons=("under the bar",), comparison=comparison.to_dict()),
    }


def test_the_rl_records_keep_their_json_shape_and_round_trip_through_the_store(tmp_path: Path) -> None:
    from envloop_pipelines.core.rl_loop.step_records import RL_STEP_RECORDS

    records = _rl_records(tmp_path)
    assert set(records) == set(RL_STEP_RECORDS)
    # The shapes the hand-written converters wrote (what an RL IO manager's stored file of an earlier round holds).
    hyp, floor, reeval = records["rl_hypothesis"], records["rl_noise_floor"], records["rl_heldout_reeval"]
    assert hyp.to_dict() == {"hash": hyp.hash, "hypothesis": hyp.hypothesis.to_dict(), "parent": dict(hyp.parent),
                             "mlflow_run_id": "run1"}
    assert floor.to_dict() == {"round": "r0001", "floor": floor.floor.to_dict(), "seconds": 2.0}
    assert reeval.to_dict() == {"round": "r0001", "seconds": 4.0, "comparison": {
        "candidate": {"pass_at_1": 0.5, "ci_low": 0.25, "ci_high": 0.75, "n_environments": 2, "n_attempts": 4},
        "parent": {"pass_at_1": 0.25, "ci_low": 0.0, "ci_high": 0.5, "n_environments": 2, "n_attempts": 4},
        "delta": {"delta": 0.25, "ci_low": 0.0, "ci_high": 0.5}, "attempts_per_environment": 2}}
    assert records["rl_sft_snapshot"].to_dict() == {
        "round": "r0001", "sha256": "f" * 64, "path": "/snap", "n_rows": 2, "n_attempts": 4, "n_passed": 2,
        "n_removed": 0, "contamination": {"clean": True, "flagged": []}}
    store = RoundStore("t", tmp_path)
    for step, record in records.items():
        store.save(step, record, "r0001")
        assert store.load(step, RL_STEP_RECORDS[step], "r0001") == record, step
    assert RL_STEP_RECORDS["rl_noise_floor"].from_dict({"round": "r0001", "floor": None}).floor is None
    assert RL_STEP_RECORDS["rl_heldout_reeval"].from_dict({"round": "r0001", "comparison": None}).comparison is None
