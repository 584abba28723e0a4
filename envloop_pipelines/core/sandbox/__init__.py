"""The sandbox: run untrusted or verifier code in a fresh, limited, isolated process.

One protocol (:class:`Sandbox`), three backends: ``local`` (the default, a
fresh process with rlimits and namespaces, :mod:`.local`), ``docker``
(``--network none``, read-only root, :mod:`.docker`) and ``k8s`` (a Job with
egress denied, :mod:`.k8s`). :func:`make_sandbox` picks one by name; each
module states what it covers and what it does not.
"""

from __future__ import annotations

import os
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


#: Environment of a deployment's verifier sandbox (read when a verifier runner is built, never at import).
SANDBOX_ENV = "ENVLOOP_SANDBOX"  # local (default) | docker | k8s
SANDBOX_IMAGE_ENV = "ENVLOOP_SANDBOX_IMAGE"  # docker/k8s: the image the worker runs in (has this package)
SANDBOX_NAMESPACE_ENV = "ENVLOOP_SANDBOX_NAMESPACE"  # k8s: the sandbox namespace (k8s/verifier.yaml)
SANDBOX_POLICY_ENV = "ENVLOOP_SANDBOX_POLICY_ENFORCED"  # k8s: "1" when the CNI enforces NetworkPolicies


def sandbox_from_env(*, limits: SandboxLimits | None = None) -> Sandbox:
    """The sandbox a deployment configured through ``ENVLOOP_SANDBOX*`` (the local backend when unset).

    On Kubernetes the values set ``ENVLOOP_SANDBOX=k8s``, so every verifier run of a round is a Job in the
    sandbox namespace with egress denied, not a process inside the step's own pod.

    Raises:
        ValueError: an unknown backend, naming the variable and the allowed values.
    """
    backend = (os.environ.get(SANDBOX_ENV) or "local").strip().lower()
    if backend not in BACKENDS:
        raise ValueError(f"{SANDBOX_ENV}={backend!r} is not a sandbox backend; allowed: {', '.join(BACKENDS)}")
    options: dict[str, Any] = {}
    if backend in ("docker", "k8s") and os.environ.get(SANDBOX_IMAGE_ENV):
        options["image"] = os.environ[SANDBOX_IMAGE_ENV]
    if backend == "k8s":
        if os.environ.get(SANDBOX_NAMESPACE_ENV):
            options["namespace"] = os.environ[SANDBOX_NAMESPACE_ENV]
        options["policy_enforced"] = os.environ.get(SANDBOX_POLICY_ENV, "0") == "1"
    return make_sandbox(backend, limits=limits, **options)


__all__ = [
    "BACKENDS",
    "HostSupport",
    "LocalSandbox",
    "RESULT_FD_ENV",
    "SANDBOX_STATUSES",
    "SANDBOX_ENV",
    "Sandbox",
    "SandboxLimits",
    "SandboxResult",
    "SandboxStatus",
    "make_sandbox",
    "probe_host",
    "sandbox_from_env",
    "setup_error",
]
