"""The classical baseline: TF-IDF + logistic regression per family (scikit-learn).

Every re-evaluation scores it on the same snapshot beside the candidate, so a
user sees what the simple tool would have given. One classifier per family
over the option keys seen in training; a question's probabilities are the
classifier's over its own options (unseen options get a small floor),
renormalised, then temperature-calibrated on val like the neural models.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from envloop_pipelines.core.model.calibration import Calibration, fit_calibration

_UNSEEN_FLOOR = 1e-3


def _text(row: dict[str, Any]) -> str:
    options = " ".join(f"{k} {t or ''}" for k, t in zip(row["option_keys"], row["option_texts"]))
    return f"{row['instructions_text']} || {options} || {row['state_text']}"


@dataclass
class TfidfBaseline:
    """Per-family TF-IDF + logistic regression, calibrated on val."""

    max_features: int = 50_000
    c: float = 4.0
    seed: int = 0
    models: dict[str, Any] = field(default_factory=dict)
    calibration: Calibration = field(default_factory=Calibration)

    def fit(self, train: pa.Table, val: pa.Table | None = None) -> "TfidfBaseline":
        from sklearn.feature_extraction.text import TfidfVectorizer
        from sklearn.linear_model import LogisticRegression
        from sklearn.pipeline import make_pipeline

        rows = [r for r in train.to_pylist() if r.get("label") is not None]
        by_family: dict[str, list[dict[str, Any]]] = {}
        for r in rows:
            by_family.setdefault(r["family"], []).append(r)
        for family, items in sorted(by_family.items()):
            y = [it["option_keys"][it["label"]] for it in items]
            if len(set(y)) < 2:
                self.models[family] = ("constant", y[0])
                continue
            pipe = make_pipeline(
                TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True, min_df=1, max_features=self.max_features),
                LogisticRegression(C=self.c, max_iter=2000, random_state=self.seed),
            )
            pipe.fit([_text(it) for it in items], y)
            self.models[family] = ("lr", pipe)
        if val is not None and val.num_rows:
            vrows = [r for r in val.to_pylist() if r.get("label") is not None]
            logits = [np.log(p) for p in self._probs(vrows)]
            self.calibration = fit_calibration(
                logits, [r["label"] for r in vrows], [r["type"] for r in vrows],
                soft_labels=[None if r.get("soft_label") is None else np.asarray(r["soft_label"]) for r in vrows],
            )
        return self

    def _probs(self, rows: list[dict[str, Any]]) -> list[np.ndarray]:
        out: list[np.ndarray | None] = [None] * len(rows)
        by_family: dict[str, list[int]] = {}
        for i, r in enumerate(rows):
            by_family.setdefault(r["family"], []).append(i)
        for family, idx in by_family.items():
            model = self.models.get(family)
            if model is None or model[0] == "constant":
                for i in idx:
                    keys = rows[i]["option_keys"]
                    p = np.full(len(keys), _UNSEEN_FLOOR)
                    if model is not None and model[1] in keys:
                        p[keys.index(model[1])] = 1.0
                    out[i] = p / p.sum()
                continue
            pipe = model[1]
            classes = list(pipe.classes_)
            proba = pipe.predict_proba([_text(rows[i]) for i in idx])
            for row_p, i in zip(proba, idx):
                keys = rows[i]["option_keys"]
                p = np.array([row_p[classes.index(k)] if k in classes else 0.0 for k in keys]) + _UNSEEN_FLOOR
                out[i] = p / p.sum()
        return out  # type: ignore[return-value]

    def predict_table(self, table: pa.Table) -> pa.Table:
        """Calibrated predictions in the model's prediction schema."""
        from envloop_pipelines.core.model.predict import PREDICTION_SCHEMA

        rows = table.to_pylist()
        probs = self._probs(rows)
        logits = [np.log(p) for p in probs]
        calibrated = [self.calibration.apply(z, r["type"]) for z, r in zip(logits, rows)]
        return pa.table(
            {
                "record_id": [r["record_id"] for r in rows],
                "question_id": [r["question_id"] for r in rows],
                "family": [r["family"] for r in rows],
                "type": [r["type"] for r in rows],
                "option_keys": [list(r["option_keys"]) for r in rows],
                "probs": [np.asarray(p, dtype=np.float64).tolist() for p in calibrated],
                "logits": [np.asarray(z, dtype=np.float32).tolist() for z in logits],
                "truncated": [False] * len(rows),
                "n_state_tokens_dropped": [0] * len(rows),
            },
            schema=PREDICTION_SCHEMA,
        )
