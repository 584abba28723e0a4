"""Issue 25: a round's steps read the benchmark version ``task_benchmark`` pinned, or refuse.

Each round asset takes ``task_benchmark``'s record, opens the task once (``LoopResource.task_snapshot``) and
hands the snapshot to core. A task re-imported between two steps of a round makes the later step fail,
naming the task and both versions, with nothing of it written; before, the step silently read the new data.
"""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import pytest

from envloop_pipelines.core.decision_loop.step_records import Benchmark, EnvironmentSynthesis, TrainingSnapshot
from envloop_pipelines.core.decision_loop.synthesis import SNAPSHOT_SCHEMA
from envloop_pipelines.core.ledger.store import RoundStore
from envloop_pipelines.core.storage import atomic_write_parquet
from envloop_pipelines.defs.rounds.assets import task_benchmark, training_dataset_snapshot, with_upstream_sources
from envloop_pipelines.resources.loop import LoopResource, MlflowResource
from envloop_pipelines.resources.round_store import RoundStoreIOManager
from envloop_pipelines_tests.core.test_task_opened_once import TASK, _import


def _synthesized(store: RoundStore, key: str, tmp_path: Path) -> None:
    """An upstream step's value for round ``key``, as the IO manager stores it: no synthesized row."""
    empty = atomic_write_parquet(tmp_path / f"{key}-synth.parquet", SNAPSHOT_SCHEMA.empty_table())
    store.save("environment_synthesis", EnvironmentSynthesis(round=key, generator="g", n_rows=0, per_cluster={},
                                                             clusters=(), path=str(empty), sha256="e"), key)


def test_a_task_re_imported_mid_round_is_refused_by_the_next_step(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    monkeypatch.setenv("ENVLOOP_HOME", str(home))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    pinned = _import(tmp_path, home, 30, seed=0)
    loop = LoopResource(home=str(home), task=TASK, generator="label_preserving_variants")
    resources = {"loop": loop, "mlflow": MlflowResource(home=str(home)), "io_manager": RoundStoreIOManager(loop=loop)}
    instance = dg.DagsterInstance.ephemeral()
    assert dg.materialize([task_benchmark], resources=resources, instance=instance).success
    store = RoundStore(TASK, str(home))
    assert store.load("task_benchmark", Benchmark).benchmark_version == pinned.benchmark_version
    instance.add_dynamic_partitions("rounds", ["r0001", "r0002"])
    step = with_upstream_sources([training_dataset_snapshot])

    _synthesized(store, "r0001", tmp_path)
    assert dg.materialize(step, partition_key="r0001", resources=resources, instance=instance).success
    assert store.load("training_dataset_snapshot", TrainingSnapshot, "r0001").benchmark_version == pinned.benchmark_version

    newer = _import(tmp_path, home, 31, seed=1)  # re-imported between two steps of round r0002
    _synthesized(store, "r0002", tmp_path)
    result = dg.materialize(step, partition_key="r0002", resources=resources, instance=instance, raise_on_error=False)
    assert not result.success
    (failure,) = result.get_step_failure_events()
    error = failure.step_failure_data.error
    message = "\n".join(e.message for e in (error, error.cause) if e is not None)
    assert "BenchmarkMismatchError" in message and f"task {TASK!r}" in message
    assert f"task_benchmark pinned {pinned.benchmark_version}, the task's current snapshot is " \
           f"{newer.benchmark_version}" in message
    assert not store.step_path("training_dataset_snapshot", "r0002").exists()  # nothing read, nothing written
