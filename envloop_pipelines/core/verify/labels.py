"""The labels a verifier scores against: private to ``core/verify/``.

Every read of test or holdout labels goes through the verifier's one door,
:func:`envloop_pipelines.core.verify.runner.verify_task`, which answers hidden
splits with aggregate scores only and reads the holdout only inside its
release's one read. No module outside ``core/verify/`` imports this one
(``envloop_pipelines_tests/test_import_direction.py`` fails when one does, at
any depth of the file). The training side reads snapshots through
:class:`~envloop_pipelines.core.data.snapshots.TaskSnapshot`, which refuses
hidden labels. Every read is logged so a round can count them.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from envloop_pipelines.core.data.snapshots import (
    SnapshotIntegrityError,
    hidden_labels_dir,
    open_task,
    restrict_hidden_labels,
)
from envloop_pipelines.core.data.splits import HIDDEN_SPLITS
from envloop_pipelines.core.storage import sha256_file

log = logging.getLogger(__name__)


def read_hidden_labels(task: str, split: str, *, snapshot_id: str | None = None, home: str | Path | None = None) -> pa.Table:
    """Labels of a hidden split, checked against the snapshot manifest.

    A label store written before its files were owner-only (an older home) is narrowed here
    on its first read (:func:`~envloop_pipelines.core.data.snapshots.restrict_hidden_labels`).

    Args:
        task: the task name.
        split: ``test`` or ``holdout``.
        snapshot_id: the snapshot (default: the task's current one).
        home: the EnvLoop home.
    """
    if split not in HIDDEN_SPLITS:
        raise ValueError(f"{split!r} is not a hidden split; hidden splits: {', '.join(sorted(HIDDEN_SPLITS))}")
    snapshot = open_task(task, snapshot_id=snapshot_id, home=home)
    meta = snapshot.manifest.hidden_labels[split]
    folder = hidden_labels_dir(task, snapshot.snapshot_id, home)
    path = folder / meta["file"]
    if not path.exists() or sha256_file(path) != meta["sha256"]:
        raise SnapshotIntegrityError(f"{path}: hidden labels missing or sha256 differs from the manifest")
    restrict_hidden_labels(folder, home)
    log.info("verifier read hidden labels %s", json.dumps({"task": task, "split": split, "snapshot": snapshot.snapshot_id}))
    return pq.read_table(path)


def split_labels(task: str, split: str, *, snapshot_id: str | None = None, home: str | Path | None = None) -> pa.Table:
    """The labels of ``split``: hidden splits through :func:`read_hidden_labels`, open ones from the snapshot."""
    if split in HIDDEN_SPLITS:
        return read_hidden_labels(task, split, snapshot_id=snapshot_id, home=home)
    return open_task(task, snapshot_id=snapshot_id, home=home).labels(split)
