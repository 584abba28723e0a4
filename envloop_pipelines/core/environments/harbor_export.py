"""Export a dataset's terminal environments as Harbor task folders (the layout: :mod:`.harbor_format`).

:func:`export_harbor` writes one folder per terminal environment:
the starting files under ``environment/files/``, copied into the working
directory (``/app``) by the Dockerfile; the verifier in a separate container
(``environment_mode = "separate"``) that gets the final ``/app`` as an
artifact; for a ``terminal`` verifier a generated ``tests/test.sh`` that runs
the same terminal-state check (:data:`~envloop_pipelines.core.verify.terminal.EXPECT_FILES`,
its parameters in ``tests/params.json``) and writes 1 or 0 to
``/logs/verifier/reward.txt``; for a ``tests`` verifier its files as they are.
``[metadata.envloop]`` keeps the environment's id, seed, split, limits and meta,
so an import of the export (:mod:`.harbor_import`) gives the same agent view. Decision environments
have no Harbor form and are skipped (counted in the result).

An environment imported from a Harbor task is written back as it came instead: every file of its folder,
byte for byte, with its mode (``task_files`` on the verifier's side of the spec, kept by the import).
"""

from __future__ import annotations

import base64
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Mapping

import tomlkit

from envloop_pipelines.core.environments.dataset import EnvironmentDataset
from envloop_pipelines.core.environments.harbor_format import HARBOR_SCHEMA_VERSION, SOLUTION_HEADER, WORKDIR
from envloop_pipelines.core.environments.spec import HOLDOUT_SPLIT, EnvironmentSpec
from envloop_pipelines.core.verify.terminal import EXPECT_FILES

#: python3 for the terminal-state check; the agent's tools are coreutils and bash.
BASE_IMAGE = "python:3.12-slim"
#: A Harbor agent has one timeout for the whole attempt; ours bounds each command. 600 s is 20 commands at
#: the default 30 s per command, and more than any shell task here takes.
AGENT_TIMEOUT_S = 600.0

TEST_SH = """#!/bin/bash
# EnvLoop terminal-state check (envloop_pipelines/core/verify/terminal.py, EXPECT_FILES), run by Harbor's
# verifier against the final state of {workdir}: 1 in /logs/verifier/reward.txt when every check holds, else 0.
mkdir -p /logs/verifier
cd {workdir} || {{ echo 0 > /logs/verifier/reward.txt; exit 0; }}
ENVLOOP_RESULT_FD=3 python3 -I /tests/check.py < /tests/params.json 3> /logs/verifier/verdict.json
python3 -I -c 'import json, sys; print(1 if json.load(open(sys.argv[1])).get("passed") is True else 0)' \\
  /logs/verifier/verdict.json > /logs/verifier/reward.txt 2> /dev/null || echo 0 > /logs/verifier/reward.txt
cat /logs/verifier/verdict.json 2> /dev/null; echo
"""


@dataclass(frozen=True)
class HarborExport:
    """What :func:`export_harbor` wrote.

    Attributes:
        out: the folder of tasks (a Harbor dataset).
        tasks: environment id -> its task folder.
        skipped: ids of environments with no Harbor form (decision environments).
        rewritten: ids of environments written in EnvLoop's own form (``task.toml``, ``environment/``, ``tests/``,
            ``solution/`` made from the environment: generated ones, or an import that kept no original); the
            others are imported Harbor tasks, written back byte for byte.
    """

    out: Path
    tasks: Mapping[str, Path]
    skipped: tuple[str, ...]
    rewritten: tuple[str, ...] = ()


def _folder_name(env_id: str, taken: set[str]) -> str:
    base = re.sub(r"[^A-Za-z0-9._-]", "-", env_id).strip(".-") or "task"
    name, k = base, 1
    while name in taken:
        name, k = f"{base}-{k}", k + 1
    taken.add(name)
    return name


def _task_toml(dataset: EnvironmentDataset, spec: EnvironmentSpec, folder: str, workdir: str) -> str:
    doc = tomlkit.document()
    doc.add(tomlkit.comment(f"Exported by EnvLoop from {dataset.name}@{dataset.version[:12]}, environment {spec.id}"))
    doc["schema_version"] = HARBOR_SCHEMA_VERSION
    # The verifier runs in its own container; the agent's final working directory is its one input.
    doc["artifacts"] = [workdir]
    task = tomlkit.table()
    task["name"] = f"{dataset.name}/{folder}"
    task["description"] = spec.instruction.splitlines()[0][:200]
    doc["task"] = task
    envloop = tomlkit.table()
    envloop["id"] = spec.id
    envloop["seed"] = spec.seed
    envloop["split"] = spec.split
    envloop["limits"] = spec.limits.to_dict()
    envloop["verifier_limits"] = spec.verifier.limits.to_dict()
    envloop["meta"] = json.dumps(dict(spec.meta), sort_keys=True)  # JSON: TOML has no null
    metadata = tomlkit.table()
    metadata["source"] = "envloop"
    metadata["dataset"] = dataset.name
    metadata["dataset_version"] = dataset.version
    metadata["verifier"] = spec.verifier.kind
    metadata.add("envloop", envloop)
    doc["metadata"] = metadata
    verifier = tomlkit.table()
    verifier["timeout_sec"] = float(spec.verifier.limits.wall_s)
    verifier["environment_mode"] = "separate"
    doc["verifier"] = verifier
    agent = tomlkit.table()
    agent["timeout_sec"] = AGENT_TIMEOUT_S
    doc["agent"] = agent
    environment = tomlkit.table()
    environment["cpus"] = 1
    environment["memory_mb"] = int(spec.limits.mem_mb)
    environment["network_mode"] = "no-network"
    environment["workdir"] = workdir
    doc["environment"] = environment
    return tomlkit.dumps(doc)


