"""Lexical readout: per-family TF-IDF + logistic regression over a question's words.

One classifier per question family over the option keys seen in training,
reading ``instructions || options || state`` as word uni- and bigrams. A
question's log-probabilities are the classifier's over its own options plus a
small floor (so an option the family never had in training keeps some mass),
renormalised.

It serves twice:

* as the classical **baseline** every re-evaluation prints (``core/baseline.py``
  calibrates it on val and scores it beside the candidate);
* inside the **hybrid readout** (recipe key ``lexical``): the decision model's
  logits become ``z_head + w · log p_lexical``, with ``w`` fitted on val
  (see :func:`fit_lexical_weight`) before the temperature. Templated records
  often carry the answer as a word (a ``level`` field reading ``ERROR``); a
  linear model over word counts reads such a field from a few dozen examples,
  where the encoder's pooled vectors need many more. The hybrid keeps both.

The fitted model is stored as arrays (``lexical.safetensors``: idf, weights,
intercepts per family) and JSON (``lexical.json``: vocabularies, classes, the
fusion weight), not as a pickle: it loads without executing anything and its
bytes are a function of the fit, so a checkpoint's identity stays meaningful.
Prediction is computed here from those arrays (sparse TF-IDF rows times the
weights, softmax or sigmoid), the same way scikit-learn's ``predict_proba``
does.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from envloop_pipelines.core.model.readout import QuestionInput

#: Probability added to every option (all an option its family's classifier never saw in training gets).
UNSEEN_FLOOR = 1e-3
LEXICAL_JSON = "lexical.json"
LEXICAL_ARRAYS = "lexical.safetensors"
#: Fusion weights tried on val (``w`` in ``z_head + w · log p_lexical``); 0 keeps the head alone.
WEIGHT_GRID: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0)


def lexical_text(q: QuestionInput) -> str:
    """What the classifier reads: instructions, the options (key and description), the state."""
    options = " ".join(f"{k} {t or ''}" for k, t in zip(q.option_keys, q.option_texts))
    return f"{q.instructions_text} || {options} || {q.state_text}"


@dataclass
class _FamilyModel:
    classes: list[str]
    vocabulary: list[str] = field(default_factory=list)
    idf: np.ndarray | None = None
    coef: np.ndarray | None = None          # (n_classes or 1, n_features)
    intercept: np.ndarray | None = None     # (n_classes or 1,)

    @property
    def constant(self) -> bool:
        return self.coef is None


@dataclass
class LexicalModel:
    """Per-family TF-IDF + logistic regression (scikit-learn to fit; numpy to predict).

    Args:
        max_features: vocabulary size per family (uni- and bigrams by frequency).
        c: inverse L2 strength of the logistic regression.
        seed: the solver's random state.
        weight: the fusion weight of the hybrid readout (``None`` until fitted; unused by the baseline).
    """

    max_features: int = 50_000
    c: float = 4.0
    seed: int = 0
    weight: float | None = None
    families: dict[str, _FamilyModel] = field(default_factory=dict)

    # ------------------------------------------------------------------ fit

    def fit(self, questions: Sequence[QuestionInput]) -> "LexicalModel":
        """Fit one classifier per family on the labelled questions."""
        from sklearn.feature_extraction.text import TfidfVectorizer
        from sklearn.linear_model import LogisticRegression

        by_family: dict[str, list[QuestionInput]] = {}
        for q in questions:
            if q.label is not None:
                by_family.setdefault(q.family, []).append(q)
        if not by_family:
            raise ValueError("lexical readout: no labelled questions to fit on")
        self.families = {}
        for family, items in sorted(by_family.items()):
            y = [it.option_keys[it.label] for it in items]  # type: ignore[index]
            if len(set(y)) < 2:
                self.families[family] = _FamilyModel(classes=[y[0]])
                continue
            vec = TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True, min_df=1, max_features=self.max_features,
                                  dtype=np.float64)
            x = vec.fit_transform([lexical_text(it) for it in items])
            lr = LogisticRegression(C=self.c, max_iter=2000, random_state=self.seed).fit(x, y)
            vocab = sorted(vec.vocabulary_, key=vec.vocabulary_.__getitem__)
            self.families[family] = _FamilyModel(
                classes=[str(c) for c in lr.classes_], vocabulary=vocab, idf=np.asarray(vec.idf_, dtype=np.float64),
                coef=np.asarray(lr.coef_, dtype=np.float64), intercept=np.asarray(lr.intercept_, dtype=np.float64),
            )
        self._vectorizers: dict[str, Any] = {}
        return self

    # ------------------------------------------------------------------ predict

    def _vectorizer(self, family: str) -> Any:
        from sklearn.feature_extraction.text import CountVectorizer

        cache = self.__dict__.setdefault("_vectorizers", {})
        if family not in cache:
            fam = self.families[family]
            cache[family] = CountVectorizer(ngram_range=(1, 2), vocabulary={t: i for i, t in enumerate(fam.vocabulary)},
                                            dtype=np.float64)
        return cache[family]

    def _class_probs(self, family: str, texts: list[str]) -> np.ndarray:
        """``predict_proba`` of the family's classifier, from the stored arrays: (n, n_classes)."""
        fam = self.families[family]
        counts = self._vectorizer(family).transform(texts).tocsr()
        counts.data = np.log(counts.data) + 1.0  # sublinear tf
        x = counts.multiply(fam.idf[None, :]).tocsr()
        norms = np.sqrt(np.asarray(x.multiply(x).sum(axis=1)).ravel())
        norms[norms == 0] = 1.0
        x = x.multiply(1.0 / norms[:, None]).tocsr()
        scores = np.asarray(x @ fam.coef.T) + fam.intercept[None, :]  # type: ignore[union-attr,operator]
        if len(fam.classes) == 2:
            p1 = 1.0 / (1.0 + np.exp(-scores[:, 0]))
            return np.stack([1.0 - p1, p1], axis=1)
        scores -= scores.max(axis=1, keepdims=True)
        e = np.exp(scores)
        return e / e.sum(axis=1, keepdims=True)

    def log_probs(self, questions: Sequence[QuestionInput]) -> list[np.ndarray]:
        """Log-probabilities over each question's own options (float64, input order)."""
        out: list[np.ndarray | None] = [None] * len(questions)
        by_family: dict[str, list[int]] = {}
        for i, q in enumerate(questions):
            by_family.setdefault(q.family, []).append(i)
        for family, idx in by_family.items():
            fam = self.families.get(family)
            probs = None if fam is None or fam.constant else self._class_probs(family, [lexical_text(questions[i]) for i in idx])
            for row, i in enumerate(idx):
                keys = questions[i].option_keys
                p = np.full(len(keys), UNSEEN_FLOOR)
                if fam is not None and fam.constant:
                    if fam.classes[0] in keys:
                        p[keys.index(fam.classes[0])] = 1.0
                elif probs is not None:
                    col = {c: j for j, c in enumerate(fam.classes)}  # type: ignore[union-attr]
                    p += np.array([probs[row, col[key]] if key in col else 0.0 for key in keys])
                out[i] = np.log(p / p.sum())
        return out  # type: ignore[return-value]

    # ------------------------------------------------------------------ storage

    def save(self, directory: str | Path) -> None:
        """Write ``lexical.json`` and ``lexical.safetensors`` into ``directory`` (deterministic bytes)."""
        from safetensors.numpy import save_file

        directory = Path(directory)
        tensors: dict[str, np.ndarray] = {}
        meta: dict[str, Any] = {"format": "envloop-lexical/1", "max_features": self.max_features, "c": self.c,
                                "seed": self.seed, "weight": self.weight, "families": {}}
        for i, (family, fam) in enumerate(sorted(self.families.items())):
            meta["families"][family] = {"index": i, "classes": fam.classes, "vocabulary": fam.vocabulary}
            if not fam.constant:
                tensors[f"{i}.idf"] = np.ascontiguousarray(fam.idf)
                tensors[f"{i}.coef"] = np.ascontiguousarray(fam.coef)
                tensors[f"{i}.intercept"] = np.ascontiguousarray(fam.intercept)
        (directory / LEXICAL_JSON).write_text(json.dumps(meta, sort_keys=True, ensure_ascii=True, separators=(",", ":")),
                                              encoding="utf-8")
        save_file(tensors or {"empty": np.zeros(0)}, str(directory / LEXICAL_ARRAYS))

    @classmethod
    def load(cls, directory: str | Path) -> "LexicalModel":
        """Read what :meth:`save` wrote; raises ``ValueError`` naming the file and field at fault."""
        from safetensors.numpy import load_file

        directory = Path(directory)
        path = directory / LEXICAL_JSON
        try:
            meta = json.loads(path.read_text(encoding="utf-8"))
            if meta.get("format") != "envloop-lexical/1":
                raise ValueError(f"format {meta.get('format')!r}, expected 'envloop-lexical/1'")
            arrays = load_file(str(directory / LEXICAL_ARRAYS))
            model = cls(max_features=int(meta["max_features"]), c=float(meta["c"]), seed=int(meta["seed"]),
                        weight=None if meta["weight"] is None else float(meta["weight"]))
            for family, raw in meta["families"].items():
                i = raw["index"]
                if f"{i}.coef" in arrays:
                    model.families[family] = _FamilyModel(list(raw["classes"]), list(raw["vocabulary"]), arrays[f"{i}.idf"],
                                                          arrays[f"{i}.coef"], arrays[f"{i}.intercept"])
                else:
                    model.families[family] = _FamilyModel(list(raw["classes"]))
        except (OSError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}: unreadable lexical readout ({type(exc).__name__}: {exc})") from None
        return model


