"""Harbor task folders both ways, on real files and in the real sandbox; harbor's own lint and loader judge the export.

harbor needs Python >= 3.12, so it lives in a venv of its own (``.ci/run`` makes ``.harbor-venv``); the test
that runs it finds the interpreter through ``ENVLOOP_HARBOR_PYTHON`` and skips when there is none, unless
``ENVLOOP_REQUIRE_HARBOR=1`` (CI) makes that a failure.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest

from envloop_pipelines.core.environments.dataset import open_dataset, store_dataset
from envloop_pipelines.core.environments.episode import open_episode
from envloop_pipelines.core.environments.generators import shell_environments
from envloop_pipelines.core.environments.harbor_export import export_harbor
from envloop_pipelines.core.environments.harbor_import import import_harbor, read_task
from envloop_pipelines.core.environments.spec import EnvironmentSpec, SpecError
from envloop_pipelines.testing.environments import decision_env

REPO = Path(__file__).resolve().parents[2]
HARBOR_PYTHON_ENV = "ENVLOOP_HARBOR_PYTHON"
REQUIRE_HARBOR_ENV = "ENVLOOP_REQUIRE_HARBOR"
PLANT = ("echo 1 > reward.txt; echo '{\"reward\": 1}' > reward.json; mkdir -p logs/verifier; "
         "echo 1 > logs/verifier/reward.txt; echo 1 > /logs/verifier/reward.txt 2>/dev/null; true")


def verdict(spec: EnvironmentSpec, command: str, home: Path) -> tuple[bool, str]:
    """(passed, status) of one attempt that runs ``command`` and stops."""
    episode = open_episode(spec, work_root=home, home=home)
    try:
        episode.run(command)
        score = episode.verify()
        return score.passed, score.status
    finally:
        episode.close()


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("harbor")
    home = root / "home"
    envs = shell_environments(6, heldout=2, seed=0)
    dataset = store_dataset("shell-six", [*envs, decision_env(0)], source={"generator": "test"}, home=home)
    done = export_harbor(dataset, root / "tasks", include_heldout=True)
    return {"root": root, "home": home, "dataset": dataset, "export": done}


def test_export_writes_one_task_per_terminal_environment(exported: dict) -> None:
    done, dataset = exported["export"], exported["dataset"]
    assert done.skipped == ("decision/route-0",) and sorted(done.tasks) == [f"shell/{s:04d}" for s in range(6)]
    folder = done.tasks["shell/0001"]
    spec = next(e for e in dataset.environments if e.id == "shell/0001")
    assert sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()) == sorted(
        ["task.toml", "instruction.md", "environment/Dockerfile", "tests/test.sh", "tests/check.py",
         "tests/params.json", "solution/solve.sh", *(f"environment/files/{f}" for f in spec.files)])
    assert (folder / "instruction.md").read_text() == spec.instruction + "\n"
    assert json.loads((folder / "tests" / "params.json").read_text()) == spec.verifier.params
    import tomllib

    config = tomllib.loads((folder / "task.toml").read_text())
    assert config["schema_version"] == "1.4" and config["artifacts"] == ["/app"]
    assert config["verifier"] == {"timeout_sec": spec.verifier.limits.wall_s, "environment_mode": "separate"}
    assert config["environment"] == {"cpus": 1, "memory_mb": spec.limits.mem_mb, "network_mode": "no-network",
                                     "workdir": "/app"}
    assert config["agent"]["timeout_sec"] > 0 and config["metadata"]["envloop"]["id"] == "shell/0001"
    # The agent's image gets the starting files, never the tests or the solution.
    dockerfile = (folder / "environment" / "Dockerfile").read_text()
    assert "COPY files/ /app/" in dockerfile and "tests" not in dockerfile and "solution" not in dockerfile
    with pytest.raises(FileExistsError, match="not an empty folder"):
        export_harbor(dataset, done.out, include_heldout=True)


def test_export_then_import_gives_the_same_agent_views_and_verdicts(exported: dict) -> None:
    home = exported["home"]
    back = import_harbor(exported["export"].out, name="shell-back", home=home)
    original = {e.id: e for e in exported["dataset"].environments if e.kind == "terminal"}
    assert [e.id for e in back.environments] == sorted(original)
    for spec in back.environments:
        before = original[spec.id]
        assert spec.agent_view() == before.agent_view()
        assert spec.verifier.kind == "tests" and before.verifier.kind == "terminal"
        assert spec.solution == before.solution and spec.verifier.limits == before.verifier.limits
        for command in (before.solution, "true", PLANT):
            assert verdict(spec, command, home) == verdict(before, command, home), (spec.id, command)
        assert verdict(spec, before.solution, home) == (True, "scored")
    assert open_dataset("shell-back", home=home).version == back.version
    assert import_harbor(exported["export"].out, name="shell-back", home=home).version == back.version  # idempotent


def write_task(folder: Path, *, toml: str | None = None, dockerfile: str | None = None,
               test_sh: str | None = None, solve: str | None = None, instruction: str = "") -> Path:
    """A hand-written Harbor task in the style of terminal-bench: its tests check /app and write the reward."""
    files = {
        "task.toml": toml if toml is not None else textwrap.dedent("""\
            schema_version = "1.4"

            [task]
            name = "acme/sum-column"

            [metadata]
            author_name = "A. Person"
            difficulty = "easy"
            tags = ["csv", "awk"]

            [verifier]
            timeout_sec = 120.0

            [agent]
            timeout_sec = 300.0

            [environment]
            cpus = 2
            memory_mb = 2048
            workdir = "/app"
            """),
        "instruction.md": instruction or "<!-- canary GUID 1234 -->\n\nSum the second column of data/prices.csv "
                                         "(skip the header) and write the total into /app/total.txt.\n",
        "environment/Dockerfile": dockerfile if dockerfile is not None else textwrap.dedent("""\
            FROM ubuntu:24.04
            # tools for the agent
            RUN apt-get update && \\
                apt-get install -y gawk
            WORKDIR /app
            COPY data/ /app/data/
            COPY ["notes.md", "./"]
            COPY readme.txt /app
            COPY secret.cfg /etc/acme/secret.cfg
            """),
        "environment/data/prices.csv": "item,price\napple,3\npear,4\nplum,5\n",
        "environment/notes.md": "The prices are in euros.\n",
        "environment/readme.txt": "Read me.\n",
        "environment/secret.cfg": "token=not-for-agents\n",
        "tests/test.sh": test_sh if test_sh is not None else textwrap.dedent("""\
            #!/bin/bash
            mkdir -p /logs/verifier
            if [ "$(tr -d ' \\n' < /app/total.txt 2>/dev/null)" = "$(cat /tests/expected.txt)" ]; then
              echo 1 > /logs/verifier/reward.txt
            else
              echo 0 > /logs/verifier/reward.txt
            fi
            """),
        "tests/expected.txt": "12",
        "solution/solve.sh": solve if solve is not None else "#!/bin/bash\ncd /app\n"
                                                             "awk -F, 'NR > 1 { s += $2 } END { print s }' "
                                                             "/app/data/prices.csv > /app/total.txt\n",
    }
    for rel, text in files.items():
        path = folder / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return folder


def test_an_imported_harbor_task_runs_and_verifies_here(tmp_path: Path) -> None:
    home = tmp_path / "home"
    task = write_task(tmp_path / "sum-column")
    dataset = import_harbor(task, home=home)
    (spec,) = dataset.environments
    assert dataset.name == "sum-column" and spec.id == "acme/sum-column" and spec.kind == "terminal"
    assert spec.instruction.startswith("Sum the second column")  # the canary line is dropped, as harbor does
    # The starting files are what the Dockerfile copies into the working directory; tests stay hidden.
    assert spec.files == {"data/prices.csv": "item,price\napple,3\npear,4\nplum,5\n",
                          "notes.md": "The prices are in euros.\n", "readme.txt": "Read me.\n"}
    assert sorted(spec.verifier.files) == ["tests/expected.txt", "tests/test.sh"]
    assert "expected" not in json.dumps(spec.agent_view()) and "12" not in json.dumps(spec.files)
    assert spec.verifier.params["workdir"] == "/app" and spec.verifier.limits.wall_s == 120.0
    # Every file of the folder, kept for the export (verifier side: never in the agent's view).
    assert sorted(spec.verifier.params["task_files"]) == sorted(
        p.relative_to(task).as_posix() for p in task.rglob("*") if p.is_file())
    assert spec.limits.mem_mb == 2048 and spec.limits.wall_s == 300.0  # the task's own [agent] timeout_sec
    harbor = spec.meta["harbor"]
    assert harbor["metadata"]["difficulty"] == "easy" and harbor["agent_timeout_sec"] == 300.0
    notes = " | ".join(harbor["not_reproduced"])
    assert "RUN is not run" in notes and "ubuntu:24.04" in notes and "/etc/acme/secret.cfg" in notes
    assert "network_mode 'public'" in notes
    assert "cd .\n" in spec.solution and "/app" not in spec.solution  # the working directory, where commands run
    assert verdict(spec, spec.solution, home) == (True, "scored")
    assert verdict(spec, "true", home) == (False, "scored")
    assert verdict(spec, "echo 12 > wrong.txt", home) == (False, "scored")
    # A planted reward is ignored: the tests' own verdict counts, and they see no total.
    assert verdict(spec, PLANT, home) == (False, "scored")
    # The agent cannot read the hidden tests, by Harbor's path or in the dataset's verifier folder.
    episode = open_episode(spec, work_root=home, home=home)
    try:
        seen = episode.run(f"cat /tests/expected.txt; cat {dataset.path}/verifier/verifier.jsonl; ls -R .")
        assert "expected" not in seen.stdout_tail and "test.sh" not in seen.stdout_tail
        assert "No such file" in seen.stderr_tail or "Permission denied" in seen.stderr_tail
    finally:
        episode.close()


@pytest.mark.parametrize("edit, where, field", [
    (lambda t: (t / "instruction.md").unlink(), "instruction.md", "instruction.md"),
    (lambda t: (t / "instruction.md").write_text("<!-- canary -->\n\n"), "instruction.md", "instruction.md"),
    (lambda t: (t / "task.toml").write_text("[verifier\n"), "task.toml", None),
    (lambda t: (t / "task.toml").write_text('[verifier]\ntimeout_sec = "soon"\n'), "task.toml", "verifier.timeout_sec"),
    (lambda t: (t / "task.toml").write_text('[environment]\nmemory_mb = 1.5\n'), "task.toml", "environment.memory_mb"),
    (lambda t: (t / "task.toml").write_text('schema_version = "2.0"\n'), "task.toml", "schema_version"),
    (lambda t: (t / "task.toml").write_text('[[steps]]\nname = "one"\n'), "task.toml", "steps"),
    (lambda t: (t / "task.toml").write_text('[environment]\nworkdir = "app"\n'), "task.toml", "environment.workdir"),
    (lambda t: (t / "tests" / "test.sh").unlink(), "tests/test.sh", "tests/test.sh"),
    (lambda t: (t / "environment" / "data" / "prices.csv").write_bytes(b"\xff\xfe\x00"), "environment/data/prices.csv",
     "environment/data/prices.csv"),
    (lambda t: (t / "environment" / "Dockerfile").write_text("FROM x\nCOPY missing.txt /app/\n"),
     "environment/Dockerfile:2", "COPY"),
    (lambda t: (t / "environment" / "Dockerfile").write_text("FROM x\nCOPY ../../etc/passwd /app/\n"),
     "environment/Dockerfile:2", "COPY"),
])
def test_bad_harbor_input_names_the_file_and_field(tmp_path: Path, edit, where: str, field: str | None) -> None:
    task = write_task(tmp_path / "t")
    edit(task)
    with pytest.raises(SpecError) as caught:
        read_task(task)
    message = str(caught.value)
    assert message.startswith(str(task / where)), message
    if field is not None:
        assert f"field '{field}'" in message, message


def test_a_folder_without_tasks_is_refused(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no Harbor task here"):
        import_harbor(tmp_path, home=tmp_path / "home")


# --------------------------------------------------------------------------- harbor itself, from its own venv


def harbor_python() -> Path | None:
    path = Path(os.environ.get(HARBOR_PYTHON_ENV) or REPO / ".harbor-venv" / "bin" / "python")
    if path.is_file():
        return path
    if os.environ.get(REQUIRE_HARBOR_ENV) == "1":
        pytest.fail(f"{REQUIRE_HARBOR_ENV}=1 but there is no harbor interpreter at {path} (set {HARBOR_PYTHON_ENV}; "
                    f".ci/run makes .harbor-venv)")
    pytest.skip(f"no harbor venv at {path} (python3.12 -m venv .harbor-venv && .harbor-venv/bin/pip install "
                f"harbor==0.26.0, or set {HARBOR_PYTHON_ENV})")
    return None


LOADER = """
import json, sys
from harbor.models.task.task import Task
out = []
for d in sys.argv[1:]:
    t = Task(d)
    c = t.config
    out.append({"dir": d, "valid": Task.is_valid_dir(d), "name": t.name, "instruction": t.instruction,
                "mode": c.verifier.environment_mode.value, "workdir": c.environment.workdir,
                "network": c.environment.network_mode.value, "memory_mb": c.environment.memory_mb,
                "artifacts": [a if isinstance(a, str) else a.source for a in c.artifacts],
                "id": c.metadata["envloop"]["id"]})
