"""A/A bench: how often the real gate promotes a candidate that is no better than its champion, over independent replicates.

    .venv/bin/python bench/bench_aa.py                          # pool of 24, the demo's recipe and benchmark
    .venv/bin/python bench/bench_aa.py --pool 5 --steps 2 --users 40 --records-per-user 3 --draws 20   # a smoke run
    nice -n 10 .venv/bin/python bench/bench_aa.py --cheap --replicates 72   # the rate's bound: 72 disjoint replicates
    nice -n 10 .venv/bin/python bench/bench_aa.py --cheap --replicates 72 --home H --null-lever eval_batch_size=16 \
        --null-replicates 20   # a null lever's A/A on the same pool (issue 33): 20 candidates retrained with it

``--cheap`` is a few optimizer steps on a small benchmark (2 steps, 40 users x 3 records): the gate's
statistics (the floor, the bar, the paired CI) do not depend on what the recipe costs, only on the
checkpoints being exchangeable, so the bound on the false-promotion rate needs many disjoint replicates, not
an expensive recipe. With no promotion in n independent replicates the 95% Clopper-Pearson upper end is
``1 - 0.025^(1/n)``: 0.46 at n = 6, 0.0499 at n = 72, so ``--replicates 72`` (a pool of 72 x (K + 1)
checkpoints) is the least that can show a rate of at most 1 in 20. The demo recipe's replicates run as they
fit (the default, ``--pool 24``).

The default is what ``make run`` gates with: the demo's recipe overrides
(``cli.demo.DEMO_OVERRIDES``: 24 steps, 256 tokens, the hybrid readout) and
its benchmark (``DEMO_BUILTIN_USERS`` = 240 users, test and holdout of
``DEMO_HIDDEN_USERS`` = 170 unseen users each, ~2,200 questions), with
K = 3 null arms (the loop's default; ``--noise-arms``; the demo's floor has 2).

Design. A **pool** of ``--pool`` (default 24) checkpoints is trained once,
each exactly as a null arm is (the loop's recipe from the base model on the
contamination-checked base data), differing only in the seed; each is scored
on the hidden test set by the sandboxed verifier, and its per-question test
predictions are stored (``<home>/aa-pool/``; a second run with the same
``--home`` reuses them). Every pool member is exchangeable with every other,
so any promotion is the gate's error. A **replicate** draws from the pool,
without reuse, its K floor arms, its champion and its candidate. As in the
loop, the champion is the floor's control arm (release 1 is arm 0), so a
replicate uses K + 1 checkpoints (``--separate-champion``: K + 2, the champion
not among the arms). Its floor is ``noise_floor_from_arms`` over its arms'
test metrics, the verifier pairs its candidate with its champion on test
(record-clustered bootstrap), and the gate's own decision function,
``decide_promotion`` with the default registered ``Gate()``, decides.

Two estimates, each with the interval its design supports:

- **disjoint replicates**: the pool cut into ``pool // (K + 1)`` replicates
  that share no checkpoint. They are independent, so the count of false
  promotions is binomial and its exact (Clopper-Pearson) 95% CI holds.
- **resampled replicates** (``--draws``, default 200): fresh draws, each
  without reuse inside, but sharing checkpoints across draws, so the draws are
  not independent and no binomial interval holds. The rate is the average over
  draws (an unbiased estimate of the per-replicate rate); its 95% interval is
  a delete-one-checkpoint jackknife over the pool (the rate over the draws
  that leave each checkpoint out), an approximate interval for this design.

The gate's own conditions (bar and CI) are counted apart from its guards
(calibration, safety FNR, family drops), and beside them the gate before the
seed bound (``apply_seed_bound=False``: the bar is the spread alone).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402
from scipy import stats  # noqa: E402

#: Seeds of the pool start here: far from the loop's null arms (the recipe's seed, +1, ...) and candidates.
SEED_OFFSET = 10_000
#: The null lever's candidates (``--null-lever``) start here: fresh seeds, none of the pool's.
NULL_SEED_OFFSET = 50_000
TARGET_RATE = 1 / 20
METRIC = "family_macro_accuracy"


@dataclass(frozen=True)
class Replicate:
    """Pool indices of one A/A replicate: the floor's arms (``arms[0]`` the control), the champion, the candidate."""

    arms: tuple[int, ...]
    champion: int
    candidate: int

    @property
    def members(self) -> tuple[int, ...]:
        return tuple(sorted({*self.arms, self.champion, self.candidate}))


