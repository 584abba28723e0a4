"""Issue 26: a Harbor task runs here as it runs in Harbor, and import never reads outside the task folder.

The task is filled the way ``harbor init``'s pytest template says (harbor 0.26.0's
``cli/template-task/pytest-tests``): ``tests/test.sh`` runs ``pytest --ctrf /logs/verifier/ctrf.json
/tests/test_outputs.py -rA`` from the working directory, ``tests/Dockerfile`` installs pytest and the ctrf plugin,
the instruction and the tests name files under ``/app``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from envloop_pipelines.cli import main
from envloop_pipelines.core.agents.client import AgentSpec
from envloop_pipelines.core.agents.evaluate import evaluate_agent, failure_reason
from envloop_pipelines.core.environments.episode import open_episode
from envloop_pipelines.core.environments.harbor_import import import_harbor, read_task
from envloop_pipelines.core.environments.spec import SpecError
from envloop_pipelines.core.sandbox import probe_host

needs_isolation = pytest.mark.skipif(not (probe_host().mount_namespace and probe_host().setuid),
                                     reason="needs root: mount namespaces and a fresh uid per command")

TEMPLATE_TEST_SH = """#!/bin/bash

# Install test dependencies in tests/Dockerfile.
# This script runs from the working directory and writes the reward.

# CTRF produces a standard test report in JSON format which is useful for logging.
if pytest --ctrf /logs/verifier/ctrf.json /tests/test_outputs.py -rA; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
"""
TEMPLATE_TESTS_DOCKERFILE = """FROM python:3.12-slim

COPY --from=ghcr.io/astral-sh/uv:0.9.7 /uv /usr/local/bin/uv

RUN uv pip install --system pytest==8.4.1 pytest-json-ctrf==0.3.5

WORKDIR /app

