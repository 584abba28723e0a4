"""The Kubernetes sandbox backend: one Job per run, egress denied by a NetworkPolicy.

:func:`job_manifest` and :func:`deny_egress_policy` build the two manifests as
plain dicts (reviewable, testable without a cluster);
:class:`KubernetesSandbox` applies them with the ``kubernetes`` client behind
the same :class:`~envloop_pipelines.core.sandbox.base.Sandbox` protocol.
:func:`namespace_manifest` and :func:`runner_rbac` build the namespace (Pod
Security Admission ``restricted``) and the Role the runner needs; ``k8s/verifier.yaml``
is generated from these functions (:mod:`.k8s_manifests`).

Threat model
============

Covered: a fresh pod per run (``restartPolicy: Never``, ``backoffLimit: 0``),
non-root (``runAsUser: 65534``, ``runAsNonRoot``), no privilege escalation,
every capability dropped, the runtime's default seccomp profile, a read-only
root filesystem, no service-account token and no service links, memory / CPU /
ephemeral-storage limits, size-limited ``emptyDir`` volumes for ``/work`` and
``/tmp``, ``activeDeadlineSeconds`` as the wall limit, and a NetworkPolicy
that selects the sandbox pods and allows **no egress** (and no ingress).
Inputs (stdin and files) travel in a Secret mounted read-only into that pod
only; nothing of the verifier's label store is mounted.

The runner reads the deny-all policy and creates it only when it is missing;
the Role of ``k8s/verifier.yaml`` grants ``get`` on that one policy and no
``create``, so on a cluster the policy is applied by the operator and a runner
cannot replace it (a missing policy fails the run: ``forbidden``).

Not covered: a NetworkPolicy is enforced only by a CNI that implements it
(Calico, Cilium, ...); the backend cannot see that, so it reports
``network_isolated: false`` unless the operator sets ``policy_enforced=True``.
Kubernetes has no CPU-seconds or per-process file-size limit (CPU is a rate,
the pids limit is the kubelet's ``podPidsLimit``). Pod logs merge stdout and
stderr, so the wrapper writes them to files and prints them between markers;
a command that prints the marker itself can confuse the split (the verifier
worker does not). Inputs are limited by the Secret size (1 MiB).
"""

from __future__ import annotations

import base64
import logging
import math
import re
import time
import uuid
from pathlib import Path
from typing import Any, Mapping, Sequence

from envloop_pipelines.core.sandbox.base import (
    RESULT_FD_ENV,
    SandboxCall,
    SandboxLimits,
    SandboxResult,
    classify,
    setup_error,
)

log = logging.getLogger(__name__)

SANDBOX_LABEL = "envloop.io/sandbox"
#: A namespace of its own: Pod Security Admission ``restricted`` there would refuse Dagster's own pods.
DEFAULT_NAMESPACE = "envloop-sandbox"
DENY_POLICY_NAME = "envloop-sandbox-deny-all"
DEFAULT_IMAGE = "python:3.11-slim"
#: Kubernetes refuses Secrets over 1 MiB (etcd's value limit).
MAX_INPUT_BYTES = 1024 * 1024
_OUT_MARK = "----envloop-sandbox-stdout----"
_ERR_MARK = "----envloop-sandbox-stderr----"
_RC_MARK = "----envloop-sandbox-exit----"
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def _check_name(name: str, what: str) -> None:
    if not _NAME.match(name) or len(name) > 63:
        raise ValueError(f"{what} {name!r} must be a DNS-1123 label (lowercase letters, digits, '-', at most 63 characters)")


def deny_egress_policy(namespace: str = DEFAULT_NAMESPACE, *, name: str = DENY_POLICY_NAME) -> dict[str, Any]:
    """A NetworkPolicy that allows sandbox pods no egress and no ingress at all (not even DNS)."""
    _check_name(namespace, "namespace")
    _check_name(name, "policy name")
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": name, "namespace": namespace, "labels": {SANDBOX_LABEL: "true"}},
        "spec": {
            "podSelector": {"matchLabels": {SANDBOX_LABEL: "true"}},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [],  # empty lists: nothing is allowed
            "egress": [],
        },
    }


