"""Where a loop's files live: the one spelling of the layout under ``<home>/loops/<task>/``.

::

    ledger.jsonl, hypotheses/, amendments/, releases/   the ledger (core/ledger/ledger.py)
    loop.json                                          the active loop and its budget (core/ledger/loop_budget.py)
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
    """JSON round trip for flat frozen dataclasses (tuples are lists in JSON): the base of every loop's step records."""

    def to_dict(self) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> Any:
        hints = typing.get_type_hints(cls)
        data = {}
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            if f.name not in raw:
                continue
            value = raw[f.name]
            if typing.get_origin(hints[f.name]) is tuple and isinstance(value, list):
                value = tuple(value)
            data[f.name] = value
        return cls(**data)


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


__all__ = ["RoundStore", "loop_dir"]
