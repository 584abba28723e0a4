"""One round of a task at a time, whichever door starts it: the claim in ``<home>/loops/<task>/round.claim``.

Every door that runs a round (``envloop round start``, ``LocalClient.run_round`` / ``start_round`` and its
worker, the round's first step on a deployment, which is where the remote ``Client``, the sensor and the
schedule arrive) claims the task's round before any work of it is done. Claiming is a compare-and-set under an
exclusive ``flock`` on ``round.claim.lock`` (released by the OS if its holder dies): the claim is read; held by
a live holder it refuses with :class:`RoundBusy`, naming the round, its run and its door; free, stale, or the
same run's (a worker taking over the claim its ``start_round`` took) it is written ours. Two doors 0.1 s apart
cannot both read it free.

A claim is stale, and so free to take, when its run has finished on the Dagster instance, or when its run is
not on the instance (yet) and the process that holds it (``pid`` on ``host``) is gone; a claim without a process
(taken by the first step of a run launched elsewhere) whose run the instance does not know is stale too. The door that ran the
round in its own process releases the claim when the run ends; a run launched elsewhere leaves its claim to go
stale when it finishes. The instance is the caller's: this module takes ``run_finished`` (a run id ->
``True``/``False``, or ``None`` when the instance has no such run) and imports no Dagster.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from envloop_pipelines.core.ledger.store import loop_dir
from envloop_pipelines.core.storage import atomic_write_json, pid_alive

#: The claim's file and its lock, in the task's loop folder (``core/ledger/store.py``).
CLAIM_FILE = "round.claim"
LOCK_FILE = "round.claim.lock"

#: A run id -> whether that run has finished on the instance (``None``: the instance has no such run).
RunFinished = Callable[[str], "bool | None"]


@dataclass(frozen=True)
class RoundClaim:
    """Who runs the task's round: the round key, the Dagster run, the door it came through and its process."""

    task: str
    round: str
    run_id: str
    door: str
    pid: int | None
    host: str
    at: float

    def describe(self) -> str:
        """``round r0003 of task 'personal_agent' is running (run 1f2e..., started by LocalClient.start_round, pid
        4242 on host h)``."""
        process = f", pid {self.pid} on {self.host}" if self.pid is not None else f" on {self.host}"
        return (f"round {self.round} of task {self.task!r} is running (run {self.run_id}, started by {self.door}"
                f"{process})")


class RoundBusy(RuntimeError):
    """Another round of the task holds the claim; the message names it, its run and its door."""

    def __init__(self, claim: RoundClaim) -> None:
        self.claim = claim
        super().__init__(f"{claim.describe()}: wait for it or cancel it first")


def claim_path(task: str, home: str | Path | None = None) -> Path:
    """The task's claim file."""
    return loop_dir(task, home) / CLAIM_FILE


def is_stale(claim: RoundClaim, run_finished: RunFinished) -> bool:
    """Whether ``claim``'s holder is done: its run finished, or not on the instance and its process gone."""
    finished = run_finished(claim.run_id)
    if finished is not None:
        return finished
    if claim.pid is None:
        return True  # only a step of a created run claims without a process: this instance has no such run
    if claim.host != socket.gethostname():
        return False  # a run not created yet by a process of another host: its own host's doors judge it
    return not pid_alive(claim.pid)


@contextmanager
def _locked(task: str, home: str | Path | None) -> Iterator[Path]:
    """The claim file's path, with the task's claim lock held (exclusive, blocking; the OS drops it if we die)."""
    import fcntl

    folder = loop_dir(task, home)
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield folder / CLAIM_FILE
    finally:
        os.close(fd)  # closing drops the lock


def _read(path: Path) -> RoundClaim | None:
    """The claim in ``path``; ``None`` when there is none (or a torn one, which nobody can hold)."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        return RoundClaim(**{k: raw[k] for k in RoundClaim.__dataclass_fields__})
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None


def read_claim(task: str, home: str | Path | None = None) -> RoundClaim | None:
    """The task's claim as it is on disk, stale or not (``None`` when there is none)."""
    return _read(claim_path(task, home))


def live_claim(task: str, home: str | Path | None, run_finished: RunFinished) -> RoundClaim | None:
    """The task's claim when its holder is live; ``None`` when the round is free to claim."""
    claim = read_claim(task, home)
    return claim if claim is not None and not is_stale(claim, run_finished) else None


def claim_round(task: str, home: str | Path | None, round_key: str, *, run_id: str, door: str,
                run_finished: RunFinished, pid: int | None = None) -> RoundClaim:
    """Claim the task's round for run ``run_id`` before any work of it; the claim written.

    Args:
        task, home: The task's loop.
        round_key: The round (``r0003``).
        run_id: The Dagster run that will run it (known before the run is created).
        door: Who asks (``envloop round start``, ``LocalClient.start_round``, ``round_job``, ...).
        run_finished: The instance's answer for a run id (see :data:`RunFinished`).
        pid: The process that holds the round (the caller's, or the worker it started); ``None`` when the run's
            own status is the only word (a step of a run launched elsewhere, in a process of its own).

    A claim of the same run is taken over (its pid replaced when ``pid`` is given, its door kept).

    Raises:
        RoundBusy: a live claim of another run holds the task's round.
    """
    with _locked(task, home) as path:
        current = _read(path)
        if current is not None and current.run_id == run_id:
            mine = replace(current, pid=pid if pid is not None else current.pid,
                           host=socket.gethostname() if pid is not None else current.host)
        elif current is not None and not is_stale(current, run_finished):
            raise RoundBusy(current)
        else:
            mine = RoundClaim(task=task, round=round_key, run_id=run_id, door=door, pid=pid,
                              host=socket.gethostname(), at=time.time())
        if mine != current:
            atomic_write_json(path, asdict(mine), overwrite=True)
        return mine


def release_round(task: str, home: str | Path | None, run_id: str) -> bool:
    """Give the claim back when run ``run_id`` holds it (its run has ended); whether it was released."""
    with _locked(task, home) as path:
        current = _read(path)
        if current is None or current.run_id != run_id:
            return False
        path.unlink()
        return True


__all__ = ["CLAIM_FILE", "RoundBusy", "RoundClaim", "RunFinished", "claim_path", "claim_round", "is_stale",
           "live_claim", "read_claim", "release_round"]
