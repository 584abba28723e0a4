"""Use case of the data layer: import a user's file as a snapshot (the built-in task: ``core/benchmark/builtin_task.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from envloop_pipelines.core.data.records import DEFAULT_GROUP_KEY, DEFAULT_TOKEN_BUDGET
from envloop_pipelines.core.data.snapshots import TaskSnapshot, create_snapshot
from envloop_pipelines.core.data.splits import SplitFractions
from envloop_pipelines.core.storage import sha256_file
from envloop_pipelines.core.data.tabular import ColumnMapping, load_records


def import_file(
    path: str | Path,
    task: str,
    *,
    mapping: ColumnMapping | None = None,
    fractions: SplitFractions = SplitFractions(),
    seed: int = 0,
    group_key: str = DEFAULT_GROUP_KEY,
    token_budget: int | None = DEFAULT_TOKEN_BUDGET,
    home: str | Path | None = None,
    extra: dict[str, Any] | None = None,
) -> TaskSnapshot:
    """Validate a whole file, then publish it as a new snapshot of ``task``.

    Raises:
        DataValidationError: every error in the file; nothing was written.
    """
    path = Path(path)
    report = load_records(path, mapping=mapping, require_group=True, token_budget=token_budget)
    source = {
        "path": str(path.resolve()),
        "sha256": sha256_file(path),
        "format": path.suffix.lower().lstrip("."),
        "mapping": None if mapping is None else repr(mapping),
    }
    return create_snapshot(report.records, task, source=source, fractions=fractions, seed=seed,
                           group_key=group_key, home=home, extra=extra)
