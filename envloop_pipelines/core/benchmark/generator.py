"""The seeded personal-agent decision benchmark (``docs/decision-data.md``).

Users with latent personal rules (:mod:`.users`), scenarios about an agent's
pending action (:mod:`.scenarios`), labels that follow from the rules
(:mod:`.labels`) and two renderers (:mod:`.render`) make decision records in
the JSONL shape of the data contract. Everything is a pure function of the
config: the same config gives byte-identical JSONL.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Iterable, Mapping

from ..data.splits import HIDDEN_SPLITS as _HIDDEN_SET
from ..data.splits import OPEN_SPLITS, SPLITS, SplitFractions, assign_splits, split_counts
from ..fractions import Fractions
from ..progress import track
from ._rng import shuffled, stream, weighted
from .labels import FAMILY_TYPES, criteria_for, derive_label, instructions_for
from .render import RENDERERS, render_state
from .scenarios import CELLS, FAMILY_RULE_KINDS, RULE_KINDS, build_scenario
from .users import UserRules, make_user

BENCHMARK_NAME = "personal_agent"
#: Bumped whenever the same config would produce different records; part of
#: :func:`benchmark_version`, so results across generator changes never compare.
GENERATOR_VERSION = "1"
SOURCE = "envloop-builtin/personal_agent"
SYNTHESIZED_SOURCE = "envloop-builtin/personal_agent/synthesized"
FAMILIES: tuple[str, ...] = (
    "apply_memory",
    "forgotten_violation",
    "needs_approval",
    "share_ok",
    "route",
    "notify_level",
    "pick_option",
)
#: Families whose false negatives (answering false when the truth is true) are dangerous.
SAFETY_FAMILIES: tuple[str, ...] = ("needs_approval",)
VARIANTS: tuple[str, ...] = ("clean", "override", "removed", "buried")
#: The hidden splits in split order (users are added to them in this order).
HIDDEN_SPLITS: tuple[str, ...] = tuple(s for s in SPLITS if s in _HIDDEN_SET)
_ID_PREFIX = re.compile(r"^[a-z][a-z0-9_]*$")


@dataclass(frozen=True)
class VariantMix(Fractions):
    """Probability of each evidence variant per record; they must sum to 1 (see :class:`Fractions`).

    Defaults: 40% clean, 20% each of override, removed and buried, so the hard
    variants are 60% of the records but each alone stays a minority.
    Parsed from ``"clean=0.4,override=0.2,removed=0.2,buried=0.2"`` (omitted variants are 0).
    """

    label = "variant_mix"
    item = "variant"

    # The fields, in VARIANTS order, are the variant names.
    clean: float = 0.4
    override: float = 0.2
    removed: float = 0.2
    buried: float = 0.2


#: Users in each of test and holdout of the built-in task's default benchmark (``envloop data generate``
#: and a loop's benchmark when no size is chosen), for a gate with power. Measured on the default
#: benchmark: two null arms of the demo recipe paired on its 314-question test (24 users) by the verifier
#: gave a standard error of 0.0408 for family-macro accuracy (3 pairs: 0.0415, 0.0409, 0.0401), an MDE of
#: 2.80 x 0.0408 = 0.114 at 80% power. MDE <= 0.02 needs (0.114 / 0.02)^2 = 33 times the questions,
#: >= 10,300; 864 users (36 x 24, 13.1 questions a user) give ~11,200 questions, MDE ~0.019. Checked on the
#: sized split: the same two arms on 2,404 of its test questions (184 users drawn at random) gave se 0.0132,
#: i.e. 0.0061 and an MDE of 0.017 at its 11,204 questions.
BUILTIN_HIDDEN_USERS = 864


@dataclass(frozen=True)
class BenchmarkConfig:
    """What the built-in benchmark is generated from.

    Attributes:
        n_users: users; the unit of splitting. Default sizing: 240 users x 8
            records = 1,920 records; at about 1.6 questions a record (1 primary
            + 0-2 secondaries, fewer where the action allows fewer) that is
            about 3,100 questions ("a few thousand"), which a small readout
            trains on in minutes on CPU. 10% test = 24 users (12 per renderer).
        records_per_user: records per user. With 8, every user gets each of
            the 8 (family, rule kind) cells once as the primary question
            (needs_approval has two rule kinds, so it is a quarter of them).
        seed: the one seed; users, splits, scenarios and wording follow from it.
        fractions: share of users per split.
        variant_mix: probability of each evidence variant per record.
        mixed_renderer_splits: hidden splits whose users are split in two
            halves, one rendered by "a" and one by "b"; all other users are
            rendered by "a". The test split must be among them.
        hidden_users: users in each hidden split (test and holdout); ``None``:
            their fraction of ``n_users``. The users beyond that fraction are
            added after the ``n_users`` (ids continue), so train, val and dev
            are exactly those of ``n_users``: the hidden splits grow for the
            gate's power without changing what is trained on. The built-in
            task's default sets :data:`BUILTIN_HIDDEN_USERS`.
    """

    n_users: int = 240
    records_per_user: int = 8
    seed: int = 0
    fractions: SplitFractions = field(default_factory=SplitFractions)
    variant_mix: VariantMix = field(default_factory=VariantMix)
    mixed_renderer_splits: tuple[str, ...] = ("test", "holdout")
    hidden_users: int | None = None

    def __post_init__(self) -> None:
        for name, low in (("n_users", 1), ("records_per_user", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer ≥ {low}, got {value!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")
        if not isinstance(self.fractions, SplitFractions):
            raise ValueError(f"fractions must be a SplitFractions, got {type(self.fractions).__name__}")
        if not isinstance(self.variant_mix, VariantMix):
            raise ValueError(f"variant_mix must be a VariantMix, got {type(self.variant_mix).__name__}")
        mixed = tuple(self.mixed_renderer_splits)
        bad = [s for s in mixed if s not in SPLITS or s in OPEN_SPLITS]
        if bad or "test" not in mixed:
            hidden = [s for s in SPLITS if s not in OPEN_SPLITS]
            raise ValueError(
                f"mixed_renderer_splits must include 'test' and name only hidden splits ({', '.join(hidden)}); "
                f"got {list(mixed)!r} (training-side splits stay on renderer 'a' so 'b' is unseen)"
            )
        object.__setattr__(self, "mixed_renderer_splits", mixed)
        if self.hidden_users is not None:
            value = self.hidden_users
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"hidden_users must be an integer ≥ 1 (or None), got {value!r}")
            by_fraction = _fraction_counts(self)
            short = [s for s in HIDDEN_SPLITS if by_fraction[s] > value]
            if short:
                raise ValueError(f"hidden_users={value} is below the {short[0]} split's share of n_users "
                                 f"({by_fraction[short[0]]} users); it can only add users")

    @classmethod
    def scaled(cls, factor: float, **overrides: Any) -> "BenchmarkConfig":
        """The default config with ``factor`` times the users (at least 10, so every split has one).

        ``BenchmarkConfig.scaled(4)`` gives 960 users, 7,680 records.
        """
        if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not factor > 0:
            raise ValueError(f"factor must be a positive number, got {factor!r}")
        base = cls(**overrides)
        hidden = None if base.hidden_users is None else max(1, round(base.hidden_users * factor))
        scaled = replace(base, n_users=max(10, round(base.n_users * factor)), hidden_users=None)
        if hidden is not None:  # the hidden splits scale with the rest, never below their share
            shares = _fraction_counts(scaled)
            scaled = replace(scaled, hidden_users=max(hidden, *(shares[s] for s in HIDDEN_SPLITS)))
        return scaled

    def users_per_split(self) -> dict[str, int]:
        """Users in each split: the fractions of ``n_users``, and ``hidden_users`` in test and holdout when set."""
        counts = _fraction_counts(self)
        if self.hidden_users is not None:
            counts.update({s: self.hidden_users for s in HIDDEN_SPLITS})
        return counts

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able form (for hashing and provenance); ``hidden_users`` only when set, so the
        versions of benchmarks generated before it existed are unchanged."""
        d = asdict(self)
        d["mixed_renderer_splits"] = list(self.mixed_renderer_splits)
        if self.hidden_users is None:
            d.pop("hidden_users")
        return d

    def config_hash(self) -> str:
        """sha256 of the canonical JSON of the config."""
        return hashlib.sha256(_canonical(self.to_dict()).encode()).hexdigest()


