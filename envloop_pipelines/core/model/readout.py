"""What both readouts share: the question as the model sees it, its encoding, the loss.

A *readout* turns one typed question about a state into one logit per option
with **one** forward pass of the base model per question: the decision head
(:mod:`.decision_head`, an encoder with a per-option head) and the label token
(:mod:`.label_token`, a causal LM scored on its label tokens). Both are
``torch.nn.Module`` subclasses of :class:`ReadoutModel` with the same surface:

* ``encode_many(questions)`` → one :class:`Encoded` per question (token ids,
  where the options are read, and whether the state was truncated);
* ``collate(items)`` → the padded tensors of a batch;
* ``forward(**batch)`` → option logits ``(batch, max_options)``; entries past a
  question's own options are meaningless and masked by ``option_mask``.

This module is the base both readouts import; it imports neither of them.
Which class serves which recipe ``readout`` name, and building one from a
recipe, is :mod:`.readouts`.

Truncation is never silent: only the *state* is cut, in its middle (the
question and its options are always read whole; see :func:`fit_state`), and
each :class:`Encoded` says whether it was cut and by how many tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

import numpy as np
import pyarrow as pa
import torch
from torch import nn

from envloop_pipelines.core.data.question_table import questions_table
from envloop_pipelines.core.data.records import QUESTION_TYPES, Record

if TYPE_CHECKING:
    from envloop_pipelines.core.model.recipe import Recipe


class InputTooLongError(ValueError):
    """The question and its options alone do not fit in the recipe's ``max_length``."""


@dataclass(frozen=True)
class QuestionInput:
    """One question about one state, as a readout reads it (a row of ``QUESTION_SCHEMA``)."""

    record_id: str
    question_id: str
    type: str
    family: str
    state_text: str
    instructions_text: str
    option_keys: tuple[str, ...]
    option_texts: tuple[str | None, ...]
    label: int | None = None
    soft_label: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.type not in QUESTION_TYPES:
            raise ValueError(f"question {self.record_id}/{self.question_id}: type must be one of {QUESTION_TYPES}, got {self.type!r}")
        if len(self.option_keys) < 2:
            raise ValueError(f"question {self.record_id}/{self.question_id}: needs at least 2 options, got {len(self.option_keys)}")
        if len(self.option_texts) != len(self.option_keys):
            raise ValueError(f"question {self.record_id}/{self.question_id}: option_texts and option_keys differ in length")

    @property
    def key(self) -> str:
        """``record_id/question_id``: how errors name the question."""
        return f"{self.record_id}/{self.question_id}"

    @property
    def n_options(self) -> int:
        return len(self.option_keys)

    def target(self) -> np.ndarray | None:
        """The training target over the options: the soft label if any, else one-hot; None if unlabelled."""
        if self.soft_label is not None:
            return np.asarray(self.soft_label, dtype=np.float64)
        if self.label is None:
            return None
        t = np.zeros(self.n_options, dtype=np.float64)
        t[self.label] = 1.0
        return t


def questions_from_table(table: pa.Table) -> list[QuestionInput]:
    """One :class:`QuestionInput` per row of a question table (labels optional)."""
    names = set(table.column_names)
    required = {"record_id", "question_id", "type", "family", "state_text", "instructions_text", "option_keys", "option_texts"}
    missing = sorted(required - names)
    if missing:
        raise ValueError(f"question table lacks column(s) {missing!r}")
    cols = {name: table.column(name).to_pylist() for name in required | (names & {"label", "soft_label"})}
    n = table.num_rows
    labels = cols.get("label", [None] * n)
    softs = cols.get("soft_label", [None] * n)
    return [
        QuestionInput(
            record_id=cols["record_id"][i],
            question_id=cols["question_id"][i],
            type=cols["type"][i],
            family=cols["family"][i],
            state_text=cols["state_text"][i],
            instructions_text=cols["instructions_text"][i],
            option_keys=tuple(cols["option_keys"][i]),
            option_texts=tuple(cols["option_texts"][i]),
            label=labels[i],
            soft_label=None if softs[i] is None else tuple(softs[i]),
        )
        for i in range(n)
    ]


