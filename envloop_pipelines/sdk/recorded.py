"""What the loop's steps recorded in their asset materializations' metadata, read back as the ledger's values.

``promotion_decision`` carries the round's typed decision, its ledger events and the release card it wrote;
``noise_floor`` the null arms, release 1 and, when no candidate can be promoted, why
(``defs/rounds/metadata.py`` names the labels). Each function takes materializations as
:meth:`~envloop_pipelines.sdk.webserver.DagsterWebserver._materializations` gives them (newest first,
``metadata`` a dict of plain values); :class:`~envloop_pipelines.sdk.client.Client` asks for them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from envloop_pipelines.core.decision_loop.step_records import RoundDecision
from envloop_pipelines.defs.rounds.metadata import DECISION, LEDGER_EVENTS, PROMOTION_WARNING, RELEASE_CARD

#: One materialization: ``run_id``, ``partition``, ``timestamp`` (epoch seconds) and ``metadata``.
Materialization = Mapping[str, Any]


def round_decisions(materializations: Iterable[Materialization]) -> dict[str, RoundDecision]:
    """The decision of each round (``promotion_decision``'s partitions): the newest one recorded."""
    decisions: dict[str, RoundDecision] = {}
    for m in materializations:
        raw = m["metadata"].get(DECISION)
        if m["partition"] and raw is not None and m["partition"] not in decisions:
            decisions[m["partition"]] = RoundDecision.from_dict(raw)
    return decisions


def ledger_events(materializations: Iterable[Materialization]) -> list[dict[str, Any]]:
    """The ledger events the steps published, each once (by its event id), oldest first."""
    events: dict[str, dict[str, Any]] = {}
    for m in materializations:
        for e in m["metadata"].get(LEDGER_EVENTS) or []:
            events.setdefault(e.get("event_id") or json.dumps(e, sort_keys=True), e)
    return sorted(events.values(), key=lambda e: e.get("at") or 0)


def release_cards(materializations: Iterable[Materialization]) -> dict[int, dict[str, Any]]:
    """Release cards by release number, as the steps that published them recorded them (the newest of each)."""
    cards: dict[int, dict[str, Any]] = {}
    for m in materializations:
        card = m["metadata"].get(RELEASE_CARD)
        if card and int(card["release"]) not in cards:
            cards[int(card["release"])] = card
    return cards


def promotion_warning(floor: Iterable[Materialization]) -> str | None:
    """Why no candidate can be promoted, as the newest ``noise_floor`` recorded it; ``None`` when one can."""
    newest = next(iter(floor), None)
    return newest["metadata"].get(PROMOTION_WARNING) if newest is not None else None


__all__ = ["Materialization", "ledger_events", "promotion_warning", "release_cards", "round_decisions"]
