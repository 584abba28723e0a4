"""The asset ``baseline_eval``: the champion on dev, its per-question predictions and metrics.

Like every step of a round, it takes the task's snapshot the step opened once (``task``, pinned to the version
``task_benchmark`` recorded) and never opens the task itself; rows and predictions go to the round's folder and
the step's value is returned, not written (the IO manager stores it).
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq

from envloop_pipelines.core.data.snapshots import TaskSnapshot, require_same_benchmark
from envloop_pipelines.core.decision_loop.step_records import BaselineEval
from envloop_pipelines.core.ledger.store import RoundStore
from envloop_pipelines.core.loop.config import LoopConfig
from envloop_pipelines.core.release.publish import champion
from envloop_pipelines.core.release.tracked_runs import write_predictions


def evaluate_champion(config: LoopConfig, task: TaskSnapshot, key: str) -> BaselineEval:
    """The champion on dev: per-question predictions and metrics."""
    from envloop_pipelines.core.model.predict import score_table

    champ = champion(config)
    require_same_benchmark(champ["benchmark_version"], task.benchmark_version)
    dev = task.table("dev")
    preds = write_predictions(RoundStore(config.task, config.home).round_dir(key) / "dev_predictions.parquet",
                              champ["checkpoint_dir"], dev)
    calibration = json.loads((Path(champ["checkpoint_dir"]) / "calibration.json").read_text(encoding="utf-8"))
    threshold = calibration.get("automation_threshold")
    return BaselineEval(round=key, champion_release=champ["release"], checkpoint_sha256=champ["checkpoint_sha256"],
                        checkpoint_dir=champ["checkpoint_dir"], benchmark_version=task.benchmark_version,
                        metrics=score_table(dev, pq.read_table(preds), config.guarded_families(task)),
                        predictions=str(preds), automation_threshold=float("inf") if threshold is None else threshold)


__all__ = ["evaluate_champion"]
