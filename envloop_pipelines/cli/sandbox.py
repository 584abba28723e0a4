"""``envloop sandbox``: run a command or a verifier in the sandbox and print the typed result as JSON.

    envloop sandbox exec [--backend local|docker|k8s] [--cpu-s N --mem-mb N --wall-s N ...] -- CMD ARGS
    envloop sandbox verify --task NAME --split dev --predictions FILE [--kind rule|grader] [--items]
    envloop sandbox verify --task NAME --split test --predictions FILE          # aggregate scores only
    envloop sandbox verify --task NAME --split holdout --release N --predictions FILE
    envloop sandbox info

``verify`` goes through the verifier's one door (``verify_task``): on test and
holdout it prints aggregate scores only (``--items`` is refused there), and a
holdout read is release N's one read (``Ledger.read_holdout_once``), refused
when that release has already read it (every published release has) and for
a release that is not published yet (the release step reads its holdout).
Test and holdout run in the sandbox the deployment configures
(``$ENVLOOP_SANDBOX*``, read here as the loop's sandbox resource reads them:
``resources/sandbox.py``; the local backend when unset).

Exit status: 0 when the command (or the verifier) ended ``ok``, 1 when it did
not (the JSON says why: timeout, cpu_limit, memory_exceeded, ...), 2 for a
usage error or a read the rules refuse.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import click

from envloop_pipelines.core.sandbox.base import BACKENDS, SandboxCall, SandboxLimits


def _echo_json(value: Any) -> None:
    click.echo(json.dumps(value, indent=2, ensure_ascii=False))


def _limits(base: SandboxLimits, **given: Any) -> SandboxLimits:
    chosen = {k: v for k, v in given.items() if v is not None}
    try:
        return replace(base, **chosen)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def backend_options(backend: str, image: str | None) -> dict[str, Any]:
    """The sandbox backend's options from ``--image`` (docker and k8s only)."""
    if image is None:
        return {}
    if backend == "local":
        raise click.BadParameter("--image applies to the docker and k8s backends", param_hint="--image")
    return {"image": image}


def _deployment_sandbox() -> Any:
    """The deployment's sandbox settings: ``$ENVLOOP_SANDBOX*`` (the local backend when unset)."""
    import os

    from envloop_pipelines.core.sandbox import SandboxSettings
    from envloop_pipelines.resources.sandbox import sandbox_settings_from_env

    try:
        return SandboxSettings(**sandbox_settings_from_env(os.environ))
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None


@click.group()
def sandbox() -> None:
    """Run commands and verifiers in the sandbox (local process, docker, or a Kubernetes Job)."""


