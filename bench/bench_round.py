"""One round on the default benchmark: wall time per asset, and Dagster's orchestration overhead.

    .venv/bin/python bench/bench_round.py [--recipe-override max_steps=40 ...]

Sets up the benchmark and the noise floor once, copies the EnvLoop home, then
runs the same round (r0001) twice from identical state: once as the Dagster
round job (ephemeral instance, in-process executor) and once by calling the
same core functions directly in this process. Prints the per-asset wall time
of both and the ratio of the totals (target: overhead ≤ 15%).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import dagster as dg  # noqa: E402

from envloop_pipelines.cli.options import add_recipe_override_argument, parse_recipe_overrides  # noqa: E402
from envloop_pipelines.cli.demo import DEMO_OVERRIDES  # noqa: E402
from envloop_pipelines.core.data.snapshots import open_task  # noqa: E402
from envloop_pipelines.core.decision_loop.baseline_eval import evaluate_champion  # noqa: E402
from envloop_pipelines.core.decision_loop.champion_noise_floor import measure_champion_noise_floor  # noqa: E402
from envloop_pipelines.core.decision_loop.environment_synthesis import synthesize_environments  # noqa: E402
from envloop_pipelines.core.decision_loop.failure_mining import mine_failures  # noqa: E402
from envloop_pipelines.core.decision_loop.independent_reeval import reevaluate  # noqa: E402
from envloop_pipelines.core.decision_loop.lora_checkpoint import train_candidate  # noqa: E402
from envloop_pipelines.core.decision_loop.noise_floor import current_noise_floor  # noqa: E402
from envloop_pipelines.core.decision_loop.promotion_decision import decide_round  # noqa: E402
from envloop_pipelines.core.decision_loop.registered_hypothesis import register_hypothesis  # noqa: E402
from envloop_pipelines.core.decision_loop.training_dataset_snapshot import build_training_snapshot  # noqa: E402
from envloop_pipelines.core.decision_loop.step_records import RoundDecision  # noqa: E402
from envloop_pipelines.core.ledger.store import RoundStore  # noqa: E402
from envloop_pipelines.core.model.predict import rescore_matches  # noqa: E402
from envloop_pipelines.core.tracking import MlflowTracker  # noqa: E402
from envloop_pipelines.defs.rounds.assets import ROUND_ASSETS, noise_floor, task_benchmark, with_upstream_sources  # noqa: E402
from envloop_pipelines.resources.bind import loop_resources  # noqa: E402
from envloop_pipelines.resources.loop import MlflowResource, loop_resource  # noqa: E402
from envloop_pipelines.core.progress import configure_command_line  # noqa: E402
from envloop_pipelines.sdk.instance import QUIET  # noqa: E402

STEPS = ("baseline_eval", "champion_noise_floor", "failure_mining", "environment_synthesis", "registered_hypothesis",
         "training_dataset_snapshot", "lora_checkpoint", "independent_reeval", "promotion_decision")


def resources_for(home: Path, overrides: dict) -> dict:
    loop = loop_resource({"home": str(home), "noise_arms": 2, "recipe_overrides": overrides})
    return {**loop_resources(loop), "mlflow": MlflowResource(home=str(home))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_recipe_override_argument(parser, default=list(DEMO_OVERRIDES))
    args = parser.parse_args()
    configure_command_line()  # progress: a bar on a terminal, lines elsewhere (ENVLOOP_PROGRESS)
    overrides = parse_recipe_overrides(tuple(args.override))
    root = Path(tempfile.mkdtemp(prefix="bench-round-"))
    base = root / "base"
    os.environ["ENVLOOP_HOME"] = str(base)
    t0 = time.perf_counter()
    assert dg.materialize([task_benchmark, noise_floor], resources=resources_for(base, overrides),
                          instance=dg.DagsterInstance.ephemeral(), run_config=QUIET).success
    setup_s = time.perf_counter() - t0
    homes = {name: root / name for name in ("dagster", "direct")}
    for home in homes.values():
        shutil.copytree(base, home)

    # Direct: the same core functions, in this process, in the assets' order (checks included),
    # each step's record handed to the next as the IO manager hands it to the next asset.
    home = homes["direct"]
    os.environ["ENVLOOP_HOME"] = str(home)
    cfg = resources_for(home, overrides)["loop"].config()
    tracker = MlflowTracker(home=home)
    task = open_task(cfg.task, home=home)  # the snapshot every step is handed, as each asset opens it once
    direct: dict[str, float] = {}
    values: dict[str, Any] = {}
    calls = {
        "baseline_eval": lambda: evaluate_champion(cfg, task, "r0001"),
        "champion_noise_floor": lambda: measure_champion_noise_floor(cfg, task, current_noise_floor(cfg, task),
                                                                     tracker),
        "failure_mining": lambda: mine_failures(cfg, task, values["baseline_eval"]),
        "environment_synthesis": lambda: synthesize_environments(cfg, task, values["failure_mining"]),
        "registered_hypothesis": lambda: register_hypothesis(cfg, task, values["environment_synthesis"], tracker,
                                                             noise_floor=values["champion_noise_floor"]),
        "training_dataset_snapshot": lambda: build_training_snapshot(cfg, task, values["environment_synthesis"]),
        "lora_checkpoint": lambda: train_candidate(
            cfg, task, values["registered_hypothesis"], values["training_dataset_snapshot"], tracker),
        "checkpoint_reproduces": lambda: rescore_matches(values["lora_checkpoint"].checkpoint, task.table("val")),
        "independent_reeval": lambda: reevaluate(
            cfg, task, values["lora_checkpoint"], values["training_dataset_snapshot"], tracker),
        "promotion_decision": lambda: decide_round(
            cfg, task, values["registered_hypothesis"], values["training_dataset_snapshot"],
            values["lora_checkpoint"], values["independent_reeval"], values["champion_noise_floor"], tracker),
    }
    t0 = time.perf_counter()
    for name, call in calls.items():
        s = time.perf_counter()
        values[name] = call()
        direct[name] = time.perf_counter() - s
    direct_total = time.perf_counter() - t0

    # Dagster: the round job's assets and checks for partition r0001. The checks are imported here, after
    # __main__ installed the console filters: their partitions_def (preview) warns when the module is imported.
    from envloop_pipelines.defs.rounds.checks import ROUND_CHECKS

    home = homes["dagster"]
    os.environ["ENVLOOP_HOME"] = str(home)
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("rounds", ["r0001"])
    t0 = time.perf_counter()
    result = dg.materialize(with_upstream_sources(ROUND_ASSETS + ROUND_CHECKS), partition_key="r0001",
                            resources=resources_for(home, overrides), instance=instance, run_config=QUIET)
    dagster_total = time.perf_counter() - t0
    assert result.success
    per_step: dict[str, float] = {}
    starts: dict[str, float] = {}
    for record in instance.all_logs(result.run_id):
        event = record.dagster_event
        if event is None or record.step_key is None:
            continue
        if event.event_type_value == "STEP_START":
            starts[record.step_key] = record.timestamp
        elif event.event_type_value == "STEP_SUCCESS":
            per_step[record.step_key] = record.timestamp - starts[record.step_key]

    decision_direct: RoundDecision = values["promotion_decision"]
    # The Dagster run's decision, as its IO manager stored it under the Dagster copy of the home.
    decision_dagster = RoundStore(cfg.task, homes["dagster"]).load("promotion_decision", RoundDecision, "r0001")
    assert decision_dagster is not None, "the Dagster run stored no promotion_decision for r0001"
    print(f"setup (benchmark + noise floor, 2 arms): {setup_s:.0f}s; recipe overrides {overrides}")
    print(f"{'asset':<28}{'dagster s':>11}{'direct s':>10}")
    for name in list(STEPS[:6]) + ["checkpoint_reproduces"] + list(STEPS[6:]):
        step = next((k for k in per_step if k == name or k.endswith(name)), None)
        print(f"{name:<28}{per_step.get(step, float('nan')) if step else float('nan'):>11.1f}{direct.get(name, float('nan')):>10.1f}")
    other = [k for k in per_step if not any(k == n or k.endswith(n) for n in (*STEPS, "checkpoint_reproduces"))]
    for name in other:
        print(f"{name:<28}{per_step[name]:>11.1f}{'':>10}")
    print(f"{'total':<28}{dagster_total:>11.1f}{direct_total:>10.1f}")
    print(f"orchestration overhead: dagster / direct = {dagster_total / direct_total:.3f} "
          f"({(dagster_total / direct_total - 1) * 100:+.1f}%, target <= +15%)")
    print(f"direct round decided: promote={decision_direct.promote} delta={decision_direct.delta['delta']:+.4f}")
    print(f"dagster round decided: promote={decision_dagster.promote} delta={decision_dagster.delta['delta']:+.4f}")


if __name__ == "__main__":
    from envloop_pipelines.console import quiet_third_party

    quiet_third_party()  # the bench prints what it measures, not a library's notes on itself
    main()
