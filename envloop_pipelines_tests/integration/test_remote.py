"""A deployment driven from outside: the SDK, the HTTP requests of docs/http-api.md, and the CLI with --remote.

One real deployment per module: an ``mlflow server`` and a ``dagster-webserver`` loading this project's
code location (``-m envloop_pipelines.definitions``) with a tiny loop in its environment; runs are
launched by the webserver's run launcher (a subprocess per run, every step in it:
``ENVLOOP_EXECUTOR=in_process``). Nothing here reads the deployment's home to drive it; the home is
read only to check that what the clients saw is what the steps wrote.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from envloop_pipelines.core import progress
from envloop_pipelines.core.ledger.ledger import Ledger
from envloop_pipelines.core.decision_loop.step_records import RoundDecision
from envloop_pipelines.core.ledger.store import RoundStore
from envloop_pipelines.sdk.client import Client
from envloop_pipelines.sdk.errors import ClientError
from envloop_pipelines.testing import services
from envloop_pipelines_tests.test_docs import doc_fences

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TASK = "personal_agent"
ENVLOOP = str(Path(sys.executable).with_name("envloop"))
#: The loop of the code location: 30 users x 3 records, 2 null arms, 2 optimizer steps of 128 tokens.
LOOP_ENV = {"ENVLOOP_BUILTIN_USERS": "30", "ENVLOOP_BUILTIN_RECORDS_PER_USER": "3", "ENVLOOP_NOISE_ARMS": "2",
            "ENVLOOP_N_SYNTHESIZED": "12", "ENVLOOP_RECIPE_OVERRIDES": '{"max_steps": 2, "max_length": 128}',
            "ENVLOOP_EXECUTOR": "in_process"}
HYPOTHESIS = {"change": {"kind": "recipe", "recipe_diff": {"max_steps": 3}}, "predicted_delta": 0.02,
              "gate": {"primary_metric": "family_macro_accuracy", "min_delta": 0.01},
              "rationale": "the champion is under-trained"}


@dataclass(frozen=True)
class Deployment:
    dagster: str
    mlflow: str
    home: Path
    env: dict[str, str]

    def client(self) -> Client:
        return Client(self.dagster, self.mlflow)


@contextmanager
def running_deployment(root: Path, *, instance: dict[str, Any] | None = None) -> Iterator[Deployment]:
    """An MLflow server and a Dagster webserver on loopback, the loop's env set for the small test benchmark."""
    home = root / "home"
    with services.mlflow_server(root / "mlflow", f"sqlite:///{root / 'mlflow' / 'mlflow.db'}") as mlflow_url:
        env = {k: v for k, v in os.environ.items() if not k.startswith("ENVLOOP_")}
        env.update(LOOP_ENV, ENVLOOP_HOME=str(home), MLFLOW_TRACKING_URI=mlflow_url, HF_HUB_OFFLINE="1",
                   TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
        with services.dagster_webserver(root, env, instance=instance) as dagster_url:
            yield Deployment(dagster_url, mlflow_url, home, env)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    with running_deployment(tmp_path_factory.mktemp("deployment")) as d:
        yield d


def _progress_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == progress.LOGGER]