def _write(path: Path, text: str, executable: bool = False, private: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if private:  # owner-only from the first byte: the folder 0700, the file created 0600 (0700 if a program)
        path.parent.chmod(0o700)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o700 if executable else 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        return
    path.write_text(text, encoding="utf-8")
    if executable:
        path.chmod(0o755)


class HoldoutExportError(ValueError):
    """An export would publish held-out environments without being asked to."""


def export_task(dataset: EnvironmentDataset, spec: EnvironmentSpec, folder: Path) -> Path:
    """Write one terminal environment as a Harbor task folder (which must not exist yet).

    A held-out environment's verifier material (``tests/``, ``solution/``) is written owner-only.
    """
    if spec.kind != "terminal":
        raise ValueError(f"{spec.id}: only terminal environments have a Harbor form, not {spec.kind!r}")
    private = spec.split == HOLDOUT_SPLIT
    if spec.verifier.kind == "tests" and spec.verifier.params.get("task_files"):
        return _write_task_files(spec, folder, private)
    workdir = str(spec.verifier.params.get("workdir", WORKDIR)) if spec.verifier.kind == "tests" else WORKDIR
    folder.mkdir(parents=True)
    _write(folder / "task.toml", _task_toml(dataset, spec, folder.name, workdir))
    _write(folder / "instruction.md", spec.instruction + "\n")
    lines = [f"FROM {BASE_IMAGE}", f"WORKDIR {workdir}"]
    if spec.files:
        lines.append(f"COPY files/ {workdir}/")
        for rel, text in spec.files.items():
            _write(folder / "environment" / "files" / rel, text)
    _write(folder / "environment" / "Dockerfile", "\n".join(lines) + "\n")
    if spec.verifier.kind == "terminal":
        _write(folder / "tests" / "test.sh", TEST_SH.format(workdir=workdir), executable=True, private=private)
        _write(folder / "tests" / "check.py", EXPECT_FILES.lstrip("\n"), private=private)
        _write(folder / "tests" / "params.json", json.dumps(dict(spec.verifier.params), indent=2, sort_keys=True) + "\n",
               private=private)
    else:
        for rel, text in spec.verifier.files.items():
            if not rel.startswith("tests/"):
                raise ValueError(f"{spec.id}: verifier file {rel!r} is not under tests/")
            _write(folder / rel, text, executable=rel.endswith(".sh"), private=private)
    if spec.solution is not None:
        _write(folder / "solution" / "solve.sh", SOLUTION_HEADER.format(workdir=workdir) + spec.solution,
               executable=True, private=private)
    return folder


#: The parts of an imported task that only the verifier may see (written owner-only for a held-out one).
VERIFIER_PARTS = ("tests", "solution", "task.toml")


def _write_task_files(spec: EnvironmentSpec, folder: Path, private: bool) -> Path:
    """An imported Harbor task as it came: every file of its folder byte for byte, with its mode."""
    folder.mkdir(parents=True)
    for rel, entry in sorted(spec.verifier.params["task_files"].items()):
        path = folder / rel
        if not path.resolve().is_relative_to(folder.resolve()) or ".." in PurePosixPath(rel).parts:
            raise ValueError(f"{spec.id}: task file {rel!r} is not inside the task folder")
        data = entry["text"].encode("utf-8") if "text" in entry else base64.b64decode(entry["base64"])
        hidden = private and PurePosixPath(rel).parts[0] in VERIFIER_PARTS
        path.parent.mkdir(parents=True, exist_ok=True)
        if hidden:
            path.parent.chmod(0o700)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        mode = int(entry.get("mode", 0o644))
        path.chmod(mode & 0o700 if hidden else mode)
    return folder


def export_harbor(dataset: EnvironmentDataset, out: str | Path, *, include_heldout: bool = False) -> HarborExport:
    """Export every terminal environment of ``dataset`` as a Harbor task folder under ``out``.

    Held-out environments (split ``heldout``) are exported only with ``include_heldout``; their tests and
    solutions are then written owner-only (folders 0700, files 0600 or 0700).

    Raises:
        FileExistsError: ``out`` exists and is not an empty folder (an export never overwrites).
        HoldoutExportError: the dataset has held-out terminal environments and ``include_heldout`` is off;
            nothing is written.
    """
    out = Path(out)
    held = [e.id for e in dataset.environments if e.kind == "terminal" and e.split == HOLDOUT_SPLIT]
    if held and not include_heldout:
        raise HoldoutExportError(
            f"{dataset.name}@{dataset.version[:12]} holds {len(held)} held-out environment(s) ({', '.join(held[:3])}"
            f"{', ...' if len(held) > 3 else ''}): an export publishes their tests and solutions. Export them only on "
            f"purpose (include_heldout, --include-heldout; written owner-only), or export a dataset without them")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not an empty folder; export into a new one")
    out.mkdir(parents=True, exist_ok=True)
    taken: set[str] = set()
    tasks: dict[str, Path] = {}
    skipped = []
    for spec in dataset.environments:
        if spec.kind != "terminal":
            skipped.append(spec.id)
            continue
        tasks[spec.id] = export_task(dataset, spec, out / _folder_name(spec.id, taken))
    rewritten = tuple(i for i, spec in ((e.id, e) for e in dataset.environments)
                      if i in tasks and not spec.verifier.params.get("task_files"))
    return HarborExport(out=out, tasks=tasks, skipped=tuple(skipped), rewritten=rewritten)


__all__ = ["AGENT_TIMEOUT_S", "BASE_IMAGE", "HarborExport", "HoldoutExportError", "export_harbor", "export_task"]
