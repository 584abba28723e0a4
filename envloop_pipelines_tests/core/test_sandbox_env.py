"""A deployment picks its verifier sandbox through ENVLOOP_SANDBOX* (the Kubernetes values set k8s)."""

from __future__ import annotations

import pytest

from envloop_pipelines.core.sandbox import LocalSandbox, sandbox_from_env
from envloop_pipelines.core.sandbox.k8s import KubernetesSandbox
from envloop_pipelines.core.verify.runner import VerifierRunner


def test_local_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ENVLOOP_SANDBOX", raising=False)
    assert isinstance(sandbox_from_env(), LocalSandbox)
    assert VerifierRunner().sandbox.backend == "local"


def test_k8s_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENVLOOP_SANDBOX", "k8s")
    monkeypatch.setenv("ENVLOOP_SANDBOX_IMAGE", "registry.example.com/envloop/envloop-pipelines:0.1.0")
    monkeypatch.setenv("ENVLOOP_SANDBOX_NAMESPACE", "team-a-sandbox")
    monkeypatch.setenv("ENVLOOP_SANDBOX_POLICY_ENFORCED", "1")
    runner = VerifierRunner()
    sandbox = runner.sandbox
    assert isinstance(sandbox, KubernetesSandbox)
    caps = sandbox.capabilities()
    assert caps["namespace"] == "team-a-sandbox" and caps["network_isolated"] is True
    assert caps["image"] == "registry.example.com/envloop/envloop-pipelines:0.1.0"
    assert runner.python == "python"  # the image's interpreter, not this host's


def test_an_unknown_backend_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENVLOOP_SANDBOX", "firecracker")
    with pytest.raises(ValueError, match="ENVLOOP_SANDBOX='firecracker'.*allowed: local, docker, k8s"):
        sandbox_from_env()
