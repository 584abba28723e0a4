"""The training questions as the Trainer reads them: dataset, collator, targets, and a length-grouped order.

Questions have ragged option counts: the collator pads each batch's targets to its widest question
(the readout's own ``collate`` pads the inputs and gives the ``option_mask``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from envloop_pipelines.core.model.readout import Encoded, QuestionInput, ReadoutModel


class _QuestionDataset(Dataset):
    """Encoded questions with their targets, in a fixed order."""

    def __init__(self, encoded: Sequence[Encoded], targets: Sequence[np.ndarray]) -> None:
        self.encoded = list(encoded)
        self.targets = list(targets)

    def __len__(self) -> int:
        return len(self.encoded)

    def __getitem__(self, i: int) -> tuple[Encoded, np.ndarray]:
        return self.encoded[i], self.targets[i]


class _Collator:
    """The readout's collate plus padded targets (ragged options → one tensor)."""

    def __init__(self, model: ReadoutModel) -> None:
        self.model = model

    def __call__(self, items: Sequence[tuple[Encoded, np.ndarray]]) -> dict[str, torch.Tensor]:
        batch = self.model.collate([e for e, _ in items])
        k = batch["option_mask"].shape[1]
        targets = torch.zeros((len(items), k), dtype=torch.float32)
        for i, (_, t) in enumerate(items):
            targets[i, : len(t)] = torch.as_tensor(t, dtype=torch.float32)
        batch["targets"] = targets
        return batch


def _targets(questions: Sequence[QuestionInput], split: str) -> list[np.ndarray]:
    """Each question's target distribution (its label or soft label).

    Raises:
        ValueError: some question has neither, naming the split and the first ten such questions.
    """
    out, missing = [], []
    for q in questions:
        t = q.target()
        if t is None:
            missing.append(q.key)
        else:
            out.append(t)
    if missing:
        shown = ", ".join(missing[:10]) + (" ..." if len(missing) > 10 else "")
        raise ValueError(f"{split}: {len(missing)} question(s) have neither label nor soft_label: {shown}")
    return out


class LengthGroupedSampler(torch.utils.data.Sampler):
    """A seeded order whose consecutive ``batch_size`` runs hold questions of similar length.

    Each epoch: shuffle, cut into chunks of 50 batches, sort each chunk by length, cut into
    batches, shuffle the full batches and put the one short batch last (the DataLoader batches
    consecutive indices, so a short batch in the middle would shift every batch after it).
    Every question is seen once per epoch, as with a random order; padding falls with the spread
    of lengths inside a batch.
    """

    def __init__(self, lengths: Sequence[int], batch_size: int, generator: torch.Generator) -> None:
        self.lengths = list(lengths)
        self.batch_size = batch_size
        self.generator = generator

    def __len__(self) -> int:
        return len(self.lengths)

    def __iter__(self) -> Iterator[int]:
        order = torch.randperm(len(self.lengths), generator=self.generator).tolist()
        chunk = 50 * self.batch_size
        batches: list[list[int]] = []
        for start in range(0, len(order), chunk):
            part = sorted(order[start:start + chunk], key=lambda i: -self.lengths[i])
            batches += [part[i:i + self.batch_size] for i in range(0, len(part), self.batch_size)]
        full = [b for b in batches if len(b) == self.batch_size]
        short = [i for b in batches if len(b) < self.batch_size for i in b]
        shuffled = [full[i] for i in torch.randperm(len(full), generator=self.generator).tolist()]
        return iter([i for b in shuffled for i in b] + short)


__all__ = ["LengthGroupedSampler"]