def fuse(logits: Sequence[np.ndarray], lexical_log_probs: Sequence[np.ndarray], weight: float) -> list[np.ndarray]:
    """The hybrid readout's logits: ``z_head + weight · log p_lexical`` (float32, like the head's)."""
    return [(np.asarray(z, dtype=np.float64) + weight * lp).astype(np.float32) for z, lp in zip(logits, lexical_log_probs)]


def head_share(logits: Sequence[np.ndarray], lexical_log_probs: Sequence[np.ndarray], weight: float) -> float | None:
    """How much of the hybrid's answer is the head's: its part of the fused logits' spread, averaged over questions.

    Per question, each part is centred over its options (a constant shift changes no probability) and
    measured by its mean absolute value: ``share = |z_head| / (|z_head| + weight · |log p_lexical|)``.
    1.0 is the head alone (``weight`` 0), 0.0 the lexical part alone (a head with constant logits).
    """
    shares = []
    for z, lp in zip(logits, lexical_log_probs):
        head = np.abs(np.asarray(z, dtype=np.float64) - np.mean(z)).mean()
        lex = weight * np.abs(np.asarray(lp, dtype=np.float64) - np.mean(lp)).mean()
        if head + lex > 0:
            shares.append(head / (head + lex))
    return float(np.mean(shares)) if shares else None


