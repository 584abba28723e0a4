"""``envloop train`` on several processes: the GPU recipe's launch command, rank 0 alone writing, DeepSpeed ZeRO-2.

Three tiers:

* the launch command in ``label_token_qwen_gpu.yaml``'s header is an ``accelerate launch`` of a module that
  exists and takes those options (unit, a few seconds);
* the same launcher on CPU, two ranks (DDP over gloo; DeepSpeed is ignored without CUDA): both train, rank 0
  alone calibrates, writes and reports the checkpoint, the other rank exits 0 without touching ``--out``
  (``slow``);
* every GPU of the machine with the recipe's DeepSpeed ZeRO-2 config and bf16 (``gpu``: skipped without CUDA).

No ``--use_deepspeed`` on the launcher: the recipe's config reaches DeepSpeed through
``TrainingArguments(deepspeed=...)``, which sets up accelerate's DeepSpeed state in each process that
``accelerate launch`` (torchrun underneath, for more than one process) starts. ``--use_deepspeed`` would
hand DeepSpeed to accelerate's own launcher and config instead.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from envloop_pipelines.core.model.recipe import RECIPES_DIR
from envloop_pipelines.testing.services import free_port

GPU_RECIPE = RECIPES_DIR / "label_token_qwen_gpu.yaml"
ACCELERATE = Path(sys.executable).parent / "accelerate"  # the venv's launcher, next to its python
MAX_STEPS = 3


# --------------------------------------------------------------------------- the recipe's launch command


def _header_commands(recipe: Path) -> list[list[str]]:
    """The shell commands in a recipe's header comment (continuation lines joined), as argv lists."""
    lines: list[str] = []
    for line in recipe.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        lines.append(line[1:].strip())
    commands, pending = [], ""
    for line in lines:
        pending = f"{pending} {line}".strip()
        if pending.endswith("\\"):
            pending = pending[:-1]
            continue
        if pending.startswith(("envloop ", "accelerate ")):
            commands.append(shlex.split(pending))
        pending = ""
    return commands


