"""The files of a Harbor task folder, as import takes them.

Links and special files anywhere in the folder are refused (:func:`refuse_links`: import never reads outside
the task); every file is kept as it is, for the export (:func:`task_files`); ``tests/`` becomes the hidden
tests (:func:`tests_files`: compiled Python kept but never run); the starting files are what the Dockerfile's
``COPY``/``ADD`` put into the working directory (:func:`starting_files`), with what it does that this sandbox
cannot reproduce listed.
"""

from __future__ import annotations

import base64
import glob
import json
import os
import re
import shlex
import stat
from pathlib import Path, PurePosixPath
from typing import Any, Callable

from envloop_pipelines.core.environments.harbor_format import WORKDIR, field_error, logical_lines, read_text_file
from envloop_pipelines.core.environments.spec import MAX_FILE_BYTES, MAX_FILES, SpecError
from envloop_pipelines.core.sandbox.tree import walk


def starting_files(env_dir: Path, workdir_setting: str | None) -> tuple[dict[str, str], str, list[str]]:
    """The files the Dockerfile copies into the working directory, the working directory, what is not reproduced."""
    dockerfile = env_dir / "Dockerfile"
    notes: list[str] = []
    placed: list[tuple[str, Path]] = []  # (absolute target in the image, host source file)
    cwd = "/"
    folders = {"/", *([workdir_setting] if workdir_setting else [])}  # destinations known to be folders
    if dockerfile.is_file():
        for line, text in logical_lines(read_text_file(dockerfile, "environment/Dockerfile")):
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
        files[str(rel)] = read_text_file(source, f"environment/{source.relative_to(env_dir)}")
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


def refuse_links(task_dir: Path) -> None:
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
            raise field_error(path, rel, f"is a symlink (to {os.readlink(path)!r}); import reads only files inside the "
                                   f"task folder: put the file itself there")
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
            raise field_error(path, rel, "is not a regular file or folder (a FIFO, socket or device); remove it")


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
        raise field_error(task_dir, "task folder", f"{len(files)} files, more than {MAX_FILES}")
    out: dict[str, dict[str, Any]] = {}
    for path in files:
        rel = path.relative_to(task_dir).as_posix()
        data = path.read_bytes()
        if len(data) > MAX_FILE_BYTES:
            raise field_error(path, rel, f"{len(data)} bytes, more than {MAX_FILE_BYTES}")
        try:
            entry: dict[str, Any] = {"text": data.decode("utf-8")}
        except UnicodeDecodeError:
            entry = {"base64": base64.b64encode(data).decode("ascii")}
        out[rel] = {**entry, "mode": stat.S_IMODE(path.stat().st_mode)}
    return out


def tests_files(task_dir: Path, on_note: Callable[[str], None]) -> dict[str, str]:
    tests = task_dir / "tests"
    if not (tests / "test.sh").is_file():
        raise field_error(task_dir / "tests" / "test.sh", "tests/test.sh",
                          "missing: a task needs tests/test.sh (other OS scripts are not supported)")
    out = {}
    for path in sorted(Path(d) / f for d, _, files in walk(tests) for f in files):
        rel = path.relative_to(task_dir).as_posix()
        if _is_compiled(path):
            # harbor init's template ships tests/__pycache__/test_outputs.cpython-312.pyc, and a local run of the
            # tests writes such files too: kept for export, never run (Python compiles the tests from source).
            on_note(f"{rel}: compiled Python (harbor init's template ships tests/__pycache__, and running the "
                    f"tests writes it): kept as it is for export; the tests run from their source")
            continue
        out[rel] = read_text_file(path, rel)
    return out


__all__ = ["READ_PARTS", "SKIPPED_FOLDERS", "refuse_links", "starting_files", "task_files", "tests_files"]
