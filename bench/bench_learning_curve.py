"""Data and compute curves of the decision model, with a per-family diagnosis, on a wide test of unseen users.

    .venv/bin/python bench/bench_learning_curve.py [--home DIR] [--multipliers 1,4,16] [--steps 300,1200]
        [--seeds 0,1] [--recipe-override precision=bf16 ...] [--order steps-first|data-first]

One benchmark of the built-in generator at ``16 x 240`` users (seed 0): its train split holds
2,304 users, of which a point trains on the first ``144 x m`` (``m`` in ``--multipliers``: 144 is the
train split of today's 240-user benchmark, so ``m = 1`` is what a round trains on and larger ``m`` is
more users of the same generator; nested, seeded order). Val is the first 48 val users at every point
(calibration, the hybrid's weight). The **wide test** is the test split of the same benchmark: 384 users
no point trains on (half rendered by the unseen renderer "b"), ~5,000 questions, checked for
contamination (no shared user, no shared state text) before anything trains.

Each point ``(m, steps, seed)`` trains the default CPU recipe (``decision_head_cpu.yaml``) with
``max_steps=steps``, ``seed`` and the bench's overrides (default: ``precision=bf16`` with every dropout 0,
the faster setting ``bench_training_cost.py`` measures) through ``train_checkpoint``, predicts the wide
test and scores it with the sandboxed verifier: family-macro accuracy, coverage at the 5% error
budget, needs_approval's false-negative rate, accuracy by family, training seconds, seconds per
step and MFU. TF-IDF + LR is fitted on the same train at each ``m``. Results go to ``DIR/points/``
as they come (the bench resumes there; the planned points are written to ``DIR/plan.json`` before the
first trains, and a later call with another plan is refused).

The **diagnosis** (printed for the largest trained point, its seeds pooled) reads the **dev split**, not the
wide test: its users are disjoint from every point's train and from val, and its labels are open (the
wide test's labels are read by the sandboxed verifier only, which answers with aggregates; rule 4 of
``docs/loop-rules.md``). Per family it reads: accuracy
with a user-clustered bootstrap 95% CI, its margin over chance (1/options) and over TF-IDF + LR
(paired, same resamples); the share of questions whose state was cut at ``max_length`` and the
accuracy of those questions when the same checkpoint reads them whole (max_length 512: does the
evidence the cut dropped decide them?); accuracy by evidence variant (clean, override, removed: soft
label, buried) and by rule kind; and train accuracy (capacity: does the model fit its own train?).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench_training_cost import bf16_matmul_peak, layer_flops, matmul_peak  # noqa: E402

from envloop_pipelines.cli.options import add_recipe_override_argument, parse_recipe_overrides  # noqa: E402
from envloop_pipelines.core.baseline import TfidfBaseline  # noqa: E402
from envloop_pipelines.core.benchmark import SAFETY_FAMILIES  # noqa: E402
from envloop_pipelines.core.benchmark.builtin_task import generate_builtin_task  # noqa: E402
from envloop_pipelines.core.data.snapshots import open_task  # noqa: E402
from envloop_pipelines.core.model.checkpoint import METRICS_FILE  # noqa: E402
from envloop_pipelines.core.model.predict import DecisionModel, predictions_table  # noqa: E402
from envloop_pipelines.core.model.readout import questions_from_table  # noqa: E402
from envloop_pipelines.core.model.recipe import DEFAULT_RECIPE, load_recipe  # noqa: E402
from envloop_pipelines.core.model.training import train_checkpoint  # noqa: E402
from envloop_pipelines.core.progress import configure_command_line  # noqa: E402
from envloop_pipelines.core.storage import atomic_write_parquet  # noqa: E402
from envloop_pipelines.core.verify.runner import verify_task  # noqa: E402

TASK = "curve"
BASE_USERS, BASE_TRAIN_USERS, VAL_USERS, MAX_MULT = 240, 144, 48, 16
DEFAULT_OVERRIDES = ("precision=bf16", "encoder_dropout=0", "lora={dropout: 0}")
N_LAYERS = 6
KEYS = ("family_macro_accuracy", "coverage_at_5pct", "fnr/needs_approval")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def users_of(table) -> list[str]:  # noqa: ANN001
    return list(dict.fromkeys(table.column("group").to_pylist()))


def rows_of_users(table, users: set[str]):  # noqa: ANN001, ANN201
    groups = table.column("group").to_pylist()
    return table.take([i for i, g in enumerate(groups) if g in users])


def prepare(home: Path) -> dict:
    """The benchmark (generated once), the train order, val and the wide test's contamination check."""
    meta_path = home / "benchmark.json"
    if meta_path.exists():
        return json.loads(meta_path.read_text())
    n_users = BASE_USERS * MAX_MULT
    gen = generate_builtin_task(task=TASK, n_users=n_users, hidden_users=n_users // 10, home=home)
    snap = open_task(TASK, home=home)
    train_users = users_of(snap.table("train"))
    random.Random(0).shuffle(train_users)
    test = snap.table("test")
    test_users = set(users_of(test))
    shared_users = test_users & set(train_users)
    shared_states = set(test.column("state_text").to_pylist()) & set(snap.table("train").column("state_text").to_pylist())
    if shared_users or shared_states:
        raise SystemExit(f"contaminated wide test: {len(shared_users)} users and {len(shared_states)} state texts "
                         "also in train")
    records = {}
    with open(gen["path"], encoding="utf-8") as fh:  # evidence variant and rule kind per record (the diagnosis)
        for line in fh:
            r = json.loads(line)
            if r["meta"]["split"] in ("dev", "train"):
                records[r["id"]] = {"variant": r["meta"]["variant"], "rule_kind": r["meta"]["rule_kind"]}
    (home / "records_meta.json").write_text(json.dumps(records))
    dev_users = set(users_of(snap.table("dev")))
    if dev_users & set(train_users):
        raise SystemExit(f"dev split shares {len(dev_users & set(train_users))} users with train: no diagnosis on it")
    meta = {"n_users": n_users, "train_users": train_users, "val_users": users_of(snap.table("val"))[:VAL_USERS],
            "test_users": len(test_users), "test_questions": test.num_rows, "snapshot_id": snap.snapshot_id,
            "contamination": {"shared_users": 0, "shared_state_texts": 0}}
    meta_path.write_text(json.dumps(meta))
    return meta


def score(home: Path, name: str, table) -> dict:  # noqa: ANN001
    path = atomic_write_parquet(home / "predictions" / f"{name}.parquet", table, overwrite=True)
    run = verify_task(TASK, "test", path, home=home, safety_families=tuple(SAFETY_FAMILIES))
    if not run.ok:
        raise SystemExit(f"verifier failed for {name}: {run.error}")
    return dict(run.report.metrics)


def train_flops_per_example(model, questions, frozen: int) -> float:  # noqa: ANN001
    lengths = [len(e.input_ids) for e in model.encode_many(questions)]
    return 3 * (N_LAYERS - frozen) * float(np.mean([layer_flops(n) for n in lengths]))


def run_point(home: Path, meta: dict, m: int, steps: int, seed: int, overrides: dict, peaks: dict) -> dict:
    out = home / "points" / f"m{m}-s{steps}-seed{seed}.json"
    if out.exists():
        return json.loads(out.read_text())
    snap = open_task(TASK, home=home)
    train = rows_of_users(snap.table("train"), set(meta["train_users"][: BASE_TRAIN_USERS * m]))
    val = rows_of_users(snap.table("val"), set(meta["val_users"]))
    test = snap.table("test")
    recipe = load_recipe(DEFAULT_RECIPE, {**overrides, "max_steps": steps, "seed": seed})
    log(f"point m={m} steps={steps} seed={seed}: {train.num_rows} train questions")
    t0 = time.perf_counter()
    ckpt = train_checkpoint(train, val, recipe, home / "ckpt" / out.stem, data_hash=f"curve-m{m}")
    train_s = time.perf_counter() - t0
    fit = json.loads((ckpt / METRICS_FILE).read_text(encoding="utf-8"))["train"]
    model = DecisionModel.load(ckpt)
    metrics = score(home, out.stem, predictions_table(model.predict(questions_from_table(test))))
    train_q = questions_from_table(train)[:1000]  # capacity: does it fit (a sample of) its own train?
    train_acc: dict[str, list[int]] = defaultdict(list)
    lexical, model.lexical = model.lexical, None  # the head alone: the hybrid's TF-IDF part memorises train
    train_pred = model.predict(train_q)
    model.lexical = lexical
    for q, p in zip(train_q, train_pred):
        if q.soft_label is None and q.label is not None:
            train_acc[q.family].append(int(int(np.argmax(p.probs)) == q.label))
    flops = train_flops_per_example(model.model, train_q, recipe.frozen_layers)
    ex_s = recipe.batch_size * recipe.grad_accum / fit["seconds_per_step"]
    peak = peaks["bf16" if recipe.precision == "bf16" else "fp32"]
    result = {"m": m, "steps": steps, "seed": seed, "train_users": BASE_TRAIN_USERS * m,
              "train_questions": train.num_rows, "precision": recipe.precision,
              "examples_seen": steps * recipe.batch_size * recipe.grad_accum,
              "metrics": metrics, "train_s": train_s, "trainer_s": fit["seconds"],
              "feature_pass": fit.get("feature_pass"), "s_per_step": fit["seconds_per_step"],
              "gflop_per_example": flops / 1e9, "mfu": flops * ex_s / peak, "mfu_peak": recipe.precision,
              "train_acc": {f: float(np.mean(v)) for f, v in train_acc.items()}}
    dev = snap.table("dev")  # the diagnosis's split: open labels, users no point trains on
    atomic_write_parquet(home / "predictions" / f"{out.stem}-dev.parquet",
                         predictions_table(model.predict(questions_from_table(dev))), overwrite=True)
    if m == max(meta.get("plan_multipliers", [m])) and seed == 0:
        result["whole"] = read_whole(model, dev, dev_labels(home))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    import shutil

    shutil.rmtree(ckpt, ignore_errors=True)  # the predictions stay; checkpoints of a curve are not kept
    return result


def read_whole(model: DecisionModel, dev, labels: dict) -> dict:  # noqa: ANN001
    """The truncated dev questions read whole (max_length 512) by the same checkpoint: right or not, per question."""
    qs = questions_from_table(dev)
    encoded = model.model.encode_many(qs)
    cut = [q for q, e in zip(qs, encoded) if e.truncated]
    saved = model.model.max_length
    model.model.max_length = 512
    try:
        preds = model.predict(cut)
    finally:
        model.model.max_length = saved
    return {q.key: int(int(np.argmax(p.probs)) == labels[(q.record_id, q.question_id)][0]) for q, p in zip(cut, preds)}


def tfidf_point(home: Path, meta: dict, m: int) -> dict:
    out = home / "points" / f"tfidf-m{m}.json"
    if out.exists():
        return json.loads(out.read_text())
    snap = open_task(TASK, home=home)
    train = rows_of_users(snap.table("train"), set(meta["train_users"][: BASE_TRAIN_USERS * m]))
    val = rows_of_users(snap.table("val"), set(meta["val_users"]))
    model = TfidfBaseline().fit(train, val)
    result = {"m": m, "metrics": score(home, f"tfidf-m{m}", model.predict_table(snap.table("test")))}
    atomic_write_parquet(home / "predictions" / f"tfidf-m{m}-dev.parquet", model.predict_table(snap.table("dev")),
                         overwrite=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    return result


# --------------------------------------------------------------------------- the diagnosis


def dev_labels(home: Path) -> dict[tuple[str, str], tuple[int | None, list | None]]:
    """The dev split's labels (an open split: the snapshot gives them to training-side code)."""
    t = open_task(TASK, home=home).labels("dev")
    return {(r, q): (lab, soft) for r, q, lab, soft in zip(t.column("record_id").to_pylist(), t.column("question_id").to_pylist(),
                                                          t.column("label").to_pylist(), t.column("soft_label").to_pylist())}


def correctness(home: Path, name: str, dev) -> np.ndarray:  # noqa: ANN001
    import pyarrow.parquet as pq

    pred = pq.read_table(home / "predictions" / f"{name}-dev.parquet")
    key = {(r, q): i for i, (r, q) in enumerate(zip(pred.column("record_id").to_pylist(),
                                                     pred.column("question_id").to_pylist()))}
    probs = pred.column("probs").to_pylist()
    labels = dev_labels(home)
    out = []
    for q in questions_from_table(dev):
        out.append(int(np.argmax(probs[key[(q.record_id, q.question_id)]])) == labels[(q.record_id, q.question_id)][0])
    return np.asarray(out, dtype=float)


def clustered(values: dict[str, np.ndarray], groups: np.ndarray, mask: np.ndarray, n_boot: int = 2000) -> dict:
    """Mean of each array over ``mask`` with a user-clustered bootstrap 95% CI (the same resamples for all)."""
    users, inv = np.unique(groups[mask], return_inverse=True)
    rng = np.random.default_rng(0)
    weights = rng.multinomial(len(users), np.full(len(users), 1 / len(users)), size=n_boot)  # (B, U)
    n_per = np.bincount(inv, minlength=len(users))
    out = {}
    for name, v in values.items():
        s_per = np.bincount(inv, weights=v[mask], minlength=len(users))
        boot = (weights @ s_per) / np.maximum(weights @ n_per, 1)
        out[name] = (float(v[mask].mean()), float(np.quantile(boot, 0.025)), float(np.quantile(boot, 0.975)))
    return out


def diagnose(home: Path, points: list[dict], tfidf: dict) -> None:
    snap = open_task(TASK, home=home)
    dev = snap.table("dev")
    qs = questions_from_table(dev)
    records = json.loads((home / "records_meta.json").read_text())
    groups = np.asarray(dev.column("group").to_pylist())
    families = np.asarray([q.family for q in qs])
    labels = dev_labels(home)
    hard = np.asarray([labels[(q.record_id, q.question_id)][1] is None for q in qs])
    chance = np.asarray([1.0 / q.n_options for q in qs])
    m, steps = points[0]["m"], points[0]["steps"]
    model_c = np.mean([correctness(home, f"m{m}-s{steps}-seed{p['seed']}", dev) for p in points], axis=0)
    tfidf_c = correctness(home, f"tfidf-m{m}", dev)
    whole = points[0].get("whole") or {}
    seed0 = correctness(home, f"m{m}-s{steps}-seed0", dev)
    print(f"\ndiagnosis: m={m} ({points[0]['train_users']} train users, {points[0]['train_questions']} questions), "
          f"{steps} steps, seeds {[p['seed'] for p in points]} pooled; dev split {len(qs)} questions of "
          f"{len(set(groups))} users no point trains on, "
          f"user-clustered bootstrap 95% CIs")
    print(f"{'family':<20}{'n':>6}{'accuracy':>24}{'- chance':>24}{'- TF-IDF (paired)':>24}{'cut':>7}"
          f"{'cut: 256->512':>15}{'train acc':>10}")
    for fam in sorted(set(families)):
        mask = families == fam
        ci = clustered({"acc": model_c, "vs_chance": model_c - chance, "vs_tfidf": model_c - tfidf_c}, groups, mask)
        cut_keys = [q.key for q, f in zip(qs, families) if f == fam and q.key in whole]
        cut_idx = [i for i, q in enumerate(qs) if families[i] == fam and q.key in whole]
        cut_share = len(cut_idx) / mask.sum()
        cut_line = (f"{seed0[cut_idx].mean():.2f}->{np.mean([whole[k] for k in cut_keys]):.2f}" if cut_idx else "-")
        train_acc = np.mean([p["train_acc"].get(fam, np.nan) for p in points])
        cells = "".join(f"{v:+.3f} [{lo:+.3f},{hi:+.3f}]".rjust(24) for v, lo, hi in ci.values())
        print(f"{fam:<20}{mask.sum():>6}{cells}{cut_share:>7.1%}{cut_line:>15}{train_acc:>10.3f}")
    print("\naccuracy by evidence variant (removed = soft label; buried = the deciding fact in the state's middle) "
          "and by the record's rule kind (the primary question's rule; other families are its secondary questions)")
    variants = np.asarray([records[q.record_id]["variant"] for q in qs])
    kinds = np.asarray([records[q.record_id]["rule_kind"] for q in qs])
    for fam in sorted(set(families)):
        parts = []
        for v in ("clean", "override", "removed", "buried"):
            mask = (families == fam) & (variants == v)
            if mask.any():
                parts.append(f"{v} {model_c[mask].mean():.2f} (n={mask.sum()})")
        primary_kinds = sorted(set(kinds[families == fam]))
        kparts = [f"{k} {model_c[(families == fam) & (kinds == k)].mean():.2f}" for k in primary_kinds
                  if ((families == fam) & (kinds == k)).sum() >= 30]
        print(f"  {fam:<20}" + "; ".join(parts) + "  | rule kind: " + "; ".join(kparts))
    print(f"  hard labels: {hard.mean():.1%} of the dev split; soft (removed) questions are scored on their argmax")


# --------------------------------------------------------------------------- the table


def print_curve(points: list[dict], tfidf: dict[int, dict]) -> None:
    fams = sorted({k.split("/", 1)[1] for p in points for k in p["metrics"] if k.startswith("acc/")})
    print(f"\n{'m':>3}{'users':>6}{'train q':>8}{'steps':>6}{'seed':>5}{'epochs':>7}{'macro':>7}{'cov@5%':>7}"
          f"{'FNR appr':>9}" + "".join(f"{f[:11]:>12}" for f in fams) + f"{'train s':>8}{'s/step':>7}{'MFU':>6}")
    for p in sorted(points, key=lambda p: (p["steps"], p["m"], p["seed"])):
        mt = p["metrics"]
        print(f"{p['m']:>3}{p['train_users']:>6}{p['train_questions']:>8}{p['steps']:>6}{p['seed']:>5}"
              f"{p['examples_seen'] / p['train_questions']:>7.1f}{mt['family_macro_accuracy']:>7.3f}"
              f"{mt.get('coverage_at_5pct') or 0:>7.3f}{mt.get('fnr/needs_approval', float('nan')):>9.3f}"
              + "".join(f"{mt.get('acc/' + f, float('nan')):>12.3f}" for f in fams)
              + f"{p['train_s']:>8.0f}{p['s_per_step']:>7.2f}{p['mfu']:>6.1%}")
    for m, t in sorted(tfidf.items()):
        mt = t["metrics"]
        print(f"{m:>3}{'TF-IDF + LR':>35}{mt['family_macro_accuracy']:>7.3f}{mt.get('coverage_at_5pct') or 0:>7.3f}"
              f"{mt.get('fnr/needs_approval', float('nan')):>9.3f}" + "".join(f"{mt.get('acc/' + f, float('nan')):>12.3f}"
                                                                      for f in fams))
    print("(macro: family-macro accuracy; cov@5%: coverage at the 5% error budget; FNR appr: needs_approval's "
          "false-negative rate at the automation threshold; MFU against the measured matmul peak of the "
          "point's precision)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--home", type=Path, default=Path(".bench/learning-curve"))
    parser.add_argument("--multipliers", default="1,4,16")
    parser.add_argument("--steps", default="300,1200")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--order", choices=("steps-first", "data-first"), default="data-first",
                        help="data-first: every m at the largest steps first (seed 0, then seed 1), then the rest")
    add_recipe_override_argument(parser, default=list(DEFAULT_OVERRIDES))
    parser.add_argument("--report-only", action="store_true", help="print what is in --home, train nothing")
    args = parser.parse_args()
    configure_command_line()
    home = args.home.resolve()
    home.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("ENVLOOP_FEATURE_CACHE", str(home / "features"))
    mults = [int(x) for x in args.multipliers.split(",")]
    steps = [int(x) for x in args.steps.split(",")]
    seeds = [int(x) for x in args.seeds.split(",")]
    if max(mults) > MAX_MULT:
        raise SystemExit(f"--multipliers: at most {MAX_MULT} (the benchmark's train split holds {BASE_TRAIN_USERS * MAX_MULT} users)")
    overrides = parse_recipe_overrides(tuple(args.override))
    plan = {"multipliers": mults, "steps": steps, "seeds": seeds, "overrides": overrides,
            "recipe": DEFAULT_RECIPE}
    plan_path = home / "plan.json"
    if plan_path.exists() and json.loads(plan_path.read_text()) != json.loads(json.dumps(plan)):
        raise SystemExit(f"{plan_path}: another plan is registered there ({plan_path.read_text().strip()}); "
                         "use another --home")
    plan_path.write_text(json.dumps(plan, indent=1))  # registered before the first point trains
    meta = prepare(home)
    meta["plan_multipliers"] = mults
    print(f"benchmark: {meta['n_users']} users; train users by point: {[BASE_TRAIN_USERS * m for m in mults]}; "
          f"val {VAL_USERS} users; wide test {meta['test_questions']} questions of {meta['test_users']} unseen users "
          f"(contamination: {meta['contamination']}); recipe {DEFAULT_RECIPE} + {overrides}")
    peaks = {"fp32": matmul_peak(), "bf16": bf16_matmul_peak()}
    print(f"matmul peak measured here: fp32 {peaks['fp32'] / 1e9:.0f} GFLOP/s, bf16 {peaks['bf16'] / 1e9:.0f} GFLOP/s")
    top = max(steps)
    order = ([(m, top, s) for s in seeds for m in mults] + [(m, st, s) for st in steps if st != top for s in seeds for m in mults]
             if args.order == "data-first" else [(m, st, s) for st in sorted(steps) for s in seeds for m in mults])
    tfidf = {m: tfidf_point(home, meta, m) for m in mults}
    points = []
    for m, st, s in order:
        path = home / "points" / f"m{m}-s{st}-seed{s}.json"
        if args.report_only and not path.exists():
            continue
        p = run_point(home, meta, m, st, s, overrides, peaks)
        points.append(p)
        log(f"m={m} steps={st} seed={s}: family-macro {p['metrics']['family_macro_accuracy']:.4f}, coverage at 5% "
            f"{p['metrics'].get('coverage_at_5pct') or 0:.3f}, {p['train_s']:.0f} s")
    if points:
        print_curve(points, tfidf)
        best_m = max(p["m"] for p in points if p["steps"] == top) if any(p["steps"] == top for p in points) else None
        at = [p for p in points if p["m"] == best_m and p["steps"] == top]
        if at and at[0].get("whole") is not None:
            diagnose(home, sorted(at, key=lambda p: p["seed"]), tfidf)


if __name__ == "__main__":
    from envloop_pipelines.console import quiet_third_party

    quiet_third_party()
    main()
