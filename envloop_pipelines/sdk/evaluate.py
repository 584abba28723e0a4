"""A checkpoint's metrics on labelled data, computed on this machine (as ``envloop eval``): ``Client.evaluate``.

Nothing here asks a deployment: the checkpoint is a directory here (``Client.fetch_checkpoint`` gives one) and
the data a file of labelled records or an open split of a task in a local EnvLoop home.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from envloop_pipelines.core.benchmark import SAFETY_FAMILIES
from envloop_pipelines.core.data.question_table import questions_table
from envloop_pipelines.core.data.snapshots import open_task
from envloop_pipelines.core.data.tabular import load_records
from envloop_pipelines.sdk.errors import ClientError


def evaluate(checkpoint: str | os.PathLike[str], *, records: str | os.PathLike[str] | None = None,
             task: str | None = None, split: str = "dev", home: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """Metrics of a checkpoint on labelled data, computed on this machine (as ``envloop eval``).

    Args:
        checkpoint: A checkpoint directory (:meth:`~envloop_pipelines.sdk.client.Client.fetch_checkpoint` gives one).
        records: A JSONL/CSV/Parquet file of labelled decision records; or
        task, split, home: an open split (``dev``, ``val``, ``train``) of a task in a local EnvLoop home.

    Raises:
        ClientError: neither or both of ``records`` and ``task``, or a split the verifier keeps.
    """
    # torch and the model's readers take seconds to import: only an evaluation pays for them
    from envloop_pipelines.core.model.predict import evaluate_checkpoint

    if (records is None) == (task is None):
        raise ClientError("records/task: give exactly one: a file of labelled records, or a task and an open split")
    if records is not None:
        table = questions_table(load_records(Path(records), require_group=False).records)
        source = {"records": str(records)}
    else:
        if split not in ("dev", "val", "train"):
            raise ClientError(f"split: {split!r} is not an open split (dev, val, train); test and holdout are "
                              f"scored by the verifier only")
        snapshot = open_task(str(task), home=home)
        table = snapshot.table(split)
        source = {"task": str(task), "split": split, "benchmark_version": snapshot.benchmark_version}
    return {**evaluate_checkpoint(checkpoint, table, safety_families=SAFETY_FAMILIES), **source}


__all__ = ["evaluate"]
