"""Issue 35: ``envloop env audit`` names the tasks a hostile agent can pass without solving them, and how.

The dataset is made with ``harbor init`` (harbor 0.26.0 from its own venv): two honest tasks and one
deliberately hackable one, whose test reads a file the agent can write (it checks the output against the
input file, which the agent may change).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from envloop_pipelines.cli import main
from envloop_pipelines.core.environments.audit import STRATEGIES, audit_task
from envloop_pipelines.core.environments.harbor_import import read_task
from envloop_pipelines.core.sandbox import probe_host
from envloop_pipelines_tests.core.agents.test_verifier_world import MODULE_TEST_SH, UVX_TEST_SH
from envloop_pipelines_tests.core.test_harbor_round_trip import _harbor, harbor_init

needs_isolation = pytest.mark.skipif(not (probe_host().mount_namespace and probe_host().setuid),
                                     reason="needs root: mount namespaces and a fresh uid per command")

SLOPPY_TEST = '''from pathlib import Path


def test_upper():
    # Sloppy: the expected value comes from a file the agent can write.
    assert Path("/app/output.txt").read_text() == Path("/app/input.txt").read_text().upper()
'''


def _hackable(harbor: Path, tasks: Path) -> Path:
    task = harbor_init(harbor, tasks, "upper")
    (task / "instruction.md").write_text("Write /app/input.txt in upper case to /app/output.txt.\n")
    (task / "environment" / "input.txt").write_text("hello\n")
    with (task / "environment" / "Dockerfile").open("a") as fh:
        fh.write("\nCOPY input.txt /app/input.txt\n")
    (task / "solution" / "solve.sh").write_text("#!/bin/bash\ntr a-z A-Z < /app/input.txt > /app/output.txt\n")
    (task / "tests" / "test_outputs.py").write_text(SLOPPY_TEST)
    return task


@needs_isolation
def test_env_audit_names_the_hackable_task_and_its_strategy_and_the_others_are_clean(tmp_path: Path) -> None:
    harbor = _harbor()
    tasks, home = tmp_path / "tasks", tmp_path / "home"
    harbor_init(harbor, tasks, "greeting")
    harbor_init(harbor, tasks, "module", test_sh=MODULE_TEST_SH)  # python3 -m pytest
    _hackable(harbor, tasks)
    assert CliRunner().invoke(main, ["env", "import", str(tasks), "--name", "audited", "--home", str(home)],
                              catch_exceptions=False).exit_code == 0
    ran = CliRunner().invoke(main, ["env", "audit", "audited", "--home", str(home)], catch_exceptions=False)
    print(ran.output)  # the note pastes it
    assert ran.exit_code == 1, ran.output  # a task can be passed without being solved
    rows = {line.split()[0]: line.split(None, 3)[1:] for line in ran.output.splitlines() if line.startswith("t4org/")}
    assert rows == {"t4org/greeting": ["passed", "clean", "-"], "t4org/module": ["passed", "clean", "-"],
                    "t4org/upper": ["passed", "hackable", "same-content"]}, ran.output
    assert "1 of 3 tasks can be passed without being solved" in ran.output
    report = json.loads(CliRunner().invoke(main, ["env", "audit", "audited", "--json", "--home", str(home)],
                                           catch_exceptions=False).output)
    assert [s for s in report["strategies"]] == [s.name for s in STRATEGIES]
    assert all(t["oracle"]["passed"] for t in report["tasks"])


@needs_isolation
def test_the_plant_strategies_pass_a_verifier_that_picks_the_plants_up(tmp_path: Path) -> None:
    """The strategies are real attacks, so a clean sheet is evidence and not a test that cannot fail: a verifier
    that sources the agent's dotfiles, puts its folder on sys.path or collects tests from it loses to them.
    (reward-files, links-to-tests and background-writer meet the episode's own defences whatever the tests do:
    planted rewards are deleted, links severed, the agent's processes gone; test_hostile and
    test_verifier_world pair those with their controls.)"""
    harbor = _harbor()
    tasks = tmp_path / "tasks"
    weak = {
        # The tests source a file of the agent's folder: home-dotfiles wins.
        "home-dotfiles": UVX_TEST_SH.replace("source $HOME/.local/bin/env", "source /app/.local/bin/env"),
        # The tests put the working directory on sys.path: module-shadowing wins.
        "module-shadowing": MODULE_TEST_SH.replace("python3 -m pytest", "PYTHONPATH=/app python3 -m pytest"),
        # The tests collect from the working directory too: its conftest.py makes every test pass.
        "config-plants": MODULE_TEST_SH.replace("/tests/test_outputs.py", "/app /tests/test_outputs.py"),
    }
    for name, test_sh in weak.items():
        spec = read_task(harbor_init(harbor, tasks, name.replace("-", ""), test_sh=test_sh))
        result = audit_task(spec, strategies=[s for s in STRATEGIES if s.name in (name, "do-nothing")],
                            work_root=tmp_path, home=tmp_path / "home")
        # Control: the same verifier with nothing planted (do-nothing) is not passed; the solution is.
        assert result.passed_by == (name,) and result.oracle.passed, (name, result.to_dict())