def namespace_manifest(namespace: str = DEFAULT_NAMESPACE) -> dict[str, Any]:
    """The sandbox namespace, with Pod Security Admission ``restricted`` enforced, audited and warned."""
    _check_name(namespace, "namespace")
    psa = {f"pod-security.kubernetes.io/{mode}": "restricted" for mode in ("enforce", "audit", "warn")}
    psa["pod-security.kubernetes.io/enforce-version"] = "latest"
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace, "labels": {SANDBOX_LABEL: "true", **psa}}}


def runner_rbac(
    namespace: str = DEFAULT_NAMESPACE,
    *,
    service_account: str,
    service_account_namespace: str,
    name: str = "envloop-sandbox-runner",
) -> list[dict[str, Any]]:
    """A Role with exactly the calls :meth:`KubernetesSandbox.run` makes, bound to the runner's service account.

    Args:
        namespace: the sandbox namespace.
        service_account: the service account of the pods that run the sandbox (Dagster's run and step pods).
        service_account_namespace: its namespace.
        name: the Role and RoleBinding name.
    """
    for value, what in ((namespace, "namespace"), (service_account, "service account"),
                        (service_account_namespace, "service account namespace"), (name, "role name")):
        _check_name(value, what)
    rules = [
        {"apiGroups": ["batch"], "resources": ["jobs"], "verbs": ["create", "delete"]},
        {"apiGroups": ["batch"], "resources": ["jobs/status"], "verbs": ["get"]},
        {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create", "delete"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]},
        {"apiGroups": [""], "resources": ["pods/log"], "verbs": ["get"]},
        {"apiGroups": ["networking.k8s.io"], "resources": ["networkpolicies"], "verbs": ["get"],
         "resourceNames": [DENY_POLICY_NAME]},
    ]
    def meta() -> dict[str, Any]:
        return {"name": name, "namespace": namespace, "labels": {SANDBOX_LABEL: "true"}}

    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": meta(), "rules": rules}
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": meta(),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": service_account, "namespace": service_account_namespace}],
    }
    return [role, binding]


def _wrapped(argv: Sequence[str], has_stdin: bool, has_files: bool) -> list[str]:
    """``sh -c`` wrapper: copy inputs into /work, run, print stdout/stderr/exit code between markers."""
    script = ""
    if has_files:
        script += "cp -R /input/files/. /work/ || exit 90; "
    redirect = "< /input/stdin" if has_stdin else "< /dev/null"
    script += (
        f'"$@" {redirect} > /tmp/.stdout 2> /tmp/.stderr; rc=$?; '
        f"echo {_OUT_MARK}; cat /tmp/.stdout; echo; echo {_ERR_MARK}; cat /tmp/.stderr; echo; echo {_RC_MARK} $rc; exit $rc"
    )
    return ["/bin/sh", "-c", script, "envloop-sandbox", *argv]


