"""The asset ``task_benchmark``: the task's snapshot pinned as the loop's benchmark.

It is the one step that opens the task (generating the built-in benchmark on first use); its record pins the
benchmark version, and every later step opens the task once with
:func:`~envloop_pipelines.core.data.snapshots.open_pinned_task` and hands the snapshot to the functions it calls.
"""

from __future__ import annotations

from envloop_pipelines.core.data.snapshots import TaskSnapshot, open_task
from envloop_pipelines.core.decision_loop.step_records import Benchmark
from envloop_pipelines.core.loop.config import LoopConfig
from envloop_pipelines.core.storage import envloop_home


def ensure_task_benchmark(config: LoopConfig) -> Benchmark:
    """The task's current snapshot, pinned as the loop's benchmark; the built-in benchmark is generated on first use."""
    return _benchmark(config.task, _open_or_generate(config))

def _open_or_generate(config: LoopConfig) -> TaskSnapshot:
    try:
        return open_task(config.task, home=envloop_home(config.home))
    except FileNotFoundError:
        if config.generator != "builtin_targeted":
            raise
    from envloop_pipelines.core.benchmark.builtin_task import generate_builtin_task

    generate_builtin_task(task=config.task, n_users=config.builtin_users,
                          records_per_user=config.builtin_records_per_user, hidden_users=config.builtin_hidden_users,
                          home=envloop_home(config.home))
    return open_task(config.task, home=envloop_home(config.home))

def _benchmark(task: str, snapshot: TaskSnapshot) -> Benchmark:
    summary = snapshot.summary()
    return Benchmark(task=task, snapshot_id=snapshot.snapshot_id,
                     benchmark_version=snapshot.benchmark_version, splits=summary["splits"])


__all__ = ["ensure_task_benchmark"]
