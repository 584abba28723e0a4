"""Hidden labels of test and holdout, read by the verifier only.

The model side never imports this module (``core.model`` and the training
entry points read snapshots through :class:`~envloop_pipelines.core.data.snapshots.TaskSnapshot`,
which refuses hidden labels). Every read is logged so a round can count them.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from envloop_pipelines.core.data.snapshots import SnapshotIntegrityError, hidden_labels_dir, open_task
from envloop_pipelines.core.data.splits import HIDDEN_SPLITS
from envloop_pipelines.core.storage import sha256_file

log = logging.getLogger(__name__)


def read_hidden_labels(task: str, split: str, *, snapshot_id: str | None = None, home: str | Path | None = None) -> pa.Table:
    """Labels of a hidden split, checked against the snapshot manifest.

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
    path = hidden_labels_dir(task, snapshot.snapshot_id, home) / meta["file"]
    if not path.exists() or sha256_file(path) != meta["sha256"]:
        raise SnapshotIntegrityError(f"{path}: hidden labels missing or sha256 differs from the manifest")
    log.info("verifier read hidden labels %s", json.dumps({"task": task, "split": split, "snapshot": snapshot.snapshot_id}))
    return pq.read_table(path)
