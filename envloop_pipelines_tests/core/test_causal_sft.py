"""Causal SFT on chat transcripts: assistant-only masks through the chat template, LoRA training, the checkpoint.

The model is a tiny randomly initialised Qwen2 (hidden 32, 2 layers) with a
byte-level BPE trained here on the test conversations (no hub), and no chat
template of its own (so the Qwen-style default is set, as for any such model).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from envloop_pipelines.core.model.causal_sft import (
    CHAT_TEMPLATE,
    IGNORE_INDEX,
    CausalSftRecipe,
    ChatTemplateError,
    assistant_spans,
    encode_chat,
    load_tokenizer,
    read_policy_checkpoint,
    render,
    train_causal_sft,
)
from envloop_pipelines.core.model.recipe import LoraSpec, RecipeError, load_recipe
from envloop_pipelines_tests.core.test_model_data import limit_threads_under_xdist

limit_threads_under_xdist()

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
#: LoRA on the output projection too: a random 32-wide LM cannot memorise text through its attention and MLP alone
#: (loss 6.0 -> 5.85 in 24 steps without it, 6.3 -> 1.3 with it).
LORA = LoraSpec(r=8, alpha=16, dropout=0.0,
                target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"))
BASH_TOOL = {"type": "function", "function": {"name": "bash", "description": "Run one bash command.",
                                              "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                                                             "required": ["command"]}}}


def tiny_chat_lm(path: Path, texts: list[str], *, seed: int = 0, whole_tokens: tuple[str, ...] = ()) -> Path:
    """A randomly initialised 2-layer Qwen2 (hidden 32) with a byte-level BPE trained on ``texts``; no chat template.

    ``<|im_start|>`` and ``<|im_end|>`` are special tokens (one id each), as in Qwen's vocabulary.
    ``whole_tokens`` are added as one (non-special) token each: a model this small learns to emit a
    whole tool call reliably only when it is a single token.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=800, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    if whole_tokens:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in whole_tokens])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>",
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, pad_token_id=fast.pad_token_id, eos_token_id=fast.eos_token_id,
        bos_token_id=None, tie_word_embeddings=False,
    )
    path.mkdir(parents=True, exist_ok=True)
    Qwen2ForCausalLM(config).save_pretrained(str(path))
    fast.save_pretrained(str(path))
    return path


def call(n: int, command: str) -> dict[str, Any]:
    return {"id": f"call_{n}", "type": "function", "function": {"name": "bash", "arguments": json.dumps({"command": command})}}


def toy_rows() -> list[dict[str, Any]]:
    """Four shell conversations in the OpenAI chat format: system, user, assistant tool calls, tool results, a last word."""
    rows = []
    for i, (name, line) in enumerate([("amber.txt", "basil cedar"), ("delta.txt", "ember fjord"),
                                      ("grove.txt", "harbor iris"), ("kelp.txt", "lumen maple")]):
        rows.append({"id": f"shell/{i}#0", "tools": [BASH_TOOL], "messages": [
            {"role": "system", "content": "You are an agent in a Linux sandbox."},
            {"role": "user", "content": f"Create a file named {name} whose content is exactly the line: {line}"},
            {"role": "assistant", "content": None, "tool_calls": [call(0, "ls -la")]},
            {"role": "tool", "tool_call_id": "call_0", "content": "exit_code: 0\nstdout:\nnotes.txt\nstderr:\n"},
            {"role": "assistant", "content": None, "tool_calls": [call(1, f"printf '%s\\n' '{line}' > {name}")]},
            {"role": "tool", "tool_call_id": "call_1", "content": "exit_code: 0\nstdout:\n\nstderr:\n"},
            {"role": "assistant", "content": "Done."},
        ]})
    return rows


