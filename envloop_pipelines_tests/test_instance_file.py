"""One Dagster instance file, ``dagster.yaml`` at the repository's top level, for every entry point.

``envloop_pipelines/dagster.yaml`` is a link to it (so an installed package carries its content, not a copy
that drifts); the CLI, the SDK's LocalClient and Dagster's own CLI (through ``$DAGSTER_HOME``) read it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TOP = REPO / "dagster.yaml"


def test_one_instance_file_at_the_top_level() -> None:
    found = [p for p in REPO.rglob("dagster.yaml")
             if not any(part.startswith(".") or part in ("build", "dist") for part in p.relative_to(REPO).parts[:-1])]
    files = [p for p in found if not p.is_symlink()]
    assert files == [TOP], f"one dagster.yaml, at the top level: {files}"
    link = REPO / "envloop_pipelines" / "dagster.yaml"
    assert link.is_symlink() and link.resolve() == TOP.resolve()


def test_every_entry_point_resolves_the_same_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from envloop_pipelines.cli import ui as cli_ui
    from envloop_pipelines.sdk import instance

    assert instance.INSTANCE_FILE.resolve() == TOP.resolve()
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster"))
    home = cli_ui.dagster_home()  # what `envloop round`, `envloop demo` and `envloop ui` call
    assert (home / "dagster.yaml").read_bytes() == TOP.read_bytes()
    assert instance.dagster_home() == home  # the SDK's LocalClient: the same home, the same file
    # Dagster's own CLI reads $DAGSTER_HOME/dagster.yaml: the instance it builds has the file's settings.
    code = "import dagster as dg; i = dg.DagsterInstance.get(); print(i.run_retries_enabled, i.run_retries_max_retries)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "DAGSTER_HOME": str(home)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "1"]


def test_the_package_and_the_image_carry_it(tmp_path: Path) -> None:
    """package-data names it, the Dockerfile copies it, and a built wheel holds its bytes (not a dangling link)."""
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "dagster.yaml" in pyproject["tool"]["setuptools"]["package-data"]["envloop_pipelines"]
    copies = [line for line in (REPO / "Dockerfile").read_text().splitlines() if line.startswith("COPY ")]
    assert any("dagster.yaml" in line.split()[1:-1] for line in copies), copies
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "dagster.yaml"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "envloop_pipelines", src / "envloop_pipelines", symlinks=True,
                    ignore=shutil.ignore_patterns("__pycache__"))
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    with zipfile.ZipFile(wheel) as z:
        assert z.read("envloop_pipelines/dagster.yaml") == TOP.read_bytes()