COPY . /tests/
"""
TEST_OUTPUTS = '''"""The outputs of the greeting task."""
from pathlib import Path


def test_greeting():
    assert Path("/app/greeting.txt").read_text().strip() == "Hello, world!"


def test_cwd_is_app():
    assert Path.cwd() == Path("/app")
'''


def harbor_task(root: Path, name: str = "greeting", *, test_sh: str = TEMPLATE_TEST_SH) -> Path:
    """A task as harbor init writes it (schema 1.4, pytest template), filled in as its comments say."""
    task = root / name
    (task / "environment").mkdir(parents=True)
    (task / "tests").mkdir()
    (task / "solution").mkdir()
    (task / "task.toml").write_text('schema_version = "1.4"\n\n[metadata]\n\n[verifier]\ntimeout_sec = 900.0\n\n'
                                    '[agent]\ntimeout_sec = 900.0\n\n[environment]\nbuild_timeout_sec = 600.0\n')
    (task / "instruction.md").write_text("Write the line 'Hello, world!' to /app/greeting.txt.\n")
    (task / "environment" / "Dockerfile").write_text("FROM ubuntu:24.04\n\n# Install or copy over any environment "
                                                      "dependencies here.\n\nWORKDIR /app")
    (task / "tests" / "Dockerfile").write_text(TEMPLATE_TESTS_DOCKERFILE)
    (task / "tests" / "test.sh").write_text(test_sh)
    (task / "tests" / "test_outputs.py").write_text(TEST_OUTPUTS)
    (task / "solution" / "solve.sh").write_text("#!/bin/bash\n\n# Use this file to solve the task.\n"
                                                "echo 'Hello, world!' > /app/greeting.txt\n")
    return task


# --------------------------------------------------------------------------- import reads only the task folder


@pytest.mark.parametrize("link", ["instruction.md", "tests/extra.json", "environment/files/notes.txt", "tests"])
def test_a_symlink_in_the_task_is_refused_by_name(tmp_path: Path, link: str) -> None:
    task = harbor_task(tmp_path)
    secret = tmp_path / "elsewhere" / "verifier.jsonl"
    secret.parent.mkdir()
    secret.write_text('{"expect": "the answer"}\n')
    (task / "environment" / "files").mkdir(exist_ok=True)
    (task / "environment" / "Dockerfile").write_text("FROM ubuntu:24.04\nWORKDIR /app\nCOPY files/ /app/\n")
    target = task / link
    if target.is_dir():
        os.rename(target, tmp_path / "moved-tests")
        target.symlink_to(tmp_path / "moved-tests")
    else:
        target.unlink(missing_ok=True)
        target.symlink_to(secret)
    # Before: the link was followed (another dataset's verifier material became a starting file the agent sees).
    with pytest.raises(SpecError, match=rf"{link}.*is a symlink .*import reads only files inside the task folder"):
        read_task(task)


def test_harbor_inits_compiled_tests_are_kept_for_export_with_a_note_that_says_where_they_come_from(
        tmp_path: Path) -> None:
    task = harbor_task(tmp_path)
    (task / "tests" / "__pycache__").mkdir()
    (task / "tests" / "__pycache__" / "test_outputs.cpython-312.pyc").write_bytes(b"\xcb\r\r\n\0\0\0")
    notes: list[str] = []
    # Before: refused as "compiled Python that a local run of the tests left" (harbor init's template ships it).
    spec = read_task(task, on_note=notes.append)
    assert notes == ["tests/__pycache__/test_outputs.cpython-312.pyc: compiled Python (harbor init's template ships "
                     "tests/__pycache__, and running the tests writes it): kept as it is for export; the tests run "
                     "from their source"]
    assert "tests/__pycache__/test_outputs.cpython-312.pyc" not in spec.verifier.files  # never run
    assert spec.verifier.params["task_files"]["tests/__pycache__/test_outputs.cpython-312.pyc"]["base64"] == "yw0NCgAAAA=="


def test_the_tests_dockerfile_is_listed_as_not_reproduced(tmp_path: Path) -> None:
    notes = read_task(harbor_task(tmp_path)).meta["harbor"]["not_reproduced"]
    assert any(n.startswith("tests/Dockerfile: the verifier's image is not built here") for n in notes), notes


# --------------------------------------------------------------------------- the task runs as in Harbor


@needs_isolation
def test_the_template_task_scores_its_own_solution_1_and_a_no_op_0(tmp_path: Path) -> None:
    dataset = import_harbor(harbor_task(tmp_path / "tasks"), name="greeting", home=tmp_path / "home")
    (spec,) = dataset.environments
    # The oracle agent runs solution/solve.sh (which writes /app/greeting.txt): before, `pytest --ctrf` was an
    # unknown option and test_outputs.py looked in /app, so the right solver scored 0.
    oracle = evaluate_agent(dataset, AgentSpec.oracle(), attempts=2, work_root=tmp_path, home=tmp_path / "home",
                            store=False)
    assert oracle.statuses == {"passed": 2, "failed": 0, "error": 0}, [failure_reason(a) for a in oracle.attempts]
    assert oracle.pass_at_1.value == 1.0
    # A no-op agent fails, and says why (pytest's failing assertion).
    episode = open_episode(spec, work_root=tmp_path, home=tmp_path / "home")
    try:
        score = episode.verify()
    finally:
        episode.close()
    assert score.status == "scored" and not score.passed and score.details["reward"] == 0.0
    assert "FAILED" in score.details["tests"]["stdout_tail"] and "greeting.txt" in score.details["tests"]["stdout_tail"]
    # An agent that follows the instruction literally: its command starts in /app, and /app is its folder.
    episode = open_episode(spec, work_root=tmp_path, home=tmp_path / "home")
    try:
        ran = episode.run("pwd; echo 'Hello, world!' > /app/greeting.txt; ls")
        score = episode.verify()
    finally:
        episode.close()
    assert ran.stdout_tail.split() == ["/app", "greeting.txt"]
    assert score.passed and score.details["reward"] == 1.0
    assert sorted(p.name for p in tmp_path.glob("envloop-episode-*")) == []  # every episode folder is gone


@needs_isolation
def test_a_verifier_that_breaks_is_an_error_not_the_agents_failure(tmp_path: Path) -> None:
    broken = TEMPLATE_TEST_SH.replace("-rA", "-rA --no-such-option")
    dataset = import_harbor(harbor_task(tmp_path / "tasks", test_sh=broken), name="broken", home=tmp_path / "home")
    result = evaluate_agent(dataset, AgentSpec.oracle(), attempts=1, work_root=tmp_path, home=tmp_path / "home",
                            store=False)
    (attempt,) = result.attempts
    # Before: status failed (reward 0), the reason only inside attempts.jsonl.
    assert attempt.status == "error" and attempt.score["status"] == "error"
    assert "the tests could not run: pytest refused its command line: unrecognized arguments: --no-such-option" \
        in attempt.error
    assert result.why == {"error: verifier": attempt.error}


# --------------------------------------------------------------------------- the CLI


def _cli(args: list[str], home: Path) -> object:
    return CliRunner().invoke(main, ["env", *args, "--home", str(home)], catch_exceptions=False)


@needs_isolation
def test_cli_import_then_eval_agent_oracle_passes_and_prints_why(tmp_path: Path) -> None:
    home = tmp_path / "home"
    harbor_task(tmp_path / "tasks")
    harbor_task(tmp_path / "tasks", "unsolved").joinpath("solution", "solve.sh").write_text("#!/bin/bash\ntrue\n")
    imported = _cli(["import", str(tmp_path / "tasks"), "--name", "greet"], home)
    assert imported.exit_code == 0, imported.output
    ran = _cli(["eval", "--dataset", "greet", "--agent", "oracle", "--no-mlflow", "--workers", "2"], home)
    assert ran.exit_code == 0, ran.output
    assert "attempts 2: 1 passed, 1 failed, 0 errors" in ran.output
    why = next(line for line in ran.output.splitlines() if line.startswith("why "))
    assert why.startswith("why      failed: the tests gave reward 0.0:") and "FAILED" in why and "test_greeting" in why
    # The attempts as chat JSONL, filtered by verdict (what harbor traces export gives).
    for status, task in (("passed", "greeting"), ("failed", "unsolved")):
        out = tmp_path / f"{status}.jsonl"
        wrote = _cli(["traces", "export", "--dataset", "greet", "--status", status, "--out", str(out)], home)
        assert wrote.exit_code == 0 and "wrote 1 attempt(s) of 1 run(s)" in wrote.output, wrote.output
        (row,) = [json.loads(line) for line in out.read_text().splitlines()]
        assert row["metadata"]["environment_id"] == task and row["metadata"]["status"] == status
        assert [m["role"] for m in row["messages"]] == ["system", "user", "assistant", "tool", "assistant"]
        assert row["tools"][0]["function"]["name"] == "bash"


def test_cli_a_dead_endpoint_exits_non_zero_and_compare_sets_it_apart(tmp_path: Path) -> None:
    from envloop_pipelines.core.environments.dataset import store_dataset
    from envloop_pipelines.testing.environments import shell_env

    home = tmp_path / "home"
    store_dataset("two", [shell_env(0), shell_env(1)], source={"generator": "test"}, home=home)
    dead = _cli(["eval", "--dataset", "two", "--agent-url", "http://127.0.0.1:9/v1", "--model", "m", "--no-mlflow",
                 "--attempts", "3"], home)
    # Before: exit 0 with "6 errors".
    assert dead.exit_code == 1 and "every attempt of m at http://127.0.0.1:9/v1 errored" in dead.output
    assert "connection failed" in dead.output
    compared = _cli(["compare", "--dataset", "two"], home)
    assert compared.exit_code == 0
    assert "1 run(s) where every attempt errored (no result; not in the table):" in compared.output
    assert "pass@1" not in compared.output


def test_cli_docker_without_an_engine_says_so_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from envloop_pipelines.core.environments.dataset import store_dataset
    from envloop_pipelines.testing.environments import shell_env

    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-docker.sock")
    home = tmp_path / "home"
    store_dataset("one", [shell_env(0)], source={"generator": "test"}, home=home)
    ran = _cli(["eval", "--dataset", "one", "--agent-url", "http://127.0.0.1:9/v1", "--model", "m", "--no-mlflow",
                "--backend", "docker", "--image", "python:3.12-slim"], home)
    assert ran.exit_code == 1 and "--backend docker: no docker engine answers on this machine" in ran.output
    assert ran.output.count("\n") == 1