def corpus(rows: list[dict[str, Any]]) -> list[str]:
    """Texts to train the tiny tokenizer on: the rows rendered by the default template."""
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models

    bare = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()))
    bare.chat_template = CHAT_TEMPLATE
    from envloop_pipelines.core.model.causal_sft import template_messages

    return [render(bare, template_messages(r["messages"]), r.get("tools") or ()) for r in rows] * 3


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_chat_lm(tmp_path_factory.mktemp("lm") / "tiny-chat-qwen2", corpus(toy_rows()))


@pytest.fixture(scope="module")
def recipe(lm_dir: Path) -> CausalSftRecipe:
    return CausalSftRecipe(base_model=str(lm_dir), max_length=512, lora=LORA, lr=2e-2, epochs=12, batch_size=2,
                           warmup_ratio=0.0, lr_scheduler="constant_with_warmup")


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, recipe: CausalSftRecipe):
    return train_causal_sft(toy_rows(), recipe, tmp_path_factory.mktemp("sft") / "policy", data_hash="toy-snapshot")


def test_a_tokenizer_without_a_template_gets_the_qwen_style_one(lm_dir: Path) -> None:
    tok = load_tokenizer(lm_dir)
    assert tok.chat_template == CHAT_TEMPLATE
    row = toy_rows()[0]
    text = render(tok, row["messages"][:3], row["tools"])
    # Tools listed in <tools>, the call as <tool_call>{json}</tool_call>, arguments an object (not JSON text quoted again).
    assert '<tools>\n{"type": "function", "function": {"name": "bash"' in text
    assert '<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la"}}\n</tool_call><|im_end|>' in text
    assert text.startswith("<|im_start|>system\nYou are an agent in a Linux sandbox.\n\n# Tools")


def test_masked_positions_are_exactly_the_assistant_tokens(lm_dir: Path) -> None:
    tok = load_tokenizer(lm_dir)
    row = toy_rows()[1]
    text, spans = assistant_spans(tok, row["messages"], row["tools"])
    written = [text[s:e] for s, e in spans]
    # Each span is what the assistant produced after "<|im_start|>assistant\n": its call or words, and its end of turn.
    assert written == [
        '<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la"}}\n</tool_call><|im_end|>\n',
        '<tool_call>\n{"name": "bash", "arguments": {"command": "printf \'%s\\\\n\' \'ember fjord\' > delta.txt"}}\n</tool_call><|im_end|>\n',
        "Done.<|im_end|>\n",
    ]
    enc = encode_chat(tok, row["messages"], row["tools"], max_length=4096)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert list(enc.input_ids) == ids and not enc.truncated
    trained = [i for i, t in enumerate(enc.labels) if t != IGNORE_INDEX]
    assert all(enc.labels[i] == enc.input_ids[i] for i in trained)
    # The unmasked tokens decode to exactly the assistant's spans, in order; everything else is masked.
    assert tok.decode([enc.input_ids[i] for i in trained]) == "".join(written)
    masked = tok.decode([t for t, lab in zip(enc.input_ids, enc.labels) if lab == IGNORE_INDEX])
    for part in ("You are an agent", "Create a file named delta.txt", "<tool_response>", "exit_code: 0", "<|im_start|>assistant"):
        assert part in masked
    assert "Done." not in masked and "printf" not in masked
    # Three contiguous runs: one per assistant turn.
    runs = sum(1 for a, b in zip([False] + [lab != IGNORE_INDEX for lab in enc.labels], [lab != IGNORE_INDEX for lab in enc.labels]) if b and not a)
    assert runs == 3
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert sum(1 for i in trained if enc.input_ids[i] == im_end) == 3  # each turn learns to stop


def test_truncation_cuts_the_end_and_a_row_without_assistant_is_refused(lm_dir: Path) -> None:
    tok = load_tokenizer(lm_dir)
    row = toy_rows()[0]
    enc = encode_chat(tok, row["messages"], row["tools"], max_length=40)
    assert enc.truncated and len(enc.input_ids) == 40 and enc.n_trained == 0  # the system prompt alone is longer
    with pytest.raises(ChatTemplateError, match="no assistant message"):
        assistant_spans(tok, row["messages"][:2], row["tools"])
    bad = [*row["messages"][:2], {"role": "assistant", "content": None,
                                  "tool_calls": [{"id": "c", "type": "function", "function": {"name": "bash", "arguments": "{oops"}}]}]
    with pytest.raises(ChatTemplateError, match=r"row 7: messages\[2\]\.tool_calls\[0\]\.function\.arguments is not JSON"):
        encode_chat(tok, bad, row["tools"], max_length=512, where="row 7")


