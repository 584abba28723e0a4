"""Loops of rounds from the command line: ``envloop round start`` and ``retry`` here (the ``LocalClient``, the setup
and the rounds under one hold of the task's loop) and ``round start --remote`` (the SDK's ``Client``), each round's
verdict printed as it is decided.
"""

from __future__ import annotations

import json
import time
from typing import Any

import click

from envloop_pipelines.cli.clients import local_client, refused, sdk_call
from envloop_pipelines.cli.render import decision_lines, echo_decision
from envloop_pipelines.names import PARTITION_TAG


def _power_line(client: Any, key: str, decision: Any) -> str | None:
    """The registered test power of round ``key`` beside its predicted delta (local rounds: read from the ledger)."""
    from envloop_pipelines.core.ledger.ledger import Ledger

    hypothesis = Ledger(client.task, client.config.home).hypothesis(key)
    power = (hypothesis.power if hypothesis is not None else None) or {}
    if power.get("mde") is None:
        return None
    bar = f", bar {power['bar']:.4f}" if isinstance(power.get("bar"), (int, float)) else ""
    pairs = (f", from {power['n_pairs']} candidate-vs-champion pair(s)" if power.get("n_pairs") else "")
    return (f"  test power: minimum detectable effect {power['mde']:.4f} at 80% power (se {power['se']:.4f}"
            f"{bar}{pairs}), predicted {decision.predicted_delta:+.4f}"
            + ("; underpowered" if power.get("underpowered") else ""))


def _drive_local(client: Any, step: Any, echo: Any) -> list[dict[str, Any]]:
    """Run ``step(on_round)`` (the local client's loop or retry), printing each round; the rounds' timings."""
    from envloop_pipelines.sdk.errors import RefusedError, RoundFailed

    timings: list[dict[str, Any]] = []
    begun = {"t": time.perf_counter()}

    def on_round(result: Any) -> None:
        seconds = time.perf_counter() - begun["t"]
        timings.append({"step": f"round {result.key}", "s": seconds, "success": True})
        for line in decision_lines(result.key, result.decision, seconds):
            echo(line)
        power = _power_line(client, result.key, result.decision)
        if power:
            echo(power)
        begun["t"] = time.perf_counter()

    try:
        step(on_round)
    except RoundFailed as exc:
        timings.append({"step": f"round {exc.run.partition}", "s": time.perf_counter() - begun["t"], "success": False})
        echo(str(exc))
    except RefusedError as exc:  # a bad budget, or another run of the task's loop took the claim first (exit 2)
        raise refused(exc) from None
    return timings


def run_loop(*, loop_settings: dict[str, Any], rounds: int, patience: int, max_wall_s: float,
             proposal: dict[str, Any] | None = None, echo: Any = click.echo,
             client: Any = None) -> list[dict[str, Any]]:
    """Set up the benchmark and noise floor, then run rounds while the loop's budget lasts (in this process).

    One claim of the task's loop for the setup and every round (``LocalClient.hold_loop``,
    ``core/loop/round_claim.py``), taken before anything is generated or written: while a setup or a round of the
    task runs, from whichever door, the command is refused at once (exit 2, one line naming that run, its door and
    how to follow or cancel it), having written nothing.
    """
    from envloop_pipelines.sdk.errors import ClientError, RoundFailed

    client = client or local_client(loop_settings, door="envloop round start")
    sdk_call(client.probe)  # a dead MLFLOW_TRACKING_URI fails here, in seconds, in one line
    for run in client.reap_orphans():
        echo(f"marked run {run.run_id} ({run.job_name}) failed: its worker is gone")
    sdk_call(client.ensure_no_round_running)
    with sdk_call(client.hold_loop):  # given back when the loop ends, however it ends
        started = time.perf_counter()
        try:
            client.setup()
            ok = True
        except RoundFailed as exc:
            echo(f"setup failed: {exc}")
            ok = False
        except ClientError as exc:  # a run of the task started from elsewhere before this one's claim (exit 2)
            raise refused(exc) from None
        timings = [{"step": "setup (benchmark + noise floor)", "s": time.perf_counter() - started, "success": ok}]
        if not ok:
            return timings
        echo(f"setup: benchmark and noise floor ready ({timings[-1]['s']:.0f}s)")
        warning = client.promotion_warning()
        if warning:
            click.echo(f"warning: task {client.task}: {warning}", err=True)
        return timings + _drive_local(client, lambda on_round: client.run_loop(
            rounds=rounds, patience=patience, max_wall_s=max_wall_s, hypothesis=proposal, on_round=on_round), echo)


def retry_round(task: str, *, echo: Any = click.echo) -> list[dict[str, Any]]:
    """Finish the task's undecided round (its worker died or it failed), then go on while the budget lasts.

    Unfinished runs whose worker is gone are marked failed first (see :meth:`LocalClient.retry`).
    """
    from envloop_pipelines.sdk.errors import ClientError

    client = local_client(task=task, door="envloop round retry")
    for run in client.reap_orphans():
        echo(f"marked run {run.run_id} ({run.job_name}, round {run.tags.get(PARTITION_TAG)}) failed: "
             f"its worker is gone")
    try:
        return _drive_local(client, lambda on_round: client.retry(on_round=on_round), echo)
    except ClientError as exc:
        raise refused(exc) from None


def run_remote_loop(client: Any, *, rounds: int, patience: int, max_wall_s: float,
                    proposal: dict[str, Any] | None) -> bool:
    """``round start --remote``: the setup if the deployment has none, then rounds through the SDK. True if all decided.

    The setup and the rounds take the client's recipe override (``--recipe-override``); a round whose recipe is not
    the one the deployment's noise floor was measured with is refused (at its registration, or by its decision:
    ``FloorRecipeError``), not gated on that floor."""
    import warnings

    from envloop_pipelines.sdk.errors import PromotionOutOfReach, RoundFailed

    if not sdk_call(client.is_set_up):
        started = time.perf_counter()
        try:
            with warnings.catch_warnings():  # said below, once, as the CLI says it
                warnings.simplefilter("ignore", PromotionOutOfReach)
                info = sdk_call(client.setup)
        except RoundFailed as exc:
            raise click.ClickException(str(exc)) from None
        click.echo(f"setup: benchmark and noise floor ready (run {info.run_id}, {time.perf_counter() - started:.0f}s)")
    warning = sdk_call(client.promotion_warning)
    if warning:
        click.echo(f"warning: task {client.task}: {warning}", err=True)
    overrides = json.dumps(sdk_call(client.loop_settings)["recipe_overrides"], sort_keys=True)  # with this client's
    click.echo(f"loop on {client.dagster_url} (task {client.task}, recipe_overrides {overrides}): "
               f"up to {rounds} rounds")
    begun = {"t": time.perf_counter()}

    def on_round(result: Any) -> None:
        echo_decision(result.key, result.decision, time.perf_counter() - begun["t"])
        click.echo(f"  run {result.run.run_id}")
        begun["t"] = time.perf_counter()

    try:
        sdk_call(client.run_loop, rounds=rounds, patience=patience, max_wall_s=max_wall_s, hypothesis=proposal,
                 on_round=on_round)
    except RoundFailed as exc:
        click.echo(f"error: {exc}", err=True)
        return False
    return True


__all__ = ["retry_round", "run_loop", "run_remote_loop"]
