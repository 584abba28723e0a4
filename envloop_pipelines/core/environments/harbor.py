"""Harbor task folders, both ways: export a dataset's terminal environments, import Harbor tasks into a dataset.

A Harbor task (the ``harbor`` package on PyPI, schema 1.4) is a folder::

    task.toml            schema_version, [task] name, [metadata], [verifier], [agent], [environment]
    instruction.md       the instruction
    environment/         Dockerfile (+ the files it COPYs): the agent's container
    tests/test.sh        hidden tests: copied to /tests only for verification; write /logs/verifier/reward.txt
    solution/solve.sh    the reference solution (the oracle agent runs it)

**Export** (:func:`export_harbor`) writes one folder per terminal environment:
the starting files under ``environment/files/``, copied into the working
directory (``/app``) by the Dockerfile; the verifier in a separate container
(``environment_mode = "separate"``) that gets the final ``/app`` as an
artifact; for a ``terminal`` verifier a generated ``tests/test.sh`` that runs
the same terminal-state check (:data:`~envloop_pipelines.core.verify.terminal.EXPECT_FILES`,
its parameters in ``tests/params.json``) and writes 1 or 0 to
``/logs/verifier/reward.txt``; for a ``tests`` verifier its files as they are.
``[metadata.envloop]`` keeps the environment's id, seed, split, limits and meta,
so an import of the export gives the same agent view. Decision environments
have no Harbor form and are skipped (counted in the result).

An environment imported from a Harbor task is written back as it came instead: every file of its folder,
byte for byte, with its mode (``task_files`` on the verifier's side of the spec, kept by the import).

**Import** (:func:`import_harbor`) reads one task folder or a folder of them:
the instruction (leading canary lines dropped, as Harbor does), the starting
files (``COPY``/``ADD`` of local files or folders from ``environment/`` into the
working directory), ``tests/`` as the hidden ``tests`` verifier (never among
the agent's files), the limits (:func:`task_limits`: ``[agent]`` and ``[verifier]`` ``timeout_sec``,
``cpus``, ``memory_mb``, ``storage_mb``), ``solution/solve.sh``, and every file of the folder as it is (for the
export). Compiled Python (``harbor init`` ships ``tests/__pycache__``) is kept but never run, and each line of
the tests that needs the network is named (:func:`network_needs`); both are told through ``on_note``. What a Dockerfile does that our
sandbox cannot reproduce (``RUN`` steps, a base image's own files, ``COPY`` to a
path outside the working directory, ``COPY --from``, URLs and archives in
``ADD``) is listed in the environment's ``meta["harbor"]["not_reproduced"]``:
tests that need installed packages will fail here. Multi-step tasks, binary
files and Compose environments are refused with an error naming the file and
the field.
"""

from __future__ import annotations

import base64
import glob
import json
import logging
import os
import re
import shlex
import stat
import tomllib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Iterable, Mapping

import tomlkit

from envloop_pipelines.core.environments.dataset import EnvironmentDataset, check_name, store_dataset
from envloop_pipelines.core.environments.episode import map_paths
from envloop_pipelines.core.environments.spec import (
    DEFAULT_COMMAND_LIMITS,
    DEFAULT_VERIFY_LIMITS,
    MAX_FILE_BYTES,
    MAX_FILES,
    EnvironmentSpec,
    SpecError,
    VerifierSpec,
)
from envloop_pipelines.core.sandbox import SandboxLimits
from envloop_pipelines.core.sandbox.tree import walk
from envloop_pipelines.core.verify.terminal import EXPECT_FILES

log = logging.getLogger(__name__)

HARBOR_SCHEMA_VERSION = "1.4"
#: The split whose environments a loop holds out (core.agents.evaluate's HELDOUT_SPLIT).
HELDOUT_SPLIT = "heldout"
#: The working directory of exported tasks (Harbor's convention).
WORKDIR = "/app"
#: python3 for the terminal-state check; the agent's tools are coreutils and bash.
BASE_IMAGE = "python:3.12-slim"
#: A Harbor agent has one timeout for the whole attempt; ours bounds each command. 600 s is 20 commands at
#: the default 30 s per command, and more than any shell task here takes.
AGENT_TIMEOUT_S = 600.0
CANARY = re.compile(r"^(<!--.*canary.*-->|#.*canary.*)$", re.IGNORECASE)
#: The header export puts before a reference solution (Harbor runs solve.sh as a program, from anywhere).
SOLUTION_HEADER = "#!/bin/bash\n# EnvLoop reference solution: it runs in the task's working directory.\ncd {workdir}\n"

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


