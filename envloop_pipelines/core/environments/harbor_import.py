"""Import Harbor task folders (the layout: :mod:`.harbor_format`) into an environment dataset.

:func:`import_harbor` reads one task folder or a folder of them (:func:`read_task` each):
the instruction (leading canary lines dropped, as Harbor does), the starting
files (``COPY``/``ADD`` of local files or folders from ``environment/`` into the
working directory), ``tests/`` as the hidden ``tests`` verifier (never among
the agent's files), the limits (:func:`task_limits`: ``[agent]`` and ``[verifier]`` ``timeout_sec``,
``cpus``, ``memory_mb``, ``storage_mb``), ``solution/solve.sh``, and every file of the folder as it is (for the
export; the files: :mod:`.harbor_files`). Compiled Python (``harbor init`` ships ``tests/__pycache__``) is kept
but never run, and each line of the tests that needs the network is named
(:func:`~.harbor_verifier.network_needs`); both are told through ``on_note``. What a Dockerfile does that our
sandbox cannot reproduce (``RUN`` steps, a base image's own files, ``COPY`` to a
path outside the working directory, ``COPY --from``, URLs and archives in
``ADD``) is listed in the environment's ``meta["harbor"]["not_reproduced"]``:
tests that need installed packages will fail here. Multi-step tasks, binary
files and Compose environments are refused with an error naming the file and
the field.
"""

from __future__ import annotations

import json
import logging
import re
import tomllib
from pathlib import Path
from typing import Any, Callable, Mapping

from envloop_pipelines.core.environments.dataset import EnvironmentDataset, check_name, store_dataset
from envloop_pipelines.core.environments.harbor_files import refuse_links, starting_files, task_files, tests_files
from envloop_pipelines.core.environments.harbor_format import (
    HARBOR_SCHEMA_VERSION,
    SOLUTION_HEADER,
    field_error,
    positive_number,
    read_text_file,
)
from envloop_pipelines.core.environments.harbor_verifier import map_paths, network_needs
from envloop_pipelines.core.environments.spec import (
    DEFAULT_COMMAND_LIMITS,
    DEFAULT_VERIFY_LIMITS,
    TRAIN_SPLIT,
    EnvironmentSpec,
    SpecError,
    VerifierSpec,
)
from envloop_pipelines.core.environments.terminal_episode import EPISODE_DISK_MB
from envloop_pipelines.core.sandbox import SandboxLimits

log = logging.getLogger(__name__)

CANARY = re.compile(r"^(<!--.*canary.*-->|#.*canary.*)$", re.IGNORECASE)


def _strip_canary(text: str) -> str:
    lines = text.split("\n")
    i = 0
    while i < len(lines) and CANARY.match(lines[i].strip()):
        i += 1
    while i < len(lines) and i > 0 and not lines[i].strip():
        i += 1
    return "\n".join(lines[i:])


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def _envloop_limits(toml: Path, raw: Any, field: str, default: SandboxLimits) -> SandboxLimits:
    if not isinstance(raw, Mapping):
        raise field_error(toml, field, "must be a table of sandbox limits")
    try:
        return SandboxLimits.from_dict({**default.to_dict(), **raw})
    except (TypeError, ValueError) as exc:
        raise field_error(toml, field, str(exc)) from None


#: What a Harbor task leaves unset: Harbor's own defaults ([verifier] timeout_sec 600; one CPU).
HARBOR_VERIFIER_TIMEOUT_S = 600.0
#: A container has no small process limit; a fresh uid per command with this many is as good for a task.
TASK_NPROC = 256


