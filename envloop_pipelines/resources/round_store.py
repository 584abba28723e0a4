"""The IO manager of the loop's steps: typed values stored as JSON in the loop's ``RoundStore``.

Each asset returns a frozen record (``core/decision_loop/step_records.py``); this IO manager
writes it to ``<home>/loops/<task>/rounds/<round>/<asset>.json`` (or
``<home>/loops/<task>/<asset>.json`` for an unpartitioned asset) and loads it
back, by the record type registered for the asset, for every downstream asset
and check. The files live under the EnvLoop home, so steps in other processes
(the multiprocess executor) or pods (``k8s_job_executor`` with the home on a
shared volume) read what upstream steps wrote.
"""

from __future__ import annotations

from typing import Any

import dagster as dg

from envloop_pipelines.core.decision_loop.step_records import STEP_RECORDS
from envloop_pipelines.core.ledger.store import RoundStore
from envloop_pipelines.resources.loop import LoopResource


def _where(context: dg.OutputContext | dg.InputContext) -> tuple[str, str | None]:
    step = context.asset_key.path[-1]
    if step not in STEP_RECORDS:
        raise dg.DagsterInvariantViolationError(f"asset {step!r} has no record type in core/decision_loop/step_records.STEP_RECORDS")
    return step, context.asset_partition_key if context.has_asset_partitions else None


class RoundStoreIOManager(dg.ConfigurableIOManager):
    """Round step values as JSON in the loop's store (see the module docstring)."""

    loop: LoopResource  # type: ignore[valid-type]

    def _store(self) -> RoundStore:
        cfg = self.loop.config()
        return RoundStore(cfg.task, cfg.home)

    def handle_output(self, context: dg.OutputContext, obj: Any) -> None:
        step, key = _where(context)
        if not isinstance(obj, STEP_RECORDS[step]):
            raise dg.DagsterTypeCheckDidNotPass(
                f"asset {step} returned {type(obj).__name__}, expected {STEP_RECORDS[step].__name__}")
        path = self._store().save(step, obj, key)
        context.add_output_metadata({"stored_at": dg.MetadataValue.path(str(path))})

    def load_input(self, context: dg.InputContext) -> Any:
        step, key = _where(context)
        value = self._store().load(step, STEP_RECORDS[step], key)
        if value is None:
            raise dg.DagsterInvariantViolationError(
                f"{self._store().step_path(step, key)} is missing: materialize {step}"
                + (f" for round {key}" if key else "") + " first")
        return value
