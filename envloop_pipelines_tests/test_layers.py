"""Layering: core never imports Dagster; envloop_pipelines.testing never imports pytest; the Definitions object loads."""

from __future__ import annotations

import json
import subprocess
import sys


def modules_loaded_by(package: str) -> list[str]:
    """``sys.modules`` of a fresh interpreter that imported ``package`` and every module in it."""
    code = (
        "import importlib, json, pkgutil, sys\n"
        f"package = importlib.import_module({package!r})\n"
        "for m in pkgutil.walk_packages(package.__path__, package.__name__ + '.'):\n"
        "    importlib.import_module(m.name)\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def test_core_imports_without_dagster() -> None:
    loaded = modules_loaded_by("envloop_pipelines.core")
    assert [k for k in loaded if k == "dagster" or k.startswith("dagster.") or k.startswith("dagster_")] == []
    assert "envloop_pipelines.core.decision_loop.noise_floor" in loaded


def test_the_shared_test_helpers_import_without_pytest() -> None:
    """``envloop_pipelines.testing`` is what bench/ imports: it loads in a fresh interpreter, no pytest, no tests."""
    loaded = modules_loaded_by("envloop_pipelines.testing")
    assert [k for k in loaded if k.split(".")[0] in ("pytest", "_pytest", "envloop_pipelines_tests")] == []
    assert len([k for k in loaded if k.startswith("envloop_pipelines.testing.")]) == 4


def test_definitions_load() -> None:
    import dagster as dg

    from envloop_pipelines.definitions import defs as load_code_location
    defs = load_code_location()

    assert isinstance(defs, dg.Definitions)
    defs.get_repository_def()  # resolves: a broken graph raises here
