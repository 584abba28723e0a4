"""Import direction inside core: a lower package never imports a higher one; a private module stays private.

Every module of each ``from_package`` is parsed (not imported), so an import inside a
function body counts as much as one at the top of the file. Add a rule as one row of
:data:`FORBIDDEN` or :data:`PRIVATE`.
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
    # The SDK and the CLI sit on top: core knows neither, and the SDK does not reach into the CLI built on it.
    ("envloop_pipelines.core", "envloop_pipelines.sdk"),
    ("envloop_pipelines.core", "envloop_pipelines.cli"),
    ("envloop_pipelines.sdk", "envloop_pipelines.cli"),
]


#: (module, owner): no module outside ``owner`` may import ``module``, in the package or in bench/, nor name it
#: in a string (``importlib.import_module``, a ``module:attribute`` plug-in spec).
PRIVATE: list[tuple[str, str]] = [
    # One door to hidden labels (rule 4): every read of test/holdout labels goes through verify_task.
    ("envloop_pipelines.core.verify.labels", "envloop_pipelines.core.verify"),
]
#: Where PRIVATE is checked: the package and the benchmarks (which import it like any user would).
PRIVATE_SCOPE: tuple[Path, ...] = (PACKAGE_ROOT, PACKAGE_ROOT.parent / "bench")


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


def named_in_strings(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, text) of string constants that name ``module`` (``"a.b"``, ``"a.b:attr"``, ``"a.b.c"``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value.strip()
            if text == module or text.startswith((module + ":", module + ".")):
                found.append((node.lineno, text))
    return found


def defined_names(path: Path) -> set[str]:
    """Top-level public functions and classes of a module."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and not n.name.startswith("_")}


def imported_names(path: Path) -> list[tuple[int, str]]:
    """(line, name) of every ``from X import name``, at any depth."""
    return [(node.lineno, alias.name) for node in ast.walk(ast.parse(path.read_text(), filename=str(path)))
            if isinstance(node, ast.ImportFrom) for alias in node.names]


def private_module_violations(module: str, owner: str, roots: tuple[Path, ...],
                              top: Path = PACKAGE_ROOT.parent) -> dict[str, str]:
    """``file:line`` → what it imports or names, for every reach into ``module`` from outside ``owner``.

    A reach is an import of the module (or of a name from it), a string naming it, or an import of
    one of its public names from anywhere else (a re-export by a module that imported it).
    """
    own = top.joinpath(*module.split(".")).with_suffix(".py")
    names = defined_names(own) if own.is_file() else set()
    bad: dict[str, str] = {}
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            if _within(_module_name(path, top), owner):
                continue
            hits = [(line, name) for line, name in imported_modules(path, top) if _within(name, module)]
            hits += named_in_strings(path, module)
            hits += [(line, name) for line, name in imported_names(path) if name in names]
            for line, name in hits:
                bad.setdefault(f"{path.relative_to(top)}:{line}", name)
    return bad


@pytest.mark.parametrize("module, owner", PRIVATE)
def test_private_module_is_imported_only_by_its_owner(module: str, owner: str) -> None:
    assert _modules_of(module) and _modules_of(owner), f"{module} or {owner} has no modules: the rule checks nothing"
    bad = private_module_violations(module, owner, PRIVATE_SCOPE)
    assert bad == {}, f"{module} is private to {owner}:\n" + "\n".join(f"{where} reaches {name}" for where, name in bad.items())


def test_the_private_check_sees_every_way_in(tmp_path: Path) -> None:
    """Control: a reach into the label reader from outside core/verify is caught, at any depth; its owner may."""
    top = tmp_path
    outside = top / "envloop_pipelines" / "core" / "environments" / "leak.py"
    inside = top / "envloop_pipelines" / "core" / "verify" / "door.py"
    bench = top / "bench" / "bench_leak.py"
    for path in (outside, inside, bench):
        path.parent.mkdir(parents=True, exist_ok=True)
    outside.write_text(
        "import importlib\n"
        "def f():\n"
        "    from envloop_pipelines.core.verify.labels import read_hidden_labels\n"
        "    from ..verify import labels\n"
        "    import envloop_pipelines.core.verify.labels as l\n"
        "    return importlib.import_module('envloop_pipelines.core.verify.labels')\n"
        "from envloop_pipelines.core.verify.runner import verify_task\n"  # the door itself is public
    )
    inside.write_text("from envloop_pipelines.core.verify.labels import split_labels\n")
    bench.write_text("from envloop_pipelines.core.verify import labels\n"
                     "from envloop_pipelines.core.verify.runner import split_labels\n")  # a re-export is a reach too
    labels = top / "envloop_pipelines" / "core" / "verify" / "labels.py"
    labels.write_text("def read_hidden_labels(): ...\ndef split_labels(): ...\ndef _helper(): ...\n")
    bad = private_module_violations("envloop_pipelines.core.verify.labels", "envloop_pipelines.core.verify",
                                    (top / "envloop_pipelines", top / "bench"), top)
    assert sorted(bad) == ["bench/bench_leak.py:1", "bench/bench_leak.py:2", "envloop_pipelines/core/environments/leak.py:3",
                           "envloop_pipelines/core/environments/leak.py:4", "envloop_pipelines/core/environments/leak.py:5",
                           "envloop_pipelines/core/environments/leak.py:6"]
