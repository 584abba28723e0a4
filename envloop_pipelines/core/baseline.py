"""The classical baseline: TF-IDF + logistic regression per family (scikit-learn).

Every re-evaluation scores it on the same snapshot beside the candidate, so a
user sees what the simple tool would have given. The classifiers are the
lexical readout's (:class:`~envloop_pipelines.core.model.lexical.LexicalModel`:
one per family over the option keys seen in training; a question's
probabilities are the classifier's over its own options plus a small floor,
renormalised), then temperature-calibrated on val like the neural models.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from envloop_pipelines.core.model.calibration import DEFAULT_SAFETY_FNR_TARGET, Calibration, fit_calibration
from envloop_pipelines.core.model.lexical import LexicalModel
from envloop_pipelines.core.model.readout import as_questions


@dataclass
class TfidfBaseline:
    """Per-family TF-IDF + logistic regression, calibrated on val."""

    max_features: int = 50_000
    c: float = 4.0
    seed: int = 0
    #: Declared safety families: TF-IDF gets its own thresholds on val for the same target, so its
    #: deferral and automated FNR compare with the model's on equal terms.
    safety_families: tuple[str, ...] = ()
    safety_fnr_target: float = DEFAULT_SAFETY_FNR_TARGET
    lexical: LexicalModel | None = None
    calibration: Calibration = field(default_factory=Calibration)

    def fit(self, train: pa.Table, val: pa.Table | None = None) -> "TfidfBaseline":
        self.lexical = LexicalModel(max_features=self.max_features, c=self.c, seed=self.seed).fit(as_questions(train))
        if val is not None and val.num_rows:
            vq = [q for q in as_questions(val) if q.label is not None]
            self.calibration = fit_calibration(
                self.lexical.log_probs(vq), [q.label for q in vq], [q.type for q in vq],
                soft_labels=[None if q.soft_label is None else np.asarray(q.soft_label) for q in vq],
                families=[q.family for q in vq], safety_families=tuple(self.safety_families),
                safety_fnr_target=self.safety_fnr_target,
            )
        return self

    def predict_table(self, table: pa.Table) -> pa.Table:
        """Calibrated predictions in the model's prediction schema (written by the model's
        :func:`~envloop_pipelines.core.model.predict.predictions_table`; nothing is truncated)."""
        from envloop_pipelines.core.model.predict import QuestionPrediction, predictions_table

        if self.lexical is None:
            raise RuntimeError("TfidfBaseline.predict_table before fit")
        questions = as_questions(table)
        logits = self.lexical.log_probs(questions)
        return predictions_table([
            QuestionPrediction(record_id=q.record_id, question_id=q.question_id, family=q.family, type=q.type,
                               option_keys=q.option_keys, probs=self.calibration.apply(z, q.type), logits=z,
                               truncated=False, n_state_tokens_dropped=0)
            for z, q in zip(logits, questions)
        ])
