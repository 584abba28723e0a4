"""The sandbox: run untrusted or verifier code in a fresh, limited, isolated process.

One protocol (:class:`Sandbox`), three backends: ``local`` (the default, a
fresh process with rlimits and namespaces, :mod:`.local`), ``docker``
(``--network none``, read-only root, :mod:`.docker`) and ``k8s`` (a Job with
egress denied, :mod:`.k8s`). :func:`make_sandbox` picks one by name; each
module states what it covers and what it does not.
"""

from __future__ import annotations

from typing import Any

from envloop_pipelines.core.sandbox.base import (
    BACKENDS,
    RESULT_FD_ENV,
    SANDBOX_STATUSES,
    Sandbox,
    SandboxLimits,
    SandboxResult,
    SandboxStatus,
    setup_error,
)
from envloop_pipelines.core.sandbox.local import HostSupport, LocalSandbox, probe_host


def make_sandbox(backend: str = "local", *, limits: SandboxLimits | None = None, **options: Any) -> Sandbox:
    """The sandbox backend named ``backend``, built with ``options``.

    Args:
        backend: ``local``, ``docker`` or ``k8s``.
        limits: default limits of its runs.
        **options: backend options (see :class:`LocalSandbox`, :class:`~.docker.DockerSandbox`,
            :class:`~.k8s.KubernetesSandbox`).

    Raises:
        ValueError: for an unknown backend, naming the allowed ones.
    """
    if backend == "local":
        return LocalSandbox(limits, **options)
    if backend == "docker":
        from envloop_pipelines.core.sandbox.docker import DockerSandbox

        return DockerSandbox(limits, **options)
    if backend == "k8s":
        from envloop_pipelines.core.sandbox.k8s import KubernetesSandbox

        return KubernetesSandbox(limits, **options)
    raise ValueError(f"unknown sandbox backend {backend!r}; allowed: {', '.join(BACKENDS)}")


__all__ = [
    "BACKENDS",
    "HostSupport",
    "LocalSandbox",
    "RESULT_FD_ENV",
    "SANDBOX_STATUSES",
    "Sandbox",
    "SandboxLimits",
    "SandboxResult",
    "SandboxStatus",
    "make_sandbox",
    "probe_host",
    "setup_error",
]