def test_the_sdk_runs_a_round_reads_its_decision_and_release_fetches_the_champion_and_serves_it(
        deployment: Deployment, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    client = deployment.client()
    settings = client.loop_settings()
    assert (settings["task"], settings["noise_arms"], settings["recipe_overrides"]) == (TASK, 2, {"max_steps": 2, "max_length": 128})

    # before the setup: a round is refused, and so is a bad hypothesis, before anything is launched
    assert not client.is_set_up()
    with pytest.raises(ClientError, match=r"no noise floor yet: run Client.setup\(\)"):
        client.start_round()
    with pytest.raises(ClientError, match="gate"):
        client.start_round({**HYPOTHESIS, "gate": {"floor_multiplier": 0.5}})
    assert client.round_keys() == []

    setup = client.setup(progress=False)
    assert setup.success and setup.job == "setup_job" and client.is_set_up()

    monkeypatch.setenv(progress.MODE_ENV, "log")
    caplog.set_level(logging.INFO, logger=progress.LOGGER)
    launched = client.start_round(HYPOTHESIS)
    assert launched.key == "r0001"
    run = client.wait(launched.run_id, poll_s=1.0)
    assert run.success and run.partition == "r0001" and run.first_step_start >= launched.launched_at
    assert {s.key for s in run.steps} >= {"baseline_eval", "lora_checkpoint", "promotion_decision"}
    lines = [line for line in _progress_lines(caplog) if line.startswith("round r0001:")]
    assert lines and lines[-1].startswith("round r0001: 100% 13/13 step ["), lines

    # the training's progress is in the run's Dagster log, with its step
    logged, _ = client._progress_lines(launched.run_id, None)
    assert any(step == "lora_checkpoint" and re.match(r"train: 100% 3/3 step \[.*\] loss=", m) for step, m in logged), logged

    # the decision, read over GraphQL, is the one the step stored; the person's gate was applied
    decision = client.decision("r0001")
    assert decision == RoundStore(TASK, deployment.home).load("promotion_decision", RoundDecision, "r0001")
    assert decision.gate["min_delta"] == 0.01 and decision.reasons == tuple(decision.reasons)
    [summary] = client.rounds()
    assert (summary.key, summary.status, summary.run.run_id, summary.decision) == ("r0001", "decided", run.run_id, decision)

    # the ledger a client sees is the ledger's events about the floor and the round (a verifier's test reads are
    # the verifier's own events, in the ledger file, attributed to no step)
    ledger = client.ledger()
    on_disk = [e for e in Ledger(TASK, deployment.home).events()
               if e["kind"] not in ("loop_started", "loop_stopped", "test_read")]
    assert any(e["kind"] == "test_read" for e in Ledger(TASK, deployment.home).events())
    assert [e["event_id"] for e in ledger] == [e["event_id"] for e in on_disk]
    assert {e["kind"] for e in ledger} >= {"null_arm", "holdout_read", "release_promoted", "hypothesis_registered",
                                           "lora_checkpoint_trained", "round_decided"}

    # releases come from MLflow, cards from Dagster: the same as the ledger's cards
    releases = client.releases()
    cards = Ledger(TASK, deployment.home).releases()
    assert [r.release for r in releases] == [c["release"] for c in cards]
    assert [r.card for r in releases] == cards
    champion = client.champion()
    assert champion is not None and champion.release == cards[-1]["release"] and champion.champion
    if decision.promote:
        assert champion.release == decision.release and champion.round == "r0001"
    assert champion.holdout["family_macro_accuracy"] == pytest.approx(cards[-1]["holdout"]["family_macro_accuracy"])
    assert client.card("champion")["checkpoint_sha256"] == champion.checkpoint_sha256

    # the champion's checkpoint, downloaded from MLflow and verified, serves
    ckpt = client.fetch_checkpoint("champion", tmp_path / "models")
    assert ckpt.name == champion.checkpoint_sha256 and (ckpt / "manifest.json").exists()
    assert client.fetch_checkpoint(champion.release, tmp_path / "models") == ckpt  # found again, verified again
    with pytest.raises(ClientError, match="release: 'latest' is neither"):
        client.fetch_checkpoint("latest", tmp_path / "models")

    from envloop_pipelines.testing.serve import benchmark_records, jev_request, start_server

    records = benchmark_records(n_users=2, records_per_user=2)
    server = start_server(ckpt, tmp_path / "serve", auth_off=True)
    try:
        body = jev_request(records[0])
        r = httpx.post(f"{server.url}/v1/systemone", json=body, timeout=120)
        assert r.status_code == 200, r.text
        answer = r.json()
        assert answer["x_checkpoint_sha256"] == champion.checkpoint_sha256
        assert answer["model"] == f"envloop-{ckpt.name}-{ckpt.name[:12]}"
        assert list(answer["answers"]) == list(body["questions"])
    finally:
        server.stop()

    # an eval of the fetched checkpoint, here, on labelled records
    path = tmp_path / "labelled.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    metrics = Client.evaluate(ckpt, records=path)
    assert metrics["n_questions"] == sum(len(r["questions"]) for r in records) and 0 <= metrics["accuracy"] <= 1
    with pytest.raises(ClientError, match="split: 'holdout' is not an open split"):
        Client.evaluate(ckpt, task=TASK, split="holdout", home=deployment.home)


def test_the_http_requests_of_the_doc_run_as_written(deployment: Deployment, tmp_path: Path) -> None:
    script = "\n".join(f.text for f in doc_fences("http-api.md") if f.lang == "bash" and "http" in f.tags)
    env = {**deployment.env, "DAGSTER": deployment.dagster, "MLFLOW": deployment.mlflow}
    for tool in ("curl", "jq"):
        assert subprocess.run(["which", tool], capture_output=True).returncode == 0, f"{tool} is needed (apt-get install {tool})"
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=900)
    out = done.stdout
    assert done.returncode == 0, out[-3000:] + done.stderr[-3000:]
    assert "code location: envloop_pipelines.definitions" in out
    key = re.search(r"^round (r\d{4}): run (\S+)$", out, flags=re.MULTILINE)
    assert key, out
    key, run_id = key[1], key[2]
    statuses = re.findall(r"^run (\S+): (\w+)$", out, flags=re.MULTILINE)
    assert len(statuses) == 2 and all(s == "SUCCESS" for _, s in statuses) and statuses[1][0] == run_id, statuses
    assert re.search(r"^lora_checkpoint SUCCESS \d+s$", out, flags=re.MULTILINE), out
    assert re.search(r"^lora_checkpoint: train: 100% 3/3 step", out, flags=re.MULTILINE), out  # the doc's max_steps 3

    # the decision the doc prints is the decision of the round it started (over the SDK, and on disk)
    printed = json.loads(out[out.index('{\n  "round"'):].split("\n}\n", 1)[0] + "\n}")
    decision = deployment.client().decision(key)
    assert decision == RoundStore(TASK, deployment.home).load("promotion_decision", RoundDecision, key)
    assert printed == {"round": key, "promote": decision.promote, "release": decision.release,
                       "delta": decision.delta["delta"], "noise_floor": decision.noise_floor,
                       "reasons": list(decision.reasons)}
    assert decision.gate["min_delta"] == 0.01  # the doc's hypothesis
    # the champion's holdout metrics, from MLflow's REST API
    holdout = json.loads(out[out.rindex('{\n  "holdout.'):])
    champion = deployment.client().champion()
    assert holdout["holdout.family_macro_accuracy"] == pytest.approx(champion.holdout["family_macro_accuracy"])


