"""Inference precision: a bf16 checkpoint is calibrated, verified and served on the same bf16 numbers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from envloop_pipelines.core.data.question_table import questions_table
from envloop_pipelines.core.model import features
from envloop_pipelines.core.model.calibration import fit_calibration
from envloop_pipelines.core.model.checkpoint import load_checkpoint, read_predictions
from envloop_pipelines.core.model.predict import DecisionModel, predict_table, predictions_from_table
from envloop_pipelines.core.model.readout import as_questions
from envloop_pipelines.core.model.recipe import Recipe, RecipeError, recipe_from_dict, recipe_to_dict
from envloop_pipelines.core.model.training import train_checkpoint
from envloop_pipelines_tests.core.test_model_data import limit_threads_under_xdist, make_records, make_table

limit_threads_under_xdist()


@pytest.fixture(autouse=True)
def _fresh_caches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENVLOOP_FEATURE_CACHE", str(tmp_path / "features"))
    monkeypatch.setattr(features, "_CACHES", {})


def test_the_field_is_validated_and_leaves_old_hashes_alone() -> None:
    assert "inference_precision" not in recipe_to_dict(Recipe())
    assert recipe_to_dict(Recipe(inference_precision="bf16"))["inference_precision"] == "bf16"
    with pytest.raises(RecipeError, match="inference_precision"):
        recipe_from_dict({"inference_precision": "int4"})
    with pytest.raises(ValueError, match="precision must be fp32 or bf16"):
        DecisionModel(object(), precision="fp16")  # type: ignore[arg-type]  # checked before the model is used


def test_a_bf16_checkpoint_is_calibrated_on_what_it_serves(tmp_path: Path) -> None:
    """The val pass the calibration is fitted on, the recorded predictions, a reload, and the verifier's
    predictions (``predict_table``, with and without its cache) are the same bf16 bits; fp32 differs."""
    recipe = Recipe(max_length=128, max_steps=3, batch_size=8, eval_batch_size=16, inference_precision="bf16")
    train, val = questions_table(make_records(24)), make_table(10, seed=1, start=500)
    out = train_checkpoint(train, val, recipe, tmp_path / "ckpt", data_hash="snap-1")
    saved = predictions_from_table(read_predictions(out))
    loaded = DecisionModel.load(out)
    assert loaded.precision == "bf16"
    again = loaded.predict(val)
    assert all(np.array_equal(a.logits, b.logits) and np.array_equal(a.probs, b.probs) for a, b in zip(saved, again))
    cache = tmp_path / "predictions"
    for table in (predict_table(out, val), predict_table(out, val, cache_dir=cache),
                  predict_table(out, val, cache_dir=cache)):
        assert table.column("logits").to_pylist() == [list(np.float32(p.logits)) for p in saved]

    # The same weights in fp32 answer with other numbers: the format is part of what was calibrated.
    ckpt = load_checkpoint(out)
    fp32 = DecisionModel(ckpt.model, ckpt.calibration, batch_size=16, precision="fp32").predict(val)
    assert not all(np.array_equal(a.logits, b.logits) for a, b in zip(saved, fp32))
    assert max(float(np.max(np.abs(a.logits - b.logits))) for a, b in zip(saved, fp32)) < 0.5

    # The stored temperature is the one val's bf16 logits give.
    questions = as_questions(val)
    refit = fit_calibration([p.logits for p in again], [q.label for q in questions], [q.type for q in questions],
                            soft_labels=[None if q.soft_label is None else np.asarray(q.soft_label) for q in questions], error_budget=recipe.error_budget,
                            families=[q.family for q in questions])
    stored = json.loads((out / "calibration.json").read_text())
    assert refit.to_dict()["temperatures"] == stored["temperatures"]
