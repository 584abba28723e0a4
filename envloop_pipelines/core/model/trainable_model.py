"""The model a training run starts from, and the trained model as its checkpoint will load it.

:func:`build_trainable_model` gives a fresh LoRA and head (seeded), or continues from a checkpoint
(``init_from``) whose readout, base model and LoRA shape match the recipe's. :func:`_as_loaded`
turns the model training left behind into the one the checkpoint reproduces, so that the
end-of-training predictions are exactly what a reader of the checkpoint gets.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from envloop_pipelines.core.model.checkpoint import load_checkpoint, read_recipe
from envloop_pipelines.core.model.readout import ReadoutModel
from envloop_pipelines.core.model.readouts import build_readout_model
from envloop_pipelines.core.model.recipe import Recipe

log = logging.getLogger(__name__)


class IncompatibleInitError(ValueError):
    """``init_from`` names a checkpoint whose readout, base model or LoRA shape differs from the recipe's."""


def _check_init_compatible(recipe: Recipe, saved: Recipe, ckpt_dir: Path) -> None:
    problems = []
    for name in ("readout", "base_model"):
        if getattr(recipe, name) != getattr(saved, name):
            problems.append(f"{name}: recipe {getattr(recipe, name)!r} vs checkpoint {getattr(saved, name)!r}")
    for name in ("r", "target_modules"):
        if getattr(recipe.lora, name) != getattr(saved.lora, name):
            problems.append(f"lora.{name}: recipe {getattr(recipe.lora, name)!r} vs checkpoint {getattr(saved.lora, name)!r}")
    if recipe.readout == "decision_head":
        for name in ("head_hidden", "state_attention", "family_head"):
            if getattr(recipe, name) != getattr(saved, name):
                problems.append(f"{name}: recipe {getattr(recipe, name)!r} vs checkpoint {getattr(saved, name)!r}")
    if problems:
        raise IncompatibleInitError(f"init_from {ckpt_dir}: cannot continue training: " + "; ".join(problems))


def build_trainable_model(recipe: Recipe, *, init_from: str | Path | None = None) -> tuple[ReadoutModel, str | None]:
    """The model to train: fresh LoRA and head (seeded), or a checkpoint's adapter and head.

    Returns:
        The model (train mode, LoRA and head trainable) and the init checkpoint's hash (or None).

    Raises:
        IncompatibleInitError: the checkpoint's readout, base model, LoRA rank/targets or head width differ.
        CheckpointIntegrityError: the checkpoint fails verification.
    """
    from transformers import set_seed

    set_seed(recipe.seed)
    if init_from is None:
        model = build_readout_model(recipe, trainable=True)
        init_hash = None
    else:
        init_from = Path(init_from)
        _check_init_compatible(recipe, read_recipe(init_from), init_from)
        ckpt = load_checkpoint(init_from, trainable=True)
        model, init_hash = ckpt.model, ckpt.checkpoint_hash
        if recipe.lora.dropout != ckpt.recipe.lora.dropout or recipe.lora.alpha != ckpt.recipe.lora.alpha:
            log.info("init_from: LoRA alpha/dropout come from the checkpoint's adapter (%s), not the recipe", init_from)
    model.train()
    return model, init_hash


def _as_loaded(model: ReadoutModel, recipe: Recipe) -> ReadoutModel:
    """The trained model as :func:`load_checkpoint` will rebuild it, in eval mode.

    Usually the trained model itself. When training changed the dtype of its
    weights (DeepSpeed with bf16 casts the whole module, base included), a fresh
    fp32 base gets the trained adapter and head instead, so that the
    end-of-training predictions are exactly what the checkpoint reproduces.
    """
    if all(p.dtype == torch.float32 for p in model.parameters()):
        model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
        return model
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    adapter = {k: v.detach().float().cpu() for k, v in get_peft_model_state_dict(model.encoder).items()}
    head = {k: (v.float() if v.is_floating_point() else v) for k, v in model.head_state_dict().items()}
    device = next(model.parameters()).device
    log.info("rebuilding the trained model in fp32 on a fresh base (training left %s weights)", {str(p.dtype) for p in model.parameters()})
    fresh = build_readout_model(recipe, trainable=False)
    set_peft_model_state_dict(fresh.encoder, adapter)
    fresh.load_head_state_dict(head)
    return fresh.to(device).eval()


__all__ = ["IncompatibleInitError", "build_trainable_model"]
