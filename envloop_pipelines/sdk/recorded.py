"""What the loop's steps recorded in their asset materializations' metadata, read back as the ledger's values.

``promotion_decision`` carries the round's typed decision, its ledger events and the release card it wrote;
``noise_floor`` the null arms, release 1 and, when no candidate can be promoted, why
(``defs/rounds/metadata.py`` names the labels). Each function takes materializations as
:meth:`~envloop_pipelines.sdk.webserver.DagsterWebserver._materializations` gives them (newest first,
``metadata`` a dict of plain values); :class:`DeploymentRecords`, which :class:`~envloop_pipelines.sdk.client.Client`
extends, asks the webserver for them: the rounds, their decisions, the ledger and the release cards.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from envloop_pipelines.core.decision_loop.step_records import RoundDecision
from envloop_pipelines.core.ledger.event_log import EVENT_KINDS
from envloop_pipelines.core.loop.config import round_key, round_number
from envloop_pipelines.defs.rounds.metadata import DECISION, LEDGER_EVENTS, PROMOTION_WARNING, RELEASE_CARD
from envloop_pipelines.names import NOISE_FLOOR, PROMOTION_DECISION, ROUND_JOB
from envloop_pipelines.sdk import queries
from envloop_pipelines.sdk.errors import NotFoundError, RefusedError
from envloop_pipelines.sdk.records import RoundInfo, RunInfo
from envloop_pipelines.sdk.webserver import DagsterWebserver

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


class DeploymentRecords(DagsterWebserver):
    """What a deployment's steps recorded, read over its webserver: the rounds (its ``rounds`` partitions) with their
    latest runs and decisions, the ledger events and the release cards the steps published, and its noise floor."""

    def is_set_up(self) -> bool:
        """Whether the noise floor (and so release 1) has been materialized."""
        return bool(self._materializations(NOISE_FLOOR, limit=1))

    def promotion_warning(self) -> str | None:
        """Why no candidate can be promoted with the measured noise floor (the bar is above what the metric can
        still gain over the champion), or ``None`` when one can; ``Client.setup`` warns with it."""
        return promotion_warning(self._materializations(NOISE_FLOOR, limit=1))

    def round_keys(self) -> list[str]:
        """Every ``rounds`` partition, in order."""
        result = self._ok(self._query(queries.PARTITION_KEYS, {"asset": {"path": [PROMOTION_DECISION]}})[
            "assetNodeOrError"], "AssetNode")
        return sorted(result["partitionKeys"] or [], key=round_number)

    def next_round_key(self) -> str:
        """The key after the last ``rounds`` partition (``r0001`` for the first)."""
        keys = self.round_keys()
        return round_key(round_number(keys[-1]) + 1 if keys else 1)

    def decision(self, key: str) -> RoundDecision | None:
        """The round's decision (``promotion_decision``), ``None`` until it is decided.

        Raises:
            NotFoundError: there is no round ``key``.
        """
        decided = round_decisions(self._materializations(PROMOTION_DECISION, partitions=[key], limit=1))
        if key in decided:
            return decided[key]
        keys = self.round_keys()
        if key not in keys:
            raise NotFoundError(f"round: no round {key!r} at {self.dagster_url}; rounds: {', '.join(keys) or 'none'}")
        return None

    def round(self, key: str) -> RoundInfo:
        """One round: its latest run and its decision.

        Raises:
            ClientError: there is no such round.
        """
        if key not in self.round_keys():
            raise NotFoundError(f"round: no round {key!r} at {self.dagster_url}; rounds: {', '.join(self.round_keys()) or 'none'}")
        runs = self.runs(ROUND_JOB, partition=key, limit=1)
        return RoundInfo(key, runs[0] if runs else None, self.decision(key))

    def rounds(self) -> list[RoundInfo]:
        """Every round, oldest first, with its latest run and decision."""
        decisions = round_decisions(self._materializations(PROMOTION_DECISION))
        latest: dict[str, RunInfo] = {}
        for run in self.runs(ROUND_JOB, limit=500):
            if run.partition and run.partition not in latest:
                latest[run.partition] = run
        return [RoundInfo(k, latest.get(k), decisions.get(k)) for k in self.round_keys()]

    def ledger(self, kind: str | None = None) -> list[dict[str, Any]]:
        """The ledger events the steps published (null arms, hypotheses, checkpoints, decisions, releases), oldest first.

        Raises:
            RefusedError: ``kind`` is not a ledger event kind (the message lists them).
        """
        if kind is not None and kind not in EVENT_KINDS:
            raise RefusedError(f"kind: {kind!r} is not a ledger event kind; allowed: {', '.join(EVENT_KINDS)}")
        events = ledger_events(m for asset in (NOISE_FLOOR, PROMOTION_DECISION) for m in self._materializations(asset))
        return [e for e in events if kind is None or e.get("kind") == kind]

    def cards(self) -> dict[int, dict[str, Any]]:
        """Release cards by release number, as the steps that published them recorded them."""
        return release_cards(m for asset in (NOISE_FLOOR, PROMOTION_DECISION) for m in self._materializations(asset))


__all__ = ["DeploymentRecords", "Materialization", "ledger_events", "promotion_warning", "release_cards",
           "round_decisions"]
