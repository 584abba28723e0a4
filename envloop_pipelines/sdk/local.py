"""The ``LocalClient``: the loop run in this process, on this machine's Dagster instance and EnvLoop home.

Rounds run through Dagster (the same jobs the UI launches) executed in-process on the instance in
``$DAGSTER_HOME`` (default ``<envloop home>/dagster``, SQLite), so every run shows up in ``envloop ui``
afterwards. It answers the same questions as the remote :class:`~envloop_pipelines.sdk.Client`
(:class:`~envloop_pipelines.sdk.protocol.LoopClient`), read from the home's ledger and round store
instead of a webserver; the CLI drives either one.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from envloop_pipelines.core.storage import atomic_write_bytes, atomic_write_json, envloop_home, pid_alive
from envloop_pipelines.names import (
    HOST_TAG,
    LOOP_TAG,
    NOISE_FLOOR,
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
from envloop_pipelines.sdk.client import (
    ClientError,
    NotFoundError,
    RefusedError,
    UnavailableError,
    ReleaseInfo,
    RoundFailed,
    RoundInfo,
    RoundRun,
    RunError,
    RunInfo,
)
from envloop_pipelines.sdk.predict import Answerer

#: The one Dagster instance file of every local entry point (shipped in the package).
INSTANCE_FILE = Path(__file__).resolve().parents[1] / "dagster.yaml"
#: What earlier versions wrote as the instance file; replaced by INSTANCE_FILE when found.
_LEGACY_INSTANCE = "telemetry:\n  enabled: false\n"
#: Dagster's console logger at WARNING: the CLI prints its own one line per step.
QUIET: dict[str, Any] = {"loggers": {"console": {"config": {"log_level": "WARNING"}}}}
#: Dagster's console logger off but for CRITICAL: a round's worker prints its own line (a cancelled round's
#: interrupted step would otherwise fill its log with Dagster's stack traces).
SILENT: dict[str, Any] = {"loggers": {"console": {"config": {"log_level": "CRITICAL"}}}}


def dagster_home() -> Path:
    """``$DAGSTER_HOME``, or ``<envloop home>/dagster``; its ``dagster.yaml`` is the package's instance file.

    A ``dagster.yaml`` a person put there (Postgres, say) is kept; a missing one, or the
    telemetry-only file earlier versions wrote, becomes a copy of :data:`INSTANCE_FILE`.
    """
    home = Path(os.environ.get("DAGSTER_HOME") or envloop_home() / "dagster").resolve()
    home.mkdir(parents=True, exist_ok=True)
    config = home / "dagster.yaml"
    if not config.exists() or config.read_text(encoding="utf-8") == _LEGACY_INSTANCE:
        atomic_write_bytes(config, INSTANCE_FILE.read_bytes(), overwrite=True)
    os.environ["DAGSTER_HOME"] = str(home)
    return home


def loop_resources(settings: Mapping[str, Any]) -> dict[str, Any]:
    """The Dagster resources of a loop with these settings (``LoopConfig`` names), as ``definitions.py`` binds them.

    The settings are the loop's, all of them (``ENVLOOP_<FIELD>`` is not read); the sandbox is the
    deployment's, from ``ENVLOOP_SANDBOX*`` when a run uses it (``resources/sandbox.py``).

    Raises:
        ValueError: a setting that ``LoopConfig`` refuses (the message names it).
    """
    from envloop_pipelines.resources.loop import MlflowResource, loop_resource
    from envloop_pipelines.resources.round_store import RoundStoreIOManager
    from envloop_pipelines.resources.sandbox import SandboxResource

    loop = loop_resource(settings)  # checked here, once
    return {"loop": loop, "mlflow": MlflowResource(), "io_manager": RoundStoreIOManager(loop=loop),
            "sandbox": SandboxResource()}


@functools.cache
def code_location_job(name: str) -> Any:
    """A job of the code location, loaded once per process (the client runs it with its own resources)."""
    from envloop_pipelines.definitions import defs

    return defs().resolve_job_def(name)


@contextlib.contextmanager
def watch_steps(instance: Any, run_id: str, total: int, desc: str, poll_s: float = 1.0) -> Iterator[None]:
    """A progress bar over the steps of a run executing in this process (read from the instance's event log).

    On a terminal the bar sits above the steps' own bars (training, prediction); elsewhere it is a line
    every few percent or 30 s, naming the step that runs, on stderr even where nothing prints progress records
    (a notebook, a script: ``ensure_shown``, as the remote client's ``wait`` does).
    """
    from envloop_pipelines.core.progress import Progress, ensure_shown

    ensure_shown()
    stop = threading.Event()
    bar = Progress(desc, total=total, unit="step")

    def poll() -> None:
        while True:
            finished = stop.wait(poll_s)
            _show_steps(bar, instance, run_id)
            if finished:
                return

    thread = threading.Thread(target=poll, name=f"progress {desc}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=30)
        bar.close()


def _show_steps(bar: Any, instance: Any, run_id: str) -> None:
    """Move ``bar`` to the run's finished steps, naming the steps that run (read from the instance's event log)."""
    import dagster as dg

    ended = {dg.DagsterEventType.STEP_SUCCESS, dg.DagsterEventType.STEP_FAILURE, dg.DagsterEventType.STEP_SKIPPED}
    try:
        records = instance.get_records_for_run(run_id, of_type={dg.DagsterEventType.STEP_START, *ended}).records
    except Exception:  # noqa: BLE001 - the run's storage is not there yet; progress is best effort
        records = []
    done, started = set(), set()
    for r in records:
        event = r.event_log_entry.dagster_event
        if event is not None and event.step_key:
            (done if event.event_type in ended else started).add(event.step_key)
    bar.update(len(done) - bar.n, now=",".join(sorted(started - done)) or None)


def _run_info(run: Any) -> RunInfo:
    """A run of the local instance as the SDK describes runs."""
    tags = dict(run.tags)
    return RunInfo(run_id=run.run_id, job=run.job_name, status=run.status.value, partition=tags.get(PARTITION_TAG),
                   start_time=None, end_time=None, created=None, tags=tags, steps=())


class LocalClient:
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

        from envloop_pipelines.sdk.local import LocalClient

        client = LocalClient({"task": "personal_agent"})
        client.setup()
        rounds = client.run_loop(rounds=2)
    """

    def __init__(self, loop_settings: Mapping[str, Any] | None = None, *, task: str | None = None,
                 notify: Callable[[str], None] = lambda line: None, door: str | None = None) -> None:
        self.notify = notify
        self._door = door
        #: The console logger's run config of the rounds run in this process (:data:`QUIET`; the worker: SILENT).
        self.run_logging: dict[str, Any] = QUIET
        self._resources: dict[str, Any] | None = None
        self._task = task or "personal_agent"
        self._home: str | None = None
        self._workers: dict[str, subprocess.Popen[bytes]] = {}  # run id -> the worker start_round started
        self._answers = Answerer()
        if loop_settings is not None:
            self._use(loop_settings)
        self._instance: Any = None

    def _use(self, settings: Mapping[str, Any]) -> None:
        self._resources = loop_resources(settings)
        self.config = self._resources["loop"].config()
        self._task, self._home = self.config.task, self.config.home

    @property
    def task(self) -> str:
        """The task this client's loop runs."""
        return self._task

    @property
    def instance(self) -> Any:
        """The local Dagster instance (``$DAGSTER_HOME``)."""
        if self._instance is None:
            import dagster as dg

            dagster_home()
            self._instance = dg.DagsterInstance.get()
        return self._instance

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
        from envloop_pipelines.core.services import ServiceUnavailable, probe_tracking_uri

        mlflow = self._resources["mlflow"] if self._resources is not None else None
        uri, setting = (mlflow.tracking_uri, "MlflowResource.tracking_uri") if mlflow is not None and \
            mlflow.tracking_uri else (os.environ.get("MLFLOW_TRACKING_URI"), "MLFLOW_TRACKING_URI")
        try:
            probe_tracking_uri(uri, setting)
        except ServiceUnavailable as exc:
            raise UnavailableError(str(exc)) from None

    def reap_orphans(self) -> list[Any]:
        """Mark failed every unfinished run of this host whose worker process is gone; the runs marked."""
        from envloop_pipelines.defs.rounds.recovery import reap_orphaned_runs

        return list(reap_orphaned_runs(self.instance))

    # ------------------------------------------------------------------ setup and rounds

    def is_set_up(self) -> bool:
        """Whether the noise floor (and so release 1) has been materialized on this instance."""
        import dagster as dg

        return self.instance.get_latest_materialization_event(dg.AssetKey(NOISE_FLOOR)) is not None

    def setup(self, *, wait: bool = True, progress: bool = True) -> RunInfo:
        """Run ``setup_job`` here (the task's benchmark and noise floor, release 1 on a fresh task).

        Raises:
            UnavailableError: the MLflow server does not answer (:meth:`probe`).
            RoundFailed: the setup run failed.
        """
        from dagster._core.utils import make_new_run_id

        from envloop_pipelines.defs.rounds.recovery import worker_tags

        self._cfg()
        self.probe()
        job = code_location_job(SETUP_JOB)
        run_id = make_new_run_id()
        watch = watch_steps(self.instance, run_id, len(job.graph.nodes), "setup") if progress else contextlib.nullcontext()
        with watch:
            job.execute_in_process(instance=self.instance, resources=self._resources, run_config=QUIET,
                                   tags=worker_tags(), run_id=run_id, raise_on_error=False)
        info = self.run(run_id)
        if not info.success:
            reason = self.run_error(run_id)
            raise RoundFailed(f"setup run {run_id} ended {info.status}" + (f": {reason}" if reason else ""), info,
                              reason)
        return info

    def promotion_warning(self) -> str | None:
        """Why no candidate can be promoted with the measured noise floor; ``None`` when one can, or with no floor."""
        from envloop_pipelines.core.ledger.event_log import LedgerError
        from envloop_pipelines.core.loop.promotion import champion_out_of_reach
        from envloop_pipelines.core.data.snapshots import open_task
        from envloop_pipelines.core.decision_loop.noise_floor import current_noise_floor

        cfg = self._cfg()
        try:
            floor = current_noise_floor(cfg, open_task(cfg.task, home=cfg.home)).floor
        except (LedgerError, FileNotFoundError):
            return None
        return champion_out_of_reach(cfg.task, cfg.home, floor) or None

    def _door_of(self, method: str) -> str:
        """The door a round claim names: the CLI's command, or ``LocalClient.<method>``."""
        return self._door or f"LocalClient.{method}"

    def _claim(self, key: str, run_id: str, door: str, pid: int) -> None:
        """Claim the task's round for ``run_id`` (``core/loop/round_claim.py``); a live claim of another run refuses.

        Raises:
            RefusedError: another round of the task runs (the message names it, its run and its door).
        """
        from envloop_pipelines.resources.round_claim import RoundBusy, claim_round_on

        try:
            claim_round_on(self.instance, self._cfg(), key, run_id=run_id, door=door, pid=pid)
        except RoundBusy as exc:
            raise RefusedError(str(exc)) from None

    def _execute_round(self, key: str, proposal: Mapping[str, Any] | None, run_key: str | None,
                       retry_of: Any = None, progress: bool = True, run_id: str | None = None,
                       extra_tags: Mapping[str, str] | None = None, door: str = "LocalClient.run_round") -> RoundInfo:
        """Run round ``key``'s job in this process; the round with its decision, or RoundFailed.

        The task's round is claimed for the run first (a worker takes over the claim its ``start_round`` took)
        and given back when the run has ended.

        Raises:
            RefusedError: another round of the task holds the claim.
        """
        from dagster._core.utils import make_new_run_id

        from envloop_pipelines.resources.round_claim import release_round_of

        cfg = self._cfg()
        run_id = run_id or make_new_run_id()
        self._claim(key, run_id, door, os.getpid())
        try:
            return self._execute_claimed(key, proposal, run_key, retry_of, progress, run_id, extra_tags)
        finally:
            release_round_of(cfg, run_id)

    def _execute_claimed(self, key: str, proposal: Mapping[str, Any] | None, run_key: str | None, retry_of: Any,
                         progress: bool, run_id: str, extra_tags: Mapping[str, str] | None) -> RoundInfo:
        from envloop_pipelines.defs.rounds.recovery import worker_tags

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
        from envloop_pipelines.core.decision_loop.proposals import ProposalError, parse_proposal

        try:
            return parse_proposal(hypothesis)
        except ProposalError as exc:
            raise RefusedError(str(exc)) from None

    def _next_round(self) -> str:
        """The key of the task's next round; refused before setup and while a round of the task runs."""
        from envloop_pipelines.core.loop.budget import last_round_number
        from envloop_pipelines.core.loop.config import round_key

        if not self.is_set_up():
            raise RefusedError(f"the task {self.task!r} has no noise floor yet: run setup() (setup_job) before the "
                               f"first round")
        self.ensure_no_round_running()
        return round_key(last_round_number(self.task, self._home) + 1)

    def ensure_no_round_running(self) -> None:
        """Refuse while a round of the task runs, from whichever door (nothing is claimed: the round's own claim
        is taken when it starts).

        Raises:
            RefusedError: a round of the task runs; the message names it, its run and (from its claim) its door.
        """
        from envloop_pipelines.resources.round_claim import RoundBusy, live_claim_on

        self.reap_orphans()  # a claim whose worker died holds nothing: its run is marked failed first
        claim = live_claim_on(self.instance, self._cfg()) if self._resources is not None else None
        if claim is not None:
            raise RefusedError(str(RoundBusy(claim)))
        running = self._running_round()
        if running is not None:
            raise RefusedError(f"round {running[0]} of task {self.task!r} is running (run {running[1]}): wait for it "
                               f"or cancel it first")

    def _running_round(self) -> tuple[str, str] | None:
        """``(key, run id)`` of a round of this task whose worker is alive: one started here that has not created
        its run yet, or an unfinished run of the instance (a run whose worker is gone is marked failed first)."""
        import dagster as dg

        for run_id, worker in list(self._workers.items()):
            if worker.poll() is None and self.instance.get_run_by_id(run_id) is None:
                return json.loads(Path(worker.args[-1]).read_text(encoding="utf-8"))["key"], run_id
        self.reap_orphans()
        unfinished = [dg.DagsterRunStatus.NOT_STARTED, dg.DagsterRunStatus.STARTING, dg.DagsterRunStatus.STARTED,
                      dg.DagsterRunStatus.CANCELING]
        for run in self.instance.get_runs(filters=dg.RunsFilter(job_name=ROUND_JOB, statuses=unfinished)):
            if json.loads(run.tags.get(SETTINGS_TAG) or "{}").get("task") == self.task:
                return run.tags.get(PARTITION_TAG, "?"), run.run_id
        return None

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
            RefusedError: a bad hypothesis (the field named), no setup yet, or a round of the task still running.
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
            RefusedError: a bad hypothesis or key, no setup yet, or a round of the task still running.
        """
        from dagster._core.utils import make_new_run_id

        from envloop_pipelines.core.loop.config import round_number

        started = time.time()
        cfg = self._cfg()
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
        run_id = make_new_run_id()
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
            from envloop_pipelines.resources.round_claim import release_round_of

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
        from envloop_pipelines.core.progress import Progress, ensure_shown
        from envloop_pipelines.defs.rounds.recovery import worker_is_gone

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
                    _show_steps(bar, self.instance, run_id)
                if run.is_finished:
                    return _run_info(run)
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
        from envloop_pipelines.core.tracking import RUN_KILLED, close_round_runs
        from envloop_pipelines.defs.rounds.recovery import worker_pid
        from envloop_pipelines.resources.loop import MlflowResource

        deadline = time.monotonic() + timeout_s
        run = self._await_run(run_id, deadline, 0.5)
        if run.is_finished:
            return _run_info(run)
        host = run.tags.get(HOST_TAG)
        if host != socket.gethostname():
            raise RefusedError(f"run {run_id}: its worker runs on host {host!r}, not this one ({socket.gethostname()}); "
                               f"cancel it there")
        self.instance.report_run_canceling(run, message="cancelled by LocalClient.cancel")
        pid = worker_pid(run)
        if pid is not None and pid_alive(pid):
            os.kill(pid, signal.SIGINT)  # Dagster ends an interrupted run CANCELED
        else:
            self.instance.report_run_canceled(run, message=f"its worker (pid {run.tags.get(PID_TAG)}) is gone")
        if not wait:
            return self.run(run_id)
        info = self.wait(run_id, progress=False, poll_s=0.5, timeout_s=max(deadline - time.monotonic(), 1.0))
        if info.partition:
            mlflow = self._resources["mlflow"] if self._resources is not None else MlflowResource()
            closed = close_round_runs(mlflow.tracker(), self.task, info.partition, RUN_KILLED)
            if closed:
                self.notify(f"round {info.partition}: {len(closed)} MLflow run(s) ended KILLED")
        return info

    def _drive(self, first: tuple[str, Callable[[], RoundInfo]] | None, on_round: Callable[[RoundInfo], None] | None,
               progress: bool, proposal: Mapping[str, Any] | None = None) -> list[RoundInfo]:
        """Run ``first`` (a round key and how to run it, if any), then the active loop's rounds while its budget
        lasts (:func:`~envloop_pipelines.core.loop.budget.drive_loop`); ``proposal`` is the first round's
        hypothesis (later rounds derive theirs from the champion's failures)."""
        from envloop_pipelines.core.loop.budget import NextRound, drive_loop, load_loop, next_round

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

        Raises:
            RefusedError: a bad hypothesis (every field named) or budget.
            RoundFailed: a round ended without a decision.
        """
        from envloop_pipelines.core.loop.budget import LoopBudget, start_loop

        cfg = self._cfg()
        proposal = self._proposal(hypothesis)
        try:
            budget = LoopBudget(max_rounds=rounds, patience=patience, max_wall_s=max_wall_s)
        except ValueError as exc:
            raise RefusedError(str(exc)) from None
        self.probe()
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
        import dagster as dg

        from envloop_pipelines.core.loop.budget import decided_rounds, last_round_number
        from envloop_pipelines.core.loop.config import round_key

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
        self.ensure_no_round_running()
        self.notify(f"retrying round {key} (run {failed.run_id} {failed.status.value})")
        return self._drive((key, lambda: self._execute_round(key, None, failed.tags.get(LOOP_TAG), retry_of=failed,
                                                             progress=progress, door=self._door_of("retry"))),
                           on_round, progress)

    # ------------------------------------------------------------------ what the steps recorded

    def run(self, run_id: str) -> RunInfo:
        """A run of the local instance.

        Raises:
            NotFoundError: no such run.
        """
        found = self.instance.get_run_by_id(run_id)
        if found is None:
            raise NotFoundError(f"run: no run {run_id!r} on the local instance")
        return _run_info(found)

    def run_error(self, run_id: str) -> RunError | None:
        """Why a run failed: the first failed step's own error (``None`` when the log names none)."""
        import dagster as dg

        records = self.instance.get_records_for_run(run_id, of_type={dg.DagsterEventType.STEP_FAILURE,
                                                                     dg.DagsterEventType.RUN_FAILURE}).records
        for record in records:
            event = record.event_log_entry.dagster_event
            if event is None:
                continue
            data = event.event_specific_data
            user = getattr(data, "user_failure_data", None)
            error = getattr(data, "error", None)
            while error is not None and error.cause is not None:  # Dagster's wrapper, then the step's own error
                error = error.cause
            message = (user.description if user is not None and user.description else
                       error.to_string().strip().splitlines()[0] if error is not None
                       else record.event_log_entry.message)
            return RunError(step=event.step_key, message=message,
                            error_class=getattr(error, "cls_name", None) if error is not None else None)
        return None

    def decision(self, key: str) -> Any:
        """Round ``key``'s decision, or ``None`` while it is undecided."""
        from envloop_pipelines.core.decision_loop.step_records import RoundDecision
        from envloop_pipelines.core.ledger.store import RoundStore

        return RoundStore(self.task, self._home).load("promotion_decision", RoundDecision, key)

    def rounds(self) -> list[RoundInfo]:
        """This home's rounds, in order: each with its latest run on the local instance and its decision."""
        import dagster as dg

        from envloop_pipelines.core.loop.config import round_key, round_number
        from envloop_pipelines.core.ledger.store import RoundStore

        keys = set(round_key(n) for n in RoundStore(self.task, self._home).started_rounds())
        keys |= set(self.instance.get_dynamic_partitions(ROUNDS_PARTITIONS))
        out = []
        for key in sorted(keys, key=round_number):
            runs = self.instance.get_runs(filters=dg.RunsFilter(job_name=ROUND_JOB, tags={PARTITION_TAG: key}),
                                          limit=1)
            out.append(RoundInfo(key, _run_info(runs[0]) if runs else None, self.decision(key)))
        return out

    def ledger(self, kind: str | None = None) -> list[dict[str, Any]]:
        """The task's ledger events, oldest first (only those of ``kind``, if given)."""
        from envloop_pipelines.core.ledger.event_log import EVENT_KINDS
        from envloop_pipelines.core.ledger.ledger import Ledger

        if kind is not None and kind not in EVENT_KINDS:
            raise RefusedError(f"kind: {kind!r} is not a ledger event kind; allowed: {', '.join(EVENT_KINDS)}")
        return list(Ledger(self.task, self._home).events(kind))

    def release_cards(self) -> list[dict[str, Any]]:
        """The release chain as cards (holdout first, errata beside), oldest first."""
        from envloop_pipelines.core.ledger.ledger import Ledger

        return list(Ledger(self.task, self._home).releases())

    def releases(self, *, with_cards: bool = True) -> list[ReleaseInfo]:
        """The release chain from the ledger's cards, oldest first (no MLflow model version here)."""
        return [ReleaseInfo(release=int(c["release"]), model_version="", round=c.get("round"),
                            checkpoint_sha256=c.get("checkpoint_sha256"), mlflow_run_id=None,
                            holdout=dict(c.get("holdout") or {}), champion=bool(c.get("champion")),
                            card=c if with_cards else None) for c in self.release_cards()]

    # ------------------------------------------------------------------ predict: a release, here or served

    def predict(self, request: Mapping[str, Any] | Sequence[Mapping[str, Any]], *, url: str | None = None,
                release: int | str = "champion", api_key: str | None = None) -> Any:
        """A release's answers to a Jev request (``{"state": ..., "questions": {...}}``; a labelled decision record
        works too: its labels and meta are left out), or to a list of them.

        With ``url`` the request goes to a served release (``envloop serve``, ``POST <url>/v1/systemone``);
        without, the release's checkpoint from this home's release chain is answered in this process by the
        same server code (kept loaded until :meth:`close`): the numbers are the ones ``envloop serve`` gives.

        Raises:
            RefusedError: the request was refused (the message is the server's own, naming the field), or
                ``release`` is neither a release number nor ``"champion"``.
            NotFoundError: no such release.
            UnavailableError: the server at ``url`` did not answer.
        """
        return self._answers.predict(request, url=url, api_key=api_key, source=lambda: self._release_source(release))

    def _release_source(self, release: int | str) -> Any:
        from envloop_pipelines.core.serve.settings import source_from_release

        try:
            return source_from_release(self.task, release, home=self._home)
        except LookupError as exc:
            raise NotFoundError(f"release: {exc}") from None
        except ValueError as exc:
            raise RefusedError(f"release: {exc}") from None

    def close(self) -> None:
        """Stop the in-process servers :meth:`predict` started (their models are unloaded)."""
        self._answers.close()
