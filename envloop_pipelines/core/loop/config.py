"""The loop's settings: one frozen value, the only place they are declared.

The Dagster resource (``resources/loop.py``), the CLI options (``cli/options.py``)
and the environment variables of a code location (``ENVLOOP_<FIELD>``) are all
derived from the fields of :class:`LoopConfig`, so a setting has one name and
one default everywhere.

Two recipe changes are kept apart by name:

- ``recipe_overrides`` (here): the **loop's** override of the recipe file, applied to
  every arm of the loop, the null arms of the noise floor included (it is part of the
  recipe hash the floor is keyed by). CLI ``--recipe-override KEY=VALUE``, env
  ``ENVLOOP_RECIPE_OVERRIDES`` (JSON).
- ``change.recipe_diff`` (a hypothesis): the change **one round** tests, applied to
  its candidate only, on top of the loop's recipe.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from envloop_pipelines.core.benchmark.generator import BENCHMARK_NAME, SAFETY_FAMILIES
from envloop_pipelines.core.data.snapshots import SnapshotManifest, TaskSnapshot
from envloop_pipelines.core.model.recipe import (
    DEFAULT_RECIPE,
    Recipe,
    RecipeError,
    check_recipe_overrides,
    load_recipe,
    recipe_hash,
)
from envloop_pipelines.core.tracking import model_name

ROUND_KEY_WIDTH = 4
#: Environment variables of a code location: ``ENVLOOP_<FIELD>`` (``ENVLOOP_RECIPE_OVERRIDES`` is JSON).
ENV_PREFIX = "ENVLOOP_"
CONTAMINATION_POLICIES = ("remove", "refuse")


def round_key(n: int) -> str:
    """The partition key of round ``n`` (``r0001``)."""
    return f"r{n:0{ROUND_KEY_WIDTH}d}"


def round_number(key: str) -> int:
    """The number of a round key; raises ``ValueError`` naming the expected shape."""
    if not (key.startswith("r") and key[1:].isdigit()):
        raise ValueError(f"round key {key!r} must look like r0001")
    return int(key[1:])


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(frozen=True)
class LoopConfig:
    """What a person chooses for a loop; everything else comes from the recipe file."""

    task: str = field(default="personal_agent", metadata=_help("Task (its current snapshot is the benchmark)."))
    recipe: str = field(default=DEFAULT_RECIPE, metadata=_help("Recipe file (packaged:<name> or a path)."))
    recipe_overrides: Mapping[str, Any] = field(default_factory=dict, metadata=_help(
        "The loop's recipe override, for every arm including the null arms (KEY=VALUE, repeatable)."))
    noise_arms: int = field(default=3, metadata=_help("K null arms of the noise floor (≥ 2)."))
    top_clusters: int = field(default=4, metadata=_help("Failure clusters a round targets."))
    # 480 targeted questions (one per synthesized record) beside the built-in benchmark's 1,876 train questions:
    # a fifth of a round's snapshot, so a fixed step budget draws about one example in five from the failure
    # clusters (120 made it one in sixteen: too little signal). Cheap to make (0.6 s for 480 here); what it
    # costs is training: at the recipe's 4 epochs, 480 x 4 = 1,920 more examples a round, ~10 min at the
    # shipped CPU recipe's 3.3 examples/s and ~2 min at a recipe 5x cheaper.
    n_synthesized: int = field(default=480, metadata=_help(
        "New training examples per round (targeted at the champion's failure clusters)."))
    generator: str = field(default="builtin_targeted", metadata=_help(
        "Environment generator: builtin_targeted | label_preserving_variants | module:attribute."))
    safety_families: tuple[str, ...] = field(default=("needs_approval",), metadata=_help(
        "Families whose false-negative rate is guarded (comma-separated), added to the task's declared ones "
        "(never fewer); their answers defer to a person below a threshold fitted on val for safety_fnr_target."))
    safety_fnr_target: float = field(default=0.10, metadata=_help(
        "Val false-negative rate a safety family's automation threshold is fitted for (in [0, 1))."))
    contamination_policy: str = field(default="remove", metadata=_help(
        "remove: drop synthesized rows that overlap test/holdout; refuse: keep them so the check blocks training."))
    builtin_users: int | None = field(default=None, metadata=_help("Built-in benchmark size in users (when generated)."))
    builtin_records_per_user: int | None = field(default=None, metadata=_help("Built-in benchmark records per user."))
    builtin_hidden_users: int | None = field(default=None, metadata=_help(
        "Built-in benchmark users in each of test and holdout, added after builtin_users (default: their "
        "fraction of builtin_users; without builtin_users, the powered 864)."))
    max_lever_seconds: float | None = field(default=None, metadata=_help(
        "The proposer's compute cap per round: a lever predicted to train longer (CPU-seconds) is not proposed "
        "(default: no cap)."))
    home: str | None = field(default=None, metadata=_help("The EnvLoop home (default $ENVLOOP_HOME or ./.envloop)."))

    def __post_init__(self) -> None:
        if self.noise_arms < 2:
            raise ValueError(f"noise_arms must be ≥ 2 (a spread needs two arms), got {self.noise_arms}")
        if self.contamination_policy not in CONTAMINATION_POLICIES:
            raise ValueError(f"contamination_policy must be one of {CONTAMINATION_POLICIES}, "
                             f"got {self.contamination_policy!r}")
        if self.top_clusters < 1:
            raise ValueError(f"top_clusters must be ≥ 1, got {self.top_clusters}")
        if not 0.0 <= self.safety_fnr_target < 1.0:
            raise ValueError(f"safety_fnr_target must be in [0, 1), got {self.safety_fnr_target}")
        if self.max_lever_seconds is not None and not self.max_lever_seconds > 0:
            raise ValueError(f"max_lever_seconds must be > 0 (or unset: no cap), got {self.max_lever_seconds}")
        if self.n_synthesized < 0:
            raise ValueError(f"n_synthesized must be ≥ 0, got {self.n_synthesized}")
        if not isinstance(self.recipe_overrides, Mapping):
            raise ValueError(f"recipe_overrides must be a mapping of recipe fields, got {self.recipe_overrides!r}")
        check_recipe_overrides(self.recipe_overrides)  # a misspelled key is refused here, not in a run's step
        given = (self.safety_families,) if isinstance(self.safety_families, str) else tuple(self.safety_families)
        bad = [f for f in given if not isinstance(f, str) or not f.strip()]
        if bad:
            raise ValueError(f"safety_families: each must be a family name, got {bad!r}")
        object.__setattr__(self, "safety_families", tuple(dict.fromkeys(f.strip() for f in given)))

    def guarded_families(self, task: TaskSnapshot) -> tuple[str, ...]:
        """The families whose false-negative rate the loop guards on ``task`` (the snapshot a step opened): the
        task's declared ones first, then the loop's ``safety_families``.

        A run may add guarded families, never drop the task's declared ones: the guard is not switched off by
        an empty list, ``ENVLOOP_SAFETY_FAMILIES=","`` or a launchpad config. Read from the snapshot the step
        holds, so building a ``LoopConfig`` reads nothing from disk.
        """
        declared = declared_safety_families(task.manifest)
        return tuple(dict.fromkeys((*declared, *self.safety_families)))

    def load_recipe(self) -> Recipe:
        """The loop's recipe: the file with the loop's ``recipe_overrides`` (validated), read and merged once per
        config (a run builds one config, so every step of it trains and hashes the same recipe)."""
        recipe = self.__dict__.get("_recipe")
        if recipe is None:
            recipe = load_recipe(self.recipe, self.recipe_overrides)
            object.__setattr__(self, "_recipe", recipe)  # a cache beside the fields: not compared, not hashed
        return recipe

    def recipe_hash(self) -> str:
        """sha256 of the loop's recipe (the file with the loop's override): what the floor and hypotheses are keyed by."""
        return recipe_hash(self.load_recipe())

    @property
    def model_name(self) -> str:
        """The MLflow registered model of the task's releases."""
        return model_name(self.task)

    # -- one source for the resource, the CLI and the environment ---------------------------
    def to_settings(self) -> dict[str, Any]:
        """JSON-able settings (what a run records, and what :meth:`from_settings` reads back)."""
        out = dataclasses.asdict(self)
        out["recipe_overrides"] = dict(self.recipe_overrides)
        out["safety_families"] = list(self.safety_families)
        return out

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> "LoopConfig":
        """A config from settings (``LoopConfig`` names and values; ``safety_families`` may be comma-separated text).

        Raises:
            ValueError: an unknown setting, or a value ``LoopConfig`` refuses (naming it).
        """
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(settings) - names)
        if unknown:
            raise ValueError(f"unknown loop setting(s) {unknown}; allowed: {sorted(names)}")
        data = dict(settings)
        if isinstance(data.get("safety_families"), str):
            data["safety_families"] = parse_setting("safety_families", data["safety_families"])
        return cls(**data)


