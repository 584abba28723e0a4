"""LoRA SFT of a local causal LM on chat transcripts: loss on the assistant's tokens only.

A row is one conversation in the OpenAI chat format (``messages``: system,
user, assistant turns with their ``tool_calls``, ``tool`` results; ``tools``:
the tool definitions offered), exactly as an agent attempt recorded it
(:class:`~envloop_pipelines.core.agents.attempts.Attempt`). The row is rendered
by the tokenizer's own chat template (``tools`` rendered by the template, as at
serving time), and the labels are ``-100`` everywhere except on the tokens the
assistant wrote: its text, its ``<tool_call>`` blocks and its end-of-turn
token. System, user and tool-result tokens teach nothing and are masked.

Which characters are the assistant's is read from the template itself, with no
knowledge of its markup: for each assistant message *i*, the conversation up to
*i* is rendered twice, once ending in the generation prompt (what the model
sees when it is asked to speak) and once ending with message *i*; the assistant
wrote everything after the first point where the two differ. A template whose
renderings are not prefixes of one another (one that rewrites earlier turns)
is refused with the message index, since its masks would not be right.

A tokenizer without a chat template (the tiny models of the tests) gets
:data:`CHAT_TEMPLATE`, a Qwen2.5-style template (``<|im_start|>role ...
<|im_end|>``, tools listed in ``<tools>``, calls as ``<tool_call>{json}
</tool_call>``, results as ``<tool_response>``). The template used is stored
in the policy checkpoint (``chat_template.jinja``) and served with it, so
training and serving render the same way; vLLM takes the same file with
``--chat-template``.

The policy checkpoint is a directory, written once to a temporary sibling and
renamed (never overwritten), with a sha256 manifest; its identity is the
manifest's hash without the volatile ``metrics.json`` and ``provenance.json``
(as for decision checkpoints, :func:`~envloop_pipelines.core.model.checkpoint.identity_of`)::

    adapter/              peft LoRA (adapter_config.json names the base model by the recipe's spec)
    chat_template.jinja   the template the rows were rendered with
    recipe.yaml           the causal-SFT recipe
    data.json             the SFT snapshot's sha256
    metrics.json          per-step loss, tokens trained, rows truncated or dropped
    provenance.json       package versions, git, recipe hash, base model sha256
    manifest.json         sha256 of every file above
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Mapping, Sequence

import torch
import yaml

from envloop_pipelines.core.model.checkpoint import (
    ADAPTER_CONFIG,
    ADAPTER_MODEL_CARD,
    MANIFEST,
    build_provenance,
    identity_of,
    stable_adapter_config,
)
from envloop_pipelines.core.model.policy import (  # the policy's rendering and loading, shared with serving
    ADAPTER_DIR,
    CHAT_TEMPLATE,
    CHAT_TEMPLATE_FILE,
    DATA_FILE,
    END_OF_TURN_TOKENS,
    FORMAT,
    METRICS_FILE,
    PROVENANCE_FILE,
    RECIPE_FILE,
    ChatTemplateError,
    PolicyCheckpoint,
    ensure_chat_template,
    load_policy,
    load_tokenizer,
    policy_manifest,
    read_policy_checkpoint,
    render,
    template_messages,
)
from envloop_pipelines.core.model.recipe import (
    LoraSpec,
    Recipe,
    RecipeError,
    TrainerFields,
    recipe_values,
    resolve_base_model,
)
from envloop_pipelines.core.storage import publish_dir, staging_dir

log = logging.getLogger(__name__)

IGNORE_INDEX = -100
#: Where shipped causal-SFT recipes live (a folder of their own: ``recipes/*.yaml`` are decision-model recipes).
CAUSAL_SFT_RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes" / "causal_sft"

# --------------------------------------------------------------------------- the recipe


@dataclass(frozen=True, kw_only=True)
class CausalSftRecipe(TrainerFields):
    """What decides a causal-SFT run, except the data: the fields :class:`TrainerFields` shares with the
    decision :class:`Recipe` (validated alike), with this recipe's own defaults.

    Attributes:
        base_model: a local Hugging Face causal LM directory (config.json, weights, tokenizer); required.
        max_length: tokens per conversation; longer ones are cut at the end (counted in the metrics).
        lora: LoRA on the base model (default: attention and MLP projections).
        lr, epochs, max_steps, batch_size, grad_accum, weight_decay, warmup_ratio, lr_scheduler,
        max_grad_norm, seed, precision, gradient_checkpointing, deepspeed: as in :class:`TrainerFields`.
    """

    base_model: str
    max_length: int = 1024
    lora: LoraSpec = field(default_factory=lambda: LoraSpec(target_modules=(
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")))
    lr: float = 2e-4
    epochs: int = 2
    batch_size: int = 8
    weight_decay: float = 0.0
    warmup_ratio: float = 0.03
    lr_scheduler: str = "cosine"

    KIND: ClassVar[str] = "causal-SFT recipe"
    PACKAGED_DIR: ClassVar[Path] = CAUSAL_SFT_RECIPES_DIR

    @classmethod
    def from_dict(cls, data: Any) -> "CausalSftRecipe":
        """Build and validate a causal-SFT recipe; an unknown key is an error naming it, ``base_model`` required."""
        values = recipe_values(data, cls, cls.KIND)
        if "base_model" not in values:
            raise RecipeError("causal-SFT recipe field 'base_model': required (a local causal LM directory)")
        return cls(**values)

    def as_training_recipe(self) -> Recipe:
        """The same training settings as a :class:`Recipe` (for the LoRA config and provenance helpers)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return Recipe(readout="label_token", **values)

    def to_dict(self) -> dict[str, Any]:
        """JSON/YAML-safe form (inverse of :meth:`from_dict`)."""
        data = dataclasses.asdict(self)
        data["lora"]["target_modules"] = list(self.lora.target_modules)
        return data

    @property
    def hash(self) -> str:
        """sha256 of the recipe's canonical JSON."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()).hexdigest()


# --------------------------------------------------------------------------- rendering and masks


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def assistant_spans(tokenizer: Any, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] = (),
                    *, where: str = "row") -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans the assistant wrote (see the module docstring).

    Raises:
        ChatTemplateError: the template rewrites an earlier turn, or no message is the assistant's.
    """
    msgs = template_messages(messages, where=where)
    full = render(tokenizer, msgs, tools)
    spans: list[tuple[int, int]] = []
    for i, message in enumerate(msgs):
        if message["role"] != "assistant":
            continue
        asked = render(tokenizer, msgs[:i], tools, add_generation_prompt=True)
        upto = render(tokenizer, msgs[: i + 1], tools)
        if not full.startswith(upto):
            raise ChatTemplateError(f"{where}: the chat template renders messages[:{i + 1}] differently inside the whole "
                                    f"conversation (it rewrites earlier turns), so the assistant's tokens cannot be told apart")
        start = _common_prefix(asked, upto)
        if start < len(upto):
            spans.append((start, len(upto)))
    if not spans:
        raise ChatTemplateError(f"{where}: no assistant message to train on")
    return full, spans


