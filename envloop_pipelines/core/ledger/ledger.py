"""The ledger: hypotheses, arms, rejected candidates, releases, all kept.

Rules enforced here (``docs/rsi-rules.md``):

1. A hypothesis is written before training, hashed and immutable: the file is
   write-once, a second registration with other content is refused.
2. A gate, registered or amended, is in every field only stricter than the default: the metric's
   own direction, the measured noise floor, a paired CI above zero, guards at most their defaults
   (:func:`gate_value_errors`, :meth:`Gate.require_not_loose`).
3. A gate moves only as a recorded amendment (:meth:`Ledger.amend_gate`, a reason, a ``gate_amended``
   event with the file's sha256), shown beside the original, passed on fresh seeds; every read of a
   hypothesis or an amendment is checked against its ledger event.
4. The holdout is read once per release: the read is a write-once marker. Every read of ``test`` is a
   ``test_read`` event naming its reader; a round or the loop's setup reads test only within its budget
   of distinct predictions files (:meth:`Ledger.reading_test`).
5. Every arm, hypothesis and rejected candidate stays with its numbers.
6. Release cards are never rewritten; corrections are appended as errata.

Layout under ``<home>/loops/<task>/``::

    ledger.jsonl                 append-only events (idempotent: an event id is its content hash)
    hypotheses/<round>.json      write-once registered hypotheses
    amendments/<round>-<n>.json  gate amendments
    releases/<NNNN>/card.json    release cards (write-once) and card.md
    releases/<NNNN>/holdout.json the one holdout read of the release
    releases/<NNNN>/errata/<n>.json  appended corrections
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Iterator, Mapping

from envloop_pipelines.core.ledger.store import loop_dir
from envloop_pipelines.core.storage import atomic_write_bytes, canonical_json, sha256_bytes

# -- the ledger's event kinds: the only spelling (docs/concepts.md) -------------------------------------------
EVENT_LOOP_STARTED = "loop_started"
EVENT_LOOP_STOPPED = "loop_stopped"
EVENT_NULL_ARM = "null_arm"
EVENT_HYPOTHESIS_REGISTERED = "hypothesis_registered"
EVENT_HYPOTHESIS_REFUTED = "hypothesis_refuted"
EVENT_GATE_AMENDED = "gate_amended"
EVENT_CHECKPOINT_TRAINED = "lora_checkpoint_trained"
EVENT_CANDIDATE_REJECTED = "candidate_rejected"
EVENT_ROUND_DECIDED = "round_decided"
EVENT_ROUND_FAILED = "round_failed"
EVENT_HOLDOUT_READ = "holdout_read"
EVENT_RELEASE_PROMOTED = "release_promoted"
EVENT_ERRATUM = "erratum"
EVENT_TEST_READ = "test_read"
EVENT_HOLDOUT_SLOT = "holdout_slot_opened"
EVENT_KINDS = (EVENT_LOOP_STARTED, EVENT_LOOP_STOPPED, EVENT_NULL_ARM, EVENT_HYPOTHESIS_REGISTERED,
               EVENT_HYPOTHESIS_REFUTED, EVENT_GATE_AMENDED, EVENT_CHECKPOINT_TRAINED, EVENT_CANDIDATE_REJECTED,
               EVENT_ROUND_DECIDED, EVENT_ROUND_FAILED, EVENT_HOLDOUT_READ, EVENT_RELEASE_PROMOTED, EVENT_ERRATUM,
               EVENT_TEST_READ, EVENT_HOLDOUT_SLOT)
#: Kinds only the holdout's one read writes (the release step's slot and the read itself): :meth:`Ledger.append`
#: refuses them, so no caller opens a release's holdout slot for predictions of its own (issue 34).
LEDGER_OWN_KINDS = (EVENT_HOLDOUT_SLOT, EVENT_HOLDOUT_READ)
#: Kinds written by earlier versions, read under their current name (the line on disk is never rewritten).
LEGACY_EVENT_KINDS = {"arm_trained": EVENT_CHECKPOINT_TRAINED}


class LedgerError(RuntimeError):
    """A loop rule was about to be broken."""


class LedgerChainError(LedgerError):
    """The ledger's hash chain is broken: a line was edited, removed or inserted (the first broken link named)."""


#: The field in which each event carries the digest of the ledger before it (sha256 of every byte of
#: ``ledger.jsonl`` before its line): each event binds all the ones before it.
CHAIN_FIELD = "prev"


def chain_break(raw: bytes, path: Any = "ledger.jsonl") -> str | None:
    """The first broken link of a ledger file's hash chain, as one message; ``None`` when every link holds.

    Each event written since the chain exists carries ``prev``, the sha256 of every byte of the file
    before its line. Lines before the first chained event were written before the chain existed (an
    existing home): they are read as they are, and the first chained event's ``prev`` binds them all (the
    chain starts there; nothing is migrated or rewritten). After it, every line must carry its ``prev`` and
    match: an edited or removed line changes the digest every later event recorded, an inserted line has
    none or a wrong one. A torn last line (a crash mid-write, no newline) is not an event. A truncated tail
    (the last events deleted) leaves a chain that holds: the head anchored in MLflow (:func:`anchor_head`)
    tells that.
    """
    import hashlib

    digest = hashlib.sha256()
    started = False
    lines = raw.split(b"\n")
    for n, line in enumerate(lines, 1):
        last = n == len(lines)
        if last:
            break  # after the final newline: empty, or a torn line
        text = line.decode("utf-8", errors="replace")
        if text.strip():
            try:
                event = json.loads(text)
            except json.JSONDecodeError:
                event = None
            what = (f"{path} line {n}" if not isinstance(event, dict) else
                    f"{path} line {n} (event {event.get('event_id')}, {event.get('kind')})")
            if not isinstance(event, dict):
                if started:
                    return f"ledger chain broken at {what}: not a JSON event; a line was edited by hand"
            elif CHAIN_FIELD in event:
                expected = digest.hexdigest()
                if event[CHAIN_FIELD] != expected:
                    return (f"ledger chain broken at {what}: it records prev {str(event[CHAIN_FIELD])[:16]}, but the "
                            f"{n - 1} lines before it hash to {expected[:16]}: a line before it was edited, removed "
                            f"or inserted")
                started = True
            elif started:
                return (f"ledger chain broken at {what}: no {CHAIN_FIELD} digest after the chain started; the line "
                        f"was inserted or rewritten by hand")
        digest.update(line + b"\n")
    return None


