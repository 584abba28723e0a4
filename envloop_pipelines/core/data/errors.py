"""Errors in decision data, each located by file, line (or row) and field.

Every loader (JSONL, CSV/Parquet, snapshots) collects all the problems of a file
as :class:`FieldError` values and raises them together in one
:class:`DataValidationError`, so a person fixes a file in one pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class FieldError:
    """One problem in an input file, located by file, line (or row) and field."""

    file: str
    line: int | None
    field: str
    message: str

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.line is not None else self.file
        return f"{where}: {self.field}: {self.message}"


class DataValidationError(ValueError):
    """Raised with every error of a file at once; nothing was imported."""

    def __init__(self, errors: Sequence[FieldError], max_shown: int = 50) -> None:
        self.errors: tuple[FieldError, ...] = tuple(errors)
        shown = "\n".join(f"  {e}" for e in self.errors[:max_shown])
        more = len(self.errors) - max_shown
        tail = f"\n  ... and {more} more" if more > 0 else ""
        files = sorted({e.file for e in self.errors})
        super().__init__(f"{len(self.errors)} error(s) in {', '.join(files)}:\n{shown}{tail}")
