"""``Ledger.append`` writes the event's own fields itself: a payload cannot rename its kind, task or id.

Before, ``{"kind": kind, "task": task, **payload}`` let a payload's ``kind`` replace the event's: an append of
``round_failed`` with ``{"kind": "round_decided"}`` wrote a ``round_decided`` event (what the budget and the
round list read as a decision).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from envloop_pipelines.core.ledger.event_log import EVENT_ROUND_DECIDED, EVENT_ROUND_FAILED, LedgerError
from envloop_pipelines.core.ledger.ledger import Ledger


@pytest.mark.parametrize("field", ["kind", "task", "event_id"])
def test_a_payload_cannot_write_the_ledgers_own_fields(tmp_path: Path, field: str) -> None:
    ledger = Ledger("t", tmp_path)
    ledger.append(EVENT_ROUND_FAILED, {"round": "r0001", "reason": "x"})
    before = ledger.events_path.read_bytes()
    forged = {"kind": EVENT_ROUND_DECIDED, "task": "other", "event_id": "decided:r0001"}[field]
    with pytest.raises(LedgerError, match=f"payload field\\(s\\) {field} are the ledger's own"):
        ledger.append(EVENT_ROUND_FAILED, {"round": "r0001", field: forged})
    assert ledger.events_path.read_bytes() == before  # nothing written
    assert [e["kind"] for e in ledger.events()] == [EVENT_ROUND_FAILED]
    assert list(ledger.events(EVENT_ROUND_DECIDED)) == []
