"""``envloop releases`` and ``envloop ledger``: what the loop recorded, here or on a deployment (``--remote``): the
release chain with its cards, the ledger's events with the calibration per lever, and ``ledger verify`` (its chain).
"""

from __future__ import annotations

import click

from envloop_pipelines.cli.clients import any_client, sdk_call
from envloop_pipelines.cli.options import remote_options
from envloop_pipelines.cli.render import echo_champion_vs_tfidf, echo_ledger, print_releases


@click.command("releases")
@click.option("--task", default=None, help="The task (default personal_agent; with --remote, the deployment's).")
@click.option("--json", "as_json", is_flag=True)
@remote_options
def releases(task: str | None, as_json: bool, remote: str | None, mlflow_uri: str | None) -> None:
    """The release chain: one card per release, holdout first, errata beside."""
    if remote and not mlflow_uri:
        raise click.BadParameter("with --remote the releases come from the deployment's MLflow server: give its URI "
                                 "(--mlflow http://host:port, or set MLFLOW_TRACKING_URI)", param_hint="--mlflow")
    client = any_client(remote, mlflow_uri, task)
    print_releases(client.task, as_json, client=client)
    if not as_json:
        echo_champion_vs_tfidf(client.task, client=client)  # the last line: the champion beside TF-IDF + LR


@click.group("ledger", invoke_without_command=True)
@click.option("--task", default=None, help="The task (default personal_agent; with --remote, the deployment's).")
@click.option("--kind", default=None, help="Only events of this kind (hypothesis_registered, candidate_rejected, ...).")
@click.option("--json", "as_json", is_flag=True)
@remote_options
@click.pass_context
def ledger(ctx: click.Context, task: str | None, kind: str | None, as_json: bool, remote: str | None,
           mlflow_uri: str | None) -> None:
    """Every hypothesis, arm, rejected candidate and release of the task's loop (`envloop ledger verify`: its chain)."""
    from envloop_pipelines.core.ledger.event_log import EVENT_KINDS

    if ctx.invoked_subcommand is not None:
        return
    if kind is not None and kind not in EVENT_KINDS:
        raise click.BadParameter(f"{kind!r} is not a ledger event kind; allowed: {', '.join(EVENT_KINDS)}",
                                 param_hint="--kind")
    echo_ledger(sdk_call(any_client(remote, mlflow_uri, task).ledger, kind), as_json, calibration=kind is None)


@ledger.command("verify")
@click.option("--task", default="personal_agent", show_default=True, help="The task whose ledger is verified.")
def ledger_verify(task: str) -> None:
    """Verify the ledger's hash chain and its head anchored in MLflow; name the first broken link (exit 1)."""
    from envloop_pipelines.core.ledger.anchor import verify_ledger
    from envloop_pipelines.core.ledger.event_log import LedgerError
    from envloop_pipelines.core.ledger.ledger import Ledger
    from envloop_pipelines.core.tracking import MlflowTracker

    try:
        state = verify_ledger(Ledger(task), MlflowTracker())
    except LedgerError as exc:
        raise click.ClickException(str(exc)) from None
    anchored = (f"the head anchored in MLflow ({state['anchored'].split(':')[0]} bytes) is its beginning"
                if state["anchored"] else "no head anchored in MLflow yet")
    click.echo(f"ledger ok: {state['events']} events ({state['chained']} chained), head {state['head'][:16]}; "
               f"{anchored}")


__all__ = ["ledger", "ledger_verify", "releases"]
