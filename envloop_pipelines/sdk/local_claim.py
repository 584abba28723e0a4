"""The task's loop claim as the :class:`~envloop_pipelines.sdk.local.LocalClient` takes and holds it (issue 47).

One claim of a task's loop covers its setup and every round (``core/loop/round_claim.py``): a client claims it
before anything is generated or written, holds it from its setup to its last round when asked
(:meth:`LocalClaims.hold_loop`), and refuses to start while another run holds it or runs
(:meth:`LocalClaims.ensure_no_round_running`), naming that run, its door and how to follow or cancel it.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import dagster as dg

from envloop_pipelines.names import PARTITION_TAG, ROUND_JOB, SETTINGS_TAG, SETUP_JOB
from envloop_pipelines.resources.round_claim import (
    SETUP,
    RoundBusy,
    claim_round_on,
    live_claim_on,
    release_hold_of,
    watch_or_cancel,
)
from envloop_pipelines.sdk.errors import BusyError
from envloop_pipelines.sdk.instance import new_run_id
from envloop_pipelines.sdk.local_records import LocalRecords


class LocalClaims(LocalRecords):
    """The claim side of :class:`~envloop_pipelines.sdk.local.LocalClient`: claim, hold, give back, refuse.

    The client sets ``_door``, ``_holder``, ``_held_run_id``, ``_resources`` and ``_workers`` and gives
    ``_cfg()``; this class reads them.
    """

    def _door_of(self, method: str) -> str:
        """The door a round claim names: the CLI's command, or ``LocalClient.<method>``."""
        return self._door or f"LocalClient.{method}"

    def _claim(self, key: str, run_id: str, door: str, pid: int, holder: str | None = None) -> None:
        """Claim the task's loop for ``run_id``, round ``key`` or the setup (``core/loop/round_claim.py``), in this
        client's hold when it has one; a live claim of another run refuses.

        Raises:
            BusyError: another run of the task's loop runs (the message names it, its run and its door).
        """
        try:
            claim_round_on(self.instance, self._cfg(), key, run_id=run_id, door=door, pid=pid,
                           holder=holder or self._holder)
        except RoundBusy as exc:
            raise BusyError(str(exc), exc.claim.run_id) from None

    def hold_loop(self, what: str = SETUP) -> contextlib.ExitStack:
        """Claim the task's loop now, for the setup and the rounds this client runs next in this process, and return
        the context that gives it back (``with client.hold_loop(): client.setup(); client.run_loop(rounds=2)``).

        One claim for them all: no other door starts a setup or a round of the task from the claim on, between
        this client's runs included; a claim whose process is gone is taken over. ``envloop round start`` holds it
        from its setup to its last round; :meth:`setup`, :meth:`run_loop` and :meth:`retry` hold it for their own
        runs when the client does not already. Nothing is generated or written before the claim.

        Args:
            what: What this client runs first, as a refused door is told: ``"setup"`` or a round key.

        Raises:
            BusyError: another run of the task's loop runs; the message, one line, names it, its door and how to
                follow or cancel it.
        """
        return self._hold(what, "hold_loop")

    def _hold(self, what: str, method: str) -> contextlib.ExitStack:
        """:meth:`hold_loop` for ``method``'s runs (the door it names); nothing to take or give back when held."""
        stack = contextlib.ExitStack()
        if self._holder is not None:
            return stack
        cfg = self._cfg()
        holder, run_id = new_run_id(), new_run_id()  # two uuid4s: the hold's and its first run's
        self._claim(what, run_id, self._door_of(method), os.getpid(), holder=holder)
        self._holder, self._held_run_id = holder, run_id

        def give_back() -> None:
            self._holder = self._held_run_id = None
            release_hold_of(cfg, holder)

        stack.callback(give_back)
        return stack

    def _next_run_id(self) -> str:
        """The run id of the next run: the one the hold claimed for its first run, then new ones."""
        run_id, self._held_run_id = self._held_run_id or new_run_id(), None
        return run_id

    def ensure_no_round_running(self) -> None:
        """Refuse while a round or the setup of the task runs, from whichever door, but this client's own hold
        (nothing is claimed: the run's own claim is taken when it starts).

        Raises:
            BusyError: a run of the task's loop runs; the message names it, its run, (from its claim) its door, and
                how to follow or cancel it.
        """
        self.reap_orphans()  # a claim whose worker died holds nothing: its run is marked failed first
        claim = live_claim_on(self.instance, self._cfg()) if self._resources is not None else None
        if claim is not None and (self._holder is None or claim.holder != self._holder):
            raise BusyError(str(RoundBusy(claim)), claim.run_id)
        running = self._running_round()
        if running is not None:
            what = "the setup" if running[0] == SETUP else f"round {running[0]}"
            raise BusyError(f"{what} of task {self.task!r} is running (run {running[1]}): "
                            f"{watch_or_cancel(running[1])}", running[1])

    def _running_round(self) -> tuple[str, str] | None:
        """``(key, run id)`` of a round (or the setup: key ``setup``) of this task whose worker is alive: one
        started here that has not created its run yet, or an unfinished run of the instance (a run whose worker is
        gone is marked failed first)."""
        for run_id, worker in list(self._workers.items()):
            if worker.poll() is None and self.instance.get_run_by_id(run_id) is None:
                return json.loads(Path(worker.args[-1]).read_text(encoding="utf-8"))["key"], run_id
        self.reap_orphans()
        unfinished = [dg.DagsterRunStatus.NOT_STARTED, dg.DagsterRunStatus.STARTING, dg.DagsterRunStatus.STARTED,
                      dg.DagsterRunStatus.CANCELING]
        for job in (ROUND_JOB, SETUP_JOB):
            for run in self.instance.get_runs(filters=dg.RunsFilter(job_name=job, statuses=unfinished)):
                if json.loads(run.tags.get(SETTINGS_TAG) or "{}").get("task") == self.task:
                    return run.tags.get(PARTITION_TAG, SETUP if job == SETUP_JOB else "?"), run.run_id
        return None