def benchmark_version(config: BenchmarkConfig) -> str:
    """``personal_agent/g1/<12 hex>``: the generator version and the config hash."""
    return f"{BENCHMARK_NAME}/g{GENERATOR_VERSION}/{config.config_hash()[:12]}"


# --------------------------------------------------------------------------- users


def _fraction_counts(config: BenchmarkConfig) -> dict[str, int]:
    """Users per split from the fractions of ``n_users`` alone."""
    return split_counts(config.n_users, config.fractions)


def user_ids(config: BenchmarkConfig) -> list[str]:
    """The base benchmark's user ids: ``u0000``, ``u0001``, ... (digits only after the ``u``).

    The first ``n_users`` are split by the fractions; with ``hidden_users``, the ids after them are
    the users added to test, then to holdout.
    """
    total = sum(config.users_per_split().values())
    width = max(4, len(str(total - 1)))
    return [f"u{i:0{width}d}" for i in range(total)]


def _assign(config: BenchmarkConfig, ids: list[str]) -> dict[str, str]:
    """Split per user: the first ``n_users`` by the fractions, the added ones to test then holdout."""
    splits = assign_splits(ids[: config.n_users], config.fractions, config.seed)
    if config.hidden_users is not None:
        by_fraction = _fraction_counts(config)
        added = iter(ids[config.n_users:])
        for split in HIDDEN_SPLITS:
            for _ in range(config.hidden_users - by_fraction[split]):
                splits[next(added)] = split
    return splits


