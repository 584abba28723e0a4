"""Agent attempts: sandboxed attempts per second and the sandbox's overhead against the same commands run bare.

    .venv/bin/python bench/bench_agents.py [--envs 12] [--attempts 2] [--workers 1,4] [--calls 20]

One run, side by side:

* **per command**: the commands of a solving attempt (``ls -la``, then the
  solution script) run bare (``subprocess.run(["bash", "-c", ...])`` in a
  temporary directory) and as the tool call of an episode (``Episode.run``: a
  fresh sandboxed process with the environment's limits, its own uid, no
  network, the hidden paths masked); median milliseconds and the ratio;
* **per verification**: the terminal-state check run bare (the same check
  script, the verdict over a pipe) and the episode's ``verify()`` (planted
  rewards stripped, the check in a fresh sandboxed process);
* **whole attempts**: a scripted agent behind a real OpenAI-compatible HTTP
  server (``envloop_pipelines/testing/scripted_agents.py``, the solver that
  always solves) makes ``--attempts`` attempts at each of ``--envs`` shell
  environments through the runner (``run_attempt``), once with sandboxed
  episodes and once with bare ones, with 1 and N attempts side by side;
  attempts per second and the ratio. The bare runs must pass exactly as the
  sandboxed ones do, or the comparison is void (the script stops).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Mapping

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from envloop_pipelines.core.agents.client import AgentSpec  # noqa: E402 - after the path fix
from envloop_pipelines.core.agents.runner import run_attempt  # noqa: E402
from envloop_pipelines.core.environments.base import Score  # noqa: E402
from envloop_pipelines.core.environments.episode import open_episode  # noqa: E402
from envloop_pipelines.core.environments.spec import EnvironmentSpec  # noqa: E402
from envloop_pipelines.core.sandbox import SandboxResult, probe_host  # noqa: E402
from envloop_pipelines.core.verify.terminal import EXPECT_FILES  # noqa: E402
from envloop_pipelines.testing.environments import shell_env  # noqa: E402
from envloop_pipelines.testing.scripted_agents import scripted_server, solution  # noqa: E402
from envloop_pipelines.core.progress import configure_command_line  # noqa: E402

_BASH = ["/bin/bash", "--noprofile", "--norc", "-c"]


class BareEpisode:
    """The same environment with no sandbox: commands and the check as plain subprocesses in a temp dir."""

    def __init__(self, spec: EnvironmentSpec, *, work_root: Path | None = None, **_: Any) -> None:
        self.spec = spec
        self.environment_id, self.instruction, self.tools, self.question = spec.id, spec.instruction, spec.tools, None
        self.root = Path(tempfile.mkdtemp(prefix="bench-bare-", dir=work_root))
        for rel, text in spec.files.items():
            (self.root / rel).parent.mkdir(parents=True, exist_ok=True)
            (self.root / rel).write_text(text, encoding="utf-8")

    def run(self, command: str) -> SandboxResult:
        start = time.perf_counter()
        p = subprocess.run([*_BASH, command], cwd=self.root, capture_output=True, timeout=self.spec.limits.wall_s)
        return SandboxResult(ok=p.returncode == 0, exit_code=p.returncode, signal=None,
                             status="ok" if p.returncode == 0 else "error", wall_s=time.perf_counter() - start, cpu_s=0.0,
                             stdout_tail=p.stdout.decode(errors="replace")[-8192:],
                             stderr_tail=p.stderr.decode(errors="replace")[-8192:], network_isolated=False,
                             backend="bare", pid=0)

    def submit(self, answer: Any) -> None:
        pass

    def verify(self) -> Score:
        read, write = os.pipe()
        try:
            p = subprocess.run([sys.executable, "-c", EXPECT_FILES], cwd=self.root, pass_fds=(write,),
                               input=json.dumps(dict(self.spec.verifier.params)).encode(), capture_output=True,
                               env={**os.environ, "ENVLOOP_RESULT_FD": str(write)}, timeout=60)
            os.close(write)
            write = -1
            with os.fdopen(read, "rb") as fh:
                verdict = json.loads(fh.read() or b"{}")
            read = -1
        finally:
            for fd in (read, write):
                if fd >= 0:
                    os.close(fd)
        if p.returncode != 0 or "passed" not in verdict:
            raise SystemExit(f"bare check failed: {p.stderr.decode(errors='replace')[-500:]}")
        return Score(1.0 if verdict["passed"] else 0.0, bool(verdict["passed"]), "scored", "terminal", verdict)

    def final_state(self) -> Mapping[str, Any]:
        return {}

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def median_ms(fn: Callable[[], object], n: int) -> float:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def attempts_per_s(specs: list[EnvironmentSpec], attempts: int, workers: int, agent: AgentSpec,
                   opener: Callable[..., Any], work_root: Path, home: Path) -> tuple[float, int, int]:
    """(attempts per second, attempts, passed) for every (spec, attempt) run with ``workers`` side by side."""
    jobs = [(s, a) for s in specs for a in range(attempts)]

    def one(job: tuple[EnvironmentSpec, int]) -> bool:
        spec, index = job
        episode = opener(spec, work_root=work_root, home=home)
        try:
            return run_attempt(episode, agent, dataset="bench", dataset_version="v", split=spec.split, seed=spec.seed,
                               attempt=index).passed
        finally:
            episode.close()

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        passed = sum(pool.map(one, jobs))
    return len(jobs) / (time.perf_counter() - start), len(jobs), passed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--envs", type=int, default=12, help="shell environments (seeds 0..envs-1)")
    parser.add_argument("--attempts", type=int, default=2, help="attempts per environment")
    parser.add_argument("--workers", default="1,4", help="attempts side by side, comma-separated")
    parser.add_argument("--calls", type=int, default=20, help="repeats of each per-command and per-verify timing")
    args = parser.parse_args()
    configure_command_line()  # progress: a bar on a terminal, lines elsewhere (ENVLOOP_PROGRESS)
    workers = [int(w) for w in args.workers.split(",")]

    support = probe_host()
    print(f"host: root={support.root} netns={support.network_namespace} mountns={support.mount_namespace} "
          f"setuid={support.setuid} cpus={os.cpu_count()} python={sys.version.split()[0]}")
    specs = [shell_env(seed) for seed in range(args.envs)]
    with tempfile.TemporaryDirectory(prefix="bench-agents-") as tmp:
        root, home = Path(tmp), Path(tmp) / "home"

        print(f"\nper command (median of {args.calls})")
        print(f"{'command':<34} {'bare ms':>8} {'sandboxed ms':>13} {'ratio':>6}")
        spec = specs[0]
        for label, command in (("ls -la", "ls -la"), ("the solution script", solution(spec.instruction))):
            bare = BareEpisode(spec, work_root=root)
            boxed = open_episode(spec, work_root=root, home=home)
            try:
                t_bare = median_ms(lambda: bare.run(command), args.calls)
                t_boxed = median_ms(lambda: boxed.run(command), args.calls)
            finally:
                bare.close()
                boxed.close()
            print(f"{label:<34} {t_bare:>8.1f} {t_boxed:>13.1f} {t_boxed / t_bare:>5.1f}x")

        def verify_ms(opener: Callable[..., Any]) -> float:
            def once() -> None:
                ep = opener(spec, work_root=root, home=home)
                try:
                    ep.run(solution(spec.instruction))
                    start = time.perf_counter()
                    assert ep.verify().passed
                    times.append(time.perf_counter() - start)
                finally:
                    ep.close()
            times: list[float] = []
            for _ in range(args.calls):
                once()
            return statistics.median(times) * 1e3

        t_bare, t_boxed = verify_ms(BareEpisode), verify_ms(open_episode)
        print(f"{'verification (terminal check)':<34} {t_bare:>8.1f} {t_boxed:>13.1f} {t_boxed / t_bare:>5.1f}x")

        with scripted_server() as server:
            agent = AgentSpec(server.url, "solver-p1.0")
            print(f"\nwhole attempts: {args.envs} environments x {args.attempts} attempts, a scripted agent over HTTP "
                  f"(3 model calls, 2 tool calls, 1 verification each)")
            print(f"{'workers':>7} {'bare att/s':>11} {'sandboxed att/s':>16} {'ms/att bare':>12} {'ms/att sandboxed':>17} "
                  f"{'ratio':>6}")
            attempts_per_s(specs[:2], 1, 1, agent, BareEpisode, root, home)  # warm up: imports, connections
            attempts_per_s(specs[:2], 1, 1, agent, open_episode, root, home)
            for w in workers:
                r_bare, n, p_bare = attempts_per_s(specs, args.attempts, w, agent, BareEpisode, root, home)
                r_boxed, _, p_boxed = attempts_per_s(specs, args.attempts, w, agent, open_episode, root, home)
                if p_bare != n or p_boxed != n:
                    raise SystemExit(f"the solver should pass every attempt: bare {p_bare}/{n}, sandboxed {p_boxed}/{n}")
                print(f"{w:>7} {r_bare:>11.2f} {r_boxed:>16.2f} {1e3 / r_bare:>12.0f} {1e3 / r_boxed:>17.0f} "
                      f"{r_bare / r_boxed:>5.1f}x")
    print("\nratio = sandboxed time / bare time. The agent's HTTP round trips are in both columns of the whole "
          "attempts;\nthe difference is the sandbox (process setup, uid, namespaces, masks, the sweep) and the "
          "sandboxed verifier.")


if __name__ == "__main__":
    from envloop_pipelines.console import quiet_third_party

    quiet_third_party()  # the bench prints what it measures, not a library's notes on itself
    main()
