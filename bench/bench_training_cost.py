"""Training cost per example: the CPU recipe as shipped vs frozen lower layers + length grouping, in one run.

    .venv/bin/python bench/bench_training_cost.py [--questions 320] [--steps 12] [--epochs 4] [--frozen 5]

Both arms train the same questions of the built-in benchmark (its train split, first
``--questions``) for ``--steps`` optimizer steps of the recipe's batch, with the feature
cache empty at the start (its one pass over the inputs is timed apart and charged to the
new arm). Prints per arm: seconds per step, examples/s while training, the examples/s of a
whole ``--epochs``-epoch run with the feature pass amortised over it, model FLOPs and MFU
(model FLOP/s over the fp32 matmul peak measured in the same run), and the ratio new/old.

FLOPs (nanoGPT-style count): a MiniLM layer at L tokens costs ``2·L·P_layer + 4·L²·d``
forward (P_layer ≈ 1.77M weights, d = 384), training ≈ 3× forward. Old arm: every layer
forward and backward. New arm: ``6−K`` layers trained, ``K`` run once per distinct input.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from envloop_pipelines.core.benchmark.builtin_task import generate_builtin_task  # noqa: E402
from envloop_pipelines.core.data.snapshots import open_task  # noqa: E402
from envloop_pipelines.core.model.recipe import DEFAULT_RECIPE, load_recipe  # noqa: E402
from envloop_pipelines.core.model.training import train_checkpoint  # noqa: E402
from envloop_pipelines.core.progress import configure_command_line  # noqa: E402

D, P_LAYER, N_LAYERS = 384, 1_774_464, 6


def layer_flops(tokens: int) -> float:
    return 2.0 * tokens * P_LAYER + 4.0 * tokens * tokens * D


def matmul_peak() -> float:
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    a @ b
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * 2048**3 / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--questions", type=int, default=320)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--frozen", type=int, default=5)
    args = parser.parse_args()
    configure_command_line()  # progress: a bar on a terminal, lines elsewhere (ENVLOOP_PROGRESS)
    root = Path(tempfile.mkdtemp(prefix="bench-cost-"))
    os.environ["ENVLOOP_FEATURE_CACHE"] = str(root / "features")
    generate_builtin_task(task="bench", home=root)
    snap = open_task("bench", home=root)
    train, val = snap.table("train").slice(0, args.questions), snap.table("val").slice(0, 32)
    peak = matmul_peak()
    arms = {"old (shipped CPU recipe)": {},
            f"new (frozen_layers={args.frozen}, length_grouped)": {"frozen_layers": args.frozen, "length_grouped": True}}
    rows = {}
    for name, extra in arms.items():
        recipe = load_recipe(DEFAULT_RECIPE, {"max_steps": args.steps, **extra})
        ckpt = train_checkpoint(train, val, recipe, root / f"ckpt-{len(rows)}", data_hash="bench")
        m = json.loads((ckpt / "metrics.json").read_text())["train"]
        from envloop_pipelines.core.model.readout import as_questions
        from envloop_pipelines.core.model.readouts import build_readout_model

        model = build_readout_model(recipe)
        lengths = [len(e) for e in model.encode_many(as_questions(train))]
        mean_layer = sum(layer_flops(n) for n in lengths) / len(lengths)
        k = recipe.frozen_layers
        step_s = m["seconds_per_step"]
        ex_s = recipe.batch_size / step_s
        train_flops = 3 * mean_layer * (N_LAYERS - k)  # per example per epoch
        feature_s = (m.get("feature_pass") or {}).get("seconds", 0.0)
        n = len(lengths)
        whole = args.epochs * n / (feature_s + args.epochs * n / ex_s)
        rows[name] = {"s_per_step": step_s, "examples_per_s": ex_s, "feature_pass_s": feature_s,
                      "examples_per_s_whole_run": whole, "gflop_per_example": train_flops / 1e9,
                      "mfu": train_flops * ex_s / peak}
    print(f"fp32 matmul peak measured here: {peak / 1e9:.0f} GFLOP/s; {args.questions} questions, {args.steps} steps, "
          f"whole run = {args.epochs} epochs")
    print(f"{'arm':<44}{'s/step':>8}{'ex/s':>8}{'feature s':>10}{'ex/s run':>10}{'GFLOP/ex':>10}{'MFU':>7}")
    for name, r in rows.items():
        print(f"{name:<44}{r['s_per_step']:>8.2f}{r['examples_per_s']:>8.2f}{r['feature_pass_s']:>10.1f}"
              f"{r['examples_per_s_whole_run']:>10.2f}{r['gflop_per_example']:>10.2f}{r['mfu']:>7.1%}")
    old, new = rows.values()
    print(f"ratio new/old: examples/s while training x{new['examples_per_s'] / old['examples_per_s']:.2f}; "
          f"over a whole {args.epochs}-epoch run x{new['examples_per_s_whole_run'] / old['examples_per_s_whole_run']:.2f} "
          f"(target >= 5x)")


if __name__ == "__main__":
    from envloop_pipelines.console import quiet_third_party

    quiet_third_party()  # the bench prints what it measures, not a library's notes on itself
    main()
