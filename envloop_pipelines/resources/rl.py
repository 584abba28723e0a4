"""The RL round's resources: its settings, generated from ``RlRoundConfig``, and the store of its step values.

``RlResource``'s fields are the fields of :class:`~envloop_pipelines.core.rl_loop.round_config.RlRoundConfig`
(same names, types, defaults and help), so the launch config cannot drift from the core. A run sets
them under ``resources.rl.config`` (README, "RL from verified attempts"). ``RlStoreIOManager`` stores
each step's frozen record (``core/rl_loop/step_records.py``) in the RL task's ``RoundStore``, as the decision
round's IO manager does for its own (one ``StepStoreIOManager``, ``resources/settings.py``).
"""

import dataclasses
import typing
from typing import Any, ClassVar

import pydantic

from envloop_pipelines.core.rl_loop.round_config import RlRoundConfig
from envloop_pipelines.core.rl_loop.step_records import RL_STEP_RECORDS
from envloop_pipelines.resources.settings import SettingsResource, StepStoreIOManager, settings_resource_model


class _RlSettings(SettingsResource):
    """The RL round's settings, built into an ``RlRoundConfig`` once per run (``SettingsResource``)."""

    SETTINGS: ClassVar[Any] = RlRoundConfig


def _rl_field(f: dataclasses.Field) -> tuple[Any, Any]:
    """The field's type (``X | None`` kept), its default and help."""
    return typing.get_type_hints(RlRoundConfig)[f.name], pydantic.Field(default=f.default,
                                                                         description=f.metadata.get("help"))


RlResource = settings_resource_model(
    "RlResource", _RlSettings,
    "The settings of an RL round: every field of ``RlRoundConfig`` (set per run under ``resources.rl.config``).",
    _rl_field)


class RlStoreIOManager(StepStoreIOManager):
    """RL step values as JSON at ``<home>/loops/<task>/rounds/<round>/<asset>.json``, by the record of each asset."""

    RECORDS: ClassVar[Any] = RL_STEP_RECORDS
    RECORDS_WHERE: ClassVar[str] = "core/rl_loop/step_records.RL_STEP_RECORDS"

    rl: RlResource  # type: ignore[valid-type]

    def settings(self) -> Any:
        return self.rl


def rl_resources() -> dict[str, Any]:
    """The resources the RL assets need beside ``mlflow``: ``rl``, configured at launch (a run's
    ``resources.rl.config``), and its IO manager, which reads the same run's settings."""
    rl = RlResource.configure_at_launch()
    return {"rl": rl, "rl_io_manager": RlStoreIOManager(rl=rl)}


__all__ = ["RlResource", "RlStoreIOManager", "rl_resources"]