def as_questions(data: pa.Table | Sequence[Record] | Sequence[QuestionInput]) -> list[QuestionInput]:
    """Accept a question table, records, or questions; return questions in input order."""
    if isinstance(data, pa.Table):
        return questions_from_table(data)
    items = list(data)
    if not items:
        return []
    if all(isinstance(x, QuestionInput) for x in items):
        return items  # type: ignore[return-value]
    if all(isinstance(x, Record) for x in items):
        return questions_from_table(questions_table(items))  # type: ignore[arg-type]
    raise TypeError("expected a pyarrow question table, a sequence of Record, or a sequence of QuestionInput")


@dataclass(frozen=True)
class Encoded:
    """One question's model input.

    Attributes:
        input_ids: Token ids of the whole sequence (no padding).
        token_type_ids: Segment ids (encoders), or None.
        option_positions: Where each option is read (decision head: marker
            positions; label token: empty, options are read at the last token).
        option_ends: Decision head: the end (exclusive) of each option's words,
            which run from just after its marker; empty for the label token.
        label_ids: Label token ids of the options (label token readout), or empty.
        n_options: Number of options.
        truncated: Whether state tokens were dropped to fit ``max_length``.
        n_state_tokens_dropped: How many.
        family: The question's family (the decision head's per-family parameters read it; ``""``: none).
    """

    input_ids: tuple[int, ...]
    token_type_ids: tuple[int, ...] | None
    option_positions: tuple[int, ...]
    option_ends: tuple[int, ...]
    label_ids: tuple[int, ...]
    n_options: int
    truncated: bool
    n_state_tokens_dropped: int
    family: str = ""

    def __len__(self) -> int:
        return len(self.input_ids)


def fit_state(state_ids: Sequence[int], budget: int) -> tuple[list[int], int]:
    """Fit the state into ``budget`` tokens by dropping its **middle**; return the kept ids and the number dropped.

    The first ``budget // 2`` tokens and the last ``budget - budget // 2`` are
    kept: a state's beginning says who and when, its end says what is about to
    happen (the pending action, the latest message), and both matter more often
    than the middle.
    """
    budget = max(budget, 0)
    n = len(state_ids)
    if n <= budget:
        return list(state_ids), 0
    head = budget // 2
    tail = budget - head
    kept = [*state_ids[:head], *state_ids[n - tail:]] if tail else list(state_ids[:head])
    return kept, n - budget


def tokenize_unique(tokenizer: Any, texts: Iterable[str]) -> dict[str, list[int]]:
    """Token ids (no special tokens) of each distinct text, tokenized in one batch.

    Questions about one state share its text, so the state is tokenized once.
    """
    unique = list(dict.fromkeys(texts))
    if not unique:
        return {}
    ids = tokenizer(unique, add_special_tokens=False)["input_ids"]
    return dict(zip(unique, ids))


