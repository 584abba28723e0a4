"""Composes ``defs/`` into the one Definitions object Dagster loads.

``defs`` is a ``@dg.definitions`` function: Dagster calls it when it loads the code location, so importing
this module reads no environment variable; loading reads ``ENVLOOP_<FIELD>`` and ``ENVLOOP_EXECUTOR``.
"""

import os

from envloop_pipelines.console import quiet_third_party

quiet_third_party()  # the code location and its run and step processes: third-party notes off the console

import dagster as dg  # noqa: E402

from envloop_pipelines.defs.agents.assets import AGENT_ASSETS  # noqa: E402
from envloop_pipelines.defs.executor import EXECUTOR_ENV, select_executor  # noqa: E402
from envloop_pipelines.defs.rl.assets import RL_ASSETS, rl_round_job  # noqa: E402
from envloop_pipelines.defs.rounds.assets import (  # noqa: E402
    ROUND_ASSETS,
    noise_floor,
    round_job,
    setup_job,
    task_benchmark,
)
from envloop_pipelines.defs.rounds.checks import ROUND_CHECKS  # noqa: E402
from envloop_pipelines.defs.rounds.schedules import nightly_loop  # noqa: E402
from envloop_pipelines.defs.rounds.sensors import (  # noqa: E402
    canceled_round_sensor,
    failed_round_sensor,
    next_round_sensor,
)
from envloop_pipelines.resources.bind import loop_resources  # noqa: E402
from envloop_pipelines.resources.loop import deployment_loop_resource  # noqa: E402


@dg.definitions
def defs() -> dg.Definitions:
    """The code location. ``ENVLOOP_<FIELD>`` set when it loads are the loop's configured values (the UI and a remote
    ``Client.loop_settings()`` show them); a bad one stops the load, naming the variable. ``ENVLOOP_SANDBOX*`` are
    read by the run that uses the sandbox."""
    loop = deployment_loop_resource(os.environ)  # first: a bad ENVLOOP_<FIELD> stops the load, naming it
    return dg.Definitions(
        assets=[task_benchmark, noise_floor, *ROUND_ASSETS, *RL_ASSETS, *AGENT_ASSETS],
        asset_checks=ROUND_CHECKS,
        jobs=[round_job, setup_job, rl_round_job],
        schedules=[nightly_loop],
        sensors=[next_round_sensor, failed_round_sensor, canceled_round_sensor],
        # ENVLOOP_EXECUTOR=k8s: one Kubernetes Job per step (k8s/dagster/values.yaml); unset: Dagster's default.
        executor=select_executor(dg.EnvVar(EXECUTOR_ENV).get_value()),
        resources=loop_resources(loop),
    )
