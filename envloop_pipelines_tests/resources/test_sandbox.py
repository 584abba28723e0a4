"""A deployment picks its verifier sandbox through ENVLOOP_SANDBOX*, read by its sandbox resource when a run uses it."""

from __future__ import annotations

import pytest

from envloop_pipelines.core.sandbox import SandboxSettings
from envloop_pipelines.core.sandbox.k8s import KubernetesSandbox
from envloop_pipelines.core.verify.runner import VerifierRunner
from envloop_pipelines.resources.sandbox import SANDBOX_ENVS, SandboxResource, sandbox_settings_from_env

K8S_ENV = {"ENVLOOP_SANDBOX": "k8s", "ENVLOOP_SANDBOX_IMAGE": "registry.example.com/envloop/envloop-pipelines:0.1.0",
           "ENVLOOP_SANDBOX_NAMESPACE": "team-a-sandbox", "ENVLOOP_SANDBOX_POLICY_ENFORCED": "1"}


@pytest.fixture(autouse=True)
def no_sandbox_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in SANDBOX_ENVS.values():
        monkeypatch.delenv(name, raising=False)


def test_local_is_the_default() -> None:
    assert SandboxResource().settings() == SandboxSettings()
    assert VerifierRunner(SandboxResource().settings()).sandbox.backend == "local"


def test_k8s_from_the_environment_when_the_resource_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    resource = SandboxResource()  # built before the variables are set, as definitions.py builds it at import
    for name, value in K8S_ENV.items():
        monkeypatch.setenv(name, value)
    settings = resource.settings()
    assert settings == SandboxSettings(backend="k8s", image=K8S_ENV["ENVLOOP_SANDBOX_IMAGE"],
                                       namespace="team-a-sandbox", policy_enforced=True)
    runner = VerifierRunner(settings)
    assert isinstance(runner.sandbox, KubernetesSandbox)
    caps = runner.sandbox.capabilities()
    assert caps["namespace"] == "team-a-sandbox" and caps["network_isolated"] is True
    assert caps["image"] == K8S_ENV["ENVLOOP_SANDBOX_IMAGE"] and runner.python == "python"


def test_a_field_set_on_the_resource_wins_over_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in K8S_ENV.items():
        monkeypatch.setenv(name, value)
    assert SandboxResource(namespace="mine", policy_enforced=False).settings() == SandboxSettings(
        backend="k8s", image=K8S_ENV["ENVLOOP_SANDBOX_IMAGE"], namespace="mine", policy_enforced=False)
    monkeypatch.setenv("ENVLOOP_SANDBOX", "firecracker")  # not read: the field is set
    assert SandboxResource(backend="local").settings().backend == "local"


def test_an_unknown_backend_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENVLOOP_SANDBOX", "firecracker")
    resource = SandboxResource()  # building it reads nothing
    with pytest.raises(ValueError, match="ENVLOOP_SANDBOX='firecracker'.*allowed: local, docker, k8s"):
        resource.settings()
    with pytest.raises(ValueError, match="backend='docker ' is not a sandbox backend"):
        SandboxResource(backend="docker ").settings()
    assert sandbox_settings_from_env({"ENVLOOP_SANDBOX": " Docker "}) == {"backend": "docker"}
    assert sandbox_settings_from_env({"ENVLOOP_SANDBOX_POLICY_ENFORCED": "0"}) == {"policy_enforced": False}