class HeldoutExportError(ValueError):
    """An export would publish held-out environments without being asked to."""


def export_task(dataset: EnvironmentDataset, spec: EnvironmentSpec, folder: Path) -> Path:
    """Write one terminal environment as a Harbor task folder (which must not exist yet).

    A held-out environment's verifier material (``tests/``, ``solution/``) is written owner-only.
    """
    if spec.kind != "terminal":
        raise ValueError(f"{spec.id}: only terminal environments have a Harbor form, not {spec.kind!r}")
    private = spec.split == HELDOUT_SPLIT
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
        HeldoutExportError: the dataset has held-out terminal environments and ``include_heldout`` is off;
            nothing is written.
    """
    out = Path(out)
    held = [e.id for e in dataset.environments if e.kind == "terminal" and e.split == HELDOUT_SPLIT]
    if held and not include_heldout:
        raise HeldoutExportError(
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


# --------------------------------------------------------------------------- import


def _fail(path: Path, field: str, message: str) -> SpecError:
    return SpecError(f"{path}: field {field!r}: {message}")


def _text(path: Path, field: str) -> str:
    data = path.read_bytes()
    if len(data) > MAX_FILE_BYTES:
        raise _fail(path, field, f"{len(data)} bytes, more than {MAX_FILE_BYTES}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise _fail(path, field, "not UTF-8 text (binary files are not supported)") from None


def _number(toml: Path, raw: Mapping[str, Any], table: str, key: str, *, integer: bool = False) -> float | None:
    value = raw.get(table, {}).get(key)
    if value is None:
        return None
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or value <= 0:
        raise _fail(toml, f"{table}.{key}", f"must be a positive {'integer' if integer else 'number'}, got {value!r}")
    return value


def _logical_lines(text: str) -> Iterable[tuple[int, str]]:
    pending, start = "", 0
    for n, raw in enumerate(text.splitlines(), 1):
        if not pending and (not raw.strip() or raw.lstrip().startswith("#")):
            continue
        if not pending:
            start = n
        stripped = raw.rstrip()
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        yield start, pending + raw
        pending = ""
    if pending:
        yield start, pending


def _starting_files(env_dir: Path, workdir_setting: str | None) -> tuple[dict[str, str], str, list[str]]:
    """The files the Dockerfile copies into the working directory, the working directory, what is not reproduced."""
    dockerfile = env_dir / "Dockerfile"
    notes: list[str] = []
    placed: list[tuple[str, Path]] = []  # (absolute target in the image, host source file)
    cwd = "/"
    folders = {"/", *([workdir_setting] if workdir_setting else [])}  # destinations known to be folders
    if dockerfile.is_file():
        for line, text in _logical_lines(_text(dockerfile, "environment/Dockerfile")):
            instruction, _, rest = text.strip().partition(" ")
            op = instruction.upper()
            if op == "WORKDIR":
                cwd = str(PurePosixPath(cwd, rest.strip().strip("\"'")))
                folders.add(cwd)
            elif op in ("COPY", "ADD"):
                placed += _copy(env_dir, dockerfile, line, op, rest.strip(), cwd, folders, notes)
            elif op == "RUN":
                notes.append(f"Dockerfile:{line}: RUN is not run here")
            elif op == "FROM":
                notes.append(f"Dockerfile:{line}: the base image's own files and programs ({rest.split()[0] if rest.split() else ''})")
    workdir = workdir_setting or (cwd if cwd != "/" else WORKDIR)
    files: dict[str, str] = {}
    for target, source in placed:
        rel = PurePosixPath(target).relative_to(workdir) if PurePosixPath(target).is_relative_to(workdir) else None
        if rel is None or str(rel) == ".":
            notes.append(f"{source.relative_to(env_dir)} -> {target}: outside the working directory {workdir}")
            continue
        files[str(rel)] = _text(source, f"environment/{source.relative_to(env_dir)}")
    return files, workdir, notes


def _copy(env_dir: Path, dockerfile: Path, line: int, op: str, rest: str, cwd: str, folders: set[str],
          notes: list[str]) -> list[tuple[str, Path]]:
    try:
        args = json.loads(rest) if rest.startswith("[") else shlex.split(rest)
    except (ValueError, json.JSONDecodeError):
        raise SpecError(f"{dockerfile}:{line}: field '{op}': cannot parse {rest!r}") from None
    flags = [a for a in args if a.startswith("--")]
    args = [a for a in args if not a.startswith("--")]
    if any(f.startswith("--from") for f in flags):
        notes.append(f"Dockerfile:{line}: {op} --from (another image's files)")
        return []
    if len(args) < 2:
        raise SpecError(f"{dockerfile}:{line}: field '{op}': needs a source and a destination, got {rest!r}")
    *sources, dest = args
    dest_abs = str(PurePosixPath(cwd, dest))
    out: list[tuple[str, Path]] = []
    root = env_dir.resolve()
    matched: list[Path] = []
    for src in sources:
        if "://" in src or (op == "ADD" and re.search(r"\.(tar|tgz|gz|bz2|xz|zip)$", src)):
            notes.append(f"Dockerfile:{line}: {op} {src} (a URL or an archive)")
            continue
        hits = sorted(Path(p) for p in glob.glob(str(env_dir / src))) if any(c in src for c in "*?[") else [env_dir / src]
        for hit in hits:
            if not hit.resolve().is_relative_to(root):
                raise SpecError(f"{dockerfile}:{line}: field '{op}': {src!r} is outside environment/")
            if not hit.exists():
                raise SpecError(f"{dockerfile}:{line}: field '{op}': {src!r} is not in {env_dir}")
            matched.append(hit)
    # Docker copies a file into the destination when it names a folder: a trailing '/', '.', a WORKDIR.
    into_dir = dest.endswith("/") or dest in (".", "./") or len(matched) > 1 or dest_abs in folders
    for hit in matched:
        if hit.is_dir():  # a folder's contents go into the destination
            for f in sorted(p for p in hit.rglob("*") if p.is_file()):
                out.append((str(PurePosixPath(dest_abs, f.relative_to(hit).as_posix())), f))
        else:
            out.append((str(PurePosixPath(dest_abs, hit.name)) if into_dir else dest_abs, hit))
    return out


#: The parts of a task folder import reads; nothing in them may lead outside the folder.
READ_PARTS = ("task.toml", "instruction.md", "environment", "tests", "solution")
#: Folders of a task folder that are not the task (a checkout's own).
SKIPPED_FOLDERS = frozenset({".git"})


def _task_paths(task_dir: Path) -> list[Path]:
    """Every file and folder of the task folder (``.git`` aside), in walk order."""
    out = []
    for d, dirs, files in walk(task_dir):
        dirs[:] = [x for x in dirs if not (Path(d) == task_dir and x in SKIPPED_FOLDERS)]
        out += [Path(d) / n for n in [*dirs, *files]]
    return out


def _refuse_links(task_dir: Path) -> None:
    """Refuse a symlink or special file anywhere in the task folder, by name: import never reads outside the task.

    Raises:
        SpecError: naming the path, where it points and how to fix it.
    """
    for path in _task_paths(task_dir):
        try:
            st = path.lstat()
        except FileNotFoundError:
            continue
        rel = path.relative_to(task_dir).as_posix()
        if stat.S_ISLNK(st.st_mode):
            raise _fail(path, rel, f"is a symlink (to {os.readlink(path)!r}); import reads only files inside the "
                                   f"task folder: put the file itself there")
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
            raise _fail(path, rel, "is not a regular file or folder (a FIFO, socket or device); remove it")


def _is_compiled(path: Path) -> bool:
    return "__pycache__" in path.parts or path.suffix in (".pyc", ".pyo")


def task_files(task_dir: Path) -> dict[str, dict[str, Any]]:
    """Every file of the task folder as it is: ``{relative path: {"text" or "base64", "mode"}}``.

    Export writes them back byte for byte (:func:`export_task`), so a Harbor task comes back as it went.

    Raises:
        SpecError: more than :data:`MAX_FILES` files, or one of more than :data:`MAX_FILE_BYTES` bytes.
    """
    files = sorted(p for p in _task_paths(task_dir) if p.is_file())
    if len(files) > MAX_FILES:
        raise _fail(task_dir, "task folder", f"{len(files)} files, more than {MAX_FILES}")
    out: dict[str, dict[str, Any]] = {}
    for path in files:
        rel = path.relative_to(task_dir).as_posix()
        data = path.read_bytes()
        if len(data) > MAX_FILE_BYTES:
            raise _fail(path, rel, f"{len(data)} bytes, more than {MAX_FILE_BYTES}")
        try:
            entry: dict[str, Any] = {"text": data.decode("utf-8")}
        except UnicodeDecodeError:
            entry = {"base64": base64.b64encode(data).decode("ascii")}
        out[rel] = {**entry, "mode": stat.S_IMODE(path.stat().st_mode)}
    return out


def _tests_files(task_dir: Path, on_note: Callable[[str], None]) -> dict[str, str]:
    tests = task_dir / "tests"
    if not (tests / "test.sh").is_file():
        raise _fail(task_dir / "tests" / "test.sh", "tests/test.sh", "missing: a task needs tests/test.sh (other OS "
                                                                       "scripts are not supported)")
    out = {}
    for path in sorted(Path(d) / f for d, _, files in walk(tests) for f in files):
        rel = path.relative_to(task_dir).as_posix()
        if _is_compiled(path):
            # harbor init's template ships tests/__pycache__/test_outputs.cpython-312.pyc, and a local run of the
            # tests writes such files too: kept for export, never run (Python compiles the tests from source).
            on_note(f"{rel}: compiled Python (harbor init's template ships tests/__pycache__, and running the "
                    f"tests writes it): kept as it is for export; the tests run from their source")
            continue
        out[rel] = _text(path, rel)
    return out


#: Commands that reach the network (package managers, downloads, uv's runners). Environments here have none.
NETWORK_COMMANDS = re.compile(
    r"(?:^|[\s;&|(`]|\$\()((?:apt-get|apt|apk|yum|dnf)\s+(?:-\S+\s+)*(?:update|install|upgrade)\b.*"
    r"|(?:curl|wget)\s.*|(?:pip3?|python3?\s+-m\s+pip|uv\s+pip)\s+install\b.*|uvx\s.*|uv\s+(?:run|sync|add|tool)\b.*"
    r"|(?:npm|yarn|pnpm)\s+(?:install|ci|add)\b.*|git\s+clone\b.*)")


def network_needs(files: Mapping[str, str]) -> list[str]:
    """``file:line: command`` for each line of the tests' shell scripts that reaches the network.

    Harbor runs ``tests/test.sh`` in a container that may have one (``network_mode = "public"``); here the tests
    run without, so such a line fails, and the verdict says so (an ``error``, not the agent's failure).
    """
    found = []
    for rel, text in sorted(files.items()):
        if not rel.endswith(".sh"):
            continue
        for n, line in _logical_lines(text):
            m = NETWORK_COMMANDS.search(line.strip())
            # `command -v uvx`, `which curl`: a check for the program, not a use of the network.
            if m and not line.strip()[:m.start(1)].rstrip().endswith(("command -v", "which", "type", "hash")):
                found.append(f"{rel}:{n}: {m.group(1).strip()[:200]}")
    return found


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
        raise _fail(toml, field, "must be a table of sandbox limits")
    try:
        return SandboxLimits.from_dict({**default.to_dict(), **raw})
    except (TypeError, ValueError) as exc:
        raise _fail(toml, field, str(exc)) from None


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
    from envloop_pipelines.core.environments.episode import EPISODE_DISK_MB

    def resources(table: Mapping[str, Any], field: str, default: SandboxLimits, wall: float | None) -> SandboxLimits:
        cpus = _number(toml, {field: table}, field, "cpus") or 1
        memory = _number(toml, {field: table}, field, "memory_mb", integer=True)
        storage = _number(toml, {field: table}, field, "storage_mb", integer=True)
        wall = float(wall) if wall else default.wall_s
        return SandboxLimits.from_dict({
            **default.to_dict(), "wall_s": wall, "cpu_s": wall * float(cpus), "nproc": max(default.nproc, TASK_NPROC),
            **({"mem_mb": int(memory)} if memory else {}),
            "fsize_mb": int(min(storage, EPISODE_DISK_MB)) if storage else max(default.fsize_mb, EPISODE_DISK_MB // 4)})

    env_cfg = raw.get("environment", {})
    verifier_cfg = raw.get("verifier", {})
    inner = verifier_cfg.get("environment") if isinstance(verifier_cfg.get("environment"), dict) else {}
    limits = resources(env_cfg, "environment", DEFAULT_COMMAND_LIMITS, _number(toml, raw, "agent", "timeout_sec"))
    verifier = resources({**env_cfg, **inner}, "environment", DEFAULT_VERIFY_LIMITS,
                         _number(toml, raw, "verifier", "timeout_sec") or HARBOR_VERIFIER_TIMEOUT_S)
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
    _refuse_links(task_dir)
    try:
        raw = tomllib.loads(_text(toml, "task.toml"))
    except FileNotFoundError:
        raise SpecError(f"{toml}: missing (a Harbor task folder has task.toml)") from None
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"{toml}: not TOML ({exc})") from None
    version = raw.get("schema_version", raw.get("version", HARBOR_SCHEMA_VERSION))
    if not isinstance(version, str) or not version.startswith("1."):
        raise _fail(toml, "schema_version", f"this importer reads schema 1.x, got {version!r}")
    for table in ("task", "metadata", "verifier", "agent", "environment", "solution"):
        if table in raw and not isinstance(raw[table], dict):
            raise _fail(toml, table, f"must be a table, got {type(raw[table]).__name__}")
    if raw.get("steps"):
        raise _fail(toml, "steps", "multi-step tasks are not supported")
    verifier_timeout = _number(toml, raw, "verifier", "timeout_sec")
    agent_timeout = _number(toml, raw, "agent", "timeout_sec")
    memory_mb = _number(toml, raw, "environment", "memory_mb", integer=True)
    env_cfg = raw.get("environment", {})
    workdir = env_cfg.get("workdir")
    if workdir is not None and (not isinstance(workdir, str) or not workdir.startswith("/")):
        raise _fail(toml, "environment.workdir", f"must be an absolute path, got {workdir!r}")
    env_dir = task_dir / "environment"
    if (env_dir / "docker-compose.yaml").is_file():
        raise _fail(env_dir / "docker-compose.yaml", "environment", "Compose environments are not supported")
    if not env_dir.is_dir() and not env_cfg.get("docker_image"):
        raise _fail(toml, "environment.docker_image", f"no environment/ folder and no image: {env_dir} is missing")
    files, workdir, notes = _starting_files(env_dir, workdir)
    if env_cfg.get("docker_image"):
        notes.append(f"environment.docker_image {env_cfg['docker_image']}: the image's own files and programs")
    network = env_cfg.get("network_mode", "public" if env_cfg.get("allow_internet", True) else "no-network")
    if network != "no-network":
        notes.append(f"environment.network_mode {network!r}: environments here run without a network")
    instruction_path = task_dir / "instruction.md"
    if not instruction_path.is_file():
        raise _fail(instruction_path, "instruction.md", "missing")
    instruction = _strip_canary(_text(instruction_path, "instruction.md"))
    instruction = instruction[:-1] if instruction.endswith("\n") else instruction
    if not instruction.strip():
        raise _fail(instruction_path, "instruction.md", "empty")
    tests = _tests_files(task_dir, note)
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
        text = _text(solve, "solution/solve.sh")
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
            raise _fail(toml, f"{field}.meta", "must be a JSON object (text)") from None
        limits = _envloop_limits(toml, mine.get("limits", {}), f"{field}.limits", DEFAULT_COMMAND_LIMITS)
        verifier_limits = _envloop_limits(toml, mine.get("verifier_limits", {}), f"{field}.verifier_limits",
                                          DEFAULT_VERIFY_LIMITS)
        env_id, seed, split = mine.get("id"), mine.get("seed", 0), mine.get("split", "train")
    else:
        limits, verifier_limits = task_limits(toml, raw)
        name = raw.get("task", {}).get("name") or task_dir.name
        env_id = re.sub(r"[^A-Za-z0-9._/#-]", "-", str(name)).strip("/")[:200] or "task"
        seed, split = 0, "train"
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


__all__ = ["AGENT_TIMEOUT_S", "BASE_IMAGE", "HARBOR_SCHEMA_VERSION", "HarborExport", "HeldoutExportError",
           "NETWORK_COMMANDS", "WORKDIR", "export_harbor", "export_task", "import_harbor", "network_needs", "read_task",
           "task_files", "task_folders", "task_limits"]
