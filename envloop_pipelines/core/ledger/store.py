"""Where a loop's files live: the one spelling of the layout under ``<home>/loops/<task>/``.

::

    ledger.jsonl, hypotheses/, amendments/, releases/   the ledger (core/ledger/ledger.py)
    loop.json                                          the active loop and its budget (core/loop/budget.py)
    noise/<key>.json, noise/<key>/                     noise floors by key, their arms' predictions
    <step>.json                                        the value of an unpartitioned step (task_benchmark, noise_floor)
    rounds/<round>/<step>.json                         the value of each round step (the IO manager's files)
    rounds/<round>/*.parquet                           predictions and synthesized rows a step wrote

Content-addressed artifacts shared by every loop of the home live under
``<home>/artifacts/{checkpoints,snapshots}/<sha256>``; records refer to them by hash.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, TypeVar

from envloop_pipelines.core.storage import atomic_write_json, envloop_home


def loop_dir(task: str, home: str | Path | None = None) -> Path:
    """The folder of one task's loop."""
    return envloop_home(home) / "loops" / task


class StepRecord(Protocol):
    """A typed step value that round-trips through JSON."""

    def to_dict(self) -> dict[str, Any]: ...


class JsonRecord:
    """JSON round trip for frozen dataclasses: the base of every loop's step records.

    A tuple is a list in JSON; a field holding a dataclass (or ``None``, for an optional one) is its
    ``to_dict()`` when it has one, else its fields, recursively, and is read back through its type
    hint (the record's own ``from_dict`` when it has one), so a record nests other records without
    hand-written converters. Mappings are JSON already and are kept as they are. Keys missing from the
    JSON take the field's default; keys the record does not know are ignored.
    """

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _to_json(getattr(self, f.name)) for f in dataclasses.fields(self)}  # type: ignore[arg-type]

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> Any:
        return _dataclass_from_json(cls, raw)


def _to_json(value: Any) -> Any:
    """A field's value as JSON: a dataclass as its ``to_dict()`` (else its fields), a tuple as a list."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        to_dict = getattr(value, "to_dict", None)
        if callable(to_dict):
            return to_dict()
        return {f.name: _to_json(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple):
        return [_to_json(v) for v in value]
    return value


def _dataclass_from_json(cls: type, raw: Mapping[str, Any]) -> Any:
    hints = typing.get_type_hints(cls)
    return cls(**{f.name: _from_json(hints[f.name], raw[f.name])
                  for f in dataclasses.fields(cls) if f.init and f.name in raw})  # type: ignore[arg-type]


def _from_json(hint: Any, value: Any) -> Any:
    """``value`` (JSON) as the type ``hint`` names: a dataclass from its mapping, a tuple from its list."""
    if value is None:
        return None
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):  # an optional field: read as its first non-None type
        members = [a for a in typing.get_args(hint) if a is not type(None)]
        return _from_json(members[0], value) if members else value
    if isinstance(hint, type) and dataclasses.is_dataclass(hint) and isinstance(value, Mapping):
        from_dict = getattr(hint, "from_dict", None)
        return from_dict(value) if callable(from_dict) else _dataclass_from_json(hint, value)
    if origin is tuple and isinstance(value, list):
        args = typing.get_args(hint)
        item = args[0] if len(args) == 2 and args[1] is Ellipsis else None
        return tuple(value if item is None else (_from_json(item, v) for v in value))
    return value


R = TypeVar("R")


class RoundStore:
    """The files of one task's loop (see the module docstring for the layout)."""

    def __init__(self, task: str, home: str | Path | None = None) -> None:
        self.task = task
        self.home = envloop_home(home)
        self.loop = loop_dir(task, self.home)
        self.noise = self.loop / "noise"
        self.loop_state = self.loop / "loop.json"
        self.checkpoints = self.home / "artifacts" / "checkpoints"
        self.snapshots = self.home / "artifacts" / "snapshots"

    def round_dir(self, key: str) -> Path:
        """The round's folder (created on first use)."""
        path = self.loop / "rounds" / key
        path.mkdir(parents=True, exist_ok=True)
        return path

    def started_rounds(self) -> list[int]:
        """Numbers of the rounds that have a folder (a step of theirs ran)."""
        rounds = self.loop / "rounds"
        return sorted(int(p.name[1:]) for p in rounds.glob("r*") if p.name[1:].isdigit()) if rounds.exists() else []

    def step_path(self, step: str, key: str | None = None) -> Path:
        """The JSON file of a step's value: per round for round steps, per loop otherwise."""
        return (self.round_dir(key) if key else self.loop) / f"{step}.json"

    def save(self, step: str, value: StepRecord, key: str | None = None) -> Path:
        """Write a step's value (atomically; a retry overwrites with the same content)."""
        path = self.step_path(step, key)
        atomic_write_json(path, value.to_dict(), overwrite=True)
        return path

    def load(self, step: str, record: type[R], key: str | None = None) -> R | None:
        """A step's value as ``record`` (its ``from_dict``), or ``None`` when the step has not run."""
        path = self.step_path(step, key)
        if not path.exists():
            return None
        return record.from_dict(json.loads(path.read_text(encoding="utf-8")))  # type: ignore[attr-defined]


__all__ = ["JsonRecord", "RoundStore", "loop_dir"]
