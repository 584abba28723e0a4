"""Dagster resources wrapping the loop's core: its settings, MLflow, and the store of step values.

``LoopResource``'s fields are generated from :class:`~envloop_pipelines.core.ledger.loop_config.LoopConfig`
(one field per setting, same name and default), so the resource cannot drift from
the core. ``recipe_overrides`` is JSON text here (Dagster config and environment
variables are text); ``safety_families`` a list.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import dagster as dg
import pydantic

from envloop_pipelines.core.data.snapshots import TaskSnapshot, open_pinned_task
from envloop_pipelines.core.decision_loop.step_records import Benchmark
from envloop_pipelines.core.ledger.loop_config import LoopConfig, field_default, field_type, loop_fields
from envloop_pipelines.core.tracking import MlflowTracker


class _LoopSettings(dg.ConfigurableResource):
    def config(self) -> LoopConfig:
        """The loop's settings as the core's value (validated there)."""
        return LoopConfig.from_settings({f.name: getattr(self, f.name) for f in loop_fields()})

    def task_snapshot(self, benchmark: Benchmark) -> TaskSnapshot:
        """The task's snapshot for one step, opened once and handed to every core function the step calls.

        Refused (``BenchmarkMismatchError``, naming the task and both versions) unless it is the benchmark
        version ``benchmark`` (the stored ``task_benchmark``) pinned: a task re-imported since is never read.
        """
        return open_pinned_task(self.task, benchmark.benchmark_version, home=self.home)

    @property
    def settings(self) -> dict[str, Any]:
        """JSON-able settings (what a run records in its tags, and what :func:`loop_resource` reads back)."""
        return self.config().to_settings()


def _resource_field(f: Any) -> tuple[Any, Any]:
    default = field_default(f)
    if f.name == "recipe_overrides":
        return str, json.dumps(dict(default))
    if f.name == "safety_families":
        return list[str], pydantic.Field(default_factory=lambda d=tuple(default): list(d))
    kind = field_type(f)
    return (kind | None if default is None else kind), default


LoopResource = pydantic.create_model(  # type: ignore[call-overload]
    "LoopResource",
    __base__=_LoopSettings,
    __module__=__name__,
    __doc__="The loop a code location runs: every setting of ``LoopConfig`` (env ``ENVLOOP_<FIELD>``).",
    **{f.name: _resource_field(f) for f in loop_fields()},
)


def loop_resource(settings: Mapping[str, Any]) -> Any:
    """A ``LoopResource`` from settings (``LoopConfig`` names; ``recipe_overrides`` a mapping or JSON)."""
    data = dict(settings)
    if "recipe_overrides" in data and not isinstance(data["recipe_overrides"], str):
        data["recipe_overrides"] = json.dumps(dict(data["recipe_overrides"]), sort_keys=True)
    if "safety_families" in data:
        data["safety_families"] = list(data["safety_families"])
    return LoopResource(**data)


class MlflowResource(dg.ConfigurableResource):
    """MLflow, the system of record. Empty ``tracking_uri``: ``$MLFLOW_TRACKING_URI`` or SQLite under the home."""

    tracking_uri: str | None = None
    home: str | None = None

    def tracker(self) -> MlflowTracker:
        return MlflowTracker(self.tracking_uri, home=self.home)
