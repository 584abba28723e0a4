"""Issue 46: the asset graph is the map of ``core/decision_loop/``.

Each asset of the decision loop (its setup and its round) calls one core function, defined in the module of
``core/decision_loop/`` named after the asset and imported in ``defs/rounds/assets.py`` under its own name
(no module imported under another name: ``before_training as steps`` hid which module a step lived in).
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import dagster as dg

import envloop_pipelines.defs.rounds.assets as assets_module
from envloop_pipelines.defs.rounds.assets import (
    baseline_eval,
    champion_noise_floor,
    environment_synthesis,
    failure_mining,
    independent_reeval,
    lora_checkpoint,
    noise_floor,
    promotion_decision,
    registered_hypothesis,
    task_benchmark,
    training_dataset_snapshot,
)

CORE = "envloop_pipelines.core.decision_loop"

#: asset -> the core function its body calls, defined in ``core/decision_loop/<asset>.py``.
ASSET_STEPS = {
    task_benchmark: "ensure_task_benchmark",
    noise_floor: "measure_noise_floor",
    baseline_eval: "evaluate_champion",
    champion_noise_floor: "measure_champion_noise_floor",
    failure_mining: "mine_failures",
    environment_synthesis: "synthesize_environments",
    registered_hypothesis: "register_hypothesis",
    training_dataset_snapshot: "build_training_snapshot",
    lora_checkpoint: "train_candidate",
    independent_reeval: "reevaluate",
    promotion_decision: "decide_round",
}


def _tree() -> ast.Module:
    return ast.parse(Path(assets_module.__file__).read_text(encoding="utf-8"))


def _core_imports() -> dict[str, str]:
    """``{name: module}`` of every name ``assets.py`` imports from ``core/decision_loop``."""
    out = {}
    for node in _tree().body:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(CORE):
            for alias in node.names:
                out[alias.asname or alias.name] = node.module
    return out


def test_each_asset_calls_the_function_of_the_module_named_after_it() -> None:
    imports = _core_imports()
    bodies = {n.name: n for n in _tree().body if isinstance(n, ast.FunctionDef)}
    for asset, function in ASSET_STEPS.items():
        name = asset.key.path[-1]
        assert imports.get(function) == f"{CORE}.{name}", (name, function, imports.get(function))
        module = importlib.import_module(f"{CORE}.{name}")
        assert getattr(module, function).__module__ == module.__name__  # defined there, not re-exported
        called = {c.func.id for c in ast.walk(bodies[name]) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)}
        assert [f for f in called if f in imports] == [function], (name, sorted(called & set(imports)))


def test_no_core_module_is_imported_under_another_name() -> None:
    for node in ast.walk(_tree()):
        ours = (isinstance(node, ast.ImportFrom) and (node.module or "").startswith("envloop_pipelines")) or (
            isinstance(node, ast.Import) and any(a.name.startswith("envloop_pipelines") for a in node.names))
        renamed = [a.name for a in getattr(node, "names", []) if ours and a.asname and a.asname != a.name]
        assert not renamed, f"assets.py line {node.lineno}: imported under another name: {renamed}"


def test_every_decision_asset_has_its_module() -> None:
    """Each asset of the decision loop's groups is in the map above, and its module exists under its name."""
    from envloop_pipelines.defs.rounds.assets import ROUND_GROUP

    defined = [a for a in vars(assets_module).values() if isinstance(a, dg.AssetsDefinition)]
    decision = {a.key.path[-1] for a in defined if a.group_names_by_key[a.key] in (ROUND_GROUP, "benchmark")}
    assert decision == {a.key.path[-1] for a in ASSET_STEPS}
    folder = Path(importlib.import_module(CORE).__file__).parent
    assert {p.stem for p in folder.glob("*.py")} >= decision
