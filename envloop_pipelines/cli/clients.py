"""The clients a command drives, and what their errors become on the command line.

``--remote URL`` gives the SDK's client of a deployment (:func:`remote_client`), else this home's ``LocalClient``
(:func:`local_client`); both are a :class:`~envloop_pipelines.sdk.protocol.LoopClient`. An SDK error becomes the
command's (:func:`sdk_call`): exit status 1, or 2 (:class:`Busy`) while another run of the task's loop holds it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import click


def local_client(settings: dict[str, Any] | None = None, task: str | None = None, door: str | None = None) -> Any:
    """The in-process client of this home (the loop resource built once, here); a bad setting is a bad option.
    ``door``: the command, as a round claim names it to the doors it refuses."""
    from envloop_pipelines.sdk.local import LocalClient

    try:
        return LocalClient(settings, task=task, notify=click.echo, door=door)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


class Busy(click.ClickException):
    """Another run of the task's loop (its setup or a round) holds the claim: one line naming it, exit status 2."""

    exit_code = 2


def refused(exc: Exception) -> click.ClickException:
    """The command's error for an SDK error: :class:`Busy` (exit 2) for a busy loop, else exit 1."""
    from envloop_pipelines.sdk.errors import BusyError

    return Busy(str(exc)) if isinstance(exc, BusyError) else click.ClickException(str(exc))


def remote_client(remote: str, mlflow_uri: str | None, task: str | None = None, *, probe: bool = False,
                  recipe_overrides: Mapping[str, Any] | None = None) -> Any:
    """The SDK's client of a deployment; refuses a ``--task`` that is not the deployment's. With ``probe`` (the
    commands that start work) its servers are probed first: a dead one fails in seconds, in one line.
    ``recipe_overrides`` (``--recipe-override``, checked by its parser) go to the client's runs, on top of the
    deployment's (``Client(loop_settings={"recipe_overrides": ...})``)."""
    from click.core import ParameterSource

    from envloop_pipelines.sdk.client import Client
    from envloop_pipelines.sdk.errors import ClientError

    ctx = click.get_current_context(silent=True)
    from_env = ctx is not None and ctx.get_parameter_source("mlflow_uri") == ParameterSource.ENVIRONMENT
    try:
        client = Client(remote, mlflow_uri, mlflow_setting="MLFLOW_TRACKING_URI" if from_env or not mlflow_uri
                        else "--mlflow", loop_settings={"recipe_overrides": dict(recipe_overrides)}
                        if recipe_overrides else None)
    except ClientError as exc:
        raise click.BadParameter(str(exc).removeprefix("dagster_url: "), param_hint="--remote") from None
    if probe:
        sdk_call(client.probe)  # before any work: a dead --mlflow fails now, not after a round
    try:
        if task is not None and client.task != task:  # client.task asks the deployment: a wrong URL fails here
            raise click.BadParameter(f"the deployment at {remote} runs task {client.task!r}, not {task!r}",
                                     param_hint="--task")
    except ClientError as exc:
        raise click.ClickException(str(exc)) from None
    return client


def any_client(remote: str | None, mlflow_uri: str | None, task: str | None) -> Any:
    """The client a command drives (a :class:`~envloop_pipelines.sdk.protocol.LoopClient`): the deployment's
    with ``--remote``, else this home's (``--task``, default personal_agent)."""
    return remote_client(remote, mlflow_uri, task) if remote else local_client(task=task)


def sdk_call(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Call the SDK; its errors become the command's (exit 1; exit 2 when the task's loop is busy)."""
    from envloop_pipelines.sdk.errors import ClientError

    try:
        return fn(*args, **kwargs)
    except ClientError as exc:
        raise refused(exc) from None


def read_hypothesis(hypothesis_file: Path | None) -> dict[str, Any] | None:
    """A person's hypothesis file, checked (every problem named) before anything runs."""
    from envloop_pipelines.core.decision_loop.proposals import ProposalError, parse_proposal

    try:
        return parse_proposal(hypothesis_file)
    except ProposalError as exc:
        raise click.BadParameter(str(exc), param_hint="--hypothesis") from None


__all__ = ["Busy", "any_client", "local_client", "read_hypothesis", "refused", "remote_client", "sdk_call"]