@dataclass(frozen=True)
class EncodedChat:
    """One conversation as token ids and labels (``-100`` where the loss is off)."""

    input_ids: tuple[int, ...]
    labels: tuple[int, ...]
    truncated: bool

    @property
    def n_trained(self) -> int:
        return sum(1 for t in self.labels if t != IGNORE_INDEX)


def encode_chat(tokenizer: Any, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] = (), *,
                max_length: int, where: str = "row") -> EncodedChat:
    """Token ids of the rendered conversation, labels on the assistant's tokens only, cut at ``max_length``.

    A token is the assistant's when its first character is (offsets from the fast tokenizer).
    """
    text, spans = assistant_spans(tokenizer, messages, tools, where=where)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    labels = []
    k = 0
    for tok, (start, end) in zip(ids, enc["offset_mapping"]):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        inside = k < len(spans) and spans[k][0] <= start < spans[k][1] and end > start
        labels.append(tok if inside else IGNORE_INDEX)
    truncated = len(ids) > max_length
    return EncodedChat(tuple(ids[:max_length]), tuple(labels[:max_length]), truncated)


# --------------------------------------------------------------------------- the model


class _ChatDataset(torch.utils.data.Dataset):
    def __init__(self, rows: Sequence[EncodedChat]) -> None:
        self.rows = list(rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> EncodedChat:
        return self.rows[i]


class _ChatCollator:
    """Right-pads ids with the pad token, labels with -100."""

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def __call__(self, rows: Sequence[EncodedChat]) -> dict[str, torch.Tensor]:
        width = max(len(r.input_ids) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            n = len(r.input_ids)
            ids[i, :n] = torch.tensor(r.input_ids)
            labels[i, :n] = torch.tensor(r.labels)
            mask[i, :n] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True, allow_nan=False) + "\n").encode("utf-8")