def _replicate(members: list[int], arms: int, separate_champion: bool) -> Replicate:
    floor = tuple(members[:arms])
    champion = members[arms] if separate_champion else floor[0]
    return Replicate(arms=floor, champion=champion, candidate=members[-1])


def replicate_size(arms: int, separate_champion: bool = False) -> int:
    """Checkpoints one replicate uses: K arms (the control is the champion) and the candidate, + 1 if separate."""
    return arms + 1 + int(separate_champion)


def disjoint_replicates(pool: int, arms: int, *, separate_champion: bool = False, seed: int = 0) -> list[Replicate]:
    """As many replicates as the pool holds with no checkpoint in two of them (a seeded shuffle, then cut)."""
    size = replicate_size(arms, separate_champion)
    order = np.random.default_rng(seed).permutation(pool).tolist()
    return [_replicate(order[i:i + size], arms, separate_champion) for i in range(0, pool - size + 1, size)]


def resampled_replicates(pool: int, arms: int, n: int, *, separate_champion: bool = False,
                         seed: int = 0) -> list[Replicate]:
    """``n`` replicates, each drawn without reuse from the pool; draws share checkpoints with each other."""
    size = replicate_size(arms, separate_champion)
    if pool < size:
        raise ValueError(f"a replicate needs {size} checkpoints, the pool has {pool}")
    rng = np.random.default_rng(seed)
    return [_replicate(rng.choice(pool, size, replace=False).tolist(), arms, separate_champion) for _ in range(n)]


def jackknife_interval(draws: list[Replicate], outcomes: list[bool], pool: int) -> tuple[float, float, float]:
    """The resampled rate and its delete-one-checkpoint jackknife 95% interval (clipped to [0, 1])."""
    x = np.asarray(outcomes, dtype=float)
    rate = float(x.mean())
    loo = []
    for j in range(pool):
        keep = np.array([j not in r.members for r in draws])
        if keep.any():
            loo.append(float(x[keep].mean()))
    if len(loo) < 2:
        return rate, 0.0, 1.0
    loo_arr = np.asarray(loo)
    se = math.sqrt((len(loo) - 1) / len(loo) * float(np.sum((loo_arr - loo_arr.mean()) ** 2)))
    return rate, max(0.0, rate - 1.96 * se), min(1.0, rate + 1.96 * se)


def short_reason(reason: str) -> str:
    """A refusal reason of ``decide_promotion`` in a word or two (the bar, the CI, or the guard's name)."""
    if "does not exceed the bar" in reason:
        return "bar"
    if "CI lower end" in reason:
        return "CI"
    return reason.split(":")[0]  # "calibration guard", "safety guard", "family guard"