def soft_cross_entropy(logits: torch.Tensor, option_mask: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean over questions of ``-sum_k y_k log softmax(z)_k`` over each question's own options.

    ``targets`` is one-hot for a hard label and the soft label otherwise, so
    both train with the same loss. Entries past a question's options get no
    probability mass and no gradient.
    """
    z = logits.float().masked_fill(~option_mask, float("-inf"))
    logp = torch.log_softmax(z, dim=-1).masked_fill(~option_mask, 0.0)
    return -(targets.to(logp.dtype) * logp).sum(dim=-1).mean()


def pad_2d(rows: Sequence[Sequence[int]], value: int, *, left: bool = False, width: int | None = None) -> torch.Tensor:
    """Pad ragged integer rows to one ``(n, width)`` long tensor."""
    width = max((len(r) for r in rows), default=0) if width is None else width
    out = torch.full((len(rows), width), value, dtype=torch.long)
    for i, r in enumerate(rows):
        if len(r):
            t = torch.as_tensor(list(r), dtype=torch.long)
            if left:
                out[i, width - len(r):] = t
            else:
                out[i, : len(r)] = t
    return out


def option_mask(items: Sequence[Encoded]) -> torch.Tensor:
    """``(n, max_options)`` bool: True where the option exists."""
    k = max(e.n_options for e in items)
    return torch.arange(k)[None, :] < torch.as_tensor([e.n_options for e in items])[:, None]


class ReadoutModel(nn.Module):
    """The common surface of both readouts (see the module docstring)."""

    readout: str = ""

    #: The peft-wrapped base model (LoRA on it); its forward is called once per batch.
    encoder: nn.Module

    @classmethod
    def from_recipe(cls, recipe: "Recipe", *, adapter_dir: str | Path | None = None,
                    trainable: bool = False) -> "ReadoutModel":  # pragma: no cover - abstract
        """The recipe's base model with LoRA (fresh, or the saved adapter in ``adapter_dir``) and a fresh head."""
        raise NotImplementedError

    def encode_many(self, questions: Sequence[QuestionInput]) -> list[Encoded]:  # pragma: no cover - abstract
        raise NotImplementedError

    def collate(self, items: Sequence[Encoded]) -> dict[str, torch.Tensor]:  # pragma: no cover - abstract
        raise NotImplementedError

    def head_state_dict(self) -> dict[str, torch.Tensor]:  # pragma: no cover - abstract
        """Tensors saved in ``head.safetensors`` (besides the adapter)."""
        raise NotImplementedError

    def load_head_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    @property
    def config(self) -> Any:
        """The base model's config (DeepSpeed's ``auto`` values read ``hidden_size`` from it)."""
        return self.encoder.get_base_model().config  # type: ignore[operator]

    def trainable_parameter_names(self) -> list[str]:
        """Names of the parameters that train (LoRA, plus the head for the decision head)."""
        return [n for n, p in self.named_parameters() if p.requires_grad]


def lora_config(recipe: "Recipe", task_type: str | None, n_layers: int | None = None) -> Any:
    """peft ``LoraConfig`` from the recipe's ``lora`` section (on the layers above ``frozen_layers`` only)."""
    from peft import LoraConfig

    layers: dict[str, Any] = {}
    if getattr(recipe, "frozen_layers", 0):
        if n_layers is None or recipe.frozen_layers >= n_layers:
            raise ValueError(f"recipe field 'frozen_layers': {recipe.frozen_layers} leaves no layer of the "
                             f"{n_layers}-layer encoder to train (allowed: 0 to {(n_layers or 1) - 1})")
        layers = {"layers_to_transform": list(range(recipe.frozen_layers, n_layers)), "layers_pattern": "layer"}
    return LoraConfig(
        r=recipe.lora.r,
        lora_alpha=recipe.lora.alpha,
        lora_dropout=recipe.lora.dropout,
        target_modules=list(recipe.lora.target_modules),
        bias="none",
        task_type=task_type,
        **layers,
    )


def wrap_lora(base: nn.Module, recipe: "Recipe", *, adapter_dir: str | Path | None, trainable: bool, task_type: str | None) -> nn.Module:
    """Put LoRA on ``base``: a fresh adapter from the recipe, or the saved one in ``adapter_dir``."""
    from peft import PeftModel, get_peft_model

    if adapter_dir is not None:
        model = PeftModel.from_pretrained(base, str(adapter_dir), is_trainable=trainable)
        # A checkpoint's adapter_config.json names the base model by the recipe's spec (``packaged:minilm``),
        # not a path; peft reads the field as a local path or hub id (when saving, it looks for the base's
        # config.json there), so in memory it names the directory the base was just loaded from, as for a
        # fresh adapter. The checkpoint writer puts the spec back on disk.
        for config in model.peft_config.values():
            config.base_model_name_or_path = getattr(base, "name_or_path", None) or None
        return model
    try:
        n_layers = getattr(getattr(base, "config", None), "num_hidden_layers", None)
        return get_peft_model(base, lora_config(recipe, task_type, n_layers))
    except ValueError as exc:
        # peft says which target modules were not found; add which field to change.
        raise ValueError(f"recipe field 'lora.target_modules' {list(recipe.lora.target_modules)!r}: {exc}") from exc


__all__ = [
    "Encoded",
    "InputTooLongError",
    "QuestionInput",
    "ReadoutModel",
    "as_questions",
    "fit_state",
    "questions_from_table",
    "soft_cross_entropy",
]
