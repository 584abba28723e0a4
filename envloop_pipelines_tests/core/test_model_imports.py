"""The modules of ``core/model`` import each other without a circle.

A circle (``readout`` → ``decision_head`` → ``readout``) works only as long as
one side defers its import into a function body, and it makes the shared base
and the readouts one unit that changes together. The graph here is read from
the source with ``ast``, so it counts every import statement: module-level,
inside functions, and under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import envloop_pipelines.core.model as model_pkg
from envloop_pipelines.core.model.readouts import READOUT_MODELS
from envloop_pipelines.core.model.recipe import READOUTS

PACKAGE = model_pkg.__name__
PACKAGE_DIR = Path(model_pkg.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join((PACKAGE, *parts))


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE_DIR.rglob("*.py"))}


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The modules of ``known`` that one import statement of ``module`` loads."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        if node.level:  # relative: resolve against the importing module's package
            anchor = module.split(".")
            anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
            base = ".".join([*anchor, node.module] if node.module else anchor)
        else:
            base = node.module or ""
        # ``from pkg import name`` loads pkg, and pkg.name when that is a module.
        names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
    out = set()
    for name in names:
        # ``import a.b.c`` loads a, a.b and a.b.c: every known prefix is an edge.
        parts = name.split(".")
        out |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)} & known
    return out


def import_graph() -> dict[str, set[str]]:
    """Module → the modules of this package it imports anywhere in its source."""
    modules = _modules()
    known = set(modules)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        edges: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges |= _imported(node, name, path.name == "__init__.py", known)
        # A submodule's import of its own (parent) package is how Python loads it anyway, not a dependency.
        graph[name] = edges - {name, *(m for m in known if name.startswith(m + "."))}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or None (depth-first search, three colours)."""
    WHITE, GREY, BLACK = 0, 1, 2
    colour = dict.fromkeys(graph, WHITE)
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        colour[node] = GREY
        stack.append(node)
        for nxt in sorted(graph[node]):
            if colour[nxt] == GREY:
                return [*stack[stack.index(nxt):], nxt]
            if colour[nxt] == WHITE and (found := visit(nxt)):
                return found
        stack.pop()
        colour[node] = BLACK
        return None

    for start in sorted(graph):
        if colour[start] == WHITE and (found := visit(start)):
            return found
    return None


def test_the_graph_reader_sees_function_level_and_relative_imports() -> None:
    src = (
        "from __future__ import annotations\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from envloop_pipelines.core.model.recipe import Recipe\n"
        "def f():\n    from . import calibration\n    import envloop_pipelines.core.model.checkpoint as c\n"
        "from .predict import DecisionModel\n"
    )
    known = set(_modules())
    mod = f"{PACKAGE}.readout"
    edges = set().union(*(_imported(n, mod, False, known) for n in ast.walk(ast.parse(src))
                          if isinstance(n, (ast.Import, ast.ImportFrom))))
    assert edges - {PACKAGE} == {f"{PACKAGE}.{m}" for m in ("recipe", "calibration", "checkpoint", "predict")}


def test_the_cycle_finder_finds_a_circle_through_three_modules() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_core_model_has_no_import_cycle() -> None:
    graph = import_graph()
    assert {f"{PACKAGE}.readout", f"{PACKAGE}.decision_head", f"{PACKAGE}.label_token"} <= set(graph)
    assert f"{PACKAGE}.readout" in graph[f"{PACKAGE}.decision_head"]  # the reader does see the edges
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle in core/model: " + " -> ".join(m.rsplit(".", 1)[-1] for m in cycle)


def test_every_recipe_readout_has_a_model() -> None:
    assert set(READOUT_MODELS) == set(READOUTS)
    assert all(cls.readout == name for name, cls in READOUT_MODELS.items())
