"""The decision-head readout: an encoder reads the question, its marked options and the state in one pass.

One sequence per question::

    [CLS] question [SEP] [M] key: description [M] key: description ... [SEP] state [SEP]
    └──────────────── segment 0 ────────────────────────────────────────┘ └─ segment 1 ─┘

Each option is read at its marker ``[M]``: the marker's hidden state,
concatenated with the mean hidden state of the option's own words (from just
after its marker to the next marker or the closing ``[SEP]``), goes through a
small head (``Linear(2·hidden → head_hidden) → GELU → Linear(head_hidden → 1)``)
that gives the option's logit; the softmax runs over the question's own
options. The encoder runs **once per question** whatever the number of options
(2 to 255).

With ``state_attention`` (a recipe switch, off in the CPU recipe) each option
also *looks up* the state: one learned scaled dot-product attention, queried
by the option's ``[marker; words]`` over the hidden states of the state's
tokens, and the head reads ``[marker; words; attended state]``
(``3·hidden``). Many decisions hinge on facts the state attaches to one option
(its price and delivery time, whether a service is among the connected ones):
the attention hands the head those tokens directly, at the cost of one small
matrix product per option, still within the one encoder pass.

Why the span mean beside the marker: the marker's input embedding is the same
for every option, so at the start of training its hidden state carries little
of *which* option it marks; the mean of the option's words does (measured here
on a small colour/urgency/satisfaction task, 96 questions, 6 epochs: choice
accuracy 0.31 with the marker alone, 1.00 with marker + span mean). Both are
contextual, so an option's vector still sees the question and the state.

With ``family_head`` (a recipe switch) the head also has **per-family
parameters**: the question's family, hashed into one of :data:`FAMILY_SLOTS`
slots (:func:`family_slot`; no vocabulary to store, and a family the model
never saw lands on a slot whose parameters are still zero), selects a shift
``b_f`` and a scale ``s_f`` of the head's hidden layer and extra output weights
``u_f``::

    h = GELU(W·x + b + b_f) ⊙ (1 + s_f)        logit = (w + u_f)·h + c

All three start at zero (the head starts as the shared one) and train with the
head's learning rate. The shared head is one function for every family; the
families it loses are per-family lookups (a level word mapped to a score
through that family's policy), which ``b_f``, ``s_f`` and ``u_f`` let each
family read from its own mix of the same hidden units, for ~3·256 parameters a
family.

Option words: noul options read ``yes`` / ``no`` (their keys are ``true`` /
``false``), score options read ``<level>: <level name>``, choice options
``<key>: <description>``.

The marker is the vocabulary's ``[unused0]`` (id 1 in the BERT vocab), put in
by id rather than through text:

* no ``resize_token_embeddings``: the base weights stay byte-identical to the
  packaged file (its sha256 in the provenance keeps meaning something) and the
  adapter carries no embedding matrix;
* user text can never forge a marker: the string ``[unused0]`` in a state is
  tokenized as ordinary word pieces, since it is not a registered special token.

Its input embedding is an untrained row; what the head reads is the marker's
*contextual* hidden state, which LoRA on the attention learns to fill with its
option's meaning.

Truncation: only the state is cut (its middle: its start and end are kept,
see :func:`~envloop_pipelines.core.model.readout.fit_state`), to fit ``max_length``; the
question and option block are never cut. When that block alone does not fit
(``[CLS] … [SEP]`` + the final ``[SEP]`` > ``max_length``) encoding raises
:class:`~envloop_pipelines.core.model.readout.InputTooLongError` naming the
question, its block length and the limit (raise ``max_length`` up to 512, the
encoder's position limit, or shorten the option descriptions).
"""

from __future__ import annotations

import logging
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

log = logging.getLogger(__name__)

#: The option marker: an unused vocabulary entry, so no embedding resize (see the module docstring).
MARKER_TOKEN = "[unused0]"
#: What noul options read as (their keys stay ``true`` / ``false``).
NOUL_WORDS: dict[str, str] = {"true": "yes", "false": "no"}
#: Slots of the per-family parameters (``family_head``); families are hashed into them.
FAMILY_SLOTS = 256


def family_slot(family: str) -> int:
    """The per-family parameters' slot of a family: the first 8 bytes of its name's sha256, modulo :data:`FAMILY_SLOTS`."""
    import hashlib

    return int.from_bytes(hashlib.sha256(family.encode("utf-8")).digest()[:8], "little") % FAMILY_SLOTS