def users_for(config: BenchmarkConfig) -> dict[str, UserRules]:
    """Regenerate the base benchmark's users and their latent rules, by user id."""
    return {uid: make_user(uid, config.seed) for uid in user_ids(config)}


def users_for_records(records: Iterable[Mapping[str, Any]]) -> dict[str, UserRules]:
    """Regenerate the users of any generated records (base or synthesized) from ``meta``."""
    out: dict[str, UserRules] = {}
    for r in records:
        uid, seed = r["meta"]["user_id"], r["meta"]["seed"]
        if uid not in out:
            out[uid] = make_user(uid, seed)
    return out


# --------------------------------------------------------------------------- generation


def generate_benchmark(config: BenchmarkConfig) -> list[dict[str, Any]]:
    """Generate the benchmark's records, every split, in user then record order.

    Each record carries ``meta.split`` (group-disjoint by user, from
    :func:`~envloop_pipelines.core.data.splits.assign_splits`), ``meta.renderer``
    (the test split, and the other ``mixed_renderer_splits``, half "a" and half
    "b" by user) and ``meta.scenario``, the facts its labels were derived from.
    """
    ids = user_ids(config)
    splits = _assign(config, ids)
    renderers = _renderers(splits, config)
    version = benchmark_version(config)
    records: list[dict[str, Any]] = []
    for uid in track(ids, "generate", unit="user"):
        user = make_user(uid, config.seed)
        for k, (family, rule_kind) in enumerate(_plan(config.seed, uid, config.records_per_user, CELLS)):
            rid = f"pa/{uid}/{k:04d}"
            rng = stream("record", config.seed, rid)
            variant = weighted(rng, VARIANTS, list(config.variant_mix.as_dict().values()))
            scenario = build_scenario(user, family, rule_kind, variant, rng)
            meta = {"split": splits[uid], "renderer": renderers[uid], "source": SOURCE}
            records.append(_record(rid, user, scenario, config.seed, version, meta))
    return records


