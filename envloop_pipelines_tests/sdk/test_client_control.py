"""A run handle and failures a person can act on, against a real deployment (issue 27).

One deployment for the module, as ``integration/test_remote.py`` builds it (an ``mlflow server`` and a
``dagster-webserver`` loading this project's code location, a tiny loop), with the shipped instance's
``run_retries`` (``max_retries: 1``) so that Dagster decides at each failure whether the run would be retried.
A notebook-style script (the SDK only, stderr a pipe) starts a round and watches it; the test cancels it,
launches a refused hypothesis over plain GraphQL, reads the reasons, and retries the round to its decision.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from envloop_pipelines.core.ledger.ledger import Ledger
from envloop_pipelines.core.ledger.store import RoundStore
from envloop_pipelines.names import PARTITION_TAG, REFUSED_TAG, ROUND_JOB
from envloop_pipelines.sdk.client import Client
from envloop_pipelines.sdk.errors import NotFoundError, RefusedError, RoundFailed, UnavailableError
from envloop_pipelines.sdk.records import RoundRun
from envloop_pipelines.testing import services
from envloop_pipelines_tests.integration.test_remote import (ENVLOOP, HYPOTHESIS, TASK, Deployment,
                                                          running_deployment)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

#: A hypothesis every door refuses (rule 2: a gate looser than the measured floor).
REFUSED = {**HYPOTHESIS, "gate": {"floor_multiplier": 0.5}}
#: The notebook: start a round, print its key and run, wait for it with progress (stderr is a pipe here).
NOTEBOOK = """
import json, sys
from envloop_pipelines.sdk.client import Client
client = Client(sys.argv[1], mlflow_uri=sys.argv[2])
run = client.start_round(json.loads(sys.argv[3]))
print(json.dumps({"key": run.key, "run_id": run.run_id}), flush=True)
info = client.wait(run.run_id, poll_s=0.5)
print(json.dumps({"status": info.status}), flush=True)
"""


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    with running_deployment(tmp_path_factory.mktemp("deployment"),
                            instance={"run_retries": {"enabled": True, "max_retries": 1}}) as d:
        d.client().setup(progress=False)  # every test starts rounds: the floor first, whichever test runs alone
        yield d


def _mlflow_runs(client: Client, key: str) -> dict[str, str]:
    """``{envloop.kind: status}`` of the round's MLflow runs (the latest of each kind)."""
    experiment = client.mlflow.get_experiment_by_name(TASK)
    if experiment is None:
        return {}
    runs = client.mlflow.search_runs([experiment.experiment_id], filter_string=f"tags.`envloop.round` = '{key}'",
                                     order_by=["attributes.start_time ASC"])
    return {r.data.tags["envloop.kind"]: r.info.status for r in runs}


def _launch_refused(client: Client, key: str) -> str:
    """A round_job run of ``key`` with the refused hypothesis, launched as the doc's curl does (no SDK check)."""
    config = {"ops": {"registered_hypothesis": {"config": {"proposal_json": json.dumps(REFUSED)}}}}
    return client._launch(ROUND_JOB, run_config=config, tags={PARTITION_TAG: key})


def test_a_refused_hypothesis_over_http_fails_once_with_its_reason_and_leaves_nothing(deployment: Deployment) -> None:
    client = deployment.client()
    key = client.add_round()
    run_id = _launch_refused(client, key)
    info = client.wait(run_id, progress=False, poll_s=0.5, timeout_s=300)
    assert info.status == "FAILURE"
    # refused by the round's first step, and not retried (the instance retries failed runs once)
    assert info.tags.get("dagster/will_retry") == "false" and info.tags.get(REFUSED_TAG) == "hypothesis", info.tags
    error = client.run_error(run_id)
    assert error is not None and error.step == "baseline_eval", error
    assert "hypothesis refused" in error.message and "floor_multiplier" in error.message, error.message
    assert "DagsterExecutionStepExecutionError" not in error.message
    # nothing of the round: no files, ledger event or MLflow run; its partition is free again
    assert not (RoundStore(TASK, deployment.home).loop / "rounds" / key).exists()
    assert [e for e in Ledger(TASK, deployment.home).events() if e.get("round") == key] == []
    assert _mlflow_runs(client, key) == {}
    assert key not in client.round_keys()
    # a retry would be refused the same way; waiting on it says why
    with pytest.raises(RefusedError, match="hypothesis was refused"):
        client.retry(run_id)
    with pytest.raises(RoundFailed, match=r"ended FAILURE: baseline_eval: .*hypothesis refused") as failed:
        client._finish_round(RoundRun(key, run_id, 0.0), progress=False)
    assert failed.value.reason == error
    assert any("hypothesis refused" in line for line in client.logs(run_id, tail=20))
    # clear errors for what does not exist
    with pytest.raises(NotFoundError, match="no round 'banana'"):
        client.decision("banana")
    with pytest.raises(NotFoundError, match="RunNotFoundError"):
        client.wait("not-a-run-id", progress=False)
    with pytest.raises(UnavailableError, match="did not answer"):
        Client(f"http://127.0.0.1:{services.free_port()}").wait(run_id, progress=False)


