"""One name per concept: the constants are the only spelling, and the settings have one source.

The concept table (``docs/concepts.md``) maps each concept to its core function, Dagster
asset, MLflow run kind, ledger event and CLI; these tests hold the code to it.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

import envloop_pipelines
from envloop_pipelines.core.ledger import event_log
from envloop_pipelines.core.ledger.ledger import Ledger
from envloop_pipelines.core.loop.config import LoopConfig, env_name, field_default, loop_fields, settings_from_env
from envloop_pipelines.core.decision_loop.step_records import STEP_RECORDS
from envloop_pipelines.core import tracking

PACKAGE = Path(envloop_pipelines.__file__).parent
REPO = PACKAGE.parent
#: ``envloop.*`` strings that are not MLflow tags: a Docker label and an entry-point group.
NOT_MLFLOW = {"envloop.sandbox", "envloop.environment_generators"}


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py"))


def _string_constants(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
                  and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings]


def test_mlflow_tags_are_spelled_only_in_tracking() -> None:
    tags = {v for k, v in vars(tracking).items() if k.startswith("TAG_")}
    assert all(t.startswith("envloop.") for t in tags)
    offenders = []
    for path in _modules():
        if path.name == "tracking.py" and path.parent.name == "core":
            continue
        for line, value in _string_constants(path):
            if re.fullmatch(r"envloop\.[a-z_]+", value) and value not in NOT_MLFLOW:
                offenders.append(f"{path.relative_to(REPO)}:{line}: {value!r}")
    assert not offenders, "MLflow tag keys spelled outside core/tracking.py:\n" + "\n".join(offenders)


def test_ledger_events_are_appended_by_constant() -> None:
    kinds = set(event_log.EVENT_KINDS)
    offenders = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "append"
                    and node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value in kinds):
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.args[0].value!r}")
    assert not offenders, "ledger events appended by literal:\n" + "\n".join(offenders)


def test_the_ledger_refuses_an_event_kind_outside_the_table(tmp_path: Path) -> None:
    ledger = Ledger("t", tmp_path)
    with pytest.raises(event_log.LedgerError, match="unknown ledger event kind 'arm_trained'"):
        ledger.append("arm_trained", {"round": "r0001"})


def test_old_event_names_are_read_under_the_new_name(tmp_path: Path) -> None:
    ledger = Ledger("t", tmp_path)
    ledger.events_path.write_text('{"event_id": "x", "at": 0, "kind": "arm_trained", "task": "t", "round": "r0001"}\n')
    assert [e["round"] for e in ledger.events(event_log.EVENT_CHECKPOINT_TRAINED)] == ["r0001"]
    assert "arm_trained" in ledger.events_path.read_text()  # the line on disk is never rewritten


def test_step_records_and_run_kinds_are_the_asset_names() -> None:
    from envloop_pipelines.definitions import defs as load_code_location
    defs = load_code_location()

    assets = {k.to_user_string() for k in defs.get_repository_def().asset_graph.get_all_asset_keys()}
    # An agent's evaluation keeps its value in its own store and hands Dagster metadata only (its run folder under
    # agent_evals/ and MLflow; core/agents/evaluate.py). The RL round's steps have their records in RL_STEP_RECORDS.
    from envloop_pipelines.core.rl_loop.step_records import RL_STEP_RECORDS

    assert not set(STEP_RECORDS) & set(RL_STEP_RECORDS)
    assert set(STEP_RECORDS) | set(RL_STEP_RECORDS) == assets - {"agent_evaluation"}
    for kind in (tracking.KIND_HYPOTHESIS, tracking.KIND_TRAINING, tracking.KIND_REEVAL, tracking.KIND_NOISE_FLOOR):
        assert kind in assets, kind


def test_the_concept_table_names_what_the_code_uses() -> None:
    """Every asset, MLflow kind and ledger event in docs/concepts.md exists in the code, and every one in the code
    is in the table."""
    from envloop_pipelines.definitions import defs as load_code_location
    defs = load_code_location()

    text = (REPO / "docs" / "concepts.md").read_text(encoding="utf-8")
    lines = text.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("|"))
    table = lines[first:next((i for i in range(first, len(lines)) if not lines[i].startswith("|")), len(lines))]
    rows = [line for line in table if not set(line) <= set("|-: ")]  # the first table: the concept table
    header = [c.strip().lower() for c in rows[0].strip("|").split("|")]
    col = {name: next(i for i, h in enumerate(header) if h.startswith(name)) for name in ("dagster", "mlflow", "ledger")}
    cells = [[c.strip() for c in row.strip("|").split("|")] for row in rows[1:]]

    def names(column: str) -> set[str]:
        return {n for row in cells if len(row) > col[column] for n in re.findall(r"`([a-z_]+)`", row[col[column]])}

    assets = {k.to_user_string() for k in defs.get_repository_def().asset_graph.get_all_asset_keys()}
    automation = {s.name for s in defs.get_repository_def().sensor_defs} | {s.name for s in defs.get_repository_def().schedule_defs}
    assert assets <= names("dagster")
    assert names("dagster") - {"rounds", "loop", "recipe_overrides"} <= assets | automation
    assert set(tracking.RUN_KINDS) <= names("mlflow")
    assert set(event_log.EVENT_KINDS) - {event_log.EVENT_GATE_AMENDED, event_log.EVENT_ERRATUM} <= names("ledger")
    assert names("ledger") <= set(event_log.EVENT_KINDS)


# -- one source of loop settings ---------------------------------------------------------------------------------


def test_the_resource_has_exactly_the_loop_settings() -> None:
    from envloop_pipelines.resources.loop import LoopResource

    fields = [f.name for f in loop_fields()]
    assert list(LoopResource.model_fields) == fields
    resource = LoopResource()
    assert resource.config() == LoopConfig()
    for f in loop_fields():
        if f.name not in ("recipe_overrides", "safety_families"):
            assert getattr(resource, f.name) == field_default(f), f.name


def test_every_setting_is_a_cli_option_with_the_same_default() -> None:
    import click

    from envloop_pipelines.cli.round import round_start

    params = {p.name: p for p in round_start.params if isinstance(p, click.Option)}
    for f in loop_fields():
        assert f.name in params, f.name
        assert f"--{f.name.replace('_', '-')}" in params[f.name].opts or f.name == "recipe_overrides"
    assert "--recipe-override" in params["recipe_overrides"].opts
    assert params["noise_arms"].default == LoopConfig().noise_arms
    assert params["recipe"].default == LoopConfig().recipe


def test_every_setting_has_its_environment_variable() -> None:
    env = {env_name(f.name): v for f, v in zip(loop_fields(), (
        "tickets", "packaged:decision_head_cpu.yaml", '{"max_steps": 3}', "4", "2", "10", "label_preserving_variants",
        "needs_approval,share_ok", "0.05", "refuse", "50", "2", "20", "450", "/tmp/envloop"))}
    settings = settings_from_env(env)
    assert set(settings) == {f.name for f in loop_fields()}
    cfg = LoopConfig.from_settings(settings)
    assert cfg.recipe_overrides == {"max_steps": 3} and cfg.noise_arms == 4 and cfg.builtin_users == 50
    assert cfg.builtin_hidden_users == 20 and cfg.max_lever_seconds == 450.0 and cfg.home == "/tmp/envloop"
    assert cfg.safety_families == ("needs_approval", "share_ok") and cfg.safety_fnr_target == 0.05
    with pytest.raises(ValueError, match="ENVLOOP_SAFETY_FNR_TARGET='low': must be a number"):
        settings_from_env({"ENVLOOP_SAFETY_FNR_TARGET": "low"})
    with pytest.raises(ValueError, match=r"safety_fnr_target must be in \[0, 1\), got 1.0"):
        LoopConfig(safety_fnr_target=1.0)
    with pytest.raises(ValueError, match="ENVLOOP_NOISE_ARMS='many': must be an integer"):
        settings_from_env({"ENVLOOP_NOISE_ARMS": "many"})
    with pytest.raises(ValueError, match="ENVLOOP_RECIPE_OVERRIDES is not JSON"):
        settings_from_env({"ENVLOOP_RECIPE_OVERRIDES": "{max_steps"})


def test_settings_round_trip_and_refuse_unknown_names() -> None:
    cfg = LoopConfig(task="x", recipe_overrides={"max_steps": 2}, safety_families=("a",))
    assert LoopConfig.from_settings(cfg.to_settings()) == cfg
    with pytest.raises(ValueError, match=r"unknown loop setting\(s\) \['recipe_overrides_json'\]"):
        LoopConfig.from_settings({"recipe_overrides_json": "{}"})
    assert dataclasses.is_dataclass(cfg)


def test_the_default_recipe_is_spelled_once() -> None:
    from envloop_pipelines.core.model.recipe import DEFAULT_RECIPE

    offenders = [f"{p.relative_to(REPO)}:{line}" for p in _modules() for line, v in _string_constants(p)
                 if v == DEFAULT_RECIPE and not p.name == "recipe.py"]
    assert not offenders, offenders
