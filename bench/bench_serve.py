"""Serving: questions/s and latency at 1, 8 and 32 concurrent clients, micro-batching on vs off, cold start.

Run: .venv/bin/python bench/bench_serve.py [--checkpoint DIR] [--requests 24,96,192] [--threads N]

The server runs as a real process on loopback (``python -m envloop_pipelines.cli.serve``),
once with micro-batching on and once with it off (``--no-batching``), on the
same checkpoint and the same requests (the built-in benchmark's records, one to
three questions each, as Jev requests). Each concurrency level sends a fixed
number of requests from that many clients, each client sending its next request
as soon as the last is answered. Printed per level: questions/s, request p50
and p99 latency, and the on/off throughput ratio. Last, scale to zero: a server
with a 2 s idle timeout unloads its model; the first request afterwards is
timed against the same request warm, with the server's own measured load time.

Without ``--checkpoint`` a small checkpoint is trained first (two steps of the
CPU recipe at ``--max-length``, about 10-20 s): its speed is a real model's,
its answers are not.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from envloop_pipelines.core.progress import configure_command_line  # noqa: E402
from envloop_pipelines.testing.serve import (  # noqa: E402 - after the path fix
    ServerProcess,
    benchmark_records,
    build_checkpoint,
    jev_request,
    start_server,
)

KEY = "bench-key"
CONCURRENCY = (1, 8, 32)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


async def _load(url: str, bodies: list[dict], clients: int, n_requests: int) -> dict[str, float]:
    """``clients`` closed-loop clients send ``n_requests`` requests in all."""
    latencies: list[float] = []
    questions = 0
    next_index = 0
    errors = 0

    async def client(c: httpx.AsyncClient) -> None:
        nonlocal next_index, questions, errors
        while next_index < n_requests:
            body = bodies[next_index % len(bodies)]
            next_index += 1
            t0 = time.perf_counter()
            r = await c.post("/v1/systemone", json=body)
            latencies.append(time.perf_counter() - t0)
            if r.status_code != 200:
                errors += 1
            else:
                questions += len(body["questions"])

    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=300,
                                 limits=httpx.Limits(max_connections=clients + 4)) as c:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(c) for _ in range(clients)))
        wall = time.perf_counter() - t0
    return {"qps": questions / wall, "p50": _percentile(latencies, 0.5), "p99": _percentile(latencies, 0.99),
            "errors": errors, "requests": len(latencies), "questions": questions, "wall": wall}


def _run_mode(checkpoint: Path, workdir: Path, bodies: list[dict], counts: dict[int, int], *, batching: bool,
              extra: list[str]) -> dict[int, dict]:
    args = ["--idle-timeout", "0", "--max-queue", "100000", *extra] + ([] if batching else ["--no-batching"])
    server = start_server(checkpoint, workdir, *args, keys=(KEY,))
    try:
        asyncio.run(_load(server.url, bodies, 4, 8))  # warm-up: first-call allocations, page cache
        return {c: asyncio.run(_load(server.url, bodies, c, counts[c])) for c in CONCURRENCY}
    finally:
        server.stop()


def _cold_start(checkpoint: Path, workdir: Path, body: dict, extra: list[str]) -> dict[str, float]:
    t0 = time.perf_counter()
    server: ServerProcess = start_server(checkpoint, workdir, "--idle-timeout", "2", *extra, keys=(KEY,))
    process_start = time.perf_counter() - t0
    try:
        headers = {"Authorization": f"Bearer {KEY}"}
        with httpx.Client(base_url=server.url, headers=headers, timeout=300) as c:
            c.post("/v1/systemone", json=body)
            warm = []
            for _ in range(5):
                t = time.perf_counter()
                c.post("/v1/systemone", json=body).raise_for_status()
                warm.append(time.perf_counter() - t)
            deadline = time.monotonic() + 30
            while server.health()["state"] != "cold":
                if time.monotonic() > deadline:
                    raise TimeoutError("the server never scaled to zero")
                time.sleep(0.1)
            rss_warm_to_cold = server.health()["rss_bytes"]
            t = time.perf_counter()
            c.post("/v1/systemone", json=body).raise_for_status()
            first = time.perf_counter() - t
            health = server.health()
        return {"process_start": process_start, "warm_median": statistics.median(warm), "first_after_idle": first,
                "server_load": health["last_cold_start_s"], "rss_cold": rss_warm_to_cold, "rss_warm": health["rss_bytes"]}
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, default=None, help="Checkpoint to serve (default: train a small one).")
    parser.add_argument("--max-length", type=int, default=256, help="max_length of the trained checkpoint (default: the CPU recipe's).")
    parser.add_argument("--requests", default="24,96,192", help="Requests sent at 1, 8 and 32 clients.")
    parser.add_argument("--threads", type=int, default=None, help="The server's torch threads (default: torch's).")
    args = parser.parse_args()
    configure_command_line()  # progress: a bar on a terminal, lines elsewhere (ENVLOOP_PROGRESS)
    extra = ["--threads", str(args.threads)] if args.threads else []
    counts = dict(zip(CONCURRENCY, (int(x) for x in args.requests.split(","))))
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp:
        tmp_path = Path(tmp)
        checkpoint = args.checkpoint
        if checkpoint is None:
            t0 = time.perf_counter()
            checkpoint = build_checkpoint(tmp_path / "ckpt", max_length=args.max_length)
            print(f"trained a small checkpoint (max_length {args.max_length}) in {time.perf_counter() - t0:.1f} s")
        bodies = [jev_request(r) for r in benchmark_records(n_users=16, records_per_user=8, seed=7)]
        per_request = sum(len(b["questions"]) for b in bodies) / len(bodies)
        print(f"requests: built-in benchmark records, {per_request:.2f} questions per request on average")
        print(f"server torch threads: {args.threads or 'default'}; cpus {os.cpu_count()}; "
              f"load average before {os.getloadavg()[0]:.2f} (other processes share these cores)")
        on = _run_mode(checkpoint, tmp_path / "on", bodies, counts, batching=True, extra=extra)
        off = _run_mode(checkpoint, tmp_path / "off", bodies, counts, batching=False, extra=extra)
        print()
        print(f"{'clients':>7} | {'batching':>8} | {'questions/s':>11} | {'p50 ms':>8} | {'p99 ms':>8} | {'requests':>8} | errors")
        for c in CONCURRENCY:
            for label, res in (("on", on[c]), ("off", off[c])):
                print(f"{c:>7} | {label:>8} | {res['qps']:>11.1f} | {res['p50'] * 1000:>8.1f} | {res['p99'] * 1000:>8.1f} | "
                      f"{res['requests']:>8} | {res['errors']}")
        print()
        for c in CONCURRENCY:
            print(f"micro-batching on/off at {c:>2} clients: questions/s ratio {on[c]['qps'] / off[c]['qps']:.2f}, "
                  f"p99 ratio {on[c]['p99'] / off[c]['p99']:.2f}")
        cold = _cold_start(checkpoint, tmp_path / "cold", bodies[0], extra)
        print()
        print(f"process start to healthy (model preloaded): {cold['process_start']:.2f} s")
        print(f"scale to zero: first request after idle unload {cold['first_after_idle'] * 1000:.0f} ms vs warm "
              f"{cold['warm_median'] * 1000:.0f} ms (ratio {cold['first_after_idle'] / cold['warm_median']:.1f}); "
              f"server-measured model load {cold['server_load'] * 1000:.0f} ms; "
              f"rss cold {cold['rss_cold'] / 1e6:.0f} MB -> warm {cold['rss_warm'] / 1e6:.0f} MB")
        print(f"load average after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    from envloop_pipelines.console import quiet_third_party

    quiet_third_party()  # the bench prints what it measures, not a library's notes on itself
    main()
