"""The ``envloop env`` commands, run as a user runs them (click's CliRunner, a real home, real files)."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner, Result

from envloop_pipelines.cli import main
from envloop_pipelines.core.data.datasets import import_file
from envloop_pipelines.core.environments.dataset import open_dataset
from envloop_pipelines_tests.core.data.test_snapshots import dataset as tickets_file


def run(args: list[str], home: Path) -> Result:
    return CliRunner().invoke(main, ["env", *args], env={"ENVLOOP_HOME": str(home)}, catch_exceptions=False)


def test_every_dataset_command_is_on_the_env_group() -> None:
    assert sorted(main.commands["env"].commands) == [  # type: ignore[attr-defined]
        "audit", "compare", "eval", "export", "generate", "import", "list", "show", "traces"]


def test_generate_list_show_export_import(tmp_path: Path) -> None:
    home = tmp_path / "home"
    empty = run(["list"], home)
    assert empty.exit_code == 0 and "no environment datasets" in empty.output
    made = run(["generate", "shell", "--name", "shell-demo", "--n", "6", "--heldout", "2"], home)
    assert made.exit_code == 0, made.output
    stored = open_dataset("shell-demo", home=home)
    assert made.output.strip() == (f"stored shell-demo@{stored.version}: 6 environments "
                                   f"(splits: heldout 2, train 4; kinds: terminal 6)")
    assert run(["generate", "shell", "--name", "shell-demo", "--n", "6", "--heldout", "2"], home).output == made.output
    listed = run(["list"], home).output.splitlines()
    assert len(listed) == 2 and listed[1].split()[:2] == ["shell-demo", stored.version[:12]]
    assert "generator shell heldout=2 n=6 seed=0" in listed[1]
    assert [m["version"] for m in json.loads(run(["list", "--json"], home).output)] == [stored.version]
    # show: counts and what agents see; nothing of the verifier side (expected states, solutions).
    shown = run(["show", "shell-demo"], home)
    assert shown.exit_code == 0 and "splits: heldout 2, train 4" in shown.output
    assert len([line for line in shown.output.splitlines() if line.startswith("shell/")]) == 6
    as_json = run(["show", f"shell-demo@{stored.version[:8]}", "--json"], home).output
    assert [v["id"] for v in json.loads(as_json)["environments"]] == [e.id for e in stored.environments]
    one = json.loads(run(["show", "shell-demo", "--environment", "shell/0003"], home).output)
    assert one == stored.environments[3].agent_view()
    for env in stored.environments:
        for text in (shown.output, as_json):
            assert env.solution not in text and '"verifier"' not in text and '"expect"' not in text
    # export as Harbor tasks and import them back: the same agent views under another name.
    out = tmp_path / "tasks"
    refused = run(["export", "shell-demo", "--format", "harbor", "--out", str(out)], home)
    assert refused.exit_code == 1 and "2 held-out environment(s)" in refused.output and not out.exists()
    exported = run(["export", "shell-demo", "--format", "harbor", "--out", str(out), "--include-heldout"], home)
    assert exported.exit_code == 0 and f"exported 6 environments of shell-demo@{stored.version[:12]}" in exported.output
    assert sorted(p.name for p in out.iterdir()) == [f"shell-{s:04d}" for s in range(6)]
    again = run(["export", "shell-demo", "--out", str(out), "--include-heldout"], home)
    assert again.exit_code == 1 and "not an empty folder" in again.output
    imported = run(["import", str(out), "--name", "shell-back"], home)
    assert imported.exit_code == 0 and imported.output.startswith("imported shell-back@")
    back = open_dataset("shell-back", home=home)
    assert [e.agent_view() for e in back.environments] == [e.agent_view() for e in stored.environments]
    assert {r["name"] for r in json.loads(run(["list", "--json"], home).output)} == {"shell-demo", "shell-back"}


def test_decision_datasets_from_a_task_snapshot(tmp_path: Path) -> None:
    home = tmp_path / "home"
    import_file(tickets_file(tmp_path), "tickets", home=home)
    made = run(["generate", "decision", "--task", "tickets", "--split", "dev", "--n", "5", "--heldout", "1",
                "--name", "tickets-dev"], home)
    assert made.exit_code == 0, made.output
    assert "5 environments (splits: heldout 1, train 4; kinds: decision 5)" in made.output
    shown = run(["show", "tickets-dev", "--json"], home).output
    assert '"label"' not in shown and '"soft_label"' not in shown  # the label rows are the verifier's
    hidden = run(["generate", "decision", "--task", "tickets", "--split", "test", "--name", "x"], home)
    assert hidden.exit_code == 2 and "'test' is not one of 'train', 'val', 'dev'" in hidden.output
    skipped = run(["export", "tickets-dev", "--out", str(tmp_path / "none")], home)
    assert skipped.exit_code == 0 and "skipped 5 decision environments" in skipped.output


def test_errors_name_what_is_wrong(tmp_path: Path) -> None:
    home = tmp_path / "home"
    missing = run(["show", "nope"], home)
    assert missing.exit_code == 1 and "no environment dataset 'nope'" in missing.output
    bad_name = run(["generate", "shell", "--name", "a/b"], home)
    assert bad_name.exit_code == 1 and "dataset name" in bad_name.output
    task = tmp_path / "task"
    task.mkdir()
    (task / "task.toml").write_text('[verifier]\ntimeout_sec = "soon"\n')
    bad = run(["import", str(task)], home)
    assert bad.exit_code == 1 and f"{task / 'task.toml'}: field 'verifier.timeout_sec'" in bad.output
    (tmp_path / "empty").mkdir()
    nothing = run(["import", str(tmp_path / "empty")], home)
    assert nothing.exit_code == 1 and "no Harbor task here" in nothing.output
    eval_args = ["eval", "--dataset", "nope", "--agent-url", "http://127.0.0.1:9/v1", "--model", "m"]
    image = run([*eval_args, "--image", "alpine"], home)
    assert image.exit_code == 2 and "--image applies to the docker and k8s backends" in image.output
    backend = run([*eval_args, "--backend", "vm"], home)
    assert backend.exit_code == 2 and "'vm' is not one of 'local', 'docker', 'k8s'" in backend.output


def test_eval_runs_an_agent_on_a_generated_dataset(tmp_path: Path) -> None:
    from envloop_pipelines.testing.scripted_agents import scripted_server

    home = tmp_path / "home"
    assert run(["generate", "shell", "--name", "shell-eval", "--n", "2"], home).exit_code == 0
    with scripted_server() as server:
        result = run(["eval", "--dataset", "shell-eval", "--agent-url", server.url, "--model", "solver-p1.0",
                      "--workers", "2", "--no-mlflow", "--json"], home)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)  # progress lines go to stderr
    assert summary["dataset"] == "shell-eval" and summary["pass_at_k"][0]["value"] == 1.0
    assert summary["dataset_version"] == open_dataset("shell-eval", home=home).version
