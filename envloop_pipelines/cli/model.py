"""``envloop train`` and ``envloop eval``: the entry points a training pod runs."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import click

from envloop_pipelines.cli.options import parse_recipe_overrides, recipe_override_option


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Everything written to stdout meanwhile goes to stderr: Python's ``sys.stdout`` and file descriptor 1.

    The commands print one JSON document on stdout (``envloop train ... | jq .checkpoint``); the libraries they
    drive do not keep to that (DeepSpeed's logger writes its warnings to stdout, a compiler check may print).
    """
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no fd 1 (a closed stdout): Python's stream only
        saved = None
    try:
        if saved is not None:
            os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        if saved is not None:
            os.dup2(saved, 1)
            os.close(saved)


@click.command("train")
@click.option("--task", required=True, help="Task name (its current snapshot).")
@click.option("--recipe", "recipe_path", required=True, help="Recipe YAML (a path or packaged:<file>).")
@click.option("--out", required=True, type=click.Path(file_okay=False, path_type=Path), help="New checkpoint directory.")
@click.option("--init-from", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="Continue from this checkpoint (the champion) instead of the base model.")
@recipe_override_option
def train(task: str, recipe_path: str, out: Path, init_from: Path | None, recipe_overrides: tuple[str, ...]) -> None:
    """Train a decision model on TASK's train split, calibrate on val, write a checkpoint to OUT.

    Stdout is one JSON document (the checkpoint, its metrics); what the libraries print goes to stderr.
    """
    with stdout_to_stderr():
        from envloop_pipelines.core.model.recipe import RecipeError, load_recipe
        from envloop_pipelines.core.model.training import is_main_process, train_checkpoint
        from envloop_pipelines.core.data.snapshots import open_task

        try:
            recipe = load_recipe(recipe_path, parse_recipe_overrides(recipe_overrides))
        except (RecipeError, FileNotFoundError, TypeError, ValueError) as exc:
            raise click.BadParameter(str(exc), param_hint="--recipe/--recipe-override") from None
        if out.exists():
            raise click.BadParameter(f"{out} exists; checkpoints are never overwritten", param_hint="--out")
        snapshot = open_task(task)
        started = time.perf_counter()
        ckpt = train_checkpoint(snapshot.table("train"), snapshot.table("val"), recipe, out,
                                data_hash=snapshot.snapshot_id, init_from=init_from)
    if not is_main_process():
        # Launched on several ranks (accelerate/torchrun): rank 0 writes the checkpoint and reports it; the
        # others end here, before OUT exists, and exit 0 (a failing rank would make the launcher stop rank 0).
        return
    metrics = json.loads((ckpt / "metrics.json").read_text())
    click.echo(json.dumps({"checkpoint": str(ckpt), "train_s": round(time.perf_counter() - started, 1),
                           "benchmark_version": snapshot.benchmark_version, "metrics": metrics}, indent=2, default=str))


@click.command("eval")
@click.option("--checkpoint", required=True, type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--task", required=True)
@click.option("--split", type=click.Choice(["dev", "val", "train"]), default="dev", show_default=True,
              help="An open split; test and holdout are scored by the verifier only.")
@click.option("--json", "as_json", is_flag=True)
def evaluate(checkpoint: Path, task: str, split: str, as_json: bool) -> None:
    """Metrics of a checkpoint on an open split of TASK (the checkpoint's manifest is verified first)."""
    with stdout_to_stderr():
        from envloop_pipelines.core.benchmark import SAFETY_FAMILIES
        from envloop_pipelines.core.data.snapshots import open_task
        from envloop_pipelines.core.model.predict import evaluate_checkpoint

        snapshot = open_task(task)
        result = evaluate_checkpoint(checkpoint, snapshot.table(split), safety_families=SAFETY_FAMILIES)
    result["split"], result["benchmark_version"] = split, snapshot.benchmark_version
    if as_json:
        click.echo(json.dumps(result, indent=2, default=str))
        return
    click.echo(f"{checkpoint} on {task}/{split} ({snapshot.benchmark_version})")
    for key, value in result.items():
        if isinstance(value, float):
            click.echo(f"  {key:<28} {value:.4f}")
        elif isinstance(value, int):
            click.echo(f"  {key:<28} {value}")
