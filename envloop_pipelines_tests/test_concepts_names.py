"""docs/concepts.md's table of the recipe change's spellings, checked against the code.

Each spelling in the CLI, config and SDK columns exists (Click options, ``LoopConfig`` fields and
environment variables, SDK signatures); each old spelling of the last column is read only in the
files that column names (the edge); the loop override's old spellings (``--override``,
``recipe_overrides_json``) are read nowhere (issue 36: one spelling from the flag to the recipe).
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

import envloop_pipelines

REPO = Path(__file__).resolve().parents[1]
PACKAGE = Path(envloop_pipelines.__file__).resolve().parent
CONCEPTS = REPO / "docs" / "concepts.md"
HEADER = "| concept | CLI | config | SDK | old spelling (read only in) |"

#: How an old spelling is found in Python source (a bare substring would match its new neighbours).
OLD_PATTERNS = {
    "--override": r"""["']--override["']""",
    "recipe_overrides_json": r"recipe_overrides_json",
    "change.recipe_overrides": (r"""["']recipe_overrides["']\s+(not\s+)?in\s+change|change(\.get\(|\[)\s*["']"""
                                r"""recipe_overrides|OLD_RECIPE_DIFF\s*=\s*["']recipe_overrides"""),
}


def _table() -> dict[str, dict[str, str]]:
    lines = CONCEPTS.read_text(encoding="utf-8").splitlines()
    start = lines.index(HEADER)
    columns = [c.strip() for c in HEADER.strip("|").split("|")]
    rows = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = dict(zip(columns, cells))
    return rows


