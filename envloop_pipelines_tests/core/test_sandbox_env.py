"""The verifier's sandbox is a value handed down to core (``SandboxSettings``); core never reads ``ENVLOOP_SANDBOX*``.

The deployment's variables are read by its sandbox resource when a run uses it
(``envloop_pipelines_tests/resources/test_sandbox.py``); the Kubernetes values set k8s.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import pytest

import envloop_pipelines.core as core
from envloop_pipelines.core.decision_loop.synthesis import GENERATOR_LIMITS, SandboxedGenerator, SandboxRefusedError
from envloop_pipelines.core.sandbox import LocalSandbox, SandboxSettings, make_sandbox
from envloop_pipelines.core.sandbox.k8s import KubernetesSandbox
from envloop_pipelines.core.verify.labels import read_hidden_labels
from envloop_pipelines.core.verify.protocol import write_predictions
from envloop_pipelines.core.verify.runner import VerifierRunner, verify_task

from .test_verifier_doors import LABEL_LOG, TASK, SpySandbox, _home, label_reads, oracle

#: The deployment's variables, set to a backend other than the default: core must not pick them up.
DEPLOYMENT_ENV = {"ENVLOOP_SANDBOX": "docker", "ENVLOOP_SANDBOX_IMAGE": "spy:latest",
                  "ENVLOOP_SANDBOX_NAMESPACE": "elsewhere", "ENVLOOP_SANDBOX_POLICY_ENFORCED": "1"}


@pytest.fixture
def deployment_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in DEPLOYMENT_ENV.items():
        monkeypatch.setenv(name, value)


@pytest.mark.usefixtures("deployment_env")
def test_local_is_the_default_whatever_the_environment_says() -> None:
    assert isinstance(make_sandbox(SandboxSettings()), LocalSandbox)
    for runner in (VerifierRunner(), VerifierRunner(SandboxSettings())):
        assert isinstance(runner.sandbox, LocalSandbox) and runner.python == sys.executable


@pytest.mark.usefixtures("deployment_env")
def test_a_user_generator_runs_in_the_sandbox_it_is_handed() -> None:
    for handed in (None, SandboxSettings()):
        generator = object.__new__(SandboxedGenerator)  # its sandbox only: constructing it runs the generator
        generator.spec, generator._sandbox = "user:Generator", handed
        try:
            box = generator._sandbox_for_run()
        except SandboxRefusedError as exc:  # a host where the local sandbox cannot switch uid
            assert "this host's local sandbox" in str(exc)
        else:
            assert isinstance(box, LocalSandbox) and box.limits.wall_s == GENERATOR_LIMITS["wall_s"]


def test_k8s_from_settings() -> None:
    settings = SandboxSettings(backend="k8s", image="registry.example.com/envloop/envloop-pipelines:0.1.0",
                               namespace="team-a-sandbox", policy_enforced=True)
    runner = VerifierRunner(settings)
    sandbox = runner.sandbox
    assert isinstance(sandbox, KubernetesSandbox)
    caps = sandbox.capabilities()
    assert caps["namespace"] == "team-a-sandbox" and caps["network_isolated"] is True
    assert caps["image"] == "registry.example.com/envloop/envloop-pipelines:0.1.0"
    assert runner.python == "python"  # the image's interpreter, not this host's
    assert SandboxSettings(backend="local", image="ignored", namespace="ignored").options() == {}


def test_an_unknown_backend_is_named() -> None:
    with pytest.raises(ValueError, match="backend='firecracker' is not a sandbox backend; allowed: local, docker, k8s"):
        SandboxSettings(backend="firecracker")
    with pytest.raises(TypeError, match="policy_enforced must be True or False"):
        SandboxSettings(backend="k8s", policy_enforced="1")  # type: ignore[arg-type]


def test_no_core_module_names_the_sandbox_variables() -> None:
    root = Path(core.__file__).parent
    offenders = [str(p.relative_to(root)) for p in sorted(root.rglob("*.py"))
                 if "ENVLOOP_SANDBOX" in p.read_text(encoding="utf-8")]
    assert offenders == [], f"core reads the deployment's sandbox variables: {offenders}"


class ForgedSettings(SandboxSettings):
    """Settings whose options would hand a backend an object of the caller's (a docker client that keeps stdin)."""

    def options(self) -> dict[str, Any]:
        return {**super().options(), "client": object()}


@pytest.mark.usefixtures("deployment_env")
def test_hidden_splits_take_settings_never_a_sandbox_object(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LABEL_LOG)
    home = _home(tmp_path)
    path = write_predictions(tmp_path / "t.jsonl", oracle(read_hidden_labels(TASK, "test", home=home)))
    caplog.clear()
    box = SpySandbox()
    for split in ("test", "holdout"):
        for given in (box, ForgedSettings(backend="docker")):
            with pytest.raises(TypeError, match="sandbox: the deployment's SandboxSettings"):
                verify_task(TASK, split, path, home=home, sandbox=given, release=1 if split == "holdout" else None)
    assert box.stdin == [] and label_reads(caplog) == 0
    assert not (home / "loops" / TASK / "ledger.jsonl").exists()  # a refusal writes nothing
    # The deployment's settings, handed down: the verifier's own runner scores test there (local here, whatever
    # ENVLOOP_SANDBOX says).
    run = verify_task(TASK, "test", path, home=home, sandbox=SandboxSettings())
    assert run.ok and run.sandbox.backend == "local"
