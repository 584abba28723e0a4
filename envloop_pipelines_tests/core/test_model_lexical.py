"""The lexical readout: scikit-learn's numbers from stored arrays, the baseline on it, the hybrid checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from envloop_pipelines.core.baseline import TfidfBaseline
from envloop_pipelines.core.data.question_table import questions_table
from envloop_pipelines.core.model import features
from envloop_pipelines.core.model.checkpoint import CheckpointIntegrityError, load_checkpoint, read_predictions
from envloop_pipelines.core.model.lexical import LEXICAL_JSON, LexicalModel, fit_lexical_weight, lexical_text
from envloop_pipelines.core.model.predict import DecisionModel, predictions_from_table
from envloop_pipelines.core.model.readout import QuestionInput, as_questions
from envloop_pipelines.core.model.recipe import Recipe, recipe_to_dict
from envloop_pipelines.core.model.training import train_checkpoint
from envloop_pipelines_tests.core.test_model_data import limit_threads_under_xdist, make_records, make_table

limit_threads_under_xdist()

_LEVELS = ("INFO", "WARN", "ERROR", "CRITICAL")
_FILLER = "disk cache node queue retry shard token worker latency gateway".split()


def _log_questions(n: int, seed: int) -> list[QuestionInput]:
    """A 4-level severity question whose answer is a word of the state, and a yes/no one keyed on a word."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        level = int(rng.integers(0, 4))
        state = json.dumps({"msg": " ".join(rng.choice(_FILLER, 6)), "level": _LEVELS[level]})
        out.append(QuestionInput(f"log{seed}-{i}", "severity", "score", "severity", state,
                                 "Severity 0-3 from the log record. Policy: INFO=0, WARN=1, ERROR=2, CRITICAL=3",
                                 ("0", "1", "2", "3"), ("info", "warn", "error", "critical"), level))
        angry = int(rng.integers(0, 2))
        text = " ".join(rng.choice(_FILLER, 5)) + (" furious" if angry else " thanks")
        out.append(QuestionInput(f"tk{seed}-{i}", "angry", "noul", "angry", text, "Is the customer angry?",
                                 ("true", "false"), (None, None), 0 if angry else 1))
    return out


def test_probabilities_are_scikit_learns_and_survive_a_round_trip(tmp_path: Path) -> None:
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline

    train, test = _log_questions(60, 0), _log_questions(20, 1)
    model = LexicalModel().fit(train)
    ours = model.log_probs(test)
    for family in ("severity", "angry"):
        tr = [q for q in train if q.family == family]
        te = [(i, q) for i, q in enumerate(test) if q.family == family]
        pipe = make_pipeline(TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True, max_features=50_000),
                             LogisticRegression(C=4.0, max_iter=2000, random_state=0))
        pipe.fit([lexical_text(q) for q in tr], [q.option_keys[q.label] for q in tr])
        proba = pipe.predict_proba([lexical_text(q) for _, q in te])
        for row, (i, q) in zip(proba, te):
            p = np.array([row[list(pipe.classes_).index(k)] for k in q.option_keys]) + 1e-3
            np.testing.assert_allclose(np.exp(ours[i]), p / p.sum(), rtol=0, atol=1e-12)
    # Word-keyed answers: what the encoder found hard, the lexical model reads from 60 examples.
    acc = np.mean([int(np.argmax(lp)) == q.label for lp, q in zip(ours, test)])
    assert acc >= 0.8, acc  # chance: 0.25 and 0.5
    model.weight = 1.5
    model.save(tmp_path)
    again = LexicalModel.load(tmp_path)
    assert again.weight == 1.5
    assert all(np.array_equal(a, b) for a, b in zip(ours, again.log_probs(test)))
    (tmp_path / LEXICAL_JSON).write_text('{"format": "other"}')
    with pytest.raises(ValueError, match=r"lexical\.json: unreadable lexical readout .*format"):
        LexicalModel.load(tmp_path)


