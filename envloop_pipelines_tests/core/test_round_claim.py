"""The round claim (``core/loop/round_claim.py``): one round of a task at a time, whichever door asks first.

Issue 37: a second ``LocalClient`` started 1.5 s after the first was accepted with the same key and both trained
r0001. Here the doors are processes racing for the claim; exactly one wins and the others are refused naming it.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from envloop_pipelines.core.loop.round_claim import (
    SETUP,
    RoundBusy,
    claim_path,
    claim_round,
    live_claim,
    read_claim,
    release_hold,
    release_round,
)

TASK = "claims"


def _no_runs(run_id: str) -> bool | None:
    return None  # an instance that has no run yet (the doors claim before the run exists)


def _race(home: str, door: str, start_at: float, out: "multiprocessing.Queue[str]") -> None:
    time.sleep(max(0.0, start_at - time.time()))
    try:
        claim_round(TASK, home, "r0001", run_id=f"run-{door}", door=door, run_finished=_no_runs, pid=os.getpid())
        out.put(f"won {door}")
        time.sleep(1.0)  # hold it while the others ask (a round runs for minutes)
    except RoundBusy as exc:
        out.put(f"refused {door}: {exc}")


def test_of_doors_asking_at_once_one_claims_the_round_and_the_others_are_refused_naming_it(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    out: "multiprocessing.Queue[str]" = ctx.Queue()
    start_at = time.time() + 0.5
    doors = [ctx.Process(target=_race, args=(str(tmp_path), f"door{i}", start_at + 0.1 * (i % 2), out))
             for i in range(6)]
    for p in doors:
        p.start()
    answers = [out.get(timeout=30) for _ in doors]
    for p in doors:
        p.join(timeout=30)
    won = [a for a in answers if a.startswith("won")]
    assert len(won) == 1, answers
    winner = won[0].split()[1]
    refused = [a for a in answers if a.startswith("refused")]
    assert len(refused) == 5
    assert all(f"round r0001 of task {TASK!r} is running (run run-{winner}, started by {winner}, pid " in a
               for a in refused), refused


def test_a_claim_is_held_until_its_run_finishes_or_its_process_is_gone(tmp_path: Path) -> None:
    me = os.getpid()
    claim_round(TASK, tmp_path, "r0001", run_id="A", door="LocalClient.start_round", run_finished=_no_runs, pid=me)
    running = {"A": False}
    with pytest.raises(RoundBusy, match=r"round r0001 .* is running \(run A, started by LocalClient.start_round"):
        claim_round(TASK, tmp_path, "r0002", run_id="B", door="envloop round start", run_finished=running.get, pid=me)
    assert live_claim(TASK, tmp_path, running.get).run_id == "A"
    running["A"] = True  # A's run has finished on the instance: its claim is stale, free to take
    assert live_claim(TASK, tmp_path, running.get) is None
    claim_round(TASK, tmp_path, "r0002", run_id="B", door="envloop round start", run_finished=running.get, pid=me)

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    claim_path(TASK, tmp_path).unlink()
    claim_round(TASK, tmp_path, "r0003", run_id="C", door="LocalClient.start_round", run_finished=_no_runs,
                pid=int(dead.stdout))  # its worker died before creating the run
    assert claim_round(TASK, tmp_path, "r0003", run_id="D", door="sensor", run_finished=_no_runs, pid=me).run_id == "D"


def test_the_runs_own_worker_takes_the_claim_over_and_only_the_holder_releases_it(tmp_path: Path) -> None:
    claim_round(TASK, tmp_path, "r0001", run_id="A", door="LocalClient.start_round", run_finished=_no_runs, pid=1)
    taken = claim_round(TASK, tmp_path, "r0001", run_id="A", door="LocalClient.run_round", run_finished=_no_runs,
                        pid=os.getpid())
    assert (taken.door, taken.pid) == ("LocalClient.start_round", os.getpid())  # the door that claimed is kept
    assert not release_round(TASK, tmp_path, "B")
    assert read_claim(TASK, tmp_path) == taken
    assert release_round(TASK, tmp_path, "A") and read_claim(TASK, tmp_path) is None


def test_a_step_claim_without_a_process_is_stale_once_the_instance_has_no_such_run(tmp_path: Path) -> None:
    claim_round(TASK, tmp_path, "r0001", run_id="A", door="sensor next_round_sensor", run_finished={"A": False}.get,
                pid=None)
    with pytest.raises(RoundBusy, match="started by sensor next_round_sensor on "):
        claim_round(TASK, tmp_path, "r0002", run_id="B", door="x", run_finished={"A": False}.get, pid=None)
    assert live_claim(TASK, tmp_path, _no_runs) is None  # another instance (a test's ephemeral one)
    claim_path(TASK, tmp_path).write_text("{torn", encoding="utf-8")
    assert read_claim(TASK, tmp_path) is None
    assert claim_round(TASK, tmp_path, "r0002", run_id="B", door="x", run_finished=_no_runs, pid=None).run_id == "B"


def _dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout)


def test_a_hold_is_its_doors_from_the_setup_to_its_last_round_and_another_door_is_refused_meanwhile(
        tmp_path: Path) -> None:
    """Issue 47: ``envloop round start`` holds the task's loop from its setup to its last round; a door asking between
    two of its runs (the setup's run finished, the next not created yet) is refused, naming the run and how to follow
    or cancel it, in one line."""
    me = os.getpid()
    finished = {"setup-run": True, "r1-run": True}  # its runs have finished on the instance: the hold goes on
    claim_round(TASK, tmp_path, SETUP, run_id="setup-run", door="envloop round start", run_finished=_no_runs, pid=me,
                holder="H")
    with pytest.raises(RoundBusy) as busy:
        claim_round(TASK, tmp_path, SETUP, run_id="other", door="LocalClient.setup", run_finished=finished.get, pid=me,
                    holder="G")
    message = str(busy.value)
    assert message == (f"the setup of task {TASK!r} is running (run setup-run, started by envloop round start, pid {me} "
                       f"on {socket.gethostname()}): wait for it (follow it in `envloop ui`) or cancel it "
                       f"(`envloop round cancel setup-run`)")
    assert "\n" not in message and busy.value.claim.holder == "H"
    with pytest.raises(RoundBusy, match="the setup of task"):  # a run of no hold (a step of a launched run)
        claim_round(TASK, tmp_path, "r0001", run_id="launched", door="a launch of round_job", run_finished=finished.get)

    nxt = claim_round(TASK, tmp_path, "r0001", run_id="r1-run", door="LocalClient.run_loop", run_finished=_no_runs,
                      pid=me, holder="H")  # the hold's next run takes its claim over
    assert (nxt.round, nxt.run_id, nxt.door, nxt.holder) == ("r0001", "r1-run", "envloop round start", "H")
    assert read_claim(TASK, tmp_path) == nxt
    with pytest.raises(RoundBusy, match=r"^round r0001 of task .* \(run r1-run, .*`envloop round cancel r1-run`\)$"):
        claim_round(TASK, tmp_path, "r0002", run_id="other", door="sensor", run_finished=finished.get, pid=None)
    assert live_claim(TASK, tmp_path, finished.get) == nxt  # its run finished, its process is alive: held

    assert not release_round(TASK, tmp_path, "other") and not release_hold(TASK, tmp_path, "G")
    assert read_claim(TASK, tmp_path) == nxt
    assert release_hold(TASK, tmp_path, "H") and read_claim(TASK, tmp_path) is None
    assert not release_hold(TASK, tmp_path, "H")
    assert claim_round(TASK, tmp_path, SETUP, run_id="other", door="LocalClient.setup", run_finished=finished.get,
                       pid=me, holder="G").holder == "G"


def test_a_hold_whose_process_is_gone_is_taken_over_and_a_hold_needs_a_process(tmp_path: Path) -> None:
    dead = _dead_pid()
    claim_round(TASK, tmp_path, SETUP, run_id="A", door="envloop round start", run_finished=_no_runs, pid=dead,
                holder="H")  # its process was killed in the middle of its setup; its run never finished
    unfinished = {"A": False}.get
    assert live_claim(TASK, tmp_path, unfinished) is None
    taken = claim_round(TASK, tmp_path, SETUP, run_id="B", door="LocalClient.setup", run_finished=unfinished,
                        pid=os.getpid(), holder="G")
    assert (taken.run_id, taken.holder, taken.pid) == ("B", "G", os.getpid())
    with pytest.raises(ValueError, match="holder: a hold is its process's"):
        claim_round(TASK, tmp_path / "other", SETUP, run_id="C", door="x", run_finished=_no_runs, holder="K")


def test_the_same_runs_claim_takes_the_round_it_runs_and_a_claim_written_before_holds_reads(tmp_path: Path) -> None:
    me = os.getpid()
    claim_round(TASK, tmp_path, SETUP, run_id="A", door="LocalClient.hold_loop", run_finished=_no_runs, pid=me,
                holder="H")
    first = claim_round(TASK, tmp_path, "r0001", run_id="A", door="LocalClient.run_loop", run_finished=_no_runs,
                        pid=me)  # the hold's first run is a round: the claim says so
    assert (first.round, first.door, first.holder) == ("r0001", "LocalClient.hold_loop", "H")
    old = {"task": TASK, "round": "r0002", "run_id": "Z", "door": "envloop round start", "pid": me,
           "host": socket.gethostname(), "at": 0.0}
    claim_path(TASK, tmp_path).write_text(json.dumps(old), encoding="utf-8")
    assert read_claim(TASK, tmp_path).holder is None and read_claim(TASK, tmp_path).run_id == "Z"