def train_causal_sft(rows: Sequence[Mapping[str, Any]], recipe: CausalSftRecipe, out_dir: str | Path, *,
                     data_hash: str) -> PolicyCheckpoint:
    """LoRA SFT of ``recipe.base_model`` on chat ``rows`` (each ``{"messages", "tools"}``); writes the checkpoint.

    Args:
        rows: the SFT snapshot's rows.
        recipe: the training recipe.
        out_dir: the checkpoint directory to create (must not exist).
        data_hash: the SFT snapshot's sha256 (recorded).

    Returns:
        The checkpoint. On several processes (DeepSpeed), rank 0 alone writes it.

    Raises:
        ValueError: no row has an assistant token left within ``max_length``; ``out_dir`` exists.
        ChatTemplateError: a row that cannot be rendered, naming it.
    """
    from peft import get_peft_model
    from transformers import Trainer, set_seed

    from envloop_pipelines.core.model.readout import lora_config
    from envloop_pipelines.core.model.training import _deterministic, is_main_process, trainer_arguments

    out_dir = Path(out_dir)
    if out_dir.exists():
        raise ValueError(f"{out_dir} exists; a policy checkpoint is never overwritten")
    base_dir = resolve_base_model(recipe)
    tokenizer = load_tokenizer(base_dir)
    encoded, dropped = [], []
    for n, row in enumerate(rows):
        where = str(row.get("id") or f"row {n}")
        enc = encode_chat(tokenizer, row["messages"], row.get("tools") or (), max_length=recipe.max_length, where=where)
        if enc.n_trained == 0:
            dropped.append(where)
        else:
            encoded.append(enc)
    if not encoded:
        raise ValueError(f"no SFT row has an assistant token within max_length={recipe.max_length} "
                         f"({len(rows)} rows, {len(dropped)} cut before the assistant spoke)")
    set_seed(recipe.seed)
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    if recipe.gradient_checkpointing and torch.cuda.is_available():
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        base.enable_input_require_grads()
    try:
        model = get_peft_model(base, lora_config(recipe.as_training_recipe(), "CAUSAL_LM"))
    except ValueError as exc:
        raise ValueError(f"recipe field 'lora.target_modules' {list(recipe.lora.target_modules)!r}: {exc}") from exc
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    t0 = time.perf_counter()
    stage = staging_dir(out_dir.parent)
    with _deterministic():
        args = trainer_arguments(recipe, str(stage / "trainer"), label_names=["labels"], log_every_step=True)
        trainer = Trainer(model=model, args=args,
                          train_dataset=_ChatDataset(encoded), data_collator=_ChatCollator(int(pad)))
        from transformers.trainer_callback import PrinterCallback

        trainer.remove_callback(PrinterCallback)  # the losses go to metrics.json, not stdout
        result = trainer.train()
    seconds = time.perf_counter() - t0
    if not is_main_process():
        shutil.rmtree(stage, ignore_errors=True)
        return PolicyCheckpoint(str(out_dir), "", recipe.base_model)
    shutil.rmtree(stage / "trainer", ignore_errors=True)
    losses = [float(e["loss"]) for e in trainer.state.log_history if "loss" in e]
    adapter = stage / ADAPTER_DIR
    model.save_pretrained(str(adapter))
    (adapter / ADAPTER_MODEL_CARD).unlink(missing_ok=True)
    config = json.loads((adapter / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    config["base_model_name_or_path"] = recipe.base_model  # the spec, not where it is installed
    (adapter / ADAPTER_CONFIG).write_text(json.dumps(stable_adapter_config(config), indent=2, sort_keys=True),
                                          encoding="utf-8")
    (stage / CHAT_TEMPLATE_FILE).write_text(tokenizer.chat_template, encoding="utf-8")
    (stage / RECIPE_FILE).write_text(yaml.safe_dump(recipe.to_dict(), sort_keys=True), encoding="utf-8")
    (stage / DATA_FILE).write_bytes(_json_bytes({"sft_snapshot": data_hash}))
    metrics = {
        "loss_per_step": losses,
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "train_loss": float(result.training_loss) if math.isfinite(result.training_loss) else None,
        "steps": int(result.global_step),
        "rows": len(encoded),
        "rows_dropped_no_assistant_token": dropped,
        "rows_truncated": sum(1 for e in encoded if e.truncated),
        "tokens": sum(len(e.input_ids) for e in encoded),
        "assistant_tokens": sum(e.n_trained for e in encoded),
        "seconds": round(seconds, 3),
    }
    (stage / METRICS_FILE).write_bytes(_json_bytes(metrics))
    provenance = build_provenance(recipe.as_training_recipe(), data_hash)
    provenance["recipe_hash"] = recipe.hash
    (stage / PROVENANCE_FILE).write_bytes(_json_bytes(provenance))
    files = policy_manifest(stage)
    (stage / MANIFEST).write_bytes(_json_bytes({"format": FORMAT, "files": files}))
    if not publish_dir(stage, out_dir):
        raise ValueError(f"{out_dir} appeared while training; a policy checkpoint is never overwritten")
    log.info("policy checkpoint %s: %d rows, %d steps, loss %s -> %s", out_dir, len(encoded), result.global_step,
             metrics["first_loss"], metrics["last_loss"])
    return PolicyCheckpoint(str(out_dir), identity_of(files), recipe.base_model)


__all__ = [
    "CHAT_TEMPLATE",
    "CausalSftRecipe",
    "ChatTemplateError",
    "END_OF_TURN_TOKENS",
    "EncodedChat",
    "IGNORE_INDEX",
    "PolicyCheckpoint",
    "assistant_spans",
    "encode_chat",
    "ensure_chat_template",
    "load_policy",
    "load_tokenizer",
    "read_policy_checkpoint",
    "render",
    "template_messages",
    "train_causal_sft",
]
