"""A misspelled recipe override is refused where it enters (issue 36): the CLI, the SDK, the launchpad (a run's
resource config) and an environment variable, before anything runs, naming the key, a close match and the fields.

On ebf721d ``envloop round start --recipe-override lrr=0.0001`` generated the benchmark, started the setup run and
ended ``noise_floor: TypeError: Recipe.__init__() got an unexpected keyword argument 'lrr'``;
``LocalClient({"recipe_overrides": {"lrr": 1e-4}})`` built without complaint.
"""

from __future__ import annotations

import json
from pathlib import Path

import dagster as dg
import pytest
from click.testing import CliRunner

from envloop_pipelines.core.loop.config import LoopConfig, settings_from_env
from envloop_pipelines.core.model.causal_sft import CausalSftRecipe
from envloop_pipelines.core.model.recipe import Recipe, RecipeError, check_recipe_overrides, load_recipe

NAMED = r"unknown recipe override\(s\) \['lrr'\] \(did you mean 'lr' for 'lrr'\?\); allowed: base_model, .*max_steps"


def _written(home: Path) -> list[Path]:
    return sorted(p for p in home.rglob("*") if p.is_file()) if home.exists() else []


def test_the_check_names_the_key_a_close_match_and_the_fields_and_a_bad_value_its_field() -> None:
    with pytest.raises(RecipeError, match=NAMED):
        check_recipe_overrides({"lrr": 1e-4})
    with pytest.raises(RecipeError, match=r"unknown recipe override\(s\) \['zzz'\]; allowed: "):
        check_recipe_overrides({"zzz": 1})
    with pytest.raises(RecipeError, match=r"recipe field 'lr': must be a number in \(0.0, 1.0\], got 'fast'"):
        check_recipe_overrides({"lr": "fast"})
    with pytest.raises(RecipeError, match=r"recipe overrides must be a mapping"):
        check_recipe_overrides(["max_steps", 3])
    assert check_recipe_overrides({"max_steps": 24, "lexical": True}) == {"max_steps": 24, "lexical": True}
    # Recipe.replace, the one place every loader applies overrides, says the same (was a TypeError).
    with pytest.raises(RecipeError, match=r"unknown recipe field\(s\) \['lrr'\] \(did you mean 'lr' for 'lrr'\?\)"):
        Recipe().replace(lrr=1e-4)


def test_the_sdk_door_refuses_it_before_anything_is_written(tmp_path: Path) -> None:
    from envloop_pipelines.sdk.local import LocalClient

    home = tmp_path / "home"
    with pytest.raises(RecipeError, match=NAMED):
        LoopConfig(recipe_overrides={"lrr": 1e-4}, home=str(home))
    with pytest.raises(RecipeError, match=NAMED):
        LocalClient({"recipe_overrides": {"lrr": 1e-4}, "home": str(home)})
    with pytest.raises(ValueError, match="recipe_overrides must be a mapping of recipe fields"):  # one spelling
        LocalClient({"recipe_overrides": json.dumps({"max_steps": 2}), "home": str(home)})
    assert _written(home) == []


