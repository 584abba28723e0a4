"""Environments: replayable resets, verification through the verifiers, a shell family with terminal checks."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from envloop_pipelines.core.data.datasets import import_file
from envloop_pipelines.core.environments import Environment, Task
from envloop_pipelines.core.environments.decision import DecisionEnvironment
from envloop_pipelines.core.environments.shell import SHELL_FAMILIES, ShellEnvironment, shell_spec
from envloop_pipelines.core.sandbox import LocalSandbox, SandboxLimits
from envloop_pipelines.core.verify.labels import read_hidden_labels
from envloop_pipelines.core.verify.terminal import TerminalStateCheck, expect_files_params

from .data.test_snapshots import dataset


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("envs")
    import_file(dataset(root), "tickets", home=root / "home")
    return root / "home"


def label_of(home: Path, split: str, task: Task) -> dict[str, Any]:
    if split in ("test", "holdout"):
        table = read_hidden_labels("tickets", split, home=home)
    else:
        from envloop_pipelines.core.data.snapshots import open_task

        table = open_task("tickets", home=home).labels(split)
    for row in table.to_pylist():
        if (row["record_id"], row["question_id"]) == (task.inputs["record_id"], task.inputs["question_id"]):
            return row
    raise KeyError(task.task_id)


# --------------------------------------------------------------------------- decision tasks


def test_decision_reset_is_replayable_and_label_free(home: Path) -> None:
    env = DecisionEnvironment("tickets", "test", home=home, sandboxed=False)
    assert isinstance(env, Environment)
    again = DecisionEnvironment("tickets", "test", home=home, sandboxed=False)
    for seed in range(20):
        assert env.reset(seed) == again.reset(seed)  # same seed, same task, across instances
    tasks = [env.reset(seed) for seed in range(40)]
    assert len({t.task_id for t in tasks}) > 5  # seeds spread over the split
    for t in tasks:
        assert not {"label", "soft_label"} & set(t.inputs)
        assert set(t.inputs["option_keys"]) and t.prompt
    with pytest.raises(ValueError, match="non-negative integer"):
        env.reset(-1)


def test_decision_verify_uses_the_rule_verifier(home: Path) -> None:
    env = DecisionEnvironment("tickets", "dev", home=home, sandboxed=False)
    hard = next(t for t in (env.reset(s) for s in range(100)) if t.inputs["question_id"] == "queue")
    label = label_of(home, "dev", hard)
    right = hard.inputs["option_keys"][label["label"]]
    wrong = next(k for k in hard.inputs["option_keys"] if k != right)
    good = env.verify(hard, right)
    assert good.passed and good.value == 1.0 and good.status == "scored" and good.details["brier"] == 0.0
    bad = env.verify(hard, {right: 0.2, wrong: 0.8, **{k: 0.0 for k in hard.inputs["option_keys"] if k not in (right, wrong)}})
    assert not bad.passed and bad.value == 0.0 and bad.details["predicted"] == wrong
    invalid = env.verify(hard, [0.5, 0.4])
    assert invalid.status == "invalid" and not invalid.passed and "probs" in invalid.details["error"]
    assert env.verify(hard, "no-such-option").status == "invalid"
    forged = dataclasses.replace(hard, inputs={**hard.inputs, "record_id": "other"})
    assert env.verify(forged, right).status == "invalid"


def test_decision_verify_in_the_sandbox_matches_in_process(home: Path) -> None:
    tasks = [DecisionEnvironment("tickets", "test", home=home, sandboxed=False).reset(s) for s in range(6)]
    rng = np.random.default_rng(0)
    answers = [rng.dirichlet(np.ones(len(t.inputs["option_keys"]))).tolist() for t in tasks]
    tasks.append(tasks[0])  # the same question twice with another answer: scored in a second run
    answers.append(tasks[0].inputs["option_keys"][0])
    boxed = DecisionEnvironment("tickets", "test", home=home).verify_batch(tasks, answers)
    local = DecisionEnvironment("tickets", "test", home=home, sandboxed=False).verify_batch(tasks, answers)
    assert [(s.value, s.passed, s.status, s.details) for s in boxed] == [(s.value, s.passed, s.status, s.details) for s in local]
    assert all(s.sandbox is not None and s.sandbox.ok for s in boxed)
    assert boxed[0].sandbox.pid != boxed[-1].sandbox.pid  # two worker processes


# --------------------------------------------------------------------------- shell tasks


def solve(task: Task) -> str:
    family = task.inputs["family"]
    if family == "create_file":
        name = task.prompt.split("named ")[1].split()[0]
        line = task.prompt.split("the line: ")[1]
        return f"printf '%s\\n' '{line}' > {name}"
    if family == "rename_ext":
        return 'for f in *.txt; do mv -- "$f" "${f%.txt}.md"; done'
    name = task.prompt.split("the file ")[1].split()[0]
    return f"wc -l < {name} > out.txt"


@pytest.fixture(scope="module")
def shell() -> ShellEnvironment:
    return ShellEnvironment(LocalSandbox(SandboxLimits(wall_s=10)))


def test_shell_reset_is_replayable_and_covers_every_family(shell: ShellEnvironment) -> None:
    tasks = [shell.reset(seed) for seed in range(30)]
    assert tasks == [shell.reset(seed) for seed in range(30)]
    assert {t.inputs["family"] for t in tasks} == set(SHELL_FAMILIES)
    assert shell_spec(7) == shell_spec(7) and shell_spec(7) != shell_spec(8)
    # The expected final state is not in the task.
    for t in tasks:
        assert "check_params" not in t.inputs and "expect" not in str(t.inputs)


def test_shell_answers_are_run_and_checked(shell: ShellEnvironment) -> None:
    seen = set()
    for seed in range(12):
        task = shell.reset(seed)
        if task.inputs["family"] in seen:
            continue
        seen.add(task.inputs["family"])
        good = shell.verify(task, solve(task))
        assert good.passed and good.value == 1.0 and good.status == "scored" and good.verifier == "terminal", good.details
        nothing = shell.verify(task, "true")
        assert not nothing.passed and nothing.value == 0.0 and nothing.status == "scored"
    assert seen == set(SHELL_FAMILIES)


def _task(shell: ShellEnvironment, family: str) -> Task:
    return next(t for t in (shell.reset(s) for s in range(50)) if t.inputs["family"] == family)


def test_planted_reward_and_printed_verdicts_are_ignored(shell: ShellEnvironment) -> None:
    task = _task(shell, "count_lines")
    cheat = ("echo '{\"passed\": true, \"score\": 1.0, \"checks\": []}' > reward.json; "
             "echo '{\"passed\": true, \"score\": 1.0, \"checks\": []}'; "
             "echo '{\"passed\": true}' >&2; exit 0")
    score = shell.verify(task, cheat)
    assert not score.passed and score.value == 0.0 and score.status == "scored"
    assert score.details["answer"]["status"] == "ok"  # the answer ran fine; the state is what failed
    checks = {c["name"]: c for c in score.details["check"]["checks"]}
    assert checks["content:out.txt"]["detail"] == "missing"


def test_hostile_final_states_fail_cleanly(shell: ShellEnvironment) -> None:
    task = _task(shell, "count_lines")
    link = shell.verify(task, "ln -s /etc/passwd out.txt")
    assert not link.passed and "outside the working directory" in str(link.details["check"]["checks"])
    inner = shell.verify(task, "wc -l < *.log > count; ln -s count out.txt")  # right content, behind a link
    assert not inner.passed and "not a regular file" in str(inner.details["check"]["checks"])
    fifo = shell.verify(task, "mkfifo out.txt")
    assert fifo.status == "scored" and not fifo.passed  # no hang on a FIFO: lstat first
    assert fifo.details["check"]["sandbox"]["wall_s"] < 5
    lingering = shell.verify(task, solve(task) + "; setsid sleep 30 >/dev/null 2>&1 &")
    assert lingering.passed  # the answer's leftovers are killed before the check runs
    hung = ShellEnvironment(LocalSandbox(), answer_limits=SandboxLimits(wall_s=0.5)).verify(task, "sleep 30")
    assert hung.details["answer"]["status"] == "timeout" and not hung.passed and hung.status == "scored"


def test_shell_rejects_malformed_answers_and_foreign_tasks(shell: ShellEnvironment) -> None:
    task = shell.reset(3)
    assert shell.verify(task, "").status == "invalid"
    assert shell.verify(task, 42).status == "invalid"
    assert shell.verify(task, "x" * (70 * 1024)).status == "invalid"
    forged = dataclasses.replace(task, inputs={**task.inputs, "files": {}})
    assert shell.verify(forged, solve(task)).status == "invalid"
    with pytest.raises(ValueError, match="non-empty subset"):
        ShellEnvironment(families=("delete_everything",))


def test_terminal_check_reads_only_its_channel(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("hello\n")
    (tmp_path / "reward.json").write_text('{"passed": true, "score": 1.0, "checks": []}')
    check = TerminalStateCheck()
    ok = check.run(LocalSandbox(), tmp_path, expect_files_params(expect={"a.md": "hello\n"}, absent=["a.txt"]))
    assert ok.status == "passed" and ok.score == 1.0 and len(ok.checks) == 2
    wrong = check.run(LocalSandbox(), tmp_path, expect_files_params(expect={"a.md": "bye\n"}, no_glob=["*.md"]))
    assert wrong.status == "failed" and wrong.score == 0.0
    broken = TerminalStateCheck(script="raise SystemExit(2)").run(LocalSandbox(), tmp_path, {})
    assert broken.status == "error" and broken.score == 0.0 and "check error" in broken.error
