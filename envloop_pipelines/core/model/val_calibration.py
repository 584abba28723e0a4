"""Calibration on val after training: :func:`calibrate_on_val`.

The trained model predicts val; with a hybrid readout (recipe key ``lexical``) the lexical part is
fitted and fused into those logits first; then the per-type temperatures, the automation threshold
at ``recipe.error_budget`` and the safety families' thresholds are fitted on them
(:func:`~envloop_pipelines.core.model.calibration.fit_calibration`). The calibrated model then
predicts the eval split (val itself unless another is given).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from envloop_pipelines.core.model.calibration import Calibration, fit_calibration
from envloop_pipelines.core.model.lexical import LexicalModel, fuse
from envloop_pipelines.core.model.lexical_fit import fit_lexical_readout
from envloop_pipelines.core.model.predict import DecisionModel, QuestionPrediction
from envloop_pipelines.core.model.readout import QuestionInput, ReadoutModel
from envloop_pipelines.core.model.recipe import Recipe


@dataclass(frozen=True)
class ValCalibration:
    """What calibrating a trained model on val gave.

    Attributes:
        calibration: The fitted calibration (``calibration.json``).
        lexical: The hybrid readout's lexical part, or None without one.
        lexical_fit: What its fit found (``metrics.json`` ``train.lexical``), or None.
        val_raw: The val predictions before calibration (the lexical part fused in, if any).
        val_calibrated: The same predictions calibrated.
        eval_predictions: The calibrated predictions on the eval split (``predictions.parquet``).
    """

    calibration: Calibration
    lexical: LexicalModel | None
    lexical_fit: dict[str, Any] | None
    val_raw: list[QuestionPrediction]
    val_calibrated: list[QuestionPrediction]
    eval_predictions: list[QuestionPrediction]


def calibrate_on_val(
    model: ReadoutModel,
    recipe: Recipe,
    train_q: Sequence[QuestionInput],
    val_q: Sequence[QuestionInput],
    eval_q: Sequence[QuestionInput] | None,
    *,
    safety_families: Sequence[str],
    safety_fnr_target: float,
) -> ValCalibration:
    """Fit the lexical part (hybrid readout) and the calibration on val, and predict the eval split.

    Args:
        model: The trained model, in eval mode.
        recipe: The recipe (batch size and precision of inference, ``lexical``, ``error_budget``).
        train_q: The training questions (the lexical part is fitted on them).
        val_q: The labelled validation questions.
        eval_q: The eval split's questions, or None when it is val itself.
        safety_families: Declared safety families, each given a threshold for ``safety_fnr_target``.
        safety_fnr_target: The val false-negative rate of those thresholds.
    """
    dm = DecisionModel(model, None, batch_size=recipe.eval_batch_size, precision=recipe.inference_precision)
    val_raw = dm.predict(val_q)
    lexical, lexical_fit = fit_lexical_readout(recipe, train_q, val_q, val_raw) if recipe.lexical else (None, None)
    if lexical is not None:
        dm.lexical = lexical
        val_raw = [dataclasses.replace(p, logits=z) for p, z in
                   zip(val_raw, fuse([p.logits for p in val_raw], lexical.log_probs(val_q), lexical.weight or 0.0))]
    calibration = fit_calibration(
        [p.logits for p in val_raw],
        [q.label if q.label is not None else -1 for q in val_q],
        [q.type for q in val_q],
        soft_labels=[None if q.soft_label is None else np.asarray(q.soft_label) for q in val_q],
        error_budget=recipe.error_budget,
        families=[q.family for q in val_q],
        safety_families=tuple(safety_families),
        safety_fnr_target=safety_fnr_target,
    )
    dm.calibration = calibration
    val_cal = dm.recalibrate(val_raw)
    eval_preds = val_cal if eval_q is None else dm.predict(eval_q)
    return ValCalibration(calibration=calibration, lexical=lexical, lexical_fit=lexical_fit, val_raw=val_raw,
                          val_calibrated=val_cal, eval_predictions=eval_preds)


__all__ = ["ValCalibration", "calibrate_on_val"]
