"""One run of a task's loop at a time, its setup or a round, whichever door starts it: the claim in
``<home>/loops/<task>/round.claim``.

Every door that runs the setup (benchmark, noise floor, release 1) or a round (``envloop round start``,
``LocalClient.setup`` / ``run_round`` / ``run_loop`` / ``start_round`` and its worker, the first steps of
``setup_job`` and ``round_job``, which is where the remote ``Client``, the HTTP job API, the UI's launchpad, the
sensor and the schedule arrive) claims the task's loop before any work of it is done: before a file, a ledger
event or an MLflow run is written, before any data is generated. Claiming is a compare-and-set under an
exclusive ``flock`` on ``round.claim.lock`` (released by the OS if its holder dies): the claim is read; held by
a live holder it refuses with :class:`RoundBusy`, naming the round, its run and its door; free, stale, or the
same run's (a worker taking over the claim its ``start_round`` took) or the same hold's it is written ours. Two
doors 0.1 s apart cannot both read it free.

A door that runs the setup and rounds one after another in its own process (``envloop round start``,
``LocalClient.hold_loop`` / ``run_loop``) takes one claim for all of them, a *hold*: the claim names the hold
(``holder``) and the run that runs now, each of its runs takes it over in turn, and it is given back when the
door is done, so no other door starts between its setup and its first round, or between two of its rounds.

A claim is stale, and so free to take, when its run has finished on the Dagster instance, or when its run is
not on the instance (yet) and the process that holds it (``pid`` on ``host``) is gone; a hold is stale when its
process is gone, whatever its runs' status (between two runs its last run has finished); a claim without a
process (taken by the first step of a run launched elsewhere) whose run the instance does not know is stale
too. The door that ran the round in its own process releases the claim when the run (or the hold) ends; a run
launched elsewhere leaves its claim to go stale when it finishes. The instance is the caller's: this module takes
``run_finished`` (a run id -> ``True``/``False``, or ``None`` when the instance has no such run) and imports no
Dagster.
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
#: The claim's ``round`` while the task's setup runs (the benchmark, the noise floor and release 1).
SETUP = "setup"


def watch_or_cancel(run_id: str, remote: str | None = None) -> str:
    """How a person refused by a claim follows or stops its run, in the CLI's words (``remote``: the deployment's
    webserver, for ``--remote``)."""
    flag = f" --remote {remote}" if remote else ""
    ui = remote or "`envloop ui`"
    return f"wait for it (follow it in {ui}) or cancel it (`envloop round cancel {run_id}{flag}`)"


@dataclass(frozen=True)
class RoundClaim:
    """Who runs the task's loop: the round key (or :data:`SETUP`), the Dagster run, the door it came through, its
    process, and the hold it belongs to (``None``: the claim is its one run's)."""

    task: str
    round: str
    run_id: str
    door: str
    pid: int | None
    host: str
    at: float
    holder: str | None = None

    @property
    def what(self) -> str:
        """``the setup`` or ``round r0003``."""
        return "the setup" if self.round == SETUP else f"round {self.round}"

    def describe(self) -> str:
        """``round r0003 of task 'personal_agent' is running (run 1f2e..., started by LocalClient.start_round, pid
        4242 on host h)``; ``the setup of task ...`` while the setup runs."""
        process = f", pid {self.pid} on {self.host}" if self.pid is not None else f" on {self.host}"
        return (f"{self.what} of task {self.task!r} is running (run {self.run_id}, started by {self.door}"
                f"{process})")


class RoundBusy(RuntimeError):
    """Another run of the task's loop (its setup or a round) holds the claim; the message, one line, names it, its
    run and its door, and how to follow or cancel it."""

    def __init__(self, claim: RoundClaim) -> None:
        self.claim = claim
        super().__init__(f"{claim.describe()}: {watch_or_cancel(claim.run_id)}")


def claim_path(task: str, home: str | Path | None = None) -> Path:
    """The task's claim file."""
    return loop_dir(task, home) / CLAIM_FILE


def is_stale(claim: RoundClaim, run_finished: RunFinished) -> bool:
    """Whether ``claim``'s holder is done: its run finished, or not on the instance and its process gone; a hold's
    process gone."""
    if claim.holder is not None and claim.pid is not None:  # a hold: its process goes on to its next run
        return claim.host == socket.gethostname() and not pid_alive(claim.pid)
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
        held = {"holder": raw.get("holder")}  # a claim written before holds existed has none
        return RoundClaim(**{k: raw[k] for k in RoundClaim.__dataclass_fields__ if k not in held}, **held)
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
                run_finished: RunFinished, pid: int | None = None, holder: str | None = None) -> RoundClaim:
    """Claim the task's loop for run ``run_id`` (the setup or a round) before any work of it; the claim written.

    Args:
        task, home: The task's loop.
        round_key: The round (``r0003``), or :data:`SETUP`.
        run_id: The Dagster run that will run it (known before the run is created).
        door: Who asks (``envloop round start``, ``LocalClient.start_round``, ``round_job``, ...).
        run_finished: The instance's answer for a run id (see :data:`RunFinished`).
        pid: The process that holds the round (the caller's, or the worker it started); ``None`` when the run's
            own status is the only word (a step of a run launched elsewhere, in a process of its own).
        holder: The hold this run belongs to (a door running setup and rounds in process ``pid``); ``None``: the
            claim is this run's alone.

    A claim of the same run is taken over (its round key set, its pid replaced when ``pid`` is given, its door and
    hold kept: a hold's first run may be a round rather than the setup it was taken for); a
    claim of the same hold is taken over by its next run (the round key and run id replaced, its door kept).

    Raises:
        RoundBusy: a live claim of another run holds the task's loop.
    """
    with _locked(task, home) as path:
        current = _read(path)
        if current is not None and current.run_id == run_id:
            mine = replace(current, round=round_key, pid=pid if pid is not None else current.pid,
                           host=socket.gethostname() if pid is not None else current.host)
        elif current is not None and holder is not None and current.holder == holder:
            mine = replace(current, round=round_key, run_id=run_id, pid=pid if pid is not None else current.pid)
        elif current is not None and not is_stale(current, run_finished):
            raise RoundBusy(current)
        else:
            if holder is not None and pid is None:
                raise ValueError("holder: a hold is its process's: give its pid")
            mine = RoundClaim(task=task, round=round_key, run_id=run_id, door=door, pid=pid,
                              host=socket.gethostname(), at=time.time(), holder=holder)
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


def release_hold(task: str, home: str | Path | None, holder: str) -> bool:
    """Give the claim back when the hold ``holder`` has it (its door is done); whether it was released."""
    with _locked(task, home) as path:
        current = _read(path)
        if current is None or current.holder != holder:
            return False
        path.unlink()
        return True


__all__ = ["CLAIM_FILE", "SETUP", "RoundBusy", "RoundClaim", "RunFinished", "claim_path", "claim_round", "is_stale",
           "live_claim", "read_claim", "release_hold", "release_round", "watch_or_cancel"]
