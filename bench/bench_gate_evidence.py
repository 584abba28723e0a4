"""The gate's operating point at the README demo's design: how often it promotes a null candidate, how often a real gain.

    nice -n 10 .venv/bin/python bench/bench_gate_evidence.py                  # runs (resumes) the registered plan
    nice -n 10 .venv/bin/python bench/bench_gate_evidence.py --max-seconds 7000   # as much as fits, then the table
    .venv/bin/python bench/bench_gate_evidence.py --report-only                # the table of what is on record
    .venv/bin/python bench/bench_gate_evidence.py --smoke --results /tmp/ge --home /tmp/ge-home   # a cheap run

**The design is the demo's** (``make run``): the built-in benchmark at ``DEMO_BUILTIN_USERS`` = 240 users with
test and holdout of ``DEMO_HIDDEN_USERS`` = 170 unseen users each (~2,200 questions), the demo's recipe
(``DEMO_OVERRIDES``: 24 steps, 256 tokens, the hybrid readout) with its feature cache, K = 2 null arms
(the demo's ``noise_arms``), the champion the floor's control arm (release 1 is arm 0), the default
registered ``Gate()``, and the gate's own decision function, ``decide_promotion`` with its guards
(calibration, safety FNR, family drops), on the verifier's paired record-clustered CI, as the round calls it.

**Replicates are disjoint.** Replicate ``i`` trains its own two arms from the base model on the base data
(seeds ``SEED_BASE + 3i`` and ``+1``; arm 0 is the champion) and its own candidates, none shared with another
replicate, so the counts are binomial and the exact (Clopper-Pearson) 95% interval holds. Its candidates:

- ``null_seed``: a third seed of the control recipe (``SEED_BASE + 3i + 2``): no better than the champion.
- ``null_lever``: the control recipe with a null lever (``eval_batch_size=16``: a recipe change the model never
  sees; the recipe hash changes) on a fresh seed, as a recipe lever's candidate is trained (from the base model).
- ``power_96`` and ``power_300``: the budget lever's candidates, 96 and 300 more steps from the champion on the
  base rows (``recipe_diff {"max_steps": 96 | 300}``, ``data: train``, initialised from the champion), fresh
  seeds: a real gain, whose size is the mean of their paired deltas over the replicates (one seed each).
  The share promoted is the measured power; beside it the power the MDE formula claims at that gain
  (``P(d > max(bar, z se))`` with each replicate's bar and paired se, averaged), and the registered MDE's 80%.

**Pre-registered.** ``<results>/plan.json`` is written before anything trains: the design (benchmark, recipe
hash, K, gate), the replicate counts per kind and their seeds, and the targets. A later call with another plan
in the same ``--results`` is refused. Each finished replicate is one small JSON in ``<results>/replicates/``
(its members' seeds, recipe hashes, checkpoint hashes and test metrics, the paired deltas, the decision and
its checks): the record travels with the repository (``bench/results/gate-evidence/``), the checkpoints do
not (``--home``: generated again, deterministically, on a fresh machine; the plan names the benchmark
version, and a run on a home whose benchmark differs is refused). A replicate is written whole or not at all.

Also printed: the seed spread at the champion's lineage (the ``power_300`` candidates: the demo's 324-step
champion after one round) beside the control recipe's (the 24-step arms), so a reader sees whether the
control recipe's floor bounds the one a 324-step champion would have (issue 45, item 2).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from scipy import stats  # noqa: E402

from bench_aa import METRIC  # noqa: E402

#: Seeds of the replicates' arms and null candidates start here (far from the loop's and bench_aa's seeds).
SEED_BASE = 20_000
#: Fresh seeds of the null lever's and the power candidates, per kind.
KIND_SEED_BASE = {"null_lever": 30_000, "power_96": 40_000, "power_300": 50_000}
NULL_LEVER = {"eval_batch_size": 16}
KINDS = ("null_seed", "null_lever", "power_96", "power_300")
#: Replicates registered per kind: 60 disjoint nulls (0 promotions: Clopper-Pearson upper 0.049), 20 of the rest.
DEFAULT_COUNTS = {"null_seed": 60, "null_lever": 20, "power_96": 20, "power_300": 20}
CLAIMED_POWER = 0.8
TARGET_RATE = 0.05


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def plan_of(args: argparse.Namespace, design: dict[str, Any]) -> dict[str, Any]:
    counts = dict(DEFAULT_COUNTS) if not args.smoke else {"null_seed": 2, "null_lever": 1, "power_96": 1, "power_300": 1}
    n = max(counts.values())
    seeds = {i: {"arms": [SEED_BASE + 3 * i, SEED_BASE + 3 * i + 1], "null_seed": SEED_BASE + 3 * i + 2,
                 **{k: base + i for k, base in KIND_SEED_BASE.items()}} for i in range(n)}
    steps = {"power_96": 4, "power_300": 8} if args.smoke else {"power_96": 96, "power_300": 300}
    return {"design": design, "counts": counts, "seeds": {str(i): s for i, s in seeds.items()},
            "null_lever": NULL_LEVER, "power_steps": steps,
            "targets": {"null_false_promotions": "0 or 1 of 60 (Clopper-Pearson upper <= 0.05 at 0 of 60: 0.049)",
                        "power": f"within 0.15 of the claimed {CLAIMED_POWER} or the MDE formula corrected"}}


def register(results: Path, plan: dict[str, Any]) -> None:
    """Write the plan before anything trains; refuse another plan in the same folder."""
    path = results / "plan.json"
    text = json.dumps(plan, indent=1, sort_keys=True)
    if path.exists():
        if json.loads(path.read_text()) != json.loads(text):
            raise SystemExit(f"{path}: another plan is registered there; use another --results (registered: "
                             f"{path.read_text()[:400]} ...)")
        return
    results.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


class Members:
    """The checkpoints of one replicate, trained on the bench's home, each scored on test by the verifier."""

    def __init__(self, config: Any, home: Path) -> None:
        from envloop_pipelines.core.data.snapshots import open_task
        from envloop_pipelines.core.decision_loop.training_dataset_snapshot import snapshot_rows
        from envloop_pipelines.core.decision_loop.noise_floor import base_training_snapshot
        from envloop_pipelines.core.ledger.store import RoundStore

        self.config, self.home = config, home
        self.snapshot = open_task(config.task, home=config.home)
        self.store = RoundStore(config.task, config.home)
        self.data = base_training_snapshot(config, self.snapshot)  # the null arms' data: checked base train
        self.train, self.val, self.test = snapshot_rows(self.data), self.snapshot.table("val"), self.snapshot.table("test")
        self.families = config.guarded_families(self.snapshot)
        self.recipe = config.load_recipe()

    def train_one(self, name: str, recipe: Any, init_from: Path | None = None) -> dict[str, Any]:
        from envloop_pipelines.core.decision_loop.lora_checkpoint import train_into_store
        from envloop_pipelines.core.model.recipe import recipe_hash
        from envloop_pipelines.core.release.tracked_runs import verify_predictions, write_predictions

        started = time.perf_counter()
        ckpt = train_into_store(self.store, self.train, self.val, recipe, data_hash=self.data.sha256,
                                init_from=init_from, safety_families=self.families,
                                safety_fnr_target=self.config.safety_fnr_target)
        preds = write_predictions(self.home / "gate-evidence" / f"{name}-test.parquet", ckpt, self.test)
        metrics = dict(verify_predictions(self.config, "test", preds, checkpoint=ckpt).report.metrics)
        return {"name": name, "seed": recipe.seed, "recipe_hash": recipe_hash(recipe), "max_steps": recipe.max_steps,
                "init_from": None if init_from is None else init_from.name, "checkpoint": str(ckpt),
                "checkpoint_sha256": ckpt.name, "test_predictions": str(preds), "metrics": metrics,
                "train_s": round(time.perf_counter() - started, 1)}