def test_a_notebook_watches_a_round_cancels_it_and_retries_it_to_its_decision(deployment: Deployment) -> None:
    client = deployment.client()
    env = {k: v for k, v in deployment.env.items() if not k.startswith("ENVLOOP_") and k != "MLFLOW_TRACKING_URI"}
    notebook = subprocess.Popen([sys.executable, "-c", NOTEBOOK, deployment.dagster, deployment.mlflow,
                                 json.dumps(HYPOTHESIS)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
    try:
        line = notebook.stdout.readline()
        assert line, f"the notebook printed no round: {notebook.stderr.read()[-3000:]}"
        started = json.loads(line)
        key, run_id = started["key"], started["run_id"]
        deadline = time.monotonic() + 600
        while True:  # cancel once the hypothesis is registered (the round's MLflow runs exist) and before the decision
            steps = {s.key: s.status for s in client.run(run_id).steps}
            if steps.get("registered_hypothesis") == "SUCCESS":
                break
            assert time.monotonic() < deadline and client.run(run_id).status in ("QUEUED", "STARTING", "STARTED"), steps
            time.sleep(0.3)
        cancelled = client.cancel(run_id)
        out, err = notebook.communicate(timeout=300)
    finally:
        if notebook.poll() is None:
            notebook.kill()
    assert cancelled.status == "CANCELED" and json.loads(out.strip().splitlines()[-1]) == {"status": "CANCELED"}
    # the notebook saw the round move (its stderr is no terminal): the client printed its progress lines
    assert any(line.startswith(f"round {key}:") and "step [" in line for line in err.splitlines()), err[-2000:]
    # the cancelled round's MLflow runs are closed KILLED, none left RUNNING
    statuses = _mlflow_runs(client, key)
    assert statuses.get("round") == "KILLED" and "RUNNING" not in statuses.values(), statuses

    # a refused launch on the same round: a second run, so the round stays; its status says why it failed
    refused = _launch_refused(client, key)
    assert client.wait(refused, progress=False, timeout_s=300).status == "FAILURE"
    cli_env = {**env, "ENVLOOP_REMOTE": deployment.dagster}
    status = subprocess.run([ENVLOOP, "round", "status", key, "--json"], env=cli_env, capture_output=True, text=True,
                            timeout=300)
    [row] = json.loads(status.stdout)
    assert row["status"] == "FAILURE" and row["reason"].startswith("baseline_eval: ") and "hypothesis refused" in row["reason"]
    text = subprocess.run([ENVLOOP, "round", "status", key], env=cli_env, capture_output=True, text=True, timeout=300)
    assert f"failed: baseline_eval: round {key}: hypothesis refused" in text.stdout, text.stdout

    # `round retry --remote` runs the cancelled run again from where it stopped (not the refused one), to a decision
    retried = subprocess.run([ENVLOOP, "round", "retry", "--mlflow", deployment.mlflow], env=cli_env,
                             capture_output=True, text=True, timeout=900)
    assert retried.returncode == 0, retried.stdout[-2000:] + retried.stderr[-3000:]
    assert f"round {key}: " in retried.stdout and ("promoted" in retried.stdout or "rejected" in retried.stdout)
    decided = client.round(key)
    assert decided.status == "decided" and decided.run.tags.get("dagster/parent_run_id") == run_id
    # issue 37: the retry's progress counts the steps it runs (it stopped at "41% 5/12 step": the whole job's)
    ran, whole = decided.run.step_keys, client.job_steps("round_job")
    assert ran and len(ran) < whole, (ran, whole)
    totals = {line.split(" step")[0].rsplit("/", 1)[-1] for line in retried.stderr.splitlines()
              if line.startswith(f"round {key}:") and " step" in line and "/" in line}
    assert totals == {str(len(ran))}, (totals, retried.stderr[-2000:])
    # the decision closes the round's parent run FINISHED
    statuses = _mlflow_runs(client, key)
    assert statuses.get("round") == "FINISHED" and "RUNNING" not in statuses.values(), statuses
    with pytest.raises(RefusedError, match="is decided"):
        client.retry(key)


def _rounded(value: object) -> object:
    """Floats to 6 decimals, recursively (a batch of another size may move the last bits)."""
    if isinstance(value, float):
        return round(value, 6)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


def test_predict_with_the_champion_here_gives_the_numbers_envloop_serve_gives(deployment: Deployment,
                                                                             tmp_path: Path) -> None:
    from envloop_pipelines.testing.serve import benchmark_records, start_server

    client = deployment.client()
    records = benchmark_records(n_users=2, records_per_user=2)
    try:
        here = client.predict(records)  # the champion's checkpoint from MLflow, answered in this process
        single = client.predict(records[0])
    finally:
        client.close()
    ckpt = client.fetch_checkpoint("champion", tmp_path / "models")
    server = start_server(ckpt, tmp_path / "serve", auth_off=True)
    try:
        served = client.predict(records, url=server.url)
        with pytest.raises(RefusedError, match="answered 422"):
            client.predict({"state": "s", "questions": {"q": {"type": "banana", "instructions": "?"}}}, url=server.url)
    finally:
        server.stop()
    assert len(here) == len(served) == len(records) and single["answers"] == here[0]["answers"]
    assert [h["x_checkpoint_sha256"] for h in here] == [s["x_checkpoint_sha256"] for s in served] == [ckpt.name] * 4
    assert [_rounded(h["answers"]) for h in here] == [_rounded(s["answers"]) for s in served]
    assert list(here[0]["answers"]) == list(records[0]["questions"])
    with pytest.raises(UnavailableError, match="did not answer"):
        client.predict(records[0], url=f"http://127.0.0.1:{services.free_port()}")


def test_a_setup_launched_while_the_tasks_loop_is_held_is_refused_by_its_first_step(deployment: Deployment) -> None:
    """Issue 47, the deployment's doors: a ``setup_job`` launched over GraphQL (``Client.setup``, as the HTTP job API
    and the launchpad launch it) while a door of the deployment's home holds the task's loop (as ``envloop round
    start`` does from its setup to its last round) passes the client's check (no run of the holder is on the
    deployment) and is refused by its first step: the run ends FAILURE tagged busy, ``setup`` raises ``BusyError``
    naming the holder's run and ``--remote``, and the ledger is as it was."""
    import os

    from envloop_pipelines.core.loop.round_claim import SETUP, claim_round, release_hold
    from envloop_pipelines.names import BUSY_WITH_TAG, SETUP_JOB
    from envloop_pipelines.sdk.errors import BusyError

    client = deployment.client()
    before = list(Ledger(TASK, deployment.home).events())
    claim_round(TASK, deployment.home, SETUP, run_id="held-by-a-door", door="envloop round start",
                run_finished=lambda run_id: None, pid=os.getpid(), holder="this-test")
    try:
        with pytest.raises(BusyError) as busy:
            client.setup(progress=False)
    finally:
        assert release_hold(TASK, deployment.home, "this-test")
    message = str(busy.value)
    assert busy.value.run_id == "held-by-a-door" and "\n" not in message, message
    assert message.startswith(f"setup: refused: the setup of task {TASK!r} is running (run held-by-a-door, started by "
                              f"envloop round start, pid {os.getpid()} on "), message
    assert message.endswith(f"wait for it (follow it in {deployment.dagster}) or cancel it (`envloop round cancel "
                            f"held-by-a-door --remote {deployment.dagster}`)"), message
    refused = client.runs(SETUP_JOB, limit=1)[0]
    assert refused.status == "FAILURE" and refused.tags[REFUSED_TAG] == "busy"
    assert refused.tags[BUSY_WITH_TAG] == "held-by-a-door"
    assert list(Ledger(TASK, deployment.home).events()) == before
