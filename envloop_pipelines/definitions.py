"""Composes ``defs/`` into the one Definitions object Dagster loads."""

import dagster as dg

from envloop_pipelines.defs.executor import EXECUTOR_ENV, select_executor
from envloop_pipelines.defs.rounds.assets import ROUND_ASSETS, noise_floor, round_job, setup_job, task_benchmark
from envloop_pipelines.defs.rounds.checks import ROUND_CHECKS
from envloop_pipelines.defs.rounds.schedules import nightly_loop
from envloop_pipelines.defs.rounds.sensors import failed_round_sensor, next_round_sensor
from envloop_pipelines.resources.loop import LoopResource, MlflowResource

defs = dg.Definitions(
    assets=[task_benchmark, noise_floor, *ROUND_ASSETS],
    asset_checks=ROUND_CHECKS,
    jobs=[round_job, setup_job],
    schedules=[nightly_loop],
    sensors=[next_round_sensor, failed_round_sensor],
    # ENVLOOP_EXECUTOR=k8s: one Kubernetes Job per step (k8s/dagster/values.yaml); unset: Dagster's default.
    executor=select_executor(dg.EnvVar(EXECUTOR_ENV).get_value()),
    resources={
        "loop": LoopResource(
            task=dg.EnvVar("ENVLOOP_TASK").get_value("personal_agent"),
            recipe=dg.EnvVar("ENVLOOP_RECIPE").get_value("packaged:decision_head_cpu.yaml"),
            recipe_overrides_json=dg.EnvVar("ENVLOOP_RECIPE_OVERRIDES").get_value("{}"),
        ),
        "mlflow": MlflowResource(),
    },
)
