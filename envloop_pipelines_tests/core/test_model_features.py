"""Frozen lower layers and their feature cache: hits, invalidation, exact predictions, training on top."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

from envloop_pipelines.core.data.question_table import questions_table
from envloop_pipelines.core.model import features
from envloop_pipelines.core.model.readout import as_questions
from envloop_pipelines.core.model.predict import DecisionModel, predictions_from_table
from envloop_pipelines.core.model.recipe import Recipe, RecipeError, recipe_hash
from envloop_pipelines.core.model.checkpoint import read_predictions
from envloop_pipelines.core.model.trainable_model import build_trainable_model
from envloop_pipelines.core.model.training import train_checkpoint
from envloop_pipelines.core.model.training_data import LengthGroupedSampler
from envloop_pipelines.core.tokens import packaged_model_dir
from envloop_pipelines_tests.core.test_model_data import limit_threads_under_xdist, make_records, make_table

limit_threads_under_xdist()

RECIPE = Recipe(max_length=128, epochs=4, batch_size=8, eval_batch_size=16, lr=2e-3, head_lr=5e-3, seed=0,
                frozen_layers=4, length_grouped=True)


@pytest.fixture(autouse=True)
def _fresh_caches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sees its own disk cache and an empty process cache."""
    monkeypatch.setenv("ENVLOOP_FEATURE_CACHE", str(tmp_path / "features"))
    monkeypatch.setattr(features, "_CACHES", {})


@pytest.fixture(scope="module")
def val_table() -> pa.Table:
    return make_table(10, seed=1, start=500)


def test_defaults_keep_old_recipe_hashes() -> None:
    """The two keys are new: at their defaults a recipe hashes as before they existed."""
    old = Recipe(max_length=128)
    from envloop_pipelines.core.model.recipe import recipe_to_dict

    assert "frozen_layers" not in recipe_to_dict(old) and "length_grouped" not in recipe_to_dict(old)
    assert recipe_hash(old) != recipe_hash(old.replace(frozen_layers=4))
    with pytest.raises(RecipeError, match="frozen_layers"):
        Recipe(readout="label_token", frozen_layers=2, lora={"target_modules": ["q_proj"]})


def test_too_many_frozen_layers_is_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="recipe field 'frozen_layers': 6 leaves no layer"):
        build_trainable_model(RECIPE.replace(frozen_layers=6))


def test_lora_lands_only_above_the_frozen_layers() -> None:
    model, _ = build_trainable_model(RECIPE)
    lora = {n for n, p in model.named_parameters() if "lora_" in n and p.requires_grad}
    layers = {int(n.split(".layer.")[1].split(".")[0]) for n in lora}
    assert layers == {4, 5}


def test_cache_hits_and_invalidation(tmp_path: Path) -> None:
    base = packaged_model_dir()
    cache = features.cache_for(base, 4)
    model, _ = build_trainable_model(RECIPE)
    assert model.feature_cache is cache
    (item,) = model.encode_many(as_questions(make_table(1))[:1])
    first = model.lower_features(item)
    assert cache.stats()["misses"] == 1
    again = model.lower_features(item)
    assert cache.stats()["hits"] == 1 and again is first
    # On disk, content-addressed under a namespace of (weights, tokenizer, K, format).
    files = list((tmp_path / "features").glob("*/*/*.npy"))
    assert len(files) == 1 and files[0].stem == features.sequence_key(item.input_ids, item.token_type_ids)
    manifest = json.loads((files[0].parent.parent / "manifest.json").read_text())
    assert manifest["frozen_layers"] == 4 and manifest["weights_sha256"] == features.base_identity(base)["weights_sha256"]
    # A new process (an empty memory level) reads the disk level.
    features._CACHES.clear()
    fresh = features.cache_for(base, 4)
    assert torch.equal(fresh.get(files[0].stem), first) and fresh.stats()["disk_hits"] == 1
    # Another layer count, another text, or another model: misses.
    assert features.cache_for(base, 3).namespace != fresh.namespace
    other = list(item.input_ids)
    other[1] += 1
    assert fresh.get(features.sequence_key(other, item.token_type_ids)) is None
    changed = tmp_path / "model"
    shutil.copytree(base, changed)
    with open(changed / "model.safetensors", "ab") as fh:
        fh.write(b"\0")
    assert features.namespace(features.base_identity(changed), 4) != fresh.namespace


def test_the_disk_level_is_bounded(tmp_path: Path) -> None:
    cache = features.FeatureCache("ns", directory=tmp_path / "bounded", disk_bytes=3000, memory_bytes=10_000)
    for i in range(10):
        cache.put(f"{i:064x}", torch.full((4, 64), float(i)))  # 1,152 bytes each as .npy
    kept = cache.prune()
    assert kept <= 3000
    left = sorted(p.stem for p in (tmp_path / "bounded" / "ns").glob("*/*.npy"))
    assert left and left[-1] == f"{9:064x}"  # the newest stay
    assert cache.stats()["bytes_in_memory"] <= 10_000


def test_length_grouped_batches_hold_similar_lengths_and_every_question_once() -> None:
    lengths = list(np.random.default_rng(0).integers(20, 300, size=203))
    order = list(LengthGroupedSampler(lengths, 8, torch.Generator().manual_seed(0)))
    assert sorted(order) == list(range(203))
    spread = [np.ptp([lengths[i] for i in order[s:s + 8]]) for s in range(0, 200, 8)]
    random_spread = [np.ptp(lengths[s:s + 8]) for s in range(0, 200, 8)]
    assert np.mean(spread) < 0.5 * np.mean(random_spread)
    assert order == list(LengthGroupedSampler(lengths, 8, torch.Generator().manual_seed(0)))  # seeded


def test_training_on_top_learns_and_predictions_do_not_depend_on_the_cache(val_table: pa.Table, tmp_path: Path) -> None:
    train = questions_table(make_records(24))
    out = train_checkpoint(train, val_table, RECIPE, tmp_path / "ckpt", data_hash="snap-1")
    metrics = json.loads((out / "metrics.json").read_text())["train"]
    losses = [e["mean_loss"] for e in metrics["epochs"]]
    assert losses[-1] < losses[0] - 0.05, losses
    assert metrics["feature_pass"]["computed"] > 0
    saved = predictions_from_table(read_predictions(out))
    # From the warm cache (memory), from the disk level alone, and with no cache at all: the same bits.
    warm = DecisionModel.load(out).predict(val_table)
    features._CACHES.clear()
    from_disk = DecisionModel.load(out).predict(val_table)
    features._CACHES.clear()
    shutil.rmtree(tmp_path / "features")
    cold = DecisionModel.load(out)
    cold.model.feature_cache = None
    uncached = cold.predict(val_table)
    for runs in zip(saved, warm, from_disk, uncached):
        assert all(np.array_equal(runs[0].logits, r.logits) for r in runs[1:])