def task_limits(toml: Path, raw: Mapping[str, Any]) -> tuple[SandboxLimits, SandboxLimits]:
    """The limits of a Harbor task's commands and of its verifier, from its own ``task.toml``.

    * each command: wall time ``[agent] timeout_sec`` (Harbor's timeout of the whole attempt; an attempt here is
      bounded by it too), CPU seconds that times ``[environment] cpus``, ``memory_mb`` as the address space,
      ``storage_mb`` as the largest file (at most the episode's tmpfs);
    * the verifier: wall time ``[verifier] timeout_sec`` (600 when unset, as in Harbor), CPU seconds that times
      the cpus, memory and storage as above (``[verifier.environment]`` where it sets them).

    What the task leaves unset keeps the defaults of :data:`DEFAULT_COMMAND_LIMITS` and
    :data:`DEFAULT_VERIFY_LIMITS`.
    """

    def resources(table: Mapping[str, Any], field: str, default: SandboxLimits, wall: float | None) -> SandboxLimits:
        cpus = positive_number(toml, {field: table}, field, "cpus") or 1
        memory = positive_number(toml, {field: table}, field, "memory_mb", integer=True)
        storage = positive_number(toml, {field: table}, field, "storage_mb", integer=True)
        wall = float(wall) if wall else default.wall_s
        return SandboxLimits.from_dict({
            **default.to_dict(), "wall_s": wall, "cpu_s": wall * float(cpus), "nproc": max(default.nproc, TASK_NPROC),
            **({"mem_mb": int(memory)} if memory else {}),
            "fsize_mb": int(min(storage, EPISODE_DISK_MB)) if storage else max(default.fsize_mb, EPISODE_DISK_MB // 4)})

    env_cfg = raw.get("environment", {})
    verifier_cfg = raw.get("verifier", {})
    inner = verifier_cfg.get("environment") if isinstance(verifier_cfg.get("environment"), dict) else {}
    limits = resources(env_cfg, "environment", DEFAULT_COMMAND_LIMITS,
                       positive_number(toml, raw, "agent", "timeout_sec"))
    verifier = resources({**env_cfg, **inner}, "environment", DEFAULT_VERIFY_LIMITS,
                         positive_number(toml, raw, "verifier", "timeout_sec") or HARBOR_VERIFIER_TIMEOUT_S)
    return limits, verifier


def read_task(task_dir: str | Path, *, on_note: Callable[[str], None] | None = None) -> EnvironmentSpec:
    """One Harbor task folder as a terminal environment with a ``tests`` verifier.

    Args:
        task_dir: the task folder.
        on_note: called with each thing a person importing the task should know (a file kept but not used,
            a line of the tests that needs the network); logged when None.

    Raises:
        SpecError: a missing or malformed file, naming the file and the field.
    """
    task_dir = Path(task_dir)
    note = on_note or (lambda text: log.warning("%s: %s", task_dir, text))
    toml = task_dir / "task.toml"
    refuse_links(task_dir)
    try:
        raw = tomllib.loads(read_text_file(toml, "task.toml"))
    except FileNotFoundError:
        raise SpecError(f"{toml}: missing (a Harbor task folder has task.toml)") from None
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"{toml}: not TOML ({exc})") from None
    version = raw.get("schema_version", raw.get("version", HARBOR_SCHEMA_VERSION))
    if not isinstance(version, str) or not version.startswith("1."):
        raise field_error(toml, "schema_version", f"this importer reads schema 1.x, got {version!r}")
    for table in ("task", "metadata", "verifier", "agent", "environment", "solution"):
        if table in raw and not isinstance(raw[table], dict):
            raise field_error(toml, table, f"must be a table, got {type(raw[table]).__name__}")
    if raw.get("steps"):
        raise field_error(toml, "steps", "multi-step tasks are not supported")
    verifier_timeout = positive_number(toml, raw, "verifier", "timeout_sec")
    agent_timeout = positive_number(toml, raw, "agent", "timeout_sec")
    memory_mb = positive_number(toml, raw, "environment", "memory_mb", integer=True)
    env_cfg = raw.get("environment", {})
    workdir = env_cfg.get("workdir")
    if workdir is not None and (not isinstance(workdir, str) or not workdir.startswith("/")):
        raise field_error(toml, "environment.workdir", f"must be an absolute path, got {workdir!r}")
    env_dir = task_dir / "environment"
    if (env_dir / "docker-compose.yaml").is_file():
        raise field_error(env_dir / "docker-compose.yaml", "environment", "Compose environments are not supported")
    if not env_dir.is_dir() and not env_cfg.get("docker_image"):
        raise field_error(toml, "environment.docker_image",
                          f"no environment/ folder and no image: {env_dir} is missing")
    files, workdir, notes = starting_files(env_dir, workdir)
    if env_cfg.get("docker_image"):
        notes.append(f"environment.docker_image {env_cfg['docker_image']}: the image's own files and programs")
    network = env_cfg.get("network_mode", "public" if env_cfg.get("allow_internet", True) else "no-network")
    if network != "no-network":
        notes.append(f"environment.network_mode {network!r}: environments here run without a network")
    instruction_path = task_dir / "instruction.md"
    if not instruction_path.is_file():
        raise field_error(instruction_path, "instruction.md", "missing")
    instruction = _strip_canary(read_text_file(instruction_path, "instruction.md"))
    instruction = instruction[:-1] if instruction.endswith("\n") else instruction
    if not instruction.strip():
        raise field_error(instruction_path, "instruction.md", "empty")
    tests = tests_files(task_dir, note)
    offline = network_needs(tests)
    for line in offline:
        note(f"{line}: needs the network, which environments here do not have (the attempt's verdict will be an "
             f"error saying so)")
    if "tests/Dockerfile" in tests:
        notes.append("tests/Dockerfile: the verifier's image is not built here; the tests run with this machine's "
                     "programs and the project's Python (pytest and pytest-json-ctrf installed)")
    solution = None
    solve = task_dir / "solution" / "solve.sh"
    if solve.is_file():
        text = read_text_file(solve, "solution/solve.sh")
        header = SOLUTION_HEADER.format(workdir=workdir)
        # Our own export's header comes off; any other script's absolute working directory becomes '.', where
        # an attempt's commands run.
        solution = text[len(header):] if text.startswith(header) else map_paths(text, {workdir: Path(".")})
    metadata = raw.get("metadata", {})
    mine = metadata.get("envloop") if isinstance(metadata.get("envloop"), dict) else None
    if mine is not None:  # our own export: the agent view as it was
        field = "metadata.envloop"
        try:
            meta = json.loads(mine.get("meta", "{}"))
        except (TypeError, json.JSONDecodeError):
            raise field_error(toml, f"{field}.meta", "must be a JSON object (text)") from None
        limits = _envloop_limits(toml, mine.get("limits", {}), f"{field}.limits", DEFAULT_COMMAND_LIMITS)
        verifier_limits = _envloop_limits(toml, mine.get("verifier_limits", {}), f"{field}.verifier_limits",
                                          DEFAULT_VERIFY_LIMITS)
        env_id, seed, split = mine.get("id"), mine.get("seed", 0), mine.get("split", TRAIN_SPLIT)
    else:
        limits, verifier_limits = task_limits(toml, raw)
        name = raw.get("task", {}).get("name") or task_dir.name
        env_id = re.sub(r"[^A-Za-z0-9._/#-]", "-", str(name)).strip("/")[:200] or "task"
        seed, split = 0, TRAIN_SPLIT
        meta = {"harbor": _jsonable({
            "task": name, "metadata": metadata, "agent_timeout_sec": agent_timeout,
            "verifier_timeout_sec": verifier_timeout, "cpus": env_cfg.get("cpus"), "memory_mb": memory_mb,
            "network_mode": network, "workdir": workdir, "not_reproduced": notes})}
    try:
        params: dict[str, Any] = {"workdir": workdir, "task_files": task_files(task_dir)}
        if offline:
            params["needs_network"] = offline
        return EnvironmentSpec(id=env_id, kind="terminal", instruction=instruction, files=files,
                               verifier=VerifierSpec("tests", params, tests, verifier_limits),
                               limits=limits, seed=seed, split=split, solution=solution, meta=meta)
    except SpecError as exc:
        raise SpecError(f"{toml}: {exc}") from None


def task_folders(path: str | Path) -> list[Path]:
    """``path`` itself when it is a task folder (it has task.toml), else its sub-folders that are.

    Raises:
        FileNotFoundError: no task folder there.
    """
    path = Path(path)
    if (path / "task.toml").is_file():
        return [path]
    found = sorted(p for p in path.iterdir() if p.is_dir() and (p / "task.toml").is_file()) if path.is_dir() else []
    if not found:
        raise FileNotFoundError(f"{path}: no Harbor task here (a task folder has task.toml; a folder of tasks "
                                f"holds such folders)")
    return found


def import_harbor(path: str | Path, *, name: str | None = None, home: str | Path | None = None,
                  on_note: Callable[[str], None] | None = None) -> EnvironmentDataset:
    """Import one Harbor task folder, or a folder of them, as an environment dataset.

    Args:
        path: a task folder or a folder of task folders.
        name: the dataset's name (default: the folder's name, made a valid name).
        home: the EnvLoop home.
        on_note: called with each note of :func:`read_task` (prefixed with the task folder's name).

    Raises:
        FileNotFoundError: no task folder at ``path``.
        SpecError: a malformed task, naming the file and the field.
        ValueError: two tasks with the same environment id.
    """
    path = Path(path).resolve()
    folders = task_folders(path)
    specs = [read_task(f, on_note=None if on_note is None else (lambda text, f=f: on_note(f"{f.name}: {text}")))
             for f in folders]
    seen: dict[str, Path] = {}
    for spec, folder in zip(specs, folders):
        if spec.id in seen:
            raise ValueError(f"{folder} and {seen[spec.id]} are both environment {spec.id!r}")
        seen[spec.id] = folder
    if name is None:
        name = re.sub(r"[^A-Za-z0-9._-]", "-", path.name).strip(".-") or "harbor"
    check_name(name)
    return store_dataset(name, specs, source={"import": "harbor", "path": str(path), "tasks": len(specs)}, home=home)


__all__ = ["import_harbor", "read_task", "task_folders", "task_limits"]
