"""Label-token readout on a tiny randomly initialised causal LM (Qwen2 config, hidden 32, 2 layers).

The tokenizer is a byte-level BPE trained here on the test texts (no hub).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch
from safetensors.torch import load_file

from envloop_pipelines.core.model.checkpoint import read_predictions
from envloop_pipelines.core.model.label_token import LABELS, LabelTokenError, LabelTokenModel, label_token_ids
from envloop_pipelines.core.model.predict import DecisionModel, predictions_from_table
from envloop_pipelines.core.model.readout import InputTooLongError, as_questions
from envloop_pipelines.core.model.readouts import build_readout_model
from envloop_pipelines.core.model.recipe import LoraSpec, Recipe
from envloop_pipelines.core.model.training import train_checkpoint
from envloop_pipelines.core.data.records import Record
from envloop_pipelines_tests.core.test_model_data import limit_threads_under_xdist, make_records, make_table, many_option_record, table_texts, tiny_causal_lm

limit_threads_under_xdist()

LORA = LoraSpec(r=8, alpha=16, dropout=0.0, target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))


@pytest.fixture(scope="module")
def tables() -> tuple[pa.Table, pa.Table]:
    return make_table(32, soft_every=8), make_table(12, seed=1, start=100)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory, tables: tuple[pa.Table, pa.Table]) -> Path:
    texts = table_texts(tables[0]) + table_texts(tables[1]) + ["Which option ?"] + [f"o{i}" for i in range(40)]
    return tiny_causal_lm(tmp_path_factory.mktemp("lm") / "tiny-qwen2", texts)


@pytest.fixture(scope="module")
def recipe(base_dir: Path) -> Recipe:
    return Recipe(readout="label_token", base_model=str(base_dir), max_length=128, lora=LORA, lr=1e-2, epochs=5, batch_size=8, eval_batch_size=8)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory, tables: tuple[pa.Table, pa.Table], recipe: Recipe) -> Path:
    return train_checkpoint(tables[0], tables[1], recipe, tmp_path_factory.mktemp("lt") / "ckpt", data_hash="lt-snap")


def test_single_label_token_loss_goes_down(ckpt: Path) -> None:
    train = json.loads((ckpt / "metrics.json").read_text())["train"]
    losses = [e["mean_loss"] for e in train["epochs"]]
    assert losses[-1] < losses[0] - 0.05, losses


def test_only_lora_parameters_train(recipe: Recipe) -> None:
    model = build_readout_model(recipe, trainable=True)
    names = model.trainable_parameter_names()
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    n_lora = sum(p.numel() for p in model.parameters() if p.requires_grad)
    # r x (in + out) per adapted projection, 7 projections x 2 layers (q/k/v/o, gate/up/down of a 32/64-wide model).
    config = model.encoder.get_base_model().config
    h, i, kv = config.hidden_size, config.intermediate_size, config.num_key_value_heads * (config.hidden_size // config.num_attention_heads)
    per_layer = 8 * ((h + h) + (h + kv) + (h + kv) + (h + h) + (h + i) + (h + i) + (i + h))
    assert n_lora == per_layer * config.num_hidden_layers


def test_predictions_sum_to_one_over_the_label_tokens(ckpt: Path, tables: tuple[pa.Table, pa.Table]) -> None:
    dm = DecisionModel.load(ckpt)
    preds = dm.predict(tables[1])
    for p in preds:
        assert abs(p.probs.sum() - 1) < 1e-12 and len(p.probs) == len(p.option_keys)
        assert list(p.probabilities()) == list(p.option_keys)
    head = load_file(str(ckpt / "head.safetensors"))
    assert set(head) == {"label_ids.noul", "label_ids.score", "label_ids.choice"}
    # The logits are the LM's next-token logits of the label tokens at the last position.
    model = dm.model
    q = as_questions(tables[1])[0]
    enc = model.encode_many([q])[0]
    with torch.inference_mode():
        out = model.encoder(input_ids=torch.tensor([enc.input_ids]), attention_mask=torch.ones(1, len(enc.input_ids), dtype=torch.long))
    expected = out.logits[0, -1, list(model.labels[q.type][: q.n_options])].float().numpy()
    np.testing.assert_allclose(preds[0].logits, expected, rtol=0, atol=1e-5)


def test_rescoring_from_disk_is_exact(ckpt: Path, tables: tuple[pa.Table, pa.Table]) -> None:
    saved = predictions_from_table(read_predictions(ckpt))
    fresh = DecisionModel.load(ckpt).predict(tables[1])
    assert all(np.array_equal(s.probs, f.probs) and np.array_equal(s.logits, f.logits) for s, f in zip(saved, fresh))


def test_one_lm_pass_per_batch_and_padding_does_not_change_answers(ckpt: Path) -> None:
    dm = DecisionModel.load(ckpt)
    calls: list[tuple[int, ...]] = []

    def hook(module: Any, args: Any, kwargs: dict, output: Any) -> None:
        calls.append(tuple(kwargs["input_ids"].shape))

    records = [many_option_record(n, rid=f"m{n}") for n in (2, 8, 12)] + list(make_records(2, seed=5))
    questions = as_questions(records)
    handle = dm.model.encoder.register_forward_hook(hook, with_kwargs=True)
    try:
        together = dm.predict(questions, batch_size=16)
        assert len(calls) == 1 and calls[0][0] == len(questions) == 9
        alone = [dm.predict([q], batch_size=1)[0] for q in questions]
    finally:
        handle.remove()
    for a, b in zip(alone, together):
        np.testing.assert_allclose(a.probs, b.probs, rtol=0, atol=1e-5)


def test_prompt_lists_labels_and_ends_with_the_answer_cue(ckpt: Path) -> None:
    dm = DecisionModel.load(ckpt)
    model = dm.model
    assert isinstance(model, LabelTokenModel)
    q = [x for x in as_questions(make_table(1)) if x.type == "choice"][0]
    text = model.tokenizer.decode(model.encode_many([q])[0].input_ids)
    assert text.startswith("State:\n") and text.endswith("Answer:")
    assert "A. red\nB. green\nC. blue" in text and "Question: Which colour was bought?" in text
    # Qwen-style pre-tokenization splits digits, so score labels fall back to the bare digit.
    tok = model.tokenizer
    assert model.labels["score"] == tuple(tok(str(i), add_special_tokens=False)["input_ids"][0] for i in range(10))
    assert model.labels["noul"] == tuple(tok(" " + w, add_special_tokens=False)["input_ids"][0] for w in ("yes", "no"))


def test_truncation_keeps_the_question_and_records_the_drop(ckpt: Path) -> None:
    model = DecisionModel.load(ckpt).model
    rec = make_records(1)[0]
    long_rec = Record(id="long", state=" ".join(["lamp"] * 300), questions=rec.questions)
    q = as_questions([long_rec])[0]
    enc = model.encode_many([q])[0]
    assert len(enc.input_ids) == 128 and enc.truncated and enc.n_state_tokens_dropped > 0
    assert model.tokenizer.decode(enc.input_ids).endswith("A. red\nB. green\nC. blue\nAnswer:")


def test_too_many_options_or_multi_token_labels_are_clear_errors(ckpt: Path) -> None:
    model = DecisionModel.load(ckpt).model
    with pytest.raises(LabelTokenError, match=r"question many/pick: 30 options .* A\.\.Z \(26 at most\)"):
        model.encode_many(as_questions([many_option_record(30)]))
    with pytest.raises(InputTooLongError, match="question many/pick"):
        short = model.max_length
        model.max_length = 20
        try:
            model.encode_many(as_questions([many_option_record(20)]))
        finally:
            model.max_length = short

    class TwoTokenYes:
        """A tokenizer where 'yes' is two tokens with or without a space."""

        def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
            word = text.strip()
            return {"input_ids": [1, 2] if word == "yes" else [100 + sum(map(ord, text))]}

    with pytest.raises(LabelTokenError, match=r"noul labels 'yes' are not single tokens"):
        label_token_ids(TwoTokenYes())
    assert LABELS["choice"][:3] == ("A", "B", "C") and LABELS["noul"] == ("yes", "no")
