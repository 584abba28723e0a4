"""This machine's Dagster instance as the ``LocalClient`` uses it: where it lives, the code location's jobs, and its
runs read back as the SDK describes runs (their status, the first failed step's own error, a progress bar).

The instance is ``$DAGSTER_HOME`` (default ``<envloop home>/dagster``, SQLite) with the package's instance file,
so every run executed here shows up in ``envloop ui`` afterwards.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dagster as dg

from envloop_pipelines.core.progress import Progress, ensure_shown
from envloop_pipelines.core.storage import atomic_write_bytes, envloop_home
from envloop_pipelines.names import PARTITION_TAG
from envloop_pipelines.sdk.records import RunError, RunInfo

#: The one Dagster instance file of every local entry point (shipped in the package).
INSTANCE_FILE = Path(__file__).resolve().parents[1] / "dagster.yaml"
#: What earlier versions wrote as the instance file; replaced by INSTANCE_FILE when found.
_LEGACY_INSTANCE = "telemetry:\n  enabled: false\n"
#: Dagster's console logger at WARNING: the CLI prints its own one line per step.
QUIET: dict[str, Any] = {"loggers": {"console": {"config": {"log_level": "WARNING"}}}}
#: Dagster's console logger off but for CRITICAL: a round's worker prints its own line (a cancelled round's
#: interrupted step would otherwise fill its log with Dagster's stack traces).
SILENT: dict[str, Any] = {"loggers": {"console": {"config": {"log_level": "CRITICAL"}}}}
#: The step events that end a step.
_STEP_ENDED = {dg.DagsterEventType.STEP_SUCCESS, dg.DagsterEventType.STEP_FAILURE, dg.DagsterEventType.STEP_SKIPPED}


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


def open_instance() -> Any:
    """The Dagster instance of :func:`dagster_home`, its storages created by one process at a time.

    On a fresh home the first open creates the SQLite databases and stamps their schema version; two processes
    doing so at once (two terminals started together, the same second) left two version rows, and every later
    open failed with alembic's "more than one head present". The first open of each process takes an
    exclusive lock on ``<dagster home>/.instance.lock`` while it opens and reads each storage once.
    """
    import fcntl

    home = dagster_home()
    with open(home / ".instance.lock", "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            instance = dg.DagsterInstance.get()
            instance.get_runs(limit=1)  # the run storage
            instance.get_latest_materialization_event(dg.AssetKey("envloop_instance_probe"))  # the event log
            instance.all_instigator_state()  # the schedule storage (sensors and schedules)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return instance


def new_run_id() -> str:
    """A new run's id, as Dagster makes them (a UUID4: Dagster's own maker is not public API)."""
    return str(uuid.uuid4())


@functools.cache
def code_location_job(name: str) -> Any:
    """A job of the code location, loaded once per process (the client runs it with its own resources)."""
    # The code location imports every step (torch, transformers: seconds): loaded when a job first runs here
    from envloop_pipelines.definitions import defs

    return defs().resolve_job_def(name)


@contextlib.contextmanager
def watch_steps(instance: Any, run_id: str, total: int, desc: str, poll_s: float = 1.0) -> Iterator[None]:
    """A progress bar over the steps of a run executing in this process (read from the instance's event log).

    On a terminal the bar sits above the steps' own bars (training, prediction); elsewhere it is a line
    every few percent or 30 s, naming the step that runs, on stderr even where nothing prints progress records
    (a notebook, a script: ``ensure_shown``, as the remote client's ``wait`` does).
    """
    ensure_shown()
    stop = threading.Event()
    bar = Progress(desc, total=total, unit="step")

    def poll() -> None:
        while True:
            finished = stop.wait(poll_s)
            show_steps(bar, instance, run_id)
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


def show_steps(bar: Any, instance: Any, run_id: str) -> None:
    """Move ``bar`` to the run's finished steps, naming the steps that run (read from the instance's event log)."""
    try:
        records = instance.get_records_for_run(run_id, of_type={dg.DagsterEventType.STEP_START, *_STEP_ENDED}).records
    except Exception:  # noqa: BLE001 - the run's storage is not there yet; progress is best effort
        records = []
    done, started = set(), set()
    for r in records:
        event = r.event_log_entry.dagster_event
        if event is not None and event.step_key:
            (done if event.event_type in _STEP_ENDED else started).add(event.step_key)
    bar.update(len(done) - bar.n, now=",".join(sorted(started - done)) or None)


def run_info(run: Any) -> RunInfo:
    """A run of the local instance as the SDK describes runs."""
    tags = dict(run.tags)
    return RunInfo(run_id=run.run_id, job=run.job_name, status=run.status.value, partition=tags.get(PARTITION_TAG),
                   start_time=None, end_time=None, created=None, tags=tags, steps=())


def run_error(instance: Any, run_id: str) -> RunError | None:
    """Why a run of ``instance`` failed: the first failed step's own error (``None`` when the log names none)."""
    records = instance.get_records_for_run(run_id, of_type={dg.DagsterEventType.STEP_FAILURE,
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


__all__ = ["INSTANCE_FILE", "QUIET", "SILENT", "code_location_job", "dagster_home", "new_run_id", "run_error",
           "run_info", "show_steps", "watch_steps"]