def test_unseen_options_and_single_class_families_keep_a_floor() -> None:
    train = [QuestionInput(f"r{i}", "q", "choice", "route", f"text {i}", "Route?", ("a", "b"), (None, None), 0)
             for i in range(4)]
    model = LexicalModel().fit(train)
    q = QuestionInput("x", "q", "choice", "route", "text", "Route?", ("a", "b", "c"), (None, None, None))
    p = np.exp(model.log_probs([q])[0])
    assert p.argmax() == 0 and p[1] == p[2] > 0 and abs(p.sum() - 1) < 1e-12
    unknown = QuestionInput("y", "q", "noul", "other_family", "text", "?", ("true", "false"), (None, None))
    assert np.allclose(np.exp(model.log_probs([unknown])[0]), 0.5)


def test_the_fusion_weight_is_chosen_on_val() -> None:
    """Uninformative head logits: the lexical part gets a positive weight; a perfect head keeps weight 0."""
    train, val = _log_questions(60, 0), _log_questions(30, 2)
    model = LexicalModel().fit(train)
    lex = model.log_probs(val)
    flat = [np.zeros(q.n_options, dtype=np.float32) for q in val]
    w, tried = fit_lexical_weight(flat, lex, val, error_budget=0.05)
    assert w > 0 and tried["0"] > tried[f"{w:g}"]
    perfect = [np.where(np.arange(q.n_options) == q.label, 20.0, -20.0).astype(np.float32) for q in val]
    w, _ = fit_lexical_weight(perfect, lex, val, error_budget=0.05)
    assert w == 0.0


def test_the_baseline_is_the_lexical_model_calibrated() -> None:
    train, val, test = make_table(40, seed=0), make_table(12, seed=1, start=300), make_table(12, seed=2, start=600)
    base = TfidfBaseline().fit(train, val)
    preds = base.predict_table(test)
    lex = LexicalModel().fit(as_questions(train)).log_probs(as_questions(test))
    assert [list(z) for z in preds.column("logits").to_pylist()] == [list(np.float32(z)) for z in lex]
    probs = np.array([sum(p) for p in preds.column("probs").to_pylist()])
    assert np.allclose(probs, 1.0)


@pytest.fixture(autouse=True)
def _fresh_caches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENVLOOP_FEATURE_CACHE", str(tmp_path / "features"))
    monkeypatch.setattr(features, "_CACHES", {})


def test_a_hybrid_checkpoint_serves_what_it_recorded(tmp_path: Path) -> None:
    """Trained with ``lexical: true``: the files are in the manifest, loading reproduces the recorded bits."""
    recipe = Recipe(max_length=128, max_steps=3, batch_size=8, eval_batch_size=16, frozen_layers=5, lexical=True)
    assert recipe_to_dict(recipe)["lexical"] is True and "lexical" not in recipe_to_dict(recipe.replace(lexical=False))
    train, val = questions_table(make_records(24)), make_table(10, seed=1, start=500)
    out = train_checkpoint(train, val, recipe, tmp_path / "ckpt", data_hash="snap-1")
    fit = json.loads((out / "metrics.json").read_text())["train"]["lexical"]
    assert set(fit["val_nll_by_weight"]) >= {"0", "1"} and fit["weight"] in {float(k) for k in fit["val_nll_by_weight"]}
    loaded = load_checkpoint(out)
    assert loaded.lexical is not None and loaded.lexical.weight == fit["weight"]
    saved = predictions_from_table(read_predictions(out))
    again = DecisionModel.load(out).predict(val)
    assert all(np.array_equal(a.logits, b.logits) and np.array_equal(a.probs, b.probs) for a, b in zip(saved, again))
    # The lexical files are part of the identity: removing one is an integrity error, not a silent head-only model.
    (out / LEXICAL_JSON).unlink()
    with pytest.raises(CheckpointIntegrityError, match="lexical.json"):
        load_checkpoint(out)

