"""Load and lifecycle against real server processes: shedding, per-key limits, scale to zero, graceful shutdown."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from envloop_pipelines.core.ledger.ledger import Ledger
from envloop_pipelines.core.model.checkpoint import checkpoint_hash
from envloop_pipelines.testing.serve import ServerProcess, benchmark_records, jev_request, start_server

pytestmark = pytest.mark.integration

KEYS = tuple(f"load-key-{i}" for i in range(8))
IDLE_TIMEOUT_S = 3.0
MAX_QUEUE = 4
PER_KEY = 3


@pytest.fixture(scope="module")
def small_server(serve_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server with a tiny queue, a per-key limit and a short idle timeout."""
    proc = start_server(
        serve_checkpoint, tmp_path_factory.mktemp("serve-load"),
        "--idle-timeout", str(IDLE_TIMEOUT_S), "--max-queue", str(MAX_QUEUE), "--max-batch", "4", "--max-wait-ms", "20",
        "--max-inflight-per-key", str(PER_KEY),
        keys=KEYS,
    )
    yield proc
    proc.stop()


def _body(i: int) -> dict:
    """A one-question request whose option keys are its own."""
    return {"model": "jev-latest", "state": f"Ticket {i}: the parcel for order {1000 + i} never arrived.",
            "questions": {f"q{i}": {"type": "choice", "instructions": "Which tag fits?",
                                    "criteria": {f"r{i}-shipping": "delivery problems", f"r{i}-billing": None, f"r{i}-other": None}}}}


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def _fire(url: str, jobs: list[tuple[str, dict]]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=len(jobs) + 8)) as c:
        return await asyncio.gather(*(c.post("/v1/systemone", json=body, headers=_auth(key)) for key, body in jobs))


def _check_shed(r: httpx.Response) -> None:
    assert int(r.headers["retry-after"]) >= 1 and int(r.headers["retry-after-ms"]) >= 1000
    detail = r.json()["detail"]
    assert set(detail) == {"error_type", "message"} and detail["message"]
    assert r.headers["x-typesafe-request-id"]


def test_overload_sheds_with_retry_after_loses_nothing_and_mixes_nothing(small_server: ServerProcess) -> None:
    n = 48  # 8 keys x 6 requests: more than the per-key limit (3) and far more than the queue (4 questions)
    jobs = [(KEYS[i % len(KEYS)], _body(i)) for i in range(n)]
    responses = asyncio.run(_fire(small_server.url, jobs))
    assert len(responses) == n
    statuses = [r.status_code for r in responses]
    assert set(statuses) <= {200, 429, 529}, statuses
    assert statuses.count(529) >= 1, statuses
    assert statuses.count(200) >= MAX_QUEUE, statuses
    for r in responses:
        if r.status_code != 200:
            _check_shed(r)

    # none lost: every shed request succeeds when retried; none mixed: every answer is its own request's,
    # and equals the answer the same request gets alone
    with httpx.Client(base_url=small_server.url, timeout=120) as c:
        for i, (key, body) in enumerate(jobs):
            alone = c.post("/v1/systemone", json=body, headers=_auth(key))
            assert alone.status_code == 200, alone.text
            ref = alone.json()["answers"][f"q{i}"]["probabilities"]
            if responses[i].status_code == 200:
                got = responses[i].json()["answers"]
                assert list(got) == [f"q{i}"]
                assert list(got[f"q{i}"]["probabilities"]) == list(ref)
                assert list(got[f"q{i}"]["probabilities"].values()) == pytest.approx(list(ref.values()), abs=1e-5)
    assert small_server.health()["status"] == "ok" and small_server.proc.poll() is None
    metrics = httpx.get(f"{small_server.url}/metrics", headers=_auth(KEYS[0])).text
    assert 'envloop_serve_shed_total{status="529"}' in metrics


def test_per_key_in_flight_limit_answers_429(small_server: ServerProcess) -> None:
    jobs = [(KEYS[0], _body(100 + i)) for i in range(10)]
    responses = asyncio.run(_fire(small_server.url, jobs))
    statuses = [r.status_code for r in responses]
    assert set(statuses) <= {200, 429, 529}, statuses
    assert statuses.count(429) >= 1, statuses
    assert statuses.count(200) >= 1
    for r in responses:
        if r.status_code == 429:
            _check_shed(r)
    assert httpx.get(f"{small_server.url}/health").status_code == 200


