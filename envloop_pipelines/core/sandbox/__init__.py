"""The sandbox: run untrusted or verifier code in a fresh, limited, isolated process.

One protocol (:class:`Sandbox`, whose ``run(argv, call)`` takes the run's
options as one :class:`SandboxCall`), three backends: ``local`` (the default,
a fresh process with rlimits and namespaces, :mod:`.local`), ``docker``
(``--network none``, read-only root, :mod:`.docker`) and ``k8s`` (a Job with
egress denied, :mod:`.k8s`). :func:`make_sandbox` picks one by name or by
:class:`SandboxSettings` (the value a deployment's sandbox resource hands
down; core never reads the choice from the environment); each module states
what it covers and what it does not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from envloop_pipelines.core.sandbox.base import (
    BACKENDS,
    RESULT_FD_ENV,
    SANDBOX_STATUSES,
    Sandbox,
    SandboxCall,
    SandboxLimits,
    SandboxResult,
    SandboxStatus,
    setup_error,
)
from envloop_pipelines.core.sandbox.host import HostSupport, probe_host
from envloop_pipelines.core.sandbox.local import LocalSandbox


@dataclass(frozen=True)
class SandboxSettings:
    """Which backend a deployment's sandbox is, and the options it needs: a value, no code.

    The loop's callers hand it down to the verifier and to user generators, which build their own
    sandbox from it (:func:`make_sandbox`); core never reads it from the environment. A deployment
    sets it through its Dagster resource (``resources/sandbox.py``, which reads the deployment's
    environment when a run uses it).

    Attributes:
        backend: ``local`` (the default), ``docker`` or ``k8s``.
        image: docker/k8s: the image the worker runs in (it has this package); ``None``: the backend's default.
        namespace: k8s: the sandbox namespace (``k8s/verifier.yaml``); ``None``: the backend's default.
        policy_enforced: k8s: the cluster's CNI enforces NetworkPolicies (the Job's egress is denied).
    """

    backend: str = "local"
    image: str | None = None
    namespace: str | None = None
    policy_enforced: bool = False

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r} is not a sandbox backend; allowed: {', '.join(BACKENDS)}")
        for name in ("image", "namespace"):
            if not isinstance(getattr(self, name), (str, type(None))):
                raise TypeError(f"{name} must be text or None, got {type(getattr(self, name)).__name__}")
        if not isinstance(self.policy_enforced, bool):
            raise TypeError(f"policy_enforced must be True or False, got {self.policy_enforced!r}")

    def options(self) -> dict[str, Any]:
        """The backend's constructor options these settings give (the image for docker and k8s; the namespace
        and the policy flag for k8s)."""
        options: dict[str, Any] = {}
        if self.backend in ("docker", "k8s") and self.image:
            options["image"] = self.image
        if self.backend == "k8s":
            if self.namespace:
                options["namespace"] = self.namespace
            options["policy_enforced"] = self.policy_enforced
        return options


def make_sandbox(backend: str | SandboxSettings = "local", *, limits: SandboxLimits | None = None,
                 **options: Any) -> Sandbox:
    """The sandbox backend named ``backend`` (or the one ``SandboxSettings`` describe), built with ``options``.

    Args:
        backend: ``local``, ``docker`` or ``k8s``; or :class:`SandboxSettings` (its options first, then ``options``).
        limits: default limits of its runs.
        **options: backend options (see :class:`LocalSandbox`, :class:`~.docker.DockerSandbox`,
            :class:`~.k8s.KubernetesSandbox`).

    Raises:
        ValueError: for an unknown backend, naming the allowed ones.
    """
    if isinstance(backend, SandboxSettings):
        backend, options = backend.backend, {**backend.options(), **options}
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
    "SandboxCall",
    "SandboxLimits",
    "SandboxResult",
    "SandboxSettings",
    "SandboxStatus",
    "make_sandbox",
    "probe_host",
    "setup_error",
]
