"""The loop a deployment runs, as its webserver reports it: :meth:`Client.loop_settings
<envloop_pipelines.sdk.client.Client.loop_settings>` reads the code location's ``loop`` resource's configured values
(GraphQL ``allTopLevelResourceDetails { configuredValues }``) and fills in what they leave unset here.

The code location turns every ``ENVLOOP_<FIELD>`` set when it loads into a configured value
(``resources/loop.py``, ``deployment_loop_resource``); a setting left unset there reports ``null`` and is
``LoopConfig``'s declared default. No ``LoopConfig`` is built on the client: the deployment's own resource
checked the settings where they entered, and the task's declared safety families are read from the deployment's
snapshot by each step (``LoopConfig.guarded_families``), never from this machine's home.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from envloop_pipelines.core.loop.config import field_default, loop_fields
from envloop_pipelines.sdk.errors import ClientError


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


__all__ = ["reported_settings"]