def test_the_cli_goes_through_the_sdk_with_remote(deployment: Deployment) -> None:
    env = {k: v for k, v in deployment.env.items() if not k.startswith("ENVLOOP_") and k != "MLFLOW_TRACKING_URI"}
    env["ENVLOOP_REMOTE"] = deployment.dagster

    def envloop(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([ENVLOOP, *args], env=env, capture_output=True, text=True, timeout=900)

    refused = envloop("round", "start", "--noise-arms", "3")
    assert refused.returncode == 2 and "--noise-arms: a remote round runs with the deployment's loop settings" in refused.stderr

    before = deployment.client().round_keys()
    started = envloop("round", "start", "--mlflow", deployment.mlflow)
    assert started.returncode == 0, started.stdout[-3000:] + started.stderr[-3000:]
    key = deployment.client().round_keys()[-1]
    assert key not in before
    decision = deployment.client().decision(key)
    from envloop_pipelines.cli.render import decision_lines

    assert decision_lines(key, decision)[0].removesuffix(")") in started.stdout
    assert "release chain of personal_agent:" in started.stdout
    assert re.search(rf"^round {key}: 100% 13/13 step \[", started.stderr, flags=re.MULTILINE), started.stderr[-2000:]

    status = envloop("round", "status", "--json")
    rows = json.loads(status.stdout)
    assert [r["round"] for r in rows] == deployment.client().round_keys()
    assert all(r["status"] == "decided" and r["run_status"] == "SUCCESS" for r in rows)
    assert envloop("round", "status", "r0999").returncode == 1

    releases = json.loads(envloop("releases", "--json", "--mlflow", deployment.mlflow).stdout)
    local = Ledger(TASK, deployment.home).releases()
    assert [r["release"] for r in releases] == [c["release"] for c in local]
    assert [r["champion"] for r in releases] == [False] * (len(local) - 1) + [True]
    # The chain ends with the champion beside TF-IDF + LR on the holdout, as the demo's does (README).
    chain = envloop("releases", "--mlflow", deployment.mlflow).stdout.strip().splitlines()
    assert chain[-1].startswith(f"champion (release {local[-1]['release']}) on the holdout: family_macro_accuracy "), chain
    assert "TF-IDF + LR" in chain[-1] and "classical baseline" in chain[-1], chain

    decided = json.loads(envloop("ledger", "--kind", "round_decided", "--json").stdout)
    assert [e["round"] for e in decided] == [r["round"] for r in rows]
    wrong = envloop("releases", "--task", "tickets", "--mlflow", deployment.mlflow)
    assert wrong.returncode == 2 and "runs task 'personal_agent', not 'tickets'" in wrong.stderr