def decide_one(config: Any, arms: list[dict[str, Any]], candidate: dict[str, Any]) -> dict[str, Any]:
    """The gate's decision on one candidate against the replicate's champion (arm 0) and floor (its arms)."""
    from bench_aa import Replicate, decide

    pool = [*arms, candidate]
    rep = Replicate(arms=tuple(range(len(arms))), champion=0, candidate=len(arms))
    pairs: dict[tuple[int, int], Any] = {}
    out = decide(config, pool, rep, pairs)
    run = pairs[(0, len(arms))]
    d = run.paired["deltas"][METRIC]
    return {**out, "se": d.get("se"), "ci": [d.get("ci_low"), d.get("ci_high")], "delta": d.get("delta"),
            "confidence_level": d.get("confidence_level", 0.95),
            "paired_families": run.paired.get("families"), "paired_safety": run.paired.get("safety")}


def slim(member: dict[str, Any]) -> dict[str, Any]:
    """What a replicate's record keeps of a member: no paths into a home that will not travel."""
    return {k: v for k, v in member.items() if k not in ("checkpoint", "test_predictions")}


def run_replicate(config: Any, members: Members, plan: dict[str, Any], i: int, kinds: list[str]) -> dict[str, Any]:
    """Replicate ``i``: its two arms and a candidate per kind registered at ``i``, each decided by the gate."""
    seeds = plan["seeds"][str(i)]
    recipe = members.recipe
    arms = [members.train_one(f"r{i:03d}-arm{j}", recipe.replace(seed=s)) for j, s in enumerate(seeds["arms"])]
    record: dict[str, Any] = {"replicate": i, "arms": [slim(a) for a in arms], "candidates": {}}
    for kind in kinds:
        if kind == "null_seed":
            cand = members.train_one(f"r{i:03d}-{kind}", recipe.replace(seed=seeds[kind]))
        elif kind == "null_lever":
            cand = members.train_one(f"r{i:03d}-{kind}", recipe.replace(**plan["null_lever"], seed=seeds[kind]))
        else:  # the budget lever's candidate: more steps from the champion on the base rows
            cand = members.train_one(f"r{i:03d}-{kind}", recipe.replace(max_steps=plan["power_steps"][kind],
                                                                        seed=seeds[kind]),
                                     init_from=Path(arms[0]["checkpoint"]))
        verdict = decide_one(config, arms, cand)
        record["candidates"][kind] = {"member": slim(cand), "decision": verdict}
        log(f"replicate {i} {kind}: gain {verdict['gain']:+.4f} bar {verdict['bar']:.4f} CI low {verdict['ci_low']:+.4f}"
            f" -> {'PROMOTED' if verdict['promote'] else 'refused: ' + verdict['reasons']} ({cand['train_s']:.0f}s)")
    return record