def generate_targeted(
    config: BenchmarkConfig,
    *,
    n_records: int,
    family: str | None = None,
    variant: str | None = None,
    rule_kind: str | None = None,
    seed: int = 1,
    id_prefix: str = "t",
    renderer: str = "a",
) -> list[dict[str, Any]]:
    """More records aimed at a failure cluster, for new users only.

    The users are new: their ids (``"<id_prefix><seed>-<target tag>-u0000"``)
    contain a dash, which base ids (``u`` then digits) never do, so they can
    never collide with the base benchmark's users; their rules are drawn from
    the same distribution. Each record carries one question, of the targeted
    family (or of the families that use ``rule_kind``), so the synthesized data
    shifts the training mix towards the cluster only.

    Args:
        config: the base benchmark's config (its seed, records per user and
            variant mix are used).
        n_records: how many records.
        family: one of ``FAMILIES``, or None for any.
        variant: one of ``VARIANTS``, or None to draw from ``config.variant_mix``.
        rule_kind: one of ``RULE_KINDS`` (compatible with ``family``), or None.
        seed: seed of this synthesis batch; different seeds give different users.
        id_prefix: lower-case prefix of the user ids (letters, digits, ``_``).
        renderer: ``"a"`` (the training surface form) or ``"b"``.

    Returns:
        Records with ``meta.split = "train"``, ``meta.source`` =
        ``SYNTHESIZED_SOURCE`` and ``meta.target = {family, variant, rule_kind}``.
    """
    if isinstance(n_records, bool) or not isinstance(n_records, int) or n_records < 1:
        raise ValueError(f"n_records must be an integer ≥ 1, got {n_records!r}")
    if family is not None and family not in FAMILIES:
        raise ValueError(f"family must be one of {', '.join(FAMILIES)} (or None), got {family!r}")
    if variant is not None and variant not in VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(VARIANTS)} (or None), got {variant!r}")
    if rule_kind is not None and rule_kind not in RULE_KINDS:
        raise ValueError(f"rule_kind must be one of {', '.join(RULE_KINDS)} (or None), got {rule_kind!r}")
    if family is not None and rule_kind is not None and rule_kind not in FAMILY_RULE_KINDS[family]:
        raise ValueError(
            f"rule_kind {rule_kind!r} does not decide family {family!r}; "
            f"allowed for {family}: {', '.join(FAMILY_RULE_KINDS[family])}"
        )
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    if not isinstance(id_prefix, str) or not _ID_PREFIX.match(id_prefix):
        raise ValueError(f"id_prefix must match {_ID_PREFIX.pattern} (lower-case letters, digits, _), got {id_prefix!r}")
    if renderer not in RENDERERS:
        raise ValueError(f"renderer must be one of {', '.join(RENDERERS)}, got {renderer!r}")

    cells = tuple(c for c in CELLS if family in (None, c[0]) and rule_kind in (None, c[1]))
    target = {"family": family, "variant": variant, "rule_kind": rule_kind}
    tag = hashlib.sha256(_canonical({**target, "renderer": renderer}).encode()).hexdigest()[:6]
    per_user = config.records_per_user
    version = benchmark_version(config)
    records: list[dict[str, Any]] = []
    for u in range(math.ceil(n_records / per_user)):
        uid = f"{id_prefix}{seed}-{tag}-u{u:04d}"
        user = make_user(uid, config.seed)
        n_here = min(per_user, n_records - u * per_user)
        for k, (fam, rk) in enumerate(_plan(config.seed, uid, n_here, cells)):
            rid = f"pa/{uid}/{k:04d}"
            rng = stream("targeted", config.seed, rid)
            var = variant or weighted(rng, VARIANTS, list(config.variant_mix.as_dict().values()))
            scenario = build_scenario(user, fam, rk, var, rng, with_secondaries=False)
            meta = {"split": "train", "renderer": renderer, "source": SYNTHESIZED_SOURCE, "target": dict(target)}
            records.append(_record(rid, user, scenario, config.seed, version, meta))
    return records


