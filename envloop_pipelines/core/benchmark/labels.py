"""Label functions: the answer to every question from (user rules, scenario facts).

Each ``label_<family>(user, scenario)`` is a pure function of the user's rules
(:class:`~.users.UserRules`) and the structured facts in ``meta.scenario``; a
later instruction in ``scenario["override"]`` wins over the stored rule.

When the deciding fact is absent from the state (variant ``"removed"``), the
truth cannot be read off the state, so the question carries a soft label:
``soft_<family>(user, scenario)`` is the probability of each answer **under the
generator's own distribution given what the state still shows** (the removed
rule is never read). Because rule values are drawn independently of the
visible facts (see :mod:`.vocab`), that posterior is the plain prior of the
rule, pushed through the label rule. The hard label is then its argmax, ties
going to the first option in criteria order.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any, Callable, Mapping

from . import vocab
from .users import Preference, UserRules, candidates_for

Scenario = Mapping[str, Any]

# --------------------------------------------------------------------------- question surface

#: The question type of each family (the table of docs/decision-data.md).
FAMILY_TYPES: dict[str, str] = {
    "apply_memory": "noul",
    "forgotten_violation": "noul",
    "needs_approval": "noul",
    "share_ok": "noul",
    "route": "choice",
    "notify_level": "score",
    "pick_option": "choice",
}
_NOUL_CRITERIA: dict[str, dict[str, str]] = {
    "apply_memory": {"true": "the memory bears on this request", "false": "the memory is beside the point"},
    "forgotten_violation": {
        "true": "it uses something the user asked to forget",
        "false": "it uses nothing the user asked to forget",
    },
    "needs_approval": {"true": "ask the user first", "false": "go ahead without asking"},
    "share_ok": {"true": "sharing it is allowed", "false": "it must not be shared"},
}


def criteria_for(family: str, user: UserRules, scenario: Scenario) -> Any:
    """The question's criteria: noul → {true, false}; choice → option → text; score → level names."""
    if family in _NOUL_CRITERIA:
        return dict(_NOUL_CRITERIA[family])
    if family == "notify_level":
        return list(vocab.NOTIFY_LEVELS)
    if family == "route":
        options = {s: vocab.SERVICE_DESCRIPTIONS[s] for s in user.services}
        options[vocab.ASK_USER] = vocab.ASK_USER_DESCRIPTION
        return options
    if family == "pick_option":
        return {o["key"]: o["title"] for o in scenario["action"]["options"]}
    raise ValueError(f"unknown family {family!r}")


def option_keys(family: str, user: UserRules, scenario: Scenario) -> tuple[str, ...]:
    """Answer keys in criteria order (``"true"``/``"false"``, level indices as strings, or option keys)."""
    qtype = FAMILY_TYPES[family]
    if qtype == "noul":
        return ("true", "false")
    if qtype == "score":
        return tuple(str(i) for i in range(len(vocab.NOTIFY_LEVELS)))
    return tuple(criteria_for(family, user, scenario))


def instructions_for(family: str, user: UserRules, scenario: Scenario) -> str:
    """The question text; it names what the question is about but never the answer."""
    first = user.first_name
    action = scenario["action"]
    if family == "apply_memory":
        return f"Is memory {scenario['memory']['mid']} relevant to {first}'s current request?"
    if family == "forgotten_violation":
        return f"Does the drafted action rely on something {first} asked the agent to forget?"
    if family == "needs_approval":
        return f"Must the agent ask {first} for approval before carrying out this action?"
    if family == "share_ok":
        return f"May the agent share this information about {first} with {action['recipient']}?"
    if family == "route":
        return f"Which connected service should handle this, or should the agent ask {first}?"
    if family == "notify_level":
        return f"How should the agent let {first} know about this?"
    if family == "pick_option":
        return f"Which option will {first} choose?"
    raise ValueError(f"unknown family {family!r}")


# --------------------------------------------------------------------------- rules


def _override(scenario: Scenario, *kinds: str) -> Mapping[str, Any] | None:
    ov = scenario.get("override")
    return ov if ov is not None and ov["kind"] in kinds else None


def effective_limit(user: UserRules, scenario: Scenario) -> int:
    """The spending limit in force: the user's, unless a later instruction changed it."""
    ov = _override(scenario, "spending_limit")
    return int(ov["limit"]) if ov else user.spending_limit


def effective_trusted(user: UserRules, scenario: Scenario) -> frozenset[str]:
    """Who may be paid without asking, after any later instruction."""
    trusted = set(user.trusted_recipients)
    ov = _override(scenario, "trusted_recipient")
    if ov:
        (trusted.add if ov["allow"] else trusted.discard)(ov["name"])
    return frozenset(trusted)


def in_quiet_hours(quiet: tuple[int, int] | None, hour: int) -> bool:
    """Whether ``hour`` falls in the quiet window [start, end) (which may wrap midnight)."""
    if quiet is None:
        return False
    start, end = quiet
    return start <= hour < end if start < end else (hour >= start or hour < end)


