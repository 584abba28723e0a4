"""The code location reads its environment when Dagster loads it and when a run uses its resources, never when
``definitions.py`` is imported.

``defs`` is a ``@dg.definitions`` function: loading it turns every ``ENVLOOP_<FIELD>`` then set into the loop's
configured values (what the UI and a remote client read; a bad one stops the load, naming the variable).
``ENVLOOP_<FIELD>`` left unset at load and ``ENVLOOP_SANDBOX*`` are read by the run that uses them; a bad
value fails that run, naming the variable.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from envloop_pipelines.core.loop.config import LoopConfig, env_name, loop_fields
from envloop_pipelines.core.sandbox import SandboxSettings
from envloop_pipelines.resources.loop import DeploymentLoopResource, LoopResource
from envloop_pipelines.resources.sandbox import SANDBOX_ENVS, SandboxResource

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    """No loop or sandbox variable set, and a home of the test's own."""
    for name in [env_name(f.name) for f in loop_fields()] + list(SANDBOX_ENVS.values()):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ENVLOOP_HOME", str(tmp_path / "home"))
    return monkeypatch


def _probe(seen: dict[str, Any]) -> dg.AssetsDefinition:
    @dg.asset
    def probe(loop: LoopResource, sandbox: SandboxResource) -> None:
        seen["loop"], seen["sandbox"] = loop.config(), sandbox.settings()

    return probe


def _run(resources: dict[str, Any], seen: dict[str, Any], **kwargs: Any) -> dg.ExecuteInProcessResult:
    return dg.materialize([_probe(seen)], resources=resources, instance=dg.DagsterInstance.ephemeral(),
                          raise_on_error=False, **kwargs)


def test_a_run_sees_the_environment_as_it_is_when_it_runs(clean_env: pytest.MonkeyPatch) -> None:
    from envloop_pipelines import definitions

    code = definitions.defs()
    resources = {key: code.resources[key] for key in ("loop", "sandbox")}
    assert isinstance(resources["loop"], DeploymentLoopResource) and isinstance(resources["loop"], LoopResource)
    assert code.resources["io_manager"].loop is resources["loop"]
    seen: dict[str, Any] = {}
    assert _run(resources, seen).success
    assert seen["loop"] == LoopConfig.from_settings({"home": os.environ["ENVLOOP_HOME"]})
    assert seen["sandbox"] == SandboxSettings()
    # Set after the import, read by the next run: the loop's settings and the deployment's sandbox.
    clean_env.setenv("ENVLOOP_TASK", "tickets")
    clean_env.setenv("ENVLOOP_NOISE_ARMS", "3")
    clean_env.setenv("ENVLOOP_RECIPE_OVERRIDES", '{"max_steps": 2}')
    clean_env.setenv("ENVLOOP_SANDBOX", "docker")
    clean_env.setenv("ENVLOOP_SANDBOX_IMAGE", "registry.example.com/envloop/envloop-pipelines:0.1.0")
    assert _run(resources, seen).success
    cfg = seen["loop"]
    assert (cfg.task, cfg.noise_arms, dict(cfg.recipe_overrides)) == ("tickets", 3, {"max_steps": 2})
    assert seen["sandbox"] == SandboxSettings(backend="docker", image="registry.example.com/envloop/envloop-pipelines:0.1.0")
    # The IO manager and the sensors read the same resource: the same settings.
    assert code.resources["io_manager"].loop.config() == cfg
    # A setting given in the run's config wins over its variable; the rest still come from the environment.
    assert _run(resources, seen, run_config={"resources": {"loop": {"config": {"noise_arms": 5}},
                                                           "sandbox": {"config": {"backend": "local"}}}}).success
    assert (seen["loop"].task, seen["loop"].noise_arms, seen["sandbox"].backend) == ("tickets", 5, "local")


def test_a_bad_value_fails_the_run_that_reads_it_naming_the_variable(clean_env: pytest.MonkeyPatch) -> None:
    from envloop_pipelines import definitions

    code = definitions.defs()
    resources = {key: code.resources[key] for key in ("loop", "sandbox")}
    for name, value, message in (("ENVLOOP_NOISE_ARMS", "many", "ENVLOOP_NOISE_ARMS='many': must be an integer"),
                                 ("ENVLOOP_SANDBOX", "firecracker", "ENVLOOP_SANDBOX='firecracker' is not a sandbox "
                                                                    "backend; allowed: local, docker, k8s")):
        clean_env.setenv(name, value)
        result = _run(resources, {})
        assert not result.success
        # The loop's settings are checked when the run's resources start (RESOURCE_INIT_FAILURE, before any
        # step's body); the sandbox's when a step uses it (STEP_FAILURE).
        errors = [getattr(e.event_specific_data, "error", None) for e in result.all_events
                  if e.event_type_value in ("STEP_FAILURE", "RESOURCE_INIT_FAILURE")]
        errors = [e for e in errors if e is not None]
        assert len(errors) == 1 and message in errors[0].to_string(), errors
        clean_env.delenv(name)


def test_importing_the_definitions_reads_no_setting(tmp_path: Path) -> None:
    """A fresh interpreter: bad values import; loading names the loop's bad variable; the sandbox's fails its use."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ENVLOOP_")}
    env.update(ENVLOOP_NOISE_ARMS="many", ENVLOOP_SANDBOX="firecracker", ENVLOOP_HOME=str(tmp_path / "home"),
               PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]))
    code = (
        "import os\n"
        "from envloop_pipelines.definitions import defs\n"
        "print('imported')\n"
        "try:\n"
        "    defs()\n"
        "except ValueError as exc:\n"
        "    print(exc)\n"
        "del os.environ['ENVLOOP_NOISE_ARMS']\n"
        "loaded = defs()\n"
        "loaded.get_repository_def()\n"
        "print('loaded')\n"
        "try:\n"
        "    loaded.resources['sandbox'].settings()\n"
        "except ValueError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines() == ["imported", "ENVLOOP_NOISE_ARMS='many': must be an integer", "loaded",
                                       "ENVLOOP_SANDBOX='firecracker' is not a sandbox backend; allowed: local, docker, k8s"]


def test_loading_shows_the_environments_settings_as_configured_values(clean_env: pytest.MonkeyPatch) -> None:
    """What a remote ``Client.loop_settings()`` reads (the resource's configured values) is what the runs use."""
    from envloop_pipelines import definitions

    clean_env.setenv("ENVLOOP_TASK", "tickets")
    clean_env.setenv("ENVLOOP_NOISE_ARMS", "3")
    clean_env.setenv("ENVLOOP_RECIPE_OVERRIDES", '{"max_steps": 2}')
    loop = definitions.defs().resources["loop"]
    assert (loop.task, loop.noise_arms, loop.recipe_overrides) == ("tickets", 3, {"max_steps": 2})
    assert loop.top_clusters is None  # unset at load: read by the run, else LoopConfig's default
    clean_env.setenv("ENVLOOP_TASK", "claims")  # after the load: the loaded value stands
    assert loop.config().task == "tickets"


def test_the_code_locations_loop_has_every_setting_unset() -> None:
    assert list(DeploymentLoopResource.model_fields) == [f.name for f in loop_fields()]
    resource = DeploymentLoopResource()
    assert all(getattr(resource, f.name) is None for f in loop_fields())
    assert "$ENVLOOP_NOISE_ARMS" in (DeploymentLoopResource.model_fields["noise_arms"].description or "")
