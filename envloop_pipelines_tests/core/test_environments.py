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
    tasks = [DecisionEnvironment("tickets", "dev", home=home, sandboxed=False).reset(s) for s in range(6)]
    rng = np.random.default_rng(0)
    answers = [rng.dirichlet(np.ones(len(t.inputs["option_keys"]))).tolist() for t in tasks]
    tasks.append(tasks[0])  # the same question twice with another answer: scored in a second run
    answers.append(tasks[0].inputs["option_keys"][0])
    boxed = DecisionEnvironment("tickets", "dev", home=home).verify_batch(tasks, answers)
    local = DecisionEnvironment("tickets", "dev", home=home, sandboxed=False).verify_batch(tasks, answers)
    assert [(s.value, s.passed, s.status, s.details) for s in boxed] == [(s.value, s.passed, s.status, s.details) for s in local]
    assert all(s.sandbox is not None and s.sandbox.ok for s in boxed)
    assert boxed[0].sandbox.pid != boxed[-1].sandbox.pid  # two worker processes


def right_answers(home: Path, env: DecisionEnvironment) -> dict[str, str]:
    """Each question's labelled option (the soft label's argmax), keyed by task id: the answers of an oracle."""
    out = {}
    for task_id in env.task_ids:
        record_id, question_id = task_id.split("#")
        task = Task(env=env.name, seed=0, task_id=task_id, prompt="", inputs={"record_id": record_id,
                                                                                "question_id": question_id})
        label = label_of(home, env.split, task)
        index = int(np.argmax(label["soft_label"])) if label["soft_label"] is not None else label["label"]
        out[task_id] = label["option_keys"][index]
    return out


@pytest.mark.parametrize("split", ["test", "holdout"])
@pytest.mark.parametrize("sandboxed", [True, False])
def test_a_hidden_split_never_answers_per_item(home: Path, split: str, sandboxed: bool) -> None:
    """Rule 4 through an environment: no per-item verdict on test or holdout, sandboxed or not."""
    from envloop_pipelines.core.verify.runner import HiddenSplitQueryError

    env = DecisionEnvironment("tickets", split, home=home, sandboxed=sandboxed)
    task = env.reset(0)
    with pytest.raises(HiddenSplitQueryError, match="aggregate scores only, never per item"):
        env.verify(task, task.inputs["option_keys"][0])
    with pytest.raises(HiddenSplitQueryError, match="aggregate scores only, never per item"):
        env.verify_batch([task], [task.inputs["option_keys"][0]])


def test_a_hidden_split_answers_aggregate_scores_of_every_question(home: Path) -> None:
    env = DecisionEnvironment("tickets", "test", home=home)
    oracle = right_answers(home, env)
    run = env.evaluate(oracle)
    assert run.ok, run.error
    assert run.report.items == () and run.report.extra_ids == ()  # no per-item result reaches the caller
    assert run.report.n_items == run.report.n_scored == len(env.task_ids) and run.report.accuracy_all == 1.0
    assert "items" not in run.to_dict(include_items=False)["report"]
    # The aggregate of a chosen question is that question's verdict: a partial answer set is refused, whatever
    # the other rows hold (missing, or present but invalid).
    one = dict(list(oracle.items())[:1])
    partial = env.evaluate(one)
    assert not partial.ok and partial.report is None
    assert f"1 of {len(env.task_ids)} scored (missing {len(env.task_ids) - 1}, invalid 0)" in partial.error
    assert "aggregate scores only" in partial.error
    invalid = env.evaluate({**oracle, **{k: [0.5, 0.5, 0.5] for k in list(oracle)[1:]}})
    assert not invalid.ok and f"1 of {len(env.task_ids)} scored" in invalid.error
    with pytest.raises(ValueError, match="is not a question of"):
        env.evaluate({"nope#queue": "billing"})


def _predictions_key(env: DecisionEnvironment, answers: dict) -> str:
    """The holdout slot key of the predictions file ``env.evaluate(answers)`` writes."""
    import tempfile

    from envloop_pipelines.core.ledger.reads import holdout_read_key

    with tempfile.TemporaryDirectory() as tmp:
        return holdout_read_key(env.write_answers(answers, Path(tmp) / "predictions.jsonl"))


def test_a_second_holdout_read_through_an_environment_is_refused(tmp_path: Path) -> None:
    """Rule 4 through an environment: the holdout is read as a release's one read, in the task home's own ledger."""
    from envloop_pipelines.core.ledger.event_log import EVENT_HOLDOUT_READ
    from envloop_pipelines.core.ledger.ledger import Ledger
    from envloop_pipelines.core.ledger.reads import HoldoutAlreadyReadError
    from envloop_pipelines.core.ledger.reads import open_holdout_slot
    from envloop_pipelines.core.verify.runner import HiddenSplitQueryError

    home = tmp_path / "home"  # a home of its own: this test spends its releases' holdout reads
    import_file(dataset(tmp_path), "tickets", home=home)
    env = DecisionEnvironment("tickets", "holdout", home=home)
    oracle = right_answers(home, env)
    with pytest.raises(HiddenSplitQueryError, match="read once per release"):
        env.evaluate(oracle)  # no release: no read
    with pytest.raises(HiddenSplitQueryError, match="holdout_slot: Ledger at .* is not the ledger of task"):
        env.evaluate(oracle, holdout_slot=Ledger("tickets", tmp_path / "elsewhere"), release=1)  # another home's
    ledger = Ledger("tickets", home)
    # An environment's read is a person's: no slot the release step opened for its predictions, no read.
    with pytest.raises(HiddenSplitQueryError, match="no holdout slot is open for these predictions"):
        env.evaluate(oracle, holdout_slot=ledger, release=1)
    assert ledger.holdout_result(1) is None
    # With the release step's slot open for exactly these predictions (the environment writes them
    # deterministically), the read is the release's one read.
    open_holdout_slot(ledger, 1, _predictions_key(env, dict(list(oracle.items())[:1])), by="release step")
    failed = env.evaluate(dict(list(oracle.items())[:1]), holdout_slot=ledger, release=1)
    assert not failed.ok and ledger.holdout_result(1) is None  # a refused or failed read does not consume it
    open_holdout_slot(ledger, 1, _predictions_key(env, oracle), by="release step")
    first = env.evaluate(oracle, release=1)  # the verifier opens the home's ledger itself
    assert first.ok and first.report.accuracy_all == 1.0 and first.report.items == ()
    assert ledger.holdout_result(1)["metrics"] == dict(first.report.metrics)
    assert [e["release"] for e in ledger.events(EVENT_HOLDOUT_READ)] == [1]
    ledger.write_release_card(1, {"release": 1, "round": "r1"}, "# release 1\n")
    with pytest.raises(HoldoutAlreadyReadError, match="each release reads it once"):
        env.evaluate(oracle, holdout_slot=ledger, release=1)
    with pytest.raises(HoldoutAlreadyReadError):
        DecisionEnvironment("tickets", "holdout", home=home).evaluate(oracle, release=1)
    assert [e["release"] for e in ledger.events(EVENT_HOLDOUT_READ)] == [1]


def test_an_open_split_evaluates_with_items(home: Path) -> None:
    env = DecisionEnvironment("tickets", "dev", home=home)
    run = env.evaluate(right_answers(home, env))
    assert run.ok and len(run.report.items) == len(env.task_ids) and all(i.correct is not False for i in run.report.items)


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