def _code(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def _old_spellings(cell: str) -> dict[str, set[str]]:
    """``{old spelling: {files of the edge}}`` from the last column: each ``old`` (``file``, ...) group."""
    out: dict[str, set[str]] = {}
    for old, where in re.findall(r"`([^`]+)` \(([^)]*)\)", cell):
        out[old] = set(re.findall(r"`([\w/]+\.py)`", where))
    return out


def _params(command: click.Command) -> dict[str, click.Parameter]:
    return {opt: p for p in command.params for opt in getattr(p, "opts", [])}


def test_the_table_has_the_two_recipe_changes() -> None:
    assert set(_table()) == {"loop recipe override", "hypothesis recipe change"}


def test_the_cli_spellings_are_the_commands_options() -> None:
    from envloop_pipelines.cli import main

    row = _table()["loop recipe override"]
    flag = _code(row["CLI"])[0].split()[0]
    commands = {" ".join(c.split()[1:]) for c in _code(row["CLI"])[1:]}
    assert commands == {"round start", "train"}
    for path in commands:
        cmd: click.Command = main
        for part in path.split():
            cmd = cmd.commands[part]  # type: ignore[attr-defined]
        params = _params(cmd)
        assert flag in params and params[flag].name == "recipe_overrides" and not params[flag].hidden
        assert "--override" not in params  # the old spelling is gone
    hyp = _code(_table()["hypothesis recipe change"]["CLI"])[0].split()[0]
    assert hyp in _params(main.commands["round"].commands["start"])  # type: ignore[attr-defined]


def test_the_config_spellings_are_loopconfig_and_its_environment() -> None:
    from envloop_pipelines.core.ledger.hypothesis import RECIPE_DIFF
    from envloop_pipelines.core.loop.config import LoopConfig, loop_fields, settings_from_env

    field, env = _code(_table()["loop recipe override"]["config"])
    assert field.startswith("LoopConfig.") and field.split(".")[1] in {f.name for f in loop_fields()}
    assert LoopConfig.from_settings(settings_from_env({env: '{"max_steps": 3}'})).recipe_overrides == {"max_steps": 3}
    (change,) = _code(_table()["hypothesis recipe change"]["config"])
    assert change == f"change.{RECIPE_DIFF}"


def test_the_sdk_spellings_are_the_clients_signatures() -> None:
    from envloop_pipelines.sdk.client import Client
    from envloop_pipelines.sdk.local import LocalClient

    local, remote = _code(_table()["loop recipe override"]["SDK"])
    assert local.startswith("LocalClient(loop_settings=") and '"recipe_overrides"' in local
    assert "loop_settings" in inspect.signature(LocalClient).parameters
    # the remote client takes the override as the local one does (issue 46), and reports the one its runs take
    assert remote.startswith("Client(url, loop_settings=") and '"recipe_overrides"' in remote
    assert "loop_settings" in inspect.signature(Client).parameters and callable(Client.loop_settings)
    assert (inspect.signature(Client).parameters["loop_settings"].annotation
            == inspect.signature(LocalClient).parameters["loop_settings"].annotation)
    (start,) = _code(_table()["hypothesis recipe change"]["SDK"])
    assert start.startswith("Client.start_round(") and '"recipe_diff"' in start
    assert "hypothesis" in inspect.signature(Client.start_round).parameters


@pytest.mark.parametrize("concept", ["hypothesis recipe change"])
def test_old_spellings_are_read_only_at_the_edge(concept: str) -> None:
    olds = _old_spellings(_table()[concept]["old spelling (read only in)"])
    assert olds, concept
    for old, edge in olds.items():
        pattern = re.compile(OLD_PATTERNS[old])
        found = {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if pattern.search(p.read_text())}
        assert found == edge, f"{old}: read in {sorted(found)}, the table names {sorted(edge)}"
        bench = [p.name for p in (REPO / "bench").rglob("*.py") if pattern.search(p.read_text())]
        assert not bench, f"{old}: the benches spell it in {bench}"


def test_the_loop_override_has_no_old_spelling_left() -> None:
    """Issue 36: ``--override`` and ``recipe_overrides_json`` are read nowhere, in the package or the benches."""
    cell = _table()["loop recipe override"]["old spelling (read only in)"]
    assert cell.startswith("none") and _old_spellings(cell) == {}
    for old in ("--override", "recipe_overrides_json"):
        pattern = re.compile(OLD_PATTERNS[old])
        found = [str(p.relative_to(REPO)) for folder in (PACKAGE, REPO / "bench") for p in folder.rglob("*.py")
                 if pattern.search(p.read_text())]
        assert found == [], f"{old} is still spelled in {found}"


def test_the_old_flag_is_refused_naming_the_new_one() -> None:
    """``--override`` is a usage error (exit 2) that points at ``--recipe-override``; the new flag works."""
    from envloop_pipelines.cli.options import loop_options, loop_settings, recipe_override_option

    seen = {}

    @click.command()
    @loop_options
    def start(**options: object) -> None:
        seen["loop"] = loop_settings(options)

    @click.command()
    @recipe_override_option
    def train(recipe_overrides: tuple[str, ...]) -> None:
        seen["train"] = recipe_overrides

    runner = CliRunner()
    for command, args in ((start, ["--override", "max_steps=2"]), (train, ["--override", "lr=0.1"])):
        res = runner.invoke(command, args)
        assert res.exit_code == 2 and "No such option '--override'" in res.output and "--recipe-override" in res.output
    res = runner.invoke(start, ["--recipe-override", "max_length=64", "--recipe-override", "max_steps=3"])
    assert res.exit_code == 0, res.output
    assert seen["loop"]["recipe_overrides"] == {"max_steps": 3, "max_length": 64}
    res = runner.invoke(train, ["--recipe-override", "lr=0.1"])
    assert res.exit_code == 0 and seen["train"] == ("lr=0.1",)


def test_the_benches_parser_has_the_same_flag(capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from envloop_pipelines.cli.options import add_recipe_override_argument, parse_recipe_overrides

    parser = argparse.ArgumentParser()
    add_recipe_override_argument(parser, default=["max_steps=24"])
    assert "--recipe-override" in parser.format_help() and "--override" not in parser.format_help()
    args = parser.parse_args(["--recipe-override", "max_length=64"])
    assert parse_recipe_overrides(tuple(args.override)) == {"max_steps": 24, "max_length": 64}
    assert "deprecated" not in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse's usage error: the old spelling is gone
        parser.parse_args(["--override", "lexical=true"])
    assert "unrecognized arguments: --override" in capsys.readouterr().err
