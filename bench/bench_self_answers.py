"""The decision model as its own agent (issue 17, item 6): do its verified self-answers help on the wide test?

    .venv/bin/python bench/bench_self_answers.py                     # 240 users, 24-step champion and arms
    .venv/bin/python bench/bench_self_answers.py --users 40 --wide-users 120 --steps 2 --recipe-override max_steps=2  # smoke

In one fresh temporary ``ENVLOOP_HOME``:

1. the built-in benchmark at ``--users`` users, and the wide test of ``bench_model_quality.py`` (the
   unseen test users of the generator at ``--wide-users`` users, imported as its own task);
2. the champion: the default recipe with the overrides (default ``max_steps=24, max_length=256``, the
   demo's budget), trained on train and calibrated on val;
3. its verified self-answers on dev (``verified_self_answers``: an option sampled from the calibrated
   distribution per question, the sandboxed rule verifier keeps the right ones as labelled rows);
4. two continuations from the champion with the same recipe, seed and ``--steps`` optimizer steps:
   ``control`` on train, ``self_answers`` on train + the verified rows. At equal steps the two see the
   same number of examples, so self_answers - control is the effect of the rows at equal compute;
5. champion, control, self_answers and TF-IDF + LR scored on the wide test by the sandboxed verifier,
   and the verifier's paired deltas (record-clustered bootstrap 95% CIs) for self_answers - control
   and self_answers - champion.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import pyarrow as pa  # noqa: E402

from bench_model_quality import paired_line, score, wide_test_task  # noqa: E402
from envloop_pipelines.cli.options import add_recipe_override_argument, parse_recipe_overrides  # noqa: E402
from envloop_pipelines.core.baseline import TfidfBaseline  # noqa: E402
from envloop_pipelines.core.benchmark.builtin_task import generate_builtin_task  # noqa: E402
from envloop_pipelines.core.data.question_table import QUESTION_SCHEMA  # noqa: E402
from envloop_pipelines.core.data.snapshots import open_task  # noqa: E402
from envloop_pipelines.core.decision_loop.self_answers import verified_self_answers  # noqa: E402
from envloop_pipelines.core.model.predict import predict_table  # noqa: E402
from envloop_pipelines.core.model.recipe import DEFAULT_RECIPE, load_recipe  # noqa: E402
from envloop_pipelines.core.model.training import train_checkpoint  # noqa: E402
from envloop_pipelines.core.progress import configure_command_line  # noqa: E402

KEYS = ("family_macro_accuracy", "brier", "ece", "nll")
#: The demo's budget (bench_aa.py, the loop's demo): 24 optimizer steps at 256 tokens.
DEFAULT_OVERRIDES = ["max_steps=24", "max_length=256"]


def table_sha256(table: pa.Table) -> str:
    """sha256 of a table's Arrow IPC stream: the data hash of a training set built here."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return hashlib.sha256(sink.getvalue().to_pybytes()).hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--users", type=int, default=240, help="built-in benchmark users")
    parser.add_argument("--wide-users", type=int, default=1920,
                        help="users of the generator whose unseen test users form the wide test")
    parser.add_argument("--recipe", default=DEFAULT_RECIPE)
    add_recipe_override_argument(parser, help=f"recipe override KEY=VALUE, repeatable "
                                              f"(default: {' '.join(DEFAULT_OVERRIDES)})")
    parser.add_argument("--steps", type=int, default=24, help="optimizer steps of each continuation (both arms)")
    parser.add_argument("--seed", type=int, default=0, help="the self-answers' sampling seed")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args()
    configure_command_line()  # progress: a bar on a terminal, lines elsewhere (ENVLOOP_PROGRESS)
    if args.steps < 1:
        raise SystemExit(f"--steps must be >= 1, got {args.steps}")

    home = Path(tempfile.mkdtemp(prefix="bench-self-answers-"))
    os.environ["ENVLOOP_HOME"] = str(home)  # the sandboxed verifier's workers resolve the same home
    timings: dict[str, float] = {}

    t0 = time.perf_counter()
    gen = generate_builtin_task(task="personal_agent", n_users=args.users, home=home)
    snapshot = open_task("personal_agent", home=home)
    train, val, dev = snapshot.table("train"), snapshot.table("val"), snapshot.table("dev")
    wide = wide_test_task(home, snapshot, args.users, args.wide_users)
    wide_test = open_task(wide, home=home).table("test")
    timings["data"] = time.perf_counter() - t0
    print(f"benchmark {snapshot.benchmark_version} ({gen['records']} records): train={train.num_rows} "
          f"val={val.num_rows} dev={dev.num_rows} questions; wide test: {wide_test.num_rows} questions of users "
          f"unseen in training (generator at {args.wide_users} users)  [{timings['data']:.0f}s]", flush=True)

    overrides = parse_recipe_overrides(tuple(DEFAULT_OVERRIDES if args.override is None else args.override))
    recipe = load_recipe(args.recipe, overrides)
    arm_recipe = recipe.replace(max_steps=args.steps)
    print(f"recipe: {args.recipe} {overrides} (seed {recipe.seed}); continuations: max_steps={args.steps}", flush=True)

    t0 = time.perf_counter()
    champion = train_checkpoint(train, val, recipe, home / "champion", data_hash=snapshot.snapshot_id)
    timings["train champion"] = time.perf_counter() - t0
    print(f"champion trained  [{timings['train champion']:.0f}s]", flush=True)

    t0 = time.perf_counter()
    rows, stats = verified_self_answers(champion, snapshot, split="dev", seed=args.seed, home=home)
    timings["self-answers"] = time.perf_counter() - t0
    print(f"self-answers on dev (seed {args.seed}): {stats.n_questions} questions, {stats.n_passed} passed "
          f"({stats.n_soft_skipped} soft-labelled skipped), pass rate {stats.pass_rate:.4f}, mean sampled "
          f"probability {stats.mean_sampled_probability:.4f}  [{timings['self-answers']:.0f}s]", flush=True)

    # The trainer reads QUESTION_SCHEMA; the rows' provenance column stays here (it is in the stats above).
    base = train.select(QUESTION_SCHEMA.names).cast(QUESTION_SCHEMA)
    augmented = pa.concat_tables([base, rows.drop_columns(["provenance"]).cast(QUESTION_SCHEMA)])
    arms = {"control": (base, snapshot.snapshot_id), "self_answers": (augmented, table_sha256(augmented))}
    checkpoints = {"champion": champion}
    for name, (table, data_hash) in arms.items():
        t0 = time.perf_counter()
        checkpoints[name] = train_checkpoint(table, val, arm_recipe, home / name, data_hash=data_hash,
                                             init_from=champion)
        timings[f"train {name}"] = time.perf_counter() - t0
        print(f"arm {name}: {table.num_rows} training rows, {args.steps} steps from the champion  "
              f"[{timings[f'train {name}']:.0f}s]", flush=True)

    results: dict[str, dict] = {}
    t0 = time.perf_counter()
    tfidf = TfidfBaseline().fit(train, val)
    results["tfidf_lr"] = score(wide, home, "tfidf", tfidf.predict_table(wide_test))
    timings["score tfidf_lr"] = time.perf_counter() - t0
    for name, ckpt in checkpoints.items():
        t0 = time.perf_counter()
        results[name] = score(wide, home, name, predict_table(ckpt, wide_test))
        timings[f"score {name}"] = time.perf_counter() - t0
        print(f"scored {name} on the wide test  [{timings[f'score {name}']:.0f}s]", flush=True)

    print(f"\nwide test (unseen users): {wide_test.num_rows} questions")
    print(f"{'model':<16}" + "".join(f"{k:>24}" for k in KEYS))
    for name in ("champion", "control", "self_answers", "tfidf_lr"):
        print(f"{name:<16}" + "".join(f"{results[name].get(k, float('nan')):>24.4f}" for k in KEYS))

    t0 = time.perf_counter()
    paired = {}
    for cand, base_name in (("self_answers", "control"), ("self_answers", "champion")):
        p = paired_line(wide, home, cand, base_name, f"{cand} - {base_name}", KEYS)
        if p is None:
            raise SystemExit(f"the verifier's paired comparison {cand} - {base_name} failed")
        paired[f"{cand}-{base_name}"] = p
    timings["paired"] = time.perf_counter() - t0
    d = paired["self_answers-control"]["deltas"]["family_macro_accuracy"]
    excludes = d["ci_low"] > 0 or d["ci_high"] < 0
    print(f"self_answers - control, family_macro_accuracy {d['delta']:+.4f} [{d['ci_low']:+.4f}, {d['ci_high']:+.4f}]: "
          + ("the CI excludes zero: the self-answers " + ("help" if d["ci_low"] > 0 else "hurt")
             if excludes else "the CI includes zero: no detectable effect of the self-answers at equal compute"))
    print("\nwall times: " + ", ".join(f"{k} {v:.0f}s" for k, v in timings.items())
          + f"; total {sum(timings.values()):.0f}s")
    if args.out:
        args.out.write_text(json.dumps({"results": results, "paired": paired, "self_answers": stats.to_dict(),
                                        "timings": timings}, indent=2))


if __name__ == "__main__":
    from envloop_pipelines.console import quiet_third_party

    quiet_third_party()  # the bench prints what it measures, not a library's notes on itself
    main()
