"""Hand-made decision records for the model tests, and tiny local models (no hub).

The task is learnable from the state alone: the colour bought (choice), whether
it is urgent (noul), the satisfaction level (score), so a few epochs on a few
dozen questions move the loss and the accuracy.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from envloop_pipelines.core.data.question_table import QUESTION_SCHEMA, questions_table
from envloop_pipelines.core.data.records import Record, records_from_objects

COLORS = ("red", "green", "blue")


def limit_threads_under_xdist() -> None:
    """One torch thread per pytest-xdist worker: two workers with two threads each on two
    cores oversubscribe the CPU, and OpenMP's spin-waiting then makes the model tests ~6x slower."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)
LEVELS = ("low", "medium", "high")


def record_objects(n: int, *, seed: int = 0, start: int = 0, soft_every: int = 0) -> list[dict[str, Any]]:
    """``n`` JSONL-shaped records with three questions each (choice, noul, score)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        color = COLORS[int(rng.integers(3))]
        urgent = bool(rng.integers(2))
        level = int(rng.integers(3))
        state = (
            f"The customer bought a {color} lamp. "
            + ("This is urgent, please hurry." if urgent else "No rush at all.")
            + f" Satisfaction level {LEVELS[level]}."
        )
        score: dict[str, Any] = {"type": "score", "instructions": "How satisfied is the customer?", "criteria": list(LEVELS), "label": level}
        if soft_every and i % soft_every == 0:
            score["soft_label"] = {str(level): 0.8, str((level + 1) % 3): 0.2}
        out.append(
            {
                "id": f"r{start + i:04d}",
                "state": state,
                "questions": {
                    "color": {"type": "choice", "instructions": "Which colour was bought?", "criteria": {c: None for c in COLORS}, "label": color},
                    "urgent": {"type": "noul", "instructions": "Is it urgent?", "label": urgent},
                    "satisfaction": score,
                },
                "meta": {"user_id": f"u{(start + i) % 7}"},
            }
        )
    return out


def make_records(n: int, *, seed: int = 0, start: int = 0, soft_every: int = 0) -> tuple[Record, ...]:
    objs = record_objects(n, seed=seed, start=start, soft_every=soft_every)
    return records_from_objects([(o, i + 1) for i, o in enumerate(objs)], file="test", token_budget=None)


def make_table(n: int, *, seed: int = 0, start: int = 0, soft_every: int = 0) -> pa.Table:
    return questions_table(make_records(n, seed=seed, start=start, soft_every=soft_every))


def many_option_record(n_options: int, *, rid: str = "many", state: str = "The answer is option o3.") -> Record:
    """One record with one choice question of ``n_options`` short options."""
    obj = {
        "id": rid,
        "state": state,
        "questions": {"pick": {"type": "choice", "instructions": "Which option?", "criteria": [f"o{i}" for i in range(n_options)], "label": f"o{min(3, n_options - 1)}"}},
    }
    return records_from_objects([(obj, 1)], file="test", token_budget=None)[0]


def tiny_causal_lm(path: Path, texts: list[str], *, seed: int = 0) -> Path:
    """A randomly initialised 2-layer Qwen2 (hidden 32) with a byte-level BPE trained on ``texts``, saved to ``path``.

    The tokenizer is trained here (no hub) the way Qwen's is built (byte-level
    BPE), so ``AutoTokenizer`` loads it as a ``Qwen2Tokenizer`` with Qwen's own
    pre-tokenizer, which splits digits one by one: the score labels are then
    single tokens only without a leading space (the readout's fallback).
    """
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    labels = ["yes", "no", *[str(i) for i in range(10)], *[chr(ord("A") + i) for i in range(26)]]
    corpus = [*texts, *(f"Answer: {lab}\n{lab}. {lab}: " for lab in labels for _ in range(3)), "State:\n\nQuestion: Options:\n"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<|endoftext|>", "<|pad|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>")
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, pad_token_id=fast.pad_token_id, eos_token_id=fast.eos_token_id,
        bos_token_id=None, tie_word_embeddings=False,
    )
    model = Qwen2ForCausalLM(config)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path))
    fast.save_pretrained(str(path))
    return path


def table_texts(table: pa.Table) -> list[str]:
    """Every text of a question table (for building a tiny vocabulary)."""
    out: list[str] = []
    for name in ("state_text", "instructions_text"):
        out.extend(table.column(name).to_pylist())
    for keys, texts in zip(table.column("option_keys").to_pylist(), table.column("option_texts").to_pylist()):
        out.extend(keys)
        out.extend(t for t in texts if t)
    return out


def test_make_table_matches_the_question_schema() -> None:
    table = make_table(5, soft_every=2)
    assert table.schema == QUESTION_SCHEMA
    assert table.num_rows == 15
    assert set(table.column("type").to_pylist()) == {"choice", "noul", "score"}
    softs = [s for s in table.column("soft_label").to_pylist() if s is not None]
    assert len(softs) == 3 and all(abs(sum(s) - 1) < 1e-9 for s in softs)
