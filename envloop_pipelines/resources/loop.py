"""Dagster resources wrapping the loop's core: its settings, MLflow, and the store of step values.

``LoopResource``'s fields are generated from :class:`~envloop_pipelines.core.loop.config.LoopConfig`
(one field per setting, same name and default), so the resource cannot drift from
the core. ``recipe_overrides`` is a mapping of recipe fields here as everywhere but the
environment variable (``ENVLOOP_RECIPE_OVERRIDES``, its JSON text); ``safety_families`` a list.

``DeploymentLoopResource`` is the code location's loop (``definitions.py``): the same fields, each
unset by default. When Dagster loads the code location (never at import) every ``ENVLOOP_<FIELD>`` then
set becomes a configured value (:func:`deployment_loop_resource`); a setting still unset is read from
``ENVLOOP_<FIELD>`` when a run (a step, a sensor tick, the IO manager) uses the resource, else it is
``LoopConfig``'s default.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any, ClassVar

import dagster as dg
import pydantic

from envloop_pipelines.core.data.snapshots import TaskSnapshot, open_pinned_task
from envloop_pipelines.core.decision_loop.step_records import Benchmark
from envloop_pipelines.core.loop.config import (
    LoopConfig,
    env_name,
    field_default,
    field_type,
    loop_fields,
    settings_from_env,
)
from envloop_pipelines.core.tracking import MlflowTracker
from envloop_pipelines.resources.settings import SettingsResource, settings_resource_model


class _LoopSettings(SettingsResource):
    """The loop's settings, built into a ``LoopConfig`` once per run (``SettingsResource``): a misspelled launchpad
    override is refused when the run's resources are set up, naming the key, before any step's body."""

    SETTINGS: ClassVar[Any] = LoopConfig

    def task_snapshot(self, benchmark: Benchmark) -> TaskSnapshot:
        """The task's snapshot for one step, opened once and handed to every core function the step calls.

        Refused (``BenchmarkMismatchError``, naming the task and both versions) unless it is the benchmark
        version ``benchmark`` (the stored ``task_benchmark``) pinned: a task re-imported since is never read.
        """
        cfg = self.config()
        return open_pinned_task(cfg.task, benchmark.benchmark_version, home=cfg.home)

    @property
    def settings(self) -> dict[str, Any]:
        """JSON-able settings (what a run records in its tags, and what :func:`loop_resource` reads back)."""
        return self.config().to_settings()


def _resource_field(f: Any) -> tuple[Any, Any]:
    default = field_default(f)
    if f.name == "recipe_overrides":
        return dict[str, Any], pydantic.Field(default_factory=dict)
    if f.name == "safety_families":
        return list[str], pydantic.Field(default_factory=lambda d=tuple(default): list(d))
    kind = field_type(f)
    return (kind | None if default is None else kind), default


LoopResource = settings_resource_model(
    "LoopResource", _LoopSettings,
    "The loop a code location runs: every setting of ``LoopConfig`` (env ``ENVLOOP_<FIELD>``).", _resource_field)


class _SettingsFromEnv(LoopResource):  # type: ignore[misc, valid-type]
    def build_config(self) -> LoopConfig:
        """The loop's settings as the core's value: the fields set here (at construction or in the run's config),
        the rest from ``ENVLOOP_<FIELD>`` as the environment is now, else ``LoopConfig``'s defaults.

        Raises:
            ValueError: a variable that does not parse (naming it) or a setting ``LoopConfig`` refuses.
        """
        given = {f.name: getattr(self, f.name) for f in loop_fields() if getattr(self, f.name) is not None}
        unset = {env_name(f.name) for f in loop_fields() if f.name not in given}
        return LoopConfig.from_settings({**settings_from_env({k: v for k, v in os.environ.items() if k in unset}),
                                         **given})


def _unset_field(f: Any) -> tuple[Any, Any]:
    kind = _resource_field(f)[0]
    default = field_default(f)
    shown = json.dumps(dict(default)) if f.name == "recipe_overrides" else (
        ",".join(default) if f.name == "safety_families" else default)
    help_text = f.metadata.get("help", "").strip()
    return kind | None, pydantic.Field(default=None, description=(
        f"{help_text} Unset: ${env_name(f.name)} when a run uses the resource, else {shown!r}.").strip())


DeploymentLoopResource = settings_resource_model(
    "DeploymentLoopResource", _SettingsFromEnv,
    "The code location's loop: each setting of ``LoopConfig`` set here, else ``ENVLOOP_<FIELD>`` at run time.",
    _unset_field)


def deployment_loop_resource(environ: Mapping[str, str]) -> Any:
    """The code location's loop as Dagster loads it: each ``ENVLOOP_<FIELD>`` set in ``environ`` as a configured
    value (what the UI and a remote ``Client.loop_settings()`` read), the rest unset (read at run time, else
    ``LoopConfig``'s default).

    Raises:
        ValueError: a variable that does not parse, naming it (the code location does not load).
    """
    return DeploymentLoopResource(**_resource_values(settings_from_env(environ)))


def _resource_values(settings: Mapping[str, Any]) -> dict[str, Any]:
    data = dict(settings)
    if isinstance(data.get("recipe_overrides"), Mapping):
        data["recipe_overrides"] = dict(data["recipe_overrides"])
    if "safety_families" in data:
        data["safety_families"] = list(data["safety_families"])
    return data


def loop_resource(settings: Mapping[str, Any]) -> Any:
    """A ``LoopResource`` from settings (``LoopConfig`` names and values).

    Raises:
        ValueError: a setting ``LoopConfig`` refuses, named by its check (before pydantic sees the value).
    """
    LoopConfig.from_settings(settings)
    return LoopResource(**_resource_values(settings))


class MlflowResource(dg.ConfigurableResource):
    """MLflow, the system of record. Empty ``tracking_uri``: ``$MLFLOW_TRACKING_URI`` or SQLite under the home."""

    tracking_uri: str | None = None
    home: str | None = None

    def tracker(self) -> MlflowTracker:
        return MlflowTracker(self.tracking_uri, home=self.home)
