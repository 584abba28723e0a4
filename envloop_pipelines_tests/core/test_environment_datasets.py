"""Environment datasets on disk: content addressing, immutability, the owner-only verifier part, the generators.

Real files under a temporary home and real sandboxes: the reference solutions are run in episodes and pass,
a no-op fails, and an agent evaluated over real HTTP on an opened dataset replays from the store.
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat
from pathlib import Path

import pytest

from envloop_pipelines.core.data.datasets import import_file
from envloop_pipelines.core.data.snapshots import open_task
from envloop_pipelines.core.environments.dataset import (
    ENVIRONMENTS_FILE,
    MANIFEST_FILE,
    VERIFIER_DIR,
    VERIFIER_FILE,
    dataset_version,
    list_datasets,
    open_dataset,
    store_dataset,
)
from envloop_pipelines.core.environments.episode import open_episode
from envloop_pipelines.core.environments.generators import (
    decision_environments,
    generate_dataset,
    shell_environments,
    synthesis_dataset_name,
    synthesis_environments,
)
from envloop_pipelines.core.environments.spec import SpecError, VerifierSpec
from envloop_pipelines.core.sandbox import SandboxLimits
from envloop_pipelines.testing.environments import decision_env, shell_env, spec_set

from .data.test_snapshots import dataset as tickets_file


def _writable(folder: Path) -> None:
    """Let the test edit a stored version (the store made it read-only)."""
    for path in [folder, *folder.rglob("*")]:
        path.chmod(0o700 if path.is_dir() else 0o600)


# --------------------------------------------------------------------------- store and open


def test_store_and_open_round_trip(tmp_path: Path) -> None:
    specs = [shell_env(2, split="heldout"), decision_env(1), shell_env(0), shell_env(1)]
    stored = store_dataset("mixed", specs, source={"generator": "test"}, home=tmp_path)
    ordered = tuple(sorted(specs, key=lambda e: e.id))
    assert stored.environments == ordered  # both sides, the verifier loaded
    # The version is the hash of the fingerprints in id order: what the agent tests' in-memory SpecSet computes.
    assert stored.version == dataset_version(specs) == spec_set("mixed", list(ordered)).version
    assert stored.path == tmp_path / "environments" / "mixed" / stored.version
    assert stored.manifest["counts"] == {"environments": 4, "splits": {"heldout": 1, "train": 3},
                                         "kinds": {"decision": 1, "terminal": 3},
                                         "verifiers": {"rule": 1, "terminal": 3}}
    assert stored.manifest["source"] == {"generator": "test"} and stored.manifest["name"] == "mixed"
    opened = open_dataset("mixed", home=tmp_path)
    assert (opened.name, opened.version, opened.environments) == ("mixed", stored.version, ordered)
    assert open_dataset(f"mixed@{stored.version[:10]}", home=tmp_path).version == stored.version
    assert [m["version"] for m in list_datasets(home=tmp_path)] == [stored.version]


def test_the_same_environments_are_the_same_version_and_nothing_is_rewritten(tmp_path: Path) -> None:
    specs = [shell_env(s) for s in range(4)]
    first = store_dataset("shells", specs, source={"generator": "a"}, home=tmp_path)
    stamps = {p: p.stat().st_mtime_ns for p in first.path.rglob("*")}
    again = store_dataset("shells", list(reversed(specs)), source={"generator": "b"}, home=tmp_path)
    assert again.version == first.version and again.manifest == first.manifest  # first source and created_at kept
    assert {p: p.stat().st_mtime_ns for p in first.path.rglob("*")} == stamps
    parent = tmp_path / "environments" / "shells"
    assert sorted(p.name for p in parent.iterdir()) == [first.version]  # no second folder, no staging left


@pytest.mark.parametrize("change", [
    {"instruction": "Do something else entirely."},
    {"files": {"notes.txt": "other\n"}},
    {"seed": 99},
    {"split": "heldout"},
    {"limits": SandboxLimits(cpu_s=5.0, mem_mb=256, wall_s=10.0, fsize_mb=8, nofile=64, nproc=16)},
    {"meta": {"family": "other"}},
    {"solution": "true\n"},
    {"verifier": VerifierSpec("terminal", {"expect": [], "absent": ["x"], "no_glob": [], "unchanged": []})},
])
def test_any_changed_field_is_another_version(tmp_path: Path, change: dict) -> None:
    specs = [shell_env(0), shell_env(1)]
    base = store_dataset("shells", specs, source={}, home=tmp_path)
    changed = store_dataset("shells", [dataclasses.replace(specs[0], **change), specs[1]], source={}, home=tmp_path)
    assert changed.version != base.version
    assert open_dataset("shells", home=tmp_path).version == changed.version  # the latest
    assert open_dataset(f"shells@{base.version}", home=tmp_path).environments == tuple(specs)  # still there, unchanged


def test_the_verifier_part_is_owner_only_and_apart(tmp_path: Path) -> None:
    specs = shell_environments(3, seed=0)
    stored = store_dataset("shells", specs, source={}, home=tmp_path)
    mode = lambda p: stat.S_IMODE(p.stat().st_mode)  # noqa: E731
    assert mode(stored.path / VERIFIER_DIR) == 0o700
    assert mode(stored.path / VERIFIER_DIR / VERIFIER_FILE) == 0o400
    assert mode(stored.path / MANIFEST_FILE) == mode(stored.path / ENVIRONMENTS_FILE) == 0o444
    public = (stored.path / ENVIRONMENTS_FILE).read_text()
    hidden = (stored.path / VERIFIER_DIR / VERIFIER_FILE).read_text()
    for spec in specs:  # the expected state and the solution are on the verifier side only
        assert json.dumps(spec.solution)[1:-1] in hidden and spec.solution not in public
        for expected in spec.verifier.params["expect"]:
            assert f'"path":"{expected["path"]}"' in hidden
    assert '"verifier"' not in public and '"solution"' not in public
    assert [json.loads(line) for line in public.splitlines()] == [s.agent_view() for s in specs]


def test_a_malformed_store_names_the_file_and_field(tmp_path: Path) -> None:
    good = store_dataset("good", [shell_env(0)], source={}, home=tmp_path)
    bad = store_dataset("bad", [shell_env(0), shell_env(1)], source={}, home=tmp_path)
    _writable(bad.path)
    manifest_path = bad.path / MANIFEST_FILE
    manifest = json.loads(manifest_path.read_text())
    for edit, field in ((lambda m: m.pop("version"), "version"), (lambda m: m.update(created_at="yesterday"), "created_at"),
                        (lambda m: m.update(name="other"), "name"), (lambda m: m["files"].pop(ENVIRONMENTS_FILE), "files")):
        broken = json.loads(json.dumps(manifest))
        edit(broken)
        manifest_path.write_text(json.dumps(broken))
        with pytest.raises(SpecError, match=rf"{manifest_path}: field '{field}'"):
            open_dataset("bad", home=tmp_path)
    manifest_path.write_text("{not json")
    with pytest.raises(SpecError, match=rf"{manifest_path}:1: not JSON"):
        open_dataset("bad", home=tmp_path)
    # One broken version does not hide the others from the listing.
    listed = {m["name"]: m for m in list_datasets(home=tmp_path)}
    assert "error" in listed["bad"] and listed["good"]["version"] == good.version
    # An environment edited on disk: the hash no longer matches; with the hash updated, the bad field is named.
    manifest_path.write_text(json.dumps(manifest))
    public = bad.path / ENVIRONMENTS_FILE
    lines = public.read_text().splitlines()
    row = json.loads(lines[1])
    row["seed"] = -1
    lines[1] = json.dumps(row)
    public.write_text("\n".join(lines) + "\n")
    with pytest.raises(SpecError, match="sha256 differs"):
        open_dataset("bad", home=tmp_path)
    from envloop_pipelines.core.storage import sha256_file

    manifest["files"][ENVIRONMENTS_FILE] = sha256_file(public)
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(SpecError, match=rf"{public}:2: environment 'shell/0001': field 'seed'"):
        open_dataset("bad", home=tmp_path)


def test_references_and_names(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no environment dataset 'nothing'"):
        open_dataset("nothing", home=tmp_path)
    with pytest.raises(ValueError, match="dataset name"):
        store_dataset("a/b", [shell_env(0)], source={}, home=tmp_path)
    with pytest.raises(ValueError, match="appears twice"):
        store_dataset("dup", [shell_env(0), shell_env(0)], source={}, home=tmp_path)
    with pytest.raises(ValueError, match="no environments"):
        store_dataset("empty", [], source={}, home=tmp_path)
    # Sixteen hex digits: among 17 versions two share a first digit, which is then an ambiguous prefix.
    versions = [store_dataset("many", [shell_env(s)], source={}, home=tmp_path).version for s in range(17)]
    first = [v[0] for v in versions]
    shared = next(c for c in first if first.count(c) > 1)
    with pytest.raises(ValueError, match=f"version prefix '{shared}' of dataset 'many' matches"):
        open_dataset(f"many@{shared}", home=tmp_path)
    with pytest.raises(FileNotFoundError, match="has no version 'zz'"):
        open_dataset("many@zz", home=tmp_path)


# --------------------------------------------------------------------------- generators


def test_the_shell_generator_is_deterministic_and_its_solutions_pass(tmp_path: Path) -> None:
    envs = shell_environments(8, heldout=3, seed=5)
    assert envs == shell_environments(8, heldout=3, seed=5)
    assert [e.id for e in envs] == [f"shell/{s:04d}" for s in range(5, 13)] and [e.seed for e in envs] == list(range(5, 13))
    assert sum(e.split == "heldout" for e in envs) == 3
    other = shell_environments(8, heldout=3, seed=6)
    assert [e.split for e in other] != [e.split for e in envs] or other[0] != envs[0]
    assert {e.meta["family"] for e in shell_environments(12)} == {"create_file", "rename_ext", "count_lines"}
    for spec in envs:
        for command, passed in ((spec.solution, True), ("true", False)):
            episode = open_episode(spec, work_root=tmp_path, home=tmp_path)
            try:
                episode.run(command)
                assert episode.verify().passed is passed, (spec.id, command)
            finally:
                episode.close()
    with pytest.raises(ValueError, match="heldout must be"):
        shell_environments(2, heldout=3)
    one = generate_dataset("shell", "shells", n=4, heldout=1, seed=2, home=tmp_path)
    assert one.manifest["source"] == {"generator": "shell", "n": 4, "heldout": 1, "seed": 2}
    assert generate_dataset("shell", "shells", n=4, heldout=1, seed=2, home=tmp_path).version == one.version


@pytest.fixture(scope="module")
def task_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("decision-envs")
    import_file(tickets_file(root), "tickets", home=root / "home")
    return root / "home"


def test_decision_environments_come_from_open_splits_with_their_labels(task_home: Path) -> None:
    snapshot = open_task("tickets", home=task_home)
    envs = decision_environments("tickets", split="dev", n=6, heldout=2, seed=1, home=task_home)
    assert envs == decision_environments("tickets", split="dev", n=6, heldout=2, seed=1, home=task_home)
    assert len(envs) == 6 and sum(e.split == "heldout" for e in envs) == 2
    assert sum(e.solution is not None for e in envs) >= 3
    labels = {(r["record_id"], r["question_id"]): r for r in snapshot.labels("dev").to_pylist()}
    for spec in envs:
        label = spec.verifier.params["label"]
        assert label == labels[(label["record_id"], label["question_id"])]
        assert spec.meta["snapshot_id"] == snapshot.snapshot_id and spec.meta["question_split"] == "dev"
        assert "label" not in json.dumps(spec.agent_view())  # no label column in what the agent sees
        if spec.solution is None:  # a soft label (a score question) has no one right option
            assert label["soft_label"] is not None
            continue
        wrong = next(k for k in spec.question["option_keys"] if k != spec.solution)
        for answer, passed in ((spec.solution, True), (wrong, False)):
            episode = open_episode(spec)
            episode.submit(answer)
            assert episode.verify().passed is passed
    for hidden in ("test", "holdout"):
        with pytest.raises(ValueError, match="hidden"):
            decision_environments("tickets", split=hidden, home=task_home)
    stored = generate_dataset("decision", "tickets-dev", task="tickets", split="dev", n=6, heldout=2, seed=1,
                              home=task_home)
    assert stored.environments == tuple(sorted(envs, key=lambda e: e.id))
    assert stored.manifest["source"]["snapshot_id"] == snapshot.snapshot_id


def test_synthesized_rows_become_decision_environments(task_home: Path) -> None:
    from envloop_pipelines.core.decision_loop.failure_mining import FailureCluster
    from envloop_pipelines.core.decision_loop.synthesis import SynthesisRequest, VariantGenerator

    train = open_task("tickets", home=task_home).table("train")
    family = train.column("family")[0].as_py()
    cluster = FailureCluster(key={"family": family}, n=10, errors=5, confident_errors=2, error_rate=0.5,
                             excess_errors=3.0, example_ids=())
    rows = VariantGenerator().synthesize(SynthesisRequest(round="r0003", clusters=(cluster,), n_examples=5, seed=3), train)
    envs = synthesis_environments(rows, task="tickets", round_key="r0003")
    assert len(envs) == rows.num_rows == 5
    for spec, row in zip(envs, rows.to_pylist()):
        assert spec.kind == "decision" and spec.split == "train" and spec.instruction == row["instructions_text"]
        assert spec.verifier.params["label"]["label"] == row["label"]
        assert spec.meta["round"] == "r0003" and spec.meta["provenance"] == json.loads(row["provenance"])
    assert synthesis_dataset_name("tickets", "r0003") == "tickets-r0003"
    assert synthesis_dataset_name("my task/x", "r0001") == "my-task-x-r0001"


def test_the_synthesis_step_stores_its_rows_as_a_dataset(task_home: Path, tmp_path: Path) -> None:
    """synthesize_environments keeps its Parquet rows and records the same rows as a dataset in its result."""
    import shutil

    import pyarrow.parquet as pq

    from envloop_pipelines.core.loop.config import LoopConfig
    from envloop_pipelines.core.decision_loop.step_records import EnvironmentSynthesis, FailureMining
    from envloop_pipelines.core.decision_loop.environment_synthesis import synthesize_environments

    home = tmp_path / "home"
    shutil.copytree(task_home, home)
    family = open_task("tickets", home=home).table("train").column("family")[0].as_py()
    mined = FailureMining(round="r0002", n_questions=10, n_errors=4, n_confident_errors=1, error_rate=0.4,
                          threshold=None, by_family={},
                          clusters=({"name": f"family={family}", "key": {"family": family}, "n": 10, "errors": 4,
                                     "confident_errors": 1, "error_rate": 0.4, "excess_errors": 2.0,
                                     "example_ids": []},))
    config = LoopConfig(task="tickets", home=str(home), generator="label_preserving_variants", n_synthesized=6)
    task = open_task("tickets", home=home)
    result = synthesize_environments(config, task, mined)
    rows = pq.read_table(result.path)
    assert result.n_rows == rows.num_rows == 6
    dataset = open_dataset(result.environment_dataset, home=home)
    assert result.environment_dataset == f"tickets-r0002@{dataset.version}"
    assert dataset.manifest["source"]["synthesis_sha256"] == result.sha256
    assert [e.instruction for e in dataset.environments] == [
        e.instruction for e in sorted(synthesis_environments(rows, task="tickets", round_key="r0002"), key=lambda e: e.id)]
    again = synthesize_environments(config, task, mined)  # a retry: the same rows, the same version
    assert again.environment_dataset == result.environment_dataset and again.sha256 == result.sha256
    assert EnvironmentSynthesis.from_dict(result.to_dict()) == result
    old = {k: v for k, v in result.to_dict().items() if k != "environment_dataset"}  # a record stored before
    assert EnvironmentSynthesis.from_dict(old).environment_dataset is None


# --------------------------------------------------------------------------- agents on a stored dataset


def test_an_agent_is_evaluated_on_an_opened_dataset_and_replayed_from_the_store(tmp_path: Path) -> None:
    from envloop_pipelines.core.agents.client import AgentSpec
    from envloop_pipelines.core.agents.evaluate import evaluate_agent, load_environments, replay
    from envloop_pipelines.testing.scripted_agents import scripted_server

    stored = generate_dataset("shell", "shell-agents", n=3, home=tmp_path)
    dataset = load_environments("shell-agents", home=tmp_path)
    assert dataset.version == stored.version
    with scripted_server() as server:
        result = evaluate_agent(dataset, AgentSpec(server.url, "solver-p1.0"), attempts=1, workers=2, home=tmp_path)
    assert result.dataset == "shell-agents" and result.dataset_version == stored.version
    assert result.pass_at_1.value == 1.0 and result.statuses["passed"] == 3
    for attempt in result.attempts:  # looks the environment up in the stored version
        assert replay(attempt, home=tmp_path).passed
    assert os.path.isdir(Path(result.run_dir))
