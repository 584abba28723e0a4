"""Recipes: validation names the field, every shipped recipe loads, the hash is canonical."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from envloop_pipelines.core.model.recipe import (
    PACKAGED_MINILM,
    Recipe,
    RecipeError,
    load_recipe,
    recipe_from_dict,
    recipe_hash,
    recipe_to_dict,
    resolve_base_model,
    resolve_deepspeed,
    shipped_recipes,
)


def test_shipped_recipes_exist() -> None:
    names = {p.name for p in shipped_recipes()}
    assert {"decision_head_cpu.yaml", "label_token_qwen_gpu.yaml"} <= names


@pytest.mark.parametrize("path", shipped_recipes(), ids=lambda p: p.name)
def test_every_shipped_recipe_loads_and_documents_itself(path: Path) -> None:
    recipe = load_recipe(path)
    assert recipe_from_dict(recipe_to_dict(recipe)) == recipe
    text = path.read_text()
    header = text.split("\n\n", 1)[0]
    assert "envloop train --task" in header and f"--recipe envloop_pipelines/recipes/{path.name}" in header
    # Every key carries a comment on its line (the trade-off it controls).
    for line in text.splitlines():
        if re.match(r"^\s*[a-z_]+:\s*\S", line) and not line.lstrip().startswith("#"):
            assert "#" in line, f"{path.name}: key line without a comment: {line!r}"
    if recipe.deepspeed is not None:
        ds = resolve_deepspeed(recipe)
        assert ds is not None and ds.is_file()


def test_cpu_default_recipe_is_the_packaged_decision_head() -> None:
    recipe = load_recipe(Path(shipped_recipes()[0]).parent / "decision_head_cpu.yaml")
    assert recipe.readout == "decision_head" and recipe.base_model == PACKAGED_MINILM
    assert recipe.deepspeed is None
    # Issue 24's measured arm: the hybrid with a per-family head over 3 frozen layers, 300 steps at 256 tokens.
    assert (recipe.max_length, recipe.frozen_layers, recipe.max_steps) == (256, 3, 300)
    assert recipe.family_head and recipe.lexical and recipe.length_grouped
    assert resolve_base_model(recipe).joinpath("model.safetensors").is_file()


def test_gpu_recipe_carries_a_deepspeed_config() -> None:
    recipe = load_recipe(Path(shipped_recipes()[0]).parent / "label_token_qwen_gpu.yaml")
    assert recipe.readout == "label_token" and recipe.precision == "bf16"
    ds = resolve_deepspeed(recipe)
    assert ds is not None and ds.name == "deepspeed_zero2.json"
    import json

    assert json.loads(ds.read_text())["zero_optimization"]["stage"] == 2


@pytest.mark.parametrize(
    ("changes", "field", "allowed"),
    [
        ({"readout": "classifier"}, "readout", "decision_head, label_token"),
        ({"max_length": 8}, "max_length", "[16,"),
        ({"max_length": 1024}, "max_length", "[16, 512]"),
        ({"lr": 0}, "lr", "(0.0, 1.0]"),
        ({"head_lr": -1.0}, "head_lr", "(0.0, 1.0]"),
        ({"epochs": 0}, "epochs", "[1, 100000]"),
        ({"batch_size": 2.5}, "batch_size", "integer"),
        ({"error_budget": 1.0}, "error_budget", "(0.0, 1.0)"),
        ({"warmup_ratio": 1.0}, "warmup_ratio", "[0.0, 1.0)"),
        ({"lr_scheduler": "step"}, "lr_scheduler", "linear, cosine"),
        ({"precision": "fp16"}, "precision", "fp32, bf16"),
        ({"seed": -1}, "seed", "[0, 4294967295]"),
        ({"base_model": "packaged:bert-large"}, "base_model", "packaged:minilm"),
        ({"deepspeed": "packaged:nope.json"}, "deepspeed", "packaged:deepspeed_zero2.json"),
        ({"state_attention": "yes"}, "state_attention", "true or false"),
        ({"readout": "label_token", "state_attention": True}, "state_attention", "false for the label_token readout"),
        ({"head_warmup_epochs": -1}, "head_warmup_epochs", "[0, 100000]"),
        ({"head_warmup_epochs": 0.5}, "head_warmup_epochs", "integer"),
        ({"readout": "label_token", "head_warmup_epochs": 1}, "head_warmup_epochs", "0 for the label_token readout"),
        ({"lora": {"r": 0}}, "lora.r", "[1, 1024]"),
        ({"lora": {"dropout": 1.0}}, "lora.dropout", "[0.0, 1.0)"),
        ({"lora": {"target_modules": []}}, "lora.target_modules", "non-empty list"),
        ({"lora": {"target_modules": "query"}}, "lora.target_modules", "non-empty list"),
    ],
)
def test_invalid_values_name_the_field_and_the_allowed_values(changes: dict, field: str, allowed: str) -> None:
    data = recipe_to_dict(Recipe())
    for key, value in changes.items():
        if key == "lora":
            data["lora"].update(value)
        else:
            data[key] = value
    with pytest.raises(RecipeError) as err:
        recipe_from_dict(data)
    message = str(err.value)
    assert f"'{field}'" in message and allowed in message, message


def test_unknown_keys_are_errors_naming_the_key(tmp_path: Path) -> None:
    with pytest.raises(RecipeError, match=r"unknown recipe key\(s\) \['learning_rate'\]"):
        recipe_from_dict({"learning_rate": 1e-3})
    with pytest.raises(RecipeError, match=r"'lora': unknown key\(s\) \['rank'\]"):
        recipe_from_dict({"lora": {"rank": 4}})
    path = tmp_path / "bad.yaml"
    path.write_text("readout: decision_head\nepochz: 3\n")
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    assert str(path) in str(err.value) and "epochz" in str(err.value)


def test_replace_validates_again() -> None:
    recipe = Recipe()
    assert recipe.replace(lora={"r": 4}).lora.r == 4
    with pytest.raises(RecipeError, match="'lora.r'"):
        recipe.replace(lora={"r": -1})


def test_recipe_hash_is_canonical_and_sensitive() -> None:
    a = Recipe()
    b = recipe_from_dict(dict(reversed(list(recipe_to_dict(a).items()))))
    assert recipe_hash(a) == recipe_hash(b)
    assert re.fullmatch(r"[0-9a-f]{64}", recipe_hash(a))
    assert recipe_hash(a.replace(seed=1)) != recipe_hash(a)
    assert recipe_hash(a.replace(lora={"alpha": 8})) != recipe_hash(a)
    # ints and floats that mean the same number hash the same (YAML "lr: 1" vs "lr: 1.0").
    assert recipe_hash(a.replace(lr=1)) == recipe_hash(a.replace(lr=1.0))
    # A field added later leaves older recipes' hashes (checkpoints, noise floors) as they were (this is the
    # default recipe's hash before state_attention existed), and changes the hash when set.
    assert "state_attention" not in recipe_to_dict(a)
    assert recipe_hash(a) == "fbf552c34d445801b9830c9d6fa8179d5b93368ab3ee49625d13a59718dc379c"
    assert recipe_hash(a.replace(state_attention=True)) != recipe_hash(a)
    assert recipe_from_dict(recipe_to_dict(a.replace(state_attention=True))).state_attention is True
    assert "head_warmup_epochs" not in recipe_to_dict(a)
    assert recipe_hash(a.replace(head_warmup_epochs=2)) != recipe_hash(a)
    assert recipe_from_dict(recipe_to_dict(a.replace(head_warmup_epochs=2))).head_warmup_epochs == 2


def test_missing_base_model_path_names_the_field(tmp_path: Path) -> None:
    recipe = Recipe(readout="label_token", base_model=str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="'base_model'"):
        resolve_base_model(recipe)
    with pytest.raises(FileNotFoundError, match="'deepspeed'"):
        resolve_deepspeed(Recipe(deepspeed=str(tmp_path / "ds.json")))


def test_recipe_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        Recipe().lr = 1.0  # type: ignore[misc]
    assert yaml.safe_load(yaml.safe_dump(recipe_to_dict(Recipe())))["lora"]["target_modules"] == ["query", "key", "value"]
