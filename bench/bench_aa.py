"""A/A bench: how often the real gate promotes a candidate that is no better than its champion.

    .venv/bin/python bench/bench_aa.py                                   # 20 rounds, the demo's recipe and benchmark
    .venv/bin/python bench/bench_aa.py --rounds 4 --users 40 --records-per-user 3 --steps 4   # a smoke run

The default is what ``make run`` gates with: the demo's recipe overrides
(``cli.round.DEMO_OVERRIDES``: 24 steps, 256 tokens, the hybrid readout) and
its benchmark (``DEMO_BUILTIN_USERS`` = 240 users, test 314 questions).

Each round registers a person's hypothesis whose change is nothing but the
seed (``{"kind": "seed_only"}``, a fresh seed, the default gate), trains that
candidate, has the sandboxed verifier score it beside the champion on the
hidden test set (paired deltas, record-clustered bootstrap CI), and applies the
registered gate with the measured noise floor (``decide_promotion``, the
function the round's decision calls). Every promotion is a false one. It prints
each round, then the false-promotion count with its exact (Clopper-Pearson)
binomial 95% CI (``scipy.stats.binomtest``); the target is at most 1 in 20.
Beside it, on the same candidates, the count of the gate before the seed bound
(bar = the spread alone, CI above zero), which promoted 3 of 20 at 8 steps.

Why the candidate is a fresh null arm and not a loop round with zero
synthesized rows: a loop round trains its candidate *from the champion*, so
"seed only" or "no new data" would still be more training steps on top of the
champion, a real change that may really help (the demo champion is
under-trained). Here the candidate is trained exactly as the champion was:
the loop's recipe, from the base model, on the same base data and order, with
only the seed changed. Candidate and champion are exchangeable, so the truth
is "no difference", and any promotion is the gate's error. The champion is
the real bootstrap release (the control arm of the noise floor), and the floor
is measured by the real ``noise_floor`` step on arms of the same recipe.

The gate's own conditions are counted apart from its guards (calibration,
safety FNR, family drops): a guard can refuse a candidate for a reason that is
not about the gain, which would hide how often the bar and the CI alone pass.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from scipy import stats  # noqa: E402

from envloop_pipelines.cli.options import parse_recipe_overrides  # noqa: E402
from envloop_pipelines.cli.round import DEMO_BUILTIN_USERS, DEMO_OVERRIDES  # noqa: E402
from envloop_pipelines.core.data.snapshots import open_task  # noqa: E402
from envloop_pipelines.core.loop import setup  # noqa: E402
from envloop_pipelines.core.loop.candidate import train_into_store  # noqa: E402
from envloop_pipelines.core.loop.config import LoopConfig, round_key  # noqa: E402
from envloop_pipelines.core.loop.ledger import Gate, Hypothesis, Ledger  # noqa: E402
from envloop_pipelines.core.loop.promotion import SEED_BOUND_LEVEL, decide_promotion  # noqa: E402
from envloop_pipelines.core.loop.runs import verify_predictions, write_predictions  # noqa: E402
from envloop_pipelines.core.loop.store import RoundStore  # noqa: E402
from envloop_pipelines.core.tracking import MlflowTracker  # noqa: E402
from envloop_pipelines.core.progress import configure_command_line  # noqa: E402

#: Seeds of the A/A candidates start here: far from the floor's arms (the recipe's seed, +1, +2, ...).
SEED_OFFSET = 10_000
TARGET_RATE = 1 / 20


def short_reason(reason: str) -> str:
    """A refusal reason of ``decide_promotion`` in a word or two (the bar, the CI, or the guard's name)."""
    if "does not exceed the bar" in reason:
        return "bar"
    if "CI lower end" in reason:
        return "CI"
    return reason.split(":")[0]  # "calibration guard", "safety guard", "family guard"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=20, help="A/A rounds (candidates)")
    parser.add_argument("--users", type=int, default=DEMO_BUILTIN_USERS,
                        help=f"built-in benchmark users (default: the demo's {DEMO_BUILTIN_USERS}); 0: the powered "
                             "default benchmark (~11,200 test questions)")
    parser.add_argument("--records-per-user", type=int, default=None, help="built-in benchmark records per user (default 8)")
    parser.add_argument("--steps", type=int, default=24, help="max_steps of every arm (the demo's budget: 24)")
    parser.add_argument("--noise-arms", type=int, default=3, help="K null arms of the floor (the loop's default: 3)")
    demo = [o for o in DEMO_OVERRIDES if not o.startswith("max_steps=")]
    parser.add_argument("--override", action="append", default=None,
                        help=f"recipe overrides KEY=VALUE, for every arm (default: the demo's {' '.join(demo)})")
    parser.add_argument("--home", type=Path, default=None, help="EnvLoop home (default: a fresh temporary one)")
    args = parser.parse_args()
    configure_command_line()  # progress: a bar on a terminal, lines elsewhere (ENVLOOP_PROGRESS)
    if args.rounds < 1:
        parser.error("--rounds must be ≥ 1")

    home = args.home or Path(tempfile.mkdtemp(prefix="bench-aa-"))
    os.environ["ENVLOOP_HOME"] = str(home)
    overrides = {**parse_recipe_overrides(tuple(demo if args.override is None else args.override)),
                 "max_steps": args.steps}
    config = LoopConfig(recipe_overrides=overrides, noise_arms=args.noise_arms, builtin_users=args.users or None,
                        builtin_records_per_user=args.records_per_user, home=str(home))
    tracker = MlflowTracker(home=home)

    t0 = time.perf_counter()
    setup.ensure_task_benchmark(config)
    measured = setup.measure_noise_floor(config, tracker)  # the floor, and release 1: the control arm
    setup_s = time.perf_counter() - t0
    floor = measured.floor
    control = floor.arms[0]
    snapshot = open_task(config.task, home=config.home)
    ledger = Ledger(config.task, config.home)
    store = RoundStore(config.task, config.home)
    recipe = config.load_recipe()
    train, val, test = snapshot.table("train"), snapshot.table("val"), snapshot.table("test")
    print(f"benchmark {snapshot.benchmark_version}: test {test.num_rows} questions "
          f"({snapshot.manifest.splits['test']['records']} records); recipe overrides {overrides}")
    print(f"noise floor over {len(floor.values)} null arms: {floor.floor:.4f} on {floor.metric} "
          f"(arms {', '.join(f'{v:.4f}' for v in floor.values)}); {SEED_BOUND_LEVEL:.0%} seed bound "
          f"{floor.seed_bound():.4f}; champion = release 1, the control arm (seed {control['seed']}); "
          f"setup {setup_s:.0f}s")
    print(f"{'round':<7}{'seed':>7}{'candidate':>11}{'champion':>10}{'gain':>9}{'floor':>8}{'bar':>8}{'CI low':>9}"
          f"{'floor+CI':>10}{'bar+CI':>8}{'promoted':>10}  refused by")

    promoted = cleared = spread_only = 0
    for i in range(1, args.rounds + 1):
        key = round_key(i)
        seed = recipe.seed + SEED_OFFSET + i
        hypothesis = Hypothesis(
            task=config.task, round=key, benchmark_version=snapshot.benchmark_version,
            change={"kind": "seed_only", "init": "base model", "data": "base train (as the champion)"},
            predicted_delta=0.0, gate=Gate(), seeds=(seed,), recipe_hash=config.recipe_hash(), author="person",
            rationale="A/A: the candidate differs from the champion only in its seed; any promotion is false")
        ledger.register_hypothesis(hypothesis)
        gate = ledger.effective_gate(key)
        started = time.perf_counter()
        ckpt = train_into_store(store, train, val, recipe.replace(seed=seed), data_hash=snapshot.snapshot_id)
        preds = write_predictions(store.round_dir(key) / "candidate_test_predictions.parquet", ckpt, test)
        run = verify_predictions(config, "test", preds, baseline=Path(control["test_predictions"]), seed=i)
        delta = run.paired["deltas"][gate.primary_metric]
        verdict = decide_promotion(gate, delta, floor, run.report.metrics, run.baseline_report.metrics,
                                   config.safety_families, paired=run.paired)
        gain_and_ci = verdict.checks["gain"] > verdict.checks["bar"] and verdict.checks["ci_low"] > 0
        # The gate before the seed bound (the same decision without it): the bar was the spread.
        before = decide_promotion(gate, delta, floor, run.report.metrics, run.baseline_report.metrics,
                                  config.safety_families, paired=run.paired, apply_seed_bound=False).checks
        old_bar = before["bar"]
        old = before["gain"] > old_bar and before["ci_low"] > 0
        promoted += verdict.promote
        cleared += gain_and_ci
        spread_only += old
        refused = "" if verdict.promote else ", ".join(short_reason(r) for r in verdict.reasons)
        print(f"{key:<7}{seed:>7}{run.report.metrics[gate.primary_metric]:>11.4f}"
              f"{run.baseline_report.metrics[gate.primary_metric]:>10.4f}{verdict.checks['gain']:>+9.4f}"
              f"{old_bar:>8.4f}{verdict.checks['bar']:>8.4f}{verdict.checks['ci_low']:>+9.4f}"
              f"{'yes' if old else 'no':>10}{'yes' if gain_and_ci else 'no':>8}"
              f"{'YES' if verdict.promote else 'no':>10}  {refused}  ({time.perf_counter() - started:.0f}s)")

    n = args.rounds
    for label, k in (("false promotions (the full gate)", promoted), ("cleared the bar and the CI alone", cleared),
                     ("the gate before the seed bound (spread + CI)", spread_only)):
        ci = stats.binomtest(k, n).proportion_ci(confidence_level=0.95, method="exact")
        print(f"{label}: {k} / {n} = {k / n:.3f}, 95% Clopper-Pearson CI [{ci.low:.3f}, {ci.high:.3f}]")
    verdict_line = "met" if promoted / n <= TARGET_RATE else "NOT met"
    print(f"target: at most 1 in 20 ({TARGET_RATE:.2f}); observed rate {promoted / n:.3f}: {verdict_line}"
          + ("" if n >= 20 else f" (only {n} rounds: the CI above is what this run can say)"))
    print(f"home: {home}")


if __name__ == "__main__":
    main()
