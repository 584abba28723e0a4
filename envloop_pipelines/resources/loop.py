"""Dagster resources wrapping the loop's core: its configuration and MLflow."""

from __future__ import annotations

import json
from typing import Any

import dagster as dg

from envloop_pipelines.core.loop.round import LoopConfig
from envloop_pipelines.core.tracking import MlflowTracker


class LoopResource(dg.ConfigurableResource):
    """The loop a code location runs: task, recipe and the knobs a person picks.

    Values can come from the environment in deployment (``dg.EnvVar``).
    """

    task: str = "personal_agent"
    recipe: str = "packaged:decision_head_cpu.yaml"
    recipe_overrides_json: str = "{}"
    noise_arms: int = 3
    top_clusters: int = 4
    n_synthesized: int = 120
    generator: str = "builtin_targeted"
    contamination_policy: str = "remove"
    builtin_users: int | None = None
    builtin_records_per_user: int | None = None
    home: str | None = None

    def config(self) -> LoopConfig:
        try:
            overrides: dict[str, Any] = json.loads(self.recipe_overrides_json or "{}")
        except json.JSONDecodeError as exc:
            raise ValueError(f"recipe_overrides_json is not JSON: {exc}") from None
        return LoopConfig(
            task=self.task, recipe=self.recipe, recipe_overrides=overrides, noise_arms=self.noise_arms,
            top_clusters=self.top_clusters, n_synthesized=self.n_synthesized, generator=self.generator,
            contamination_policy=self.contamination_policy, builtin_users=self.builtin_users,
            builtin_records_per_user=self.builtin_records_per_user, home=self.home,
        )


class MlflowResource(dg.ConfigurableResource):
    """MLflow, the system of record. Empty ``tracking_uri``: ``$MLFLOW_TRACKING_URI`` or SQLite under the home."""

    tracking_uri: str | None = None
    home: str | None = None

    def tracker(self) -> MlflowTracker:
        return MlflowTracker(self.tracking_uri, home=self.home)
