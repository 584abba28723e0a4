"""JSON in, text out: decoding that keeps duplicate keys visible, and rendering for the model.

Shared by the record loaders and the serving API, which both take states,
instructions and criteria as a string, an object or an array.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any


# --------------------------------------------------------------------------- JSON decoding


class JsonObject(dict):
    """A decoded JSON object that remembers keys given more than once.

    ``json.loads`` keeps the last of duplicate keys silently; duplicate option
    keys must be an error, so the decoder records them here.
    """

    duplicate_keys: tuple[str, ...] = ()


def _object_pairs(pairs: list[tuple[str, Any]]) -> JsonObject:
    obj = JsonObject(pairs)
    if len(obj) != len(pairs):
        counts = Counter(k for k, _ in pairs)
        obj.duplicate_keys = tuple(sorted(k for k, n in counts.items() if n > 1))
    return obj


def decode_json(text: str) -> Any:
    """``json.loads`` that records duplicate object keys (see :class:`JsonObject`)."""
    return json.loads(text, object_pairs_hook=_object_pairs)


# --------------------------------------------------------------------------- text rendering


def render_value(value: Any) -> str:
    """Text for a state, instruction or criterion that may be a string, object or array.

    Objects and arrays become canonical JSON (keys kept in the user's order), so
    the model sees exactly the structure the user sent.
    """
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, separators=(", ", ": "))