#: The dropout probabilities of a BERT-class config that ``encoder_dropout`` sets.
ENCODER_DROPOUT_KEYS: tuple[str, ...] = ("hidden_dropout_prob", "attention_probs_dropout_prob")


def encoder_dropout_config(base_dir: str | Path, dropout: float | None) -> dict[str, float]:
    """``from_pretrained`` keyword arguments that set the encoder's dropout (the recipe's ``encoder_dropout``).

    Empty for ``None`` (the base model's own). Dropout acts in training only; measured on the frozen-3 CPU
    recipe here, the encoder's dropout masks are ~17% of a training step's time.

    Raises:
        ValueError: the base model's config has none of :data:`ENCODER_DROPOUT_KEYS` (not BERT-class).
    """
    if dropout is None:
        return {}
    import json

    config = json.loads((Path(base_dir) / "config.json").read_text(encoding="utf-8"))
    keys = [k for k in ENCODER_DROPOUT_KEYS if k in config]
    if not keys:
        raise ValueError(f"recipe field 'encoder_dropout': {base_dir}/config.json has none of "
                         f"{', '.join(ENCODER_DROPOUT_KEYS)}; leave encoder_dropout null for this base model")
    return {k: float(dropout) for k in keys}


def option_text(qtype: str, key: str, text: str | None) -> str:
    """The words after an option's marker."""
    shown = NOUL_WORDS.get(key, key) if qtype == "noul" else key
    return f"{shown}: {text}" if text else shown


