"""The ``envloop`` command: one group, its subcommands in the modules of this package."""

from __future__ import annotations

import logging

import click


@click.group()
@click.option("-v", "--verbose", is_flag=True, help="Log at INFO level.")
def main(verbose: bool) -> None:
    """EnvLoop pipelines: typed decision models and the self-improvement loop."""
    from envloop_pipelines.console import quiet_third_party
    from envloop_pipelines.core.progress import configure_command_line

    quiet_third_party()  # before any subcommand imports transformers, DeepSpeed or Dagster

    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    configure_command_line()  # a bar on a terminal; a line every few percent or 30 s on stderr otherwise


def _register_subcommands() -> None:
    from envloop_pipelines.cli.data import data
    from envloop_pipelines.cli.demo import demo
    from envloop_pipelines.cli.env import env, export_command, generate, import_command, list_command, show_command
    from envloop_pipelines.cli.env_audit import audit_command
    from envloop_pipelines.cli.env_eval import compare_command, eval_command, traces
    from envloop_pipelines.cli.ledger import ledger, releases
    from envloop_pipelines.cli.model import evaluate, train
    from envloop_pipelines.cli.round import round_group
    from envloop_pipelines.cli.sandbox import sandbox
    from envloop_pipelines.cli.serve import serve
    from envloop_pipelines.cli.ui import ui

    main.add_command(data)
    main.add_command(env)
    env.add_command(list_command)
    env.add_command(show_command)
    env.add_command(generate)
    env.add_command(export_command)
    env.add_command(import_command)
    env.add_command(eval_command)
    env.add_command(compare_command)
    env.add_command(traces)
    env.add_command(audit_command)
    main.add_command(sandbox)
    main.add_command(serve)
    main.add_command(train)
    main.add_command(evaluate)
    for command in (round_group, releases, ledger, ui, demo):
        main.add_command(command)


_register_subcommands()

if __name__ == "__main__":  # pragma: no cover
    main()
