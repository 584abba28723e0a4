"""The readouts by name, and building the recipe's one: :func:`build_readout_model`.

The base the readouts share lives in :mod:`.readout`, which imports neither of
them; each readout imports that base; this module imports both readouts. So
the imports run one way, ``readouts → {decision_head, label_token} → readout``,
and adding a readout means one entry in :data:`READOUT_MODELS` (and its name in
``recipe.READOUTS``, which a test keeps equal to the keys here).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Mapping

import torch

from envloop_pipelines.core.model.decision_head import DecisionHeadModel
from envloop_pipelines.core.model.label_token import LabelTokenModel
from envloop_pipelines.core.model.readout import ReadoutModel

if TYPE_CHECKING:
    from envloop_pipelines.core.model.recipe import Recipe

#: Recipe ``readout`` name → the model class that implements it.
READOUT_MODELS: Mapping[str, type[ReadoutModel]] = {
    model.readout: model for model in (DecisionHeadModel, LabelTokenModel)
}


def readout_model_class(name: str) -> type[ReadoutModel]:
    """The model class of a recipe ``readout`` name.

    Raises:
        ValueError: naming the field and the known readouts.
    """
    try:
        return READOUT_MODELS[name]
    except KeyError:
        raise ValueError(f"recipe field 'readout': {name!r} is not one of {', '.join(sorted(READOUT_MODELS))}") from None


def build_readout_model(
    recipe: "Recipe",
    *,
    adapter_dir: str | Path | None = None,
    head_state: Mapping[str, torch.Tensor] | None = None,
    trainable: bool = False,
) -> ReadoutModel:
    """The recipe's readout on its base model, fresh LoRA or a saved adapter.

    Args:
        recipe: Says which readout, base model, LoRA and head width.
        adapter_dir: A peft adapter directory to load instead of a fresh LoRA.
        head_state: Head tensors to load (``head.safetensors``).
        trainable: Whether the adapter (and head) train; False puts the model in eval mode.
    """
    model = readout_model_class(recipe.readout).from_recipe(recipe, adapter_dir=adapter_dir, trainable=trainable)
    if head_state is not None:
        model.load_head_state_dict(head_state)
    if not trainable:
        model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
    return model


__all__ = ["READOUT_MODELS", "build_readout_model", "readout_model_class"]
