"""Issue 35: the verifier runs in a world the agent never wrote.

Three hostile agents earned rewards on ``harbor init``-style tasks: a HOME hijack (the verifier's HOME was the
agent's ``/app``), module shadowing (``python3 -m pytest`` ran the agent's ``/app/pytest``), and a link to the
hidden tests (the episode's host path read from ``/proc/self/mountinfo``). Each attack runs here as the agent's
own commands in the real sandbox, beside an honest control that still passes.
"""

from __future__ import annotations

import re
import secrets
from pathlib import Path

import pytest

from envloop_pipelines.core.environments.episode import open_episode
from envloop_pipelines.core.environments.harbor_import import read_task
from envloop_pipelines.core.environments.spec import EnvironmentSpec
from envloop_pipelines.core.sandbox import probe_host
from envloop_pipelines_tests.core.test_harbor_fidelity import TEMPLATE_TEST_SH, harbor_task

needs_isolation = pytest.mark.skipif(not (probe_host().mount_namespace and probe_host().setuid),
                                     reason="needs root: mount namespaces and a fresh uid per command")
needs_pid_namespace = pytest.mark.skipif(not getattr(probe_host(), "pid_namespace", True), reason="needs a PID namespace")

HONEST = "echo 'Hello, world!' > /app/greeting.txt"

#: terminal-bench's tasks: uv's installer leaves $HOME/.local/bin/env (it puts uvx on PATH), the tests run by uvx.
UVX_TEST_SH = """#!/bin/bash
source $HOME/.local/bin/env 2> /dev/null
if command -v uvx > /dev/null; then
  uvx -p 3.12 -w pytest pytest /tests/test_outputs.py -rA
else
  python3 -m pytest /tests/test_outputs.py -rA
fi
if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
"""
#: The template's command as `python3 -m pytest`: the working directory used to come first on sys.path.
MODULE_TEST_SH = TEMPLATE_TEST_SH.replace("if pytest --ctrf", "if python3 -m pytest --ctrf")
#: A pytest of the agent's that finds the log folder from --ctrf and writes the reward.
FAKE_PYTEST = ("import os, sys\n"
               "ctrf = sys.argv[sys.argv.index('--ctrf') + 1]\n"
               "open(os.path.join(os.path.dirname(ctrf), 'reward.txt'), 'w').write('1')\n"
               "sys.exit(0)\n")


def _attempt(spec: EnvironmentSpec, commands: list[str], root: Path) -> tuple[list[str], dict]:
    """Run the agent's commands in a fresh episode, then verify; the commands' outputs and the score."""
    episode = open_episode(spec, work_root=root, home=root / "home")
    try:
        outputs = []
        for command in commands:
            ran = episode.run(command)
            assert ran.status == "ok", (command, ran.detail, ran.stderr_tail)
            outputs.append(ran.stdout_tail + ran.stderr_tail)
        score = episode.verify()
    finally:
        episode.close()
    return outputs, {"passed": score.passed, "status": score.status, **score.details}


@needs_isolation
def test_a_home_hijack_is_not_the_verifiers_home(tmp_path: Path) -> None:
    spec = read_task(harbor_task(tmp_path / "tasks", "uvx", test_sh=UVX_TEST_SH))
    plant = "mkdir -p /app/.local/bin && echo 'uvx() { return 0; }' > /app/.local/bin/env"
    _, hijack = _attempt(spec, [plant], tmp_path)
    # Before: HOME was /app, the planted uvx "passed" the tests: reward 1.0 without a greeting.
    assert not hijack["passed"] and hijack["reward"] == 0.0, hijack["tests"]
    assert "FAILED" in hijack["tests"]["stdout_tail"] and "test_greeting" in hijack["tests"]["stdout_tail"]
    # Control: the honest agent passes, with the same plant beside its answer.
    _, honest = _attempt(spec, [plant, HONEST], tmp_path)
    assert honest["passed"] and honest["reward"] == 1.0, honest["tests"]


@needs_isolation
def test_the_verifiers_home_tmpdir_and_path_are_its_own(tmp_path: Path) -> None:
    show = ("#!/bin/bash\necho \"HOME=$HOME TMPDIR=$TMPDIR PWD=$PWD\"; ls -A \"$HOME\" | wc -l; echo \"PATH=$PATH\"; "
            "echo \"SAFE=$PYTHONSAFEPATH\"; echo 1 > /logs/verifier/reward.txt\n")
    spec = read_task(harbor_task(tmp_path / "tasks", "show", test_sh=show))
    _, seen = _attempt(spec, ["touch /app/.bashrc /app/.profile; mkdir -p /app/.local/bin"], tmp_path)
    out = seen["tests"]["stdout_tail"]
    assert "HOME=/tmp/home TMPDIR=/tmp PWD=/app\n0\n" in out, out  # a fresh, empty home; Harbor's working dir
    assert "/app" not in out.split("PATH=")[1].split("\n")[0] and "SAFE=1" in out


@needs_isolation
def test_a_planted_pytest_module_is_not_run_by_python_m_pytest(tmp_path: Path) -> None:
    spec = read_task(harbor_task(tmp_path / "tasks", "module", test_sh=MODULE_TEST_SH))
    plant = f"mkdir -p /app/pytest && touch /app/pytest/__init__.py && printf %s {_sh(FAKE_PYTEST)} > /app/pytest/__main__.py"
    _, shadowed = _attempt(spec, [plant], tmp_path)
    # Before: /app came first on sys.path, the agent's pytest ran as the verifier and wrote reward.txt (1.0).
    assert not shadowed["passed"] and shadowed["reward"] == 0.0, shadowed["tests"]
    assert "test_greeting" in shadowed["tests"]["stdout_tail"]  # the real pytest ran the real tests
    _, honest = _attempt(spec, [plant, HONEST], tmp_path)
    assert honest["passed"] and honest["reward"] == 1.0, honest["tests"]


