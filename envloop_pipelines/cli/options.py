"""Command-line options shared by the commands, derived from the core's values where one exists.

The loop's options are generated from the fields of ``LoopConfig``: ``--<field-with-dashes>``
with the field's default and help; ``recipe_overrides`` is ``--recipe-override KEY=VALUE``
(repeatable), ``safety_families`` a comma-separated list.

The recipe override has one spelling from the flag to the recipe: ``--recipe-override KEY=VALUE`` here,
``recipe_overrides`` (a mapping of recipe fields) in ``LoopConfig``, the SDK, the ``loop`` resource and a
run's recorded settings, its JSON text in ``ENVLOOP_RECIPE_OVERRIDES``. :data:`OPTION_ALIASES` lists the
loop options' older names.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from typing import Any

import click

from envloop_pipelines.core.loop.config import field_default, field_type, loop_fields, parse_setting

#: Older spellings of loop options, still accepted.
OPTION_ALIASES = {"n_synthesized": ("--synthesized",), "builtin_users": ("--users",),
                  "builtin_records_per_user": ("--records-per-user",)}
#: The one flag of the recipe override (``LoopConfig.recipe_overrides``), given once per recipe field.
RECIPE_OVERRIDE_FLAG = "--recipe-override"


def parse_recipe_overrides(pairs: tuple[str, ...]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs (values parsed as YAML) as a dict of recipe fields."""
    import yaml

    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{pair!r} must look like KEY=VALUE", param_hint=RECIPE_OVERRIDE_FLAG)
        out[key] = yaml.safe_load(value)
    from envloop_pipelines.core.model.recipe import RecipeError, check_recipe_overrides

    try:
        return check_recipe_overrides(out)
    except RecipeError as exc:  # before anything runs: no benchmark generated, no run started
        raise click.BadParameter(str(exc), param_hint=RECIPE_OVERRIDE_FLAG) from None


def recipe_override_option(fn: Callable) -> Callable:
    """``--recipe-override KEY=VALUE`` (repeatable) as the command's ``recipe_overrides``."""
    return click.option(RECIPE_OVERRIDE_FLAG, "recipe_overrides", multiple=True, metavar="KEY=VALUE",
                        help="Recipe override, one recipe field each (repeatable).")(fn)


def add_recipe_override_argument(parser: argparse.ArgumentParser, *, default: list[str] | None = None,
                                 help: str = "recipe override KEY=VALUE, one recipe field each (repeatable)") -> None:
    """``--recipe-override KEY=VALUE`` (repeatable, into ``args.override``) on a script's argparse parser.

    The CLI's spelling for the benches (``bench/``). Parse the values with :func:`parse_recipe_overrides`.
    """
    parser.add_argument(RECIPE_OVERRIDE_FLAG, dest="override", action="append", default=default, metavar="KEY=VALUE",
                        help=help)


def loop_options(fn: Callable) -> Callable:
    """Add one option per loop setting (``LoopConfig``'s fields, defaults and help)."""
    for f in reversed(loop_fields()):
        if f.name == "recipe_overrides":
            fn = click.option(RECIPE_OVERRIDE_FLAG, "recipe_overrides", multiple=True, metavar="KEY=VALUE",
                              help=f.metadata["help"])(fn)
            continue
        default = field_default(f)
        names = (f"--{f.name.replace('_', '-')}", *OPTION_ALIASES.get(f.name, ()), f.name)
        if f.name == "safety_families":
            fn = click.option(*names, default=",".join(default), show_default=True, help=f.metadata["help"])(fn)
            continue
        kind = field_type(f)
        fn = click.option(*names, type=kind if kind in (int, float) else str, default=default,
                          show_default=default is not None, help=f.metadata["help"])(fn)
    return fn


def remote_options(fn: Callable) -> Callable:
    """``--remote URL`` (a Dagster webserver: go through the SDK) and ``--mlflow URI`` (its MLflow server)."""
    fn = click.option("--mlflow", "mlflow_uri", envvar="MLFLOW_TRACKING_URI", default=None, metavar="URI",
                      help="With --remote: the deployment's MLflow tracking URI (default $MLFLOW_TRACKING_URI); "
                           "releases, the champion and checkpoints come from there.")(fn)
    return click.option("--remote", envvar="ENVLOOP_REMOTE", default=None, metavar="URL",
                        help="A deployment's Dagster webserver (http://host:port; default $ENVLOOP_REMOTE): "
                             "do it there through the SDK instead of in this process.")(fn)


def loop_settings(options: Mapping[str, Any]) -> dict[str, Any]:
    """The loop's settings from the options :func:`loop_options` added (``LoopConfig`` names)."""
    names = {f.name for f in loop_fields()}
    settings = {k: v for k, v in options.items() if k in names}
    settings["recipe_overrides"] = parse_recipe_overrides(tuple(settings.get("recipe_overrides") or ()))
    if isinstance(settings.get("safety_families"), str):
        settings["safety_families"] = list(parse_setting("safety_families", settings["safety_families"]))
    return settings


__all__ = ["RECIPE_OVERRIDE_FLAG", "add_recipe_override_argument", "loop_options",
           "loop_settings", "parse_recipe_overrides", "recipe_override_option", "remote_options"]