def apply_quiet_cap(level: int, category: str, quiet: tuple[int, int] | None, hour: int) -> int:
    """During quiet hours nothing goes above digest, except the exempt categories."""
    if category not in vocab.QUIET_EXEMPT and in_quiet_hours(quiet, hour):
        return min(level, vocab.QUIET_CAP)
    return level


def choose_option(options: list[Mapping[str, Any]], pref: Preference) -> str:
    """The option a preference picks. Prices, times and ratings are distinct within a record."""
    if pref.kind == "cheapest":
        return min(options, key=lambda o: o["price"])["key"]
    if pref.kind == "fastest":
        return min(options, key=lambda o: o["time"])["key"]
    if pref.kind == "best_rated":
        return max(options, key=lambda o: o["rating"])["key"]
    if pref.kind == "brand":
        branded = [o for o in options if o["brand"] == pref.brand]
        return min(branded or options, key=lambda o: o["price"])["key"]
    raise ValueError(f"unknown preference kind {pref.kind!r}")


def effective_preference(user: UserRules, scenario: Scenario) -> Preference:
    """The user's preference for the record's pick domain, after any later instruction."""
    ov = _override(scenario, "preference")
    if ov:
        return Preference(ov["pref"], ov.get("brand"))
    return user.preferences[scenario["action"]["domain"]]


# --------------------------------------------------------------------------- hard labels


def label_needs_approval(user: UserRules, scenario: Scenario) -> bool:
    """Ask first when the amount is over the limit, or when paying someone not trusted."""
    action = scenario["action"]
    if action["amount"] > effective_limit(user, scenario):
        return True
    return action["type"] == "transfer" and action["recipient"] not in effective_trusted(user, scenario)


def label_share_ok(user: UserRules, scenario: Scenario) -> bool:
    """Sharing is allowed when the recipient's relationship is in the category's policy."""
    action = scenario["action"]
    ov = _override(scenario, "privacy")
    if ov and ov["category"] == action["category"] and ov["recipient"] in (None, action["recipient"]):
        return bool(ov["allow"])
    relationship = user.contact(action["recipient"]).relationship
    return relationship in vocab.PRIVACY_POLICIES[user.privacy[action["category"]]]


def label_notify_level(user: UserRules, scenario: Scenario) -> int:
    """The user's level for the event category, capped at digest during quiet hours."""
    category, hour = scenario["notify"]["category"], scenario["notify"]["hour"]
    level = user.notify[category]
    ov = _override(scenario, "notification")
    if ov and ov["category"] == category:
        level = int(ov["level"])
    return apply_quiet_cap(level, category, user.quiet_hours, hour)


def label_route(user: UserRules, scenario: Scenario) -> str:
    """The only connected service able to do the task, the user's default among several, or ask."""
    task = scenario["route"]["task"]
    ov = _override(scenario, "service")
    if ov and ov["task"] == task:
        return str(ov["target"])
    candidates = candidates_for(user.services, task)
    if not candidates:
        return vocab.ASK_USER
    if len(candidates) == 1:
        return candidates[0]
    return user.route_defaults[task]


def label_pick_option(user: UserRules, scenario: Scenario) -> str:
    """The option the user's (possibly overridden) preference picks."""
    return choose_option(scenario["action"]["options"], effective_preference(user, scenario))


def label_forgotten_violation(user: UserRules, scenario: Scenario) -> bool:
    """True when the drafted action uses a value the user asked to forget."""
    forgotten = set(user.forgotten_values)
    ov = _override(scenario, "forget")
    if ov:
        (forgotten.add if ov["forget"] else forgotten.discard)(ov["value"])
    return scenario["action"]["draft_value"] in forgotten


def label_apply_memory(user: UserRules, scenario: Scenario) -> bool:
    """True when the memory's topic bears on the request's domain (or the user said so)."""
    memory = scenario["memory"]
    ov = _override(scenario, "relevance")
    if ov and ov["topic"] == memory["topic"]:
        return bool(ov["use"])
    return scenario["action"]["domain"] in vocab.RELEVANCE[memory["topic"]]


LABEL_FUNCTIONS: dict[str, Callable[[UserRules, Scenario], Any]] = {
    "apply_memory": label_apply_memory,
    "forgotten_violation": label_forgotten_violation,
    "needs_approval": label_needs_approval,
    "share_ok": label_share_ok,
    "route": label_route,
    "notify_level": label_notify_level,
    "pick_option": label_pick_option,
}

# --------------------------------------------------------------------------- soft labels ("removed")


def _bernoulli(p_true: Fraction) -> dict[str, Fraction]:
    return {"true": p_true, "false": 1 - p_true}


