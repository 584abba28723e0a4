"""A loop of rounds and its budget: rounds, patience without gain, wall time.

The active loop lives in ``<home>/loops/<task>/loop.json``. Starting a loop
with the id of the active one is a no-op, so a replayed schedule tick never
starts a second loop; every run request carries the run key
``<loop id>:<round>``, so a replayed sensor tick never starts a second run.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from envloop_pipelines.core.loop.config import round_key
from envloop_pipelines.core.ledger.event_log import EVENT_LOOP_STARTED, EVENT_LOOP_STOPPED, EVENT_ROUND_DECIDED
from envloop_pipelines.core.ledger.ledger import Ledger
from envloop_pipelines.core.ledger.store import RoundStore
from envloop_pipelines.core.storage import atomic_write_json


@dataclass(frozen=True)
class LoopBudget:
    max_rounds: int = 2
    patience: int = 2
    max_wall_s: float = 24 * 3600.0

    def __post_init__(self) -> None:
        if self.max_rounds < 1 or self.patience < 1 or self.max_wall_s <= 0:
            raise ValueError(f"loop budget must be positive: {self}")


@dataclass(frozen=True)
class LoopState:
    loop_id: str
    task: str
    first_round: int
    budget: LoopBudget
    started_at: float


@dataclass(frozen=True)
class NextRound:
    """What the loop wants next: a round key, or None with the reason."""

    round: str | None
    reason: str
    run_key: str | None = None


def spent(budget: LoopBudget, promoted: Sequence[bool], elapsed_s: float) -> str | None:
    """Why the loop stops after its decided rounds (``promoted``, in order) and ``elapsed_s``; ``None`` while it lasts.

    The one budget rule of every loop: the daemon's (:func:`next_round`, for the schedule and the sensor),
    the CLI's and the SDK's (both through :func:`drive_loop`). Stops after ``max_rounds`` decided rounds,
    after ``patience`` rounds in a row without a promotion, or once ``max_wall_s`` has passed.
    """
    if len(promoted) >= budget.max_rounds:
        return f"budget spent: {len(promoted)} of {budget.max_rounds} rounds"
    if len(promoted) >= budget.patience and not any(promoted[-budget.patience:]):
        return f"patience spent: {budget.patience} rounds without a promotion"
    if elapsed_s > budget.max_wall_s:
        return f"wall time spent: {budget.max_wall_s:.0f}s"
    return None


def drive_loop(ask: Callable[[], NextRound], run: Callable[[NextRound], bool]) -> str:
    """Run rounds one after another while the budget lasts; the reason the loop stopped.

    ``ask`` says what the loop wants next (:func:`next_round`, or a client's own count under :func:`spent`);
    ``run`` runs that round and says whether it was decided. A round that was not decided stops the loop
    (``round <key> failed``): the next one would follow an undecided round.
    """
    while True:
        nxt = ask()
        if nxt.round is None:
            return nxt.reason
        if not run(nxt):
            return f"round {nxt.round} failed"


def _path(task: str, home: str | Path | None) -> Path:
    return RoundStore(task, home).loop_state


def _decided(ledger: Ledger) -> dict[str, dict]:
    return {e["round"]: e for e in ledger.events(EVENT_ROUND_DECIDED)}


def decided_rounds(task: str, home: str | Path | None = None) -> dict[str, dict]:
    """The task's decided rounds: round key -> its ``round_decided`` ledger event."""
    return _decided(Ledger(task, home))


def last_round_number(task: str, home: str | Path | None = None) -> int:
    """The highest round number the task has started (0 when none)."""
    numbers = RoundStore(task, home).started_rounds()
    decided = [int(k[1:]) for k in _decided(Ledger(task, home))]
    return max(numbers + decided + [0])


def start_loop(task: str, loop_id: str, budget: LoopBudget, *, home: str | Path | None = None,
               now: float | None = None) -> LoopState:
    """Start (or, for the same id, keep) the task's active loop; its first round follows the last one."""
    current = load_loop(task, home)
    if current is not None and current.loop_id == loop_id:
        return current
    state = LoopState(loop_id=loop_id, task=task, first_round=last_round_number(task, home) + 1, budget=budget,
                      started_at=time.time() if now is None else now)
    atomic_write_json(_path(task, home), {**asdict(state), "budget": asdict(budget)}, overwrite=True)
    Ledger(task, home).append(EVENT_LOOP_STARTED, {"loop_id": loop_id, "first_round": state.first_round,
                                               "budget": asdict(budget)}, key=f"loop:{loop_id}")
    return state


def load_loop(task: str, home: str | Path | None = None) -> LoopState | None:
    path = _path(task, home)
    if not path.exists():
        return None
    raw = json.loads(path.read_text())
    return LoopState(loop_id=raw["loop_id"], task=raw["task"], first_round=raw["first_round"],
                     budget=LoopBudget(**raw["budget"]), started_at=raw["started_at"])


def next_round(task: str, *, home: str | Path | None = None, now: float | None = None) -> NextRound:
    """The loop's next round if its budget is not spent and its last round was decided."""
    state = load_loop(task, home)
    if state is None:
        return NextRound(None, "no active loop")
    ledger = Ledger(task, home)
    decided = _decided(ledger)
    mine = [k for k in sorted(decided) if int(k[1:]) >= state.first_round]
    started = max(last_round_number(task, home), state.first_round - 1)
    expected = round_key(state.first_round + len(mine) - 1) if mine else None
    if started >= state.first_round and round_key(started) not in decided:
        return NextRound(None, f"round {round_key(started)} is not decided yet")
    reason = spent(state.budget, [bool(decided[k]["promoted"]) for k in mine],
                   (time.time() if now is None else now) - state.started_at)
    if reason is None:
        key = round_key(max(started, state.first_round - 1) + 1)
        return NextRound(key, f"round {len(mine) + 1} of {state.budget.max_rounds} (after {expected or 'start'})",
                         run_key=f"{state.loop_id}:{key}")
    ledger.append(EVENT_LOOP_STOPPED, {"loop_id": state.loop_id, "reason": reason}, key=f"loop_stopped:{state.loop_id}")
    return NextRound(None, reason)
