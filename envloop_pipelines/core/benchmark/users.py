"""Users and their latent personal rules.

A user's rules are a pure function of ``(seed, user_id)`` (see
:func:`make_user`), so anyone holding a record can regenerate the rules its
labels were derived from. Every rule value is drawn from the tables in
:mod:`.vocab` with the probabilities written there; the soft labels of the
"removed" variant are exactly those priors.
"""

from __future__ import annotations

import unicodedata
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from . import vocab
from ._rng import chance, pick, sample, shuffled, stream


@dataclass(frozen=True)
class Contact:
    """Someone the user knows."""

    name: str
    relationship: str  # one of vocab.RELATIONSHIPS
    role: str  # the word a state uses ("sister", "landlord", ...)


@dataclass(frozen=True)
class ForgetItem:
    """A personal detail with a value the user asked the agent to forget and the current one."""

    topic: str  # one of vocab.FORGET_TOPICS
    forgotten: str
    current: str


@dataclass(frozen=True)
class Preference:
    """How the user picks among options in one domain."""

    kind: str  # one of vocab.PREFERENCE_KINDS
    brand: str | None = None  # set only when kind == "brand"


@dataclass(frozen=True)
class UserRules:
    """One user's latent rules; the labels of their records follow from these.

    Attributes:
        user_id: the group key (``meta.user_id``).
        first_name: how states address the user.
        last_name: family name.
        spending_limit: dollars the agent may spend without asking (strictly
            more needs approval).
        trusted_recipients: contacts the agent may pay without asking (within
            the limit).
        contacts: people the user knows, with their relationship class.
        privacy: memory category → share policy name (``vocab.PRIVACY_POLICIES``).
        notify: event category → level 0..3 (silent, digest, notify, interrupt).
        quiet_hours: (start, end) hours during which nothing goes above digest
            except security alerts, or None.
        services: connected services, in the order the route options list them.
        route_defaults: task kind → the service used when several connected
            services can handle it.
        forget: every forgettable detail; ``forgotten_topics`` says which the
            user actually asked the agent to forget.
        forgotten_topics: topics whose old value the user asked to forget.
        preferences: pick domain → how the user picks.
        memories: memory topic → what the agent remembers ("is vegetarian").
        trivia: harmless facts used as distractors.
    """

    user_id: str
    first_name: str
    last_name: str
    spending_limit: int
    trusted_recipients: tuple[str, ...]
    contacts: tuple[Contact, ...]
    privacy: dict[str, str]
    notify: dict[str, int]
    quiet_hours: tuple[int, int] | None
    services: tuple[str, ...]
    route_defaults: dict[str, str]
    forget: dict[str, ForgetItem]
    forgotten_topics: tuple[str, ...]
    preferences: dict[str, Preference]
    memories: dict[str, str]
    trivia: dict[str, str]

    def contact(self, name: str) -> Contact:
        """The contact called ``name`` (KeyError if the user has none)."""
        for c in self.contacts:
            if c.name == name:
                return c
        raise KeyError(f"user {self.user_id} has no contact {name!r}")

    @property
    def forgotten_values(self) -> frozenset[str]:
        """Values the user asked the agent to forget."""
        return frozenset(self.forget[t].forgotten for t in self.forgotten_topics)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able form (for inspection and export)."""
        return asdict(self)


def make_user(user_id: str, seed: int) -> UserRules:
    """Regenerate one user's rules; a pure function of ``(user_id, seed)``.

    Args:
        user_id: the user's id (``"u0007"`` for the base benchmark, something
            with a dash for synthesized users).
        seed: the benchmark seed (``BenchmarkConfig.seed``).
    """
    rng = stream("user", seed, user_id)
    first = pick(rng, vocab.FIRST_NAMES)
    last = pick(rng, vocab.LAST_NAMES)

    # 6-7 contacts: a partner for ~60% of users, 1-2 relatives, then the others.
    names = sample(rng, vocab.CONTACT_NAMES, 7)
    classes: list[str] = []
    if chance(rng, 0.6):
        classes.append("partner")
    classes += ["family"] * (1 + int(rng.integers(2)))
    classes += ["friend", "friend", "colleague", "colleague", "acquaintance"]
    classes = classes[:7]
    contacts = tuple(
        Contact(name=n, relationship=rel, role=pick(rng, vocab.ROLES[rel])) for n, rel in zip(names, classes)
    )
    contacts = tuple(shuffled(rng, contacts))
    # Trust is drawn independently of the relationship, so a visible relationship
    # says nothing about trust and a removed trusted list is a fair coin.
    trusted = tuple(sorted(c.name for c in sample(rng, contacts, 2 + int(rng.integers(2)))))

    privacy = {cat: pick(rng, tuple(vocab.PRIVACY_POLICIES)) for cat in vocab.PRIVACY_CATEGORIES}
    notify = {
        cat: int(rng.choice(4, p=[float(p) for p in vocab.NOTIFY_PRIORS[cat]])) for cat in vocab.NOTIFY_CATEGORIES
    }
    quiet = pick(rng, vocab.QUIET_HOURS) if chance(rng, 0.6) else None

    services, defaults = _services(rng)

    forget: dict[str, ForgetItem] = {}
    streets = sample(rng, vocab.STREETS, 2)
    # Old and current values come from the same ranges, so a value alone never
    # tells whether it is the forgotten one (the "removed" prior stays 1/2).
    numbers = sample(rng, range(2, 400), 2)
    forget["address"] = ForgetItem(
        "address", forgotten=f"{numbers[0]} {streets[0]}", current=f"{numbers[1]} {streets[1]}"
    )
    phones = sample(rng, range(10, 100), 2)
    forget["phone"] = ForgetItem("phone", forgotten=f"+1 555 01{phones[0]}", current=f"+1 555 01{phones[1]}")
    doms = sample(rng, vocab.EMAIL_DOMAINS, 2)
    handle = f"{_ascii(first)}.{_ascii(last)}"
    forget["email"] = ForgetItem("email", forgotten=f"{handle}@{doms[0]}", current=f"{handle}@{doms[1]}")
    # The ex is not one of the contacts; the current plus-one is the partner or a friend.
    ex = pick(rng, [n for n in vocab.CONTACT_NAMES if n not in names])
    plus_one = next((c.name for c in contacts if c.relationship == "partner"), None) or next(
        c.name for c in contacts if c.relationship == "friend"
    )
    forget["plus_one"] = ForgetItem("plus_one", forgotten=ex, current=plus_one)
    forgotten_topics = tuple(sorted(sample(rng, vocab.FORGET_TOPICS, 2 + int(rng.integers(2)))))

    preferences: dict[str, Preference] = {}
    for domain in vocab.PICK_DOMAINS:
        kind = pick(rng, vocab.PREFERENCE_KINDS)
        brand = pick(rng, vocab.PICK_BRANDS[domain]) if kind == "brand" else None
        preferences[domain] = Preference(kind, brand)

    memories = {topic: pick(rng, vocab.MEMORY_VALUES[topic]) for topic in vocab.MEMORY_TOPICS}
    trivia = {key: pick(rng, values) for key, values in vocab.TRIVIA.items()}

    return UserRules(
        user_id=user_id,
        first_name=first,
        last_name=last,
        spending_limit=pick(rng, vocab.SPENDING_LIMITS),
        trusted_recipients=trusted,
        contacts=contacts,
        privacy=privacy,
        notify=notify,
        quiet_hours=quiet,
        services=services,
        route_defaults=defaults,
        forget=forget,
        forgotten_topics=forgotten_topics,
        preferences=preferences,
        memories=memories,
        trivia=trivia,
    )


def _services(rng: np.random.Generator) -> tuple[tuple[str, ...], dict[str, str]]:
    """2-5 connected services, with at least one task kind that two of them handle
    (so every user can get a route question whose answer is their default)."""
    multi_kind = pick(rng, vocab.TASK_KINDS)
    able = [s for s, kinds in vocab.SERVICES.items() if multi_kind in kinds]
    chosen = sample(rng, able, 2)
    others = [s for s in vocab.SERVICES if s not in chosen]
    chosen += sample(rng, others, int(rng.integers(0, 4)))
    services = tuple(shuffled(rng, chosen))
    defaults: dict[str, str] = {}
    for kind in vocab.TASK_KINDS:
        candidates = candidates_for(services, kind)
        if len(candidates) >= 2:
            # Uniform among the candidates: the prior of a "removed" route question.
            defaults[kind] = pick(rng, candidates)
    return services, defaults


def _ascii(name: str) -> str:
    """Lower-case ASCII form of a name, for e-mail handles."""
    plain = unicodedata.normalize("NFKD", name).encode("ascii", "ignore").decode()
    return plain.lower().replace("-", "").replace("'", "")


def candidates_for(services: tuple[str, ...], kind: str) -> tuple[str, ...]:
    """Connected services able to handle ``kind``, in the user's option order."""
    return tuple(s for s in services if kind in vocab.SERVICES[s])

