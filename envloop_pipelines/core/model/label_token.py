"""The label-token readout: a causal LM answers with one label token.

The prompt lists the options under labels and ends with an answer cue::

    State:
    <state>

    Question: <instructions>
    Options:
    A. billing: Charges, refunds, invoices
    B. shipping
    Answer:

Labels: ``A``, ``B``, … for choice (26 options at most: one letter each),
``yes`` / ``no`` for noul (true / false), digits ``0`` … ``9`` for score. The
logit of option *k* is the LM's next-token logit of label *k* at the last
position; the prediction is the softmax over the question's label logits.

Loss: cross-entropy over **the label tokens' logits only** (not the full
vocabulary). It is the same distribution the prediction reads, so soft labels
train against exactly what is calibrated and served, and no probability mass is
spent teaching the LM that non-label tokens are unlikely after ``Answer:``.

Each label must be a single token of the base tokenizer; the readout first
tries the label with a leading space (``" A"``, what follows ``Answer:`` in
running text) and falls back to the bare label, per label set, and raises
naming the labels when neither is one token each.

Batches are left-padded with explicit ``position_ids`` (count of real tokens
before each one), so a question's positions, and its logits up to float
rounding, do not depend on how much padding its batch needs; the LM returns
logits for the last position only (``logits_to_keep=1``).

Truncation: only the state is cut (its middle, as for the decision head) to fit ``max_length``; the rest of
the prompt is kept whole, and a prompt that does not fit without the state
raises :class:`~envloop_pipelines.core.model.readout.InputTooLongError`.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch
from torch import nn

from envloop_pipelines.core.model.readout import (
    Encoded,
    InputTooLongError,
    QuestionInput,
    ReadoutModel,
    fit_state,
    option_mask,
    pad_2d,
    tokenize_unique,
    wrap_lora,
)

if TYPE_CHECKING:
    from envloop_pipelines.core.model.recipe import Recipe

#: Label strings per question type, in option order.
LABELS: dict[str, tuple[str, ...]] = {
    "noul": ("yes", "no"),
    "score": tuple(str(i) for i in range(10)),
    "choice": tuple(string.ascii_uppercase),
}
STATE_PREFIX = "State:\n"
ANSWER_CUE = "Answer:"


class LabelTokenError(ValueError):
    """A label is not a single token of the base tokenizer, or a question has more options than labels."""


def label_token_ids(tokenizer: Any) -> dict[str, tuple[int, ...]]:
    """The single-token id of every label, per question type.

    Raises:
        LabelTokenError: naming the labels that are not one token.
    """
    out: dict[str, tuple[int, ...]] = {}
    for qtype, labels in LABELS.items():
        chosen: tuple[int, ...] | None = None
        bad: list[str] = []
        for prefix in (" ", ""):
            encoded = [tokenizer(prefix + lab, add_special_tokens=False)["input_ids"] for lab in labels]
            bad = [repr(prefix + lab) for lab, ids in zip(labels, encoded) if len(ids) != 1]
            if not bad:
                chosen = tuple(int(ids[0]) for ids in encoded)
                break
        if chosen is None:
            raise LabelTokenError(
                f"label-token readout: the {qtype} labels {', '.join(bad)} are not single tokens of this tokenizer "
                f"(each label must be one token, with or without a leading space)"
            )
        if len(set(chosen)) != len(chosen):
            raise LabelTokenError(f"label-token readout: the {qtype} labels {labels!r} map to repeated token ids {chosen!r}")
        out[qtype] = chosen
    return out


def prompt_parts(q: QuestionInput) -> tuple[str, str]:
    """``(state text, text after the state)`` of the prompt (see the module docstring)."""
    labels = LABELS[q.type]
    if q.n_options > len(labels):
        raise LabelTokenError(
            f"question {q.key}: {q.n_options} options but the label-token readout labels {q.type} options "
            f"{labels[0]}..{labels[-1]} ({len(labels)} at most); use the decision_head readout"
        )
    lines = []
    for label, key, text in zip(labels, q.option_keys, q.option_texts):
        if q.type == "choice":
            body = f"{key}: {text}" if text else key
            lines.append(f"{label}. {body}")
        elif q.type == "score":
            lines.append(f"{label}. {text}" if text else label)
        else:  # noul: the label is the answer word
            lines.append(f"{label}: {text}" if text else label)
    tail = f"\n\nQuestion: {q.instructions_text}\nOptions:\n" + "\n".join(lines) + f"\n{ANSWER_CUE}"
    return q.state_text, tail


class LabelTokenModel(ReadoutModel):
    """Causal LM (LoRA) scored on its label tokens; see the module docstring."""

    readout = "label_token"

    def __init__(self, encoder: nn.Module, tokenizer: Any, max_length: int) -> None:
        super().__init__()
        self.encoder = encoder
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.labels = label_token_ids(tokenizer)
        pad = tokenizer.pad_token_id
        if pad is None:
            pad = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
        self.pad_id = int(pad)
        bos = tokenizer.bos_token_id
        self.prefix_ids: list[int] = [int(bos)] if bos is not None and getattr(tokenizer, "add_bos_token", False) else []
        self.state_prefix_ids: list[int] = tokenizer(STATE_PREFIX, add_special_tokens=False)["input_ids"]

    @classmethod
    def from_recipe(cls, recipe: "Recipe", *, adapter_dir: str | Path | None = None, trainable: bool = False) -> "LabelTokenModel":
        """Load the causal LM and its tokenizer from the recipe's local path and put LoRA on it."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from envloop_pipelines.core.model.recipe import resolve_base_model

        base_dir = resolve_base_model(recipe)
        tokenizer = AutoTokenizer.from_pretrained(str(base_dir))
        base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
        return cls.from_base(base, tokenizer, recipe, adapter_dir=adapter_dir, trainable=trainable)

    @classmethod
    def from_base(cls, base: nn.Module, tokenizer: Any, recipe: "Recipe", *, adapter_dir: str | Path | None = None,
                  trainable: bool = False) -> "LabelTokenModel":
        """Put the recipe's LoRA (and, training on a GPU, gradient checkpointing) on a causal LM already built.

        :meth:`from_recipe` builds ``base`` from the recipe's directory; ``bench/bench_gpu.py`` builds a
        randomly initialised one from a config, with no weights to load.
        """
        if trainable and recipe.gradient_checkpointing and torch.cuda.is_available():
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            base.enable_input_require_grads()
        encoder = wrap_lora(base, recipe, adapter_dir=adapter_dir, trainable=trainable, task_type="CAUSAL_LM")
        return cls(encoder, tokenizer, recipe.max_length)

    # ------------------------------------------------------------------ encoding

    def encode_many(self, questions: Sequence[QuestionInput]) -> list[Encoded]:
        parts = [prompt_parts(q) for q in questions]
        ids = tokenize_unique(self.tokenizer, [t for pair in parts for t in pair])
        return [self._encode(q, state, tail, ids) for q, (state, tail) in zip(questions, parts)]

    def _encode(self, q: QuestionInput, state: str, tail: str, ids: Mapping[str, list[int]]) -> Encoded:
        fixed = len(self.prefix_ids) + len(self.state_prefix_ids) + len(ids[tail])
        budget = self.max_length - fixed
        if budget < 0:
            raise InputTooLongError(
                f"question {q.key}: the prompt without its state takes {fixed} tokens, over max_length={self.max_length} "
                f"(the state is the only part cut); raise the recipe's max_length or shorten the option descriptions"
            )
        kept, dropped = fit_state(ids[state], budget)
        input_ids = [*self.prefix_ids, *self.state_prefix_ids, *kept, *ids[tail]]
        return Encoded(
            input_ids=tuple(input_ids),
            token_type_ids=None,
            option_positions=(),
            option_ends=(),
            label_ids=self.labels[q.type][: q.n_options],
            n_options=q.n_options,
            truncated=dropped > 0,
            n_state_tokens_dropped=dropped,
        )

    def collate(self, items: Sequence[Encoded]) -> dict[str, torch.Tensor]:
        """Left-pad so every question ends at the last position; positions count real tokens only."""
        input_ids = pad_2d([e.input_ids for e in items], self.pad_id, left=True)
        attention_mask = pad_2d([[1] * len(e) for e in items], 0, left=True)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "label_ids": pad_2d([e.label_ids for e in items], 0),
            "option_mask": option_mask(items),
        }

    # ------------------------------------------------------------------ forward

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        label_ids: torch.Tensor,
        option_mask: torch.Tensor,
    ) -> torch.Tensor:
        """Label logits ``(batch, max_options)`` at the last position: one LM pass for the whole batch."""
        out = self.encoder(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, logits_to_keep=1, use_cache=False
        )
        last = out.logits[:, -1, :].float()  # (batch, vocab)
        return torch.gather(last, 1, label_ids)

    # ------------------------------------------------------------------ head state

    def head_state_dict(self) -> dict[str, torch.Tensor]:
        """The label token ids per type: the readout's only non-adapter state, checked again at load."""
        return {f"label_ids.{t}": torch.tensor(ids, dtype=torch.long) for t, ids in self.labels.items()}

    def load_head_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        saved = {k[len("label_ids."):]: tuple(int(x) for x in v.tolist()) for k, v in state.items() if k.startswith("label_ids.")}
        if saved != self.labels:
            raise ValueError(
                "head.safetensors: the checkpoint's label token ids differ from the base tokenizer's "
                f"(saved {saved!r}, tokenizer {self.labels!r}): the base model's tokenizer changed"
            )


__all__ = ["ANSWER_CUE", "LABELS", "LabelTokenError", "LabelTokenModel", "label_token_ids", "prompt_parts"]
