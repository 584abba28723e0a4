"""Layering: core never imports Dagster; envloop_pipelines.testing never imports pytest; the Definitions object loads."""

from __future__ import annotations

import subprocess
import sys


def test_core_imports_without_dagster() -> None:
    code = (
        "import importlib, pkgutil, sys\n"
        "import envloop_pipelines.core as core\n"
        "for m in pkgutil.walk_packages(core.__path__, 'envloop_pipelines.core.'):\n"
        "    importlib.import_module(m.name)\n"
        "bad = sorted(k for k in sys.modules if k == 'dagster' or k.startswith('dagster.') or k.startswith('dagster_'))\n"
        "assert not bad, bad\n"
        "print('ok', len([k for k in sys.modules if k.startswith('envloop_pipelines.core')]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok")


def test_the_shared_test_helpers_import_without_pytest() -> None:
    """``envloop_pipelines.testing`` is what bench/ imports: it loads in a fresh interpreter, no pytest, no tests."""
    code = (
        "import importlib, pkgutil, sys\n"
        "import envloop_pipelines.testing as testing\n"
        "for m in pkgutil.walk_packages(testing.__path__, 'envloop_pipelines.testing.'):\n"
        "    importlib.import_module(m.name)\n"
        "bad = sorted(k for k in sys.modules if k.split('.')[0] in ('pytest', '_pytest', 'envloop_pipelines_tests'))\n"
        "assert not bad, bad\n"
        "print('ok', len([k for k in sys.modules if k.startswith('envloop_pipelines.testing.')]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ok", "4"]


def test_definitions_load() -> None:
    import dagster as dg

    from envloop_pipelines.definitions import defs as load_code_location
    defs = load_code_location()

    assert isinstance(defs, dg.Definitions)
    defs.get_repository_def()  # resolves: a broken graph raises here
