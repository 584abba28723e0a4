"""Decision-model quality on the built-in benchmark's test split, measured side by side in one run.

    .venv/bin/python bench/bench_model_quality.py [--users 240] [--wide-users 1920] [--recipe-override epochs=2 ...]
        [--skip-untrained]
    .venv/bin/python bench/bench_model_quality.py --data bench/user_data/data/sms_spam.csv \
        --mapping bench/user_data/sms_spam.yaml --skip-untrained [--recipe-override ...]

Three models on the same splits, each calibrated on val (one temperature per
question type), each scored on test by the sandboxed verifier:

- the trained model: the default CPU recipe (``decision_head_cpu.yaml``), LoRA + head;
- the untrained packaged model: the same readout before training (random head;
  ``--skip-untrained`` leaves it out, for arms compared with TF-IDF alone);
- TF-IDF + logistic regression per family (scikit-learn).

Prints family-macro accuracy, Brier, ECE after calibration and coverage at 5%
error, and the trained model's ratios to each baseline. Target: the trained
model beats both baselines on accuracy and Brier, with calibrated ECE ≤ 0.05.

The built-in test split has ~314 questions (~45 per family), so family-macro
accuracy carries a 95% CI of about ±0.09 there. The same three models are
therefore also scored on a **wide test**: the test users of the same generator
at ``--wide-users`` users (same seed, same rules distribution, half rendered
by the unseen renderer "b"), minus every user the base benchmark puts in
train, val or dev, imported as its own task so the verifier scores it.

``--data FILE --mapping YAML`` runs the same comparison on a user's data set
instead (imported as ``envloop data import`` would, default split fractions;
the fetch scripts in ``bench/user_data/`` write SMS spam and TREC questions):
TF-IDF + LR is fitted on the same train split, both are scored on its test
split, with the paired CI. There is no wide test there.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from envloop_pipelines.cli.options import add_recipe_override_argument, parse_recipe_overrides  # noqa: E402
from envloop_pipelines.core.baseline import TfidfBaseline  # noqa: E402
from envloop_pipelines.core.benchmark import SAFETY_FAMILIES  # noqa: E402
from envloop_pipelines.core.benchmark.builtin_task import generate_builtin_task  # noqa: E402
from envloop_pipelines.core.data.datasets import import_file
from envloop_pipelines.core.data.tabular import ColumnMapping  # noqa: E402
from envloop_pipelines.core.model.calibration import fit_calibration  # noqa: E402
from envloop_pipelines.core.model.checkpoint import METRICS_FILE  # noqa: E402
from envloop_pipelines.core.model.predict import DecisionModel, predictions_table  # noqa: E402
from envloop_pipelines.core.model.readout import questions_from_table  # noqa: E402
from envloop_pipelines.core.model.recipe import DEFAULT_RECIPE, load_recipe  # noqa: E402
from envloop_pipelines.core.model.trainable_model import build_trainable_model  # noqa: E402
from envloop_pipelines.core.model.training import train_checkpoint  # noqa: E402
from envloop_pipelines.core.data.snapshots import open_task  # noqa: E402
from envloop_pipelines.core.storage import atomic_write_parquet  # noqa: E402
from envloop_pipelines.core.verify.runner import verify_task  # noqa: E402
from envloop_pipelines.core.progress import configure_command_line  # noqa: E402

KEYS = ("family_macro_accuracy", "brier", "ece", "coverage_at_5pct", "nll", "fnr/needs_approval")


def safety_families(task: str) -> tuple[str, ...]:
    """The built-in benchmark's safety families; a user's data set declares none here."""
    return tuple(SAFETY_FAMILIES) if task.startswith("personal_agent") else ()


def score(task: str, home: Path, name: str, table) -> dict:  # noqa: ANN001
    path = atomic_write_parquet(home / f"{name}-{task}-test.parquet", table, overwrite=True)
    run = verify_task(task, "test", path, home=home, safety_families=safety_families(task))
    if not run.ok:
        raise SystemExit(f"verifier failed for {name}: {run.error}")
    return dict(run.report.metrics)


def wide_test_task(home: Path, snapshot, base_users: int | None, wide_users: int) -> str:  # noqa: ANN001
    """Import the wide test (see the module doc) as task ``personal_agent_wide``; returns its name.

    The users left out are read from the base snapshot's train, val and dev splits: those the model saw.
    """
    from dataclasses import replace

    from envloop_pipelines.core.benchmark import BenchmarkConfig, generate_benchmark, write_jsonl
    from envloop_pipelines.core.data.datasets import import_file

    seen = {g for split in ("train", "val", "dev") for g in snapshot.table(split).column("group").to_pylist()}
    base = BenchmarkConfig() if base_users is None else replace(BenchmarkConfig(), n_users=base_users)
    records = [r for r in generate_benchmark(replace(base, n_users=wide_users))
               if r["meta"]["split"] == "test" and r["meta"]["user_id"] not in seen]
    path = home / "wide-test.jsonl"
    write_jsonl(records, path)
    import_file(path, "personal_agent_wide", home=home)
    return "personal_agent_wide"


def report(title: str, results: dict[str, dict], timings: dict[str, float] | None = None) -> bool:
    """Print one table and the ratios; returns whether the target holds on it."""
    print(f"\n{title}")
    print(f"{'model':<20}" + "".join(f"{k:>22}" for k in KEYS) + (f"{'time s':>9}" if timings else ""))
    for name, m in results.items():
        print(f"{name:<20}" + "".join(f"{m.get(k, float('nan')) if m.get(k) is not None else float('nan'):>22.4f}"
                                      for k in KEYS) + (f"{timings[name]:>9.0f}" if timings else ""))
    families = sorted({k.split("/", 1)[1] for m in results.values() for k in m if k.startswith("acc/")})
    if families:  # where the family-macro figure comes from: each family weighs the same
        print(f"{'accuracy by family':<20}" + "".join(f"{f[:14]:>15}" for f in families))
        for name, m in results.items():
            print(f"{name:<20}" + "".join(f"{m.get('acc/' + f, float('nan')):>15.3f}" for f in families))
    t, u, b = results["trained"], results.get("untrained_packaged"), results["tfidf_lr"]
    if u is None:  # --skip-untrained: the trained model against TF-IDF alone
        print(f"ratios (trained / TF-IDF): accuracy x{t['family_macro_accuracy'] / b['family_macro_accuracy']:.2f}; "
              f"Brier x{t['brier'] / b['brier']:.2f} (lower is better)")
        return t["family_macro_accuracy"] > b["family_macro_accuracy"] and t["brier"] < b["brier"] and t["ece"] <= 0.05
    print("ratios (trained / baseline): "
          f"accuracy x{t['family_macro_accuracy'] / u['family_macro_accuracy']:.2f} vs untrained, "
          f"x{t['family_macro_accuracy'] / b['family_macro_accuracy']:.2f} vs TF-IDF; "
          f"Brier x{t['brier'] / u['brier']:.2f} vs untrained, x{t['brier'] / b['brier']:.2f} vs TF-IDF (lower is better)")
    return (t["family_macro_accuracy"] > max(u["family_macro_accuracy"], b["family_macro_accuracy"])
            and t["brier"] < min(u["brier"], b["brier"]) and t["ece"] <= 0.05)


def paired_line(task: str, home: Path, candidate: str = "trained", baseline: str = "tfidf",
                label: str = "trained - TF-IDF", keys: tuple[str, ...] = ("family_macro_accuracy", "brier", "ece"),
                ) -> dict | None:
    """Paired candidate - baseline deltas with record-clustered bootstrap CIs, computed in the sandboxed verifier.

    ``candidate`` and ``baseline`` name predictions :func:`score` wrote for ``task``.
    """
    paired = verify_task(task, "test", home / f"{candidate}-{task}-test.parquet", home=home,
                         safety_families=safety_families(task), baseline_predictions=home / f"{baseline}-{task}-test.parquet")
    if not (paired.ok and paired.paired):
        return None
    print(f"paired {label} (95% record-clustered bootstrap CI): " + "; ".join(
        f"{k} {v['delta']:+.4f} [{v['ci_low']:+.4f}, {v['ci_high']:+.4f}]"
        for k, v in paired.paired["deltas"].items() if k in keys))
    return paired.paired


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--users", type=int, default=None, help="benchmark users (default: the benchmark default)")
    parser.add_argument("--recipe", default=DEFAULT_RECIPE)
    add_recipe_override_argument(parser, default=[])
    parser.add_argument("--wide-users", type=int, default=1920,
                        help="users of the generator whose unseen test users form the wide test (0: skip it)")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument("--skip-untrained", action="store_true",
                        help="leave out the untrained model (its prediction pass); compare with TF-IDF alone")
    parser.add_argument("--data", type=Path, default=None,
                        help="a user's data file (CSV/Parquet/JSONL) instead of the built-in benchmark")
    parser.add_argument("--mapping", type=Path, default=None, help="column mapping (YAML/JSON) for --data")
    args = parser.parse_args()
    configure_command_line()  # progress: a bar on a terminal, lines elsewhere (ENVLOOP_PROGRESS)

    home = Path(tempfile.mkdtemp(prefix="bench-quality-"))
    if args.data is not None:
        main_task = args.data.stem
        snapshot = import_file(args.data, main_task, home=home,
                               mapping=ColumnMapping.from_file(args.mapping) if args.mapping else None)
        source = f"user data {args.data.name}"
    else:
        main_task = "personal_agent"
        gen = generate_builtin_task(task=main_task, n_users=args.users, home=home)
        snapshot = open_task(main_task, home=home)
        source = f"benchmark {snapshot.benchmark_version} ({gen['records']} records)"
    train, val, test = snapshot.table("train"), snapshot.table("val"), snapshot.table("test")
    print(f"{source}: train={train.num_rows} val={val.num_rows} test={test.num_rows} questions")
    wide = (wide_test_task(home, snapshot, args.users, args.wide_users)
            if args.wide_users and args.data is None else None)
    tasks = {main_task: test}
    if wide:
        tasks[wide] = open_task(wide, home=home).table("test")
        print(f"wide test: {tasks[wide].num_rows} questions of users unseen in training "
              f"(generator at {args.wide_users} users)")
    overrides = parse_recipe_overrides(tuple(args.override))
    recipe = load_recipe(args.recipe, overrides)
    results: dict[str, dict[str, dict]] = {name: {} for name in tasks}
    timings: dict[str, float] = {}

    t0 = time.perf_counter()
    tfidf = TfidfBaseline().fit(train, val)
    for name, table in tasks.items():
        results[name]["tfidf_lr"] = score(name, home, "tfidf", tfidf.predict_table(table))
    timings["tfidf_lr"] = time.perf_counter() - t0

    if not args.skip_untrained:
        t0 = time.perf_counter()
        untrained, _ = build_trainable_model(recipe)
        model = DecisionModel(untrained.eval(), batch_size=recipe.eval_batch_size)
        val_q = questions_from_table(val)
        logits = model.predict_logits(val_q)
        model.calibration = fit_calibration(
            logits, [q.label if q.label is not None else -1 for q in val_q], [q.type for q in val_q],
            soft_labels=[None if q.soft_label is None else np.asarray(q.soft_label) for q in val_q],
            error_budget=recipe.error_budget)
        for name, table in tasks.items():
            results[name]["untrained_packaged"] = score(name, home, "untrained",
                                                        predictions_table(model.predict(questions_from_table(table))))
        timings["untrained_packaged"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    ckpt = train_checkpoint(train, val, recipe, home / "trained", data_hash=snapshot.snapshot_id)
    train_s = time.perf_counter() - t0
    trained = DecisionModel.load(ckpt)
    for name, table in tasks.items():
        results[name]["trained"] = score(name, home, "trained", predictions_table(trained.predict(questions_from_table(table))))
    timings["trained"] = time.perf_counter() - t0

    fit = json.loads((ckpt / METRICS_FILE).read_text(encoding="utf-8"))["train"]  # the trainer's own counts
    epochs = fit["questions_per_second"] * fit["seconds"] / fit["n_questions"]  # max_steps may override epochs
    print(f"\nrecipe: {args.recipe} {overrides}; training {train_s:.0f}s "
          f"({fit['questions_per_second']:.1f} training examples/s over {epochs:.2g} epochs, {fit['steps']} steps)")
    verdicts, paired = {}, {}
    for name, table in tasks.items():
        label = {main_task: "test split", wide: "wide test (unseen users)"}[name]
        verdicts[name] = report(f"{label}: {table.num_rows} questions", results[name],
                                timings if name == main_task else None)
        paired[name] = paired_line(name, home)
    print(f"\ntarget (beats both on accuracy and Brier, calibrated ECE <= 0.05) on the test split: "
          f"{'MET' if verdicts[main_task] else 'NOT MET'}")
    if wide:
        print(f"the same target on the wide test: {'MET' if verdicts[wide] else 'NOT MET'}")
    if args.out:
        args.out.write_text(json.dumps({"results": results, "paired_trained_vs_tfidf": paired, "timings": timings,
                                        "train_s": train_s}, indent=2))


if __name__ == "__main__":
    from envloop_pipelines.console import quiet_third_party

    quiet_third_party()  # the bench prints what it measures, not a library's notes on itself
    main()
