"""Scenarios: the structured facts of one record, before any wording.

A scenario is a JSON-able dict that ``meta.scenario`` keeps verbatim:

- ``primary`` / ``rule_kind`` / ``variant``: the question the record is built
  around, the user rule that decides it, and how hard the evidence is.
- ``questions``: the families asked, primary first.
- ``now``: the clock (weekday, date, time, hour).
- ``action``: the agent's pending action (purchase, transfer, share, message,
  request, choose, event) with its facts.
- ``notify`` / ``route`` / ``memory``: the facts that only those families read.
- ``override``: a later instruction that changes the primary rule, or None.
- ``removed``: the rule kind whose fact was left out of the state, or None.
- ``context``: the ordered facts the state shows (deciding facts and
  distractors), each a dict with a ``kind``.

Labels come from :mod:`.labels` applied to (user rules, scenario); the
context is only what the renderers put into words.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

import numpy as np

from . import vocab
from ._rng import chance, log_uniform, pick, sample, shuffled, weighted
from .labels import in_quiet_hours, label_share_ok
from .users import UserRules, candidates_for

#: (family, rule kind) cells; each record is built around one of them.
CELLS: tuple[tuple[str, str], ...] = (
    ("apply_memory", "relevance"),
    ("forgotten_violation", "forget"),
    ("needs_approval", "spending_limit"),
    ("needs_approval", "trusted_recipient"),
    ("share_ok", "privacy"),
    ("route", "service"),
    ("notify_level", "notification"),
    ("pick_option", "preference"),
)
RULE_KINDS: tuple[str, ...] = tuple(rk for _, rk in CELLS)
#: The rule kinds that decide each family (needs_approval has two).
FAMILY_RULE_KINDS: dict[str, tuple[str, ...]] = {f: tuple(rk for g, rk in CELLS if g == f) for f, _ in CELLS}

#: How many extra (clean-evidence) questions a record carries: 0, 1 or 2.
_SECONDARY_WEIGHTS = (0.3, 0.45, 0.25)
#: Families that can be asked about each action type besides the primary.
_SECONDARIES: dict[str, tuple[str, ...]] = {
    "purchase": ("needs_approval", "route", "notify_level"),
    "transfer": ("needs_approval", "route", "notify_level"),
    "share": (),
    "message": (),
    "request": ("apply_memory", "forgotten_violation"),
    "choose": ("pick_option", "route"),
    "event": (),
}
_FAMILY_ORDER = ("apply_memory", "forgotten_violation", "needs_approval", "share_ok", "route", "notify_level", "pick_option")
#: Share of overrides that flip the answer; the rest restate or move the rule
#: without crossing, so "there is an override" alone does not give the answer.
_FLIP = 0.7


def build_scenario(
    user: UserRules,
    family: str,
    rule_kind: str,
    variant: str,
    rng: np.random.Generator,
    *,
    with_secondaries: bool = True,
) -> dict[str, Any]:
    """Draw one scenario around ``(family, rule_kind)`` for ``user``.

    Args:
        user: whose rules decide the labels.
        family: the primary question's family.
        rule_kind: the rule that decides it (one of ``FAMILY_RULE_KINDS[family]``).
        variant: ``"clean"``, ``"override"``, ``"removed"`` or ``"buried"``.
        rng: the record's random stream.
        with_secondaries: whether to add 0-2 clean questions of other families.
    """
    sc: dict[str, Any] = {
        "primary": family,
        "rule_kind": rule_kind,
        "variant": variant,
        "override": None,
        "removed": rule_kind if variant == "removed" else None,
    }
    _BUILDERS[rule_kind](user, sc, rng)
    questions = [family]
    if with_secondaries:
        options = [f for f in _SECONDARIES[sc["action"]["type"]] if f != family]
        k = min(len(options), int(rng.choice(3, p=_SECONDARY_WEIGHTS)))
        extra = sample(rng, options, k)
        for fam in extra:
            _add_secondary(fam, user, sc, rng)
        questions += [f for f in _FAMILY_ORDER if f in extra]
    sc["questions"] = questions
    sc["now"] = _now(rng, user, variant, has_notify="notify_level" in questions)
    if "notify" in sc:
        sc["notify"]["hour"] = sc["now"]["hour"]
    if sc["override"] is not None:
        # The later instruction came 10-180 minutes before now (now is 08:00 or later).
        sc["override"]["minutes_ago"] = int(rng.integers(10, 181))
    sc["context"] = _context(user, sc, rng)
    return sc


# --------------------------------------------------------------------------- primary builders


def _build_spending_limit(user: UserRules, sc: dict[str, Any], rng: np.random.Generator) -> None:
    sc["action"] = _purchase(rng, pick(rng, tuple(vocab.PURCHASES)))
    if sc["variant"] == "override":
        amount, limit = sc["action"]["amount"], user.spending_limit
        if chance(rng, _FLIP):
            # Move the limit across the amount to a round number.
            new = int(np.ceil((amount + 0.01) / 50) * 50) if amount > limit else int(np.floor((amount - 0.01) / 10) * 10)
        else:
            # Move it without crossing: halve a limit the amount is already over, double one it is under.
            new = max(10, limit // 2) if amount > limit else limit * 2
        sc["override"] = {"kind": "spending_limit", "limit": new}


def _build_trusted_recipient(user: UserRules, sc: dict[str, Any], rng: np.random.Generator) -> None:
    trusted = [c for c in user.contacts if c.name in user.trusted_recipients]
    others = [c for c in user.contacts if c.name not in user.trusted_recipients]
    # Payee trusted or not with probability 1/2: the prior of a removed trusted list.
    payee = pick(rng, trusted) if chance(rng, 0.5) else pick(rng, others)
    limit = user.spending_limit
    # Within the visible limit, so the trusted list alone decides.
    amount = round(float(rng.uniform(max(5.0, 0.15 * limit), 0.95 * limit)), 2)
    sc["action"] = _transfer(rng, payee.name, payee.role, amount)
    if sc["variant"] == "override":
        is_trusted = payee.name in user.trusted_recipients
        allow = (not is_trusted) if chance(rng, _FLIP) else is_trusted
        sc["override"] = {"kind": "trusted_recipient", "name": payee.name, "allow": allow}


def _build_privacy(user: UserRules, sc: dict[str, Any], rng: np.random.Generator) -> None:
    # Recipient and category are drawn without looking at the policy, so the
    # policy prior is also the posterior when the policy is removed.
    recipient = pick(rng, user.contacts)
    category = pick(rng, vocab.PRIVACY_CATEGORIES)
    sc["action"] = {
        "type": "share",
        "recipient": recipient.name,
        "role": recipient.role,
        "category": category,
        "item": pick(rng, vocab.PRIVATE_ITEMS[category]).format(first=user.first_name),
        "ask": pick(rng, vocab.THIRD_PARTY_QUESTIONS).format(first=user.first_name),
    }
    if sc["variant"] == "override":
        allowed = label_share_ok(user, {"action": sc["action"], "override": None})
        allow = (not allowed) if chance(rng, _FLIP) else allowed
        # A ban may be general ("with anyone"); a permission names the person.
        who = None if (not allow and chance(rng, 0.5)) else recipient.name
        sc["override"] = {"kind": "privacy", "category": category, "recipient": who, "allow": allow}


def _build_notification(user: UserRules, sc: dict[str, Any], rng: np.random.Generator) -> None:
    kind = weighted(rng, ("event", "purchase", "transfer"), (0.7, 0.15, 0.15))
    if kind == "event":
        category = pick(rng, tuple(vocab.EVENT_TEXTS))
        contact = pick(rng, user.contacts)
        text = pick(rng, vocab.EVENT_TEXTS[category]).format(first=user.first_name, contact=contact.name)
        sc["action"] = {"type": "event", "category": category, "text": text}
    elif kind == "purchase":
        category = "purchase"
        sc["action"] = _purchase(rng, pick(rng, tuple(vocab.PURCHASES)))
    else:
        category = "payment"
        payee = pick(rng, user.contacts)
        sc["action"] = _transfer(rng, payee.name, payee.role, log_uniform(rng, 5.0, 600.0))
    sc["notify"] = {"category": category, "hour": None}
    if sc["variant"] == "override":
        current = user.notify[category]
        sc["override"] = {"kind": "notification", "category": category, "level": pick(rng, [lv for lv in range(4) if lv != current])}


def _build_service(user: UserRules, sc: dict[str, Any], rng: np.random.Generator) -> None:
    by_case: dict[str, list[str]] = {"none": [], "single": [], "multi": []}
    for task in vocab.TASK_KINDS:
        n = len(candidates_for(user.services, task))
        by_case["none" if n == 0 else "single" if n == 1 else "multi"].append(task)
    if sc["variant"] == "clean":
        cases = [c for c in ("none", "single", "multi") if by_case[c]]
        case = weighted(rng, cases, [{"none": 0.25, "single": 0.3, "multi": 0.45}[c] for c in cases])
    else:
        # Hard variants are about the user's default, which exists only when
        # several connected services can do the task (every user has such a task).
        case = "multi"
    task = pick(rng, by_case[case])
    if task == "payments":
        payee = pick(rng, user.contacts)
        sc["action"] = _transfer(rng, payee.name, payee.role, log_uniform(rng, 5.0, 600.0))
    elif task == "messaging":
        contact = pick(rng, user.contacts)
        sc["action"] = {
            "type": "message",
            "recipient": contact.name,
            "role": contact.role,
            "text": pick(rng, vocab.MESSAGE_REQUESTS).format(contact=contact.name),
        }
    else:
        domains = [d for d, t in vocab.PICK_TASK.items() if t == task]
        if domains and chance(rng, 0.5):
            sc["action"] = _choose(rng, pick(rng, domains))
        else:
            sc["action"] = _purchase(rng, task)
    sc["route"] = {"task": task}
    if sc["variant"] == "override":
        others = [s for s in candidates_for(user.services, task) if s != user.route_defaults[task]]
        target = pick(rng, others) if chance(rng, 0.7) else vocab.ASK_USER
        sc["override"] = {"kind": "service", "task": task, "target": target}


def _build_preference(user: UserRules, sc: dict[str, Any], rng: np.random.Generator) -> None:
    domain = pick(rng, vocab.PICK_DOMAINS)
    sc["action"] = _choose(rng, domain)
    if sc["variant"] == "override":
        current = user.preferences[domain].kind
        kind = pick(rng, [k for k in vocab.PREFERENCE_KINDS if k != current])
        brand = pick(rng, [o["brand"] for o in sc["action"]["options"]]) if kind == "brand" else None
        sc["override"] = {"kind": "preference", "pref": kind, "brand": brand}


def _build_forget(user: UserRules, sc: dict[str, Any], rng: np.random.Generator) -> None:
    topic = pick(rng, user.forgotten_topics)
    domain = pick(rng, [d for d in vocab.REQUEST_DOMAINS if topic in vocab.DRAFT_FIELDS[d]])
    item = user.forget[topic]
    # Forgotten or current value with probability 1/2: the prior of a removed forget list.
    value = item.forgotten if chance(rng, 0.5) else item.current
    sc["action"] = _request(rng, domain, topic, value)
    if sc["variant"] == "override":
        violates = value == item.forgotten
        if chance(rng, _FLIP):
            # Re-allow the forgotten value, or ask to forget the current one too.
            sc["override"] = {"kind": "forget", "value": value, "forget": not violates}
        else:
            # Restate: forget the forgotten one again, or confirm the current one is fine.
            sc["override"] = {"kind": "forget", "value": value, "forget": violates}


def _build_relevance(user: UserRules, sc: dict[str, Any], rng: np.random.Generator) -> None:
    domain = pick(rng, vocab.REQUEST_DOMAINS)
    topic = pick(rng, vocab.DRAFT_FIELDS[domain])
    sc["action"] = _request(rng, domain, topic, user.forget[topic].current)
    sc["memory"] = _memory(user, domain, rng)
    if sc["variant"] == "override":
        relevant = domain in vocab.RELEVANCE[sc["memory"]["topic"]]
        use = (not relevant) if chance(rng, _FLIP) else relevant
        sc["override"] = {"kind": "relevance", "topic": sc["memory"]["topic"], "use": use}


_BUILDERS = {
    "spending_limit": _build_spending_limit,
    "trusted_recipient": _build_trusted_recipient,
    "privacy": _build_privacy,
    "notification": _build_notification,
    "service": _build_service,
    "preference": _build_preference,
    "forget": _build_forget,
    "relevance": _build_relevance,
}


def _add_secondary(family: str, user: UserRules, sc: dict[str, Any], rng: np.random.Generator) -> None:
    """Add the facts a clean secondary question needs."""
    action = sc["action"]
    if family == "notify_level":
        sc["notify"] = {"category": "purchase" if action["type"] == "purchase" else "payment", "hour": None}
    elif family == "route":
        sc["route"] = {"task": task_of(action)}
    elif family == "apply_memory":
        sc["memory"] = _memory(user, action["domain"], rng)
    elif family == "forgotten_violation":
        topic = action["draft_topic"]
        if topic in user.forgotten_topics and chance(rng, 0.5):
            action["draft_value"] = user.forget[topic].forgotten
    # needs_approval and pick_option read only the action, which has what they need.


def task_of(action: dict[str, Any]) -> str:
    """The route task kind of an action."""
    if action["type"] == "transfer":
        return "payments"
    if action["type"] == "message":
        return "messaging"
    if action["type"] == "choose":
        return vocab.PICK_TASK[action["domain"]]
    return str(action["task"])


# --------------------------------------------------------------------------- actions


def _purchase(rng: np.random.Generator, task: str) -> dict[str, Any]:
    merchant, item = pick(rng, vocab.PURCHASES[task])
    amount = log_uniform(rng, *vocab.PURCHASE_RANGES[task])
    if amount in vocab.SPENDING_LIMITS:
        # A whole-dollar amount equal to a limit would read as a tie; keep cents.
        amount += 0.37
    return {"type": "purchase", "task": task, "merchant": merchant, "item": item, "amount": round(amount, 2)}


def _transfer(rng: np.random.Generator, recipient: str, role: str, amount: float) -> dict[str, Any]:
    if amount in vocab.SPENDING_LIMITS:
        amount += 0.37
    return {
        "type": "transfer",
        "recipient": recipient,
        "role": role,
        "amount": round(amount, 2),
        "purpose": pick(rng, vocab.TRANSFER_PURPOSES),
    }


def _request(rng: np.random.Generator, domain: str, topic: str, value: str) -> dict[str, Any]:
    return {
        "type": "request",
        "domain": domain,
        "request": pick(rng, vocab.REQUEST_TEXTS[domain]),
        "draft": vocab.DRAFT_ACTIONS[domain],
        "draft_topic": topic,
        "draft_value": value,
    }


def _choose(rng: np.random.Generator, domain: str) -> dict[str, Any]:
    """3-5 options with distinct prices, times and ratings (so every preference has one answer)."""
    n = 3 + int(rng.integers(3))
    (p_lo, p_hi), (t_lo, t_hi), _unit = vocab.PICK_RANGES[domain]
    prices = sample(rng, range(p_lo, p_hi + 1), n)
    times = sample(rng, range(t_lo, t_hi + 1), n)
    ratings = sample(rng, [round(3.0 + 0.1 * i, 1) for i in range(20)], n)
    suffixes = sample(rng, vocab.PICK_SUFFIXES[domain], n)
    options = []
    for i in range(n):
        brand = pick(rng, vocab.PICK_BRANDS[domain])
        options.append(
            {
                "key": "ABCDE"[i],
                "title": f"{brand} {suffixes[i]}",
                "brand": brand,
                "price": int(prices[i]),
                "time": int(times[i]),
                "rating": float(ratings[i]),
            }
        )
    return {"type": "choose", "domain": domain, "request": pick(rng, vocab.PICK_REQUESTS[domain]), "options": options}


def _memory(user: UserRules, domain: str, rng: np.random.Generator) -> dict[str, Any]:
    """A memory about the user, relevant to ``domain`` with probability 1/2 (the removed prior)."""
    relevant = [t for t in vocab.MEMORY_TOPICS if domain in vocab.RELEVANCE[t]]
    irrelevant = [t for t in vocab.MEMORY_TOPICS if domain not in vocab.RELEVANCE[t]]
    topic = pick(rng, relevant) if chance(rng, 0.5) else pick(rng, irrelevant)
    return {"mid": f"M{int(rng.integers(10, 100))}", "topic": topic, "value": user.memories[topic]}


# --------------------------------------------------------------------------- clock


def _now(rng: np.random.Generator, user: UserRules, variant: str, *, has_notify: bool) -> dict[str, Any]:
    date = _dt.date(2025, 1, 1) + _dt.timedelta(days=int(rng.integers(365)))
    if variant == "override":
        # Daytime outside quiet hours: a later instruction never meets the quiet-hours cap.
        hours = [h for h in range(8, 22) if not in_quiet_hours(user.quiet_hours, h)]
    elif has_notify and user.quiet_hours is not None and chance(rng, 0.4):
        hours = [h for h in range(24) if in_quiet_hours(user.quiet_hours, h)]
    elif has_notify:
        hours = [h for h in range(7, 24) if not in_quiet_hours(user.quiet_hours, h)]
    else:
        hours = list(range(7, 23))
    hour = pick(rng, hours)
    minute = int(rng.integers(60))
    return {
        "weekday": vocab.WEEKDAYS[date.weekday()],
        "date": date.isoformat(),
        "time": f"{hour:02d}:{minute:02d}",
        "hour": hour,
    }


# --------------------------------------------------------------------------- context


def _deciding_facts(family: str, user: UserRules, sc: dict[str, Any]) -> list[dict[str, Any]]:
    """Facts the state must show for ``family`` (less the removed one)."""
    removed = sc["removed"] if family == sc["primary"] else None
    action = sc["action"]
    facts: list[dict[str, Any]] = []
    if family == "needs_approval":
        if removed != "spending_limit":
            facts.append({"kind": "spending_limit", "limit": user.spending_limit})
        if action["type"] == "transfer" and removed != "trusted_recipient":
            facts.append({"kind": "trusted_recipients", "names": list(user.trusted_recipients)})
    elif family == "share_ok":
        if not removed:
            category = action["category"]
            facts.append({"kind": "privacy", "category": category, "policy": user.privacy[category]})
    elif family == "notify_level":
        category = sc["notify"]["category"]
        if not removed:
            facts.append({"kind": "notify_pref", "category": category, "level": user.notify[category]})
        quiet = user.quiet_hours
        facts.append({"kind": "quiet_hours", "start": quiet[0] if quiet else None, "end": quiet[1] if quiet else None})
    elif family == "route":
        task = sc["route"]["task"]
        facts.append({"kind": "connected_services", "services": list(user.services)})
        if len(candidates_for(user.services, task)) >= 2 and not removed:
            facts.append({"kind": "route_default", "task": task, "service": user.route_defaults[task]})
    elif family == "pick_option":
        if not removed:
            pref = user.preferences[action["domain"]]
            facts.append({"kind": "preference", "domain": action["domain"], "pref": pref.kind, "brand": pref.brand})
    elif family == "forgotten_violation":
        if not removed:
            for topic in user.forgotten_topics:
                facts.append({"kind": "forget_request", "topic": topic, "value": user.forget[topic].forgotten})
    elif family == "apply_memory":
        memory = sc["memory"]
        facts.append({"kind": "memory", "mid": memory["mid"], "topic": memory["topic"], "value": memory["value"], "redacted": bool(removed)})
    return facts


def _look_alikes(user: UserRules, sc: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """The user's other rules, by fact kind, minus anything that decides a question here.

    A fact about the same key as a question (the same privacy category, event
    category, task, pick domain, memory topic or draft topic) is never a
    distractor, so distractors cannot change a label.
    """
    action = sc["action"]
    notify_cat = sc["notify"]["category"] if "notify" in sc else None
    route_task = sc["route"]["task"] if "route" in sc else None
    share_cat = action["category"] if action["type"] == "share" else None
    pick_domain = action["domain"] if action["type"] == "choose" else None
    memory_topic = sc["memory"]["topic"] if "memory" in sc else None
    draft_topic = action.get("draft_topic")
    recipient = action.get("recipient")
    return {
        "privacy": [{"kind": "privacy", "category": c, "policy": p} for c, p in user.privacy.items() if c != share_cat],
        "notify_pref": [
            {"kind": "notify_pref", "category": c, "level": lv} for c, lv in user.notify.items() if c != notify_cat
        ],
        "route_default": [
            {"kind": "route_default", "task": t, "service": s}
            for t, s in user.route_defaults.items()
            if t != route_task
        ],
        "preference": [
            {"kind": "preference", "domain": d, "pref": p.kind, "brand": p.brand}
            for d, p in user.preferences.items()
            if d != pick_domain
        ],
        "memory": [
            {"kind": "memory", "mid": None, "topic": t, "value": v, "redacted": False}
            for t, v in user.memories.items()
            if t != memory_topic
        ],
        "profile": [
            {"kind": "profile", "topic": t, "value": item.current} for t, item in user.forget.items() if t != draft_topic
        ],
        # Only for purchases: nobody is paid, so who is trusted cannot matter.
        "trusted_recipients": (
            [{"kind": "trusted_recipients", "names": list(user.trusted_recipients)}] if action["type"] == "purchase" else []
        ),
        "contact": [{"kind": "contact", "name": c.name, "role": c.role} for c in user.contacts if c.name != recipient],
    }


#: Per rule kind, the kind of the context fact that decides it.
_RULE_FACT: dict[str, str] = {
    "spending_limit": "spending_limit",
    "trusted_recipient": "trusted_recipients",
    "privacy": "privacy",
    "notification": "notify_pref",
    "service": "route_default",
    "preference": "preference",
    "forget": "forget_request",
    "relevance": "memory",
}
#: Per rule kind, the fact kinds that look like its deciding fact.
_SAME_KIND: dict[str, tuple[str, ...]] = {
    "spending_limit": ("trusted_recipients", "notify_pref"),
    "trusted_recipient": ("contact",),
    "privacy": ("privacy",),
    "notification": ("notify_pref",),
    "service": ("route_default",),
    "preference": ("preference",),
    "forget": ("profile",),
    "relevance": ("memory",),
}


def _context(user: UserRules, sc: dict[str, Any], rng: np.random.Generator) -> list[dict[str, Any]]:
    deciding: list[dict[str, Any]] = []
    for family in sc["questions"]:
        deciding += _deciding_facts(family, user, sc)
    trivia = [{"kind": "trivia", "key": k, "value": v} for k, v in user.trivia.items()]
    if sc["variant"] == "buried":
        look = _look_alikes(user, sc)
        kinds = _SAME_KIND[sc["rule_kind"]]
        same = [f for k in kinds for f in look[k]]
        others = [f for k, facts in look.items() if k not in kinds for f in facts] + trivia
        n_same = min(len(same), 2 + int(rng.integers(3)))
        n_total = 5 + int(rng.integers(5))  # 5-9 distractors
        chosen = sample(rng, same, n_same) + sample(rng, others, min(len(others), n_total - n_same))
    else:
        recipient = sc["action"].get("recipient")
        light = trivia + [{"kind": "contact", "name": c.name, "role": c.role} for c in user.contacts if c.name != recipient]
        chosen = sample(rng, light, int(rng.integers(3)))  # 0-2 harmless lines
    _number_memories(chosen, sc, rng)
    facts = shuffled(rng, deciding + chosen)
    if sc["variant"] == "buried":
        # Keep the deciding fact(s) off both ends, so they truly sit among the others.
        anchors = [f for f in _deciding_facts(sc["primary"], user, sc) if f["kind"] == _RULE_FACT[sc["rule_kind"]]]
        for end in (0, len(facts) - 1):
            if facts[end] in anchors:
                j = pick(rng, [j for j in range(1, len(facts) - 1) if facts[j] not in anchors])
                facts[end], facts[j] = facts[j], facts[end]
    return facts


def _number_memories(facts: list[dict[str, Any]], sc: dict[str, Any], rng: np.random.Generator) -> None:
    """Give distractor memories ids distinct from the record's own memory."""
    taken = {sc["memory"]["mid"]} if "memory" in sc else set()
    for f in facts:
        if f["kind"] == "memory" and f["mid"] is None:
            mid = f"M{int(rng.integers(10, 100))}"
            while mid in taken:
                mid = f"M{int(rng.integers(10, 100))}"
            taken.add(mid)
            f["mid"] = mid