def test_gpu_recipe_launch_commands_name_entry_points_that_exist() -> None:
    from accelerate.commands.launch import launch_command_parser

    from envloop_pipelines.cli.model import train

    train_options = {opt for param in train.params for opt in param.opts}
    commands = _header_commands(GPU_RECIPE)
    by_tool = {argv[0]: argv for argv in commands}
    assert set(by_tool) == {"envloop", "accelerate"}, commands

    # One GPU: the console script.
    single = by_tool["envloop"]
    (script,) = entry_points(group="console_scripts", name="envloop")
    assert script.value == "envloop_pipelines.cli:main"
    assert single[1] == "train" and {a for a in single[2:] if a.startswith("--")} <= train_options

    # Several GPUs: accelerate runs a module (-m) on every rank, with the train subcommand's own options.
    multi = by_tool["accelerate"]
    assert multi[1] == "launch"
    launch = launch_command_parser().parse_args(multi[2:])
    assert launch.module and not launch.use_deepspeed and launch.num_processes > 1
    module, (subcommand, *options) = launch.training_script, launch.training_script_args
    assert subcommand == "train" and {a for a in options if a.startswith("--")} <= train_options
    recipe_arg = options[options.index("--recipe") + 1]
    assert (RECIPES_DIR.parents[1] / recipe_arg).resolve() == GPU_RECIPE.resolve()
    assert importlib.util.find_spec(module) is not None
    # The module runs as a program (its __main__ guard), as each rank runs it.
    shown = subprocess.run([sys.executable, "-m", module, "train", "--help"], check=False, capture_output=True,
                           text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert "--recipe" in shown.stdout and "--out" in shown.stdout


# --------------------------------------------------------------------------- launching


def _prepare(root: Path, *, deepspeed: str | None) -> tuple[dict[str, str], Path]:
    """A tiny task imported into a fresh home, a tiny causal LM, and a label-token recipe for it.

    Returns the environment to launch with and the recipe path.
    """
    from envloop_pipelines.core.benchmark.builtin_task import generate_builtin_task
    from envloop_pipelines.core.data.snapshots import open_task
    from envloop_pipelines_tests.core.test_model_data import table_texts, tiny_causal_lm

    home = root / "home"
    generate_builtin_task(task="tiny", n_users=12, records_per_user=2, home=home)
    snapshot = open_task("tiny", home=home)
    # The noul labels must be single tokens of the tiny BPE: enough "yes"/"no" in its corpus to merge them.
    texts = table_texts(snapshot.table("train")) + table_texts(snapshot.table("val")) + ["Answer: yes", "Answer: no"] * 100
    lm = tiny_causal_lm(root / "lm", texts)
    recipe = root / "recipe.yaml"
    recipe.write_text(
        "readout: label_token\n"
        f"base_model: {lm}\n"
        "max_length: 512              # the benchmark's prompts without their state take ~180 tiny-BPE tokens\n"
        "lora: {r: 4, alpha: 8, dropout: 0.0, target_modules: [q_proj, v_proj]}\n"
        "lr: 1.0e-2\n"
        f"max_steps: {MAX_STEPS}\n"
        "batch_size: 4\n"
        "eval_batch_size: 16\n"
        "precision: bf16\n"
        f"deepspeed: {deepspeed or 'null'}\n",
        encoding="utf-8",
    )
    env = {**os.environ, "ENVLOOP_HOME": str(home), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           # No accelerate default_config.yaml of the machine's user: only the flags given here count.
           "HF_HOME": str(root / "hf")}
    return env, recipe


def _launch(n: int, mixed_precision: str, env: dict[str, str], recipe: Path, out: Path,
            timeout: float) -> subprocess.CompletedProcess[str]:
    cmd = [str(ACCELERATE), "launch", "--num_processes", str(n), "--num_machines", "1",
           "--mixed_precision", mixed_precision, "--dynamo_backend", "no"]
    if n > 1:
        cmd += ["--multi_gpu", "--main_process_port", str(free_port())]
    cmd += ["-m", "envloop_pipelines.cli", "-v", "train", "--task", "tiny", "--recipe", str(recipe), "--out", str(out)]
    return subprocess.run(cmd, check=False, env=env, cwd=out.parent, capture_output=True, text=True, timeout=timeout)


def _check_launched(result: subprocess.CompletedProcess[str], out: Path, home: str, *, world_size: int) -> dict[str, Any]:
    """Every rank exited 0; rank 0 alone reported and wrote a checkpoint that verifies. Returns its provenance."""
    from envloop_pipelines.core.model.predict import DecisionModel
    from envloop_pipelines.core.data.snapshots import open_task

    assert result.returncode == 0, result.stderr[-6000:]
    assert result.stdout.count('"checkpoint":') == 1, result.stdout[-3000:]  # one report: rank 0's
    report, _ = json.JSONDecoder().raw_decode(result.stdout[result.stdout.index('{\n  "checkpoint"'):])
    assert report["checkpoint"] == str(out)
    # The other ranks left training without waiting for (or reading) the checkpoint.
    assert result.stderr.count("not the main process") == world_size - 1, result.stderr[-6000:]
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.partial")]

    dm = DecisionModel.load(out)  # verifies the manifest and the base model's sha256 first
    val = open_task("tiny", home=home).table("val")
    predictions = dm.predict(val)
    assert predictions and all(np.all(np.isfinite(p.probs)) for p in predictions)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["train"]["steps"] == MAX_STEPS
    losses = [e["mean_loss"] for e in metrics["train"]["epochs"]]
    assert losses and all(np.isfinite(losses)), losses
    provenance = json.loads((out / "provenance.json").read_text())
    assert provenance["world_size"] == world_size
    return provenance


@pytest.mark.slow
@pytest.mark.skipif(not ACCELERATE.exists(), reason="accelerate's launcher is not installed next to this python")
def test_two_cpu_ranks_train_and_rank_zero_alone_writes(tmp_path: Path) -> None:
    env, recipe = _prepare(tmp_path, deepspeed="packaged:deepspeed_zero2.json")  # ignored on CPU, with a log line
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    out = tmp_path / "ckpt"
    result = _launch(2, "no", env, recipe, out, timeout=600)
    provenance = _check_launched(result, out, env["ENVLOOP_HOME"], world_size=2)
    assert provenance["device"] == "cpu" and provenance["deepspeed"] is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed not installed")
@pytest.mark.skipif(not ACCELERATE.exists(), reason="accelerate's launcher is not installed next to this python")
def test_deepspeed_zero2_on_every_gpu(tmp_path: Path) -> None:
    n = torch.cuda.device_count()
    env, recipe = _prepare(tmp_path, deepspeed="packaged:deepspeed_zero2.json")
    out = tmp_path / "ckpt"
    result = _launch(n, "bf16", env, recipe, out, timeout=900)
    provenance = _check_launched(result, out, env["ENVLOOP_HOME"], world_size=n)
    assert provenance["device"] == "cuda" and provenance["deepspeed"] == "packaged:deepspeed_zero2.json"
