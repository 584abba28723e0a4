"""The round's MLflow runs, its predictions on disk and its calls to the verifier.

A round has one parent run (``envloop.kind=round``) and one child run per step
that records something, named ``<round> <step>`` with ``envloop.kind`` the step's
asset name (constants in ``core/tracking.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from envloop_pipelines.core.loop.config import LoopConfig
from envloop_pipelines.core.sandbox import SandboxSettings
from envloop_pipelines.core.storage import atomic_write_parquet
from envloop_pipelines.core.tracking import KIND_ROUND, TAG_KIND, TAG_ROUND, TAG_SUPERSEDED, TrackedRun, Tracker

log = logging.getLogger(__name__)


def round_run(tracker: Tracker, config: LoopConfig, key: str, tags: Mapping[str, str] | None = None) -> TrackedRun:
    """The round's parent MLflow run (found again on a retry)."""
    found = tracker.find_run(config.task, {TAG_ROUND: key, TAG_KIND: KIND_ROUND})
    if found is not None:
        return found
    return tracker.start_run(config.task, f"round {key}", tags={TAG_ROUND: key, TAG_KIND: KIND_ROUND, **(tags or {})})


def child_run(tracker: Tracker, config: LoopConfig, key: str, kind: str,
              tags: Mapping[str, str] | None = None) -> TrackedRun:
    """A fresh child run of the round's parent run, of ``kind`` (a ``KIND_*`` of ``core/tracking.py``).

    A step that died mid-way (its worker killed) left its run RUNNING; the retry closes it as
    KILLED, tagged ``envloop.superseded``, so each step of a round has one finished run.
    """
    parent = round_run(tracker, config, key, tags)
    for stale in tracker.running_runs(config.task, {TAG_ROUND: key, TAG_KIND: kind}):
        tracker.set_tags(stale, {TAG_SUPERSEDED: "a retry of the step started a new run"})
        tracker.end_run(stale, "KILLED")
        log.warning("round %s: closed the %s run %s left RUNNING by a dead worker", key, kind, stale)
    return tracker.start_run(config.task, f"{key} {kind}", parent_run_id=parent.run_id,
                             tags={TAG_ROUND: key, TAG_KIND: kind, **(tags or {})})


def flat_metrics(d: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """Finite numbers of a nested metrics dict as MLflow metric names (``a.b``; ``acc/x`` → ``acc.x``)."""
    out: dict[str, float] = {}
    for k, v in d.items():
        name = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flat_metrics(v, name + "."))
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and np.isfinite(v):
            out[name.replace("/", ".")] = float(v)
    return out


def write_predictions(path: Path, checkpoint: str | Path, table: pa.Table, *, home: str | Path | None = None) -> Path:
    """The checkpoint's predictions on ``table`` (inputs only), written atomically as Parquet.

    With ``home`` they are computed once per (checkpoint, inputs) and reused from
    ``<home>/artifacts/predictions`` (the champion answers a test split once, not every round).
    """
    from envloop_pipelines.core.model.predict import predict_table

    cache = None if home is None else Path(home) / PREDICTIONS_CACHE
    return atomic_write_parquet(path, predict_table(checkpoint, table, cache_dir=cache), overwrite=True)


#: Where reused predictions live under the EnvLoop home.
PREDICTIONS_CACHE = "artifacts/predictions"


def verify_predictions(config: LoopConfig, split: str, predictions: Path, baseline: Path | None = None,
                       seed: int = 0, *, holdout_slot: Any = None, release: int | None = None,
                       checkpoint: str | Path | None = None, baseline_checkpoint: str | Path | None = None,
                       safety_thresholds: Mapping[str, float] | None = None,
                       baseline_safety_thresholds: Mapping[str, float] | None = None,
                       reader: str = "adhoc", read_budget: int | None = None,
                       sandbox: SandboxSettings | None = None) -> Any:
    """Score predictions on a hidden split in the sandboxed verifier (a separate process), aggregate scores only.

    Args:
        holdout_slot: the ledger, for the holdout: the read is the release's one read.
        release: the release whose holdout read this is.
        checkpoint: the checkpoint that made ``predictions``: its safety thresholds (calibration) are
            scored too, so the verifier reports the defer rate and automated FNR that ``envloop serve``
            would give. ``baseline_checkpoint``: the same for ``baseline``.
        safety_thresholds: thresholds given directly (a model that is no checkpoint, such as TF-IDF);
            ``baseline_safety_thresholds``: the same for ``baseline``.
        reader: who reads ``test`` (the ``test_read`` event names it; rule 4): ``round:<round key>`` for a
            round's step (its candidate, champion and TF-IDF baseline, at most
            :data:`~envloop_pipelines.core.ledger.reads.ROUND_TEST_READ_BUDGET` files),
            ``setup:<noise floor key>`` for the loop's setup (with ``read_budget``:
            ``setup.setup_reader``), ``adhoc`` (default) for a person's own call (not limited).
            Every loop step passes its reader.
        sandbox: the deployment's sandbox, where the verifier's worker runs (default: the local backend).

    Raises:
        RuntimeError: the verifier failed; the message carries its status and the worker's stderr.
        HoldoutAlreadyReadError: the release already read the holdout.
        TestReadBudgetError: a ``test`` read beyond the reader's budget (refused before the labels are read).
    """
    from envloop_pipelines.core.verify.runner import verify_task

    if checkpoint is not None:
        safety_thresholds = checkpoint_safety_thresholds(checkpoint)
    baseline_safety = (checkpoint_safety_thresholds(baseline_checkpoint) if baseline_checkpoint is not None
                       else baseline_safety_thresholds)
    run = verify_task(config.task, split, predictions, home=config.home, safety_families=config.safety_families,
                      baseline_predictions=baseline, seed=seed, holdout_slot=holdout_slot, release=release,
                      safety_thresholds=safety_thresholds, baseline_safety_thresholds=baseline_safety,
                      reader=reader, read_budget=read_budget, sandbox=sandbox)
    if not run.ok:
        raise RuntimeError(f"verifier on {split} failed ({run.status}): {run.error}; "
                           f"worker stderr: {run.sandbox.stderr_tail[-1000:]!r}")
    return run


def checkpoint_safety_thresholds(checkpoint: str | Path) -> dict[str, float]:
    """A checkpoint's safety thresholds on P(false), from its calibration (empty when it declares none)."""
    import json

    from envloop_pipelines.core.model.calibration import Calibration

    raw = json.loads((Path(checkpoint) / "calibration.json").read_text(encoding="utf-8"))
    return dict(Calibration.from_dict(raw).safety_thresholds)


__all__ = ["PREDICTIONS_CACHE", "checkpoint_safety_thresholds", "child_run", "flat_metrics", "round_run",
           "verify_predictions", "write_predictions"]
