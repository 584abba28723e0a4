"""The CLI's rooms (issue 46): each file one idea and at most 600 lines, as the SDK's (``sdk/test_sdk_rooms.py``);
``cli/round.py`` was 702 lines (the round commands, the loops they drive, the clients, the tables, ``ui`` and the
demo). The split kept every command and its options: the names below are the CLI a person and the docs use.
"""

from __future__ import annotations

from pathlib import Path

import click

import envloop_pipelines

CLI = Path(envloop_pipelines.__file__).resolve().parent / "cli"
MAX_LINES = 600

#: The commands of ``envloop`` and of its ``round`` and ``ledger`` groups, with the options of ``round start``.
COMMANDS = {"data", "demo", "env", "eval", "ledger", "releases", "round", "sandbox", "serve", "train", "ui"}
ROUND_COMMANDS = {"add", "cancel", "retry", "start", "status"}


def test_no_file_of_the_cli_is_over_600_lines() -> None:
    lines = {p.name: len(p.read_text(encoding="utf-8").splitlines()) for p in sorted(CLI.glob("*.py"))}
    long = {name: n for name, n in lines.items() if n > MAX_LINES}
    assert long == {}, f"split these by idea: {long}"
    assert lines["round.py"] <= 450, lines["round.py"]


def test_the_split_kept_every_command_and_the_round_starts_options() -> None:
    from envloop_pipelines.cli import main

    assert set(main.commands) == COMMANDS  # type: ignore[attr-defined]
    round_group: click.Group = main.commands["round"]  # type: ignore[attr-defined,assignment]
    assert set(round_group.commands) == ROUND_COMMANDS
    assert set(main.commands["ledger"].commands) == {"verify"}  # type: ignore[attr-defined]
    start = {opt for p in round_group.commands["start"].params for opt in getattr(p, "opts", [])}
    assert {"--rounds", "--patience", "--max-wall-s", "--hypothesis", "--remote", "--mlflow", "--recipe-override",
            "--noise-arms", "--task", "--home"} <= start
