"""What both loops' Dagster resources share: a settings resource generated from a core dataclass, built into the
core's value once per run, and one IO manager that stores each step's frozen record in the task's ``RoundStore``.

The decision loop (``resources/loop.py``: ``LoopResource`` from ``LoopConfig``, ``RoundStoreIOManager``) and the
RL round (``resources/rl.py``: ``RlResource`` from ``RlRoundConfig``, ``RlStoreIOManager``) differ only in the
dataclass, each field's Dagster type and the table of step records; this module is the machinery once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import dagster as dg
import pydantic

from envloop_pipelines.core.ledger.store import RoundStore


class SettingsResource(dg.ConfigurableResource):
    """A resource whose fields are a core settings dataclass's (``SETTINGS``, with ``from_settings``).

    The run's value is built once, when the run's resources are set up (a bad setting fails the run there,
    before any step), and every ``config()`` of the run returns it; outside a run (a sensor tick, a test) each
    call builds it.
    """

    SETTINGS: ClassVar[Any]
    _config: Any = pydantic.PrivateAttr(default=None)

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        self._config = self.build_config()

    def config(self) -> Any:
        """The run's settings as the core's value: the one built at setup, else built now (validated there)."""
        return self._config if self._config is not None else self.build_config()

    def build_config(self) -> Any:
        """The settings as the core's value (validated there)."""
        return self.SETTINGS.from_settings({f.name: getattr(self, f.name) for f in dataclasses.fields(self.SETTINGS)})


def settings_resource_model(name: str, base: type[SettingsResource], doc: str,
                            field: Callable[[dataclasses.Field], tuple[Any, Any]]) -> Any:
    """A pydantic resource class named ``name`` with one field per field of ``base.SETTINGS`` (same name, in order):
    ``field(f)`` gives its Dagster type and default."""
    return pydantic.create_model(  # type: ignore[call-overload]
        name, __base__=base, __module__=base.__module__, __doc__=doc,
        **{f.name: field(f) for f in dataclasses.fields(base.SETTINGS)})


class StepStoreIOManager(dg.ConfigurableIOManager):
    """Step values as JSON in the task's ``RoundStore`` (``<home>/loops/<task>/rounds/<round>/<asset>.json``, or
    ``<home>/loops/<task>/<asset>.json`` for an unpartitioned asset), by the record type ``RECORDS`` registers for
    each asset; the task and home are those of the settings resource ``settings()`` returns."""

    RECORDS: ClassVar[Mapping[str, type]]
    RECORDS_WHERE: ClassVar[str]

    def settings(self) -> SettingsResource:
        raise NotImplementedError

    def _where(self, context: dg.OutputContext | dg.InputContext) -> tuple[RoundStore, str, str | None]:
        step = context.asset_key.path[-1]
        if step not in self.RECORDS:
            raise dg.DagsterInvariantViolationError(f"asset {step!r} has no record type in {self.RECORDS_WHERE}")
        cfg = self.settings().config()
        return RoundStore(cfg.task, cfg.home), step, context.asset_partition_key if context.has_asset_partitions else None

    def handle_output(self, context: dg.OutputContext, obj: Any) -> None:
        store, step, key = self._where(context)
        if not isinstance(obj, self.RECORDS[step]):
            raise dg.DagsterTypeCheckDidNotPass(
                f"asset {step} returned {type(obj).__name__}, expected {self.RECORDS[step].__name__}")
        context.add_output_metadata({"stored_at": dg.MetadataValue.path(str(store.save(step, obj, key)))})

    def load_input(self, context: dg.InputContext) -> Any:
        store, step, key = self._where(context)
        value = store.load(step, self.RECORDS[step], key)
        if value is None:
            raise dg.DagsterInvariantViolationError(
                f"{store.step_path(step, key)} is missing: materialize {step}" + (f" for round {key}" if key else "")
                + " first")
        return value


__all__ = ["SettingsResource", "StepStoreIOManager", "settings_resource_model"]