@sandbox.command("exec", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--backend", type=click.Choice(BACKENDS), default="local", show_default=True)
@click.option("--cpu-s", type=float, default=None, help="CPU seconds per process (default 10).")
@click.option("--mem-mb", type=int, default=None, help="Address space (local) or memory (docker, k8s) in MiB (default 2048).")
@click.option("--wall-s", type=float, default=None, help="Wall-clock seconds for the whole run (default 30).")
@click.option("--fsize-mb", type=int, default=None, help="Largest file the command may write, MiB (default 64).")
@click.option("--nproc", type=int, default=None, help="Processes and threads (default 64).")
@click.option("--nofile", type=int, default=None, help="Open files per process (default 256).")
@click.option("--stdin", "stdin_path", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Feed this file to the command's stdin.")
@click.option("--workdir", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="Run in this directory and keep its changes (default: a fresh temporary one).")
@click.option("--image", default=None, help="Container image (docker, k8s).")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def sandbox_exec(backend: str, cpu_s: float | None, mem_mb: int | None, wall_s: float | None, fsize_mb: int | None,
                 nproc: int | None, nofile: int | None, stdin_path: Path | None, workdir: Path | None, image: str | None,
                 command: tuple[str, ...]) -> None:
    """Run COMMAND in the sandbox and print its typed result (status, exit code, limits, output tails) as JSON."""
    from envloop_pipelines.core.sandbox import make_sandbox

    limits = _limits(SandboxLimits(), cpu_s=cpu_s, mem_mb=mem_mb, wall_s=wall_s, fsize_mb=fsize_mb, nproc=nproc, nofile=nofile)
    box = make_sandbox(backend, limits=limits, **backend_options(backend, image))
    result = box.run(list(command), SandboxCall(stdin=stdin_path.read_bytes() if stdin_path else None, workdir=workdir))
    _echo_json(result.to_dict(include_channel=False))
    sys.exit(0 if result.ok else 1)


@sandbox.command("verify")
@click.option("--task", required=True, help="Task name.")
@click.option("--split", default="test", show_default=True, type=click.Choice(("train", "val", "dev", "test", "holdout")))
@click.option("--predictions", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Predictions file (.parquet or .jsonl: record_id, question_id, option_keys, probs).")
@click.option("--kind", type=click.Choice(("rule", "grader")), default="rule", show_default=True)
@click.option("--grader", default="text_match", show_default=True, help="Scoring model of the grader kind.")
@click.option("--snapshot", "snapshot_id", default=None, help="Snapshot id (default: the task's current one).")
@click.option("--home", type=click.Path(file_okay=False, path_type=Path), default=None, help="EnvLoop home.")
@click.option("--backend", type=click.Choice(("local", "docker")), default=None,
              help="Sandbox of an open split (default local). Test and holdout run in the sandbox the deployment "
                   "configures ($ENVLOOP_SANDBOX), never one chosen per call.")
@click.option("--image", default=None, help="Verifier image (docker; open splits only).")
@click.option("--wall-s", type=float, default=None, help="Wall-clock limit of the worker.")
@click.option("--mem-mb", type=int, default=None, help="Memory limit of the worker, MiB.")
@click.option("--items/--no-items", default=False, show_default=True,
              help="Include the per-item scores (open splits only: test and holdout answer with aggregate scores).")
@click.option("--release", type=int, default=None,
              help="With --split holdout: the published release whose one holdout read this is.")
def sandbox_verify(task: str, split: str, predictions: Path, kind: str, grader: str, snapshot_id: str | None,
                   home: Path | None, backend: str | None, image: str | None, wall_s: float | None, mem_mb: int | None,
                   items: bool, release: int | None) -> None:
    """Score PREDICTIONS on TASK's SPLIT with a verifier worker in the sandbox; print the report as JSON."""
    from envloop_pipelines.core.data.splits import HIDDEN_SPLITS
    from envloop_pipelines.core.ledger.event_log import LedgerError
    from envloop_pipelines.core.ledger.ledger import Ledger
    from envloop_pipelines.core.sandbox import make_sandbox
    from envloop_pipelines.core.verify.runner import (
        DEFAULT_WORKER_LIMITS,
        HiddenSplitQueryError,
        VerifierRunner,
        verify_task,
    )

    if items and split in HIDDEN_SPLITS:
        raise click.UsageError(f"--items: {split} answers with aggregate scores only, never per item "
                               f"(per-item scores are given on train, val and dev)")
    if split != "holdout" and release is not None:
        raise click.UsageError("--release applies to --split holdout only")
    slot = None
    if split == "holdout":
        if release is None:
            raise click.UsageError("--split holdout needs --release N: the holdout is read once per release "
                                   "(envloop releases lists them)")
        slot = Ledger(task, home)
        if not (slot.release_dir(release) / "card.json").exists():
            raise click.UsageError(f"--release {release}: release {release} of {task!r} is not published; the release "
                                   f"step reads its holdout when it publishes it")
    runner = None  # test and holdout: the verifier's own runner, in the configured sandbox
    settings = None
    if split in HIDDEN_SPLITS:
        chosen = [name for name, value in (("--backend", backend), ("--image", image), ("--wall-s", wall_s),
                                           ("--mem-mb", mem_mb)) if value is not None]
        if chosen:
            raise click.UsageError(f"{', '.join(chosen)}: {split} is scored only in the sandbox the deployment "
                                   f"configures ($ENVLOOP_SANDBOX), never one chosen per call")
        settings = _deployment_sandbox()
    else:
        backend = backend or "local"
        limits = _limits(DEFAULT_WORKER_LIMITS, wall_s=wall_s, mem_mb=mem_mb)
        runner = VerifierRunner(make_sandbox(backend, limits=limits, **backend_options(backend, image)), limits=limits)
    try:
        run = verify_task(task, split, predictions, kind=kind, snapshot_id=snapshot_id, home=home, runner=runner,
                          sandbox=settings, grader=grader, holdout_slot=slot, release=release)
    except (FileNotFoundError, LedgerError, HiddenSplitQueryError) as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    _echo_json(run.to_dict(include_items=items))
    sys.exit(0 if run.ok else 1)


@sandbox.command("info")
@click.option("--backend", type=click.Choice(BACKENDS), default="local", show_default=True)
def sandbox_info(backend: str) -> None:
    """What the backend can enforce on this host (network namespace, masking, uid switch, engine)."""
    from envloop_pipelines.core.sandbox import make_sandbox

    _echo_json(make_sandbox(backend).capabilities())


__all__ = ["sandbox"]
