"""Crash safety: the run worker of a round is SIGKILLed in the middle of training, then the round is retried.

The worker is the real ``envloop round start`` process (Dagster on SQLite under
``$DAGSTER_HOME``, MLflow on SQLite, the packaged model). After the kill the
test runs ``envloop round retry`` and asserts the exact state: one snapshot, one
checkpoint per trained arm, one ledger entry per event, no temp or staging
leftovers, the dead run marked failed and the retry succeeded.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from envloop_pipelines.core.ledger.ledger import Ledger
from envloop_pipelines.core.tracking import MlflowTracker

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TASK = "personal_agent"
ENVLOOP = str(Path(sys.executable).with_name("envloop"))
# 30 users x 3 records, 2 null arms; 40 optimizer steps so training lasts long enough to be killed in.
LOOP_ARGS = ["--builtin-users", "30", "--builtin-records-per-user", "3", "--noise-arms", "2", "--n-synthesized", "12",
             "--recipe-override", "max_steps=40", "--recipe-override", "max_length=128"]


def _env(home: Path, dagster_home: Path) -> dict[str, str]:
    env = {**os.environ, "ENVLOOP_HOME": str(home), "DAGSTER_HOME": str(dagster_home), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("MLFLOW_TRACKING_URI", None)
    return env


def _training_in_progress(home: Path) -> bool:
    """Round r0001's hypothesis is registered and a checkpoint is being written in a staging directory."""
    ledger = Ledger(TASK, home)
    if ledger.hypothesis("r0001") is None:
        return False
    checkpoints = home / "artifacts" / "checkpoints"
    return any(p.name.startswith(".staging") for p in checkpoints.iterdir()) if checkpoints.exists() else False


