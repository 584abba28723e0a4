"""The loop a deployment runs, as its webserver reports it: :meth:`Client.loop_settings
<envloop_pipelines.sdk.client.Client.loop_settings>` reads the code location's ``loop`` resource's configured values
(GraphQL ``allTopLevelResourceDetails { configuredValues }``) and fills in what they leave unset here.

The code location turns every ``ENVLOOP_<FIELD>`` set when it loads into a configured value
(``resources/loop.py``, ``deployment_loop_resource``); a setting left unset there reports ``null`` and is
``LoopConfig``'s declared default. No ``LoopConfig`` is built on the client: its checks read a home (the task's
declared safety families, the recipe file), and the home that matters is the deployment's.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from envloop_pipelines.core.loop.config import field_default, loop_fields, parse_setting
from envloop_pipelines.sdk.errors import ClientError


def reported_settings(configured: Sequence[Mapping[str, str]]) -> dict[str, Any]:
    """The loop's settings (``LoopConfig`` names) from its resource's configured values as the webserver reports them
    (GraphQL ``configuredValues``: each ``{key, value, type}``, the value JSON text); a setting left unset is
    ``LoopConfig``'s declared default. No ``LoopConfig`` is built: that would read this machine's home.

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
    overrides = settings["recipe_overrides"]  # JSON text in the resource (Dagster config is text), a mapping here
    settings["recipe_overrides"] = dict(parse_setting("recipe_overrides", overrides) if isinstance(overrides, str)
                                        else overrides)
    settings["safety_families"] = list(settings["safety_families"])
    return settings


__all__ = ["reported_settings"]
