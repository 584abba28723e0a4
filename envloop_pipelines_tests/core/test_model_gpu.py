"""GPU paths of the decision-model core: bf16, gradient checkpointing, DeepSpeed ZeRO-2, exact re-scoring on the GPU.

Marked ``gpu``: skipped without a CUDA device. The DeepSpeed test also skips
where ``deepspeed`` is not importable.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

from envloop_pipelines.core.model.checkpoint import read_predictions
from envloop_pipelines.core.model.predict import DecisionModel, predictions_from_table
from envloop_pipelines.core.model.recipe import LoraSpec, Recipe
from envloop_pipelines.core.model.training import train_checkpoint
from envloop_pipelines_tests.core.test_model_data import make_table, table_texts, tiny_causal_lm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

LORA_LM = LoraSpec(r=8, alpha=16, dropout=0.0, target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))


@pytest.fixture(scope="module")
def tables() -> tuple[pa.Table, pa.Table]:
    return make_table(32, soft_every=8), make_table(12, seed=1, start=100)


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory: pytest.TempPathFactory, tables: tuple[pa.Table, pa.Table]) -> Path:
    return tiny_causal_lm(tmp_path_factory.mktemp("lm") / "tiny", table_texts(tables[0]) + table_texts(tables[1]))


def _losses(ckpt: Path) -> list[float]:
    return [e["mean_loss"] for e in json.loads((ckpt / "metrics.json").read_text())["train"]["epochs"]]


def _rescore_is_exact(ckpt: Path, table: pa.Table) -> DecisionModel:
    saved = predictions_from_table(read_predictions(ckpt))
    dm = DecisionModel.load(ckpt, device="cuda")
    fresh = dm.predict(table)
    assert all(np.array_equal(s.probs, f.probs) and np.array_equal(s.logits, f.logits) for s, f in zip(saved, fresh))
    return dm


def test_label_token_trains_in_bf16_with_gradient_checkpointing(tmp_path: Path, tables: tuple[pa.Table, pa.Table], lm_dir: Path) -> None:
    recipe = Recipe(readout="label_token", base_model=str(lm_dir), max_length=128, lora=LORA_LM, lr=1e-2, epochs=5,
                    batch_size=8, precision="bf16", gradient_checkpointing=True)
    ckpt = train_checkpoint(tables[0], tables[1], recipe, tmp_path / "lt", data_hash="gpu")
    losses = _losses(ckpt)
    assert losses[-1] < losses[0] - 0.05, losses
    assert json.loads((ckpt / "provenance.json").read_text())["device"] == "cuda"
    _rescore_is_exact(ckpt, tables[1])


def test_decision_head_trains_on_the_gpu_and_rescores_exactly(tmp_path: Path, tables: tuple[pa.Table, pa.Table]) -> None:
    recipe = Recipe(max_length=128, epochs=6, batch_size=8, lr=2e-3, head_lr=5e-3, precision="bf16")
    ckpt = train_checkpoint(tables[0], tables[1], recipe, tmp_path / "dh", data_hash="gpu")
    losses = _losses(ckpt)
    assert losses[-1] < losses[0] - 0.15, losses
    dm = _rescore_is_exact(ckpt, tables[1])
    assert dm.device.type == "cuda"


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed not installed")
def test_deepspeed_zero2_config_passes_through(tmp_path: Path, tables: tuple[pa.Table, pa.Table], lm_dir: Path) -> None:
    recipe = Recipe(readout="label_token", base_model=str(lm_dir), max_length=128, lora=LORA_LM, lr=1e-2, epochs=3,
                    batch_size=8, precision="bf16", deepspeed="packaged:deepspeed_zero2.json")
    ckpt = train_checkpoint(tables[0], tables[1], recipe, tmp_path / "ds", data_hash="gpu")
    assert all(np.isfinite(_losses(ckpt)))
    dm = _rescore_is_exact(ckpt, tables[1])
    assert {p.dtype for p in dm.model.parameters()} == {torch.float32}
