"""Issue 35: a Harbor task comes back as it went.

``harbor init`` (harbor 0.26.0, from its own venv: ``ENVLOOP_HARBOR_PYTHON``) makes the tasks;
``envloop env import`` -> ``env eval --agent oracle`` -> ``env export`` runs on them, and the export is compared
with the original file by file, byte by byte.
"""

from __future__ import annotations

import filecmp
import os
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from envloop_pipelines.cli import main
from envloop_pipelines.core.environments.dataset import open_dataset
from envloop_pipelines.core.sandbox import probe_host
from envloop_pipelines_tests.core.test_harbor import HARBOR_PYTHON_ENV, REQUIRE_HARBOR_ENV

needs_isolation = pytest.mark.skipif(not (probe_host().mount_namespace and probe_host().setuid),
                                     reason="needs root: mount namespaces and a fresh uid per command")

TEST_OUTPUTS = '''from pathlib import Path


def test_greeting():
    assert Path("/app/greeting.txt").read_text().strip() == "Hello, world!"
'''
#: terminal-bench's test.sh: uv from the network, then the tests by uvx.
NETWORK_TEST_SH = """#!/bin/bash

apt-get update
apt-get install -y curl

curl -LsSf https://astral.sh/uv/0.9.7/install.sh | sh

source $HOME/.local/bin/env

uvx -p 3.13 -w pytest==8.4.1 pytest /tests/test_outputs.py -rA
if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
"""


def _harbor() -> Path:
    python = os.environ.get(HARBOR_PYTHON_ENV)
    if not python:
        if os.environ.get(REQUIRE_HARBOR_ENV) == "1":
            pytest.fail(f"{REQUIRE_HARBOR_ENV}=1 but {HARBOR_PYTHON_ENV} is not set")
        pytest.skip(f"{HARBOR_PYTHON_ENV} is not set (harbor needs Python >= 3.12)")
    return Path(python).parent / "harbor"


def harbor_init(harbor: Path, out: Path, name: str, *, test_sh: str | None = None) -> Path:
    """``harbor init`` a task, then fill it in as its comments say (and set its own limits)."""
    subprocess.run([str(harbor), "init", "--task", f"t4org/{name}", "--description", "Write a greeting",
                    "--author", "Ada Lovelace <ada@example.com>", "--include-standard-metadata", "-o", str(out)],
                   check=True, capture_output=True, env={**os.environ, "NO_COLOR": "1"})
    task = out / name
    (task / "instruction.md").write_text("Write the line 'Hello, world!' to /app/greeting.txt.\n")
    with (task / "solution" / "solve.sh").open("a") as fh:
        fh.write("\necho 'Hello, world!' > /app/greeting.txt\n")
    (task / "tests" / "test_outputs.py").write_text(TEST_OUTPUTS)
    if test_sh is not None:
        (task / "tests" / "test.sh").write_text(test_sh)
    toml = (task / "task.toml").read_text()
    toml = toml.replace('keywords = []', 'keywords = ["greeting", "files"]')
    toml = toml.replace('[agent]\ntimeout_sec = 600.0', '[agent]\ntimeout_sec = 120.0')
    toml = toml.replace('[verifier]\ntimeout_sec = 600.0', '[verifier]\ntimeout_sec = 90.0')
    toml = toml.replace('network_mode = "public"', 'network_mode = "public"\ncpus = 2\nmemory_mb = 1024')
    (task / "task.toml").write_text(toml)
    return task


def _differences(a: Path, b: Path) -> list[str]:
    """Files only on one side, or whose bytes differ, between two folders (recursively)."""
    cmp = filecmp.dircmp(a, b)
    out = [f"only in {a}: {n}" for n in cmp.left_only] + [f"only in {b}: {n}" for n in cmp.right_only]
    out += [f"differs: {n}" for n in cmp.common_files if not filecmp.cmp(a / n, b / n, shallow=False)]
    for sub in cmp.common_dirs:
        out += _differences(a / sub, b / sub)
    return out


def _cli(args: list[str], home: Path) -> object:
    return CliRunner().invoke(main, ["env", *args, "--home", str(home)], catch_exceptions=False)


