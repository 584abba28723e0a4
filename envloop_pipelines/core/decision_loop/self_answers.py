"""The decision model as its own agent: its verified answers as training rows (issue 17, item 6).

On decision environments whose labels the trainer never sees (the questions of an open split other than
train, ``dev`` by default), the champion answers each question by **sampling** an option from its
calibrated distribution; the verifier (the rule verifier, sandboxed, through
:meth:`DecisionEnvironment.evaluate`) says which sampled answers are right; the right ones become
training rows labelled with the sampled option, with provenance (the split, the record and question,
the sampled option and its probability, the champion's checkpoint hash). The wrong ones are dropped:
nothing about them reaches the trainer. The trainer reads the inputs only (``INPUT_SCHEMA``); what
it learns about a label it learns from a verified answer, as an RL agent learns from its reward.

:class:`SelfAnswerGenerator` puts this behind the environment generator protocol
(``core/decision_loop/synthesis.py``), so a round of the decision loop trains on the verified self-answers
and is gated like any other (registered hypothesis, floor, paired CI on the wide test).

Sampling (not the argmax) matters: a question the champion gets right with probability 0.6 is kept
about 60% of the time, so confident mistakes are never reinforced and uncertain right answers are,
in proportion to the champion's own calibrated belief (rejection sampling against the verifier).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from envloop_pipelines.core.data.question_table import INPUT_SCHEMA, QUESTION_SCHEMA
from envloop_pipelines.core.data.snapshots import TaskSnapshot, open_task
from envloop_pipelines.core.data.splits import HIDDEN_SPLITS

GENERATOR_NAME = "self_answers"
#: Splits whose labels a trainer never reads and whose verifier answers per item.
ALLOWED_SPLITS = ("val", "dev")


@dataclass(frozen=True)
class SelfAnswerStats:
    """What a sampling pass did (aggregates; the per-item verdicts stay inside :func:`verified_self_answers`)."""

    split: str
    checkpoint_sha256: str
    n_questions: int
    n_passed: int
    n_soft_skipped: int
    pass_rate: float
    mean_sampled_probability: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def sample_options(probabilities: Sequence[np.ndarray], seed: int) -> list[int]:
    """One option index per question, drawn from its distribution (``numpy.random.default_rng(seed)``)."""
    rng = np.random.default_rng(seed)
    out = []
    for p in probabilities:
        p = np.asarray(p, dtype=float)
        out.append(int(rng.choice(len(p), p=p / p.sum())))
    return out


def verified_self_answers(
    checkpoint: str | Path,
    task: TaskSnapshot,
    *,
    split: str = "dev",
    families: Sequence[str] | None = None,
    seed: int = 0,
    home: str | Path | None = None,
    sandboxed: bool = True,
) -> tuple[pa.Table, SelfAnswerStats]:
    """The champion's sampled answers that the verifier passed, as training rows (``SNAPSHOT_SCHEMA``).

    Args:
        checkpoint: the champion's checkpoint (its calibrated distribution is sampled).
        task: the task's snapshot whose split is answered (opened once by the caller; the verifier scores
            against the same snapshot).
        split: ``dev`` or ``val`` (open splits the trainer does not train on; test and holdout never
            answer per item).
        families: only questions of these families (None: every question).
        seed: the sampling seed.
        home: the EnvLoop home.
        sandboxed: run the verifier in its sandbox (the default) or in process.

    Raises:
        ValueError: a hidden split or train, or a selection with no question.
    """
    from envloop_pipelines.core.environments.decision import DecisionEnvironment
    from envloop_pipelines.core.decision_loop.synthesis import with_provenance
    from envloop_pipelines.core.model.checkpoint import checkpoint_hash
    from envloop_pipelines.core.model.predict import DecisionModel

    if split not in ALLOWED_SPLITS or split in HIDDEN_SPLITS:
        raise ValueError(f"self-answers sample on {' or '.join(ALLOWED_SPLITS)} (labels the trainer never sees, a "
                         f"verifier that answers per item), got {split!r}")
    name = task.manifest.task
    inputs = task.table(split).select(INPUT_SCHEMA.names)  # the inputs only: labels stay with the verifier
    if families is not None:
        inputs = inputs.filter(pc.is_in(inputs.column("family"), value_set=pa.array(list(families), pa.string())))
    if inputs.num_rows == 0:
        raise ValueError(f"no question of task {name!r} split {split!r}" + (f" in families {list(families)}" if families else ""))
    model = DecisionModel.load(checkpoint)
    predictions = model.predict(inputs)
    picks = sample_options([p.probs for p in predictions], seed)
    keys = inputs.column("option_keys").to_pylist()
    answers = {f"{r}#{q}": keys[n][picks[n]] for n, (r, q) in enumerate(
        zip(inputs.column("record_id").to_pylist(), inputs.column("question_id").to_pylist()))}
    env = DecisionEnvironment(name, split, snapshot_id=task.snapshot_id, home=home, sandboxed=sandboxed)
    run = env.evaluate(answers)
    if run.report is None:
        raise RuntimeError(f"the verifier did not report on the self-answers: {run.error or run.status}")
    verdict = {(i.record_id, i.question_id): i.correct for i in run.report.items}
    rows, provenance, sampled_p, soft = [], [], [], 0
    sha = checkpoint_hash(checkpoint)
    for n, row in enumerate(inputs.to_pylist()):
        correct = verdict.get((row["record_id"], row["question_id"]))
        sampled_p.append(float(predictions[n].probs[picks[n]]))
        if correct is None:
            soft += 1  # a soft-labelled question has no right option to keep
            continue
        if not correct:
            continue
        rows.append({**row, "record_id": f"{row['record_id']}~self-{split}", "label": picks[n], "soft_label": None})
        provenance.append(json.dumps({"generator": GENERATOR_NAME, "split": split, "source_record": row["record_id"],
                                      "question_id": row["question_id"], "sampled_option": keys[n][picks[n]],
                                      "sampled_probability": round(sampled_p[-1], 6), "checkpoint_sha256": sha,
                                      "seed": seed}, sort_keys=True))
    table = pa.Table.from_pylist(rows, schema=QUESTION_SCHEMA) if rows else QUESTION_SCHEMA.empty_table()
    stats = SelfAnswerStats(split=split, checkpoint_sha256=sha, n_questions=inputs.num_rows, n_passed=len(rows),
                            n_soft_skipped=soft, pass_rate=len(rows) / max(1, inputs.num_rows - soft),
                            mean_sampled_probability=float(np.mean(sampled_p)))
    return with_provenance(table, provenance), stats


class SelfAnswerGenerator:
    """Environment generator: the champion's verified self-answers on the clusters' families (see the module docstring).

    Args:
        checkpoint: the champion's checkpoint.
        task: the task.
        home: the EnvLoop home.
        split: the split answered (``dev`` or ``val``).
    """

    name = GENERATOR_NAME

    def __init__(self, checkpoint: str | Path, task: str, home: str | Path | None = None, split: str = "dev") -> None:
        self.checkpoint, self.task, self.home, self.split = checkpoint, task, home, split
        self.stats: SelfAnswerStats | None = None

    def synthesize(self, request: Any, train: pa.Table) -> pa.Table:
        """Verified self-answers on the clusters' families, at most ``request.n_examples`` (a seeded choice)."""
        families = sorted({c.key["family"] for c in request.clusters if c.key.get("family")}) or None
        # Built by name (a generator's JSON arguments), it opens the task once per call and hands the snapshot on.
        table, self.stats = verified_self_answers(self.checkpoint, open_task(self.task, home=self.home),
                                                  split=self.split, families=families, seed=request.seed,
                                                  home=self.home)
        if table.num_rows > request.n_examples:
            keep = np.sort(np.random.default_rng(request.seed).choice(table.num_rows, request.n_examples, replace=False))
            table = table.take(pa.array(keep))
        return table


__all__ = ["ALLOWED_SPLITS", "GENERATOR_NAME", "SelfAnswerGenerator", "SelfAnswerStats", "sample_options",
           "verified_self_answers"]