def declared_safety_families(manifest: SnapshotManifest) -> tuple[str, ...]:
    """The safety families a task declares in its snapshot's manifest; a loop always guards them.

    A manifest may declare them (``extra.safety_families``); the built-in benchmark declares
    ``core.benchmark.SAFETY_FAMILIES`` (``needs_approval``); a task that declares none has none.
    """
    extra = manifest.extra
    if extra.get("safety_families") is not None:
        return tuple(extra["safety_families"])
    return tuple(SAFETY_FAMILIES) if (extra.get("generator") or {}).get("name") == BENCHMARK_NAME else ()


def loop_fields() -> tuple[dataclasses.Field, ...]:
    """The settings of a loop, in declaration order."""
    return dataclasses.fields(LoopConfig)


def field_default(f: dataclasses.Field) -> Any:
    """A field's default (calling its factory)."""
    return f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]


def field_type(f: dataclasses.Field) -> Any:
    """A field's type with ``X | None`` unwrapped to ``X`` (for parsing text)."""
    hint = typing.get_type_hints(LoopConfig)[f.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if type(None) in typing.get_args(hint) and len(args) == 1 else hint


def env_name(name: str) -> str:
    """The environment variable of a setting (``ENVLOOP_NOISE_ARMS``)."""
    return f"{ENV_PREFIX}{name.upper()}"


def settings_from_env(environ: Mapping[str, str]) -> dict[str, Any]:
    """The settings given as ``ENVLOOP_<FIELD>`` variables, parsed by field type.

    Raises:
        ValueError: naming the variable and the expected type.
    """
    out: dict[str, Any] = {}
    for f in loop_fields():
        raw = environ.get(env_name(f.name))
        if raw:
            out[f.name] = parse_setting(f.name, raw, label=env_name(f.name))
    return out


def parse_setting(name: str, raw: str, *, label: str | None = None) -> Any:
    """A setting given as text (an environment variable, a comma list on the command line), by field type.

    ``recipe_overrides`` is a JSON object, ``safety_families`` comma-separated names, integers and
    numbers are parsed as such, the rest text.

    Raises:
        ValueError: naming ``label`` (default the setting) and the expected form.
    """
    label = label or name
    if name == "recipe_overrides":
        try:
            value = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{label} is not JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(f"{label} must be a JSON object of recipe fields")
        try:
            return check_recipe_overrides(value)
        except RecipeError as exc:
            raise RecipeError(f"{label}: {exc}") from None
    if name == "safety_families":
        return tuple(s.strip() for s in raw.split(",") if s.strip())
    kind = field_type(next(f for f in loop_fields() if f.name == name))
    if kind is int:
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"{label}={raw!r}: must be an integer") from None
    if kind is float:
        try:
            return float(raw)
        except ValueError:
            raise ValueError(f"{label}={raw!r}: must be a number") from None
    return raw


__all__ = ["ENV_PREFIX", "LoopConfig", "declared_safety_families", "env_name", "field_default", "field_type", "loop_fields",
           "parse_setting", "round_key", "round_number", "settings_from_env"]
