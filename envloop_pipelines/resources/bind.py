"""The one place the code location's resources are bound: ``definitions.py`` and the ``LocalClient`` both call
:func:`loop_resources`, so a run the UI launches and a run executed in a client's process use the same resources.

The two differ only in the ``loop`` resource handed in: the code location's
(:func:`~envloop_pipelines.resources.loop.deployment_loop_resource`, its settings from ``ENVLOOP_<FIELD>``) or a
client's (:func:`~envloop_pipelines.resources.loop.loop_resource`, its settings given in code).
"""

from __future__ import annotations

from typing import Any

from envloop_pipelines.resources.loop import LoopResource, MlflowResource
from envloop_pipelines.resources.rl import rl_resources
from envloop_pipelines.resources.round_store import RoundStoreIOManager
from envloop_pipelines.resources.sandbox import SandboxResource


def loop_resources(loop: LoopResource) -> dict[str, Any]:  # type: ignore[valid-type]
    """Every resource the decision loop's and the RL loop's jobs use, around the loop's settings.

    ``loop`` is the decision loop's settings resource; its IO manager stores the round's values in that loop's
    home. MLflow is ``$MLFLOW_TRACKING_URI`` (else SQLite under the home), the sandbox is the deployment's
    (``ENVLOOP_SANDBOX*`` read when a run uses it), and the RL round's settings are given at launch
    (``resources.rl.config``).
    """
    return {"loop": loop, "mlflow": MlflowResource(), "io_manager": RoundStoreIOManager(loop=loop),
            "sandbox": SandboxResource(), **rl_resources()}


__all__ = ["loop_resources"]
