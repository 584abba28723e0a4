"""The RL round as Dagster assets: settings from the run config (``resources.rl.config``, the fields of
``RlRoundConfig``), frozen records through the RL IO manager into the RL task's store.

The first steps on a stored shell dataset (two training environments, one held out) with the scripted
solver as the sampler, so no model is loaded: the hypothesis is registered, the attempts sampled and the
SFT snapshot built, each step reading the one before it from the store. Then the whole round, all seven
assets, on the RL round tests' tiny chat LM (about 15 s on two CPU cores): the decision comes back through
the IO manager and is the one the ledger's ``round_decided`` event carries.
"""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import pytest

from envloop_pipelines.testing.environments import shell_env
from envloop_pipelines_tests.core import test_rl_round

#: The RL round tests' tiny chat LM and its recipe file (a module fixture of test_rl_round.py).
round_setup = test_rl_round.round_setup


def _materialize(selection: list, home: Path, settings: dict, *, raise_on_error: bool = False) -> dg.ExecuteInProcessResult:
    from envloop_pipelines.defs.rl.assets import RL_ASSETS
    from envloop_pipelines.resources.rl import rl_resources
    from envloop_pipelines.resources.loop import MlflowResource

    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("rl_rounds", ["r0001"])
    chosen = {id(a) for a in selection}
    assets = [*selection, *(a.to_source_asset() for a in RL_ASSETS if id(a) not in chosen)]
    return dg.materialize(assets, partition_key="r0001", instance=instance, raise_on_error=raise_on_error,
                          resources={**rl_resources(), "mlflow": MlflowResource(home=str(home))},
                          run_config={"resources": {"rl": {"config": settings}}})


def test_the_first_rl_steps_hand_their_records_through_the_store(tmp_path: Path) -> None:
    from envloop_pipelines.core.environments.dataset import store_dataset
    from envloop_pipelines.core.ledger.ledger import Ledger
    from envloop_pipelines.core.rl_loop.step_records import RlHypothesis, RlSampling, RlSnapshot
    from envloop_pipelines.core.ledger.store import RoundStore
    from envloop_pipelines.defs.rl.assets import rl_hypothesis, rl_sampled_attempts, rl_sft_snapshot
    from envloop_pipelines.testing.scripted_agents import scripted_server

    envs = [shell_env(0, split="train"), shell_env(1, split="train"), shell_env(10, split="heldout")]
    stored = store_dataset("shell-rl", envs, source={"generator": "test"}, home=tmp_path)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"base_model: {tmp_path / 'no-model'}\nseed: 7\n")
    with scripted_server() as server:
        settings = {"dataset": f"shell-rl@{stored.version}", "recipe": str(recipe), "home": str(tmp_path),
                    "sampler_url": server.url, "sampler_model": "solver-p1.0", "attempts": 1, "max_turns": 2,
                    "wall_s": 60.0}
        result = _materialize([rl_hypothesis, rl_sampled_attempts, rl_sft_snapshot], tmp_path, settings)
    assert result.success, [e.message for e in result.all_events if e.is_failure]

    store = RoundStore("rl-shell-rl", tmp_path)  # the task the run's settings give (rl-<dataset name>)
    hyp = store.load("rl_hypothesis", RlHypothesis, "r0001")
    sampling = store.load("rl_sampled_attempts", RlSampling, "r0001")
    snapshot = store.load("rl_sft_snapshot", RlSnapshot, "r0001")
    assert hyp.hash == Ledger("rl-shell-rl", tmp_path).require_hypothesis("r0001").hash
    assert hyp.hypothesis.seeds == (7, 1007, 1008) and hyp.parent["checkpoint_sha256"] is None
    assert hyp.sampler["model"] == "solver-p1.0" and hyp.hypothesis.power["mde"] > 0
    assert (sampling.n_attempts, sampling.n_passed) == (2, 2) and Path(sampling.attempts_path).exists()
    assert (snapshot.n_attempts, snapshot.n_rows) == (2, 2) and snapshot.contamination["clean"]


