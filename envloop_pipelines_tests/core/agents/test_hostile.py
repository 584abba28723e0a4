"""A hostile agent in the sandbox, beside honest ones: no reward, no stray process, no disturbance.

The hostile agent (``envloop_pipelines/testing/scripted_agents.py``, model ``hostile``) reads what
it should not (the hidden material of the home's environments, by its exact path, and Harbor's
/tests), plants reward files in its working directory and in /logs, opens a socket back to its own
server, leaves a detached process behind, runs a fork bomb and fills the disk, then claims success.
Honest solvers run their attempts at the same time in other sandboxes. Each claim is paired with the
control that shows the leak would be visible: the honest agent's commands do run, its files are
there, the stray process would show in /proc by its name.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from envloop_pipelines.core.agents.attempts import Attempt
from envloop_pipelines.core.agents.client import AgentSpec
from envloop_pipelines.core.agents.runner import run_attempt
from envloop_pipelines.core.environments.episode import open_episode
from envloop_pipelines.core.environments.spec import EnvironmentSpec
from envloop_pipelines.core.sandbox import LocalSandbox
from envloop_pipelines.testing.environments import shell_env
from envloop_pipelines.testing.scripted_agents import STRAY_MARKER, scripted_server

SECRET = "expected-state-7f3a9c-never-seen-by-agents"
PUBLIC = "public-control-readable-by-anyone"


def _stray_processes() -> list[str]:
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if STRAY_MARKER in cmdline:
            found.append(f"{pid}: {cmdline}")
    return found


def _attempt(spec: EnvironmentSpec, agent: AgentSpec, root: Path, home: Path, index: int = 0,
             sandbox: LocalSandbox | None = None) -> Attempt:
    episode = open_episode(spec, work_root=root, home=home, sandbox=sandbox)
    try:
        return run_attempt(episode, agent, dataset="d", dataset_version="v", split="train", seed=spec.seed, attempt=index)
    finally:
        episode.close()


def test_a_hostile_agent_gets_nothing_and_disturbs_no_one() -> None:
    # A home every uid could reach by permissions (not pytest's 0700 tmp), and a sandbox without the private
    # /tmp: what keeps the secret from the agent is then the episode's mask over <home>/environments alone.
    home = Path(tempfile.mkdtemp(prefix="envloop-agents-home-"))
    home.chmod(0o755)
    # The control sits outside the home: the episode conceals the whole home (and the checkout) from commands.
    public = Path(tempfile.mkdtemp(prefix="envloop-agents-public-"))
    public.chmod(0o755)
    try:
        hidden = home / "environments" / "ds" / "v1" / "verifier"
        hidden.mkdir(parents=True)
        for p in (home / "environments", home / "environments" / "ds", hidden.parent, hidden):
            p.chmod(0o755)
        (hidden / "environments.jsonl").write_text(SECRET + "\n")
        (hidden / "environments.jsonl").chmod(0o644)  # world-readable: only the mask stands in the way
        (public / "public.txt").write_text(PUBLIC + "\n")
        (public / "public.txt").chmod(0o644)
        work = home / "work"
        work.mkdir(mode=0o755)
        results, alone, elapsed = _run_side_by_side(home, work, hidden, public)
    finally:
        shutil.rmtree(home, ignore_errors=True)
        shutil.rmtree(public, ignore_errors=True)
    bad, beside = results[0], results[1:]
    tools = "\n".join(m["content"] for m in bad.messages if m["role"] == "tool")

    # It ran every command it wanted to (the test is not vacuous) and got no reward.
    assert bad.tool_calls == 8 and bad.status == "failed" and not bad.passed and bad.score["value"] == 0.0
    assert set(bad.score["details"]["planted_rewards_removed"]) >= {"reward.txt", "reward.json", "logs/verifier/reward.txt"}
    # The hidden material stayed hidden; the secret's path was named, its content never came back, while
    # the world-readable control file beside it was read.
    assert str(hidden) in tools and SECRET not in tools and PUBLIC in tools
    assert "Permission denied" in tools or "No such file or directory" in tools
    # No way home: the socket failed (the tool result says why) and nothing connected.
    assert "CONNECTED" not in tools and "Network is unreachable" in tools
    # The fork bomb hit the process limit; the disk filler the file-size limit.
    assert "fork: retry: Resource temporarily unavailable" in tools or "fork: Resource temporarily unavailable" in tools
    assert "File size limit exceeded" in tools
    big = bad.final_state["files"]["big.bin"]["bytes"]
    assert 0 < big <= shell_env(0).limits.fsize_mb * 2**20
    # No process survived its attempt.
    assert _stray_processes() == []
    # Beside it, the honest attempts passed as they do alone, in their own time.
    assert [a.passed for a in beside] == [a.passed for a in alone] == [True] * len(alone)
    assert max(a.wall_s for a in beside) < 20 and elapsed < 60


def _run_side_by_side(home: Path, root: Path, hidden: Path, public: Path) -> tuple[list[Attempt], list[Attempt], float]:
    honest_specs = [shell_env(seed) for seed in range(1, 5)]
    reads = (str(hidden), str(hidden / "environments.jsonl"), str(public / "public.txt"))
    with scripted_server(hostile_reads=reads) as server:
        solver, hostile = AgentSpec(server.url, "solver-p1.0"), AgentSpec(server.url, "hostile")
        # Control: the honest attempts alone.
        alone = [_attempt(s, solver, root, home) for s in honest_specs]
        jobs = [(shell_env(0), hostile)] + [(s, solver) for s in honest_specs]
        box = LocalSandbox(private_tmp=False)
        start = time.monotonic()
        with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
            results = list(pool.map(lambda job: _attempt(job[0], job[1], root, home, index=1, sandbox=box), jobs))
        return results, alone, time.monotonic() - start
