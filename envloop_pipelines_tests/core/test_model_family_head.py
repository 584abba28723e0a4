"""The decision head's per-family parameters (recipe key ``family_head``): shapes, zero start, use, training."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

from envloop_pipelines.core.data.question_table import questions_table
from envloop_pipelines.core.model import features
from envloop_pipelines.core.model.checkpoint import read_predictions
from envloop_pipelines.core.model.decision_head import FAMILY_SLOTS, DecisionHead, family_slot
from envloop_pipelines.core.model.predict import DecisionModel, predictions_from_table
from envloop_pipelines.core.model.readout import as_questions
from envloop_pipelines.core.model.recipe import Recipe, RecipeError, recipe_hash, recipe_to_dict
from envloop_pipelines.core.model.trainable_model import IncompatibleInitError, build_trainable_model
from envloop_pipelines.core.model.training import train_checkpoint
from envloop_pipelines_tests.core.test_model_data import limit_threads_under_xdist, make_records, make_table

limit_threads_under_xdist()

RECIPE = Recipe(max_length=128, epochs=4, batch_size=8, eval_batch_size=16, lr=2e-3, head_lr=5e-3, seed=0,
                frozen_layers=4, length_grouped=True, family_head=True)


@pytest.fixture(autouse=True)
def _fresh_caches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENVLOOP_FEATURE_CACHE", str(tmp_path / "features"))
    monkeypatch.setattr(features, "_CACHES", {})


def test_the_key_is_new_and_decision_head_only() -> None:
    plain = Recipe(max_length=128)
    assert "family_head" not in recipe_to_dict(plain)  # at its default a recipe hashes as before the key
    assert recipe_hash(plain) != recipe_hash(plain.replace(family_head=True))
    with pytest.raises(RecipeError, match="family_head"):
        Recipe(readout="label_token", family_head=True, lora={"target_modules": ["q_proj"]})
    with pytest.raises(RecipeError, match="family_head"):
        Recipe(family_head="yes")


def test_family_slot_is_a_fixed_hash_in_range() -> None:
    assert family_slot("notify_level") == family_slot("notify_level")
    slots = {family_slot(f) for f in ("needs_approval", "notify_level", "pick_option", "route", "apply_memory",
                                      "forgotten_violation", "share_ok")}
    assert len(slots) == 7 and all(0 <= s < FAMILY_SLOTS for s in slots)  # the built-in families do not collide


def test_zero_start_is_the_shared_head_and_each_family_reads_its_own_parameters() -> None:
    torch.manual_seed(0)
    shared = DecisionHead(8, 16)
    torch.manual_seed(0)
    fam = DecisionHead(8, 16, family_head=True)
    assert {n for n, _ in fam.named_parameters()} - {n for n, _ in shared.named_parameters()} == {
        "family_shift.weight", "family_scale.weight", "family_out.weight"}
    assert fam.family_out.weight.shape == (FAMILY_SLOTS, 16)
    x = torch.randn(3, 5, 16)
    slots = torch.tensor([1, 2, 3])
    out = fam(x, family_slots=slots)
    assert out.shape == (3, 5)
    assert torch.equal(out, shared(x))  # zero at the start: exactly the shared head
    with pytest.raises(ValueError, match="family slot"):
        fam(x)
    with torch.no_grad():  # give slot 2 its own parameters: only the question of that family moves
        for table in (fam.family_shift, fam.family_scale, fam.family_out):
            table.weight[2].normal_()
    moved = fam(x, family_slots=slots)
    assert torch.equal(moved[[0, 2]], out[[0, 2]]) and not torch.allclose(moved[1], out[1])


def _lookup_loss(family_head: bool, steps: int = 300) -> float:
    """Two families read the same option vectors with opposite answers (a per-family lookup)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(32, 2, 8, generator=gen).repeat(2, 1, 1)  # every question once in each family
    which = (x[:, 0, 0] > x[:, 1, 0]).long()  # family 0: the option with the larger first feature
    fams = (torch.arange(64) >= 32).long()
    target = torch.nn.functional.one_hot(torch.where(fams == 0, which, 1 - which), 2).float()  # family 1: the other
    torch.manual_seed(0)
    head = DecisionHead(4, 32, family_head=family_head)
    opt = torch.optim.Adam(head.parameters(), lr=1e-2)
    slots = fams + 10
    for _ in range(steps):
        opt.zero_grad()
        logits = head(x, family_slots=slots) if family_head else head(x)
        loss = -(target * torch.log_softmax(logits, -1)).sum(-1).mean()
        loss.backward()
        opt.step()
    return float(loss.detach())


def test_per_family_parameters_learn_a_lookup_the_shared_head_cannot() -> None:
    shared, per_family = _lookup_loss(False), _lookup_loss(True)
    assert shared > 0.9 * math.log(2)  # one function for both families: no better than chance
    assert per_family < 0.1, (shared, per_family)


@pytest.fixture(scope="module")
def val_table() -> pa.Table:
    return make_table(10, seed=1, start=500)


def test_batches_carry_family_slots_and_training_fills_only_the_trained_families(val_table: pa.Table,
                                                                                 tmp_path: Path) -> None:
    train = questions_table(make_records(24))
    model, _ = build_trainable_model(RECIPE)
    questions = as_questions(train)[:4]
    batch = model.collate(model.encode_many(questions))
    assert batch["family_slots"].tolist() == [family_slot(q.family) for q in questions]
    assert model(**batch).shape == batch["option_mask"].shape
    assert {n for n, p in model.named_parameters() if p.requires_grad and n.startswith("head.family_")} == {
        "head.family_shift.weight", "head.family_scale.weight", "head.family_out.weight"}

    out = train_checkpoint(train, val_table, RECIPE, tmp_path / "ckpt", data_hash="snap-1")
    metrics = json.loads((out / "metrics.json").read_text())["train"]
    losses = [e["mean_loss"] for e in metrics["epochs"]]
    assert losses[-1] < losses[0] - 0.05, losses
    trained = sorted(metrics["family_slots"].values())
    assert trained == sorted(family_slot(f) for f in {q.family for q in as_questions(train)})
    loaded = DecisionModel.load(out)
    head = loaded.model.head
    for table in (head.family_shift, head.family_scale, head.family_out):
        norms = table.weight.detach().norm(dim=1)
        assert (norms[trained] > 0).all()  # every trained family moved its own parameters
        others = torch.ones(FAMILY_SLOTS, dtype=torch.bool)
        others[trained] = False
        assert (norms[others] == 0).all()  # no other slot did: an unseen family reads the shared head
    # The checkpoint's per-family parameters come back: its predictions are what training wrote.
    saved = predictions_from_table(read_predictions(out))
    again = loaded.predict(val_table)
    assert all(np.array_equal(a.logits, b.logits) for a, b in zip(saved, again))
    # Continuing from it with another head shape is refused naming the field.
    with pytest.raises(IncompatibleInitError, match="family_head"):
        build_trainable_model(RECIPE.replace(family_head=False), init_from=out)