def _sh(text: str) -> str:
    import shlex

    return shlex.quote(text)


def _expected_task(root: Path) -> tuple[EnvironmentSpec, str]:
    """A task no honest agent can solve without being told: /app/answer.txt must hold a hidden random value."""
    secret = secrets.token_hex(16)
    task = harbor_task(root, "hidden")
    (task / "instruction.md").write_text("Write the hidden value to /app/answer.txt.\n")
    (task / "tests" / "expected.txt").write_text(secret + "\n")
    (task / "tests" / "test_outputs.py").write_text(
        "from pathlib import Path\n\n\ndef test_answer():\n"
        "    assert Path('/app/answer.txt').read_text() == Path('/tests/expected.txt').read_text()\n")
    return read_task(task), secret


#: Ways to name the hidden tests from the agent's phase: the episode's host path read from mountinfo (what the
#: hostile agent did), Harbor's own /tests, and /tests reached through a relative link and through /proc.
LINKS = {
    "host path from mountinfo": ("p=$(grep -o '/[^ ]*envloop-episode-[^/ ]*' /proc/self/mountinfo | head -1); "
                                 "echo \"found:$p\"; ln -s \"$p/verify/tests/expected.txt\" /app/answer.txt"),
    "/tests": "ln -s /tests/expected.txt /app/answer.txt",
    "relative": "ln -s ../tests/expected.txt /app/answer.txt",
    "/proc": "ln -s /proc/self/root/tests/expected.txt /app/answer.txt",
    "link to a linked folder": "ln -s /tests /app/t && ln -s t/expected.txt /app/answer.txt",
}


@needs_isolation
@pytest.mark.parametrize("how", sorted(LINKS))
def test_a_link_to_the_hidden_tests_resolves_as_in_the_agents_world(tmp_path: Path, how: str) -> None:
    spec, secret = _expected_task(tmp_path / "tasks")
    outputs, linked = _attempt(spec, [LINKS[how]], tmp_path)
    # Before ("host path from mountinfo"): the verifier bound the episode's folder back at its host path, the link
    # resolved to the expected value itself: reward 1.0 on a task no honest agent can solve.
    assert not linked["passed"] and linked["reward"] == 0.0, linked["tests"]
    assert secret not in linked["tests"]["stdout_tail"]
    assert all("envloop-episode" not in out for out in outputs), outputs  # the host path is not to be found
    if how != "host path from mountinfo":  # (that agent found no path: its link leads nowhere in either world)
        assert "answer.txt" in [s["path"] for s in linked["links_severed"]], linked.get("links_severed")
    # Control: a link inside the working directory still resolves, and the answer written passes.
    _, honest = _attempt(spec, [f"echo {secret} > /app/real.txt && ln -s real.txt /app/answer.txt"], tmp_path)
    assert honest["passed"] and honest["reward"] == 1.0 and "links_severed" not in honest, honest["tests"]


def test_severed_links_point_nowhere() -> None:
    from envloop_pipelines.core.environments.harbor_verifier import SEVERED_LINK

    assert not Path(SEVERED_LINK).exists()


@needs_isolation
@needs_pid_namespace
def test_inside_an_attempt_ps_and_mountinfo_show_nothing_of_other_attempts_or_host_paths(tmp_path: Path) -> None:
    spec = read_task(harbor_task(tmp_path / "tasks"))
    other = open_episode(spec, work_root=tmp_path, home=tmp_path / "home")
    episode = open_episode(spec, work_root=tmp_path, home=tmp_path / "home")
    try:
        assert other.run("sleep 0.2 & echo other").status == "ok"
        seen = episode.run("ps -e -o pid=,args=; echo ---; cat /proc/self/mountinfo")
    finally:
        episode.close()
        other.close()
    ps, mountinfo = seen.stdout_tail.split("---\n")
    print(seen.stdout_tail)  # the note pastes it
    # The run's own processes only: its init (pid 1), the command (pid 2) and ps.
    pids = [int(line.split()[0]) for line in ps.splitlines()]
    assert pids == [1, 2, 3], ps
    assert ps.splitlines()[0].split(None, 1)[1].startswith("envloop-sandbox -I -S -B /dev/fd/"), ps
    for text in (ps, mountinfo):
        assert "envloop-episode" not in text and str(tmp_path) not in text, text
    # The working directory is the episode's tmpfs folder at /app, its host path nowhere.
    app = next(line for line in mountinfo.splitlines() if line.split()[4] == "/app")
    assert app.split()[3] == "/work" and " tmpfs " in app, app
    assert re.search(r" /proc .* - proc ", mountinfo)  # its own /proc


@needs_isolation
def test_a_task_folder_inside_a_private_temp_dir_is_still_shown_there(tmp_path: Path) -> None:
    from envloop_pipelines.core.sandbox import LocalSandbox, SandboxCall

    work = tmp_path / "w"
    (work / "app").mkdir(parents=True)
    (work / "app" / "f").write_text("hi\n")
    # The bind lands in the command's fresh /tmp, after the tmpfs (a workdir = "/tmp/app" task); the host's mount of
    # the source is kept for it, not detached.
    ran = LocalSandbox().run(["/bin/sh", "-c", "pwd; cat f"],
                             SandboxCall(workdir=work, binds={"/tmp/app": work / "app"}, cwd="/tmp/app"))
    assert ran.ok and ran.stdout_tail == "/tmp/app\nhi\n", (ran.detail, ran.stderr_tail)
