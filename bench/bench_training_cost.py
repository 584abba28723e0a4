"""Training cost per example of the CPU recipe: fp32 as shipped vs bf16 autocast vs bf16 without dropout, in one run.

    .venv/bin/python bench/bench_training_cost.py [--questions 320] [--steps 12] [--epochs 4]
        [--arm NAME=OVERRIDE[;OVERRIDE...] ...]

Every arm trains the same questions of the built-in benchmark (its train split, first
``--questions``) for ``--steps`` optimizer steps of the recipe's batch. The feature cache (the
frozen lower layers, fp32 whatever the precision) is empty at the start: the first arm pays its one
pass over the inputs, timed apart; the others find it. Prints per arm: seconds per step, examples/s
while training, the examples/s of a whole ``--epochs``-epoch run with the feature pass amortised over
it, model FLOPs and MFU against the matmul peak of the arm's precision (fp32 and bf16 peaks measured in
the same run), and each arm's ratio to the first.

Default arms: the shipped recipe (fp32); ``precision=bf16`` (bf16 autocast on this CPU's
``avx512_bf16`` units); bf16 with ``encoder_dropout=0`` and ``lora.dropout=0`` (the dropout masks are
~17% of a step here). Accuracy at each setting: ``bench_learning_curve.py`` (its points train bf16
without dropout; ``--recipe-override`` gives the fp32 arm).

FLOPs (nanoGPT-style count): a MiniLM layer at L tokens costs ``2·L·P_layer + 4·L²·d``
forward (P_layer ≈ 1.77M weights, d = 384), training ≈ 3× forward, on the ``6−K`` layers above the
``K`` frozen ones.
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


def matmul_peak(dtype: torch.dtype = torch.float32) -> float:
    """FLOP/s of a 2048² matrix product in ``dtype``, best of 5 (the MFU denominator)."""
    a, b = torch.randn(2048, 2048, dtype=dtype), torch.randn(2048, 2048, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * 2048**3 / best


def bf16_matmul_peak() -> float:
    return matmul_peak(torch.bfloat16)


DEFAULT_ARMS = ("shipped (fp32)=", "bf16=precision=bf16",
                "bf16, dropout 0=precision=bf16;encoder_dropout=0;lora={dropout: 0}")


def parse_arm(text: str) -> tuple[str, dict]:
    from envloop_pipelines.cli.options import parse_recipe_overrides

    name, _, overrides = text.partition("=")
    return name, parse_recipe_overrides(tuple(o for o in overrides.split(";") if o))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--questions", type=int, default=320)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--arm", action="append", default=None,
                        help="NAME=OVERRIDE[;OVERRIDE...] (recipe overrides as --recipe-override takes them); repeatable")
    args = parser.parse_args()
    configure_command_line()  # progress: a bar on a terminal, lines elsewhere (ENVLOOP_PROGRESS)
    root = Path(tempfile.mkdtemp(prefix="bench-cost-"))
    os.environ["ENVLOOP_FEATURE_CACHE"] = str(root / "features")
    generate_builtin_task(task="bench", home=root)
    snap = open_task("bench", home=root)
    train, val = snap.table("train").slice(0, args.questions), snap.table("val").slice(0, 32)
    peaks = {"fp32": matmul_peak(), "bf16": bf16_matmul_peak()}
    from envloop_pipelines.core.model.readout import as_questions
    from envloop_pipelines.core.model.readouts import build_readout_model

    rows = {}
    for name, extra in (parse_arm(a) for a in (args.arm or DEFAULT_ARMS)):
        recipe = load_recipe(DEFAULT_RECIPE, {"max_steps": args.steps, **extra})
        ckpt = train_checkpoint(train, val, recipe, root / f"ckpt-{len(rows)}", data_hash="bench")
        m = json.loads((ckpt / "metrics.json").read_text())["train"]
        lengths = [len(e.input_ids) for e in build_readout_model(recipe).encode_many(as_questions(train))]
        mean_layer = sum(layer_flops(n) for n in lengths) / len(lengths)
        step_s = m["seconds_per_step"]
        ex_s = recipe.batch_size * recipe.grad_accum / step_s
        train_flops = 3 * mean_layer * (N_LAYERS - recipe.frozen_layers)  # per example per epoch
        feature_s = (m.get("feature_pass") or {}).get("seconds", 0.0)
        first_feature_s = feature_s if not rows else next(iter(rows.values()))["feature_pass_s"]
        n = len(lengths)
        whole = args.epochs * n / (first_feature_s + args.epochs * n / ex_s)  # a run that pays its own pass
        rows[name] = {"s_per_step": step_s, "examples_per_s": ex_s, "feature_pass_s": feature_s,
                      "examples_per_s_whole_run": whole, "gflop_per_example": train_flops / 1e9,
                      "mfu": train_flops * ex_s / peaks[recipe.precision], "precision": recipe.precision}
    print(f"matmul peak measured here: fp32 {peaks['fp32'] / 1e9:.0f} GFLOP/s, bf16 {peaks['bf16'] / 1e9:.0f} GFLOP/s; "
          f"{args.questions} questions, {args.steps} steps, whole run = {args.epochs} epochs; "
          f"mean sequence {sum(lengths) / len(lengths):.0f} tokens")
    print(f"{'arm':<24}{'s/step':>8}{'ex/s':>8}{'feature s':>10}{'ex/s run':>10}{'GFLOP/ex':>10}{'MFU':>7}{'x first':>9}")
    first = next(iter(rows.values()))
    for name, r in rows.items():
        print(f"{name:<24}{r['s_per_step']:>8.2f}{r['examples_per_s']:>8.2f}{r['feature_pass_s']:>10.1f}"
              f"{r['examples_per_s_whole_run']:>10.2f}{r['gflop_per_example']:>10.2f}{r['mfu']:>7.1%}"
              f"{r['examples_per_s'] / first['examples_per_s']:>9.2f}")
    print("(MFU against the peak of the arm's precision; the feature pass is fp32 in every arm and paid once)")


if __name__ == "__main__":
    from envloop_pipelines.console import quiet_third_party

    quiet_third_party()  # the bench prints what it measures, not a library's notes on itself
    main()
