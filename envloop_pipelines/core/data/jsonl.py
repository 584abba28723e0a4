"""Reading a JSONL file of decision records, with every error named by file, line and field.

Bytes that are not UTF-8 and lines that are not JSON are reported by line (and
column); each decoded object then goes through
:func:`~envloop_pipelines.core.data.records.records_from_objects`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from envloop_pipelines.core.data.errors import DataValidationError, FieldError
from envloop_pipelines.core.data.json_text import decode_json
from envloop_pipelines.core.data.records import (
    DEFAULT_GROUP_KEY,
    DEFAULT_TOKEN_BUDGET,
    LoadReport,
    records_from_objects,
)


def utf8_errors(raw: bytes, file: str, max_errors: int = 50) -> list[FieldError]:
    """Every byte of ``raw`` that is not UTF-8, by line and column (the first ``max_errors``, then a count)."""
    errors: list[FieldError] = []
    bad = 0
    for number, line in enumerate(raw.split(b"\n"), start=1):
        start = 0
        while True:
            try:
                line[start:].decode("utf-8")
                break
            except UnicodeDecodeError as exc:
                at = start + exc.start
                bad += 1
                if len(errors) < max_errors:
                    errors.append(FieldError(file, number, "<encoding>",
                                             f"not UTF-8: byte 0x{line[at]:02x} at column {at + 1}"))
                start = start + max(exc.end, exc.start + 1)
    if bad > len(errors):
        errors.append(FieldError(file, None, "<encoding>", f"{bad - len(errors)} more bytes that are not UTF-8 "
                                                           f"({bad} in all)"))
    return errors


def load_jsonl(
    path: str | Path,
    *,
    group_key: str = DEFAULT_GROUP_KEY,
    require_group: bool = False,
    require_labels: bool = True,
    token_budget: int | None = DEFAULT_TOKEN_BUDGET,
    count_tokens: Callable[[list[str]], list[int]] | None = None,
) -> LoadReport:
    """Load and validate a JSONL file of decision records.

    Raises:
        DataValidationError: with every error in the file (file, line, field).
        FileNotFoundError: when the file does not exist.
    """
    path = Path(path)
    file = str(path)
    raw = path.read_bytes()
    errors: list[FieldError] = []
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise DataValidationError(utf8_errors(raw, file)) from None
    if text.startswith("\ufeff"):
        text = text[1:]
    objects: list[tuple[Any, int | None]] = []
    lines = text.split("\n")
    for number, line_text in enumerate(lines, start=1):
        if not line_text.strip():
            continue
        try:
            objects.append((decode_json(line_text), number))
        except json.JSONDecodeError as exc:
            errors.append(FieldError(file, number, "<json>", f"invalid JSON: {exc.msg} at column {exc.colno}"))
    if not objects and not errors:
        raise DataValidationError([FieldError(file, None, "<file>", "empty file: no records")])
    records = records_from_objects(
        objects, file=file, group_key=group_key, require_group=require_group, require_labels=require_labels,
        token_budget=token_budget, count_tokens=count_tokens, errors=errors,
    )
    return LoadReport(records=records, source=file, n_lines=len(lines))
