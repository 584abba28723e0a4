"""A round against a real `mlflow server` on loopback, over HTTP."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import pytest

from envloop_pipelines.core.ledger.ledger import Ledger
from envloop_pipelines.core.tracking import MlflowTracker
from envloop_pipelines.defs.rounds.assets import (
    ROUND_ASSETS,
    noise_floor,
    task_benchmark,
    with_upstream_sources,
)
from envloop_pipelines.defs.rounds.checks import ROUND_CHECKS
from envloop_pipelines.resources.loop import LoopResource, MlflowResource
from envloop_pipelines.resources.round_store import RoundStoreIOManager
from envloop_pipelines.resources.sandbox import SandboxResource
from envloop_pipelines.testing import services

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("mlflow-server")
    with services.mlflow_server(root, f"sqlite:///{root / 'mlflow.db'}") as url:
        yield url


def test_round_against_a_real_mlflow_server(mlflow_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    monkeypatch.setenv("ENVLOOP_HOME", str(home))
    loop = LoopResource(home=str(home), builtin_users=30, builtin_records_per_user=3, noise_arms=2, n_synthesized=8,
                        recipe_overrides={"max_steps": 1, "max_length": 128})
    resources = {"loop": loop, "mlflow": MlflowResource(tracking_uri=mlflow_server, home=str(home)),
                 "io_manager": RoundStoreIOManager(loop=loop), "sandbox": SandboxResource()}
    instance = dg.DagsterInstance.ephemeral()
    assert dg.materialize([task_benchmark, noise_floor], resources=resources, instance=instance).success
    instance.add_dynamic_partitions("rounds", ["r0001"])
    result = dg.materialize(with_upstream_sources(ROUND_ASSETS + ROUND_CHECKS), partition_key="r0001", resources=resources, instance=instance)
    assert result.success
    # Everything went over HTTP: nothing local but the loop's own files.
    assert not (home / "mlflow.db").exists()
    tracker = MlflowTracker(mlflow_server)
    for kind in ("round", "registered_hypothesis", "lora_checkpoint", "independent_reeval"):
        run = tracker.find_run("personal_agent", {"envloop.round": "r0001", "envloop.kind": kind})
        assert run is not None and run.url.startswith(mlflow_server), kind
    evaluation = tracker.find_run("personal_agent", {"envloop.round": "r0001", "envloop.kind": "independent_reeval"})
    data = tracker.run_data(evaluation.run_id)
    assert "candidate.family_macro_accuracy" in data.data.metrics
    artifacts = [a.path for a in tracker.client.list_artifacts(evaluation.run_id)]
    assert "independent_reeval.json" in artifacts and "predictions" in artifacts
    champion = Ledger("personal_agent", home).releases()[-1]
    assert tracker.champion_version("envloop-personal_agent") == champion["model_version"]
    # The release's checkpoint is in the server's artifact store, downloadable over HTTP.
    local = tracker.client.download_artifacts(champion["mlflow_run_id"], "checkpoint", str(tmp_path / "dl"))
    assert (Path(local) / "manifest.json").exists()
