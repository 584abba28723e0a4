"""MLflow's champion alias and release tags are the ledger's projection, never a second source (issue 34).

The ledger's release events and cards say which checkpoint is release N and which release is the champion
(the latest). MLflow's registry repeats it for clients: a model version per release, tagged
``envloop.release``, and the ``champion`` alias on the latest one. A plain ``MlflowClient`` call can move the
alias or tag another version as a release; every reader that takes MLflow's word (the remote ``Client``'s
releases, its ``fetch_checkpoint``, ``verify_ledger``: the next round and ``envloop ledger verify``) checks it
against the ledger here first and refuses a mismatch, naming both versions.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from envloop_pipelines.core.ledger.event_log import LedgerError
from envloop_pipelines.core.tracking import CHAMPION_ALIAS, TAG_RELEASE


class ChampionMismatchError(LedgerError):
    """MLflow's alias or release tags disagree with the ledger's release events."""


def projection_error(cards: Sequence[Mapping[str, Any]], versions: Iterable[tuple[str, Mapping[str, str]]],
                     champion: str | None, model_name: str) -> str | None:
    """Why MLflow's registry is not the ledger's projection, or ``None`` when it is.

    Args:
        cards: the ledger's release cards, oldest first (each with its ``release`` and ``model_version``).
        versions: MLflow's model versions of ``model_name`` as ``(version, tags)``; ``None`` to skip the tags.
        champion: the version the ``champion`` alias points at (``None``: no alias).
        model_name: the registered model (for the message).
    """
    by_release = {int(c["release"]): c for c in cards if c.get("release") is not None}
    for version, tags in versions:
        number = (tags or {}).get(TAG_RELEASE)
        if number is None:
            continue
        card = by_release.get(int(number))
        if card is None:
            return (f"MLflow model version {version} of {model_name} is tagged {TAG_RELEASE}={number}, but the ledger "
                    f"has no release {number}: the registry is not the ledger's projection")
        if card.get("model_version") is not None and str(card["model_version"]) != str(version):
            return (f"MLflow model version {version} of {model_name} is tagged {TAG_RELEASE}={number}, but the "
                    f"ledger's release {number} is model version {card['model_version']}")
    if cards and cards[-1].get("model_version") is not None:
        last = cards[-1]
        if champion is not None and str(champion) != str(last["model_version"]):
            return (f"the MLflow {CHAMPION_ALIAS!r} alias of {model_name} points at model version {champion}, but the "
                    f"ledger's champion is release {last['release']}, model version {last['model_version']}")
    return None


__all__ = ["ChampionMismatchError", "projection_error"]
