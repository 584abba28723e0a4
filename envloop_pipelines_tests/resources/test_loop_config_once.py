"""Issue 36: a run's ``LoopConfig`` is built once, when its resources are set up, and handed to every step."""

from typing import Any

import dagster as dg

from envloop_pipelines.core.loop import config as loop_config
from envloop_pipelines.resources.loop import loop_resource
from envloop_pipelines.resources.round_store import RoundStoreIOManager


def test_a_run_builds_its_loop_config_once_and_every_call_returns_it(monkeypatch: Any) -> None:
    built: list[int] = []
    post_init = loop_config.LoopConfig.__post_init__
    monkeypatch.setattr(loop_config.LoopConfig, "__post_init__", lambda self: built.append(1) or post_init(self))
    seen: list[int] = []

    @dg.asset(required_resource_keys={"loop"})
    def step(context: dg.AssetExecutionContext) -> None:  # a real annotation: no `from __future__ import annotations`
        seen.extend(id(context.resources.loop.config()) for _ in range(5))
        assert context.resources.loop.config().noise_arms == 4

    loop = loop_resource({"noise_arms": 4})  # checks the settings (one LoopConfig), before any run
    built.clear()
    assert dg.materialize([step], resources={"loop": loop, "io_manager": RoundStoreIOManager(loop=loop)}).success
    assert len(set(seen)) == 1, "each call built a new LoopConfig"
    # Once for the run's loop resource and once for the IO manager's (Dagster sets up a nested resource on its
    # own): never once per call.
    assert len(built) <= 2