def kinds_at(plan: dict[str, Any], i: int) -> list[str]:
    return [k for k in KINDS if i < plan["counts"][k]]


def cp_interval(k: int, n: int) -> tuple[float, float]:
    ci = stats.binomtest(k, n).proportion_ci(confidence_level=0.95, method="exact")
    return float(ci.low), float(ci.high)


def formula_power(gain: float, bar: float, se: float, level: float) -> float:
    """The MDE formula's power at a true ``gain``: ``P(d > max(bar, z se))`` with ``d ~ N(gain, se)``."""
    threshold = max(bar, float(stats.norm.ppf(1 - (1 - level) / 2)) * se)
    return float(stats.norm.sf((threshold - gain) / se)) if se > 0 else float(gain > threshold)


def report(results: Path, plan: dict[str, Any]) -> dict[str, Any]:
    """Print the operating point's table from the records on file; return it as the operating point's record."""
    from envloop_pipelines.core.metrics.paired import minimum_detectable_effect

    records = [json.loads(p.read_text()) for p in sorted((results / "replicates").glob("r*.json"))]
    d = plan["design"]
    print(f"\ndesign: {d['task']} benchmark {d['benchmark_version']}: test {d['test_questions']} questions of "
          f"{d['test_users']} unseen users; recipe {d['recipe_hash'][:12]} ({d['recipe_overrides']}); K = "
          f"{d['noise_arms']} null arms, the champion the control arm; gate {d['gate']}")
    print(f"registered replicates: {plan['counts']}; on record: {len(records)} replicates")
    print(f"\n{'kind':<12}{'n':>4}{'promoted':>9}{'rate':>7}{'95% CP CI':>18}{'mean gain':>11}{'sd gain':>9}"
          f"{'mean bar':>9}{'mean se':>9}{'mean MDE':>9}{'formula power':>14}{'refused by (count)':>22}")
    summary: dict[str, Any] = {}
    for kind in KINDS:
        rows = [r["candidates"][kind]["decision"] for r in records if kind in r["candidates"]]
        if not rows:
            print(f"{kind:<12}{0:>4}  (none on record yet)")
            continue
        n, k = len(rows), sum(bool(r["promote"]) for r in rows)
        low, high = cp_interval(k, n)
        gains = [r["gain"] for r in rows]
        mean_gain = statistics.fmean(gains)
        sd_gain = statistics.stdev(gains) if n > 1 else float("nan")
        bars = [r["bar"] for r in rows]
        ses = [r["se"] for r in rows]
        mdes = [minimum_detectable_effect(r["se"], confidence_level=r["confidence_level"], bar=r["bar"]) for r in rows]
        power = statistics.fmean(formula_power(mean_gain, r["bar"], r["se"], r["confidence_level"]) for r in rows)
        reasons: dict[str, int] = {}
        for r in rows:
            for reason in filter(None, (r["reasons"] or "").split(", ")):
                reasons[reason] = reasons.get(reason, 0) + 1
        print(f"{kind:<12}{n:>4}{k:>9}{k / n:>7.3f}{f'[{low:.3f}, {high:.3f}]':>18}{mean_gain:>+11.4f}{sd_gain:>9.4f}"
              f"{statistics.fmean(bars):>9.4f}{statistics.fmean(ses):>9.4f}{statistics.fmean(mdes):>9.4f}"
              f"{power if kind.startswith('power') else float('nan'):>14.3f}"
              f"{', '.join(f'{a} {b}' for a, b in sorted(reasons.items())):>22}")
        summary[kind] = {"n": n, "promoted": k, "cp95": [low, high], "mean_gain": mean_gain,
                         "mean_mde": statistics.fmean(mdes), "formula_power": power}
    nulls = [s for kind, s in summary.items() if kind.startswith("null")]
    if nulls:
        k, n = sum(s["promoted"] for s in nulls), sum(s["n"] for s in nulls)
        low, high = cp_interval(k, n)
        print(f"\nfalse promotions, null seed and null lever together: {k} / {n}, 95% Clopper-Pearson upper "
              f"{high:.4f} ({'<=' if high <= TARGET_RATE else '>'} {TARGET_RATE})")
    for kind in ("power_96", "power_300"):
        if kind in summary:
            s = summary[kind]
            print(f"power, {kind}: promoted {s['promoted']} / {s['n']} = {s['promoted'] / s['n']:.3f} at a measured gain "
                  f"of {s['mean_gain']:+.4f}; the MDE formula claims {s['formula_power']:.3f} at that gain "
                  f"(and {CLAIMED_POWER} at its MDE {s['mean_mde']:.4f}); measured - claimed "
                  f"{s['promoted'] / s['n'] - s['formula_power']:+.3f}")
    arm_scores = [a["metrics"][METRIC] for r in records for a in r["arms"]]
    lineage = [r["candidates"]["power_300"]["member"]["metrics"][METRIC] for r in records if "power_300" in r["candidates"]]
    spread = None
    if len(arm_scores) > 2 and len(lineage) > 2:
        floors = [abs(r["arms"][0]["metrics"][METRIC] - r["arms"][1]["metrics"][METRIC]) for r in records]
        steps = d["recipe_overrides"].get("max_steps", 0) + plan["power_steps"]["power_300"]
        spread = {"control_sd": statistics.stdev(arm_scores), "n_control": len(arm_scores),
                  "lineage_sd": statistics.stdev(lineage), "n_lineage": len(lineage), "lineage_steps": steps,
                  "bounded": statistics.stdev(lineage) <= statistics.stdev(arm_scores),
                  "mean_k2_floor": statistics.fmean(floors)}
        print(f"\nseed spread of {METRIC} on test: the control recipe's arms sd {spread['control_sd']:.4f} "
              f"(n={len(arm_scores)}; the K=2 floor, |arm0 - arm1|, mean {spread['mean_k2_floor']:.4f}); the "
              f"champion's lineage after one budget round ({steps} steps, one seed per champion) sd "
              f"{spread['lineage_sd']:.4f} (n={len(lineage)}): the control recipe's floor "
              f"{'bounds' if spread['bounded'] else 'does NOT bound'} it")
    seconds = [m["train_s"] for r in records for m in [*r["arms"], *(c["member"] for c in r["candidates"].values())]]
    if seconds:
        print(f"members trained: {len(seconds)}, {sum(seconds) / 3600:.2f} h in all (train, predict and score)")
    (results / "summary.json").write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n")
    null = [summary[k] for k in ("null_seed", "null_lever") if k in summary]
    k, n = sum(s["promoted"] for s in null), sum(s["n"] for s in null)
    return {"design": {key: d[key] for key in ("benchmark_version", "recipe_hash", "noise_arms", "gate")},
            "test_questions": d["test_questions"], "test_users": d["test_users"],
            "null": {"n": n, "promoted": k, "cp95": list(cp_interval(k, n)) if n else None,
                     "by_kind": {kind: summary[kind] for kind in ("null_seed", "null_lever") if kind in summary}},
            "power": {f"+{plan['power_steps'][kind]} steps": summary[kind] for kind in ("power_96", "power_300")
                      if kind in summary},
            "lineage_spread": spread, "registered": plan["counts"], "measured": time.strftime("%Y-%m-%d")}


