"""Issue 34, "one recipe from registration to card": a round split across runs under other ``recipe_overrides``.

The audit materialized ``registered_hypothesis`` under the floor's recipe, then ``lora_checkpoint`` …
``promotion_decision`` in a second run with ``recipe_overrides {"max_steps": 3, "lr": 0.01}``: the candidate
trained under another recipe than the registered hypothesis and the floor, and nothing refused. Here, through
real Dagster on a small imported task: the training step refuses before any compute, and the decision step
(run alone under the other overrides after a candidate trained under the registration's recipe) refuses
before anything is written, each naming both recipe hashes.
"""

from __future__ import annotations

import json
from typing import Any

import dagster as dg
import pytest

from envloop_pipelines.core.ledger.event_log import EVENT_CHECKPOINT_TRAINED, EVENT_ROUND_DECIDED
from envloop_pipelines.core.ledger.ledger import Ledger
from envloop_pipelines.core.ledger.store import RoundStore
from envloop_pipelines.defs.rounds.assets import (
    ROUND_ASSETS,
    independent_reeval,
    lora_checkpoint,
    noise_floor,
    promotion_decision,
    registered_hypothesis,
    task_benchmark,
    training_dataset_snapshot,
    with_upstream_sources,
)
from envloop_pipelines.resources.loop import LoopResource, MlflowResource
from envloop_pipelines.resources.round_store import RoundStoreIOManager
from envloop_pipelines.resources.sandbox import SandboxResource

from .test_round import GENERATOR, LOOP, TASK, learnable_tickets

pytestmark = pytest.mark.slow

#: The audit's second run: the loop's override changed between registration and training.
OTHER = {**LOOP["recipe_overrides"], "max_steps": 3, "lr": 0.01}


def _resources(home: Any, overrides: dict[str, Any]) -> dict[str, Any]:
    loop = LoopResource(home=str(home), generator=GENERATOR, **{**LOOP, "recipe_overrides": overrides})
    return {"loop": loop, "mlflow": MlflowResource(home=str(home)), "io_manager": RoundStoreIOManager(loop=loop),
            "sandbox": SandboxResource()}


def _error(result: dg.ExecuteInProcessResult) -> str:
    return "\n".join(str(e.event_specific_data.error) for e in result.all_events if e.is_step_failure)


def test_a_round_split_across_recipes_is_refused_at_training_and_at_the_decision(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from envloop_pipelines.core.data.datasets import import_file

    home = tmp_path / "home"
    monkeypatch.setenv("ENVLOOP_HOME", str(home))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    data = tmp_path / "tickets.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in learnable_tickets(160)), encoding="utf-8")
    import_file(data, TASK, home=home)
    floor_resources = _resources(home, LOOP["recipe_overrides"])
    other_resources = _resources(home, OTHER)
    registered_hash = floor_resources["loop"].config().recipe_hash()
    other_hash = other_resources["loop"].config().recipe_hash()
    assert registered_hash != other_hash
    instance = dg.DagsterInstance.ephemeral()
    assert dg.materialize([task_benchmark, noise_floor], resources=floor_resources, instance=instance).success
    key = "r0001"
    instance.add_dynamic_partitions("rounds", [key])
    before = [a for a in ROUND_ASSETS if a not in (lora_checkpoint, independent_reeval, promotion_decision)]
    assert registered_hypothesis in before and training_dataset_snapshot in before
    assert dg.materialize(with_upstream_sources(before), partition_key=key, resources=floor_resources,
                          instance=instance).success
    ledger = Ledger(TASK, home)
    store = RoundStore(TASK, home)
    # The seed is drawn at registration, not the recipe's seed + 1000 + the round (known, so previewable on test).
    assert ledger.hypothesis(key).seeds != (floor_resources["loop"].config().load_recipe().seed + 1001,)

    # Run 2: training and the decision under the other overrides: refused at training, before any compute.
    split = dg.materialize(with_upstream_sources([lora_checkpoint, independent_reeval, promotion_decision]),
                           partition_key=key, resources=other_resources, instance=instance, raise_on_error=False)
    assert not split.success
    message = _error(split)
    assert "training refuses to start: recipe_hash" in message
    assert other_hash[:16] in message and registered_hash[:16] in message
    assert not store.step_path("lora_checkpoint", key).exists()
    assert [e for e in ledger.events(EVENT_CHECKPOINT_TRAINED) if e.get("round") == key] == []

    # The candidate trained and re-evaluated under the registration's recipe, then the decision alone under the
    # other overrides: refused, naming both hashes, and nothing of the decision written.
    assert dg.materialize(with_upstream_sources([lora_checkpoint, independent_reeval]), partition_key=key,
                          resources=floor_resources, instance=instance).success
    events_before = ledger.events_path.read_bytes()
    decided = dg.materialize(with_upstream_sources([promotion_decision]), partition_key=key,
                             resources=other_resources, instance=instance, raise_on_error=False)
    assert not decided.success
    message = _error(decided)
    assert f"round {key}: no decision: recipe_hash" in message
    assert other_hash[:16] in message and registered_hash[:16] in message
    assert ledger.events_path.read_bytes() == events_before
    assert not store.step_path("promotion_decision", key).exists()
    assert [e for e in ledger.events(EVENT_ROUND_DECIDED) if e.get("round") == key] == []
    assert ledger.releases()[-1]["release"] == 1  # only the bootstrap release
