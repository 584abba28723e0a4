"""Which executor runs a job's steps: Dagster's default on one machine, one Kubernetes Job per step on a cluster.

``ENVLOOP_EXECUTOR`` picks it when the code location loads:

- unset or ``multiprocess``: Dagster's default (``multi_or_in_process_executor``, which runs each step in a
  process of its own; ``execute_in_process`` stays in-process). The local default, unchanged.
- ``k8s``: ``dagster_k8s.k8s_job_executor``: each step is a Kubernetes Job with the run launcher's image, env,
  volumes and service account, plus the step's ``dagster-k8s/config`` op tags (the training asset's GPU).
- ``in_process``: Dagster's ``in_process_executor``: every step in the run's own process, one after another. No
  process per step to start (a tiny round on 2 cores: about 22 s instead of 65 s), no isolation between steps: a
  small deployment, a laptop, the tests' webserver.

``dagster_k8s`` (and the ``kubernetes`` client under it) is imported only on the ``k8s`` path.
"""

from __future__ import annotations

import dagster as dg

EXECUTOR_ENV = "ENVLOOP_EXECUTOR"
EXECUTORS = ("multiprocess", "k8s", "in_process")


def select_executor(name: str | None) -> dg.ExecutorDefinition | None:
    """The executor named ``name``; ``None`` means Dagster's default (multiprocess).

    Args:
        name: the value of ``ENVLOOP_EXECUTOR``: empty/``None``, ``multiprocess``, ``k8s`` or ``in_process``.

    Raises:
        ValueError: for any other name, naming the allowed ones.
    """
    chosen = (name or "multiprocess").strip().lower()
    if chosen == "multiprocess":
        return None
    if chosen == "k8s":
        from dagster_k8s import k8s_job_executor

        return k8s_job_executor
    if chosen == "in_process":
        return dg.in_process_executor
    raise ValueError(f"{EXECUTOR_ENV}={name!r} is not an executor; allowed: {', '.join(EXECUTORS)}")


__all__ = ["EXECUTORS", "EXECUTOR_ENV", "select_executor"]
