"""``envloop round``: start a loop of rounds, retry, cancel, add a partition and show the rounds.

Rounds run through Dagster (the same jobs the UI launches) on the instance in
``$DAGSTER_HOME`` (default ``<envloop home>/dagster``, SQLite), so every run
shows up in ``envloop ui`` afterwards.

With ``--remote URL`` (a deployment's Dagster webserver) the same commands go
through the SDK (``envloop_pipelines.sdk.Client``): the rounds run on the
deployment, with its loop settings and the loop recipe override given here
(``--recipe-override``), and what they print comes from its GraphQL API and
its MLflow server (``--mlflow``). CLI, SDK and HTTP are one path. The loops
themselves are driven in ``loop_runs.py``, printed by ``render.py``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import click

from envloop_pipelines.cli.clients import any_client, local_client, read_hypothesis, remote_client, sdk_call
from envloop_pipelines.cli.loop_runs import retry_round, run_loop, run_remote_loop
from envloop_pipelines.cli.options import loop_options, loop_settings, parse_recipe_overrides, remote_options
from envloop_pipelines.cli.render import echo_decision, echo_rounds, print_releases, round_row
from envloop_pipelines.names import ROUNDS_PARTITIONS


@click.group("round")
def round_group() -> None:
    """Run rounds of the loop."""


@round_group.command("start")
@loop_options
@click.option("--rounds", type=int, default=1, show_default=True, help="Round budget of this loop.")
@click.option("--patience", type=int, default=2, show_default=True, help="Stop after this many rounds without gain.")
@click.option("--max-wall-s", type=float, default=6 * 3600, show_default=True)
@click.option("--hypothesis", "hypothesis_file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              default=None, help="A person's hypothesis for the first round (JSON: change, predicted_delta, gate, seeds, rationale); later rounds derive theirs.")
@remote_options
@click.pass_context
def round_start(ctx: click.Context, rounds: int, patience: int, max_wall_s: float, hypothesis_file: Path | None,
                remote: str | None, mlflow_uri: str | None, **options: Any) -> None:
    """Start a loop of rounds and run it to the end of its budget (here, or on a deployment with --remote).

    Exit status: 0 when every round was decided, 1 when a round failed (the ledger and the run say why),
    2 for bad options or while a setup or a round of the task runs (from any door: one line names its run and how
    to follow or cancel it; nothing is generated or written).
    """
    from click.core import ParameterSource

    for name, value in (("--rounds", rounds), ("--patience", patience), ("--max-wall-s", max_wall_s)):
        if not value > 0:
            raise click.BadParameter(f"must be positive, got {value}", param_hint=name)
    proposal = read_hypothesis(hypothesis_file)
    if remote:
        given = [f"--{n.replace('_', '-')}" for n in options if n != "recipe_overrides"
                 and ctx.get_parameter_source(n) in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)]
        if given:
            raise click.BadParameter(
                f"{', '.join(given)}: a remote round runs with the deployment's loop settings (ENVLOOP_<SETTING> of "
                f"its code location; only --recipe-override is given to its runs); leave "
                f"{'it' if len(given) == 1 else 'them'} out", param_hint="--remote")
        # checked before any request, as here: a misspelled field is a usage error naming a close match (exit 2)
        overrides = parse_recipe_overrides(tuple(options.get("recipe_overrides") or ()))
        client = remote_client(remote, mlflow_uri, probe=True, recipe_overrides=overrides)
        ok = run_remote_loop(client, rounds=rounds, patience=patience, max_wall_s=max_wall_s, proposal=proposal)
        if client.mlflow_uri:
            print_releases(client.task, client=client)
        if not ok:
            raise SystemExit(1)
        return
    settings = loop_settings(options)
    client = local_client(settings, door="envloop round start")  # the loop resource, built once for the command
    timings = run_loop(loop_settings=settings, rounds=rounds, patience=patience, max_wall_s=max_wall_s,
                       proposal=proposal, client=client)
    print_releases(client.task, client=client)
    if timings and not all(t.get("success", True) for t in timings):
        raise SystemExit(1)


@round_group.command("retry")
@click.argument("key", required=False)
@click.option("--task", default=None, help="The task (default personal_agent; with --remote, the deployment's).")
@remote_options
def round_retry(key: str | None, task: str | None, remote: str | None, mlflow_uri: str | None) -> None:
    """Finish a round whose run failed or whose worker died, then go on while the loop's budget lasts.

    With --remote: run the deployment's round KEY (default: its last undecided round) again from the step
    that failed (Dagster's re-execution), wait for it and print its decision. Exit status 1 when it fails again,
    here or there.
    """
    if remote:
        client = remote_client(remote, mlflow_uri, task, probe=True)
        if key is None:
            undecided = [r.key for r in sdk_call(client.rounds) if r.decision is None and r.run is not None]
            if not undecided:
                click.echo(f"task {client.task}: no undecided round to retry")
                return
            key = undecided[-1]
        from envloop_pipelines.sdk.errors import RoundFailed

        started = time.perf_counter()
        try:
            result = sdk_call(client.retry, key, wait=True)
        except RoundFailed as exc:
            click.echo(f"error: {exc}", err=True)
            raise SystemExit(1) from None
        echo_decision(result.key, result.decision, time.perf_counter() - started)
        click.echo(f"  run {result.run.run_id}")
        return
    if key is not None:
        raise click.BadParameter("a local retry finishes the task's last undecided round; KEY is for --remote",
                                 param_hint="KEY")
    task = task or "personal_agent"
    timings = retry_round(task)
    print_releases(task)
    if not all(t.get("success", True) for t in timings):
        raise SystemExit(1)  # the round failed again (its error is printed above), as with --remote


@round_group.command("cancel")
@click.argument("run_id")
@click.option("--task", default=None, help="The task (default personal_agent; with --remote, the deployment's).")
@remote_options
def round_cancel(run_id: str, task: str | None, remote: str | None, mlflow_uri: str | None) -> None:
    """Cancel the run RUN_ID of a round or of the setup and wait until it has stopped; print how it ended.

    Here: the run's worker on this machine (an `envloop round start`, or a round started from the SDK) is
    interrupted and the run ends CANCELED. With --remote: the deployment's run is terminated. Either way the
    round's MLflow runs still running end KILLED; `envloop round retry` runs the round again.
    """
    info = sdk_call(any_client(remote, mlflow_uri, task).cancel, run_id)
    click.echo(f"run {info.run_id}: {info.status}" + (f" (round {info.partition})" if info.partition else ""))


@round_group.command("add")
@click.option("--task", default="personal_agent", show_default=True)
def round_add(task: str) -> None:
    """Add the next round partition (for `dagster asset materialize --partition`) and print its key."""
    from envloop_pipelines.core.loop.budget import last_round_number
    from envloop_pipelines.core.loop.config import round_key
    from envloop_pipelines.sdk.instance import open_instance

    instance = open_instance()
    existing = instance.get_dynamic_partitions(ROUNDS_PARTITIONS)
    key = round_key(max([last_round_number(task)] + [int(k[1:]) for k in existing]) + 1)
    instance.add_dynamic_partitions(ROUNDS_PARTITIONS, [key])
    click.echo(key)


@round_group.command("status")
@click.argument("key", required=False)
@click.option("--task", default=None, help="The task (default personal_agent; with --remote, the deployment's).")
@click.option("--json", "as_json", is_flag=True, help="Print the rounds as JSON.")
@remote_options
def round_status(key: str | None, task: str | None, as_json: bool, remote: str | None, mlflow_uri: str | None) -> None:
    """Every round (or round KEY): its status, its verdict and its latest run.

    Status is ``decided``, or the latest run's (``STARTED``, ``FAILURE`` ...), or ``not started``.
    Exit status 1 when KEY is not a round.
    """
    client = any_client(remote, mlflow_uri, task)
    task = client.task
    rows = []
    for r in sdk_call(client.rounds):
        failed = r.decision is None and r.run is not None and r.run.status == "FAILURE"
        reason = sdk_call(client.run_error, r.run.run_id) if failed else None
        rows.append(round_row(r.key, r.decision, r.run.run_id if r.run else None, r.run.status if r.run else None,
                              str(reason) if reason is not None else None))
    if key is not None:
        rows = [r for r in rows if r["round"] == key]
        if not rows:
            raise click.ClickException(f"task {task} has no round {key!r}")
    echo_rounds(task, rows, as_json)


__all__ = ["round_group"]
