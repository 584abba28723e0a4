"""The RL round's resources: its settings, generated from ``RlRoundConfig``, and the store of its step values.

``RlResource``'s fields are the fields of :class:`~envloop_pipelines.core.rl_loop.round_config.RlRoundConfig`
(same names, types, defaults and help), so the launch config cannot drift from the core. A run sets
them under ``resources.rl.config`` (README, "RL from verified attempts"). ``RlStoreIOManager`` stores
each step's frozen record (``core/rl_loop/step_records.py``) in the RL task's ``RoundStore``, as the decision
round's IO manager does for its own.
"""

from typing import Any

import dagster as dg
import pydantic

from envloop_pipelines.core.rl_loop.round_config import RlRoundConfig, rl_field_type, rl_fields
from envloop_pipelines.core.rl_loop.step_records import RL_STEP_RECORDS
from envloop_pipelines.core.ledger.store import RoundStore


class _RlSettings(dg.ConfigurableResource):
    def config(self) -> RlRoundConfig:
        """The round's settings as the core's value (validated there)."""
        return RlRoundConfig.from_settings({f.name: getattr(self, f.name) for f in rl_fields()})


RlResource = pydantic.create_model(  # type: ignore[call-overload]
    "RlResource",
    __base__=_RlSettings,
    __module__=__name__,
    __doc__="The settings of an RL round: every field of ``RlRoundConfig`` (set per run under ``resources.rl.config``).",
    **{f.name: (rl_field_type(f), pydantic.Field(default=f.default, description=f.metadata.get("help")))
       for f in rl_fields()},
)


class RlStoreIOManager(dg.ConfigurableIOManager):
    """RL step values as JSON at ``<home>/loops/<task>/rounds/<round>/<asset>.json``, by the record of each asset."""

    rl: RlResource  # type: ignore[valid-type]

    def _where(self, context: "dg.OutputContext | dg.InputContext") -> tuple[RoundStore, str, str]:
        step = context.asset_key.path[-1]
        if step not in RL_STEP_RECORDS:
            raise dg.DagsterInvariantViolationError(f"asset {step!r} has no record type in core/rl_loop/step_records.RL_STEP_RECORDS")
        cfg = self.rl.config()
        return RoundStore(cfg.task, cfg.home), step, context.asset_partition_key

    def handle_output(self, context: dg.OutputContext, obj: Any) -> None:
        store, step, key = self._where(context)
        if not isinstance(obj, RL_STEP_RECORDS[step]):
            raise dg.DagsterTypeCheckDidNotPass(
                f"asset {step} returned {type(obj).__name__}, expected {RL_STEP_RECORDS[step].__name__}")
        context.add_output_metadata({"stored_at": dg.MetadataValue.path(str(store.save(step, obj, key)))})

    def load_input(self, context: dg.InputContext) -> Any:
        store, step, key = self._where(context)
        value = store.load(step, RL_STEP_RECORDS[step], key)
        if value is None:
            raise dg.DagsterInvariantViolationError(
                f"{store.step_path(step, key)} is missing: materialize {step} for round {key} first")
        return value


def rl_resources() -> dict[str, Any]:
    """The resources the RL assets need beside ``mlflow``: ``rl``, configured at launch (a run's
    ``resources.rl.config``), and its IO manager, which reads the same run's settings."""
    rl = RlResource.configure_at_launch()
    return {"rl": rl, "rl_io_manager": RlStoreIOManager(rl=rl)}


__all__ = ["RlResource", "RlStoreIOManager", "rl_resources"]
