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
