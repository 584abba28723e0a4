"""The deployment's sandbox: where the verifier's workers and user generators run.

``SandboxResource`` hands the core a :class:`~envloop_pipelines.core.sandbox.SandboxSettings` value;
the core builds its sandbox from it and never reads the environment. A field left unset is read
from the deployment's ``ENVLOOP_SANDBOX*`` variable when a run uses the resource (never at import),
else the local backend's default. The Kubernetes values set ``ENVLOOP_SANDBOX=k8s``
(``k8s/dagster/values.yaml``), so a round's verifier runs as a Job in the sandbox namespace.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import dagster as dg
import pydantic

from envloop_pipelines.core.sandbox import BACKENDS, SandboxSettings

#: The deployment-facing names of the sandbox's settings (one variable per field of ``SandboxSettings``).
SANDBOX_ENV = "ENVLOOP_SANDBOX"  # local (default) | docker | k8s
SANDBOX_IMAGE_ENV = "ENVLOOP_SANDBOX_IMAGE"  # docker/k8s: the image the worker runs in (has this package)
SANDBOX_NAMESPACE_ENV = "ENVLOOP_SANDBOX_NAMESPACE"  # k8s: the sandbox namespace (k8s/verifier.yaml)
SANDBOX_POLICY_ENV = "ENVLOOP_SANDBOX_POLICY_ENFORCED"  # k8s: "1" when the CNI enforces NetworkPolicies
SANDBOX_ENVS = {"backend": SANDBOX_ENV, "image": SANDBOX_IMAGE_ENV, "namespace": SANDBOX_NAMESPACE_ENV,
                "policy_enforced": SANDBOX_POLICY_ENV}


def sandbox_settings_from_env(environ: Mapping[str, str]) -> dict[str, Any]:
    """The sandbox settings given as ``ENVLOOP_SANDBOX*`` variables (``SandboxSettings`` names; unset ones left out).

    Raises:
        ValueError: an unknown backend, naming the variable and the allowed values.
    """
    out: dict[str, Any] = {}
    backend = (environ.get(SANDBOX_ENV) or "").strip().lower()
    if backend:
        if backend not in BACKENDS:
            raise ValueError(f"{SANDBOX_ENV}={backend!r} is not a sandbox backend; allowed: {', '.join(BACKENDS)}")
        out["backend"] = backend
    for name in ("image", "namespace"):
        if environ.get(SANDBOX_ENVS[name]):
            out[name] = environ[SANDBOX_ENVS[name]]
    if environ.get(SANDBOX_POLICY_ENV):
        out["policy_enforced"] = environ[SANDBOX_POLICY_ENV].strip() == "1"
    return out


class SandboxResource(dg.ConfigurableResource):
    """The deployment's sandbox (verifier workers, user generators). Unset: ``ENVLOOP_SANDBOX*`` at run time, else local."""

    backend: str | None = pydantic.Field(
        default=None, description=f"local, docker or k8s. Unset: ${SANDBOX_ENV} when a run uses it, else local.")
    image: str | None = pydantic.Field(
        default=None, description=f"docker/k8s: the worker's image. Unset: ${SANDBOX_IMAGE_ENV}, else the backend's.")
    namespace: str | None = pydantic.Field(
        default=None, description=f"k8s: the sandbox namespace. Unset: ${SANDBOX_NAMESPACE_ENV}, else the backend's.")
    policy_enforced: bool | None = pydantic.Field(
        default=None, description=f"k8s: the CNI enforces NetworkPolicies. Unset: ${SANDBOX_POLICY_ENV}=1, else false.")

    def settings(self) -> SandboxSettings:
        """The sandbox as the core's value: the fields set here, the rest from ``ENVLOOP_SANDBOX*`` now, else defaults.

        Raises:
            ValueError: a bad backend, naming the variable (or the field) and the allowed values.
        """
        given = {name: getattr(self, name) for name in SANDBOX_ENVS if getattr(self, name) is not None}
        unset = {var for name, var in SANDBOX_ENVS.items() if name not in given}
        return SandboxSettings(**sandbox_settings_from_env({k: v for k, v in os.environ.items() if k in unset}), **given)


__all__ = ["SANDBOX_ENV", "SANDBOX_ENVS", "SANDBOX_IMAGE_ENV", "SANDBOX_NAMESPACE_ENV", "SANDBOX_POLICY_ENV",
           "SandboxResource", "sandbox_settings_from_env"]