@pytest.mark.parametrize("settings, message", [
    ({}, "give the dataset"),
    ({"dataset": "shell@x", "noise_arms": 1}, "noise_arms must be ≥ 2"),
    ({"dataset": "shell@x", "nonsense": 1}, "nonsense"),
])
def test_bad_rl_settings_are_refused_by_name(tmp_path: Path, settings: dict, message: str) -> None:
    """Refused when the run's resources are set up (the settings are built once per run), before any step."""
    import re

    from envloop_pipelines.defs.rl.assets import rl_hypothesis

    with pytest.raises(Exception) as caught:
        _materialize([rl_hypothesis], tmp_path, {"home": str(tmp_path), **settings}, raise_on_error=True)
    chain, exc = [], caught.value
    while exc is not None:
        chain.append(str(exc))
        exc = exc.__cause__ or exc.__context__
    assert any(re.search(message, m) for m in chain), chain
    assert not (tmp_path / "loops").exists()  # no step ran


def test_the_whole_rl_round_materializes_and_its_decision_comes_back_through_the_io_manager(
        round_setup: dict, tmp_path: Path) -> None:
    from envloop_pipelines.core.environments.dataset import store_dataset
    from envloop_pipelines.core.ledger.ledger import Ledger
    from envloop_pipelines.core.ledger.store import RoundStore
    from envloop_pipelines.core.rl_loop.step_records import RL_STEP_RECORDS, RlRoundResult
    from envloop_pipelines.core.tracking import KIND_NULL_ARM, KIND_ROUND, TAG_KIND, MlflowTracker
    from envloop_pipelines.defs.rl.assets import RL_ASSETS
    from envloop_pipelines.testing.scripted_agents import scripted_server

    stored = store_dataset("shell-rl", list(round_setup["dataset"].environments), source={"generator": "test"},
                           home=tmp_path)
    config = round_setup["config"]
    with scripted_server() as server:
        settings = {"dataset": f"shell-rl@{stored.version}", "recipe": config.recipe, "home": str(tmp_path),
                    "sampler_url": server.url, "sampler_model": "solver-p0.75", "attempts": 2, "eval_attempts": 2,
                    "noise_arms": 2, "max_turns": 2, "attempt_tokens": 64, "wall_s": 60.0, "completion_tokens": 12,
                    "workers": 2}
        result = _materialize(list(RL_ASSETS), tmp_path, settings)
    assert result.success, [e.message for e in result.all_events if e.is_failure]
    assert {e.asset_key.path[-1] for e in result.get_asset_materialization_events()} == set(RL_STEP_RECORDS)

    # The decision as the IO manager hands it downstream, the file it stored, and the ledger's record: one decision.
    decision = result.asset_value("rl_decision")
    assert isinstance(decision, RlRoundResult) and decision.round == "r0001"
    store = RoundStore("rl-shell-rl", tmp_path)
    assert store.load("rl_decision", RlRoundResult, "r0001") == decision
    ledger = Ledger("rl-shell-rl", tmp_path)
    assert RlRoundResult.from_dict(ledger.round_decision("r0001")) == decision
    # A random 32-wide LM solves no held-out shell task, trained or not: an honest rejection with its numbers.
    assert not decision.promoted and decision.release is None
    test_rl_round.snapshot_loss_fell(decision.candidate["path"], decision.snapshot["path"])  # training happened
    assert decision.comparison["candidate"]["pass_at_1"] == 0.0 and len(decision.noise_floor["values"]) == 2
    assert [e["kind"] for e in ledger.events()] == ["hypothesis_registered", "lora_checkpoint_trained", "null_arm",
                                                     "null_arm", "candidate_rejected", "hypothesis_refuted",
                                                     "round_decided"]
    # Every step's record went through the IO manager into the store.
    assert all(store.load(step, record, "r0001") is not None for step, record in RL_STEP_RECORDS.items())
    tracker = MlflowTracker(home=tmp_path)
    runs = tracker.client.search_runs([tracker.client.get_experiment_by_name("rl-shell-rl").experiment_id],
                                      max_results=50)
    kinds = sorted(r.data.tags[TAG_KIND] for r in runs)
    assert kinds.count(KIND_NULL_ARM) == 2 and kinds.count(KIND_ROUND) == 1
    assert next(r for r in runs if r.data.tags[TAG_KIND] == KIND_ROUND).info.status == "FINISHED"
