"""The remote door of the loop recipe override (issue 46): ``Client(url, loop_settings={"recipe_overrides": ...})``
and ``envloop round start --remote URL --recipe-override KEY=VALUE`` give a real deployment's runs the override, and
a round on another recipe than the noise floor's is refused (at its registration when no floor of its recipe
exists, else by its decision, ``FloorRecipeError``) rather than gated on that floor.

Before, the remote ``Client`` had no way to give one and the CLI refused ``--recipe-override`` beside ``--remote``
(the deployment's ``ENVLOOP_RECIPE_OVERRIDES`` decided), while ``LocalClient(loop_settings={"recipe_overrides":
...})`` could. The deployment is the one of ``test_remote.py`` (its loop: ``max_steps`` 2, ``max_length`` 128); the
client asks for ``max_steps`` 3 on top. Nothing here reads the deployment's home to drive it; the home is read only
to check that what the runs did is what the clients asked.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from envloop_pipelines.core.decision_loop.step_records import MeasuredNoiseFloor, RegisteredHypothesis
from envloop_pipelines.core.ledger.store import RoundStore
from envloop_pipelines.core.loop.config import LoopConfig
from envloop_pipelines.sdk.client import Client
from envloop_pipelines.sdk.errors import RefusedError, RoundFailed
from envloop_pipelines_tests.integration.test_remote import ENVLOOP, TASK, running_deployment

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NAMED = r"unknown recipe override\(s\) \['lrr'\] \(did you mean 'lr' for 'lrr'\?\); allowed: base_model, .*max_steps"
#: The deployment's override (test_remote.LOOP_ENV), and the one the client's runs take: its max_steps on top.
DEPLOYMENT = {"max_steps": 2, "max_length": 128}
WITH_CLIENTS = {"max_steps": 3, "max_length": 128}

RUN_CONFIG = "query($id: ID!) { runOrError(runId: $id) { __typename ... on Run { runConfigYaml } } }"


def _run_config(client: Client, run_id: str) -> dict[str, Any]:
    """The run config a run was launched with, as the webserver stored it."""
    return yaml.safe_load(client._query(RUN_CONFIG, {"id": run_id})["runOrError"]["runConfigYaml"]) or {}


def _recipe_hash(overrides: dict[str, Any]) -> str:
    return LoopConfig(recipe_overrides=overrides).recipe_hash()  # the packaged default recipe, as the deployment's


def test_a_remote_override_reaches_the_setup_and_the_rounds_and_another_recipe_is_refused_by_the_floor(
        tmp_path: Path) -> None:
    with running_deployment(tmp_path / "deployment") as deployment:
        plain = deployment.client()
        env = {k: v for k, v in deployment.env.items() if not k.startswith("ENVLOOP_") and k != "MLFLOW_TRACKING_URI"}

        def envloop(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([ENVLOOP, *args], env=env, capture_output=True, text=True, timeout=1200)

        # the door: a misspelled field is refused naming a close match, before anything is launched
        with pytest.raises(RefusedError, match=NAMED):
            Client(deployment.dagster, deployment.mlflow, loop_settings={"recipe_overrides": {"lrr": 1e-4}})
        refused = envloop("round", "start", "--remote", deployment.dagster, "--mlflow", deployment.mlflow,
                          "--recipe-override", "lrr=0.0001")
        assert refused.returncode == 2 and "did you mean 'lr' for 'lrr'?" in refused.stderr, refused.stderr
        assert plain.runs("setup_job") == [] and plain.runs("round_job") == [] and plain.round_keys() == []

        # the SDK's setup: the deployment's loop with the client's override on top, in the run's config
        client = Client(deployment.dagster, deployment.mlflow, loop_settings={"recipe_overrides": {"max_steps": 3}})
        assert client.loop_settings()["recipe_overrides"] == WITH_CLIENTS
        assert plain.loop_settings()["recipe_overrides"] == DEPLOYMENT
        setup = client.setup(progress=False)
        assert setup.success
        loop = _run_config(client, setup.run_id)["resources"]["loop"]["config"]
        assert loop["recipe_overrides"] == WITH_CLIENTS
        assert (loop["noise_arms"], loop["builtin_users"], loop["n_synthesized"]) == (2, 30, 12)  # the deployment's
        # ... and the floor was measured on that recipe: its null arms trained 3 steps, not the deployment's 2
        floor_hash = client._materializations("noise_floor", limit=1)[0]["metadata"]["recipe_hash"]
        assert floor_hash == _recipe_hash(WITH_CLIENTS) != _recipe_hash(DEPLOYMENT)
        stored = RoundStore(TASK, deployment.home).load("noise_floor", MeasuredNoiseFloor)
        assert stored is not None and stored.recipe_hash == floor_hash
        trained = [m for step, m in client._progress_lines(setup.run_id, None)[0]
                   if step == "noise_floor" and m.startswith("train: 100%")]
        assert trained and all(re.match(r"train: 100% 3/3 step", m) for m in trained), trained

        # the CLI's round with the same override (through the SDK): its run takes it, the floor gates it
        started = envloop("round", "start", "--remote", deployment.dagster, "--mlflow", deployment.mlflow,
                          "--recipe-override", "max_steps=3")
        assert started.returncode == 0, started.stdout[-3000:] + started.stderr[-3000:]
        assert 'recipe_overrides {"max_length": 128, "max_steps": 3}' in started.stdout, started.stdout
        assert "setup:" not in started.stdout  # set up already: the CLI ran the round only
        [key] = plain.round_keys()
        [run] = plain.runs("round_job", partition=key)
        assert run.success and plain.decision(key) is not None
        assert _run_config(plain, run.run_id)["resources"]["loop"]["config"]["recipe_overrides"] == WITH_CLIENTS
        registered = RoundStore(TASK, deployment.home).load("registered_hypothesis", RegisteredHypothesis, key)
        assert registered.hypothesis.recipe_hash == floor_hash  # the round's recipe is the floor's

        # a round on the deployment's own recipe finds no floor of that recipe: refused when it registers, before
        # anything is trained (the floor's recipe is the override's)
        with pytest.raises(RoundFailed) as failed:
            plain.run_round(progress=False)
        reason = failed.value.reason
        assert reason is not None and reason.step == "registered_hypothesis", reason
        assert reason.error_class == "UnmeasuredPowerError", reason
        assert f"no noise floor for this loop's recipe (recipe_hash {_recipe_hash(DEPLOYMENT)[:16]})" in reason.message
        assert "lora_checkpoint" not in {s.key for s in failed.value.run.steps if s.status == "SUCCESS"}
        assert _run_config(plain, failed.value.run.run_id).get("resources") is None  # no override: the deployment's
        assert plain.decision(failed.value.run.partition) is None

        # both floors measured (a setup on the deployment's recipe: the floor its rounds are now handed), a round
        # with the override registers on its own floor but is not gated on the other: its decision refuses it
        assert plain.setup(progress=False).success
        assert plain._materializations("noise_floor", limit=1)[0]["metadata"]["recipe_hash"] == _recipe_hash(DEPLOYMENT)
        with pytest.raises(RoundFailed) as failed:
            client.run_round(progress=False)
        reason = failed.value.reason
        assert reason is not None and reason.step == "promotion_decision", reason
        assert reason.error_class == "FloorRecipeError" and "noise_floor.recipe_hash" in reason.message, reason
        assert _run_config(client, failed.value.run.run_id)["resources"]["loop"]["config"]["recipe_overrides"] == (
            WITH_CLIENTS)
        assert client.decision(failed.value.run.partition) is None
