"""A round's hypothesis and its gate, and the checks every door runs on them before any compute.

Rule 2 (``docs/loop-rules.md``): a gate, registered or amended, is in every field only stricter than the
default: the metric's own direction, the measured noise floor, a paired CI above zero, guards at most their
defaults (:func:`gate_value_errors`, :meth:`Gate.require_not_loose`); every hypothesis records its minimum
detectable effect (:func:`power_errors`). A round's seeds are drawn by the loop, never chosen
(:func:`seed_count_errors`, :func:`draw_seeds`). The ledger writes a hypothesis once and refuses any change
(``Ledger.register_hypothesis``, :class:`HypothesisImmutableError`).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Mapping

from envloop_pipelines.core.ledger.event_log import LedgerError
from envloop_pipelines.core.storage import canonical_json, sha256_bytes

#: A hypothesis's own recipe change: ``change.recipe_diff``, its one spelling. ``recipe_overrides`` is the loop's
#: override (``--recipe-override``); in a change it is refused, naming the field to use.
RECIPE_DIFF = "recipe_diff"
RECIPE_DIFF_FIELD = f"change.{RECIPE_DIFF}"
OLD_RECIPE_DIFF = "recipe_overrides"
_OLD_SPELLING = ("a hypothesis's own recipe change is change.recipe_diff (recipe_overrides is the loop's override, "
                 "set with --recipe-override)")


class HypothesisImmutableError(LedgerError):
    """A registered hypothesis would change."""


class HypothesisRefusedError(LedgerError, ValueError):
    """A hypothesis with an invalid field (its change, predicted delta or seeds); nothing is written."""


class GateTooLooseError(LedgerError, ValueError):
    """A gate would be looser than the measured noise floor and a paired CI above zero (rule 2)."""


def power_errors(power: Any) -> list[str]:
    """What is wrong with a hypothesis's recorded power (rule 2: every hypothesis records the smallest effect its
    test can detect): ``power`` an object whose ``mde`` is a finite number ≥ 0; one message naming ``power.mde``."""
    if not isinstance(power, Mapping):
        return [f"power.mde: a hypothesis is registered with its minimum detectable effect; got no power "
                f"({json.dumps(power, default=str)})"]
    mde = power.get("mde")
    if not _is_number(mde) or not math.isfinite(mde) or mde < 0:
        return [f"power.mde: must be a finite number ≥ 0 (the minimum detectable effect of the hypothesis's test), "
                f"got {json.dumps(mde, default=str)}"]
    return []


#: The loosest gate any hypothesis or amendment may set (rule 2): the gain must clear at least the measured
#: noise floor itself (``floor_multiplier`` ≥ 1) and the paired CI's lower end must be above zero.
MIN_FLOOR_MULTIPLIER = 1.0


@dataclass(frozen=True)
class Gate:
    """The bar a candidate must clear, fixed before training.

    A candidate is promoted when its paired delta on ``primary_metric`` (in the
    registered direction) exceeds both ``min_delta`` and the noise floor times
    ``floor_multiplier``, and the lower end of its CI is above zero.
    """

    primary_metric: str = "family_macro_accuracy"
    direction: str = "increase"
    min_delta: float = 0.0
    floor_multiplier: float = 1.0
    require_ci_above_zero: bool = True
    #: Guards: calibrated ECE ceiling, safety FNR may not rise by more than this, families may not drop by
    #: more than their own noise (their per-family floor, or ``family_drop_tolerance`` when none is measured).
    max_ece: float = 0.08
    max_safety_fnr_increase: float = 0.02
    family_drop_tolerance: float = 0.05

    def __post_init__(self) -> None:
        if self.direction not in ("increase", "decrease"):
            raise ValueError(f"gate.direction must be 'increase' or 'decrease', got {self.direction!r}")
        for name in ("min_delta", "floor_multiplier", "max_ece", "max_safety_fnr_increase", "family_drop_tolerance"):
            if getattr(self, name) < 0:
                raise ValueError(f"gate.{name} must be ≥ 0, got {getattr(self, name)}")

    def loosening(self) -> list[str]:
        """Why this gate is looser than rule 2 allows, one message per field (empty when it is not).

        Every field may only be stricter than the default (:func:`gate_value_errors`): the direction is
        the primary metric's own, ``min_delta`` ≥ 0, ``floor_multiplier`` ≥ 1, ``require_ci_above_zero``
        true, each guard tolerance at most its default; NaN, infinities and non-numbers are refused.
        Gates registered before this rule still load (the ledger is never rewritten); they are refused
        only when written, and the decision applies the defaults in their place.
        """
        return gate_value_errors(asdict(self))

    def require_not_loose(self, what: str) -> "Gate":
        """Return the gate, or raise :class:`GateTooLooseError` naming each loosened field."""
        errors = self.loosening()
        if errors:
            raise GateTooLooseError(f"{what} refused: " + "; ".join(errors))
        return self


#: The direction in which each metric improves: a gate's direction is its metric's own, never settable
#: the other way (a "decrease" gate on an accuracy would promote a worse candidate).
METRIC_DIRECTIONS = {"family_macro_accuracy": "increase", "accuracy": "increase", "macro_accuracy": "increase",
                     "pass_at_1": "increase", "nll": "decrease", "brier": "decrease", "ece": "decrease"}
#: Guard tolerances: a gate may set each one lower (stricter) than its default, never higher.
GUARD_FIELDS = ("max_ece", "max_safety_fnr_increase", "family_drop_tolerance")


def metric_direction(metric: str) -> str | None:
    """The direction in which ``metric`` improves (``None`` for a metric this loop does not know)."""
    return METRIC_DIRECTIONS.get(metric)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def gate_value_errors(values: Mapping[str, Any]) -> list[str]:
    """Each field of a gate that is looser than the default, or not a finite number, one message per field.

    Rule 2, "stricter, never looser", field by field: ``direction`` must be the primary metric's own
    (:data:`METRIC_DIRECTIONS`), ``min_delta`` ≥ 0, ``floor_multiplier`` ≥ 1, ``require_ci_above_zero``
    true, ``max_ece``, ``max_safety_fnr_increase`` and ``family_drop_tolerance`` between 0 and their
    defaults (a guard at 1.0 is a guard switched off); NaN and infinities are refused. The one check every
    door calls (through :func:`gate_errors`, :meth:`Gate.require_not_loose`).
    """
    defaults = Gate.__dataclass_fields__
    errors: list[str] = []
    metric = values.get("primary_metric", defaults["primary_metric"].default)
    if not isinstance(metric, str):
        errors.append(f"gate.primary_metric: must be a metric name (text), got {json.dumps(metric, default=str)}")
        metric = None
    direction = values.get("direction", defaults["direction"].default)
    own = metric_direction(metric) if metric else None
    if metric and own is None:
        errors.append(f"gate.primary_metric: {metric!r} has no known direction (known: "
                      f"{', '.join(sorted(METRIC_DIRECTIONS))})")
    elif own is not None and direction != own:
        errors.append(f"gate.direction: {metric} improves when it {own}s; a gate may not reverse it "
                      f"(got {json.dumps(direction, default=str)}); leave direction out")
    for name, low, high in (("min_delta", 0.0, None), ("floor_multiplier", MIN_FLOOR_MULTIPLIER, None),
                            *((g, 0.0, defaults[g].default) for g in GUARD_FIELDS)):
        value = values.get(name, defaults[name].default)
        if not _is_number(value):
            errors.append(f"gate.{name}: must be a number, got {json.dumps(value, default=str)}")
        elif not math.isfinite(value):
            errors.append(f"gate.{name}: must be a finite number, got {value}")
        elif name == "floor_multiplier" and value < low:
            errors.append(f"gate.floor_multiplier: must be at least {MIN_FLOOR_MULTIPLIER:g} (got {value:g}); "
                          f"a hypothesis may make its gate stricter, never looser than the measured noise floor")
        elif value < low:
            errors.append(f"gate.{name}: must be ≥ {low:g}, got {value:g}")
        elif high is not None and value > high:
            errors.append(f"gate.{name}: must be at most the default {high:g} (got {value:g}); a guard may be "
                          f"made stricter, never looser")
    if values.get("require_ci_above_zero", True) is not True:
        errors.append(f"gate.require_ci_above_zero: must be true (got "
                      f"{json.dumps(values.get('require_ci_above_zero'), default=str)}); every promotion needs the "
                      f"paired CI's lower end above zero")
    return errors


def gate_errors(raw: Any) -> list[str]:
    """What is wrong with a gate, before any compute: unknown fields, bad values, anything looser than the default.

    Every door checks a gate here (a hypothesis file, the SDK, the launchpad, ``Ledger.register_hypothesis``,
    ``Ledger.amend_gate``); each message names the field.
    """
    if isinstance(raw, Gate):
        raw = asdict(raw)
    if not isinstance(raw, Mapping):
        return ["gate: must be an object"]
    allowed = [f.name for f in fields(Gate)]
    unknown = [f"gate: unknown field {k!r} (allowed: {', '.join(allowed)})" for k in raw if k not in allowed]
    if unknown:
        return unknown
    return gate_value_errors(raw)


#: What a hypothesis's ``change.kind`` may be: a person's proposal (``data``, ``recipe``), and the RL round's.
PROPOSAL_CHANGE_KINDS = ("data", "recipe")
CHANGE_KINDS = (*PROPOSAL_CHANGE_KINDS, "rl_from_verified_attempts")


#: A change's switches and their one value: ``init`` ("base": the candidate starts from the base model, not the
#: champion) and ``data`` ("train": it trains on the snapshot's base rows alone, not the synthesized ones).
CHANGE_SWITCHES = {"init": "base", "data": "train"}


def recipe_diff_errors(diff: Any) -> list[str]:
    """What is wrong with a hypothesis's ``change.recipe_diff``: checked by the loop's one recipe validator
    (:func:`~envloop_pipelines.core.model.recipe.check_recipe_overrides`: keys against the recipe's fields with
    a close-match hint, values on the default recipe); the candidate's seed is the hypothesis's seeds."""
    from envloop_pipelines.core.model.recipe import RecipeError, check_recipe_overrides

    if not isinstance(diff, Mapping):
        return [f"{RECIPE_DIFF_FIELD}: must be an object of recipe fields, got {json.dumps(diff, default=str)}"]
    errors = []
    if "seed" in diff:
        errors.append(f"{RECIPE_DIFF_FIELD}.seed: the candidate's seed is the hypothesis's seeds, not a recipe change")
    try:
        check_recipe_overrides({k: v for k, v in diff.items() if k != "seed"}, what="recipe field")
    except (RecipeError, TypeError, ValueError) as exc:
        errors.append(f"{RECIPE_DIFF_FIELD}: {exc}")
    return errors


def recipe_diff(change: Mapping[str, Any]) -> dict[str, Any]:
    """The recipe change a hypothesis tests (``change.recipe_diff``; a change without one changes no field).

    Raises:
        LedgerError: the change spells it ``recipe_overrides``, the loop's override (a hypothesis registered
            before the one spelling): the round refuses it rather than train without the change.
    """
    if OLD_RECIPE_DIFF in change:
        raise LedgerError(f"change.{OLD_RECIPE_DIFF}: {_OLD_SPELLING}; register the hypothesis again with it")
    return dict(change.get(RECIPE_DIFF) or {})


def hypothesis_errors(*, change: Any, predicted_delta: Any, seeds: Any, gate: Any,
                      kinds: tuple[str, ...] = CHANGE_KINDS, require_kind: bool = True) -> list[str]:
    """Everything wrong with a hypothesis's values, each message naming its field; empty when it may be registered.

    ``change`` a non-empty object whose ``kind`` is one of ``kinds`` (a ``recipe_diff`` with the recipe's
    fields only, :func:`recipe_diff_errors`), ``predicted_delta`` a finite number, ``seeds`` a non-empty
    list of distinct integers, ``gate`` no looser than the default (:func:`gate_errors`). Called by
    ``steps.proposal_errors`` (every door: CLI, SDK, the launchpad) and by :meth:`Ledger.register_hypothesis`
    (``require_kind=False``: a core caller's change may be empty, a kind it gives is still checked).
    """
    errors: list[str] = []
    if not isinstance(change, Mapping):
        errors.append(f"change: must be an object, got {json.dumps(change, default=str)}")
    elif not change and require_kind:
        errors.append(f"change: must not be empty; give change.kind ({' | '.join(kinds)})")
    elif change:
        kind = change.get("kind")
        if kind not in kinds and (require_kind or "kind" in change):
            errors.append(f"change.kind: must be one of {', '.join(kinds)}, got {json.dumps(kind, default=str)}")
        if OLD_RECIPE_DIFF in change:
            errors.append(f"change.{OLD_RECIPE_DIFF}: {_OLD_SPELLING}")
        if RECIPE_DIFF in change:
            errors += recipe_diff_errors(change[RECIPE_DIFF])
        elif kind == "recipe" and OLD_RECIPE_DIFF not in change:
            errors.append(f"{RECIPE_DIFF_FIELD}: a change of kind 'recipe' needs recipe_diff (an object of recipe fields)")
        # What the candidate starts from and trains on (the proposer's levers write them; a person may too):
        # a misspelled value would silently train from the champion on every row.
        for name, allowed in CHANGE_SWITCHES.items():
            if name in change and change[name] != allowed:
                errors.append(f"change.{name}: must be {json.dumps(allowed)} or left out, "
                              f"got {json.dumps(change[name], default=str)}")
    if not _is_number(predicted_delta) or not math.isfinite(predicted_delta):
        errors.append(f"predicted_delta: must be a finite number, got {json.dumps(predicted_delta, default=str)}")
    if (not isinstance(seeds, (list, tuple)) or not seeds
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in seeds)):
        errors.append(f"seeds: must be a non-empty list of integers, got {json.dumps(seeds, default=str)}")
    elif len(set(seeds)) != len(seeds):
        errors.append(f"seeds: must be distinct, got {list(seeds)}")
    errors += gate_errors(gate)
    return errors


#: The most seeds a person may ask a round for (``"seeds": N``); the loop draws them after registration.
MAX_SEED_COUNT = 8


def seed_count_errors(seeds: Any) -> list[str]:
    """What is wrong with a proposal's ``seeds``: a count (how many), never values (which) (issue 34).

    A round's seeds are drawn by the loop when its hypothesis is registered (:func:`draw_seeds`), so no one
    can preview a seed's candidate on test and then register the seed that happened to win (best-of-k on
    test). A person may say how many: an integer from 1 to :data:`MAX_SEED_COUNT`.
    """
    if isinstance(seeds, int) and not isinstance(seeds, bool) and 1 <= seeds <= MAX_SEED_COUNT:
        return []
    if isinstance(seeds, (list, tuple)):
        return [f"seeds: a round's seeds are drawn by the loop after registration; give a count (how many, e.g. "
                f"\"seeds\": {max(len(seeds), 1)}), not values (got {json.dumps(list(seeds), default=str)})"]
    return [f"seeds: must be a count of seeds, an integer from 1 to {MAX_SEED_COUNT} (the loop draws them after "
            f"registration), got {json.dumps(seeds, default=str)}"]


def draw_seeds(count: int = 1, used: Any = ()) -> tuple[int, ...]:
    """``count`` distinct seeds the loop draws at registration (or amendment), none of ``used``.

    Drawn from the OS's randomness (``secrets``) in [1, 2**31): unknown to anyone before the hypothesis
    (or amendment) that carries them is written, so a seed cannot be chosen after seeing its candidate.
    """
    import secrets

    taken = set(used)
    out: list[int] = []
    while len(out) < count:
        seed = 1 + secrets.randbelow(2**31 - 1)
        if seed not in taken and seed not in out:
            out.append(seed)
    return tuple(out)


@dataclass(frozen=True)
class Hypothesis:
    """A round's registered proposal: the change, the predicted effect, the gate, the seeds."""

    task: str
    round: str
    benchmark_version: str
    change: Mapping[str, Any]
    predicted_delta: float
    gate: Gate
    seeds: tuple[int, ...]
    recipe_hash: str
    author: str = "auto"
    rationale: str = ""
    created_at: float = field(default_factory=time.time)
    #: The test's power for this hypothesis, measured at registration (rule 2: each hypothesis records the
    #: smallest effect its test set can detect): ``mde``, the ``se`` it comes from, ``underpowered`` (the
    #: predicted effect is below the MDE), how it was measured. ``None`` in hypotheses registered before
    #: (left out of their content, so their hashes are unchanged).
    power: Mapping[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["seeds"] = list(self.seeds)
        if self.power is None:
            d.pop("power")
        else:
            d["power"] = dict(self.power)
        return d

    @property
    def underpowered(self) -> bool:
        """Whether the predicted effect is below the minimum detectable effect measured at registration."""
        return bool(self.power and self.power.get("underpowered"))

    @property
    def hash(self) -> str:
        """Content hash (the registration time is not part of the content)."""
        body = self.to_dict()
        body.pop("created_at")
        return sha256_bytes(canonical_json(body))

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "Hypothesis":
        data = dict(raw)
        data.pop("hash", None)
        data["gate"] = Gate(**data["gate"])
        data["seeds"] = tuple(data["seeds"])
        return cls(**data)