class HypothesisImmutableError(LedgerError):
    """A registered hypothesis would change."""


class HoldoutAlreadyReadError(LedgerError):
    """A second holdout read for the same release."""


class HoldoutSlotError(LedgerError):
    """A holdout read for a release other than the one being published now (the next release number)."""


class ReleaseCardExistsError(LedgerError):
    """A release card would be rewritten."""


class HypothesisRefusedError(LedgerError, ValueError):
    """A hypothesis with an invalid field (its change, predicted delta or seeds); nothing is written."""


class GateTooLooseError(LedgerError, ValueError):
    """A gate would be looser than the measured noise floor and a paired CI above zero (rule 2)."""


class TestReadBudgetError(LedgerError, PermissionError):
    """A loop reader's read of ``test`` beyond its budget of distinct predictions files (rule 4).

    Raised before any label is read; nothing is appended to the ledger.
    """

    __test__ = False  # an exception, not a pytest test class


#: Who reads ``test`` when no loop step does: a person's CLI, SDK or environment call (logged, not limited).
ADHOC_READER = "adhoc"
#: What a round reads of ``test`` (``candidate.reevaluate``): its candidate, its champion (the candidate's
#: paired baseline) and the TF-IDF baseline, three distinct predictions files; one more per gate amendment of
#: the round (its candidate is trained again on the amendment's fresh seeds, rule 3, and read again).
ROUND_TEST_READ_BUDGET = 3
#: What each kind of loop reader reads of ``test``, for the refusal's message.
_READER_READS = {"round": "its candidate, its champion and the TF-IDF baseline",
                 "setup": "its null arms, its continuation arms and the TF-IDF baseline of release 1"}


def reader_budget(reader: Any, budget: Any = None) -> int | None:
    """How many distinct predictions files ``reader`` may score on ``test``; ``None`` when not limited.

    ``adhoc`` (a person's call): not limited, each read logged. ``round:<round key>``:
    :data:`ROUND_TEST_READ_BUDGET`, fixed (``budget`` may not change it; :meth:`Ledger.reading_test` adds one
    per gate amendment of the round, whose fresh-seed candidate is a new file). ``setup:<noise floor key>``: the
    ``budget`` the loop's setup counts (``setup.setup_reader``: its null arms, continuation arms
    and TF-IDF baseline).

    Raises:
        ValueError: an unknown reader, or a budget that is missing, not a positive integer or not the round's.
    """
    if reader == ADHOC_READER:
        if budget is not None:
            raise ValueError(f"read_budget: an {ADHOC_READER} read is not limited; got a budget of {budget!r}")
        return None
    kind, _, name = reader.partition(":") if isinstance(reader, str) else ("", "", "")
    if kind not in _READER_READS or not name:
        raise ValueError(f"reader: must be {ADHOC_READER!r}, 'round:<round key>' or 'setup:<noise floor key>', "
                         f"got {reader!r}")
    if kind == "round":
        if budget is not None and budget != ROUND_TEST_READ_BUDGET:
            raise ValueError(f"read_budget: a round reads test for at most {ROUND_TEST_READ_BUDGET} predictions files "
                             f"({_READER_READS['round']}); its budget is not settable (got {budget!r})")
        return ROUND_TEST_READ_BUDGET
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"read_budget: the setup reader {reader!r} needs its budget, a positive integer "
                         f"({_READER_READS['setup']}), got {budget!r}")
    return budget


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
    """What is wrong with a hypothesis's ``change.recipe_diff``: keys against the recipe's fields, values
    validated on the default recipe (the loop's recipe validates them again when the candidate trains)."""
    from envloop_pipelines.core.model.recipe import Recipe, recipe_from_dict, recipe_to_dict

    if not isinstance(diff, Mapping):
        return [f"change.recipe_diff: must be an object of recipe fields, got {json.dumps(diff, default=str)}"]
    allowed = sorted(f.name for f in fields(Recipe) if f.name != "seed")
    errors = []
    if "seed" in diff:
        errors.append("change.recipe_diff.seed: the candidate's seed is the hypothesis's seeds, not a recipe change")
    unknown = sorted(str(k) for k in diff if k not in allowed and k != "seed")
    if unknown:
        errors.append(f"change.recipe_diff: unknown recipe field(s) {', '.join(repr(k) for k in unknown)} "
                      f"(allowed: {', '.join(allowed)})")
    if not errors:
        try:
            recipe_from_dict({**recipe_to_dict(Recipe()), **diff})
        except (TypeError, ValueError) as exc:
            errors.append(f"change.recipe_diff: {exc}")
    return errors


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
        if "recipe_diff" in change:
            errors += recipe_diff_errors(change["recipe_diff"])
        elif kind == "recipe" and "recipe_overrides" not in change:
            errors.append("change.recipe_diff: a change of kind 'recipe' needs recipe_diff (an object of recipe fields)")
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


