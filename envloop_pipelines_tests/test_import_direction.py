"""Import direction inside core: a lower package never imports a higher one.

Every module of each ``from_package`` is parsed (not imported), so an import inside a
function body counts as much as one at the top of the file. Add a rule as one row of
:data:`FORBIDDEN`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import envloop_pipelines

PACKAGE_ROOT = Path(envloop_pipelines.__file__).resolve().parent

#: (from_package, to_package): no module under ``from_package`` may import ``to_package`` or anything in it.
FORBIDDEN: list[tuple[str, str]] = [
    ("envloop_pipelines.core.sandbox", "envloop_pipelines.core.verify"),  # the sandbox sits below the verifier
]


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path, root: Path = PACKAGE_ROOT.parent) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file, at any depth, relative ones resolved.

    ``from a.b import c`` yields both ``a.b`` and ``a.b.c`` (``c`` may be a submodule).
    ``root`` is the folder that holds the top-level package.
    """
    module = _module_name(path, root)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names if alias.name != "*"]
    return found


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _modules_of(package: str) -> list[Path]:
    folder = PACKAGE_ROOT.parent.joinpath(*package.split("."))
    return sorted(folder.rglob("*.py")) if folder.is_dir() else [folder.with_suffix(".py")]


@pytest.mark.parametrize("from_package, to_package", FORBIDDEN)
def test_no_upward_import(from_package: str, to_package: str) -> None:
    modules = _modules_of(from_package)
    assert modules and all(p.is_file() for p in modules), f"{from_package} has no modules: the rule checks nothing"
    bad: dict[str, str] = {}  # one line per import statement
    for path in modules:
        for line, name in imported_modules(path):
            if _within(name, to_package):
                bad.setdefault(f"{path.relative_to(PACKAGE_ROOT.parent)}:{line}", name)
    assert bad == {}, f"{from_package} must not import {to_package}:\n" + "\n".join(
        f"{where} imports {name}" for where, name in bad.items())


def test_the_parser_sees_function_level_and_relative_imports(tmp_path: Path) -> None:
    """Control: the check catches each way a module can import the forbidden package."""
    fake_root = tmp_path / "envloop_pipelines"
    module = fake_root / "core" / "sandbox" / "leak.py"
    module.parent.mkdir(parents=True)
    module.write_text(
        "import os\n"
        "def f():\n"
        "    from envloop_pipelines.core.verify.runner import VerifierRunner\n"
        "    import envloop_pipelines.core.verify.worker\n"
        "    from ..verify import protocol\n"
        "    from .. import verify\n"
        "    from envloop_pipelines.core.verifyish import x\n"
    )
    hits = [(line, name) for line, name in imported_modules(module, tmp_path)
            if _within(name, "envloop_pipelines.core.verify")]
    assert sorted({line for line, _ in hits}) == [3, 4, 5, 6]