def test_idle_unload_releases_memory_and_the_next_request_reloads(small_server: ServerProcess) -> None:
    body = jev_request(benchmark_records(n_users=1, records_per_user=2)[1])
    with httpx.Client(base_url=small_server.url, headers=_auth(KEYS[1]), timeout=120) as c:
        warm_answer = c.post("/v1/systemone", json=body).json()["answers"]
        warm = small_server.health()
        assert warm["state"] == "warm"
        deadline = time.monotonic() + IDLE_TIMEOUT_S + 10
        cold = warm
        while time.monotonic() < deadline and cold["state"] != "cold":
            time.sleep(0.25)
            cold = small_server.health()
        assert cold["state"] == "cold" and cold["unloads"] > warm["unloads"]
        assert cold["rss_bytes"] < warm["rss_bytes"], (warm["rss_bytes"], cold["rss_bytes"])  # memory handed back

        t0 = time.perf_counter()
        r = c.post("/v1/systemone", json=body)
        first_latency = time.perf_counter() - t0
        assert r.status_code == 200, r.text
        for qid, a in r.json()["answers"].items():  # the reloaded model answers as before
            before = warm_answer[qid]
            assert a.get("noul", 0) == pytest.approx(before.get("noul", 0), abs=1e-6)
            assert list(a.get("probabilities", {}).values()) == pytest.approx(list(before.get("probabilities", {}).values()), abs=1e-6)
        again = small_server.health()
        assert again["state"] == "warm" and again["cold_starts"] == cold["cold_starts"] + 1
        assert 0 < again["last_cold_start_s"] < first_latency
    log = small_server.log_text()
    assert log.count("cold start: model loaded in") >= 2 and "scaled to zero (idle)" in log


def test_graceful_shutdown_finishes_in_flight_requests(serve_checkpoint: Path, tmp_path: Path) -> None:
    # served from a release chain: the champion (latest card) under its versioned id
    home = tmp_path / "home"
    sha = checkpoint_hash(serve_checkpoint)
    for n in (1, 2):
        Ledger("tickets", home).write_release_card(
            n, {"release": n, "round": f"r{n:04d}", "checkpoint_dir": str(serve_checkpoint), "checkpoint_sha256": sha}, f"# {n}\n")
    server = start_server(None, tmp_path, "--task", "tickets", "--release", "champion", "--home", str(home),
                          "--graceful-timeout", "30", "--idle-timeout", "0", "--max-batch", "8", keys=(), auth_off=True)
    assert server.health()["model"] == "envloop-tickets-r0002"
    # auth explicitly off: requests with any bearer header, or none, are accepted
    assert httpx.get(f"{server.url}/v1/models", headers=_auth("anything-at-all")).status_code == 200
    assert httpx.get(f"{server.url}/v1/models").status_code == 200
    records = benchmark_records(n_users=4, records_per_user=8, seed=5)
    body = {"model": "jev-latest", "state": records[0]["state"], "questions": {
        f"q{i}": {"type": "score", "instructions": f"Question {i}: how urgent is this?", "criteria": ["low", "mid", "high"]}
        for i in range(96)  # 12 forward passes of 8: long enough to still be running at SIGTERM
    }}
    result: dict[str, httpx.Response] = {}

    def call() -> None:
        result["r"] = httpx.post(f"{server.url}/v1/systemone", json=body, headers=_auth("some-client-key"), timeout=120)

    thread = threading.Thread(target=call)
    thread.start()
    deadline = time.monotonic() + 30
    while server.health()["running_questions"] == 0:  # wait until the request is in the model
        assert time.monotonic() < deadline, "the request never reached the model"
        time.sleep(0.02)
    server.terminate()  # SIGTERM while the request is in the model
    thread.join(timeout=120)
    code = server.proc.wait(timeout=60)
    assert code in (0, -signal.SIGTERM)
    r = result["r"]
    assert r.status_code == 200, r.text
    assert len(r.json()["answers"]) == 96 and r.json()["model"] == "envloop-tickets-r0002"
    log = server.log_text()
    assert "Shutting down" in log and "Application shutdown complete" in log
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{server.url}/health", timeout=5)
