"""Issue 25, "steps reopen the task 12 times instead of receiving it": a step opens the task once, at its edge.

The decision loop's step functions take the task's snapshot (``task: TaskSnapshot``) that the step opened
and never open the task themselves: parsed here (no ``open_task`` call left in ``core/decision_loop`` but
the two doors that must open by name), and run here on a small imported task with ``open_task`` counted.
A snapshot handed in is the one read, even after the task is re-imported; ``open_pinned_task``, the edge's
door, refuses a task re-imported since ``task_benchmark`` pinned its version, naming the task and both.
"""

from __future__ import annotations

import ast
import random
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

import envloop_pipelines
from envloop_pipelines.core.data import snapshots
from envloop_pipelines.core.data.datasets import import_file
from envloop_pipelines.core.data.snapshots import BenchmarkMismatchError, TaskSnapshot, open_task, require_same_benchmark

from .data.test_records import good_record, write_lines

DECISION_LOOP = Path(envloop_pipelines.__file__).resolve().parent / "core" / "decision_loop"
#: The only functions of ``core/decision_loop`` that open the task, each once per call: ``task_benchmark``'s own
#: (it opens the task, or generates the built-in one and opens that, and pins its version), and the
#: self-answer generator, which is built by name from a generator's JSON arguments.
OPENERS = {("task_benchmark.py", "_open_or_generate"), ("self_answers.py", "SelfAnswerGenerator.synthesize")}
TASK = "tickets"


def _open_task_calls(path: Path) -> list[tuple[str, int]]:
    """(enclosing function's qualified name, line) of every ``open_task(...)`` call in the module."""
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST, scope: tuple[str, ...]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, (*scope, child.name))
                continue
            if isinstance(child, ast.Call):
                func = child.func
                name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
                if name == "open_task":
                    found.append((".".join(scope) or "<module>", child.lineno))
            visit(child, scope)

    visit(ast.parse(path.read_text(encoding="utf-8")), ())
    return found


def test_no_step_function_of_the_decision_loop_opens_the_task() -> None:
    calls = {(path.name, scope, line) for path in sorted(DECISION_LOOP.glob("*.py"))
             for scope, line in _open_task_calls(path)}
    assert {(name, scope) for name, scope, _ in calls} == OPENERS, sorted(calls)


def _records(n_users: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)  # states far apart: the contamination check keeps every train row
    return [{**good_record(f"r{u}-{k}", user=f"u{u}"), "state": " ".join(f"w{rng.randrange(10**6)}" for _ in range(16))}
            for u in range(n_users) for k in range(2)]


def _import(tmp_path: Path, home: Path, n_users: int, seed: int) -> TaskSnapshot:
    return import_file(write_lines(tmp_path / f"d{seed}.jsonl", _records(n_users, seed)), TASK, home=home)


@pytest.fixture()
def opened(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every ``open_task`` call from now on, wherever the module that makes it imported the name from."""
    calls: list[str] = []
    original = snapshots.open_task

    def counting(task: str, **kwargs: Any) -> TaskSnapshot:
        calls.append(task)
        return original(task, **kwargs)

    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("envloop_pipelines") and getattr(module, "open_task", None) is original:
            monkeypatch.setattr(module, "open_task", counting)
    yield calls


def test_a_round_step_given_the_snapshot_opens_no_task_and_reads_the_one_it_was_given(
        tmp_path: Path, opened: list[str]) -> None:
    from envloop_pipelines.core.decision_loop.training_dataset_snapshot import build_training_snapshot
    from envloop_pipelines.core.decision_loop.failure_mining import mine_failures
    from envloop_pipelines.core.decision_loop.registered_hypothesis import paired_noise
    from envloop_pipelines.core.decision_loop.environment_synthesis import synthesize_environments
    from envloop_pipelines.core.decision_loop.noise_floor import current_noise_floor
    from envloop_pipelines.core.decision_loop.task_benchmark import ensure_task_benchmark
    from envloop_pipelines.core.decision_loop.step_records import BaselineEval
    from envloop_pipelines.core.ledger.event_log import LedgerError
    from envloop_pipelines.core.loop.config import LoopConfig
    from envloop_pipelines.core.storage import atomic_write_parquet

    home = tmp_path / "home"
    task = _import(tmp_path, home, 30, seed=0)
    config = LoopConfig(task=TASK, home=str(home), generator="label_preserving_variants", n_synthesized=4,
                        safety_families=())
    dev = task.table("dev")
    # The champion's dev answers: option 1 at 0.9 everywhere, wrong on every hard question (their labels are 0).
    probs = [[0.1 / (len(k) - 1), 0.9, *[0.1 / (len(k) - 1)] * (len(k) - 2)] for k in dev.column("option_keys").to_pylist()]
    predictions = atomic_write_parquet(tmp_path / "dev_predictions.parquet", pa.table({
        "record_id": dev.column("record_id"), "question_id": dev.column("question_id"),
        "option_keys": dev.column("option_keys"), "probs": probs}))
    baseline = BaselineEval(round="r0001", champion_release=1, checkpoint_sha256="c", checkpoint_dir="/none",
                            benchmark_version=task.benchmark_version, metrics={}, predictions=str(predictions),
                            automation_threshold=0.5)
    newer = _import(tmp_path, home, 31, seed=1)  # re-imported mid-round: the task's current snapshot moves
    assert open_task(TASK, home=home).benchmark_version == newer.benchmark_version != task.benchmark_version
    opened.clear()

    mined = mine_failures(config, task, baseline)
    assert mined.n_errors == mined.n_questions > 0 and mined.clusters
    synthesis = synthesize_environments(config, task, mined)
    assert synthesis.n_rows > 0
    snapshot = build_training_snapshot(config, task, synthesis)
    assert snapshot.benchmark_version == task.benchmark_version  # the snapshot handed in, not the current one
    assert snapshot.n_base == task.table("train").num_rows != newer.table("train").num_rows
    with pytest.raises(LedgerError, match="materialize noise_floor first"):
        current_noise_floor(config, task)
    assert paired_noise(config, task) is None
    assert opened == []  # not one open: every step read the snapshot it was given
    assert ensure_task_benchmark(config).benchmark_version == newer.benchmark_version  # the first step pins anew
    assert opened == [TASK]  # once


def test_the_edge_opens_the_pinned_version_and_refuses_a_task_re_imported_since(tmp_path: Path) -> None:
    from envloop_pipelines.core.data.snapshots import open_pinned_task

    home = tmp_path / "home"
    pinned = _import(tmp_path, home, 30, seed=0)
    assert open_pinned_task(TASK, pinned.benchmark_version, home=home).snapshot_id == pinned.snapshot_id
    newer = _import(tmp_path, home, 31, seed=1)
    with pytest.raises(BenchmarkMismatchError) as refused:
        open_pinned_task(TASK, pinned.benchmark_version, home=home)
    message = str(refused.value)
    assert message.startswith(f"task {TASK!r}: results come from different benchmark versions ")
    assert f"task_benchmark pinned {pinned.benchmark_version}, the task's current snapshot is " \
           f"{newer.benchmark_version}" in message
    # Without a task the message is the one it always was.
    with pytest.raises(BenchmarkMismatchError) as plain:
        require_same_benchmark("b@1", "a@2")
    assert str(plain.value) == "results come from different benchmark versions ['a@2', 'b@1']; they are never compared"
    assert require_same_benchmark("a@1", "a@1", task=TASK) == "a@1"
