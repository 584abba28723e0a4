"""A small real checkpoint and a real server process, for the serve tests and ``bench/bench_serve.py``.

The checkpoint is a real one (``train_checkpoint`` on the built-in benchmark's
questions, two optimizer steps, ``max_length`` 128), so the server loads,
verifies and calibrates exactly as it would a released model. The server runs
as its own process (``python -m envloop_pipelines.cli.serve``) on a loopback
port it picks itself and reports through ``--port-file``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import httpx


def benchmark_records(n_users: int = 6, records_per_user: int = 4, seed: int = 0) -> list[dict[str, Any]]:
    """Records of the built-in benchmark (with labels and meta)."""
    from envloop_pipelines.core.benchmark import generate_benchmark
    from envloop_pipelines.core.benchmark.generator import BenchmarkConfig

    return generate_benchmark(BenchmarkConfig(n_users=n_users, records_per_user=records_per_user, seed=seed))


def jev_request(record: dict[str, Any], model: str = "jev-latest") -> dict[str, Any]:
    """A benchmark record as a Jev request (labels and meta left out)."""
    questions = {
        qid: {k: v for k, v in q.items() if k in ("type", "instructions", "criteria")} for qid, q in record["questions"].items()
    }
    return {"model": model, "state": record["state"], "questions": questions}


def build_checkpoint(out_dir: Path, *, max_length: int = 128, max_steps: int = 2, seed: int = 0) -> Path:
    """Train a small real checkpoint on benchmark questions (about 10 s on 2 cores)."""
    from envloop_pipelines.core.model.readout import questions_from_table
    from envloop_pipelines.core.model.recipe import load_recipe, shipped_recipes
    from envloop_pipelines.core.model.training import train_checkpoint
    from envloop_pipelines.core.data.question_table import questions_table
    from envloop_pipelines.core.data.records import records_from_objects

    objects = benchmark_records(n_users=6, records_per_user=4, seed=seed)
    records = records_from_objects([(o, i) for i, o in enumerate(objects)], file="gen", token_budget=None)
    questions = questions_from_table(questions_table(records))
    recipe_path = next(p for p in shipped_recipes() if p.name == "decision_head_cpu.yaml")
    recipe = load_recipe(recipe_path).replace(max_steps=max_steps, max_length=max_length, batch_size=8, eval_batch_size=32, seed=seed)
    return train_checkpoint(questions[:16], questions[16:], recipe, out_dir, data_hash=f"serve-test-{seed}")


@dataclass
class ServerProcess:
    """A server running as a subprocess."""

    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path
    key: str | None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"} if self.key else {}

    def log_text(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def health(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/health", timeout=10).json()

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM, wait; SIGKILL after ``timeout``. Returns the exit code."""
        self.terminate()
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(timeout=10)


def start_server(
    checkpoint: Path | None,
    workdir: Path,
    *args: str,
    keys: Sequence[str] = ("serve-test-key",),
    auth_off: bool = False,
    startup_timeout: float = 120,
) -> ServerProcess:
    """Start ``python -m envloop_pipelines.cli.serve`` on a free loopback port and wait until ``/health`` answers.

    ``checkpoint=None`` serves what ``args`` name instead (``--task T --release N|champion --home H``).
    """
    workdir.mkdir(parents=True, exist_ok=True)
    port_file = workdir / f"port-{time.monotonic_ns()}"
    log_path = workdir / f"server-{time.monotonic_ns()}.log"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    env.pop("ENVLOOP_SERVE_KEYS", None)
    if keys:
        env["ENVLOOP_SERVE_KEYS"] = ",".join(keys)
    source = ["--checkpoint", str(checkpoint)] if checkpoint is not None else []
    cmd = [sys.executable, "-m", "envloop_pipelines.cli.serve", *source, "--host", "127.0.0.1",
           "--port", "0", "--port-file", str(port_file), *args]
    if auth_off:
        cmd.append("--auth-off")
    log = open(log_path, "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(workdir))
    log.close()
    deadline = time.monotonic() + startup_timeout
    server: ServerProcess | None = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log_path.read_text(errors='replace')[-4000:]}")
        if server is None and port_file.exists() and port_file.read_text().strip():
            server = ServerProcess(proc, int(port_file.read_text()), log_path, keys[0] if keys else None)
        if server is not None:
            try:
                if httpx.get(f"{server.url}/health", timeout=5).status_code == 200:
                    return server
            except httpx.TransportError:
                pass
        time.sleep(0.1)
    proc.kill()
    raise TimeoutError(f"server not healthy after {startup_timeout} s:\n{log_path.read_text(errors='replace')[-4000:]}")


__all__ = ["ServerProcess", "benchmark_records", "build_checkpoint", "jev_request", "start_server"]