def _answers_as_baseline(read: Mapping[str, Any] | None) -> bool:
    """Whether a round's paired ``test_read`` scored predictions identical to its baseline's (same sha256)."""
    return read is not None and read["predictions_sha256"] == read.get("baseline_sha256")


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


def _amendment_matches(event: Mapping[str, Any], name: str, payload: bytes, body: Mapping[str, Any]) -> bool:
    """Whether a ``gate_amended`` event records this amendment file: its name and sha256 (events written before
    the sha256 was recorded: the same content)."""
    if "sha256" in event:
        return event.get("file") == name and event["sha256"] == sha256_bytes(payload)
    return all(event.get(k) == v for k, v in body.items())


def _write_once(path: Path, payload: bytes) -> bool:
    """Create ``path`` with ``payload`` unless it exists. True when written, False when it
    already held exactly this payload; raise when it holds something else."""
    if path.exists():
        if path.read_bytes() == payload:
            return False
        raise FileExistsError(str(path))
    atomic_write_bytes(path, payload)
    return True


class Ledger:
    """The append-only record of one task's loop."""

    def __init__(self, task: str, home: str | Path | None = None) -> None:
        self.task = task
        self.root = loop_dir(task, home)
        self.root.mkdir(parents=True, exist_ok=True)
        self.events_path = self.root / "ledger.jsonl"

    # -- events ------------------------------------------------------------------------------
    def append(self, kind: str, payload: Mapping[str, Any], *, key: str | None = None) -> dict[str, Any]:
        """Append one event; an event with the same ``key`` (default: content hash) is written once.

        Replaying a step after a crash therefore never duplicates an entry.

        Raises:
            LedgerError: ``kind`` is not one of ``EVENT_KINDS`` (one spelling per event), or the payload names
                a field the ledger writes itself (``kind``, ``task``, ``event_id``): it would have replaced the
                event's own (an event of one kind written as another). Nothing is written.
        """
        if kind in LEDGER_OWN_KINDS:
            raise LedgerError(f"{kind} events are written only by the release step's own read "
                              f"(Ledger.read_holdout_once, core/release/publish.py), never appended by a caller")
        return self._append(kind, payload, key=key)

    def _append(self, kind: str, payload: Mapping[str, Any], *, key: str | None = None) -> dict[str, Any]:
        """:meth:`append` without the refusal of :data:`LEDGER_OWN_KINDS` (the ledger's and the release step's own)."""
        if kind not in EVENT_KINDS:
            raise LedgerError(f"unknown ledger event kind {kind!r}; allowed: {', '.join(EVENT_KINDS)}")
        reserved = sorted(set(payload) & {"kind", "task", "event_id", CHAIN_FIELD})
        if reserved:
            raise LedgerError(f"{kind} event: payload field(s) {', '.join(reserved)} are the ledger's own "
                              f"(kind, task, event_id, {CHAIN_FIELD}); name them otherwise")
        import fcntl

        body = {"kind": kind, "task": self.task, **payload}
        event_id = key or sha256_bytes(canonical_json(body))[:16]
        # One appender at a time (an exclusive lock, released by the OS if its holder dies): each event's
        # ``prev`` is the digest of every line before it, so two appenders must not write after the same head.
        lock = os.open(self.root / "ledger.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            raw = self._verified_bytes()  # refuses to append to a broken chain
            for existing in self._parsed(raw):
                if existing.get("event_id") == event_id:
                    return existing
            committed = raw[:raw.rfind(b"\n") + 1]  # a torn last line (a crash mid-write) is not part of the chain
            event = {"event_id": event_id, "at": time.time(), **body, CHAIN_FIELD: sha256_bytes(committed)}
            line = json.dumps(event, sort_keys=True, ensure_ascii=False, default=str) + "\n"
            fd = os.open(self.events_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                if committed != raw:
                    os.ftruncate(fd, len(committed))
                os.write(fd, line.encode("utf-8"))
                os.fsync(fd)
            finally:
                os.close(fd)
        finally:
            os.close(lock)
        return event

    # -- the chain (issue 34: tamper evidence) ------------------------------------------------
    def _verified_bytes(self) -> bytes:
        """The ledger file's bytes, after :func:`chain_break` found no broken link.

        Raises:
            LedgerChainError: the first broken link, named (the same message for every reader).
        """
        raw = self.events_path.read_bytes() if self.events_path.exists() else b""
        broken = chain_break(raw, self.events_path)
        if broken:
            raise LedgerChainError(broken)
        return raw

    def verify(self) -> dict[str, Any]:
        """The chain's head when every link holds: ``{"events", "chained", "head"}``.

        ``head`` is the sha256 of the whole file (what :func:`anchor_head` records in MLflow).

        Raises:
            LedgerChainError: the first broken link (:func:`chain_break`).
        """
        raw = self._verified_bytes()
        events = self._parsed(raw)
        return {"events": len(events), "chained": sum(1 for e in events if CHAIN_FIELD in e),
                "head": sha256_bytes(raw)}

    @staticmethod
    def _parsed(raw: bytes) -> list[dict[str, Any]]:
        out = []
        for line in raw.decode("utf-8", errors="replace").splitlines():
            if not line.strip():
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a torn last line from a crash mid-write is not an event
        return out

    def events(self, kind: str | None = None) -> Iterator[dict[str, Any]]:
        """The ledger's events, oldest first (of ``kind``), once its chain is verified.

        Raises:
            LedgerChainError: a broken link (:func:`chain_break`): an edited, removed or inserted line.
        """
        if not self.events_path.exists():
            return
        for event in self._parsed(self._verified_bytes()):
            if event.get("kind") in LEGACY_EVENT_KINDS:
                event["kind"] = LEGACY_EVENT_KINDS[event["kind"]]
            if kind is None or event.get("kind") == kind:
                yield event

    # -- hypotheses --------------------------------------------------------------------------
    def hypothesis_path(self, round_key: str) -> Path:
        return self.root / "hypotheses" / f"{round_key}.json"

    def register_hypothesis(self, hypothesis: Hypothesis) -> str:
        """Write the hypothesis once; re-registering the same content is a no-op.

        The hypothesis is checked first (:func:`hypothesis_errors`: its change, predicted delta, seeds and
        a gate no looser than the default; :func:`power_errors`: a minimum detectable effect, ``power.mde``),
        so nothing is written for one that is refused. A hypothesis registered before the MDE was required
        is still read, and re-registering it unchanged is still a no-op.

        Raises:
            HypothesisImmutableError: the round already has a different hypothesis.
            GateTooLooseError: its gate is looser than the default in any field (rule 2).
            HypothesisRefusedError: another field is invalid, or it has no MDE (``power.mde``), each named.
        """
        path = self.hypothesis_path(hypothesis.round)
        if path.exists():
            existing = Hypothesis.from_dict(json.loads(path.read_text(encoding="utf-8")))
            if existing.hash != hypothesis.hash:
                raise HypothesisImmutableError(
                    f"round {hypothesis.round} already registered hypothesis {existing.hash[:12]}; "
                    f"a registered hypothesis is immutable (record an amendment instead)"
                )
            if self._registered_event(hypothesis.round) is None:  # a crash between the file and its event
                self._append_registered(hypothesis)
            return existing.hash
        errors = hypothesis_errors(change=hypothesis.change, predicted_delta=hypothesis.predicted_delta,
                                   seeds=list(hypothesis.seeds), gate=hypothesis.gate,
                                   require_kind=False)  # for every caller
        errors += power_errors(hypothesis.power)
        if errors:
            what = f"round {hypothesis.round}: hypothesis refused: " + "; ".join(errors)
            raise (GateTooLooseError if any(e.startswith("gate") for e in errors) else HypothesisRefusedError)(what)
        body = {**hypothesis.to_dict(), "hash": hypothesis.hash}
        atomic_write_bytes(path, (json.dumps(body, sort_keys=True, indent=2, ensure_ascii=False) + "\n").encode())
        self._append_registered(hypothesis)
        return hypothesis.hash

    def _append_registered(self, hypothesis: Hypothesis) -> None:
        power = hypothesis.power or {}
        self.append(EVENT_HYPOTHESIS_REGISTERED, {"round": hypothesis.round, "hash": hypothesis.hash,
                                                  "predicted_delta": hypothesis.predicted_delta,
                                                  "mde": power.get("mde"), "underpowered": hypothesis.underpowered,
                                                  "change": dict(hypothesis.change)},
                    key=f"hypothesis:{hypothesis.round}")

    def _registered_event(self, round_key: str) -> dict[str, Any] | None:
        return next((e for e in self.events(EVENT_HYPOTHESIS_REGISTERED) if e.get("round") == round_key), None)

    def hypothesis(self, round_key: str) -> Hypothesis | None:
        """The round's registered hypothesis, or ``None``; every read checks it against its ledger event.

        Raises:
            HypothesisImmutableError: the file's content does not hash to the hash its ``hypothesis_registered``
                event recorded (an edited file, even with its ``hash`` field recomputed), or it has no event.
        """
        path = self.hypothesis_path(round_key)
        if not path.exists():
            return None
        raw = json.loads(path.read_text(encoding="utf-8"))
        hyp = Hypothesis.from_dict(raw)
        if hyp.hash != raw.get("hash"):
            raise HypothesisImmutableError(f"{path}: content no longer matches its registered hash")
        event = self._registered_event(round_key)
        if event is None:
            raise HypothesisImmutableError(f"{path}: no {EVENT_HYPOTHESIS_REGISTERED} event for round {round_key} in "
                                           f"{self.events_path}; a hypothesis is registered only through "
                                           f"Ledger.register_hypothesis")
        if event.get("hash") != hyp.hash:
            raise HypothesisImmutableError(f"{path}: content hash {hyp.hash[:12]} is not the one registered in the "
                                           f"ledger ({str(event.get('hash'))[:12]}); the file was changed after "
                                           f"registration")
        return hyp

    def require_hypothesis(self, round_key: str) -> Hypothesis:
        hyp = self.hypothesis(round_key)
        if hyp is None:
            raise LedgerError(
                f"round {round_key} has no registered hypothesis; training refuses to start without one "
                f"(materialize registered_hypothesis first)"
            )
        return hyp

    def amend_gate(self, round_key: str, new_gate: Gate, reason: str, *, seeds: int = 1) -> dict[str, Any]:
        """Record a gate amendment (shown beside the original on the card), with the fresh seeds it requires.

        The candidate must then pass on seeds not used before the amendment (rule 3): ``seeds`` says how
        many, and the ledger draws them (:func:`draw_seeds`), none of the hypothesis's, an earlier
        amendment's or a trained checkpoint's of this round; training then uses them (:meth:`candidate_seeds`)
        and the decision refuses a candidate trained on another (:meth:`require_fresh_seed`). An amendment
        identical to the gate in force is refused (each one grants a fresh seed and one more test read: a
        recorded redraw with nothing amended). The file and a ``gate_amended`` event carrying its sha256 are
        written; an amendment file without its event is refused on every read (:meth:`amendments`).

        Raises:
            LedgerError: no reason, seed values instead of a count, or a gate identical to the one in force.
            GateTooLooseError: the amended gate is looser than the default in any field (rule 2).
        """
        if not isinstance(reason, str) or not reason.strip():
            raise LedgerError("reason: a gate amendment needs a reason")
        errors = gate_errors(new_gate) + seed_count_errors(seeds)
        if errors:
            raise (GateTooLooseError if errors[0].startswith("gate") else LedgerError)(
                f"round {round_key}: gate amendment refused: " + "; ".join(errors))
        original = self.require_hypothesis(round_key)
        existing = self.amendments(round_key)  # refuses a tampered folder before anything is added
        in_force = self.effective_gate(round_key)
        if asdict(in_force) == asdict(new_gate):
            where = f"amendment {len(existing)}" if existing else "the registered hypothesis"
            raise LedgerError(f"round {round_key}: gate amendment refused: gate: identical to the gate in force "
                              f"({where}); an amendment changes the gate (a copy would only draw a fresh seed and "
                              f"one more test read)")
        used = sorted(self.used_seeds(round_key))
        fresh = list(draw_seeds(seeds, used))
        n = len(existing) + 1
        name = f"{round_key}-{n}.json"
        body = {"round": round_key, "original_gate": asdict(original.gate), "amended_gate": asdict(new_gate),
                "reason": reason, "hypothesis_hash": original.hash, "requires_fresh_seeds": True,
                "seeds": fresh, "used_seeds": used}
        payload = canonical_json(body)
        atomic_write_bytes(self.root / "amendments" / name, payload)
        self.append(EVENT_GATE_AMENDED, {**body, "amendment": n, "file": name, "sha256": sha256_bytes(payload)})
        return body

    def used_seeds(self, round_key: str) -> set[int]:
        """Every seed of this round so far: the hypothesis's, its amendments', its trained checkpoints'."""
        used = set(self.require_hypothesis(round_key).seeds)
        for amendment in self.amendments(round_key):
            used.update(amendment.get("seeds") or ())
        for event in self.events(EVENT_CHECKPOINT_TRAINED):
            if event.get("round") == round_key and isinstance(event.get("seed"), int):
                used.add(event["seed"])
        return used

    def candidate_seeds(self, round_key: str) -> tuple[int, ...]:
        """The seeds the round's candidate trains on: the latest amendment's fresh seeds, else the hypothesis's."""
        for amendment in reversed(self.amendments(round_key)):
            if amendment.get("seeds"):
                return tuple(amendment["seeds"])
        return self.require_hypothesis(round_key).seeds

    def require_fresh_seed(self, round_key: str, seed: Any) -> None:
        """Refuse a candidate trained on a seed used before the round's latest amendment (rule 3).

        Raises:
            LedgerError: naming the seed, the amendment and the seeds it requires.
        """
        amendments = self.amendments(round_key)
        if not amendments:
            return
        latest = amendments[-1]
        allowed = latest.get("seeds")
        stale = (seed not in allowed) if allowed else (seed in self.require_hypothesis(round_key).seeds)
        if stale:
            wanted = allowed if allowed else "other than the hypothesis's"
            raise LedgerError(f"round {round_key}: seed: the candidate was trained on seed {seed!r}, not on the fresh "
                              f"seeds ({wanted}) its gate amendment {len(amendments)} requires (reason: "
                              f"{latest.get('reason')!r}); train the candidate again (it uses Ledger.candidate_seeds)")

    def amendments(self, round_key: str) -> list[dict[str, Any]]:
        """The round's gate amendments in numeric order (``-10`` after ``-9``), each checked against its event.

        Raises:
            LedgerError: a file in ``amendments/`` with no ``gate_amended`` event of the same content (one
                dropped in or edited by hand), or an event whose file is gone; amendments are made only
                through :meth:`amend_gate`.
        """
        folder = self.root / "amendments"
        numbered = []
        for path in folder.glob(f"{round_key}-*.json"):
            suffix = path.stem[len(round_key) + 1:]
            if not suffix.isdigit():
                raise LedgerError(f"{path}: not an amendment of round {round_key} written by Ledger.amend_gate "
                                  f"(expected {round_key}-<n>.json); remove it")
            numbered.append((int(suffix), path))
        numbered.sort()
        events = [e for e in self.events(EVENT_GATE_AMENDED) if e.get("round") == round_key]
        out = []
        for n, path in numbered:
            payload = path.read_bytes()
            body = json.loads(payload)
            if not any(_amendment_matches(e, path.name, payload, body) for e in events):
                raise LedgerError(f"{path}: no {EVENT_GATE_AMENDED} event in {self.events_path} records this "
                                  f"amendment's content; it was not made through Ledger.amend_gate (with a reason "
                                  f"and an event) and is refused")
            out.append(body)
        if len(events) > len(out):
            raise LedgerError(f"round {round_key}: {len(events)} {EVENT_GATE_AMENDED} events but {len(out)} "
                              f"amendment files in {folder}; an amendment file was removed")
        return out

    def effective_gate(self, round_key: str) -> Gate:
        """The latest amendment's gate, else the registered one (as written; the decision applies rule 2's floor)."""
        amendments = self.amendments(round_key)
        if amendments:
            return Gate(**amendments[-1]["amended_gate"])
        return self.require_hypothesis(round_key).gate

    def round_decision(self, round_key: str) -> dict[str, Any] | None:
        """The decision record the round's ``round_decided`` event carries (its ``decision``), or ``None``.

        A decided round's decision lives here, so a retry of its decision step returns it without deciding
        (or publishing) again. ``None`` when the round is undecided, or was decided before the event carried
        its record (the reader then falls back to the record stored beside the round's steps).
        """
        event = next((e for e in self.events(EVENT_ROUND_DECIDED) if e.get("round") == round_key), None)
        return None if event is None else event.get("decision")

    # -- releases ----------------------------------------------------------------------------
    def release_dir(self, release: int) -> Path:
        return self.root / "releases" / f"{release:04d}"

    def releases(self) -> list[dict[str, Any]]:
        """Every release card, oldest first, with its errata; each bound to the ledger (issue 34).

        A card is a release only with its ``release_promoted`` event, whose ``card_sha256`` (events written
        before the digest was recorded: its release number) it must match; a card whose event is not written
        yet is read only as the last card of a release that read its holdout (a crash between the card and
        its event, which the release step's retry writes).

        Raises:
            LedgerChainError: the chain is broken, or a card was dropped in or edited (the file named).
        """
        promoted = {e.get("release"): e for e in self.events(EVENT_RELEASE_PROMOTED)}
        read = {e.get("release") for e in self.events(EVENT_HOLDOUT_READ)}
        cards = sorted((self.root / "releases").glob("*/card.json"))
        out = []
        for i, card in enumerate(cards):
            payload = card.read_bytes()
            body = json.loads(payload)
            event = promoted.get(body.get("release"))
            if event is None and not (i == len(cards) - 1 and body.get("release") in read):
                raise LedgerChainError(f"release card {card}: no {EVENT_RELEASE_PROMOTED} event in {self.events_path} "
                                       f"and no holdout read of its release: it was not published by the release "
                                       f"step (a card dropped in by hand) and is refused")
            if event is not None and event.get("card_sha256") not in (None, sha256_bytes(payload)):
                raise LedgerChainError(f"release card {card}: its sha256 {sha256_bytes(payload)[:16]} is not the one "
                                       f"its {EVENT_RELEASE_PROMOTED} event recorded ({event['card_sha256'][:16]}): "
                                       f"the card was edited")
            body["errata"] = [json.loads(p.read_text()) for p in sorted((card.parent / "errata").glob("*.json"))]
            out.append(body)
        return out

    def release_of_round(self, round_key: str) -> dict[str, Any] | None:
        """The card of the release ``round_key`` published (without its errata), or ``None``.

        A round publishes at most one release; a retry of its decision after a crash between the card and
        ``round_decided`` finds it here instead of publishing the checkpoint again as the next release.
        """
        for card in self.releases():
            if card.get("round") == round_key:
                card.pop("errata", None)
                return card
        return None

    def next_release_number(self) -> int:
        return len(self.releases()) + 1  # only cards bound to the ledger count

    def holdout_slot(self, release: int) -> dict[str, Any] | None:
        """The release's open holdout slot (the latest one the release step opened,
        ``core/release/publish.py``'s ``_open_holdout_slot``), or None."""
        slots = [e for e in self.events(EVENT_HOLDOUT_SLOT) if e.get("release") == release]
        return slots[-1] if slots else None

    def require_publishable(self, release: Any) -> None:
        """Refuse a release that is published or is not the one being published now (the holdout's only slot).

        Raises:
            HoldoutAlreadyReadError: the release is published (it read its holdout).
            HoldoutSlotError: not an integer, or not :meth:`next_release_number`.
        """
        if isinstance(release, bool) or not isinstance(release, int):
            raise HoldoutSlotError(f"release: must be an integer release number, got {release!r}")
        d = self.release_dir(release)
        if (d / "card.json").exists():
            if (d / "holdout.json").exists():
                raise HoldoutAlreadyReadError(
                    f"release {release} already read the holdout ({d / 'holdout.json'}); each release reads it once")
            raise HoldoutAlreadyReadError(
                f"release {release} is published ({d / 'card.json'}); a release reads the holdout only when it is "
                f"published, once")
        expected = self.next_release_number()
        if release != expected:
            raise HoldoutSlotError(
                f"release {release}: the holdout is read only for the release being published now, release "
                f"{expected} of task {self.task!r} (the release step reads it when it publishes)")

    def read_holdout_once(self, release: int, read: Any, *, key: str | None = None) -> Any:
        """Call ``read()`` for the release's one holdout read and record it.

        The slot opens only for the release being published now (:meth:`next_release_number`), so no
        read is taken for a release that is published (it read its holdout) or further ahead (which
        would block the real publish). ``key`` names what is read (the verifier passes the sha256 of
        the predictions it scores): when a read for this release is already stored under the same key
        and its card is not written yet (the process died between the read and the card), the stored
        result is returned and nothing is read again; a read under another key is refused. Two
        processes never read at once (an exclusive lock, released by the OS if its holder dies).

        Raises:
            HoldoutAlreadyReadError: the release already consumed its holdout (its card is written, or
                its read is stored under another key, or another process holds the slot now).
            HoldoutSlotError: ``release`` is not the release being published now.
        """
        import fcntl

        self.require_publishable(release)
        d = self.release_dir(release)
        marker = d / "holdout.json"
        self.require_read_marker(release, marker)
        d.mkdir(parents=True, exist_ok=True)
        fd = os.open(d / "holdout.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise HoldoutAlreadyReadError(
                    f"release {release}: another process is reading the holdout now; each release reads it once"
                ) from None
            if marker.exists():
                stored = json.loads(marker.read_text(encoding="utf-8"))
                if key is None or stored.get("key") != key:
                    raise HoldoutAlreadyReadError(
                        f"release {release} already read the holdout ({marker}) for other predictions; each "
                        f"release reads it once")
                result = stored["result"]  # the same read, stored before a crash: finish from it
            else:
                result = read()  # raises: nothing stored, the holdout is not consumed
                atomic_write_bytes(marker, canonical_json({"release": release, "at": time.time(), "key": key,
                                                           "result": result}))
                marker.chmod(0o444)
        finally:
            os.close(fd)  # releases the lock
        self._append(EVENT_HOLDOUT_READ, {"release": release, "read_key": key}, key=f"holdout:{release}")
        return result

    def require_read_marker(self, release: int, marker: Path) -> None:
        """Refuse a read of a release whose ``holdout_read`` event exists but whose stored read is gone.

        The ledger's events are the record of the read, not the file beside them: deleting
        ``holdout.json`` does not give a release its holdout read back.

        Raises:
            HoldoutAlreadyReadError: naming the event and the missing file.
        """
        event = next((e for e in self.events(EVENT_HOLDOUT_READ) if e.get("release") == release), None)
        if event is not None and not marker.exists():
            raise HoldoutAlreadyReadError(
                f"release {release} already read the holdout (the {EVENT_HOLDOUT_READ} event {event.get('event_id')} "
                f"in {self.events_path}), and its stored read {marker} is gone; the ledger's event is the record: "
                f"each release reads the holdout once")

    def holdout_result(self, release: int) -> Any:
        """The stored result of the release's one holdout read, or None."""
        marker = self.release_dir(release) / "holdout.json"
        return json.loads(marker.read_text())["result"] if marker.exists() else None

    # -- test reads --------------------------------------------------------------------------
    def test_files_read(self, reader: str) -> dict[str, str | None]:
        """The distinct predictions files ``reader`` has scored on ``test``: sha256 → the path it was read from.

        Both files of a paired read count (the predictions and their baseline). Reads recorded before
        readers were named are ``adhoc``'s.
        """
        seen: dict[str, str | None] = {}
        for event in self.events(EVENT_TEST_READ):
            if event.get("reader", ADHOC_READER) != reader:
                continue
            for sha, path in ((event.get("predictions_sha256"), event.get("predictions")),
                              (event.get("baseline_sha256"), event.get("baseline"))):
                if sha and sha not in seen:
                    seen[sha] = path
        return seen

    @contextmanager
    def reading_test(self, reader: str, predictions_sha256: str, baseline_sha256: str | None = None, *,
                     budget: int | None = None, predictions: str | None = None,
                     baseline: str | None = None) -> Iterator[Callable[..., dict[str, Any]]]:
        """Hold ``reader``'s budget of ``test`` reads around one read (rule 4): refuse it first, or record it after.

        A read is within the budget when the distinct predictions files ``reader`` has scored on test
        (:meth:`test_files_read`), with this read's predictions and baseline added, number at most
        ``budget`` (``None``: not limited, an ``adhoc`` read; :func:`reader_budget`), plus, for a round, one
        per ``gate_amended`` event of the round (the candidate it trains again on fresh seeds). Beyond it
        :class:`TestReadBudgetError` is raised before the body runs (before any label is read) and
        nothing is appended. Within it the body reads and calls the yielded ``record(status, **fields)``,
        which appends the ``test_read`` event keyed by reader, predictions sha256 and baseline sha256: a
        retry of the same read is not a new event and never counts twice (a failed read's event also
        carries its status, so the retry that succeeds is recorded beside it). Two processes of one
        limited reader never check and read at once (an exclusive lock, released by the OS if its holder
        dies).

        Raises:
            TestReadBudgetError: the read would exceed ``reader``'s budget; names the reader, the budget and
                what it has read.
        """
        import fcntl

        fd = None
        if budget is not None:
            fd = os.open(self.root / "test_reads.lock", os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            kind, _, name = reader.partition(":")
            if kind == "round":
                self._require_round_reader(reader, name)
            amended = 0 if kind != "round" else sum(1 for e in self.events(EVENT_GATE_AMENDED) if e.get("round") == name)
            if budget is not None:
                budget += amended
            read = self.test_files_read(reader)
            wanted = {predictions_sha256: predictions, **({baseline_sha256: baseline} if baseline_sha256 else {})}
            new = {sha: path for sha, path in wanted.items() if sha not in read}
            if budget is not None and len(read) + len(new) > budget:
                why = _READER_READS.get(kind, "its own") + (
                    f", and a fresh-seed candidate for each of its {amended} gate amendments" if amended else "")
                listed = "; ".join(f"{path or '?'} ({sha[:12]})" for sha, path in read.items()) or "nothing"
                adding = "; ".join(f"{path or '?'} ({sha[:12]})" for sha, path in new.items())
                raise TestReadBudgetError(
                    f"reader {reader!r}: test read refused before any label is read: its budget is {budget} distinct "
                    f"predictions files on test ({why}) and it has read {len(read)}: "
                    f"{listed}; this read would add {len(new)}: {adding}")

            def record(status: str, **fields: Any) -> dict[str, Any]:
                key = f"test_read:{reader}:{predictions_sha256}:{baseline_sha256 or '-'}"
                return self.append(EVENT_TEST_READ, {
                    "split": "test", "reader": reader, "status": status, "predictions_sha256": predictions_sha256,
                    "baseline_sha256": baseline_sha256, "predictions": predictions, "baseline": baseline, **fields},
                    key=key if status == "ok" else f"{key}:{status}")

            yield record
        finally:
            if fd is not None:
                os.close(fd)  # releases the lock

    def _require_round_reader(self, reader: str, round_key: str) -> None:
        """Refuse a ``round:<key>`` read that is not the round's own re-evaluation (issue 34).

        A round's budget is spent only by its own run: after its hypothesis is registered and its candidate
        trained (a ``lora_checkpoint_trained`` event of the round), before it is decided. A caller naming a
        future round (or a decided one) as its reader is refused before any label is read, so a person's read
        never spends a round's budget (theirs is ``adhoc``: logged, not limited).

        Raises:
            TestReadBudgetError: naming the reader and the event the round lacks (or its decision).
        """
        if self._registered_event(round_key) is None:
            lacking = f"no {EVENT_HYPOTHESIS_REGISTERED} event"
        elif not any(e.get("round") == round_key for e in self.events(EVENT_CHECKPOINT_TRAINED)):
            lacking = f"no {EVENT_CHECKPOINT_TRAINED} event (its candidate is not trained)"
        elif any(e.get("round") == round_key for e in self.events(EVENT_ROUND_DECIDED)):
            lacking = f"a {EVENT_ROUND_DECIDED} event (it is decided)"
        else:
            return
        raise TestReadBudgetError(
            f"reader {reader!r}: test read refused before any label is read: a round's reads come from its own "
            f"re-evaluation (independent_reeval), after its candidate is trained and before its decision, and round "
            f"{round_key} has {lacking} in {self.events_path}; a person's read is {ADHOC_READER!r} (logged, not "
            f"limited, and what it reads can no longer become a round's candidate)")

    def round_candidate_read(self, round_key: str) -> dict[str, Any] | None:
        """The round's own paired read of its candidate on test (its latest ``test_read`` event with a baseline)."""
        own = f"round:{round_key}"
        mine = [e for e in self.events(EVENT_TEST_READ) if e.get("reader") == own and e.get("baseline_sha256")
                and e.get("status", "ok") == "ok"]
        return mine[-1] if mine else None

    def candidate_answers_as_champion(self, round_key: str) -> bool:
        """Whether the round's candidate predicted every test question exactly as its champion (same sha256).

        Such a candidate changed nothing the test sees (a training step at a zero learning rate, a lever that
        moved no weight): it cannot be promoted, and rejecting it selects nothing, so the predictions the
        setup or another round read before (the champion's) do not make it ineligible.
        """
        return _answers_as_baseline(self.round_candidate_read(round_key))

    def require_unread_candidate(self, round_key: str) -> None:
        """Refuse a round's candidate whose test predictions anyone else read on test (issue 34: no redraw on test).

        The candidate's predictions are the ones the round's own paired read scored (``round:<key>``, with its
        champion as the baseline; the latest, after an amendment). A ``test_read`` event of another reader
        (a person's ``adhoc`` read, another round, the setup) of the same sha256 means someone saw this
        candidate's test score outside the round: it may have been picked for it (best-of-k on test), so it
        cannot be the round's candidate. Person reads stay possible; they make what they read ineligible.

        Raises:
            LedgerError: naming the earlier read (its event id, reader, file and time).
        """
        own = f"round:{round_key}"
        read = self.round_candidate_read(round_key)
        if read is None or _answers_as_baseline(read):
            return  # the champion's own predictions: the gate can only reject them (decide_round says so)
        candidate = read["predictions_sha256"]
        for event in self.events(EVENT_TEST_READ):
            if event.get("reader", ADHOC_READER) == own:
                continue
            if candidate in (event.get("predictions_sha256"), event.get("baseline_sha256")):
                at = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(float(event.get("at") or 0)))
                raise LedgerError(
                    f"round {round_key}: no decision: the candidate's test predictions (sha256 {candidate[:12]}) were "
                    f"read on test before, by {event.get('reader', ADHOC_READER)!r} (test_read event "
                    f"{event.get('event_id')}, {event.get('predictions') or event.get('baseline')}, {at} UTC); "
                    f"predictions seen on test outside their round cannot become its candidate")

    def write_release_card(self, release: int, card: Mapping[str, Any], markdown: str) -> Path:
        """Write a release card once; an identical retry is a no-op, any change is refused."""
        d = self.release_dir(release)
        payload = (json.dumps(card, sort_keys=True, indent=2, ensure_ascii=False, default=str) + "\n").encode()
        try:
            _write_once(d / "card.json", payload)
            _write_once(d / "card.md", markdown.encode("utf-8"))
        except FileExistsError as exc:
            raise ReleaseCardExistsError(f"release card {exc} exists and is never rewritten; append an erratum") from None
        for path in (d / "card.json", d / "card.md"):
            path.chmod(0o444)
        self.record_release_promoted(release, card)
        return d

    def record_release_promoted(self, release: int, card: Mapping[str, Any]) -> dict[str, Any]:
        """The ``release_promoted`` event of a written card, once, with the card file's sha256 (a retry after a
        crash between the card and its event writes it; a second call returns the first)."""
        path = self.release_dir(release) / "card.json"
        digest = sha256_bytes(path.read_bytes()) if path.exists() else None
        return self.append(EVENT_RELEASE_PROMOTED, {"release": release, "round": card.get("round"),
                                                    "checkpoint_sha256": card.get("checkpoint_sha256"),
                                                    "card_sha256": digest},
                           key=f"release:{release}")

    def append_erratum(self, release: int, field_name: str, old: Any, new: Any, reason: str) -> dict[str, Any]:
        """Correct a card by appending; the old value stays visible beside the new one."""
        d = self.release_dir(release)
        if not (d / "card.json").exists():
            raise LedgerError(f"release {release} has no card")
        n = len(list((d / "errata").glob("*.json"))) + 1
        body = {"release": release, "erratum": n, "field": field_name, "old": old, "new": new, "reason": reason,
                "at": time.time()}
        atomic_write_bytes(d / "errata" / f"{n:03d}.json", canonical_json(body))
        self.append(EVENT_ERRATUM, body)
        return body