def main() -> None:
    from envloop_pipelines.cli.demo import DEMO_BUILTIN_USERS, DEMO_HIDDEN_USERS, DEMO_OVERRIDES
    from envloop_pipelines.cli.options import parse_recipe_overrides
    from envloop_pipelines.core.data.snapshots import open_task
    from envloop_pipelines.core.decision_loop.task_benchmark import ensure_task_benchmark
    from envloop_pipelines.core.ledger.hypothesis import Gate
    from envloop_pipelines.core.loop.config import LoopConfig
    from envloop_pipelines.core.loop.operating_point import OPERATING_POINTS_FILE, record_operating_point
    from envloop_pipelines.core.progress import configure_command_line

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--results", type=Path, default=Path(__file__).resolve().parent / "results" / "gate-evidence",
                        help="the plan and the replicates' records (default: bench/results/gate-evidence, committed)")
    parser.add_argument("--home", type=Path, default=Path(".bench/gate-evidence-home"),
                        help="EnvLoop home of the benchmark and the checkpoints (not kept)")
    parser.add_argument("--max-seconds", type=float, default=None,
                        help="start no replicate after this many seconds (the one under way finishes)")
    parser.add_argument("--report-only", action="store_true", help="print the table of what is on record, train nothing")
    parser.add_argument("--record", action="store_true",
                        help="put the operating point on record (envloop_pipelines/core/loop/gate_operating_points.json): "
                             "the cards and `envloop ledger` of a loop at this design show it")
    parser.add_argument("--points-file", type=Path, default=None,
                        help="where --record writes (default: the package's gate_operating_points.json)")
    parser.add_argument("--smoke", action="store_true",
                        help="a cheap design (40 users x 3 records, 2 steps) and 2 replicates: checks the bench runs")
    args = parser.parse_args()
    configure_command_line()
    home = args.home.resolve()
    os.environ["ENVLOOP_HOME"] = str(home)
    os.environ.setdefault("ENVLOOP_FEATURE_CACHE", str(home / "features"))
    overrides = parse_recipe_overrides(DEMO_OVERRIDES)
    kwargs = dict(builtin_users=DEMO_BUILTIN_USERS, builtin_hidden_users=DEMO_HIDDEN_USERS)
    if args.smoke:
        overrides["max_steps"] = 2
        kwargs = dict(builtin_users=40, builtin_records_per_user=3, builtin_hidden_users=None)
    config = LoopConfig(task="personal_agent", recipe_overrides=overrides, noise_arms=2, home=str(home), **kwargs)
    results = args.results.resolve()
    if args.report_only:
        point = report(results, json.loads((results / "plan.json").read_text()))
        if args.record:
            record_operating_point(point, path=args.points_file or OPERATING_POINTS_FILE)
            print(f"on record in {args.points_file or OPERATING_POINTS_FILE}")
        return
    ensure_task_benchmark(config)
    snapshot = open_task(config.task, home=config.home)
    test = snapshot.table("test")
    design = {"task": config.task, "benchmark_version": snapshot.benchmark_version, "test_questions": test.num_rows,
              "test_users": len(set(test.column("group").to_pylist())), "builtin": kwargs,
              "recipe_hash": config.recipe_hash(), "recipe_overrides": overrides, "noise_arms": config.noise_arms,
              "gate": Gate().__dict__, "champion": "control arm (arm 0)"}
    plan = plan_of(args, design)
    register(results, plan)
    (results / "replicates").mkdir(parents=True, exist_ok=True)
    members = Members(config, home)
    started = time.perf_counter()
    for i in range(max(plan["counts"].values())):
        out = results / "replicates" / f"r{i:03d}.json"
        if out.exists():
            continue
        if args.max_seconds is not None and time.perf_counter() - started > args.max_seconds:
            log(f"--max-seconds {args.max_seconds:.0f} reached: replicate {i} and later wait for the next call")
            break
        t0 = time.perf_counter()
        record = run_replicate(config, members, plan, i, kinds_at(plan, i))
        record["seconds"] = round(time.perf_counter() - t0, 1)
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
        tmp.replace(out)  # a replicate is on record whole or not at all
        log(f"replicate {i} on record ({record['seconds']:.0f}s)")
    point = report(results, plan)
    if args.record:
        record_operating_point(point, path=args.points_file or OPERATING_POINTS_FILE)
        print(f"on record in {args.points_file or OPERATING_POINTS_FILE}")


if __name__ == "__main__":
    from envloop_pipelines.console import quiet_third_party

    quiet_third_party()
    main()
