"""The typed values the steps of a round hand each other.

Each step function takes the records of the steps it depends on and returns its
own (a frozen dataclass). Dagster's IO manager (``resources/round_store.py``)
stores them as JSON at the paths of :class:`~envloop_pipelines.core.ledger.store.RoundStore`
and hands them downstream, so lineage in the UI is the real data flow; without
Dagster (benches, tests) the same functions are called with the values directly.
Large artifacts (snapshots, checkpoints) stay content-addressed on disk and are
referenced here by hash and path. Nested metric dictionaries stay dictionaries:
their keys are the metric names of ``core/metrics/point.py``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from envloop_pipelines.core.ledger.hypothesis import Gate, Hypothesis
from envloop_pipelines.core.loop.promotion import NoiseFloor, PromotionDecision
from envloop_pipelines.core.ledger.store import JsonRecord


@dataclass(frozen=True)
class Benchmark(JsonRecord):
    """``task_benchmark``: the task's current snapshot."""

    task: str
    snapshot_id: str
    benchmark_version: str
    splits: Mapping[str, Any]


@dataclass(frozen=True)
class MeasuredNoiseFloor:
    """``noise_floor``: the floor of the null arms, with where it came from."""

    floor: NoiseFloor
    benchmark_version: str
    recipe_hash: str
    identity: str
    mlflow_run_id: str | None = None
    mlflow_url: str | None = None
    cached: bool = False
    #: ``"control"``: the setup's null arms of the control recipe; ``"lineage"``: the champion's making repeated
    #: with fresh seeds beside the champion (``champion_noise_floor``), with the champion's checkpoint, the
    #: control floor's key and the making it repeats.
    source: str = "control"
    champion_checkpoint_sha256: str | None = None
    control_key: str | None = None
    making: Mapping[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        # Flat, as the noise cache has always been written: NoiseFloor's fields beside the provenance.
        return {**self.floor.to_dict(), "benchmark_version": self.benchmark_version, "recipe_hash": self.recipe_hash,
                "identity": self.identity, "mlflow_run_id": self.mlflow_run_id, "mlflow_url": self.mlflow_url,
                "cached": self.cached, "source": self.source,
                "champion_checkpoint_sha256": self.champion_checkpoint_sha256, "control_key": self.control_key,
                "making": dict(self.making) if self.making is not None else None}

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "MeasuredNoiseFloor":
        return cls(floor=NoiseFloor.from_dict(raw), benchmark_version=raw["benchmark_version"],
                   recipe_hash=raw["recipe_hash"], identity=raw.get("identity", ""),
                   mlflow_run_id=raw.get("mlflow_run_id"), mlflow_url=raw.get("mlflow_url"),
                   cached=bool(raw.get("cached", False)), source=raw.get("source", "control"),
                   champion_checkpoint_sha256=raw.get("champion_checkpoint_sha256"),
                   control_key=raw.get("control_key"), making=raw.get("making"))


@dataclass(frozen=True)
class BaselineEval(JsonRecord):
    """``baseline_eval``: the champion on dev."""

    round: str
    champion_release: int
    checkpoint_sha256: str
    checkpoint_dir: str
    benchmark_version: str
    metrics: Mapping[str, Any]
    predictions: str
    automation_threshold: float


@dataclass(frozen=True)
class FailureMining(JsonRecord):
    """``failure_mining``: the champion's dev errors, clustered (``mining.FailureReport`` as data)."""

    round: str
    n_questions: int
    n_errors: int
    n_confident_errors: int
    error_rate: float
    threshold: float | None
    clusters: tuple[Mapping[str, Any], ...]
    by_family: Mapping[str, Any]


@dataclass(frozen=True)
class EnvironmentSynthesis(JsonRecord):
    """``environment_synthesis``: the rows written for the top clusters, and the same rows as an environment dataset.

    ``environment_dataset`` is ``<name>@<version>`` of the decision environments made of the rows
    (``envloop env show``); None when no row was synthesized, and in records stored before it existed.
    """

    round: str
    generator: str
    n_rows: int
    per_cluster: Mapping[str, int]
    clusters: tuple[str, ...]
    path: str
    sha256: str
    environment_dataset: str | None = None


@dataclass(frozen=True)
class RegisteredHypothesis:
    """``registered_hypothesis``: the hypothesis as registered, with its hash and MLflow run."""

    hypothesis: Hypothesis
    hash: str
    mlflow_run_id: str
    mlflow_url: str

    @property
    def round(self) -> str:
        return self.hypothesis.round

    def to_dict(self) -> dict[str, Any]:
        return {"round": self.round, "hash": self.hash, **self.hypothesis.to_dict(),
                "mlflow_run_id": self.mlflow_run_id, "mlflow_url": self.mlflow_url}

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "RegisteredHypothesis":
        body = {k: v for k, v in raw.items() if k in {f.name for f in dataclasses.fields(Hypothesis)}}
        return cls(hypothesis=Hypothesis.from_dict(body), hash=raw["hash"], mlflow_run_id=raw["mlflow_run_id"],
                   mlflow_url=raw["mlflow_url"])


@dataclass(frozen=True)
class TrainingSnapshot(JsonRecord):
    """``training_dataset_snapshot``: base train plus synthesized rows, content-addressed, with its contamination report."""

    round: str
    sha256: str
    path: str
    n_rows: int
    n_base: int
    n_synthesized: int
    n_removed: int
    contamination: Mapping[str, Any]
    schema_ok: bool
    benchmark_version: str

    def problems(self) -> list[str]:
        """Why the snapshot must not be trained on (empty when it is fine)."""
        problems = []
        if not self.schema_ok:
            problems.append("schema differs from SNAPSHOT_SCHEMA")
        if not self.contamination["clean"]:
            problems.append(f"{self.contamination['n_flagged']} rows overlap test/holdout")
        return problems


@dataclass(frozen=True)
class TrainedCheckpoint(JsonRecord):
    """``lora_checkpoint``: the candidate, trained from the champion, published under its content hash."""

    round: str
    checkpoint: str
    checkpoint_sha256: str
    init_from: str
    snapshot_sha256: str
    seed: int
    train_s: float
    metrics: Mapping[str, Any]
    mlflow_run_id: str
    mlflow_url: str
    hypothesis_hash: str = ""


@dataclass(frozen=True)
class Reevaluation(JsonRecord):
    """``independent_reeval``: candidate and champion on the hidden test set, from the verifier, beside TF-IDF."""

    round: str
    benchmark_version: str
    candidate: Mapping[str, Any]
    champion: Mapping[str, Any]
    tfidf_baseline: Mapping[str, Any]
    paired: Mapping[str, Any]
    complete: bool
    verifier_pid: int | None
    verifier: Mapping[str, Any]
    candidate_checkpoint_sha256: str
    champion_checkpoint_sha256: str
    mlflow_run_id: str = ""
    mlflow_url: str = ""

    def delta(self, metric: str) -> Mapping[str, Any]:
        """The paired delta (candidate − champion) of ``metric``: ``delta``, ``ci_low``, ``ci_high``."""
        return self.paired["deltas"][metric]

    @property
    def deltas(self) -> Mapping[str, Mapping[str, Any]]:
        return self.paired["deltas"]


@dataclass(frozen=True)
class RoundDecision(JsonRecord):
    """``promotion_decision``: the gate's verdict (``promotion.PromotionDecision``) and the release it made."""

    round: str
    promote: bool
    reasons: tuple[str, ...]
    checks: Mapping[str, Any]
    delta: Mapping[str, Any]
    noise_floor: float
    hypothesis_hash: str
    predicted_delta: float
    gate: Mapping[str, Any]
    release: int | None = None
    model_version: str | None = None
    #: The search-space lever the round tested (``change.lever``; the change's kind for a person's hypothesis).
    lever: str | None = None

    @classmethod
    def of(cls, key: str, decision: PromotionDecision, *, delta: Mapping[str, Any], noise_floor: float,
           hypothesis: Hypothesis, gate: Gate) -> "RoundDecision":
        return cls(round=key, promote=decision.promote, reasons=tuple(decision.reasons), checks=dict(decision.checks),
                   delta=dict(delta), noise_floor=noise_floor, hypothesis_hash=hypothesis.hash,
                   predicted_delta=hypothesis.predicted_delta, gate=dataclasses.asdict(gate),
                   lever=hypothesis.change.get("lever") or hypothesis.change.get("kind"))


#: The record type of each step's value, by step (asset) name: what the IO manager loads.
STEP_RECORDS: dict[str, type] = {
    "task_benchmark": Benchmark,
    "noise_floor": MeasuredNoiseFloor,
    "baseline_eval": BaselineEval,
    "champion_noise_floor": MeasuredNoiseFloor,
    "failure_mining": FailureMining,
    "environment_synthesis": EnvironmentSynthesis,
    "registered_hypothesis": RegisteredHypothesis,
    "training_dataset_snapshot": TrainingSnapshot,
    "lora_checkpoint": TrainedCheckpoint,
    "independent_reeval": Reevaluation,
    "promotion_decision": RoundDecision,
}

__all__ = ["Benchmark", "BaselineEval", "EnvironmentSynthesis", "FailureMining", "MeasuredNoiseFloor", "JsonRecord",
           "Reevaluation", "RegisteredHypothesis", "RoundDecision", "STEP_RECORDS", "TrainedCheckpoint",
           "TrainingSnapshot"]