@needs_isolation
def test_harbor_init_import_eval_export_gives_the_task_back_byte_for_byte(tmp_path: Path) -> None:
    harbor = _harbor()
    tasks, home = tmp_path / "tasks", tmp_path / "home"
    greeting = harbor_init(harbor, tasks, "greeting")
    online = harbor_init(harbor, tasks, "online", test_sh=NETWORK_TEST_SH)
    assert (greeting / "tests" / "__pycache__").is_dir()  # harbor init's own template ships compiled Python

    imported = _cli(["import", str(tasks), "--name", "greet"], home)
    # Before: refused as "compiled Python that a local run of the tests left"; nothing said about the network.
    assert imported.exit_code == 0, imported.output
    assert ("note  greeting: tests/__pycache__/test_outputs.cpython-312.pyc: compiled Python (harbor init's "
            "template ships tests/__pycache__") in imported.output
    assert ("note  online: tests/test.sh:3: apt-get update: needs the network, which environments here do not "
            "have") in imported.output
    assert "note  online: tests/test.sh:6: curl -LsSf https://astral.sh/uv/0.9.7/install.sh | sh: needs" \
        in imported.output

    # The task's own limits, not the defaults (30 s wall, 10 s CPU, 512 MB, 16 processes, 8 MB files).
    specs = {e.id: e for e in open_dataset("greet", home=home).environments}
    spec = specs["t4org/greeting"]
    assert (spec.limits.wall_s, spec.limits.cpu_s, spec.limits.mem_mb) == (120.0, 240.0, 1024)
    assert spec.limits.nproc >= 256 and spec.limits.fsize_mb >= 64
    assert (spec.verifier.limits.wall_s, spec.verifier.limits.cpu_s, spec.verifier.limits.mem_mb) == (90.0, 180.0, 1024)

    ran = _cli(["eval", "--dataset", "greet", "--agent", "oracle", "--no-mlflow", "--workers", "2"], home)
    assert ran.exit_code == 0, ran.output
    assert "attempts 2: 1 passed, 0 failed, 1 errors" in ran.output, ran.output
    why = next(line for line in ran.output.splitlines() if line.startswith("why "))
    assert why.startswith("why      error: verifier: ") and ("the tests could not run: they need the network, which "
                                                           "environments here do not have: tests/test.sh:3: apt-get "
                                                           "update (and 3 more)") in why, why

    exported = _cli(["export", "greet", "--out", str(tmp_path / "out")], home)
    assert exported.exit_code == 0, exported.output
    assert "2 imported Harbor task(s) written back as they came: every file byte for byte" in exported.output
    # Before: ubuntu:24.04 became python:3.12-slim, the name, version, authors, keywords, description and network
    # mode changed, cpus/memory/artifacts were added, solve.sh got a second shebang, the .pyc was refused.
    for task in (greeting, online):
        back = tmp_path / "out" / f"t4org-{task.name}"
        assert _differences(task, back) == [], _differences(task, back)
        assert {p.relative_to(back): p.stat().st_mode for p in back.rglob("*")} == {
            p.relative_to(task): p.stat().st_mode for p in task.rglob("*")}
        # harbor's own verdict on both: the same.
        lint = [subprocess.run([str(harbor), "lint", str(t)], capture_output=True, text=True) for t in (task, back)]
        assert lint[0].returncode == lint[1].returncode and lint[0].stdout.replace(str(task), "") == \
            lint[1].stdout.replace(str(back), ""), (lint[0].stdout, lint[1].stdout)
    # Importing the export gives the same dataset version.
    first = open_dataset("greet", home=home).version
    again = _cli(["import", str(tmp_path / "out"), "--name", "greet"], home)
    assert again.exit_code == 0 and f"greet@{first[:12]}" in again.output, (first, again.output)


@needs_isolation
def test_test_output_names_tests_paths_as_harbor_shows_them(tmp_path: Path) -> None:
    from envloop_pipelines.core.environments.episode import open_episode
    from envloop_pipelines.core.environments.harbor_import import read_task

    from envloop_pipelines_tests.core.test_harbor_fidelity import harbor_task

    spec = read_task(harbor_task(tmp_path / "tasks"))  # harbor init's template, filled in
    episode = open_episode(spec, work_root=tmp_path, home=tmp_path / "home")
    try:
        score = episode.verify()
    finally:
        episode.close()
    out = score.details["tests"]["stdout_tail"]
    # Before: ../tmp/envloop-episode-.../verify/tests/test_outputs.py
    assert "\n/tests/test_outputs.py:6: " in out and "FAILED ../tests/test_outputs.py::test_greeting" in out, out
    assert "envloop-episode" not in out and str(tmp_path) not in out
