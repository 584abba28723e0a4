"""The loop a deployment runs, as its webserver reports it: :meth:`Client.loop_settings
<envloop_pipelines.sdk.client.Client.loop_settings>` reads the code location's ``loop`` resource's configured values
(GraphQL ``allTopLevelResourceDetails { configuredValues }``) and fills in what they leave unset here.

The code location turns every ``ENVLOOP_<FIELD>`` set when it loads into a configured value
(``resources/loop.py``, ``deployment_loop_resource``); a setting left unset there reports ``null`` and is
``LoopConfig``'s declared default. No ``LoopConfig`` is built on the client: the deployment's own resource
checked the settings where they entered, and the task's declared safety families are read from the deployment's
snapshot by each step (``LoopConfig.guarded_families``), never from this machine's home.

A client gives its runs one setting of its own, the loop recipe override (``Client(loop_settings={"recipe_overrides":
...})``, the ``LocalClient``'s spelling): :func:`client_overrides` checks it where the client is built, with the
project's one validator (``core/model/recipe.py``: ``check_recipe_overrides``), before anything is launched, and
:func:`loop_run_config` puts it in the run config of the ``loop`` resource of the client's setup and rounds, on top of
the deployment's own override. A run given the resource's config gets no configured value beside it, so the run
config carries the deployment's configured values too: the run is the deployment's loop with the client's override.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from envloop_pipelines.core.loop.config import field_default, loop_fields
from envloop_pipelines.core.model.recipe import RecipeError, check_recipe_overrides
from envloop_pipelines.sdk.errors import ClientError, RefusedError

#: The loop settings a client of a deployment gives its runs; every other one is the code location's.
CLIENT_SETTINGS = ("recipe_overrides",)


def reported_settings(configured: Sequence[Mapping[str, str]]) -> dict[str, Any]:
    """The loop's settings (``LoopConfig`` names) from its resource's configured values as the webserver reports them
    (GraphQL ``configuredValues``: each ``{key, value, type}``, the value JSON text); a setting left unset is
    ``LoopConfig``'s declared default (no ``LoopConfig`` is built here: see the module docstring).

    Raises:
        ClientError: a setting bound to an environment variable (``type`` ``ENV_VAR``): the webserver shows the
            variable's name, not its value.
    """
    settings = {f.name: field_default(f) for f in loop_fields()}
    for entry in configured:
        if entry["key"] not in settings:
            continue
        if entry["type"] != "VALUE":
            raise ClientError(f"loop setting {entry['key']!r}: the deployment reads it from ${entry['value']} when a "
                              f"run starts; its webserver does not show the value")
        value = json.loads(entry["value"])
        # None: unset when the code location loaded (a run reads ENVLOOP_<FIELD>, else the default)
        if value is not None:
            settings[entry["key"]] = value
    settings["recipe_overrides"] = dict(settings["recipe_overrides"])  # a mapping in the resource as everywhere
    settings["safety_families"] = list(settings["safety_families"])
    return settings


def client_overrides(loop_settings: Mapping[str, Any] | None) -> dict[str, Any]:
    """The loop recipe override a remote client gives its runs (``loop_settings["recipe_overrides"]``), checked as
    the ``LocalClient``'s is (``check_recipe_overrides``), here, before anything is launched.

    Raises:
        RefusedError: a setting other than :data:`CLIENT_SETTINGS` (a remote round runs with the deployment's), an
            override that is not a mapping, an unknown recipe field (naming it, a close match and the fields) or a
            value its field refuses.
    """
    if loop_settings is None:
        return {}
    if not isinstance(loop_settings, Mapping):
        raise RefusedError(f"loop_settings must be a mapping of loop settings, got {loop_settings!r}")
    others = sorted(set(loop_settings) - set(CLIENT_SETTINGS))
    if others:
        raise RefusedError(f"loop_settings: {others}: a remote round runs with the deployment's loop settings "
                           f"(ENVLOOP_<SETTING> of its code location); a client gives only "
                           f"{', '.join(CLIENT_SETTINGS)}")
    overrides = loop_settings.get("recipe_overrides") or {}
    if not isinstance(overrides, Mapping):  # LoopConfig's words: one spelling, a mapping, at every door
        raise RefusedError(f"recipe_overrides must be a mapping of recipe fields, got {overrides!r}")
    try:
        return check_recipe_overrides(overrides)
    except RecipeError as exc:
        raise RefusedError(str(exc)) from None


def loop_run_config(configured: Sequence[Mapping[str, str]], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The run config that gives a run the deployment's loop with ``overrides`` (checked by
    :func:`client_overrides`) on top of its recipe override; ``{}`` without overrides (the run is the deployment's).

    ``configured`` is the ``loop`` resource's configured values as the webserver reports them: each one set
    (``VALUE``, not ``null``) is given again, since Dagster gives a run whose config names the resource none of
    them; a setting unset there stays unset (the run reads ``ENVLOOP_<FIELD>``, else the default).

    Raises:
        ClientError: a setting bound to an environment variable (:func:`reported_settings`).
        RefusedError: the deployment's override and ``overrides`` together are not a valid recipe change.
    """
    if not overrides:
        return {}
    reported_settings(configured)  # refuses a value the webserver does not show
    names = {f.name for f in loop_fields()}
    values = {e["key"]: json.loads(e["value"]) for e in configured if e["key"] in names}
    values = {k: v for k, v in values.items() if v is not None}
    merged = {**dict(values.get("recipe_overrides") or {}), **dict(overrides)}
    try:
        values["recipe_overrides"] = check_recipe_overrides(merged)
    except RecipeError as exc:
        raise RefusedError(f"the deployment's recipe_overrides with this client's: {exc}") from None
    return {"resources": {"loop": {"config": values}}}


__all__ = ["CLIENT_SETTINGS", "client_overrides", "loop_run_config", "reported_settings"]