def test_the_cli_door_refuses_it_before_the_benchmark_is_generated(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from envloop_pipelines.cli import main

    home = tmp_path / "home"
    monkeypatch.setenv("ENVLOOP_HOME", str(home))
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster"))
    result = CliRunner().invoke(main, ["round", "start", "--home", str(home), "--users", "30",
                                       "--recipe-override", "lrr=0.0001"])
    assert result.exit_code == 2, result.output
    assert "--recipe-override" in result.output and "did you mean 'lr' for 'lrr'?" in result.output
    assert "Traceback" not in result.output
    assert _written(home) == []


def test_the_launchpad_door_refuses_it_when_the_run_starts_before_any_step(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from envloop_pipelines.defs.rounds.assets import task_benchmark
    from envloop_pipelines.resources.loop import LoopResource

    home = tmp_path / "home"
    monkeypatch.setenv("ENVLOOP_HOME", str(home))
    loop = LoopResource.configure_at_launch()  # the launchpad: the run's config gives the override, a mapping
    run_config = {"resources": {"loop": {"config": {"home": str(home), "builtin_users": 30,
                                                    "recipe_overrides": {"lrr": 1e-4}}}}}
    with pytest.raises(Exception) as caught:
        dg.materialize([task_benchmark], resources={"loop": loop}, run_config=run_config,
                       instance=dg.DagsterInstance.ephemeral())
    chain, exc = [], caught.value
    while exc is not None:
        chain.append(str(exc))
        exc = exc.__cause__ or exc.__context__
    assert any("did you mean 'lr' for 'lrr'?" in message for message in chain), chain
    assert not (home / "tasks").exists() and not (home / "generated").exists()  # task_benchmark never ran


def test_the_environment_variable_door_names_the_variable() -> None:
    from envloop_pipelines.resources.loop import deployment_loop_resource

    environ = {"ENVLOOP_RECIPE_OVERRIDES": json.dumps({"lrr": 1e-4})}
    with pytest.raises(RecipeError, match=r"ENVLOOP_RECIPE_OVERRIDES: " + NAMED):
        settings_from_env(environ)
    with pytest.raises(RecipeError, match=r"ENVLOOP_RECIPE_OVERRIDES: "):
        deployment_loop_resource(environ)  # the code location does not load
    assert settings_from_env({"ENVLOOP_RECIPE_OVERRIDES": '{"max_steps": 3}'}) == {"recipe_overrides": {"max_steps": 3}}


@pytest.mark.parametrize("spec, kind", [("packaged:decision_head_cpu.yaml", Recipe),
                                        ("packaged:causal_sft_qwen_gpu.yaml", CausalSftRecipe)])
def test_one_loader_for_both_recipe_kinds_refuses_a_misspelled_override_alike(spec: str, kind: type) -> None:
    """Issue 36: the decision recipe and the causal-SFT recipe load through one ``load_recipe``: the same
    misspelled override is one ``RecipeError`` naming the file, the key, a close match and the fields."""
    assert isinstance(load_recipe(spec, {"lr": 1e-4}, kind=kind), kind)
    with pytest.raises(RecipeError) as caught:
        load_recipe(spec, {"lrr": 1e-4}, kind=kind)
    message = str(caught.value)
    assert message.startswith(str(kind.PACKAGED_DIR / spec.split(":", 1)[1]) + ": unknown recipe field(s) ['lrr']")
    assert "did you mean 'lr' for 'lrr'?" in message and "allowed: " in message and "max_length" in message
    with pytest.raises(RecipeError, match=r"recipe field 'lr': must be a number"):
        load_recipe(spec, {"lr": -1}, kind=kind)
    with pytest.raises(FileNotFoundError, match="shipped: packaged:"):
        load_recipe("packaged:nope.yaml", kind=kind)


def test_the_remote_doors_refuse_it_before_any_request(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 46: the remote ``Client`` takes the override as ``LocalClient`` does, and ``round start --remote`` passes
    ``--recipe-override`` to it; both check it before any request. The URL is dead: a request would fail otherwise
    (exit 1, ``not reachable``), not with the usage error naming the close match."""
    from envloop_pipelines.cli import main
    from envloop_pipelines.sdk.client import Client
    from envloop_pipelines.sdk.errors import RefusedError

    dead = "http://127.0.0.1:9"
    with pytest.raises(RefusedError, match=NAMED):
        Client(dead, loop_settings={"recipe_overrides": {"lrr": 1e-4}})
    monkeypatch.setenv("ENVLOOP_HOME", str(tmp_path / "home"))
    runner = CliRunner()
    result = runner.invoke(main, ["round", "start", "--remote", dead, "--recipe-override", "lrr=0.0001"])
    assert result.exit_code == 2, result.output
    assert "--recipe-override" in result.output and "did you mean 'lr' for 'lrr'?" in result.output
    assert "Traceback" not in result.output and "not reachable" not in result.output
    # another loop option beside --remote is still refused (the deployment's settings apply), naming the exception
    result = runner.invoke(main, ["round", "start", "--remote", dead, "--noise-arms", "3",
                                  "--recipe-override", "max_steps=3"])
    assert result.exit_code == 2 and "--noise-arms: a remote round runs with the deployment's loop settings" in (
        result.output) and "only --recipe-override is given to its runs" in result.output, result.output
    assert "--recipe-override" not in result.output.split("--noise-arms:")[0]
    # a good override passes the door and the command goes on to the deployment: here a dead one, named
    result = runner.invoke(main, ["round", "start", "--remote", dead, "--recipe-override", "max_steps=3"])
    assert result.exit_code == 1 and "http://127.0.0.1:9" in result.output and "not reachable" in result.output, (
        result.output)
    assert _written(tmp_path / "home") == []
