"""The hybrid readout's lexical part, fitted after training: :func:`fit_lexical_readout` (recipe key ``lexical``).

The lexical model is fitted on the training questions; its fusion weight (``w`` in
``z_head + w · log p_lexical``) is the one of :data:`~envloop_pipelines.core.model.lexical.WEIGHT_GRID`
with the lowest calibrated val NLL (:func:`~envloop_pipelines.core.model.lexical.fit_lexical_weight`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from envloop_pipelines.core.model.lexical import LexicalModel, fit_lexical_weight, head_share
from envloop_pipelines.core.model.predict import QuestionPrediction
from envloop_pipelines.core.model.readout import QuestionInput
from envloop_pipelines.core.model.recipe import Recipe

log = logging.getLogger(__name__)


def fit_lexical_readout(recipe: Recipe, train_q: Sequence[QuestionInput], val_q: Sequence[QuestionInput],
                        val_raw: Sequence[QuestionPrediction]) -> tuple[LexicalModel, dict[str, Any]]:
    """The hybrid readout's lexical part: fitted on train, its fusion weight chosen on val (calibrated NLL).

    Args:
        recipe: The recipe (its ``seed`` and ``error_budget``).
        train_q: The training questions the lexical model is fitted on.
        val_q: The validation questions the weight is chosen on.
        val_raw: The trained head's uncalibrated predictions on ``val_q``.

    Returns:
        The fitted lexical model (its ``weight`` set) and what the fit found, for ``metrics.json``
        (``train.lexical``): the weight, the val NLL of each weight tried, the head's share, seconds, families.
    """
    t0 = time.perf_counter()
    lexical = LexicalModel(seed=recipe.seed).fit(train_q)
    weight, tried = fit_lexical_weight([p.logits for p in val_raw], lexical.log_probs(val_q), val_q,
                                       error_budget=recipe.error_budget)
    lexical.weight = weight
    share = head_share([p.logits for p in val_raw], lexical.log_probs(val_q), weight)
    log.info("lexical readout: weight %g on val (calibrated val NLL by weight: %s); the head's share %s", weight,
             tried, "n/a" if share is None else f"{share:.2f}")
    return lexical, {"weight": weight, "val_nll_by_weight": tried, "head_share": share,
                     "seconds": time.perf_counter() - t0, "families": len(lexical.families)}


__all__ = ["fit_lexical_readout"]
