"""One gathered batch of requests → one prediction call, answers split back per request.

:func:`predict_jobs` runs in the batcher's worker thread. Every question of
every request in the batch goes into **one** :meth:`DecisionModel.predict` call
(sorted by length, ``batch_size`` questions per forward pass), and the results are cut
back into per-request lists by position, so answers cannot cross requests.

Option windows. A readout reads a question, all of its options and the state
in one window of ``max_length`` tokens, and only the state may be cut. A
question whose options do not fit (255 choice options never fit a 512-token
encoder: each option costs a marker plus its words), or take more than half the
window while the state is being cut, is read in *windows*: the options are
halved, recursively, into runs of consecutive options until each run's
question-and-options block is at most half the window (so the state keeps at
least the other half), each window a question of its own with the same
instructions and state; the windows' logits are concatenated in option order
and calibrated together (one softmax over all options). The label-token
readout also splits where a type has more options than labels. The number of
windows depends only on the question's own text, never on its id or its
neighbours, so answers stay independent of renaming and reordering.
A question whose instructions plus *two* options do not fit the window cannot
be answered: :class:`WindowError` (the server answers ``tokens_exceeded``).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Sequence

import numpy as np

from envloop_pipelines.core.model.predict import DecisionModel
from envloop_pipelines.core.model.readout import InputTooLongError, QuestionInput, ReadoutModel
from envloop_pipelines.core.serve.answers import ModelAnswer

log = logging.getLogger(__name__)


class WindowError(ValueError):
    """A question's instructions and options cannot fit the model's window, even two options at a time."""


def _max_options(model: ReadoutModel, qtype: str) -> int | None:
    if getattr(model, "readout", "") == "label_token":
        from envloop_pipelines.core.model.label_token import LABELS

        return len(LABELS[qtype])
    return None


def _block_length(model: ReadoutModel, q: QuestionInput) -> int | None:
    """Tokens of the question with an empty state (instructions, options, special tokens); None if over the window."""
    try:
        return len(model.encode_many([dataclasses.replace(q, state_text="")])[0])
    except InputTooLongError:
        return None


def _part(q: QuestionInput, lo: int, hi: int) -> QuestionInput:
    return dataclasses.replace(q, option_keys=q.option_keys[lo:hi], option_texts=q.option_texts[lo:hi])


def plan_windows(model: ReadoutModel, q: QuestionInput) -> list[QuestionInput]:
    """The question itself, or its windows of consecutive options (module docstring).

    Raises:
        WindowError: the instructions and two options alone are over the window.
    """
    max_length = int(getattr(model, "max_length"))
    half = max_length // 2
    cap = _max_options(model, q.type)
    # Probe with an empty state first: tokenizing the instructions and options is cheap, the state may not be
    # (up to 32k tokens), and predict() tokenizes it anyway. Only a question whose options take more than half
    # the window is encoded whole, to learn whether its state would be cut.
    block = _block_length(model, q)
    if (cap is None or q.n_options <= cap) and block is not None:
        if block <= half or not model.encode_many([q])[0].truncated:
            return [q]

    def split(lo: int, hi: int) -> list[tuple[int, int]]:
        n = hi - lo
        part = _part(q, lo, hi)
        block = _block_length(model, part)
        ok_cap = cap is None or n <= cap
        if ok_cap and block is not None and block <= half:
            return [(lo, hi)]
        if n < 4:  # halves would have fewer than 2 options, which no readout reads
            if ok_cap and block is not None:
                return [(lo, hi)]
            raise WindowError(
                f"the instructions and {n} options take {block if block is not None else f'more than {max_length}'} tokens "
                f"with an empty state, over the model's window of {max_length} tokens; shorten the instructions or the option descriptions"
            )
        mid = lo + n // 2
        return split(lo, mid) + split(mid, hi)

    return [_part(q, lo, hi) for lo, hi in split(0, q.n_options)]


def predict_jobs(
    dm: DecisionModel, jobs: Sequence[Sequence[QuestionInput]], *, batch_size: int | None = None
) -> list[list[ModelAnswer] | Exception]:
    """Answer several requests' questions with one ``predict`` call; one result (or exception) per request, in order."""
    plans: list[list[list[QuestionInput]] | Exception] = []
    flat: list[QuestionInput] = []
    for questions in jobs:
        try:
            plans.append([plan_windows(dm.model, q) for q in questions])
        except WindowError as exc:
            plans.append(exc)
            continue
        for windows in plans[-1]:  # type: ignore[union-attr]
            flat.extend(windows)
    predictions = dm.predict(flat, batch_size=batch_size) if flat else []
    out: list[list[ModelAnswer] | Exception] = []
    at = 0
    for questions, plan in zip(jobs, plans):
        if isinstance(plan, Exception):
            out.append(plan)
            continue
        answers = []
        for q, windows in zip(questions, plan):
            preds = predictions[at : at + len(windows)]
            at += len(windows)
            if len(windows) == 1:
                probs = preds[0].probs
            else:
                logits = np.concatenate([np.asarray(p.logits, dtype=np.float32) for p in preds])
                probs = dm.calibration.apply(logits, q.type)
            answers.append(
                ModelAnswer(
                    probs=np.asarray(probs, dtype=np.float64),
                    truncated=any(p.truncated for p in preds),
                    n_state_tokens_dropped=max(int(p.n_state_tokens_dropped) for p in preds),
                    n_windows=len(windows),
                )
            )
        out.append(answers)
    if at != len(predictions):  # pragma: no cover - an internal invariant
        raise RuntimeError(f"predict_jobs: {len(predictions)} predictions for {at} windows")
    return out


__all__ = ["WindowError", "plan_windows", "predict_jobs"]