def fit_lexical_weight(
    logits: Sequence[np.ndarray],
    lexical_log_probs: Sequence[np.ndarray],
    questions: Sequence[QuestionInput],
    *,
    error_budget: float,
    grid: Sequence[float] = WEIGHT_GRID,
) -> tuple[float, dict[str, float]]:
    """The fusion weight with the lowest calibrated NLL on val (ties: the smaller weight).

    Each weight on the grid is scored as it would be served: the fused logits get their own
    per-type temperature fitted on the same questions, then the NLL of the labels is taken.
    Returns the weight and the NLL of every weight tried (recorded in the checkpoint's metrics).
    """
    from envloop_pipelines.core.model.calibration import fit_calibration

    labels = [q.label if q.label is not None else -1 for q in questions]
    types = [q.type for q in questions]
    soft = [None if q.soft_label is None else np.asarray(q.soft_label) for q in questions]
    tried: dict[str, float] = {}
    best_w, best_nll = 0.0, math.inf
    for w in grid:
        fused = fuse(logits, lexical_log_probs, w)
        cal = fit_calibration(fused, labels, types, soft_labels=soft, error_budget=error_budget)
        nll = float(np.mean([-math.log(max(float(cal.apply(z, t)[y]), 1e-12))
                             for z, t, y in zip(fused, types, labels) if y >= 0]))
        tried[f"{w:g}"] = nll
        if nll < best_nll - 1e-9:
            best_w, best_nll = float(w), nll
    return best_w, tried


__all__ = ["LEXICAL_ARRAYS", "LEXICAL_JSON", "LexicalModel", "UNSEEN_FLOOR", "WEIGHT_GRID", "fit_lexical_weight", "fuse", "head_share",
           "lexical_text"]