def soft_needs_approval(user: UserRules, scenario: Scenario) -> dict[str, Fraction]:
    """Limit removed: P(amount > L) with L uniform over the limits. Trusted list
    removed (a transfer within the visible limit): the payee was drawn from the
    trusted and the other contacts with probability 1/2 each."""
    action = scenario["action"]
    if scenario["removed"] == "spending_limit":
        p_over = Fraction(sum(1 for lim in vocab.SPENDING_LIMITS if action["amount"] > lim), len(vocab.SPENDING_LIMITS))
        if action["type"] == "transfer" and action["recipient"] not in effective_trusted(user, scenario):
            # The (visible) trusted list already says ask, whatever the limit was.
            return _bernoulli(Fraction(1))
        return _bernoulli(p_over)
    if scenario["removed"] == "trusted_recipient":
        if action["amount"] > effective_limit(user, scenario):
            return _bernoulli(Fraction(1))
        return _bernoulli(Fraction(1, 2))
    raise ValueError(f"needs_approval has no removable rule {scenario['removed']!r}")


def soft_share_ok(user: UserRules, scenario: Scenario) -> dict[str, Fraction]:
    """Policy removed: the share of the (uniform) policies that allow the recipient's relationship."""
    relationship = user.contact(scenario["action"]["recipient"]).relationship
    allowing = sum(1 for allowed in vocab.PRIVACY_POLICIES.values() if relationship in allowed)
    return _bernoulli(Fraction(allowing, len(vocab.PRIVACY_POLICIES)))


def soft_notify_level(user: UserRules, scenario: Scenario) -> dict[str, Fraction]:
    """Level removed: the category's level prior, pushed through the (visible) quiet-hours cap."""
    category, hour = scenario["notify"]["category"], scenario["notify"]["hour"]
    out: dict[str, Fraction] = {}
    for level, p in enumerate(vocab.NOTIFY_PRIORS[category]):
        capped = str(apply_quiet_cap(level, category, user.quiet_hours, hour))
        out[capped] = out.get(capped, Fraction(0)) + p
    return out


def soft_route(user: UserRules, scenario: Scenario) -> dict[str, Fraction]:
    """Default removed: uniform over the connected services able to do the task."""
    candidates = candidates_for(user.services, scenario["route"]["task"])
    if len(candidates) < 2:
        raise ValueError("a removed route default needs at least two candidate services")
    return {s: Fraction(1, len(candidates)) for s in candidates}


def soft_pick_option(user: UserRules, scenario: Scenario) -> dict[str, Fraction]:
    """Preference removed: kind uniform over the four kinds, brand uniform over the domain's brands."""
    action = scenario["action"]
    options, domain = action["options"], action["domain"]
    kinds = vocab.PREFERENCE_KINDS
    out: dict[str, Fraction] = {}
    for kind in kinds:
        if kind == "brand":
            brands = vocab.PICK_BRANDS[domain]
            for brand in brands:
                key = choose_option(options, Preference("brand", brand))
                out[key] = out.get(key, Fraction(0)) + Fraction(1, len(kinds) * len(brands))
        else:
            key = choose_option(options, Preference(kind))
            out[key] = out.get(key, Fraction(0)) + Fraction(1, len(kinds))
    return out


def soft_forgotten_violation(user: UserRules, scenario: Scenario) -> dict[str, Fraction]:
    """Forget list removed: the draft used the forgotten or the current value with probability 1/2 each."""
    return _bernoulli(Fraction(1, 2))


def soft_apply_memory(user: UserRules, scenario: Scenario) -> dict[str, Fraction]:
    """Memory content removed: the topic was drawn relevant or irrelevant with probability 1/2 each."""
    return _bernoulli(Fraction(1, 2))


SOFT_LABEL_FUNCTIONS: dict[str, Callable[[UserRules, Scenario], dict[str, Fraction]]] = {
    "apply_memory": soft_apply_memory,
    "forgotten_violation": soft_forgotten_violation,
    "needs_approval": soft_needs_approval,
    "share_ok": soft_share_ok,
    "route": soft_route,
    "notify_level": soft_notify_level,
    "pick_option": soft_pick_option,
}


def argmax_label(family: str, soft: Mapping[str, Fraction | float], keys: tuple[str, ...]) -> Any:
    """The hard label of a soft label: the most probable option, ties to the first in ``keys``."""
    best = max(keys, key=lambda k: (soft.get(k, 0), -keys.index(k)))
    qtype = FAMILY_TYPES[family]
    if qtype == "noul":
        return best == "true"
    if qtype == "score":
        return int(best)
    return best


def derive_label(family: str, user: UserRules, scenario: Scenario) -> tuple[Any, dict[str, float] | None]:
    """``(label, soft_label)`` of one question of a record.

    The soft label is set only on the question whose deciding fact was removed
    (the record's primary family in a ``"removed"`` record); zero-probability
    options are left out.
    """
    if scenario.get("removed") and family == scenario["primary"]:
        soft = SOFT_LABEL_FUNCTIONS[family](user, scenario)
        keys = option_keys(family, user, scenario)
        label = argmax_label(family, soft, keys)
        return label, {k: float(soft[k]) for k in keys if soft.get(k, 0) > 0}
    return LABEL_FUNCTIONS[family](user, scenario), None