def job_manifest(
    name: str,
    argv: Sequence[str],
    *,
    image: str = DEFAULT_IMAGE,
    limits: SandboxLimits | None = None,
    namespace: str = DEFAULT_NAMESPACE,
    env: Mapping[str, str] | None = None,
    input_secret: str | None = None,
    input_files: Sequence[str] = (),
    has_stdin: bool = False,
    cpus: float = 1.0,
    uid: int = 65534,
    ttl_s: int = 300,
) -> dict[str, Any]:
    """The Job that runs ``argv`` once under ``limits``, as a manifest dict.

    Args:
        name: the Job name (DNS-1123 label).
        argv: the command.
        image: the container image.
        limits: memory (limit and request), wall (``activeDeadlineSeconds``), file size (the
            ``/work`` and ``/tmp`` size limits and ephemeral storage).
        namespace: the namespace (the deny-all policy must exist there).
        env: environment variables (nothing else is set).
        input_secret: the Secret holding ``stdin`` and ``file-<i>`` keys, mounted at ``/input``.
        input_files: relative paths of the files, in the order of their ``file-<i>`` keys.
        has_stdin: the Secret has a ``stdin`` key to feed the command.
        cpus: the CPU limit (a rate, not seconds).
        uid: the non-root uid (and gid, fsGroup).
        ttl_s: seconds the finished Job is kept before the cluster deletes it.
    """
    _check_name(name, "job name")
    _check_name(namespace, "namespace")
    if uid == 0:
        raise ValueError("uid must not be 0: the sandbox pod runs as non-root")
    limits = limits or SandboxLimits()
    mem = f"{limits.mem_mb}Mi"
    scratch = f"{limits.fsize_mb}Mi"
    volumes: list[dict[str, Any]] = [
        {"name": "work", "emptyDir": {"sizeLimit": scratch}},
        {"name": "tmp", "emptyDir": {"medium": "Memory", "sizeLimit": f"{max(16, limits.fsize_mb * 2)}Mi"}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "work", "mountPath": "/work"},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    if input_secret:
        items = ([{"key": "stdin", "path": "stdin"}] if has_stdin else []) + [
            {"key": f"file-{i}", "path": f"files/{rel}"} for i, rel in enumerate(input_files)
        ]
        volumes.append({"name": "input", "secret": {"secretName": input_secret, "defaultMode": 0o444, "items": items}})
        mounts.append({"name": "input", "mountPath": "/input", "readOnly": True})
    container = {
        "name": "sandbox",
        "image": image,
        "command": _wrapped(argv, has_stdin, bool(input_files)),
        "workingDir": "/work",
        "env": [{"name": k, "value": v} for k, v in (env or {}).items()],
        "resources": {
            "limits": {"cpu": str(cpus), "memory": mem, "ephemeral-storage": f"{limits.fsize_mb * 4}Mi"},
            "requests": {"cpu": str(min(cpus, 0.1)), "memory": mem},
        },
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "runAsUser": uid,
            "runAsGroup": uid,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "volumeMounts": mounts,
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": namespace, "labels": {SANDBOX_LABEL: "true"}},
        "spec": {
            "backoffLimit": 0,
            "activeDeadlineSeconds": max(1, math.ceil(limits.wall_s)),
            "ttlSecondsAfterFinished": ttl_s,
            "template": {
                "metadata": {"labels": {SANDBOX_LABEL: "true", "job-name": name}},
                "spec": {
                    "restartPolicy": "Never",
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    "securityContext": {"runAsNonRoot": True, "runAsUser": uid, "runAsGroup": uid, "fsGroup": uid,
                                        "seccompProfile": {"type": "RuntimeDefault"}},
                    "containers": [container],
                    "volumes": volumes,
                },
            },
        },
    }


def input_secret_manifest(name: str, namespace: str, stdin: bytes | None, files: Mapping[str, bytes]) -> dict[str, Any]:
    """The Secret carrying a run's inputs (``stdin``, ``file-<i>``)."""
    data = {} if stdin is None else {"stdin": base64.b64encode(stdin).decode()}
    for i, (rel, content) in enumerate(files.items()):
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            raise ValueError(f"file name {rel!r} must be a relative path inside the working directory")
        data[f"file-{i}"] = base64.b64encode(content).decode()
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": name, "namespace": namespace, "labels": {SANDBOX_LABEL: "true"}}, "data": data}


def split_logs(logs: str) -> tuple[str, str, int | None]:
    """stdout, stderr and the exit code from the wrapper's marked log."""
    out_at, err_at, rc_at = logs.rfind(_OUT_MARK), logs.rfind(_ERR_MARK), logs.rfind(_RC_MARK)
    if min(out_at, err_at, rc_at) < 0:
        return "", logs, None
    stdout = logs[out_at + len(_OUT_MARK) + 1 : err_at].removesuffix("\n")
    stderr = logs[err_at + len(_ERR_MARK) + 1 : rc_at].removesuffix("\n")
    try:
        rc = int(logs[rc_at + len(_RC_MARK):].split()[0])
    except (IndexError, ValueError):
        rc = None
    return stdout, stderr, rc


class KubernetesSandbox:
    """Runs commands as Kubernetes Jobs with egress denied (see the threat model above).

    Args:
        limits: default limits.
        image: the container image.
        namespace: where Jobs, Secrets and the NetworkPolicy go.
        policy_enforced: the operator states that the cluster's CNI enforces NetworkPolicies.
        api_client: a ``kubernetes.client.ApiClient`` (default: in-cluster config, else kubeconfig).
        cpus: the CPU limit of a pod.
        poll_s: how often the Job's status is read.
    """

    backend = "k8s"

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        *,
        image: str = DEFAULT_IMAGE,
        namespace: str = DEFAULT_NAMESPACE,
        policy_enforced: bool = False,
        api_client: Any = None,
        cpus: float = 1.0,
        poll_s: float = 1.0,
    ) -> None:
        _check_name(namespace, "namespace")
        self.limits = limits or SandboxLimits()
        self.image, self.namespace, self.policy_enforced = image, namespace, policy_enforced
        self._api_client = api_client
        self.cpus, self.poll_s = cpus, poll_s

    def _api(self) -> Any:
        if self._api_client is None:
            from kubernetes import client, config

            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            self._api_client = client.ApiClient()
        return self._api_client

    def job_for(
        self,
        name: str,
        argv: Sequence[str],
        *,
        limits: SandboxLimits | None = None,
        env: Mapping[str, str] | None = None,
        input_secret: str | None = None,
        input_files: Sequence[str] = (),
        has_stdin: bool = False,
        result_channel: bool = False,
    ) -> dict[str, Any]:
        """The Job manifest :meth:`run` creates for ``argv`` (its environment: ``HOME``, ``TMPDIR``, ``LANG``, ``env``)."""
        full_env = {"HOME": "/work", "TMPDIR": "/tmp", "LANG": "C.UTF-8", **dict(env or {})}
        if result_channel:
            full_env[RESULT_FD_ENV] = "1"
        return job_manifest(name, argv, image=self.image, limits=limits or self.limits, namespace=self.namespace,
                            env=full_env, input_secret=input_secret, input_files=input_files, has_stdin=has_stdin,
                            cpus=self.cpus)

    def capabilities(self) -> dict[str, Any]:
        return {"backend": self.backend, "namespace": self.namespace, "network_isolated": self.policy_enforced,
                "hidden_paths_masked": True, "image": self.image}

    def run(self, argv: Sequence[str], call: SandboxCall | None = None) -> SandboxResult:
        """Run ``argv`` as a Job; ``workdir`` state does not come back (terminal checks use local or docker).

        ``call.hidden_paths``, ``conceal``, ``binds`` and ``cwd`` need nothing here: no host path is mounted
        into the pod.
        """
        call = call or SandboxCall()
        limits = call.limits or self.limits
        net = self.policy_enforced
        stdin, env, result_channel = call.stdin, call.env, call.result_channel
        if not argv:
            return setup_error(self.backend, "empty command", limits)
        if call.workdir is not None:
            return setup_error(self.backend, "the k8s backend does not return a working directory's state", limits)
        files = dict(call.files)
        if len(stdin or b"") + sum(len(v) for v in files.values()) > MAX_INPUT_BYTES * 3 // 4:  # base64 grows 4/3
            return setup_error(self.backend, f"inputs over the Secret limit of {MAX_INPUT_BYTES} bytes", limits)
        try:
            from kubernetes import client
            from kubernetes.client.rest import ApiException

            api = self._api()
        except Exception as exc:  # no client config, no cluster
            return setup_error(self.backend, f"no cluster: {type(exc).__name__}: {exc}", limits)
        core, batch, netapi = client.CoreV1Api(api), client.BatchV1Api(api), client.NetworkingV1Api(api)
        name = f"envloop-sb-{uuid.uuid4().hex[:12]}"
        started = time.monotonic()
        timed_out = False
        try:
            try:  # read first: on a cluster the operator applies the policy and the runner may only read it
                netapi.read_namespaced_network_policy(DENY_POLICY_NAME, self.namespace)
            except ApiException as exc:
                if exc.status != 404:
                    raise
                try:
                    netapi.create_namespaced_network_policy(self.namespace, deny_egress_policy(self.namespace))
                except ApiException as exc2:
                    if exc2.status != 409:  # 409: created meanwhile by another run
                        raise
            secret = None
            if stdin is not None or files:
                secret = name
                core.create_namespaced_secret(self.namespace, input_secret_manifest(name, self.namespace, stdin, files))
            batch.create_namespaced_job(self.namespace, self.job_for(
                name, argv, limits=limits, env=env, input_secret=secret, input_files=list(files),
                has_stdin=stdin is not None, result_channel=result_channel))
            deadline = started + limits.wall_s + 120  # scheduling and image pulls come on top of the Job's own deadline
            while True:
                status = batch.read_namespaced_job_status(name, self.namespace).status
                if status.succeeded or status.failed:
                    timed_out = any(c.reason == "DeadlineExceeded" for c in (status.conditions or []))
                    break
                if time.monotonic() > deadline:
                    timed_out = True
                    break
                time.sleep(self.poll_s)
            pods = core.list_namespaced_pod(self.namespace, label_selector=f"job-name={name}").items
            logs, term = "", None
            if pods:
                pod = pods[0]
                try:
                    logs = core.read_namespaced_pod_log(pod.metadata.name, self.namespace)
                except ApiException:
                    logs = ""
                for cs in pod.status.container_statuses or []:
                    if cs.state and cs.state.terminated:
                        term = cs.state.terminated
        except Exception as exc:
            return setup_error(self.backend, f"{type(exc).__name__}: {exc}", limits)
        finally:
            for delete in (lambda: batch.delete_namespaced_job(name, self.namespace, propagation_policy="Background"),
                           lambda: core.delete_namespaced_secret(name, self.namespace)):
                try:
                    delete()
                except Exception:  # already gone, or never created
                    pass
        wall = time.monotonic() - started
        stdout, stderr, rc = split_logs(logs)
        exit_code = rc if rc is not None else (term.exit_code if term is not None else None)
        sig = None
        if exit_code is not None and 128 < exit_code < 128 + 65:
            exit_code, sig = None, exit_code - 128
        if term is not None and term.reason == "OOMKilled":
            status_word, detail = "memory_exceeded", f"OOM-killed at {limits.mem_mb} MiB"
        else:
            status_word, detail = classify(exit_code=exit_code, sig=sig, cpu_s=0.0, limits=limits, timed_out=timed_out,
                                           stderr=stderr, stdout=stdout)
        tail = limits.tail_bytes
        return SandboxResult(
            ok=status_word == "ok", exit_code=exit_code, signal=sig, status=status_word, wall_s=round(wall, 4), cpu_s=0.0,
            stdout_tail=stdout[-tail:], stderr_tail=stderr[-tail:], network_isolated=net, backend=self.backend, pid=0,
            hidden_paths_masked=True, uid=65534, detail=f"{detail} (k8s reports no CPU seconds)",
            channel=stdout if result_channel else None, stdout_bytes=len(stdout.encode()), stderr_bytes=len(stderr.encode()),
            limits=limits.to_dict(),
        )


__all__ = ["DEFAULT_NAMESPACE", "DENY_POLICY_NAME", "KubernetesSandbox", "SANDBOX_LABEL", "deny_egress_policy",
           "input_secret_manifest", "job_manifest", "namespace_manifest", "runner_rbac", "split_logs"]
