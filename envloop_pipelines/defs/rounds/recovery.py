"""Runs whose worker died: found by the process that ran them, marked failed, retried.

With Dagster's default (local) run launcher nothing watches a run worker: a
worker killed mid-step (SIGKILL, OOM, a reboot) leaves its run STARTED forever
(on Kubernetes, run monitoring does this job). Runs the CLI executes carry
``envloop/host`` and ``envloop/pid``; :func:`reap_orphaned_runs` marks those
whose process is gone as failed, so a retry starts from a clean record and the
UI tells the truth.
"""

from __future__ import annotations

import os
import socket

import dagster as dg

from envloop_pipelines.core.storage import pid_alive

from envloop_pipelines.names import HOST_TAG, PID_TAG, RETRY_OF_TAG, SETTINGS_TAG

__all__ = ["HOST_TAG", "PID_TAG", "RETRY_OF_TAG", "SETTINGS_TAG", "reap_orphaned_runs", "worker_is_gone", "worker_pid",
           "worker_tags"]


def worker_tags() -> dict[str, str]:
    """Tags naming this process as the run's worker."""
    return {HOST_TAG: socket.gethostname(), PID_TAG: str(os.getpid())}


def worker_pid(run: dg.DagsterRun) -> int | None:
    """The pid of the run's worker when its tags name one on this host; ``None`` otherwise."""
    pid = run.tags.get(PID_TAG, "")
    return int(pid) if run.tags.get(HOST_TAG) == socket.gethostname() and pid.isdigit() else None


def worker_is_gone(run: dg.DagsterRun) -> bool:
    """Whether the run's worker was a process of this host (not this one) that no longer exists."""
    pid = worker_pid(run)
    return pid is not None and pid != os.getpid() and not pid_alive(pid)


def reap_orphaned_runs(instance: dg.DagsterInstance) -> list[dg.DagsterRun]:
    """Mark as failed every unfinished run of this host whose worker process no longer exists."""
    host = socket.gethostname()
    # NOT_STARTED too: an in-process run is created with its worker's tags before it starts, and a worker
    # killed in between leaves it so
    unfinished = [dg.DagsterRunStatus.NOT_STARTED, dg.DagsterRunStatus.STARTING, dg.DagsterRunStatus.STARTED,
                  dg.DagsterRunStatus.CANCELING]
    reaped = []
    for run in instance.get_runs(filters=dg.RunsFilter(statuses=unfinished, tags={HOST_TAG: host})):
        if not worker_is_gone(run):
            continue
        instance.report_run_failed(run, message=f"run worker (pid {run.tags[PID_TAG]} on {host}) is gone: killed or "
                                                f"crashed mid-run")
        reaped.append(run)
    return reaped
