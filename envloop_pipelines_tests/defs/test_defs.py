"""The asset graph, pinned: a change to keys, deps, partitions, checks, jobs, schedules or sensors shows up here."""

from __future__ import annotations

import dagster as dg

from envloop_pipelines.definitions import defs as load_code_location
defs = load_code_location()

EXPECTED_DEPS = {
    "task_benchmark": set(),
    "noise_floor": {"task_benchmark"},
    # Every step of a round reads task_benchmark's record: the benchmark version it opens the task at (issue 25).
    "baseline_eval": {"task_benchmark", "noise_floor"},
    # The floor that gates the round (issue 45): the control floor, or the champion's lineage floor.
    "champion_noise_floor": {"task_benchmark", "noise_floor", "baseline_eval"},
    "failure_mining": {"task_benchmark", "baseline_eval"},
    "environment_synthesis": {"task_benchmark", "failure_mining"},
    "registered_hypothesis": {"task_benchmark", "environment_synthesis", "champion_noise_floor"},
    "training_dataset_snapshot": {"task_benchmark", "environment_synthesis"},
    "lora_checkpoint": {"task_benchmark", "training_dataset_snapshot", "registered_hypothesis"},
    # Typed values flow through the IO manager: an asset depends on every step whose value it reads.
    "independent_reeval": {"task_benchmark", "lora_checkpoint", "training_dataset_snapshot"},
    "promotion_decision": {"task_benchmark", "independent_reeval", "lora_checkpoint", "training_dataset_snapshot",
                           "registered_hypothesis", "champion_noise_floor"},
    # RL from verified attempts: one asset per step (core/rl_loop/round_steps.py), records through the RL IO manager.
    "rl_hypothesis": set(),
    "rl_sampled_attempts": {"rl_hypothesis"},
    "rl_sft_snapshot": {"rl_sampled_attempts"},
    "rl_policy_checkpoint": {"rl_hypothesis", "rl_sft_snapshot"},
    "rl_noise_floor": {"rl_sft_snapshot", "rl_policy_checkpoint"},
    "rl_heldout_reeval": {"rl_hypothesis", "rl_policy_checkpoint"},
    "rl_decision": {"rl_hypothesis", "rl_sampled_attempts", "rl_sft_snapshot", "rl_policy_checkpoint", "rl_noise_floor",
                    "rl_heldout_reeval"},
    # Agents in environments: one evaluation per (dataset version, agent) (core/agents/evaluate.py).
    "agent_evaluation": set(),
}
UNPARTITIONED = {"task_benchmark", "noise_floor"}
#: Partitions other than the decision loop's ``rounds``.
OWN_PARTITIONS = {k: "rl_rounds" for k in EXPECTED_DEPS if k.startswith("rl_")}
#: (asset, check, blocking, partitions): the round's checks are partitioned by round, like their assets (issue 25).
EXPECTED_CHECKS = {
    ("training_dataset_snapshot", "snapshot_schema_is_valid", True, "rounds"),
    ("training_dataset_snapshot", "snapshot_is_uncontaminated", True, "rounds"),
    ("lora_checkpoint", "checkpoint_reproduces", False, "rounds"),
    ("independent_reeval", "candidate_is_calibrated", False, "rounds"),
}


def test_asset_graph_snapshot() -> None:
    repo = defs.get_repository_def()
    graph = repo.asset_graph
    deps = {
        key.to_user_string(): {p.to_user_string() for p in graph.get(key).parent_keys}
        for key in graph.get_all_asset_keys()
    }
    assert deps == EXPECTED_DEPS
    for key in graph.get_all_asset_keys():
        partitions = graph.get(key).partitions_def
        if key.to_user_string() in UNPARTITIONED:
            assert partitions is None
        elif key.to_user_string() == "agent_evaluation":
            assert isinstance(partitions, dg.MultiPartitionsDefinition)
            assert {d.name: d.partitions_def.name for d in partitions.partitions_defs} == {
                "dataset_version": "env_dataset_versions", "agent": "agents"}
        else:
            expected = OWN_PARTITIONS.get(key.to_user_string(), "rounds")
            assert isinstance(partitions, dg.DynamicPartitionsDefinition) and partitions.name == expected
    specs = {k: graph.get_check_spec(k) for k in graph.asset_check_keys}
    checks = {(k.asset_key.to_user_string(), k.name, s.blocking, s.partitions_def and s.partitions_def.name)
              for k, s in specs.items()}
    assert checks == EXPECTED_CHECKS
    # The partitioned checks still run in the partitioned round job (blocking ones before training).
    round_checks = repo.get_job("round_job").asset_layer.asset_graph.asset_check_keys
    assert {k.name for k in round_checks} == {c for _, c, _, _ in EXPECTED_CHECKS}
    assert {j.name for j in repo.get_all_jobs() if not j.name.startswith("__")} == {"round_job", "setup_job", "rl_round_job"}
    assert {s.name: s.cron_schedule for s in repo.schedule_defs} == {"nightly_loop": "0 2 * * *"}
    assert {s.name for s in repo.sensor_defs} == {"next_round_sensor", "failed_round_sensor", "canceled_round_sensor"}
    training = graph.get(dg.AssetKey("lora_checkpoint"))
    assert "dagster-k8s/config" in repo.assets_defs_by_key[dg.AssetKey("lora_checkpoint")].op.tags
    assert training.group_name == "round"


def test_asset_descriptions_are_short_sentences() -> None:
    graph = defs.get_repository_def().asset_graph
    for key in graph.get_all_asset_keys():
        description = graph.get(key).description or ""
        assert description and len(description) < 200, key