print(json.dumps(out))
"""


def test_harbor_lints_and_loads_the_export(exported: dict) -> None:
    python = harbor_python()
    assert python is not None
    folders = [str(p) for p in exported["export"].tasks.values()]
    harbor = python.parent / "harbor"
    linted = subprocess.run([str(harbor), "lint", "--ignore", "shared-verifier", *folders], capture_output=True,
                            text=True, timeout=300)
    assert linted.returncode == 0 and linted.stdout.strip() == "", linted.stdout + linted.stderr
    # The default rule set, shared-verifier included, passes too: the verifier runs in a separate container.
    assert subprocess.run([str(harbor), "lint", *folders], capture_output=True, timeout=300).returncode == 0
    loaded = subprocess.run([str(python), "-c", LOADER, *folders], capture_output=True, text=True, timeout=300)
    assert loaded.returncode == 0, loaded.stderr
    specs = {e.id: e for e in exported["dataset"].environments}
    for task in json.loads(loaded.stdout):
        spec = specs[task["id"]]
        assert task["valid"] and task["name"] == f"shell-six/{Path(task['dir']).name}"
        assert task["instruction"].strip() == spec.instruction
        assert (task["mode"], task["workdir"], task["network"], task["artifacts"]) == ("separate", "/app",
                                                                                        "no-network", ["/app"])
        assert task["memory_mb"] == spec.limits.mem_mb
