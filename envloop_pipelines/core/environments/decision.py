"""Decision tasks as an environment: one typed question of a snapshot per seed.

``reset(seed)`` picks a question of the split with ``numpy.random.default_rng(seed)``
from the snapshot pinned when the environment was built (so a seed means the
same question for as long as the environment exists, and across machines with
the same snapshot id). The task carries the state, the question and its
options, never the label.

On an open split (train, val, dev) ``verify`` writes the answer as a one-row
predictions file and scores it with the rule verifier in a sandboxed worker
(``sandboxed=False`` scores in process, for quick local loops). On a hidden
split (test, holdout) there is no per-item answer: ``verify`` and
``verify_batch`` raise :class:`~envloop_pipelines.core.verify.runner.HiddenSplitQueryError`,
and :meth:`DecisionEnvironment.evaluate` scores answers to every question of
the split through the verifier's one door
(:func:`~envloop_pipelines.core.verify.runner.verify_task`), aggregate scores
only, the holdout as a release's one read. Labels are read on the verifier
side only.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from envloop_pipelines.core.environments.base import Score, Task, check_seed
from envloop_pipelines.core.data.snapshots import open_task
from envloop_pipelines.core.data.splits import HIDDEN_SPLITS, SPLITS
from envloop_pipelines.core.storage import envloop_home
from envloop_pipelines.core.verify.protocol import VerifierReport, write_predictions
from envloop_pipelines.core.verify.rule import RuleVerifier
from envloop_pipelines.core.verify.runner import HiddenSplitQueryError, HoldoutSlot, VerifierRun, VerifierRunner, verify_task

_INPUT_COLUMNS = ("record_id", "question_id", "family", "type", "state_text", "instructions_text", "option_keys", "option_texts")


def answer_row(task: Task, answer: Any) -> dict[str, Any]:
    """A prediction row from an answer: ``{option: prob}``, probabilities in option order, or one option key."""
    keys = list(task.inputs["option_keys"])
    base = {"record_id": task.inputs["record_id"], "question_id": task.inputs["question_id"]}
    if isinstance(answer, str):
        if answer not in keys:
            raise ValueError(f"answer {answer!r} is not an option ({keys})")
        return {**base, "option_keys": keys, "probs": [1.0 if k == answer else 0.0 for k in keys]}
    if isinstance(answer, Mapping):
        return {**base, "option_keys": [str(k) for k in answer], "probs": list(answer.values())}
    if isinstance(answer, (Sequence, np.ndarray)):
        return {**base, "option_keys": keys, "probs": [float(x) for x in answer]}
    raise ValueError(f"an answer is an option key, a mapping option → probability or a probability list, got {type(answer).__name__}")


class DecisionEnvironment:
    """One question of a task's split per seed, scored by the rule verifier.

    Args:
        task: the task name.
        split: the split to draw from (``dev`` by default). On ``test`` and ``holdout`` only
            :meth:`evaluate` scores (aggregate scores of answers to every question).
        snapshot_id: the snapshot (default: the task's current one, pinned now).
        home: the EnvLoop home.
        runner: the sandboxed verifier runner of an open split (default: the local sandbox). Refused
            on test and holdout: hidden labels go only to the verifier's own runner.
        sandboxed: score in a sandboxed worker (True) or in process (False).

    Raises:
        HiddenSplitQueryError: a ``runner`` on test or holdout.
    """

    def __init__(
        self,
        task: str,
        split: str = "dev",
        *,
        snapshot_id: str | None = None,
        home: str | Path | None = None,
        runner: VerifierRunner | None = None,
        sandboxed: bool = True,
    ) -> None:
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; allowed: {', '.join(SPLITS)}")
        if split in HIDDEN_SPLITS and runner is not None:
            raise HiddenSplitQueryError(
                f"runner: {split} is scored only by the verifier's own runner (verify_task); a caller's runner "
                f"or sandbox never receives hidden labels")
        snapshot = open_task(task, snapshot_id=snapshot_id, home=home)
        self.task, self.split, self.home = task, split, home
        self.snapshot_id = snapshot.snapshot_id
        self.name = f"decision:{task}@{self.snapshot_id[:12]}/{split}"
        table = snapshot.table(split).select(list(_INPUT_COLUMNS))
        order = pc.sort_indices(table, sort_keys=[("record_id", "ascending"), ("question_id", "ascending")])
        self._rows: list[dict[str, Any]] = table.take(order).to_pylist()
        if not self._rows:
            raise ValueError(f"split {split!r} of task {task!r} has no questions")
        self.runner = runner
        self.sandboxed = sandboxed
        self._labels: pa.Table | None = None  # open splits: loaded on the first verify

    def __len__(self) -> int:
        return len(self._rows)

    def reset(self, seed: int) -> Task:
        row = self._rows[int(np.random.default_rng(check_seed(seed)).integers(len(self._rows)))]
        return Task(
            env=self.name, seed=seed, task_id=f"{row['record_id']}#{row['question_id']}",
            prompt=row["instructions_text"],
            inputs={k: row[k] for k in _INPUT_COLUMNS if k != "instructions_text"},
        )

    @property
    def task_ids(self) -> list[str]:
        """Every question of the split as a task id (``record_id#question_id``), in a fixed order."""
        return [f"{r['record_id']}#{r['question_id']}" for r in self._rows]

    def evaluate(self, answers: Mapping[str, Any], *, holdout_slot: HoldoutSlot | None = None,
                 release: int | None = None, safety_families: Sequence[str] = ()) -> VerifierRun:
        """Score answers as one predictions file through the verifier's door: aggregate scores on hidden splits.

        Args:
            answers: task id (:attr:`task_ids`) → answer (an option key, a mapping option →
                probability, or a probability list). On test and holdout every question must have
                a valid answer, or the verifier refuses the file.
            holdout_slot: optional on ``holdout``: it must be the task home's own ledger (the verifier
                reads the holdout in that ledger; any other slot is refused).
            release: the release whose one holdout read this is; required on ``holdout``, and only the
                release being published now is read.
            safety_families: families whose false-negative rate the report includes.

        Returns:
            The verifier run; on a hidden split its report has no items.

        Raises:
            ValueError: an answer names no question of the split or is malformed.
            HiddenSplitQueryError: ``holdout`` without a release, or with a slot that is not the task's ledger.
            HoldoutAlreadyReadError: from the ledger, when the release already read the holdout.
            HoldoutSlotError: from the ledger, when ``release`` is not the release being published now.
        """
        with tempfile.TemporaryDirectory(prefix="envloop-evaluate-") as tmp:
            path = self.write_answers(answers, Path(tmp) / "predictions.jsonl")
            return verify_task(self.task, self.split, path, snapshot_id=self.snapshot_id, home=self.home,
                               runner=self.runner, holdout_slot=holdout_slot, release=release,
                               safety_families=safety_families)

    def write_answers(self, answers: Mapping[str, Any], path: Path) -> Path:
        """The predictions file :meth:`evaluate` scores for ``answers`` (the same bytes for the same answers).

        Raises:
            ValueError: an answer to a question that is not this environment's.
        """
        by_id = {f"{r['record_id']}#{r['question_id']}": r for r in self._rows}
        rows = []
        for task_id, answer in answers.items():
            if task_id not in by_id:
                raise ValueError(f"{task_id!r} is not a question of {self.name}")
            row = by_id[task_id]
            task = Task(env=self.name, seed=0, task_id=task_id, prompt=row["instructions_text"],
                        inputs={k: row[k] for k in _INPUT_COLUMNS if k != "instructions_text"})
            rows.append(answer_row(task, answer))
        return write_predictions(path, rows)

    def _labels_for(self, keys: set[tuple[str, str]]) -> pa.Table:
        if self._labels is None:
            self._labels = open_task(self.task, snapshot_id=self.snapshot_id, home=self.home).labels(self.split)
        records = pa.array(sorted({r for r, _ in keys}), pa.string())
        subset = self._labels.filter(pc.is_in(self._labels.column("record_id"), value_set=records))
        mask = [(r, q) in keys for r, q in zip(subset.column("record_id").to_pylist(), subset.column("question_id").to_pylist())]
        return subset.filter(pa.array(mask, pa.bool_()))

    def verify(self, task: Task, answer: Any) -> Score:
        """Score one answer; see :meth:`verify_batch`."""
        return self.verify_batch([task], [answer])[0]

    def verify_batch(self, tasks: Sequence[Task], answers: Sequence[Any]) -> list[Score]:
        """Score answers to tasks with one verifier run (one sandboxed worker for the whole batch).

        Two answers to the same question in one batch go to separate runs (a
        predictions file holds one row per question).

        Raises:
            HiddenSplitQueryError: the split is test or holdout, which never say per item whether
                an answer is right (use :meth:`evaluate`).
        """
        if self.split in HIDDEN_SPLITS:
            raise HiddenSplitQueryError(
                f"{self.name}: {self.split} answers with aggregate scores only, never per item; "
                f"evaluate() scores answers to every question through the verifier")
        if len(tasks) != len(answers):
            raise ValueError(f"{len(tasks)} tasks but {len(answers)} answers")
        scores: list[Score | None] = [None] * len(tasks)
        rounds: list[list[tuple[int, dict[str, Any]]]] = []
        seen: dict[tuple[str, str], int] = {}
        for n, (task, answer) in enumerate(zip(tasks, answers)):
            if task.env != self.name or task.fingerprint() != self.reset(task.seed).fingerprint():
                scores[n] = Score(0.0, False, "invalid", "rule", {"error": f"task {task.task_id} is not seed {task.seed} of {self.name}"})
                continue
            try:
                row = answer_row(task, answer)
            except (ValueError, TypeError) as exc:
                scores[n] = Score(0.0, False, "invalid", "rule", {"error": str(exc)})
                continue
            key = (row["record_id"], row["question_id"])
            k = seen.get(key, 0)
            seen[key] = k + 1
            if k == len(rounds):
                rounds.append([])
            rounds[k].append((n, row))
        for entries in rounds:
            self._score_into(scores, entries)
        return [s for s in scores if s is not None]

    def _score_into(self, scores: list[Score | None], entries: list[tuple[int, dict[str, Any]]]) -> None:
        rows = [row for _, row in entries]
        labels = self._labels_for({(r["record_id"], r["question_id"]) for r in rows})
        run = None
        if self.sandboxed:
            runner = self.runner or VerifierRunner()
            data = "".join(json.dumps(r) + "\n" for r in rows).encode()
            run = runner.run(data, labels, predictions_format="jsonl", hidden_paths=[envloop_home(self.home) / "verifier"])
            report: VerifierReport | None = run.report
            if report is None:
                for n, _ in entries:
                    scores[n] = Score(0.0, False, "error", "rule", {"error": run.error}, sandbox=run.sandbox)
                return
        else:
            report = RuleVerifier().score(rows, labels)
        by_key = {(i.record_id, i.question_id): i for i in report.items}
        for n, row in entries:
            item = by_key[(row["record_id"], row["question_id"])]
            passed = (bool(item.correct) if item.correct is not None else item.score >= 0.5) and item.status == "scored"
            scores[n] = Score(item.score, passed, "scored" if item.status == "scored" else "invalid", "rule",
                              item.to_dict(), sandbox=None if run is None else run.sandbox)


__all__ = ["DecisionEnvironment", "answer_row"]