def test_a_template_that_rewrites_earlier_turns_is_refused(lm_dir: Path) -> None:
    tok = load_tokenizer(lm_dir)
    # Renders every assistant turn but the last as "[hidden]": the prefixes disagree with the whole.
    tok.chat_template = ("{%- for m in messages %}{%- if m.role == 'assistant' and not loop.last %}[hidden]"
                         "{%- else %}<{{ m.role }}>{{ m.content }}{%- endif %}{%- endfor %}"
                         "{%- if add_generation_prompt %}<assistant>{%- endif %}")
    row = toy_rows()[0]
    with pytest.raises(ChatTemplateError, match="rewrites earlier turns"):
        assistant_spans(tok, row["messages"], row["tools"])


def test_loss_falls_on_a_memorisable_toy_set_and_the_checkpoint_verifies(trained, recipe: CausalSftRecipe) -> None:
    metrics = trained.metrics()
    losses = metrics["loss_per_step"]
    assert metrics["steps"] == 24 and len(losses) == 24  # 4 rows / batch 2 x 12 epochs
    # The first and last epoch's mean loss: the assistant turns are learned (a random LM starts near ln|V|).
    first, last = sum(losses[:2]) / 2, sum(losses[-2:]) / 2
    assert first > 5.0 and last < 0.6 * first, (first, last)
    assert metrics["rows"] == 4 and metrics["rows_truncated"] == 0 and metrics["assistant_tokens"] > 0
    ckpt = read_policy_checkpoint(trained.path)
    assert ckpt.sha256 == trained.sha256 and len(ckpt.sha256) == 64
    adapter_config = json.loads((ckpt.adapter_dir / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == recipe.base_model and adapter_config["r"] == 8
    assert ckpt.chat_template == CHAT_TEMPLATE
    assert json.loads((Path(trained.path) / "data.json").read_text()) == {"sft_snapshot": "toy-snapshot"}
    prov = json.loads((Path(trained.path) / "provenance.json").read_text())
    assert prov["recipe_hash"] == recipe.hash and prov["data_hash"] == "toy-snapshot"


def test_the_checkpoint_is_verified_and_never_overwritten(trained, recipe: CausalSftRecipe, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(trained.path, copy)
    (copy / "chat_template.jinja").write_text("{{ messages }}")
    with pytest.raises(ValueError, match="chat_template.jinja: changed"):
        read_policy_checkpoint(copy)
    (copy / "manifest.json").unlink()
    with pytest.raises(ValueError, match="not a policy checkpoint"):
        read_policy_checkpoint(copy)
    with pytest.raises(ValueError, match="never overwritten"):
        train_causal_sft(toy_rows(), recipe, trained.path, data_hash="x")


def test_the_trained_adapter_puts_more_probability_on_the_assistant_tokens(trained, lm_dir: Path) -> None:
    from envloop_pipelines.core.model.causal_sft import load_policy

    tok = load_tokenizer(lm_dir)
    row = toy_rows()[2]
    enc = encode_chat(tok, row["messages"], row["tools"], max_length=512)
    ids = torch.tensor([enc.input_ids])
    labels = torch.tensor([enc.labels])

    def loss(model: Any) -> float:
        with torch.no_grad():
            return float(model(input_ids=ids, labels=labels).loss)

    base, tuned = loss(load_policy(lm_dir, device="cpu")), loss(load_policy(lm_dir, trained.adapter_dir, device="cpu"))
    assert tuned < 0.6 * base, (base, tuned)


def test_recipes_are_validated_by_field(lm_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(RecipeError, match="unknown causal-SFT recipe key"):
        CausalSftRecipe.from_dict({"base_model": str(lm_dir), "readout": "label_token"})
    with pytest.raises(RecipeError, match="'base_model': required"):
        CausalSftRecipe.from_dict({"lr": 1e-4})
    with pytest.raises(RecipeError, match="lr_scheduler"):
        CausalSftRecipe.from_dict({"base_model": str(lm_dir), "lr_scheduler": "cyclic"})
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"base_model: {lm_dir}\nepochs: 0\n")
    with pytest.raises(RecipeError, match=r"bad\.yaml: recipe field 'epochs'"):
        load_recipe(bad, kind=CausalSftRecipe)
    r = CausalSftRecipe(base_model=str(lm_dir))
    assert CausalSftRecipe.from_dict(r.to_dict()) == r and r.hash == CausalSftRecipe.from_dict(r.to_dict()).hash


def test_the_shipped_qwen_recipe_loads_and_documents_itself() -> None:
    import re

    from envloop_pipelines.core.model.causal_sft import CAUSAL_SFT_RECIPES_DIR
    from envloop_pipelines.core.model.recipe import resolve_deepspeed

    paths = sorted(CAUSAL_SFT_RECIPES_DIR.glob("*.yaml"))
    assert [p.name for p in paths] == ["causal_sft_qwen_gpu.yaml"]
    recipe = load_recipe("packaged:causal_sft_qwen_gpu.yaml", kind=CausalSftRecipe)
    assert recipe.precision == "bf16" and recipe.gradient_checkpointing and recipe.lora.r == 16
    ds = resolve_deepspeed(recipe.as_training_recipe())
    assert ds is not None and ds.name == "deepspeed_zero2.json"
    text = paths[0].read_text()
    header = text.split("\n\n", 1)[0]
    assert "vllm serve" in header and "--enable-lora --lora-modules policy=CKPT/adapter" in header
    for line in text.splitlines():  # every key carries a comment on its line (the trade-off it controls)
        if re.match(r"^\s*[a-z_]+:\s*\S", line) and not line.lstrip().startswith("#"):
            assert "#" in line, f"key line without a comment: {line!r}"
    assert CausalSftRecipe.from_dict(recipe.to_dict()) == recipe


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_qwen_recipe_trains_on_a_gpu_and_the_policy_generates_there(lm_dir: Path, tmp_path: Path) -> None:
    """The shipped GPU recipe's settings (bf16, gradient checkpointing, DeepSpeed ZeRO-2 where importable) on the tiny model."""
    import importlib.util

    from envloop_pipelines.core.serve.generation import PolicyGenerator, policy_settings

    shipped = load_recipe("packaged:causal_sft_qwen_gpu.yaml", kind=CausalSftRecipe)
    recipe = shipped.replace(base_model=str(lm_dir), max_length=512, lora=LORA, lr=2e-2, epochs=12, batch_size=2,
                             grad_accum=1, warmup_ratio=0.0, lr_scheduler="constant_with_warmup",
                             deepspeed=shipped.deepspeed if importlib.util.find_spec("deepspeed") else None)
    ckpt = train_causal_sft(toy_rows(), recipe, tmp_path / "gpu", data_hash="gpu")
    losses = ckpt.metrics()["loss_per_step"]
    assert sum(losses[-2:]) / 2 < 0.6 * sum(losses[:2]) / 2, losses
    assert json.loads((Path(ckpt.path) / "provenance.json").read_text())["device"] == "cuda"
    generator = PolicyGenerator(policy_settings(ckpt.path, auth_off=True, device="cuda"))
    assert generator.device.type == "cuda"
    row = toy_rows()[0]
    out = generator.generate(row["messages"][:2], row["tools"], max_tokens=8, temperature=0.0, top_p=1.0, seed=0)
    assert 1 <= out.completion_tokens <= 8
