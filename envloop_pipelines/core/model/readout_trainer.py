"""The ``transformers.Trainer`` of a readout, what one run of it leaves behind, and that run's loss summaries.

The Trainer subclass brings the custom loss (soft cross-entropy over each question's options), the
optimizer split into two learning rates (``lr`` for LoRA, ``head_lr`` for the decision head) and a
data order that is a function of the seed alone. It records each micro-batch's loss and each
optimizer step's wall time; :func:`_epoch_losses` and :func:`_loss_quarters` summarise the first
for ``metrics.json``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import RandomSampler

from envloop_pipelines.core.model.readout import ReadoutModel, soft_cross_entropy
from envloop_pipelines.core.model.recipe import Recipe
from envloop_pipelines.core.model.training_data import LengthGroupedSampler


def _trainer_class() -> type:
    """The Trainer subclass (built lazily: importing ``transformers.Trainer`` is slow)."""
    from transformers import Trainer, TrainerCallback

    class _EpochLossCallback(TrainerCallback):
        def __init__(self, owner: Any) -> None:
            self.owner = owner
            self._t0 = 0.0

        def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.owner.epoch_index += 1

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self._t0 = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.owner.step_seconds.append(time.perf_counter() - self._t0)

    class ReadoutTrainer(Trainer):
        """Soft cross-entropy over each question's options; two learning rates; a seeded data order."""

        # compute_loss returns a per-micro-batch mean: let the Trainer divide by grad_accum.
        loss_is_scaled_for_ga = False

        def __init__(self, *args: Any, recipe: Recipe, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.recipe = recipe
            self.epoch_index = -1
            self.loss_log: list[tuple[int, float, int]] = []  # (epoch, loss, questions)
            self.step_seconds: list[float] = []
            self.add_callback(_EpochLossCallback(self))

        def compute_loss(self, model: Any, inputs: dict[str, torch.Tensor], return_outputs: bool = False,
                         num_items_in_batch: Any = None) -> Any:
            targets = inputs.pop("targets")
            logits = model(**inputs)
            loss = soft_cross_entropy(logits, inputs["option_mask"], targets)
            if model.training:
                self.loss_log.append((max(self.epoch_index, 0), float(loss.detach()), int(targets.shape[0])))
            return (loss, logits) if return_outputs else loss

        def create_optimizer(self, model: Any = None) -> torch.optim.Optimizer:
            if self.optimizer is None:
                opt_model = self.model if model is None else model
                groups: dict[tuple[float, float], list[torch.nn.Parameter]] = {}
                for name, p in opt_model.named_parameters():
                    if not p.requires_grad:
                        continue
                    lr = self.recipe.head_lr if name.startswith("head.") else self.recipe.lr
                    decay = 0.0 if (p.ndim < 2) else self.recipe.weight_decay  # no decay on biases
                    groups.setdefault((lr, decay), []).append(p)
                self.optimizer = torch.optim.AdamW(
                    [{"params": ps, "lr": lr, "weight_decay": wd} for (lr, wd), ps in groups.items()],
                    lr=self.recipe.lr,
                    betas=(0.9, 0.999),
                    eps=1e-8,
                )
            return self.optimizer

        def _get_train_sampler(self, train_dataset: Any = None) -> torch.utils.data.Sampler:
            ds = train_dataset if train_dataset is not None else self.train_dataset
            generator = torch.Generator().manual_seed(self.recipe.seed)
            if self.recipe.length_grouped:
                return LengthGroupedSampler([len(e) for e in ds.encoded], self.recipe.batch_size, generator)
            return RandomSampler(ds, generator=generator)

    return ReadoutTrainer


@dataclass
class TrainerRun:
    """What one ``Trainer.train()`` left behind, read before the trainer is dropped.

    ``step_seconds`` holds each optimizer step's wall time (its ``grad_accum`` micro-batches, clipping and the
    optimizer's update); ``loss_log`` each micro-batch's ``(epoch, loss, questions)``.
    """

    model: ReadoutModel
    steps: int
    seconds: float
    loss_log: list[tuple[int, float, int]]
    step_seconds: list[float]
    main_process: bool
    world_size: int
    used_deepspeed: bool


def _epoch_losses(loss_log: Sequence[tuple[int, float, int]]) -> list[dict[str, float]]:
    """Each epoch's mean loss (weighted by the questions of each micro-batch) and its micro-batch count."""
    by_epoch: dict[int, list[tuple[float, int]]] = {}
    for epoch, loss, n in loss_log:
        by_epoch.setdefault(epoch, []).append((loss, n))
    return [
        {"epoch": e + 1, "mean_loss": float(sum(l * n for l, n in rows) / sum(n for _, n in rows)), "micro_batches": len(rows)}
        for e, rows in sorted(by_epoch.items())
    ]


def _loss_quarters(loss_log: Sequence[tuple[int, float, int]]) -> list[float] | None:
    """The mean training loss over each quarter of the micro-batches, in order: whether the loss was still
    falling when training stopped (the proposer's under-training signal; the per-epoch means cannot say
    it for a run shorter than an epoch). ``None`` below four micro-batches."""
    if len(loss_log) < 4:
        return None
    quarters = np.array_split(np.arange(len(loss_log)), 4)
    return [float(sum(loss_log[i][1] * loss_log[i][2] for i in q) / sum(loss_log[i][2] for i in q)) for q in quarters]


__all__ = ["TrainerRun"]