class DecisionHead(nn.Module):
    """``[marker; option words]`` (and, with ``state_attention``, the attended state) → option logit."""

    def __init__(self, hidden_size: int, head_hidden: int, *, state_attention: bool = False,
                 family_head: bool = False) -> None:
        super().__init__()
        self.state_attention = state_attention
        self.family_head = family_head
        if state_attention:
            self.query = nn.Linear(2 * hidden_size, hidden_size)
            self.key = nn.Linear(hidden_size, hidden_size)
        self.proj = nn.Linear((3 if state_attention else 2) * hidden_size, head_hidden)
        self.act = nn.GELU()
        self.out = nn.Linear(head_hidden, 1)
        if family_head:  # per-family shift, scale and output weights; zero: the shared head (module docstring)
            self.family_shift = nn.Embedding(FAMILY_SLOTS, head_hidden)
            self.family_scale = nn.Embedding(FAMILY_SLOTS, head_hidden)
            self.family_out = nn.Embedding(FAMILY_SLOTS, head_hidden)
            for table in (self.family_shift, self.family_scale, self.family_out):
                nn.init.zeros_(table.weight)

    def forward(self, options: torch.Tensor, hidden: torch.Tensor | None = None,
                state_mask: torch.Tensor | None = None, family_slots: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``(batch, options)`` from ``options`` = ``[marker; words]`` ``(batch, options, 2·hidden)``.

        With ``state_attention``, ``hidden`` ``(batch, seq, hidden)`` and ``state_mask``
        ``(batch, seq)`` (true on the state's tokens) are required; with ``family_head``,
        ``family_slots`` ``(batch,)`` (each question's :func:`family_slot`).
        """
        if self.state_attention:
            if hidden is None or state_mask is None:
                raise ValueError("state_attention needs the encoder's hidden states and the state mask")
            scores = torch.bmm(self.query(options), self.key(hidden).transpose(1, 2)) / hidden.size(-1) ** 0.5
            scores = scores.masked_fill(~state_mask[:, None, :], torch.finfo(scores.dtype).min)
            attended = torch.bmm(torch.softmax(scores, dim=-1), hidden)  # (batch, options, hidden)
            options = torch.cat([options, attended], dim=-1)
        if not self.family_head:
            return self.out(self.act(self.proj(options))).squeeze(-1)
        if family_slots is None:
            raise ValueError("family_head needs each question's family slot (collate the batch with this model)")
        pre = self.proj(options) + self.family_shift(family_slots)[:, None, :]
        h = self.act(pre) * (1.0 + self.family_scale(family_slots)[:, None, :])
        return self.out(h).squeeze(-1) + (h * self.family_out(family_slots)[:, None, :]).sum(-1)


class DecisionHeadModel(ReadoutModel):
    """Encoder (LoRA) + :class:`DecisionHead`; see the module docstring."""

    readout = "decision_head"

    def __init__(self, encoder: nn.Module, tokenizer: object, head_hidden: int, max_length: int, *,
                 state_attention: bool = False, frozen_layers: int = 0, feature_cache: Any = None,
                 family_head: bool = False) -> None:
        super().__init__()
        self.encoder = encoder
        #: Layers run once per distinct input through ``feature_cache`` (``core/model/features.py``); 0: none.
        self.frozen_layers = frozen_layers
        self.feature_cache = feature_cache
        self.tokenizer = tokenizer
        self.max_length = max_length
        config = encoder.get_base_model().config  # type: ignore[operator]
        if max_length > config.max_position_embeddings:
            raise ValueError(
                f"recipe field 'max_length': {max_length} exceeds the encoder's {config.max_position_embeddings} positions"
            )
        self.head = DecisionHead(config.hidden_size, head_hidden, state_attention=state_attention,
                                 family_head=family_head)
        tok = tokenizer
        self.cls_id: int = tok.cls_token_id  # type: ignore[attr-defined]
        self.sep_id: int = tok.sep_token_id  # type: ignore[attr-defined]
        self.pad_id: int = tok.pad_token_id  # type: ignore[attr-defined]
        marker = tok.convert_tokens_to_ids(MARKER_TOKEN)  # type: ignore[attr-defined]
        if marker is None or marker == tok.unk_token_id:  # type: ignore[attr-defined]
            raise ValueError(f"the encoder's vocabulary has no {MARKER_TOKEN!r} entry to use as the option marker")
        self.marker_id: int = int(marker)

    @classmethod
    def from_recipe(cls, recipe: "Recipe", *, adapter_dir: str | Path | None = None, trainable: bool = False) -> "DecisionHeadModel":
        """Load the base encoder and tokenizer, put LoRA on it, and add a fresh head."""
        from transformers import AutoModel, AutoTokenizer

        from envloop_pipelines.core.model.recipe import resolve_base_model

        base_dir = resolve_base_model(recipe)
        tokenizer = AutoTokenizer.from_pretrained(str(base_dir))
        base = AutoModel.from_pretrained(str(base_dir), **encoder_dropout_config(base_dir, recipe.encoder_dropout))
        if getattr(base, "pooler", None) is not None:
            base.pooler = None  # unused: the head reads the options, not [CLS]; dropped so no LoRA lands on it
        encoder = wrap_lora(base, recipe, adapter_dir=adapter_dir, trainable=trainable, task_type=None)
        cache = None
        if recipe.frozen_layers:
            from envloop_pipelines.core.model.features import cache_for

            cache = cache_for(base_dir, recipe.frozen_layers)
        return cls(encoder, tokenizer, recipe.head_hidden, recipe.max_length, state_attention=recipe.state_attention,
                   frozen_layers=recipe.frozen_layers, feature_cache=cache, family_head=recipe.family_head)

    # ------------------------------------------------------------------ encoding

    def encode_many(self, questions: Sequence[QuestionInput]) -> list[Encoded]:
        """Encode each question as one sequence (see the module docstring)."""
        texts: list[str] = []
        for q in questions:
            texts.append(q.state_text)
            texts.append(q.instructions_text)
            texts.extend(option_text(q.type, k, t) for k, t in zip(q.option_keys, q.option_texts))
        ids = tokenize_unique(self.tokenizer, texts)
        return [self._encode(q, ids) for q in questions]

    def _encode(self, q: QuestionInput, ids: Mapping[str, list[int]]) -> Encoded:
        block = [self.cls_id, *ids[q.instructions_text], self.sep_id]
        positions: list[int] = []
        ends: list[int] = []
        for key, text in zip(q.option_keys, q.option_texts):
            positions.append(len(block))
            block.append(self.marker_id)
            block.extend(ids[option_text(q.type, key, text)])
            ends.append(len(block))
        block.append(self.sep_id)
        budget = self.max_length - len(block) - 1  # room for the state and its closing [SEP]
        if budget < 0:
            raise InputTooLongError(
                f"question {q.key}: the question and its {q.n_options} options take {len(block) + 1} tokens, "
                f"over max_length={self.max_length} (the state is the only part cut); raise the recipe's "
                f"max_length (at most 512 for this encoder) or shorten the option descriptions"
            )
        state, dropped = fit_state(ids[q.state_text], budget)
        input_ids = block + state + [self.sep_id]
        token_types = [0] * len(block) + [1] * (len(state) + 1)
        return Encoded(
            input_ids=tuple(input_ids),
            token_type_ids=tuple(token_types),
            option_positions=tuple(positions),
            option_ends=tuple(ends),
            label_ids=(),
            n_options=q.n_options,
            truncated=dropped > 0,
            n_state_tokens_dropped=dropped,
            family=q.family,
        )

    def collate(self, items: Sequence[Encoded]) -> dict[str, torch.Tensor]:
        """Right-pad a batch; missing options get position 0 and an empty span (masked out by ``option_mask``).

        With ``frozen_layers``, ``lower_hidden`` holds each sequence's lower-layer features (from the
        feature cache, computed on a miss), right-padded with zeros.
        """
        batch = {
            "input_ids": pad_2d([e.input_ids for e in items], self.pad_id),
            "attention_mask": pad_2d([[1] * len(e) for e in items], 0),
            "token_type_ids": pad_2d([e.token_type_ids or () for e in items], 0),
            "option_positions": pad_2d([e.option_positions for e in items], 0),
            "option_ends": pad_2d([e.option_ends for e in items], 0),
            "option_mask": option_mask(items),
        }
        if self.head.family_head:
            batch["family_slots"] = torch.tensor([family_slot(e.family) for e in items], dtype=torch.long)
        if self.frozen_layers:
            features = [self.lower_features(e) for e in items]
            lower = torch.zeros((len(items), batch["input_ids"].shape[1], features[0].shape[-1]), dtype=torch.float32)
            for i, f in enumerate(features):
                lower[i, : f.shape[0]] = f
            batch["lower_hidden"] = lower
        return batch

    def lower_features(self, item: Encoded) -> torch.Tensor:
        """The frozen layers' output for one encoded question: from the cache, or computed and cached."""
        from envloop_pipelines.core.model.features import run_lower, sequence_key

        types = item.token_type_ids or (0,) * len(item.input_ids)
        key = sequence_key(item.input_ids, types)
        found = self.feature_cache.get(key) if self.feature_cache is not None else None
        if found is None:
            found = run_lower(self.encoder, self.frozen_layers, item.input_ids, types)
            if self.feature_cache is not None:
                self.feature_cache.put(key, found)
        return found

    # ------------------------------------------------------------------ forward

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor,
        option_positions: torch.Tensor,
        option_ends: torch.Tensor,
        option_mask: torch.Tensor,
        lower_hidden: torch.Tensor | None = None,
        family_slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Option logits ``(batch, max_options)``: one encoder pass for the whole batch.

        With ``frozen_layers`` the pass starts from ``lower_hidden`` (the collated cache features) and
        runs the layers above them only.
        """
        if self.frozen_layers:
            from envloop_pipelines.core.model.features import run_upper

            if lower_hidden is None:
                raise ValueError("frozen_layers: the batch has no lower_hidden (collate it with this model)")
            hidden = run_upper(self.encoder, self.frozen_layers, lower_hidden, attention_mask)
        else:
            hidden = self.encoder(
                input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
            ).last_hidden_state
        hidden = hidden.float()
        index = option_positions.unsqueeze(-1).expand(-1, -1, hidden.size(-1))
        markers = torch.gather(hidden, 1, index)  # (batch, options, hidden)
        # Option k's words are the positions strictly between its marker and end_k: an averaging matrix.
        pos = torch.arange(hidden.size(1), device=hidden.device)
        span = (pos[None, None, :] > option_positions[:, :, None]) & (pos[None, None, :] < option_ends[:, :, None])
        span = span.to(hidden.dtype)
        words = torch.bmm(span, hidden) / span.sum(-1, keepdim=True).clamp(min=1.0)
        # The state's tokens: segment 1, not padding (its closing [SEP] included, so the mask is never empty).
        state_mask = (token_type_ids == 1) & attention_mask.bool()
        return self.head(torch.cat([markers, words], dim=-1), hidden, state_mask, family_slots)

    # ------------------------------------------------------------------ head state

    def head_state_dict(self) -> dict[str, torch.Tensor]:
        return {f"head.{k}": v.detach().cpu().contiguous() for k, v in self.head.state_dict().items()}

    def load_head_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        own = {k[len("head."):]: v for k, v in state.items() if k.startswith("head.")}
        extra = sorted(k for k in state if not k.startswith("head."))
        if extra:
            raise ValueError(f"head.safetensors: unexpected tensors {extra!r} for the decision_head readout")
        self.head.load_state_dict(own, strict=True)


__all__ = ["DecisionHead", "DecisionHeadModel", "ENCODER_DROPOUT_KEYS", "FAMILY_SLOTS", "MARKER_TOKEN", "NOUL_WORDS", "family_slot",
           "encoder_dropout_config", "option_text"]
