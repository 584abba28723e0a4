"""The ``LocalClient``: the loop run in this process, on this machine's Dagster instance and EnvLoop home.

Rounds run through Dagster (the same jobs the UI launches) executed in-process on the instance in
``$DAGSTER_HOME`` (default ``<envloop home>/dagster``, SQLite), so every run shows up in ``envloop ui``
afterwards. It answers the same questions as the remote :class:`~envloop_pipelines.sdk.Client`
(:class:`~envloop_pipelines.sdk.protocol.LoopClient`), read from the home's ledger and round store
instead of a webserver; the CLI drives either one.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

import dagster as dg

from envloop_pipelines.core.data.snapshots import open_task
from envloop_pipelines.core.decision_loop.noise_floor import current_noise_floor
from envloop_pipelines.core.decision_loop.proposals import ProposalError, parse_proposal
from envloop_pipelines.core.ledger.event_log import LedgerError
from envloop_pipelines.core.loop.budget import (
    LoopBudget,
    NextRound,
    decided_rounds,
    drive_loop,
    last_round_number,
    load_loop,
    next_round,
    start_loop,
)
from envloop_pipelines.core.loop.config import round_key, round_number
from envloop_pipelines.core.loop.promotion import champion_out_of_reach
from envloop_pipelines.core.progress import Progress, ensure_shown
from envloop_pipelines.core.services import ServiceUnavailable, probe_tracking_uri
from envloop_pipelines.core.storage import atomic_write_json, pid_alive
from envloop_pipelines.core.tracking import RUN_KILLED, close_round_runs
from envloop_pipelines.defs.rounds.recovery import worker_is_gone, worker_pid, worker_tags
from envloop_pipelines.names import (
    HOST_TAG,
    LOOP_TAG,
    PARENT_RUN_TAG,
    PARTITION_TAG,
    PID_TAG,
    RETRY_OF_TAG,
    ROOT_RUN_TAG,
    ROUND_JOB,
    ROUNDS_PARTITIONS,
    SETTINGS_TAG,
    SETUP_JOB,
)
from envloop_pipelines.resources.bind import loop_resources
from envloop_pipelines.resources.loop import MlflowResource, loop_resource
from envloop_pipelines.resources.round_claim import (
    SETUP,
    release_round_of,
)
from envloop_pipelines.sdk.errors import ClientError, NotFoundError, RefusedError, RoundFailed, UnavailableError
from envloop_pipelines.sdk.instance import (
    QUIET,
    code_location_job,
    dagster_home,
    new_run_id,
    run_info,
    show_steps,
    watch_steps,
)
from envloop_pipelines.sdk.local_claim import LocalClaims
from envloop_pipelines.sdk.records import RoundInfo, RoundRun, RunInfo


#: How often ``LocalClient.cancel`` looks whether its interrupt took: one sent while the worker was still
#: starting the run is lost (the start sets the run STARTED over CANCELING), and is sent again.
CANCEL_RECHECK_S = 10.0


class LocalClient(LocalClaims):
    """Drive the loop in this process: Dagster's jobs executed in-process on the local instance.

    Args:
        loop_settings: The loop's settings (``LoopConfig`` names); the loop resource is built from them
            once, here (a bad setting raises ``ValueError`` naming it). Leave out to read only, or to retry
            a round with its failed run's settings.
        task: The task when ``loop_settings`` is left out (default ``personal_agent``).
        notify: Where the loop's own lines go (a run whose worker died, a loop's start and stop).
        door: Who drives this client, as the round claim names it to a door it refuses (default
            ``LocalClient.<method>``; the CLI's is ``envloop round start``).

    Example::

        from envloop_pipelines.sdk import LocalClient

        client = LocalClient({"task": "personal_agent"})
        client.setup()
        rounds = client.run_loop(rounds=2)
    """

    def __init__(self, loop_settings: Mapping[str, Any] | None = None, *, task: str | None = None,
                 notify: Callable[[str], None] = lambda line: None, door: str | None = None) -> None:
        super().__init__(task or "personal_agent")
        self.notify = notify
        self._door = door
        #: The console logger's run config of the rounds run in this process (:data:`QUIET`; the worker: SILENT).
        self.run_logging: dict[str, Any] = QUIET
        self._resources: dict[str, Any] | None = None
        self._workers: dict[str, subprocess.Popen[bytes]] = {}  # run id -> the worker start_round started
        #: The hold this client has on its task's loop (:meth:`hold_loop`), and the run id it claimed for its first run.
        self._holder: str | None = None
        self._held_run_id: str | None = None
        if loop_settings is not None:
            self._use(loop_settings)

    def _use(self, settings: Mapping[str, Any]) -> None:
        loop = loop_resource(settings)
        self.config = loop.config()  # checked here, once (a bad setting raises ValueError naming it)
        self._resources = loop_resources(loop)
        self._task, self._home = self.config.task, self.config.home

    def _cfg(self) -> Any:
        if self._resources is None:
            raise RefusedError("this LocalClient has no loop settings: give them to run the loop")
        return self.config

    def probe(self) -> None:
        """Fail in seconds when the MLflow server the loop will use (``$MLFLOW_TRACKING_URI``; the default SQLite
        store under the home needs none) does not answer: one request, no retries, at most 5 s. Done before any
        work by :meth:`setup`, :meth:`run_round`, :meth:`start_round`, :meth:`run_loop` and :meth:`retry`.

        Raises:
            UnavailableError: the server did not answer; the one-line message names its URL and the setting.
        """
        mlflow = self._resources["mlflow"] if self._resources is not None else None
        uri, setting = (mlflow.tracking_uri, "MlflowResource.tracking_uri") if mlflow is not None and \
            mlflow.tracking_uri else (os.environ.get("MLFLOW_TRACKING_URI"), "MLFLOW_TRACKING_URI")
        try:
            probe_tracking_uri(uri, setting)
        except ServiceUnavailable as exc:
            raise UnavailableError(str(exc)) from None

    # ------------------------------------------------------------------ setup and rounds

    def setup(self, *, wait: bool = True, progress: bool = True) -> RunInfo:
        """Run ``setup_job`` here (the task's benchmark and noise floor, release 1 on a fresh task).

        The task's loop is claimed first (:meth:`hold_loop`, unless this client holds it already), before any data
        is generated or anything is written: a setup or a round of the task running from any door refuses it.

        Raises:
            UnavailableError: the MLflow server does not answer (:meth:`probe`).
            BusyError: another run of the task's loop runs (the message names it and how to follow or cancel it).
            RoundFailed: the setup run failed.
        """
        cfg = self._cfg()
        self.probe()
        with self._hold(SETUP, "setup"):
            self.ensure_no_round_running()
            job = code_location_job(SETUP_JOB)
            run_id = self._next_run_id()
            self._claim(SETUP, run_id, self._door_of("setup"), os.getpid())  # the hold's claim, this run's now
            watch = (watch_steps(self.instance, run_id, len(job.graph.nodes), "setup") if progress
                     else contextlib.nullcontext())
            tags = {**worker_tags(), SETTINGS_TAG: json.dumps(cfg.to_settings(), sort_keys=True)}
            with watch:
                job.execute_in_process(instance=self.instance, resources=self._resources, run_config=QUIET,
                                       tags=tags, run_id=run_id, raise_on_error=False)
        info = self.run(run_id)
        if not info.success:
            reason = self.run_error(run_id)
            raise RoundFailed(f"setup run {run_id} ended {info.status}" + (f": {reason}" if reason else ""), info,
                              reason)
        return info

    def promotion_warning(self) -> str | None:
        """Why no candidate can be promoted with the measured noise floor; ``None`` when one can, or with no floor."""
        cfg = self._cfg()
        try:
            floor = current_noise_floor(cfg, open_task(cfg.task, home=cfg.home)).floor
        except (LedgerError, FileNotFoundError):
            return None
        return champion_out_of_reach(cfg.task, cfg.home, floor) or None

    def _execute_round(self, key: str, proposal: Mapping[str, Any] | None, run_key: str | None,
                       retry_of: Any = None, progress: bool = True, run_id: str | None = None,
                       extra_tags: Mapping[str, str] | None = None, door: str = "LocalClient.run_round") -> RoundInfo:
        """Run round ``key``'s job in this process; the round with its decision, or RoundFailed.

        The task's loop is claimed for the run first (a worker takes over the claim its ``start_round`` took; in
        a hold, the run takes the hold's claim over) and given back when the run has ended (in a hold, when the
        hold ends).

        Raises:
            BusyError: another run of the task's loop holds the claim.
        """
        cfg = self._cfg()
        run_id = run_id or self._next_run_id()
        self._claim(key, run_id, door, os.getpid())
        try:
            return self._execute_claimed(key, proposal, run_key, retry_of, progress, run_id, extra_tags)
        finally:
            if self._holder is None:
                release_round_of(cfg, run_id)

    def _execute_claimed(self, key: str, proposal: Mapping[str, Any] | None, run_key: str | None, retry_of: Any,
                         progress: bool, run_id: str, extra_tags: Mapping[str, str] | None) -> RoundInfo:
        cfg = self._cfg()
        self.instance.add_dynamic_partitions(ROUNDS_PARTITIONS, [key])
        run_config: dict[str, Any] = dict(self.run_logging)
        if proposal is not None:
            run_config["ops"] = {"registered_hypothesis": {"config": {"proposal_json": json.dumps(proposal)}}}
        tags = {**dict(extra_tags or {}), **worker_tags(), SETTINGS_TAG: json.dumps(cfg.to_settings(), sort_keys=True)}
        if run_key:
            tags[LOOP_TAG] = run_key
        if retry_of is not None:
            run_config = {**run_config, **{k: v for k, v in retry_of.run_config.items() if k == "ops"}}
            tags.update({RETRY_OF_TAG: retry_of.run_id, PARENT_RUN_TAG: retry_of.run_id,
                         ROOT_RUN_TAG: retry_of.tags.get(ROOT_RUN_TAG, retry_of.run_id)})
        job = code_location_job(ROUND_JOB)
        with (watch_steps(self.instance, run_id, len(job.graph.nodes), f"round {key}") if progress
              else contextlib.nullcontext()):
            job.execute_in_process(instance=self.instance, resources=self._resources, partition_key=key,
                                   run_config=run_config, tags=tags, raise_on_error=False, run_id=run_id)
        info = self.run(run_id)
        decision = self.decision(key) if info.success else None
        if decision is None:
            raise RoundFailed(f"round {key} failed; see `envloop ledger` and the Dagster run {run_id}; "
                              f"`envloop round retry` runs it again", info, self.run_error(run_id))
        return RoundInfo(key, info, decision)

    def _proposal(self, hypothesis: Mapping[str, Any] | str | os.PathLike[str] | None) -> dict[str, Any] | None:
        """A person's hypothesis checked (every field named), or ``None`` for the automatic one."""
        try:
            return parse_proposal(hypothesis)
        except ProposalError as exc:
            raise RefusedError(str(exc)) from None

    def _next_round(self) -> str:
        """The key of the task's next round; refused while a round or the setup of the task runs, and before setup."""
        self.ensure_no_round_running()  # first: while the setup runs, a start is told so, not that there is none
        if not self.is_set_up():
            raise RefusedError(f"the task {self.task!r} has no noise floor yet: run setup() (setup_job) before the "
                               f"first round")
        return round_key(last_round_number(self.task, self._home) + 1)

    def run_round(self, hypothesis: Mapping[str, Any] | str | os.PathLike[str] | None = None, *,
                  progress: bool = True, tags: Mapping[str, str] | None = None, key: str | None = None,
                  run_id: str | None = None) -> RoundInfo:
        """Run the task's next round in this process (blocking) and return it with its decision.

        Args:
            hypothesis: A person's hypothesis (a mapping, JSON text or a JSON file); ``None``: the round derives
                one from the champion's failures. Checked before anything runs.
            progress: A bar over the round's steps.
            tags: Extra tags of the Dagster run.
            key, run_id: The round key and the run id to use (:meth:`start_round`'s worker passes the ones it
                returned); default the next round and a new id.

        Raises:
            RefusedError: a bad hypothesis (the field named), or no setup yet.
            BusyError: a round or the setup of the task still running (a kind of RefusedError).
            RoundFailed: the round ended without a decision.
        """
        proposal = self._proposal(hypothesis)
        self.probe()
        key = key or self._next_round()
        return self._execute_round(key, proposal, (tags or {}).get(LOOP_TAG), progress=progress, run_id=run_id,
                                   extra_tags=tags, door=self._door_of("run_round"))

    def start_round(self, hypothesis: Mapping[str, Any] | str | os.PathLike[str] | None = None, *,
                    key: str | None = None, tags: Mapping[str, str] | None = None) -> RoundRun:
        """Start the task's next round in a worker process of its own and return at once (see :meth:`wait`).

        The worker (``python -m envloop_pipelines.sdk.worker``) runs the same in-process job as
        :meth:`run_round`, on this instance, so the run shows in ``envloop ui`` and :meth:`cancel` stops it;
        its output goes to ``<DAGSTER_HOME>/workers/<run id>.log``. One round of a task runs at a time.

        Args:
            hypothesis: As :meth:`run_round`'s, checked here before anything starts.
            key: The round key (default: the task's next round).
            tags: Extra tags of the Dagster run.

        Raises:
            RefusedError: a bad hypothesis or key, or no setup yet.
            BusyError: a round or the setup of the task still running (a kind of RefusedError).
        """
        started = time.time()
        cfg = self._cfg()
        if self._holder is not None:  # its claim goes to a worker that outlives this process: not this one's hold
            raise RefusedError("start_round: this client holds its task's loop (hold_loop); run_round runs the round "
                               "in it")
        proposal = self._proposal(hypothesis)
        self.probe()
        following = self._next_round()
        if key is not None:
            try:
                number = round_number(key)
            except ValueError as exc:
                raise RefusedError(f"key: {exc}") from None
            if number < round_number(following):
                raise RefusedError(f"key: round {key} exists already; leave key out for the next one ({following})")
        key = key or following
        run_id = new_run_id()
        door = self._door_of("start_round")
        self._claim(key, run_id, door, os.getpid())  # before anything: a second start, anywhere, is refused
        folder = dagster_home() / "workers"
        folder.mkdir(parents=True, exist_ok=True)
        spec = folder / f"{run_id}.json"
        try:
            atomic_write_json(spec, {"settings": cfg.to_settings(), "key": key, "proposal": proposal,
                                     "run_id": run_id, "tags": dict(tags or {}), "door": door})
            with open(folder / f"{run_id}.log", "wb") as log:
                self._workers[run_id] = subprocess.Popen(
                    [sys.executable, "-m", "envloop_pipelines.sdk.worker", str(spec)], stdout=log,
                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                    env={**os.environ, "DAGSTER_HOME": str(dagster_home())})
        except BaseException:
            release_round_of(cfg, run_id)
            raise
        self._claim(key, run_id, door, self._workers[run_id].pid)  # the worker holds it now (it outlives us)
        self.notify(f"round {key}: run {run_id} started in worker pid {self._workers[run_id].pid}")
        return RoundRun(key=key, run_id=run_id, launched_at=started)

    def _worker_log(self, run_id: str, lines: int = 20) -> str:
        path = dagster_home() / "workers" / f"{run_id}.log"
        text = path.read_text(encoding="utf-8", errors="replace") if path.exists() else ""
        return "\n".join(text.strip().splitlines()[-lines:])

    def _await_run(self, run_id: str, deadline: float | None, poll_s: float) -> Any:
        """The instance's run ``run_id``; a run a worker of this client has not created yet is waited for.

        Raises:
            NotFoundError: no such run, and no worker of this client that would create it.
            ClientError: the worker ended before creating the run (its log's end is in the message), or the
                deadline passed first.
        """
        while True:
            run = self.instance.get_run_by_id(run_id)
            if run is not None:
                return run
            worker = self._workers.get(run_id)
            if worker is None:
                raise NotFoundError(f"run: no run {run_id!r} on the local instance")
            if worker.poll() is not None and self.instance.get_run_by_id(run_id) is None:
                raise ClientError(f"run {run_id}: its worker exited with {worker.returncode} before starting the run; "
                                  f"its log ends:\n{self._worker_log(run_id)}")
            if deadline is not None and time.monotonic() > deadline:
                raise ClientError(f"run {run_id}: its worker has not started the run yet")
            time.sleep(min(poll_s, 0.5))

    def wait(self, run_id: str, *, progress: bool = True, poll_s: float = 2.0, timeout_s: float | None = None,
             desc: str | None = None) -> RunInfo:
        """Follow a run of the local instance until it ends; returns it (whatever its status).

        With ``progress``, a bar over the run's steps naming the step that runs. A run whose worker process
        is gone (killed, crashed) is marked failed (as :meth:`reap_orphans` does) and returned.

        Raises:
            NotFoundError: no such run.
            ClientError: ``timeout_s`` passed first (the run goes on), or the worker ended before starting it.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        run = self._await_run(run_id, deadline, poll_s)
        bar = None
        if progress:
            ensure_shown()  # a notebook or a script: the progress lines go to stderr, where a person sees them
            total = len(code_location_job(run.job_name).graph.nodes)
            bar = Progress(desc or (f"round {run.tags[PARTITION_TAG]}" if PARTITION_TAG in run.tags else run.job_name),
                           total=total, unit="step")
        try:
            while True:
                worker = self._workers.get(run_id)
                if worker is not None:
                    worker.poll()  # a worker that has ended is reaped, so its pid no longer looks alive
                if bar is not None:
                    show_steps(bar, self.instance, run_id)
                if run.is_finished:
                    return run_info(run)
                if worker_is_gone(run):
                    self.reap_orphans()  # marks it failed
                    run = self.instance.get_run_by_id(run_id)
                    if run.is_finished:
                        continue
                if deadline is not None and time.monotonic() > deadline:
                    raise ClientError(f"run {run_id} is still {run.status.value} after {timeout_s:.0f}s")
                time.sleep(poll_s)
                run = self.instance.get_run_by_id(run_id)
        finally:
            if bar is not None:
                bar.close()

    def cancel(self, run_id: str, *, wait: bool = True, timeout_s: float = 120.0) -> RunInfo:
        """Cancel a run of this host: its worker is interrupted (SIGINT), the run ends ``CANCELED`` and the round's
        MLflow runs still RUNNING end ``KILLED``. A run that has ended already is returned as it is.

        With ``wait`` the run is followed until it has stopped (at most ``timeout_s``). A run whose worker is
        gone is marked cancelled at once.

        Raises:
            NotFoundError: no such run.
            RefusedError: the run's worker is on another host (cancel it there).
            ClientError: ``timeout_s`` passed before the run stopped.
        """
        deadline = time.monotonic() + timeout_s
        run = self._await_run(run_id, deadline, 0.5)
        if run.is_finished:
            return run_info(run)
        host = run.tags.get(HOST_TAG)
        if host != socket.gethostname():
            raise RefusedError(f"run {run_id}: its worker runs on host {host!r}, not this one ({socket.gethostname()}); "
                               f"cancel it there")
        self._interrupt(run)
        if not wait:
            return self.run(run_id)
        while True:
            try:
                info = self.wait(run_id, progress=False, poll_s=0.5,
                                 timeout_s=max(min(CANCEL_RECHECK_S, deadline - time.monotonic()), 1.0))
                break
            except ClientError:
                run = self.instance.get_run_by_id(run_id)
                if time.monotonic() >= deadline or run is None or run.status not in (
                        dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.CANCELING):
                    raise
            if run.status == dg.DagsterRunStatus.STARTED:
                # The interrupt came while the worker was starting the run, before Dagster's step boundary that
                # turns it into CANCELED: the start overwrote CANCELING and the signal was lost. Again.
                self._interrupt(run)
        if info.partition:
            mlflow = self._resources["mlflow"] if self._resources is not None else MlflowResource()
            closed = close_round_runs(mlflow.tracker(), self.task, info.partition, RUN_KILLED)
            if closed:
                self.notify(f"round {info.partition}: {len(closed)} MLflow run(s) ended KILLED")
        return info

    def _interrupt(self, run: Any) -> None:
        """Mark ``run`` CANCELING and interrupt its worker (SIGINT: Dagster ends an interrupted run CANCELED);
        a run whose worker is gone is marked CANCELED at once."""
        self.instance.report_run_canceling(run, message="cancelled by LocalClient.cancel")
        pid = worker_pid(run)
        if pid is not None and pid_alive(pid):
            os.kill(pid, signal.SIGINT)
        else:
            self.instance.report_run_canceled(run, message=f"its worker (pid {run.tags.get(PID_TAG)}) is gone")

    def _drive(self, first: tuple[str, Callable[[], RoundInfo]] | None, on_round: Callable[[RoundInfo], None] | None,
               progress: bool, proposal: Mapping[str, Any] | None = None) -> list[RoundInfo]:
        """Run ``first`` (a round key and how to run it, if any), then the active loop's rounds while its budget
        lasts (:func:`~envloop_pipelines.core.loop.budget.drive_loop`); ``proposal`` is the first round's
        hypothesis (later rounds derive theirs from the champion's failures)."""
        cfg = self._cfg()
        done: list[RoundInfo] = []
        pending = [first] if first is not None else []

        def ask() -> NextRound:
            if pending:
                return NextRound(pending[0][0], "asked for")
            return next_round(cfg.task, home=cfg.home)

        def run(nxt: NextRound) -> bool:
            result = pending.pop()[1]() if pending else self._execute_round(
                nxt.round, None if done else proposal, nxt.run_key, progress=progress, door=self._door_of("run_loop"))
            done.append(result)
            if on_round is not None:
                on_round(result)
            return True  # a round without a decision raised RoundFailed

        reason = drive_loop(ask, run)
        state = load_loop(cfg.task, cfg.home)
        self.notify(f"loop {state.loop_id if state else '-'} stops: {reason}")
        return done

    def run_loop(self, *, rounds: int, patience: int = 2, max_wall_s: float = 6 * 3600,
                 hypothesis: Mapping[str, Any] | str | os.PathLike[str] | None = None, progress: bool = True,
                 on_round: Callable[[RoundInfo], None] | None = None) -> list[RoundInfo]:
        """Start a loop (the home's active loop) and run its rounds here while its budget lasts.

        The hypothesis (if any) is the first round's (``envloop round start --hypothesis``); later rounds
        derive theirs from the champion's failures, as with the remote client.

        One claim of the task's loop for all its rounds (:meth:`hold_loop`, unless this client holds it already).

        Raises:
            RefusedError: a bad hypothesis (every field named) or budget.
            BusyError: another run of the task's loop runs.
            RoundFailed: a round ended without a decision.
        """
        cfg = self._cfg()
        proposal = self._proposal(hypothesis)
        try:
            budget = LoopBudget(max_rounds=rounds, patience=patience, max_wall_s=max_wall_s)
        except ValueError as exc:
            raise RefusedError(str(exc)) from None
        self.probe()
        with self._hold(round_key(last_round_number(cfg.task, cfg.home) + 1), "run_loop"):  # one claim, every round
            self.ensure_no_round_running()  # before the active loop is replaced
            state = start_loop(cfg.task, f"cli-{int(time.time())}", budget, home=cfg.home)
            self.notify(f"loop {state.loop_id}: up to {rounds} rounds")
            return self._drive(None, on_round, progress, proposal)

    def retry(self, run: str | None = None, *, wait: bool = True, progress: bool = True,
              on_round: Callable[[RoundInfo], None] | None = None) -> list[RoundInfo]:
        """Finish the task's undecided round (its worker died or it failed), then go on while the loop's budget lasts.

        The retry runs the round's job again for the same partition with the failed run's loop settings and
        hypothesis config; every step is idempotent (content-addressed snapshots and checkpoints, write-once
        ledger entries and hypothesis), so what the dead run finished is found again, not duplicated.
        ``run``: the round key (default and only choice here: the task's last round). Returns the rounds run
        (``[]`` when there is no undecided round).

        Raises:
            NotFoundError: ``run`` is not the last undecided round.
            RefusedError: the round has no run started here, or its last run did not fail.
            RoundFailed: the round failed again.
        """
        task = self.task
        last = last_round_number(task, self._home)
        key = round_key(last) if last else None
        if key is None or key in decided_rounds(task, self._home):
            self.notify(f"task {task}: no undecided round to retry"
                        + (f" (last round {key} is decided)" if key else ""))
            return []
        if run is not None and run != key:
            raise NotFoundError(f"round {run!r} is not the task's undecided round ({key})")
        runs = self.instance.get_runs(filters=dg.RunsFilter(job_name=ROUND_JOB, tags={PARTITION_TAG: key}), limit=1)
        if not runs or SETTINGS_TAG not in runs[0].tags:
            raise RefusedError(f"round {key} has no run started by `envloop round` to take its settings from")
        failed = runs[0]
        if failed.status not in (dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED):
            raise RefusedError(f"round {key}: its last run {failed.run_id} is {failed.status.value}, not failed")
        settings = json.loads(failed.tags[SETTINGS_TAG])
        if settings.get("task") != task:
            raise RefusedError(f"round {key}'s run belongs to task {settings.get('task')!r}, not {task!r}")
        self._use(settings)
        self.probe()
        with self._hold(key, "retry"):  # one claim for the retried round and the rounds after it
            self.ensure_no_round_running()
            self.notify(f"retrying round {key} (run {failed.run_id} {failed.status.value})")
            return self._drive((key, lambda: self._execute_round(key, None, failed.tags.get(LOOP_TAG),
                                                                 retry_of=failed, progress=progress,
                                                                 door=self._door_of("retry"))), on_round, progress)


__all__ = ["LocalClient"]
