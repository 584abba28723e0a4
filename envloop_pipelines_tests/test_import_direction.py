"""Import direction inside core: a lower package never imports a higher one; a private module stays private.

Every module of each ``from_package`` is parsed (not imported), so an import inside a
function body counts as much as one at the top of the file. Add a rule as one row of
:data:`FORBIDDEN` or :data:`PRIVATE`. No two files of the package import each other, directly
or round a circle, and bench/ never imports the tests.
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
    # Core is the pure domain: it never reaches up into the Dagster layer, its resources or their composition.
    ("envloop_pipelines.core", "envloop_pipelines.defs"),
    ("envloop_pipelines.core", "envloop_pipelines.resources"),
    ("envloop_pipelines.core", "envloop_pipelines.definitions"),
    # The two up-arrows of issue 25, pinned by name (CORE_FLOORS forbids them too): the RL loop is handed its
    # policy server, and the data layer does not import the benchmark generator that stands on it.
    ("envloop_pipelines.core.rl_loop", "envloop_pipelines.core.serve"),
    ("envloop_pipelines.core.data", "envloop_pipelines.core.benchmark"),
    # The two wings share only what sits below them (core/ledger, core/release), never each other.
    ("envloop_pipelines.core.decision_loop", "envloop_pipelines.core.rl_loop"),
    ("envloop_pipelines.core.rl_loop", "envloop_pipelines.core.decision_loop"),
    # What the tests and the benches share (envloop_pipelines/testing) stands on the package; the pipeline never
    # imports it, and it never imports pytest (a bench script imports it as any user would).
    ("envloop_pipelines.core", "envloop_pipelines.testing"),
    ("envloop_pipelines.defs", "envloop_pipelines.testing"),
    ("envloop_pipelines.resources", "envloop_pipelines.testing"),
    ("envloop_pipelines.sdk", "envloop_pipelines.testing"),
    ("envloop_pipelines.cli", "envloop_pipelines.testing"),
    ("envloop_pipelines.testing", "pytest"),
    ("envloop_pipelines.testing", "envloop_pipelines_tests"),
]

#: DESIGN's floors inside core, bottom to top: a folder (or top-level module) of core imports only folders on a
#: floor below its own; folders on one floor do not import each other. Every folder and module of core is on a
#: floor (a new one is placed here on purpose). DESIGN's map: the ground (storage, metrics, tracking, records) <
#: model, benchmark, splits < serve, loop, verify; the ledger sits under the verifier, whose one door to hidden
#: labels opens the task's own ledger, and publishing (core/release) above it.
CORE_FLOORS: list[tuple[str, ...]] = [
    ("storage", "metrics", "tokens", "fractions", "progress", "services"),  # the ground floor; probing a server
    ("tracking", "data"),                                       # MLflow behind a protocol; records, splits, snapshots
    ("benchmark", "model", "sandbox"),                          # the generator; readouts and training; the sandbox
    ("baseline", "ledger"),                                     # TF-IDF; the ledger, the loop's files, hypotheses, gate
    ("loop",),                                                  # the loop's rules: settings, budget, promotion, claim
    ("verify",),                                                # the verifier (opens the ledger for hidden reads)
    ("environments", "serve", "release"),                       # environments; serving; publishing a release
    ("agents",),                                                # agents on environments
    ("decision_loop", "rl_loop"),                               # the two wings
]


#: (module, owner): no module outside ``owner`` may import ``module``, in the package or in bench/, nor name it
#: in a string (``importlib.import_module``, a ``module:attribute`` plug-in spec).
PRIVATE: list[tuple[str, str]] = [
    # One door to hidden labels (rule 4): every read of test/holdout labels goes through verify_task.
    ("envloop_pipelines.core.verify.labels", "envloop_pipelines.core.verify"),
]
#: Where PRIVATE is checked: the package and the benchmarks (which import it like any user would).
PRIVATE_SCOPE: tuple[Path, ...] = (PACKAGE_ROOT, PACKAGE_ROOT.parent / "bench")

#: The benchmarks stand on the package (``envloop_pipelines.testing`` for what they share with the tests), not on
#: the tests.
BENCH_ROOT = PACKAGE_ROOT.parent / "bench"
TESTS_PACKAGE = "envloop_pipelines_tests"


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


def core_units(top: Path = PACKAGE_ROOT.parent) -> list[str]:
    """The folders and top-level modules of ``envloop_pipelines/core`` (the units CORE_FLOORS places)."""
    core = top / "envloop_pipelines" / "core"
    return sorted(p.stem for p in core.iterdir()
                  if (p.is_dir() and (p / "__init__.py").is_file()) or (p.suffix == ".py" and p.name != "__init__.py"))


def core_imports(top: Path = PACKAGE_ROOT.parent) -> dict[tuple[str, str], str]:
    """(from unit, to unit) → the first ``file:line`` of that import, for every import between two units of core."""
    edges: dict[tuple[str, str], str] = {}
    core = top / "envloop_pipelines" / "core"
    for path in sorted(core.rglob("*.py")):
        rel = path.relative_to(core).parts
        if rel == ("__init__.py",):
            continue
        unit = Path(rel[0]).stem
        for line, name in imported_modules(path, top):
            parts = name.split(".")
            if parts[:2] == ["envloop_pipelines", "core"] and len(parts) > 2 and parts[2] != unit:
                edges.setdefault((unit, parts[2]), f"{path.relative_to(top)}:{line}")
    return edges


def floor_violations(edges: dict[tuple[str, str], str], floors: list[tuple[str, ...]]) -> list[str]:
    """Every import that does not point to a lower floor, as ``file:line: a (floor i) imports b (floor j)``."""
    floor = {unit: i for i, units in enumerate(floors) for unit in units}
    return [f"{where}: {a} (floor {floor.get(a)}) imports {b} (floor {floor.get(b)})"
            for (a, b), where in sorted(edges.items())
            if a in floor and b in floor and floor[b] >= floor[a]]


def cycles(edges: dict[tuple[str, str], str]) -> list[list[str]]:
    """The import cycles between units (each as a path that comes back to its start), by depth-first search."""
    graph: dict[str, list[str]] = {}
    for a, b in sorted(edges):
        graph.setdefault(a, []).append(b)
    found: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the stack, 2: done

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in graph.get(node, []):
            if state.get(nxt) == 1:
                found.append(stack[stack.index(nxt):] + [node, nxt] if nxt in stack else [node, nxt])
            elif nxt not in state:
                visit(nxt, stack + [node])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    return found


def write_tree(root: Path, files: dict[str, str]) -> None:
    """Write each ``relative path: text`` under ``root``, with an empty ``__init__.py`` beside every file."""
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        (path.parent / "__init__.py").touch()
        path.write_text(text)


def test_every_unit_of_core_is_on_one_floor() -> None:
    placed = [unit for units in CORE_FLOORS for unit in units]
    assert len(placed) == len(set(placed)), f"a unit on two floors: {sorted(u for u in placed if placed.count(u) > 1)}"
    units = core_units()
    assert sorted(set(units) - set(placed)) == [], "place each new folder or module of core on a floor in CORE_FLOORS"
    assert sorted(set(placed) - set(units)) == [], "CORE_FLOORS names a unit core does not have"


def test_core_imports_point_down_the_floors() -> None:
    bad = floor_violations(core_imports(), CORE_FLOORS)
    assert bad == [], "an import in core that does not point to a lower floor:\n" + "\n".join(bad)


def test_no_import_cycle_between_cores_folders() -> None:
    assert cycles(core_imports()) == []


def test_the_floor_check_sees_an_up_arrow_and_a_cycle(tmp_path: Path) -> None:
    """Control: an up-arrow (data → benchmark) and a sideways import between wings are caught, with the cycle."""
    core = tmp_path / "envloop_pipelines" / "core"
    files = {
        "data/datasets.py": "def f():\n    from envloop_pipelines.core.benchmark import generate_benchmark\n",
        "benchmark/generator.py": "from ..data import splits\n",
        "decision_loop/x.py": "from envloop_pipelines.core.rl_loop.rl_round import run_rl_round\n",
        "rl_loop/rl_round.py": "from envloop_pipelines.core.ledger import ledger\n",
        "ledger/ledger.py": "import envloop_pipelines.core.storage\n",
        "storage.py": "",
    }
    write_tree(core, files)
    edges = core_imports(tmp_path)
    assert sorted(edges) == [("benchmark", "data"), ("data", "benchmark"), ("decision_loop", "rl_loop"),
                             ("ledger", "storage"), ("rl_loop", "ledger")]
    bad = floor_violations(edges, CORE_FLOORS)
    assert [line.split(": ", 1)[1] for line in bad] == ["data (floor 1) imports benchmark (floor 2)",
                                                         "decision_loop (floor 8) imports rl_loop (floor 8)"]
    assert cycles(edges) == [["benchmark", "data", "benchmark"]]


def module_files(top: Path = PACKAGE_ROOT.parent, package: str = "envloop_pipelines") -> dict[str, Path]:
    """Module name → file, for every module of ``package`` under ``top`` (a package is its ``__init__.py``)."""
    return {_module_name(path, top): path for path in sorted(top.joinpath(*package.split(".")).rglob("*.py"))}


def file_imports(top: Path = PACKAGE_ROOT.parent, package: str = "envloop_pipelines") -> dict[tuple[str, str], str]:
    """(from file, to file) → the first ``file:line`` of that import, for every import between files of ``package``.

    Every import counts, at any depth (:func:`imported_files`).
    """
    files = module_files(top, package)
    edges: dict[tuple[str, str], str] = {}
    for path in files.values():
        source = str(path.relative_to(top))
        for line, target in imported_files(path, files, top):
            if target != path:
                edges.setdefault((source, str(target.relative_to(top))), f"{source}:{line}")
    return edges


def imported_files(path: Path, files: dict[str, Path], top: Path = PACKAGE_ROOT.parent) -> list[tuple[int, Path]]:
    """(line, file) of every import in ``path`` of one of ``files`` (module name → file), at any depth.

    A name of :func:`imported_modules` is a file only where that file exists. ``from a.b import c, d`` imports
    a.b's ``__init__`` when one of the names is defined there; when every name is a submodule it imports only
    them: the package's ``__init__`` runs on the way, as for ``import a.b.c``, which is not counted either.
    """
    names = imported_modules(path, top)
    on_line: dict[int, set[str]] = {}
    for line, name in names:
        on_line.setdefault(line, set()).add(name)

    def only_a_parent(line: int, name: str) -> bool:
        children = [n for n in on_line[line] if n.startswith(name + ".") and "." not in n[len(name) + 1:]]
        return bool(children) and all(n in files for n in children)

    return [(line, files[name]) for line, name in names if name in files and not only_a_parent(line, name)]


def test_no_import_cycle_between_files() -> None:
    edges = file_imports()
    assert len({a for a, _ in edges}) > 100, "the import graph is nearly empty: the check reads nothing"
    found = cycles(edges)
    assert found == [], "files that import each other, directly or round a circle (break it by moving what both " \
                        "need to a lower module, not by an import inside a function):\n" + "\n".join(
        " -> ".join(cycle) + "\n    " + ", ".join(edges[(a, b)] for a, b in zip(cycle, cycle[1:]))
        for cycle in found)


def test_the_file_cycle_check_sees_a_circle_hidden_in_a_function(tmp_path: Path) -> None:
    """Control: two files that import each other, one from inside a function, are a cycle; a straight line is not.

    ``from package import submodule`` is an edge to the submodule only; a name defined in the ``__init__`` is one to it.
    """
    package = tmp_path / "envloop_pipelines"
    files = {
        "core/data/records.py": "import json\n"
                                "def load():\n    from envloop_pipelines.core.data.snapshots import declared\n",
        "core/data/snapshots.py": "from .records import load\nfrom envloop_pipelines.core import storage\n",
        "core/data/splits.py": "from envloop_pipelines.core import storage, HOME\n",
        "core/storage.py": "from envloop_pipelines.core.data import nothing_here\n",
    }
    write_tree(package, files)
    edges = file_imports(tmp_path)
    assert sorted(edges) == [
        ("envloop_pipelines/core/data/records.py", "envloop_pipelines/core/data/snapshots.py"),
        ("envloop_pipelines/core/data/snapshots.py", "envloop_pipelines/core/data/records.py"),
        ("envloop_pipelines/core/data/snapshots.py", "envloop_pipelines/core/storage.py"),
        ("envloop_pipelines/core/data/splits.py", "envloop_pipelines/core/__init__.py"),
        ("envloop_pipelines/core/data/splits.py", "envloop_pipelines/core/storage.py"),
        ("envloop_pipelines/core/storage.py", "envloop_pipelines/core/data/__init__.py"),
    ]
    assert edges[("envloop_pipelines/core/data/records.py", "envloop_pipelines/core/data/snapshots.py")] == \
        "envloop_pipelines/core/data/records.py:3"
    assert cycles(edges) == [["envloop_pipelines/core/data/records.py", "envloop_pipelines/core/data/snapshots.py",
                              "envloop_pipelines/core/data/records.py"]]
    (package / "core/data/records.py").write_text("import json\n")
    assert cycles(file_imports(tmp_path)) == []


def reaches_into(folder: Path, package: str, top: Path = PACKAGE_ROOT.parent) -> dict[str, str]:
    """``file:line`` → what it imports or names, for every reach into ``package`` from a file under ``folder``.

    A reach is an import of the package or of anything in it, at any depth, or a string naming it
    (``importlib.import_module``).
    """
    bad: dict[str, str] = {}
    for path in sorted(folder.rglob("*.py")):
        hits = [(line, name) for line, name in imported_modules(path, top) if _within(name, package)]
        for line, name in hits + named_in_strings(path, package):
            bad.setdefault(f"{path.relative_to(top)}:{line}", name)
    return bad


def test_benches_do_not_import_the_tests() -> None:
    assert sorted(BENCH_ROOT.glob("bench_*.py")), f"no bench script under {BENCH_ROOT}: the rule checks nothing"
    bad = reaches_into(BENCH_ROOT, TESTS_PACKAGE)
    assert bad == {}, (f"bench/ stands on the package: move what a bench shares with the tests to "
                       f"envloop_pipelines/testing/ (or where it belongs in the package):\n"
                       + "\n".join(f"{where} reaches {name}" for where, name in bad.items()))


def test_the_bench_check_sees_every_way_into_the_tests(tmp_path: Path) -> None:
    """Control: a bench that imports the tests, at any depth or by name, is caught; one on the package is not."""
    bench = tmp_path / "bench"
    bench.mkdir()
    (bench / "bench_leak.py").write_text(
        "import importlib\n"
        "from envloop_pipelines_tests.serve.helpers import start_server\n"
        "def main():\n"
        "    from envloop_pipelines_tests import services\n"
        "    import envloop_pipelines_tests.core.agents.scripted\n"
        "    return importlib.import_module('envloop_pipelines_tests.services')\n"
    )
    (bench / "bench_clean.py").write_text("from envloop_pipelines.testing.serve import start_server\n"
                                          "from envloop_pipelines_testsuite import x\n")
    assert sorted(reaches_into(bench, TESTS_PACKAGE, tmp_path)) == [
        "bench/bench_leak.py:2", "bench/bench_leak.py:4", "bench/bench_leak.py:5", "bench/bench_leak.py:6"]