@pytest.fixture(scope="module")
def recovered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("crash")
    home, dagster_home = root / "home", root / "dagster"
    env = _env(home, dagster_home)
    log = open(root / "killed.log", "wb")
    proc = subprocess.Popen([ENVLOOP, "round", "start", *LOOP_ARGS, "--rounds", "1"], env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 900
    while not _training_in_progress(home):
        if proc.poll() is not None:
            pytest.fail(f"the round ended before training could be killed: {(root / 'killed.log').read_text()[-3000:]}")
        if time.time() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail("training of round r0001 did not start within 15 minutes")
        time.sleep(0.2)
    time.sleep(2.0)  # inside the training loop
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    round_dir = home / "loops" / TASK / "rounds" / "r0001"
    killed_state = {
        "trained": (round_dir / "lora_checkpoint.json").exists(),
        "staging": sorted(p.name for p in (home / "artifacts" / "checkpoints").iterdir() if p.name.startswith(".")),
    }
    retry = subprocess.run([ENVLOOP, "round", "retry"], env=env, check=False, capture_output=True, text=True, timeout=1200)
    assert retry.returncode == 0, retry.stdout[-3000:] + retry.stderr[-3000:]
    os.environ["DAGSTER_HOME"] = str(dagster_home)
    try:
        instance = dg.DagsterInstance.get()
        runs = {job: instance.get_runs(filters=dg.RunsFilter(job_name=job)) for job in ("setup_job", "round_job")}
    finally:
        os.environ.pop("DAGSTER_HOME", None)
    return {"home": home, "killed": killed_state, "retry": retry.stdout, "runs": runs, "round_dir": round_dir,
            "tracker": MlflowTracker(home=home)}


def test_the_worker_was_killed_mid_training(recovered: dict[str, Any]) -> None:
    assert recovered["killed"]["trained"] is False
    assert len(recovered["killed"]["staging"]) == 1 and recovered["killed"]["staging"][0].startswith(".staging~")


def test_the_retry_completes_the_round(recovered: dict[str, Any]) -> None:
    assert "retrying round r0001" in recovered["retry"] and "marked run" in recovered["retry"]
    decision = json.loads((recovered["round_dir"] / "promotion_decision.json").read_text())
    assert decision["round"] == "r0001" and isinstance(decision["promote"], bool)
    assert "loop" in recovered["retry"] and "stops" in recovered["retry"]  # then the one-round budget is spent


def test_dagster_marks_the_dead_run_failed_and_the_retry_succeeds(recovered: dict[str, Any]) -> None:
    setup, rounds = recovered["runs"]["setup_job"], recovered["runs"]["round_job"]
    assert [r.status for r in setup] == [dg.DagsterRunStatus.SUCCESS]
    assert len(rounds) == 2  # newest first
    retried, dead = rounds
    assert dead.status == dg.DagsterRunStatus.FAILURE and retried.status == dg.DagsterRunStatus.SUCCESS
    assert dead.tags["dagster/partition"] == retried.tags["dagster/partition"] == "r0001"
    assert retried.tags["envloop/retry_of"] == dead.run_id == retried.tags["dagster/parent_run_id"]


def test_no_duplicate_or_half_written_artifact(recovered: dict[str, Any]) -> None:
    home: Path = recovered["home"]
    ledger = Ledger(TASK, home)
    checkpoints = sorted(p.name for p in (home / "artifacts" / "checkpoints").iterdir())
    trained = sorted({e["checkpoint_sha256"] for e in ledger.events() if e["kind"] in ("null_arm", "lora_checkpoint_trained")})
    assert checkpoints == trained  # one directory per trained arm, nothing staged or half-written beside them
    snapshots = sorted(p.name for p in (home / "artifacts" / "snapshots").iterdir())
    snap = json.loads((recovered["round_dir"] / "training_dataset_snapshot.json").read_text())
    # the round's snapshot, and the null arms' (their train rows, contamination-checked too), each with its report
    from envloop_pipelines.core.ledger.store import RoundStore

    floors = [json.loads(p.read_text()) for p in RoundStore(TASK, home).noise.glob("*.json")]
    shas = {snap["sha256"]} | {arm["training_snapshot"] for f in floors for arm in f.get("arms", [])}
    assert snapshots == sorted(f"{sha}{ext}" for sha in shas for ext in (".contamination.json", ".parquet"))
    leftovers = [p for p in home.rglob(".*") if p.name.endswith(".tmp") or p.name.startswith(".staging")]
    assert leftovers == []
    lora = json.loads((recovered["round_dir"] / "lora_checkpoint.json").read_text())
    assert lora["checkpoint_sha256"] in checkpoints


def test_the_ledger_has_each_entry_once(recovered: dict[str, Any]) -> None:
    events = list(Ledger(TASK, recovered["home"]).events())
    ids = [e["event_id"] for e in events]
    assert len(ids) == len(set(ids))
    per_round = collections.Counter(e["kind"] for e in events if e.get("round") == "r0001")
    assert per_round["hypothesis_registered"] == 1 and per_round["lora_checkpoint_trained"] == 1
    assert per_round["round_decided"] == 1
    assert sum(1 for e in events if e["kind"] == "null_arm") == 2


def test_mlflow_has_one_finished_training_run_and_the_dead_one_closed(recovered: dict[str, Any]) -> None:
    tracker: MlflowTracker = recovered["tracker"]
    exp = tracker.client.get_experiment_by_name(TASK)
    runs = tracker.client.search_runs([exp.experiment_id],
                                      filter_string="tags.`envloop.round` = 'r0001' and tags.`envloop.kind` = 'lora_checkpoint'")
    assert sorted(r.info.status for r in runs) == ["FINISHED", "KILLED"]
    killed = next(r for r in runs if r.info.status == "KILLED")
    assert "envloop.superseded" in killed.data.tags
    hypothesis = tracker.client.search_runs(
        [exp.experiment_id], filter_string="tags.`envloop.round` = 'r0001' and tags.`envloop.kind` = 'registered_hypothesis'")
    assert [r.info.status for r in hypothesis] == ["FINISHED"]
    assert tracker.running_runs(TASK, {"envloop.round": "r0001", "envloop.kind": "lora_checkpoint"}) == []
