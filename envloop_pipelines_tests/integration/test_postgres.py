"""A round end to end with Dagster's storage and MLflow both on a real PostgreSQL server.

The server is Debian's PostgreSQL, started on loopback for this module
(:mod:`envloop_pipelines_tests.postgres`). Dagster reads the project's
``dagster.postgres.yaml`` (the shared-instance config) from ``$DAGSTER_HOME``;
MLflow is a real ``mlflow server`` whose backend store is the same Postgres.
The round runs through the real CLI (``envloop round start``), and the tests
then read both databases directly with SQL as well as through the Dagster and
MLflow clients.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from envloop_pipelines.core.ledger.ledger import Ledger
from envloop_pipelines.core.tracking import MlflowTracker
from envloop_pipelines.defs.rounds.assets import ROUND_ASSETS
from envloop_pipelines_tests.postgres import PostgresServer, start_postgres
from envloop_pipelines.testing.services import mlflow_server

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
TASK = "personal_agent"


@pytest.fixture(scope="module")
def pg() -> Iterator[PostgresServer]:
    server = start_postgres()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def mlflow_on_postgres(pg: PostgresServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    pg.create_database("mlflow")
    with mlflow_server(tmp_path_factory.mktemp("mlflow-pg"), pg.url("mlflow")) as url:
        yield url


def _dagster_env(pg: PostgresServer) -> dict[str, str]:
    return {"DAGSTER_PG_HOST": pg.host, "DAGSTER_PG_PORT": str(pg.port), "DAGSTER_PG_DB": "dagster",
            "DAGSTER_PG_USERNAME": pg.user, "DAGSTER_PG_PASSWORD": pg.password}


@pytest.fixture(scope="module")
def round_on_postgres(pg: PostgresServer, mlflow_on_postgres: str,
                      tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("round-pg")
    home, dagster_home = root / "home", root / "dagster"
    dagster_home.mkdir()
    shutil.copy(REPO / "dagster.postgres.yaml", dagster_home / "dagster.yaml")
    pg.create_database("dagster")
    env = {**os.environ, **_dagster_env(pg), "ENVLOOP_HOME": str(home), "DAGSTER_HOME": str(dagster_home),
           "MLFLOW_TRACKING_URI": mlflow_on_postgres, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    started = time.perf_counter()
    proc = subprocess.run(
        [str(BIN / "envloop"), "round", "start", "--builtin-users", "30", "--builtin-records-per-user", "3", "--noise-arms", "2",
         "--n-synthesized", "12", "--recipe-override", "max_steps=2", "--recipe-override", "max_length=128", "--rounds", "1"],
        env=env, check=False, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    saved = {k: os.environ.get(k) for k in (*_dagster_env(pg), "DAGSTER_HOME")}
    os.environ.update({**_dagster_env(pg), "DAGSTER_HOME": str(dagster_home)})
    instance = dg.DagsterInstance.get()
    try:
        yield {"home": home, "dagster_home": dagster_home, "instance": instance, "stdout": proc.stdout,
               "mlflow": mlflow_on_postgres, "seconds": time.perf_counter() - started}
    finally:
        instance.dispose()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_dagster_instance_is_on_postgres(round_on_postgres: dict[str, Any]) -> None:
    from dagster_postgres import (
        PostgresEventLogStorage,
        PostgresRunStorage,
        PostgresScheduleStorage,
    )

    instance = round_on_postgres["instance"]
    assert isinstance(instance.run_storage, PostgresRunStorage)
    assert isinstance(instance.event_log_storage, PostgresEventLogStorage)
    assert isinstance(instance.schedule_storage, PostgresScheduleStorage)
    # Nothing fell back to SQLite under DAGSTER_HOME.
    assert not list(round_on_postgres["dagster_home"].rglob("*.db"))


def test_the_round_runs_are_in_postgres(round_on_postgres: dict[str, Any], pg: PostgresServer) -> None:
    instance: dg.DagsterInstance = round_on_postgres["instance"]
    runs = instance.get_runs()
    assert sorted((r.job_name, r.status) for r in runs) == [("round_job", dg.DagsterRunStatus.SUCCESS),
                                                           ("setup_job", dg.DagsterRunStatus.SUCCESS)]
    round_run = next(r for r in runs if r.job_name == "round_job")
    assert round_run.tags["dagster/partition"] == "r0001"
    assert instance.get_dynamic_partitions("rounds") == ["r0001"]
    for asset in ROUND_ASSETS:
        event = instance.get_latest_materialization_event(asset.key)
        assert event is not None and event.run_id == round_run.run_id, asset.key
    # The same facts straight from the database, with SQL.
    rows = pg.query("dagster", "SELECT run_id, pipeline_name, status FROM runs ORDER BY id")
    assert [(r[1], r[2]) for r in rows] == [("setup_job", "SUCCESS"), ("round_job", "SUCCESS")]
    (n_materialized,) = pg.query(
        "dagster", "SELECT count(DISTINCT asset_key) FROM event_logs WHERE run_id = %s AND dagster_event_type = %s",
        (round_run.run_id, "ASSET_MATERIALIZATION"))[0]
    assert n_materialized == len(ROUND_ASSETS)
    assert pg.query("dagster", "SELECT partition FROM dynamic_partitions WHERE partitions_def_name = 'rounds'") == [("r0001",)]


def test_mlflow_records_are_in_postgres(round_on_postgres: dict[str, Any], pg: PostgresServer) -> None:
    tracker = MlflowTracker(round_on_postgres["mlflow"])
    for kind in ("round", "registered_hypothesis", "lora_checkpoint", "independent_reeval"):
        assert tracker.find_run(TASK, {"envloop.round": "r0001", "envloop.kind": kind}) is not None, kind
    hyp = Ledger(TASK, round_on_postgres["home"]).hypothesis("r0001")
    kinds = dict(pg.query("mlflow", "SELECT t.value, count(*) FROM tags t JOIN runs r ON r.run_uuid = t.run_uuid "
                                    "WHERE t.key = 'envloop.kind' GROUP BY t.value"))
    assert kinds["registered_hypothesis"] == kinds["lora_checkpoint"] == kinds["independent_reeval"] == 1
    assert kinds["null_arm"] == 2  # the noise floor's arms
    (param,) = pg.query("mlflow", "SELECT p.value FROM params p JOIN tags t ON t.run_uuid = p.run_uuid "
                                  "WHERE p.key = 'hash' AND t.key = 'envloop.kind' AND t.value = 'registered_hypothesis'")
    assert param[0] == hyp.hash
    champion = tracker.champion_version(f"envloop-{TASK}")
    aliases = pg.query("mlflow", "SELECT name, alias, version FROM registered_model_aliases")
    assert aliases == [(f"envloop-{TASK}", "champion", int(champion))]
