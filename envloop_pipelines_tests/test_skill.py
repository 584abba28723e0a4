"""The usage skill for coding agents (``envloop_pipelines/SKILL.md``) is true: every command it shows runs.

Each line of each ``bash`` block runs through ``bash`` in a fresh working directory, in document
order (the ``export`` lines carry over), with the venv's ``envloop`` first on ``PATH``. A trailing
``# → TEXT`` comment is text the output must contain, ``# exit N`` the exit status (0 otherwise).
After the round, every path of the table "What a round leaves" exists.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from importlib import resources
from pathlib import Path

import pytest

import envloop_pipelines

ROOT = Path(__file__).resolve().parents[1]
SKILL = Path(envloop_pipelines.__file__).parent / "SKILL.md"


def _commands() -> list[tuple[int, str, int, str | None]]:
    """``(line number, command, exit status, text the output contains)`` of every bash block line."""
    out, in_block = [], False
    for number, line in enumerate(SKILL.read_text(encoding="utf-8").split("\n"), start=1):
        if line.startswith("```"):
            in_block = line.strip() == "```bash" if not in_block else False
            continue
        if not in_block or not line.strip() or line.lstrip().startswith("#"):
            continue
        command, _, comment = line.partition("  # ")
        m = re.fullmatch(r"\s*(?:exit (\d+))?\s*(?:→\s*(.*?))?\s*", comment)
        assert m, f"SKILL.md:{number}: a comment is `# → TEXT`, `# exit N` or `# exit N → TEXT`"
        out.append((number, command.strip(), int(m[1] or 0), m[2] or None))
    return out


def test_the_skill_ships_with_the_package() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert "SKILL.md" in pyproject["tool"]["setuptools"]["package-data"]["envloop_pipelines"]
    assert (resources.files("envloop_pipelines") / "SKILL.md").is_file()


def test_the_skill_is_short_and_every_line_of_its_blocks_is_checked() -> None:
    text = SKILL.read_text(encoding="utf-8")
    assert len(text.split()) < 1200, "a skill is read in one go: keep it short"
    commands = _commands()
    assert any("round start" in c for _, c, _, _ in commands)
    assert all(c.startswith(("envloop ", "export ")) for _, c, _, _ in commands), "the skill teaches the CLI"
    assert all(expect or code == 0 for _, c, code, expect in commands if not c.startswith("export")), (
        "every failing command says what its message contains")


@pytest.mark.slow
def test_every_command_of_the_skill_runs(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items()
           if k not in ("DAGSTER_HOME", "MLFLOW_TRACKING_URI", "ENVLOOP_HOME", "ENVLOOP_REMOTE", "ENVLOOP_PROGRESS")
           and not k.startswith("ENVLOOP_")}
    env.update(PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1")
    exports: list[str] = []
    for number, command, code, expect in _commands():
        script = "\n".join([*exports, command])
        done = subprocess.run(["bash", "-c", script], cwd=work, env=env, capture_output=True, text=True, timeout=900)
        output = done.stdout + done.stderr
        assert done.returncode == code, f"SKILL.md:{number}: `{command}` exited {done.returncode}, not {code}:\n{output[-3000:]}"
        if expect is not None:
            assert expect in output, f"SKILL.md:{number}: `{command}` does not print {expect!r}:\n{output[-3000:]}"
        if command.startswith("export "):
            exports.append(command)
    home = work / ".envloop"
    table = SKILL.read_text(encoding="utf-8").split("## What a round leaves", 1)[1].split("\n## ", 1)[0]
    paths = [p for row in re.findall(r"^\| (.+?) \|", table, flags=re.MULTILINE) for p in re.findall(r"`([^`]+)`", row)]
    assert len(paths) >= 8, paths
    for path in paths:
        found = list(home.glob(path.replace("<sha256>", "*").rstrip("/")))
        assert found, f"SKILL.md: a round leaves {path} under $ENVLOOP_HOME, but {home} has none"
