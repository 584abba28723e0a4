"""The ledger's chain head, anchored outside the home in MLflow (issue 34: tamper evidence).

The hash chain (``Ledger``: each event carries ``prev``, the digest of the file before it) tells an
edited, removed or inserted line, but not a truncated tail: the last events deleted leave a chain that
holds. So at every registration, test read, decision and release the loop writes the head, the ledger
file's size and sha256, as the task experiment's tag ``envloop.ledger_head``; every check reads it back and
requires the file to begin with exactly those bytes. The home's owner can still delete both; the goal is
evidence, not prevention.
"""

from __future__ import annotations

from typing import Any

from envloop_pipelines.core.ledger.event_log import LedgerChainError
from envloop_pipelines.core.ledger.ledger import Ledger
from envloop_pipelines.core.ledger.projection import ChampionMismatchError, projection_error
from envloop_pipelines.core.storage import sha256_bytes
from envloop_pipelines.core.tracking import TAG_LEDGER_HEAD, Tracker, model_name


def verify_ledger(ledger: Ledger, tracker: Tracker | None = None) -> dict[str, Any]:
    """The ledger's chain verified, and its head against the one anchored in MLflow (when ``tracker`` is given).

    Returns:
        ``{"events", "chained", "head", "bytes", "anchored"}`` (``anchored``: the tag's value, or ``None``).

    Raises:
        LedgerChainError: the first broken link, a release card not bound to its event (dropped in or
            edited), or a head anchored in MLflow that the file no longer begins with (events removed or
            rewritten), named.
    """
    state = ledger.verify()
    raw = ledger.events_path.read_bytes() if ledger.events_path.exists() else b""
    state["bytes"] = len(raw)
    state["anchored"] = None
    if tracker is None:
        ledger.releases()
        return state
    tag = tracker.experiment_tag(ledger.task, TAG_LEDGER_HEAD)
    state["anchored"] = tag
    if tag:
        size, _, digest = tag.partition(":")
        n = int(size) if size.isdigit() else -1
        if n < 0 or n > len(raw) or sha256_bytes(raw[:n]) != digest:
            raise LedgerChainError(
                f"ledger chain broken: the head anchored in MLflow (experiment {ledger.task!r}, tag {TAG_LEDGER_HEAD}: "
                f"the first {size} bytes hash to {digest[:16]}) is not the beginning of {ledger.events_path} "
                f"({len(raw)} bytes): events were removed or rewritten after it was anchored")
    cards = ledger.releases()  # every card bound to its release_promoted event
    name = model_name(ledger.task)
    mismatch = projection_error(cards, (), tracker.champion_version(name), name)
    if mismatch:
        raise ChampionMismatchError(f"release chain refused: {mismatch}")
    return state


def anchor_head(ledger: Ledger, tracker: Tracker) -> str:
    """Check the anchored head (:func:`verify_ledger`), then anchor the current one; returns the tag's value.

    Raises:
        LedgerChainError: as :func:`verify_ledger` (a broken chain is never anchored over).
    """
    state = verify_ledger(ledger, tracker)
    raw = ledger.events_path.read_bytes() if ledger.events_path.exists() else b""
    value = f"{len(raw)}:{sha256_bytes(raw)}"
    if value != state["anchored"]:
        tracker.set_experiment_tag(ledger.task, TAG_LEDGER_HEAD, value)
    return value


__all__ = ["anchor_head", "verify_ledger"]
