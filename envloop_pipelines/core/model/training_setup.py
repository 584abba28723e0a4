"""A training run made ready before its first step: :func:`prepare_run`.

The questions are checked (:func:`labelled_questions`: some to train on, some to calibrate on, each
with a label or soft label), the model is built (:func:`~envloop_pipelines.core.model.trainable_model.build_trainable_model`),
the training questions encoded, and with ``frozen_layers`` the frozen layers run once per distinct
input, so that the step times of training measure training alone. What preparing found goes to
``metrics.json`` (``train.feature_pass``, ``train.family_slots``, the parameter counts).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from envloop_pipelines.core.data.records import Record
from envloop_pipelines.core.model.readout import Encoded, QuestionInput, ReadoutModel, as_questions
from envloop_pipelines.core.model.recipe import Recipe
from envloop_pipelines.core.model.trainable_model import build_trainable_model
from envloop_pipelines.core.model.training_data import _Collator, _QuestionDataset, _targets

log = logging.getLogger(__name__)

#: What :func:`~envloop_pipelines.core.model.training.train_checkpoint` takes as a split.
TableLike = pa.Table | Sequence[Record] | Sequence[QuestionInput]


@dataclass
class PreparedRun:
    """The model and its training data, made ready before the first step, and what preparing them found."""

    model: ReadoutModel
    init_hash: str | None
    encoded: list[Encoded]
    dataset: _QuestionDataset
    collator: _Collator
    feature_pass: dict[str, Any] | None
    family_slots: dict[str, int] | None
    n_trainable: int
    n_total: int

    @property
    def n_truncated(self) -> int:
        return sum(e.truncated for e in self.encoded)


def labelled_questions(
    train_table: TableLike, val_table: TableLike, eval_table: TableLike | None
) -> tuple[list[QuestionInput], list[QuestionInput], list[QuestionInput], list[np.ndarray]]:
    """The train, val and eval questions (eval: val unless given) and the training targets.

    Raises:
        ValueError: no training or no val question, or one of them without a label or soft label.
    """
    train_q, val_q = as_questions(train_table), as_questions(val_table)
    eval_q = val_q if eval_table is None else as_questions(eval_table)
    if not train_q:
        raise ValueError("train: no questions to train on")
    if not val_q:
        raise ValueError("val: no questions to calibrate on")
    train_targets = _targets(train_q, "train")
    _targets(val_q, "val")
    return train_q, val_q, eval_q, train_targets


def prepare_run(recipe: Recipe, train_q: Sequence[QuestionInput], train_targets: Sequence[np.ndarray],
                init_from: str | Path | None) -> PreparedRun:
    """Build the model (:func:`build_trainable_model`), encode the training questions, run the feature pass."""
    model, init_hash = build_trainable_model(recipe, init_from=init_from)
    encoded = model.encode_many(train_q)
    n_trunc = sum(e.truncated for e in encoded)
    if n_trunc:
        log.warning("train: %d of %d questions had their state truncated to max_length=%d", n_trunc, len(encoded), recipe.max_length)
    return PreparedRun(
        model=model,
        init_hash=init_hash,
        encoded=encoded,
        feature_pass=_feature_pass(model, encoded),
        family_slots=_family_slots(train_q) if recipe.family_head else None,
        n_trainable=sum(p.numel() for p in model.parameters() if p.requires_grad),
        n_total=sum(p.numel() for p in model.parameters()),
        dataset=_QuestionDataset(encoded, train_targets),
        collator=_Collator(model),
    )


def _feature_pass(model: ReadoutModel, encoded: Sequence[Encoded]) -> dict[str, Any] | None:
    """With ``frozen_layers``: run the frozen layers once per distinct training input (or find them cached).

    Done before the first step so that step times measure training alone; what it found and
    computed is recorded in ``metrics.json`` (``train.feature_pass``).
    """
    cache = getattr(model, "feature_cache", None)
    if not getattr(model, "frozen_layers", 0) or cache is None:
        return None
    before, started = cache.stats(), time.perf_counter()
    for e in encoded:
        model.lower_features(e)
    after = cache.stats()
    return {"seconds": round(time.perf_counter() - started, 3), "computed": after["misses"] - before["misses"],
            "reused_from_memory": after["hits"] - before["hits"],
            "reused_from_disk": after["disk_hits"] - before["disk_hits"]}


def _family_slots(questions: Sequence[QuestionInput]) -> dict[str, int]:
    """With ``family_head``: each training family's parameter slot (recorded in ``metrics.json``).

    Two families on one slot share their per-family parameters (the hash is fixed, so they always
    will): said in a warning, since each then reads a mix of both families' parameters.
    """
    from envloop_pipelines.core.model.decision_head import family_slot

    slots = {f: family_slot(f) for f in sorted({q.family for q in questions})}
    by_slot: dict[int, list[str]] = {}
    for family, slot in slots.items():
        by_slot.setdefault(slot, []).append(family)
    for slot, names in by_slot.items():
        if len(names) > 1:
            log.warning("family_head: families %s share parameter slot %d", names, slot)
    return slots


__all__ = ["PreparedRun", "TableLike", "labelled_questions", "prepare_run"]
