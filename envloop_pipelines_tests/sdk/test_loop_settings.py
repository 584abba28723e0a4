"""A remote client's loop settings are the deployment's, as its webserver reports them: nothing is built or read
on the client's machine (its home, its ``ENVLOOP_<FIELD>``). Before, ``Client.loop_settings()`` built a
``LoopConfig`` here, whose checks read this machine's home (the task's declared safety families, the recipe).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from envloop_pipelines.core.loop.config import LoopConfig, loop_fields
from envloop_pipelines.core.tracking import model_name
from envloop_pipelines.sdk.client import Client
from envloop_pipelines.sdk.errors import ClientError
from envloop_pipelines.sdk.loop_settings import reported_settings
from envloop_pipelines.testing import services

#: The deployment's loop: what its code location's environment sets when it loads.
DEPLOYMENT_ENV = {"ENVLOOP_TASK": "tickets", "ENVLOOP_NOISE_ARMS": "4", "ENVLOOP_RECIPE_OVERRIDES": '{"max_steps": 2}'}


@pytest.fixture
def no_loop_config_here(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """This machine: other settings of its own, and a ``LoopConfig`` built here fails the test."""
    monkeypatch.setenv("ENVLOOP_HOME", str(tmp_path / "client-home"))
    monkeypatch.setenv("ENVLOOP_TASK", "personal_agent")
    monkeypatch.setenv("ENVLOOP_NOISE_ARMS", "7")

    def built_here(self: LoopConfig) -> None:
        pytest.fail("the client built a LoopConfig (reading this machine's home)")

    monkeypatch.setattr(LoopConfig, "__post_init__", built_here)


def _value(key: str, value: object) -> dict[str, str]:
    return {"key": key, "value": json.dumps(value), "type": "VALUE"}


def test_the_reported_values_with_the_rest_left_at_their_defaults(no_loop_config_here: None) -> None:
    settings = reported_settings([_value("task", "tickets"), _value("noise_arms", 4), _value("top_clusters", None),
                                  _value("recipe_overrides", {"max_steps": 2}), _value("not_a_setting", 1)])
    assert list(settings) == [f.name for f in loop_fields()]
    assert (settings["task"], settings["noise_arms"], settings["recipe_overrides"]) == ("tickets", 4, {"max_steps": 2})
    assert (settings["top_clusters"], settings["safety_families"], settings["home"]) == (4, ["needs_approval"], None)


def test_a_setting_bound_to_an_environment_variable_is_refused_naming_it() -> None:
    with pytest.raises(ClientError, match=r"'task': the deployment reads it from \$LOOP_TASK when a run starts"):
        reported_settings([{"key": "task", "value": "LOOP_TASK", "type": "ENV_VAR"}])


def test_a_clients_override_is_the_deployments_loop_with_it_on_top(no_loop_config_here: None) -> None:
    """Issue 46: the run config a remote client gives its runs' ``loop`` resource. Dagster gives a run whose config
    names the resource none of its configured values, so they are given again; an unset one stays unset (the run
    reads ``ENVLOOP_<FIELD>``); the client's recipe fields win over the deployment's, the rest of its stay."""
    from envloop_pipelines.sdk.errors import RefusedError
    from envloop_pipelines.sdk.loop_settings import loop_run_config

    configured = [_value("task", "tickets"), _value("noise_arms", 4), _value("top_clusters", None),
                  _value("recipe_overrides", {"max_steps": 2, "max_length": 128}), _value("not_a_setting", 1)]
    assert loop_run_config(configured, {"max_steps": 3, "lexical": True}) == {"resources": {"loop": {"config": {
        "task": "tickets", "noise_arms": 4, "recipe_overrides": {"max_steps": 3, "max_length": 128, "lexical": True}}}}}
    assert loop_run_config(configured, {}) == {}  # no override: the run is the deployment's, no config at all
    assert loop_run_config([_value("task", "tickets")], {"max_steps": 3}) == {
        "resources": {"loop": {"config": {"task": "tickets", "recipe_overrides": {"max_steps": 3}}}}}
    with pytest.raises(ClientError, match=r"'task': the deployment reads it from \$LOOP_TASK"):
        loop_run_config([{"key": "task", "value": "LOOP_TASK", "type": "ENV_VAR"}], {"max_steps": 3})
    with pytest.raises(RefusedError, match=r"the deployment's recipe_overrides with this client's: .*'lrr'"):
        loop_run_config([_value("recipe_overrides", {"lrr": 1})], {"max_steps": 3})


def test_the_run_config_is_one_the_code_locations_jobs_take(monkeypatch: pytest.MonkeyPatch) -> None:
    """The config :func:`loop_run_config` builds from the configured values of the code location's own ``loop``
    resource passes the config schema of ``setup_job`` and ``round_job`` as Dagster loads them."""
    import dagster as dg

    from envloop_pipelines.resources.loop import deployment_loop_resource
    from envloop_pipelines.sdk.loop_settings import loop_run_config

    environ = {**DEPLOYMENT_ENV, "ENVLOOP_SAFETY_FAMILIES": "needs_approval", "ENVLOOP_BUILTIN_USERS": "30"}
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    from envloop_pipelines.definitions import defs

    loaded = defs()
    values = deployment_loop_resource(environ).model_dump()
    configured = [_value(k, v) for k, v in values.items() if k in {f.name for f in loop_fields()}]
    config = loop_run_config(configured, {"max_steps": 3})
    assert config["resources"]["loop"]["config"]["recipe_overrides"] == {"max_steps": 3}
    assert config["resources"]["loop"]["config"]["safety_families"] == ["needs_approval"]
    for job in ("setup_job", "round_job"):
        assert dg.validate_run_config(loaded.resolve_job_def(job), config) is not None, job


@pytest.fixture(scope="module")
def webserver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A real ``dagster-webserver`` loading the code location with :data:`DEPLOYMENT_ENV` and a home of its own."""
    root = tmp_path_factory.mktemp("deployment")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ENVLOOP_")}
    env.update(DEPLOYMENT_ENV, ENVLOOP_HOME=str(root / "home"))
    with services.dagster_webserver(root, env) as url:
        yield url, root / "home"


@pytest.mark.integration
def test_the_remote_client_reports_the_deployments_settings_not_its_own(webserver: tuple[str, Path],
                                                                        no_loop_config_here: None) -> None:
    url, home = webserver
    client = Client(url)
    settings = client.loop_settings()
    assert (settings["task"], settings["noise_arms"], settings["recipe_overrides"]) == ("tickets", 4, {"max_steps": 2})
    assert settings["home"] == str(home)  # the deployment's home, not this machine's $ENVLOOP_HOME
    assert settings["top_clusters"] == 4  # unset on the deployment: LoopConfig's default, not read here
    assert (client.task, client.model_name) == ("tickets", model_name("tickets"))