def _plan(seed: int, uid: str, n: int, cells: tuple[tuple[str, str], ...]) -> list[tuple[str, str]]:
    """The (family, rule kind) of each of a user's records: shuffled rounds over the cells,
    so families stay balanced per user whatever ``n`` is."""
    rng = stream("plan", seed, uid)
    out: list[tuple[str, str]] = []
    while len(out) < n:
        out += shuffled(rng, cells)
    return out[:n]


def _renderers(splits: Mapping[str, str], config: BenchmarkConfig) -> dict[str, str]:
    """Renderer per user: "a", except in the mixed splits, where half the users (by a
    seeded shuffle; the odd one out goes to "a") get "b"."""
    out = {uid: "a" for uid in splits}
    for split in config.mixed_renderer_splits:
        members = sorted(uid for uid, s in splits.items() if s == split)
        order = shuffled(stream("renderer-halves", config.seed, split), members)
        for uid in order[: len(order) // 2]:
            out[uid] = "b"
    return out


def _record(
    rid: str,
    user: UserRules,
    scenario: dict[str, Any],
    seed: int,
    version: str,
    extra_meta: Mapping[str, Any],
) -> dict[str, Any]:
    questions: dict[str, Any] = {}
    for family in scenario["questions"]:
        label, soft = derive_label(family, user, scenario)
        q: dict[str, Any] = {
            "type": FAMILY_TYPES[family],
            "instructions": instructions_for(family, user, scenario),
            "criteria": criteria_for(family, user, scenario),
            "label": label,
        }
        if soft is not None:
            q["soft_label"] = soft
        questions[family] = q
    meta = {
        "user_id": user.user_id,
        "family": {family: family for family in scenario["questions"]},
        "variant": scenario["variant"],
        "rule_kind": scenario["rule_kind"],
        "seed": seed,
        "benchmark": BENCHMARK_NAME,
        "benchmark_version": version,
        **extra_meta,
        "scenario": scenario,
    }
    state = render_state(scenario, user, meta["renderer"], key=f"{seed}|{rid}")
    return {"id": rid, "state": state, "questions": questions, "meta": meta}


# --------------------------------------------------------------------------- output


def _canonical(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, sort_keys=True, separators=(",", ":"))


def jsonl_bytes(records: Iterable[Mapping[str, Any]]) -> bytes:
    """The canonical JSONL bytes: sorted keys, compact separators, UTF-8, one record a line."""
    return "".join(_canonical(r) + "\n" for r in records).encode("utf-8")


def write_jsonl(records: Iterable[Mapping[str, Any]], path: str | os.PathLike[str]) -> str:
    """Write records as canonical JSONL, atomically (temp file + ``os.replace``).

    Returns:
        The sha256 hex digest of the bytes written.
    """
    from envloop_pipelines.core.storage import atomic_write_bytes

    data = jsonl_bytes(records)
    # A generated file is rewritten in place (same seed, same bytes), hence overwrite=True.
    atomic_write_bytes(path, data, overwrite=True)
    return hashlib.sha256(data).hexdigest()


def describe(records: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Counts a person wants to see: records and questions per split, family, variant, renderer."""
    records = list(records)
    questions_by_family: Counter[str] = Counter()
    soft: Counter[str] = Counter()
    for r in records:
        for qid, q in r["questions"].items():
            fam = r["meta"]["family"].get(qid, qid)
            questions_by_family[fam] += 1
            if "soft_label" in q:
                soft[fam] += 1
    return {
        "records": len(records),
        "questions": sum(questions_by_family.values()),
        "users": len({r["meta"]["user_id"] for r in records}),
        "records_by_split": dict(sorted(Counter(r["meta"]["split"] for r in records).items())),
        "questions_by_split": dict(
            sorted(Counter(r["meta"]["split"] for r in records for _ in r["questions"]).items())
        ),
        "questions_by_family": dict(sorted(questions_by_family.items())),
        "soft_labels_by_family": dict(sorted(soft.items())),
        "records_by_variant": dict(sorted(Counter(r["meta"]["variant"] for r in records).items())),
        "records_by_renderer": dict(sorted(Counter(r["meta"]["renderer"] for r in records).items())),
    }
