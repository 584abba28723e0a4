"""The Harbor task folder: its layout, the names both directions share, and the readers that name the field.

A Harbor task (the ``harbor`` package on PyPI, schema 1.4) is a folder::

    task.toml            schema_version, [task] name, [metadata], [verifier], [agent], [environment]
    instruction.md       the instruction
    environment/         Dockerfile (+ the files it COPYs): the agent's container
    tests/test.sh        hidden tests: copied to /tests only for verification; write /logs/verifier/reward.txt
    solution/solve.sh    the reference solution (the oracle agent runs it)

:mod:`.harbor_export` writes such folders, :mod:`.harbor_import` reads them (with :mod:`.harbor_files` for
the files of the folder), and :mod:`.harbor_verifier` runs their tests' contract here. Every error of a
reader here is a :class:`~.spec.SpecError` that names the file and the field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Mapping

from envloop_pipelines.core.environments.spec import MAX_FILE_BYTES, SpecError

HARBOR_SCHEMA_VERSION = "1.4"
#: The working directory of exported tasks (Harbor's convention).
WORKDIR = "/app"
#: The header export puts before a reference solution (Harbor runs solve.sh as a program, from anywhere).
SOLUTION_HEADER = "#!/bin/bash\n# EnvLoop reference solution: it runs in the task's working directory.\ncd {workdir}\n"


def field_error(path: Path, field: str, message: str) -> SpecError:
    """The error of a task folder's file: ``<path>: field '<field>': <message>``."""
    return SpecError(f"{path}: field {field!r}: {message}")


def read_text_file(path: Path, field: str) -> str:
    """A task folder's file as text: UTF-8, at most :data:`~.spec.MAX_FILE_BYTES` bytes.

    Raises:
        SpecError: a larger file, or one that is not UTF-8 (binary files are not supported).
    """
    data = path.read_bytes()
    if len(data) > MAX_FILE_BYTES:
        raise field_error(path, field, f"{len(data)} bytes, more than {MAX_FILE_BYTES}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise field_error(path, field, "not UTF-8 text (binary files are not supported)") from None


def positive_number(toml: Path, raw: Mapping[str, Any], table: str, key: str, *,
                    integer: bool = False) -> float | None:
    """``raw[table][key]`` of a ``task.toml``: a positive number (an integer with ``integer``), or None when unset.

    Raises:
        SpecError: any other value, naming ``table.key``.
    """
    value = raw.get(table, {}).get(key)
    if value is None:
        return None
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or value <= 0:
        raise field_error(toml, f"{table}.{key}",
                          f"must be a positive {'integer' if integer else 'number'}, got {value!r}")
    return value


def logical_lines(text: str) -> Iterable[tuple[int, str]]:
    """``(first line number, line)`` of a shell script or Dockerfile: continuations joined, blanks and comments
    skipped."""
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


__all__ = ["HARBOR_SCHEMA_VERSION", "SOLUTION_HEADER", "WORKDIR", "field_error", "logical_lines", "positive_number",
           "read_text_file"]