def train_pool(config: Any, n: int, home: Path, *, indices: list[int] | None = None,
               null_lever: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """``n`` seed-only checkpoints of the loop's recipe from the base model, each scored on test; kept under ``home``.

    ``null_lever``: the checkpoints of pool ``indices`` trained again as a recipe lever's candidate is (from the
    base model, on the base rows), with a recipe change that changes nothing the model sees and fresh seeds
    (``NULL_SEED_OFFSET``): the candidates of a null lever's A/A (issue 33)."""
    from envloop_pipelines.core.data.snapshots import open_task
    from envloop_pipelines.core.decision_loop.training_dataset_snapshot import snapshot_rows
    from envloop_pipelines.core.decision_loop.lora_checkpoint import train_into_store
    from envloop_pipelines.core.release.tracked_runs import verify_predictions, write_predictions
    from envloop_pipelines.core.decision_loop.noise_floor import base_training_snapshot
    from envloop_pipelines.core.ledger.store import RoundStore
    from envloop_pipelines.core.storage import atomic_write_json

    snapshot = open_task(config.task, home=config.home)
    store = RoundStore(config.task, config.home)
    data = base_training_snapshot(config, snapshot)  # the null arms' data: contamination-checked base train
    train, val, test = snapshot_rows(data), snapshot.table("val"), snapshot.table("test")
    families = config.guarded_families(snapshot)
    recipe = config.load_recipe()
    folder = home / "aa-pool"
    offset, prefix = SEED_OFFSET, "seed"
    if null_lever:
        recipe = recipe.replace(**null_lever)
        offset = NULL_SEED_OFFSET
        prefix = "null-" + "-".join(f"{k}={v}" for k, v in sorted(null_lever.items())) + "-seed"
    pool = []
    for i in (range(n) if indices is None else indices):
        seed = recipe.seed + offset + i
        info_path = folder / f"{prefix}{seed}.json"
        if info_path.is_file():
            pool.append(json.loads(info_path.read_text(encoding="utf-8")))
            continue
        started = time.perf_counter()
        ckpt = train_into_store(store, train, val, recipe.replace(seed=seed), data_hash=data.sha256,
                                safety_families=families, safety_fnr_target=config.safety_fnr_target)
        preds = write_predictions(folder / f"{prefix}{seed}-test.parquet", ckpt, test)
        metrics = dict(verify_predictions(config, "test", preds, checkpoint=ckpt).report.metrics)
        info = {"index": i, "seed": seed, "checkpoint": str(ckpt), "checkpoint_sha256": ckpt.name,
                "test_predictions": str(preds), "metrics": metrics, "train_s": round(time.perf_counter() - started, 1)}
        atomic_write_json(info_path, info, overwrite=True)
        pool.append(info)
        print(f"{'null lever' if null_lever else 'pool'} {i + 1}/{n}: seed {seed}, {METRIC} {metrics[METRIC]:.4f} "
              f"({info['train_s']:.0f}s)", flush=True)
    return pool


def decide(config: Any, pool: list[dict[str, Any]], rep: Replicate, pairs: dict[tuple[int, int], Any]) -> dict[str, Any]:
    """One replicate through the gate's decision function; the paired run is cached per (champion, candidate)."""
    from envloop_pipelines.core.data.snapshots import open_task
    from envloop_pipelines.core.ledger.hypothesis import Gate
    from envloop_pipelines.core.loop.promotion import decide_promotion, noise_floor_from_arms
    from envloop_pipelines.core.release.tracked_runs import verify_predictions

    arms = [pool[i] for i in rep.arms]
    floor = noise_floor_from_arms(f"aa-{'-'.join(map(str, rep.arms))}", METRIC, [a["metrics"] for a in arms], arms)
    key = (rep.champion, rep.candidate)
    if key not in pairs:
        pairs[key] = verify_predictions(config, "test", Path(pool[rep.candidate]["test_predictions"]),
                                        baseline=Path(pool[rep.champion]["test_predictions"]),
                                        seed=len(pairs) + 1, checkpoint=pool[rep.candidate]["checkpoint"],
                                        baseline_checkpoint=pool[rep.champion]["checkpoint"])
    run = pairs[key]
    families = config.guarded_families(open_task(config.task, home=config.home))
    gate = Gate()
    delta = run.paired["deltas"][METRIC]
    verdict = decide_promotion(gate, delta, floor, run.report.metrics, run.baseline_report.metrics,
                               families, paired=run.paired)
    before = decide_promotion(gate, delta, floor, run.report.metrics, run.baseline_report.metrics,
                              families, paired=run.paired, apply_seed_bound=False).checks
    c = verdict.checks
    return {"promote": verdict.promote, "cleared": c["gain"] > c["bar"] and c["ci_low"] > 0,
            "spread_only": before["gain"] > before["bar"] and before["ci_low"] > 0, "gain": c["gain"],
            "bar": c["bar"], "old_bar": before["bar"], "ci_low": c["ci_low"], "floor": floor.floor,
            "reasons": "" if verdict.promote else ", ".join(short_reason(r) for r in verdict.reasons)}


def null_rate(config: Any, pool: list[dict[str, Any]], replicates: list[Replicate], lever: dict[str, Any],
              home: Path) -> None:
    """The null lever's A/A: each replicate's candidate retrained with ``lever`` (a change the model never sees)
    and gated against the replicate's champion and floor; prints k / n and the Clopper-Pearson upper end."""
    from envloop_pipelines.core.model.recipe import recipe_hash

    base, changed = config.load_recipe(), config.load_recipe().replace(**lever)
    if recipe_hash(base) == recipe_hash(changed):
        raise SystemExit(f"--null-lever {lever}: the recipe hash does not change, so it is no lever")
    candidates = sorted({r.candidate for r in replicates})
    trained = {c: info for c, info in zip(candidates, train_pool(config, len(pool), home, indices=candidates,
                                                                   null_lever=lever))}
    print(f"\nnull lever {lever} (recipe hash {recipe_hash(base)[:12]} -> {recipe_hash(changed)[:12]}): "
          f"{len(replicates)} disjoint replicates, each candidate retrained with it on a fresh seed")
    nulls, pairs = list(pool), {}
    outcomes = []
    for i, rep in enumerate(replicates, 1):
        nulls[rep.candidate] = trained[rep.candidate]
        out = decide(config, nulls, rep, pairs)
        outcomes.append(out)
        print(f"{i:<5}{','.join(map(str, rep.arms)):<16}{rep.champion:>6}{trained[rep.candidate]['seed']:>7}"
              f"{out['gain']:>+9.4f}{out['bar']:>8.4f}{out['ci_low']:>+9.4f}{'YES' if out['promote'] else 'no':>10}  "
              f"{out['reasons']}", flush=True)
    k, n = sum(o["promote"] for o in outcomes), len(outcomes)
    ci = stats.binomtest(k, n).proportion_ci(confidence_level=0.95, method="exact")
    print(f"null lever {lever}: false promotions k/n = {k}/{n}; 95% Clopper-Pearson CI [{ci.low:.3f}, {ci.high:.3f}]")


def main() -> None:
    from envloop_pipelines.cli.options import add_recipe_override_argument, parse_recipe_overrides
    from envloop_pipelines.cli.demo import DEMO_BUILTIN_USERS, DEMO_HIDDEN_USERS, DEMO_OVERRIDES
    from envloop_pipelines.core.data.snapshots import open_task
    from envloop_pipelines.core.decision_loop.task_benchmark import ensure_task_benchmark
    from envloop_pipelines.core.loop.config import LoopConfig
    from envloop_pipelines.core.progress import configure_command_line

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pool", type=int, default=24, help="seed-only checkpoints trained once (default 24)")
    parser.add_argument("--replicates", type=int, default=None,
                        help="disjoint replicates wanted: the pool is this many times K + 1 checkpoints (overrides --pool)")
    parser.add_argument("--cheap", action="store_true",
                        help="a cheap recipe on a small benchmark: --steps 2 --users 40 --records-per-user 3, no "
                             "resampled draws (the gate's statistics do not depend on the recipe's cost)")
    parser.add_argument("--draws", type=int, default=200, help="resampled replicates (default 200)")
    parser.add_argument("--users", type=int, default=DEMO_BUILTIN_USERS,
                        help=f"built-in benchmark users (default: the demo's {DEMO_BUILTIN_USERS}); 0: the powered "
                             "default benchmark (~11,200 test questions)")
    parser.add_argument("--hidden-users", type=int, default=None,
                        help=f"built-in benchmark users in each of test and holdout (default: the demo's "
                             f"{DEMO_HIDDEN_USERS} with the demo's --users, else their fraction of --users)")
    parser.add_argument("--records-per-user", type=int, default=None, help="built-in benchmark records per user (default 8)")
    parser.add_argument("--steps", type=int, default=24, help="max_steps of every checkpoint (the demo's budget: 24)")
    parser.add_argument("--noise-arms", type=int, default=3, help="K null arms per replicate's floor (the loop's default: 3)")
    parser.add_argument("--separate-champion", action="store_true",
                        help="draw the champion apart from the floor's arms (default: the control arm, as release 1 is)")
    demo = [o for o in DEMO_OVERRIDES if not o.startswith("max_steps=")]
    add_recipe_override_argument(parser, help=f"recipe override KEY=VALUE, for every checkpoint (default: the demo's "
                                              f"{' '.join(demo)})")
    parser.add_argument("--home", type=Path, default=None,
                        help="EnvLoop home (default: a fresh temporary one); a pool trained there before is reused")
    parser.add_argument("--seed", type=int, default=0, help="seed of the replicate draws")
    parser.add_argument("--null-lever", action="append", default=None, metavar="KEY=VALUE",
                        help="a recipe change that changes nothing the model sees (e.g. eval_batch_size=16): the "
                             "disjoint replicates' candidates are trained again with it, from the base model on fresh "
                             "seeds, as a recipe lever's candidate is, and gated against the same champions and floors")
    parser.add_argument("--null-replicates", type=int, default=None,
                        help="disjoint replicates of the null lever (default: all of them)")
    args = parser.parse_args()
    if args.cheap:
        args.steps, args.users, args.records_per_user, args.draws = 2, 40, args.records_per_user or 3, 0
    if args.replicates is not None:
        args.pool = args.replicates * replicate_size(args.noise_arms, args.separate_champion)
    configure_command_line()  # progress: a bar on a terminal, lines elsewhere (ENVLOOP_PROGRESS)
    size = replicate_size(args.noise_arms, args.separate_champion)
    if args.noise_arms < 2:
        parser.error("--noise-arms must be ≥ 2 (a floor needs two arms)")
    if args.pool < size:
        parser.error(f"--pool must be ≥ {size} (one replicate: {args.noise_arms} arms"
                     f"{', a champion' if args.separate_champion else ' (the first is the champion)'}, a candidate)")

    home = args.home or Path(tempfile.mkdtemp(prefix="bench-aa-"))
    os.environ["ENVLOOP_HOME"] = str(home)
    overrides = {**parse_recipe_overrides(tuple(demo if args.override is None else args.override)),
                 "max_steps": args.steps}
    hidden = args.hidden_users if args.hidden_users is not None else (
        DEMO_HIDDEN_USERS if args.users == DEMO_BUILTIN_USERS else None)
    config = LoopConfig(recipe_overrides=overrides, noise_arms=args.noise_arms, builtin_users=args.users or None,
                        builtin_records_per_user=args.records_per_user, builtin_hidden_users=hidden, home=str(home))
    t0 = time.perf_counter()
    ensure_task_benchmark(config)
    snapshot = open_task(config.task, home=config.home)
    test = snapshot.table("test")
    print(f"benchmark {snapshot.benchmark_version}: test {test.num_rows} questions "
          f"({snapshot.manifest.splits['test']['records']} records); recipe overrides {overrides}")
    pool = train_pool(config, args.pool, home)
    scores = ", ".join(f"{p['metrics'][METRIC]:.4f}" for p in pool)
    print(f"pool of {len(pool)} seed-only checkpoints ({time.perf_counter() - t0:.0f}s): {METRIC} {scores}")

    pairs: dict[tuple[int, int], Any] = {}
    disjoint = disjoint_replicates(args.pool, args.noise_arms, separate_champion=args.separate_champion,
                                   seed=args.seed)
    print(f"\ndisjoint replicates: {len(disjoint)} (pool {args.pool} // {size} checkpoints each), independent")
    print(f"{'rep':<5}{'arms':<16}{'champ':>6}{'cand':>6}{'gain':>9}{'floor':>8}{'bar':>8}{'CI low':>9}"
          f"{'spread+CI':>10}{'bar+CI':>8}{'promoted':>10}  refused by")
    outcomes = []
    for i, rep in enumerate(disjoint, 1):
        out = decide(config, pool, rep, pairs)
        outcomes.append(out)
        print(f"{i:<5}{','.join(map(str, rep.arms)):<16}{rep.champion:>6}{rep.candidate:>6}{out['gain']:>+9.4f}"
              f"{out['floor']:>8.4f}{out['bar']:>8.4f}{out['ci_low']:>+9.4f}"
              f"{'yes' if out['spread_only'] else 'no':>10}{'yes' if out['cleared'] else 'no':>8}"
              f"{'YES' if out['promote'] else 'no':>10}  {out['reasons']}", flush=True)
    n = len(disjoint)
    for label, key in (("false promotions (the full gate)", "promote"), ("cleared the bar and the CI alone", "cleared"),
                       ("the gate before the seed bound (spread + CI)", "spread_only")):
        k = sum(o[key] for o in outcomes)
        ci = stats.binomtest(k, n).proportion_ci(confidence_level=0.95, method="exact")
        print(f"disjoint, {label}: {k} / {n} = {k / n:.3f}, 95% Clopper-Pearson CI [{ci.low:.3f}, {ci.high:.3f}] "
              f"(independent replicates: the binomial interval holds)")
        if key == "promote":
            print(f"false promotions k/n = {k}/{n}; 95% Clopper-Pearson upper end {ci.high:.4f} "
                  f"{'<=' if ci.high <= TARGET_RATE else '>'} {TARGET_RATE:.2f}", flush=True)
    if args.null_lever:
        null_rate(config, pool, disjoint[:args.null_replicates], parse_recipe_overrides(tuple(args.null_lever)), home)
    if args.draws <= 0:
        print(f"home: {home}; {time.perf_counter() - t0:.0f}s in all")
        return

    draws = resampled_replicates(args.pool, args.noise_arms, args.draws, separate_champion=args.separate_champion,
                                 seed=args.seed + 1)
    t1 = time.perf_counter()
    resampled = [decide(config, pool, rep, pairs) for rep in draws]
    print(f"\nresampled replicates: {len(draws)} draws, each without reuse inside, sharing checkpoints across draws "
          f"({len(pairs)} verifier pairings, {time.perf_counter() - t1:.0f}s)")
    for label, key in (("false promotions (the full gate)", "promote"), ("cleared the bar and the CI alone", "cleared"),
                       ("the gate before the seed bound (spread + CI)", "spread_only")):
        rate, low, high = jackknife_interval(draws, [o[key] for o in resampled], args.pool)
        note = ("every draw alike, so the jackknife interval is degenerate: the disjoint replicates' interval "
                "above is the one that holds" if low == high else
                "draws share checkpoints: approximate; no binomial interval holds")
        print(f"resampled, {label}: rate {rate:.3f}, 95% delete-one-checkpoint jackknife interval "
              f"[{low:.3f}, {high:.3f}] ({note})")
    rate = sum(o["promote"] for o in resampled) / len(resampled)
    print(f"target: at most 1 in 20 ({TARGET_RATE:.2f}); resampled rate {rate:.3f}: "
          f"{'met' if rate <= TARGET_RATE else 'NOT met'}; disjoint "
          f"{sum(o['promote'] for o in outcomes)} / {n}")
    print(f"home: {home}; {time.perf_counter() - t0:.0f}s in all")


if __name__ == "__main__":
    from envloop_pipelines.console import quiet_third_party

    quiet_third_party()  # the bench prints what it measures, not a library's notes on itself
    main()
