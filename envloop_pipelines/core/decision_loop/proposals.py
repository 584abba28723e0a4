"""A person's hypothesis as it comes in: a JSON file, JSON text or a mapping, read and checked once.

Every door reads it here: the CLI's ``--hypothesis FILE``, the SDK's ``hypothesis=`` (a mapping,
JSON text or a file) and the round's first step (the launchpad's ``proposal_json``). Each turns
:class:`ProposalError` into its own error (a bad option, :class:`~envloop_pipelines.sdk.RefusedError`,
a refused run); the checks themselves are :func:`~envloop_pipelines.core.decision_loop.registered_hypothesis.proposal_errors`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: What a proposal holds, said when it is not a JSON object.
_OBJECT = "must be a JSON object (change, predicted_delta, gate, seeds, rationale)"


class ProposalError(ValueError):
    """A hypothesis that cannot be registered: ``source`` (the file, or ``hypothesis``) and every problem found."""

    def __init__(self, source: str, errors: list[str]) -> None:
        self.source, self.errors = source, list(errors)
        super().__init__(f"{source}: " + "; ".join(self.errors))


def parse_proposal(hypothesis: Mapping[str, Any] | str | os.PathLike[str] | None, *,
                   source: str | None = None, text_only: bool = False) -> dict[str, Any] | None:
    """The proposal dict of a person's hypothesis, checked; ``None`` (the round derives one) for ``None`` or ``''``.

    Args:
        hypothesis: A mapping; JSON text (it starts with ``{`` or ``[``); or a path (``os.PathLike``, or a
            string naming a file) to a JSON file.
        source: How messages name the input (default: the file's path, else ``hypothesis``).
        text_only: A string is JSON text, never a path (the launchpad's ``proposal_json``).

    Raises:
        ProposalError: unreadable file, invalid JSON (with its line), not an object, or a proposal that
            :func:`~envloop_pipelines.core.decision_loop.registered_hypothesis.proposal_errors` refuses (every field named).
    """
    if hypothesis is None or (isinstance(hypothesis, str) and not hypothesis.strip()):
        return None
    from envloop_pipelines.core.decision_loop.registered_hypothesis import proposal_errors

    label = source or "hypothesis"
    if isinstance(hypothesis, Mapping):
        proposal: Any = dict(hypothesis)
    else:
        text = str(hypothesis)
        is_json = not isinstance(hypothesis, os.PathLike) and (text_only or text.lstrip().startswith(("{", "[")))
        if not is_json:
            if not isinstance(hypothesis, os.PathLike) and not Path(text).is_file():
                raise ProposalError(label, [f"{text[:80]!r} is neither JSON text nor a file"])
            try:
                text = Path(hypothesis).read_text(encoding="utf-8")
            except OSError as exc:
                raise ProposalError(label, [f"cannot read {hypothesis}: {exc.strerror}"]) from None
            label = source or str(hypothesis)
        try:
            proposal = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ProposalError(label, [f"line {exc.lineno}: {exc.msg}"]) from None
    if not isinstance(proposal, dict):
        raise ProposalError(label, [_OBJECT])
    errors = proposal_errors(proposal)
    if errors:
        raise ProposalError(label, errors)
    return proposal
