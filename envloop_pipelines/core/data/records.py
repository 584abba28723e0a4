"""Decision records: the data contract of ``docs/decision-data.md``.

A record is one *state* (a ticket, a conversation, an agent action) carrying
one or more typed *questions* (noul / choice / score), each with a label. This
module holds the record values and their validation: one decoded object into a
typed :class:`Record`, then the checks over a whole file (duplicate ids, token
budget, declared splits), reporting **every** error at once with its file, line
and field (:mod:`~envloop_pipelines.core.data.errors`). Reading JSONL files is
:mod:`~envloop_pipelines.core.data.jsonl`, CSV/Parquet through a column mapping
:mod:`~envloop_pipelines.core.data.tabular`; the flattened per-question table
that training and metrics read is :mod:`~envloop_pipelines.core.data.question_table`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Literal, Mapping, Sequence

from envloop_pipelines.core.data.errors import DataValidationError, FieldError
from envloop_pipelines.core.data.json_text import render_value
from envloop_pipelines.core.data.splits import SPLITS
from envloop_pipelines.core.progress import track

QuestionType = Literal["noul", "choice", "score"]
QUESTION_TYPES: tuple[str, ...] = ("noul", "choice", "score")
#: noul questions are two options in this fixed order, so P(true) is index 0.
NOUL_OPTIONS: tuple[str, str] = ("true", "false")
MIN_CHOICE_OPTIONS, MAX_CHOICE_OPTIONS = 2, 255
MIN_SCORE_LEVELS, MAX_SCORE_LEVELS = 2, 10
#: Jev API budget for the state plus the longest question (``docs/jev-api.md``).
DEFAULT_TOKEN_BUDGET = 32_768
DEFAULT_GROUP_KEY = "user_id"
_SOFT_LABEL_TOLERANCE = 1e-4


# --------------------------------------------------------------------------- values


@dataclass(frozen=True)
class Question:
    """One typed question about a state.

    ``option_keys`` is the answer space in a fixed order: ``("true", "false")``
    for noul, the criteria keys for choice, ``("0", "1", ...)`` for score.
    ``option_texts`` holds each option's description (the level name for
    score, ``None`` where the key alone carries the meaning).
    """

    id: str
    type: QuestionType
    instructions: Any
    criteria: Any
    option_keys: tuple[str, ...]
    option_texts: tuple[str | None, ...]
    family: str
    label: int | None = None
    soft_label: tuple[float, ...] | None = None

    @property
    def n_options(self) -> int:
        return len(self.option_keys)

    def label_value(self) -> Any:
        """The label in the record format (bool, option key, or level index)."""
        if self.label is None:
            return None
        if self.type == "noul":
            return self.label == 0
        if self.type == "score":
            return self.label
        return self.option_keys[self.label]


@dataclass(frozen=True)
class Record:
    """One state with its questions and metadata."""

    id: str
    state: Any
    questions: tuple[Question, ...]
    meta: Mapping[str, Any] = field(default_factory=dict)
    group: str | None = None


@dataclass(frozen=True)
class LoadReport:
    """What a loader read: the records and where they came from."""

    records: tuple[Record, ...]
    source: str
    n_lines: int


# --------------------------------------------------------------------------- parsing


def _is_text_like(value: Any) -> bool:
    return isinstance(value, (str, dict, list))


def parse_options(
    qtype: str, criteria: Any, where: Callable[[str, str], None], prefix: str
) -> tuple[tuple[str, ...], tuple[str | None, ...]] | None:
    """Options of a question from its criteria, or None after reporting errors."""
    # a description is text, an object or an array (or null but for a score level), as the server's schema says
    described = (list(criteria.items()) if isinstance(criteria, dict)
                 else list(enumerate(criteria)) if isinstance(criteria, list) and qtype == "score" else [])
    wrong = [(k, d) for k, d in described if not (d is None and qtype != "score") and not _is_text_like(d)]
    for key, desc in wrong:
        allowed = "text, an object or an array" + ("" if qtype == "score" else ", or null")
        where(f"{prefix}.criteria", f"criteria[{key!r}] must be {allowed}, got {type(desc).__name__}")
    if wrong:
        return None
    if qtype == "noul":
        texts: dict[str, str | None] = {"true": None, "false": None}
        if criteria is None:
            return NOUL_OPTIONS, (None, None)
        if not isinstance(criteria, dict):
            where(f"{prefix}.criteria", "noul criteria must be an object with keys 'true' and/or 'false', or null")
            return None
        bad = [k for k in criteria if k not in texts]
        if bad:
            where(f"{prefix}.criteria", f"noul criteria keys must be 'true'/'false', got {bad!r}")
            return None
        for key, text in criteria.items():
            texts[key] = None if text is None else render_value(text)
        return NOUL_OPTIONS, (texts["true"], texts["false"])
    if qtype == "choice":
        if isinstance(criteria, list):
            keys = [c if isinstance(c, str) else None for c in criteria]
            if any(k is None for k in keys):
                where(f"{prefix}.criteria", "choice criteria as an array must list option keys as strings")
                return None
            pairs: list[tuple[str, Any]] = [(k, None) for k in keys]  # type: ignore[misc]
        elif isinstance(criteria, dict):
            if getattr(criteria, "duplicate_keys", ()):
                where(f"{prefix}.criteria", f"duplicate option keys {list(criteria.duplicate_keys)!r}")
                return None
            pairs = list(criteria.items())
        else:
            where(f"{prefix}.criteria", "choice criteria must be an object mapping option → description (or null)")
            return None
        keys = [k for k, _ in pairs]
        dupes = sorted({k for k in keys if keys.count(k) > 1})
        if dupes:
            where(f"{prefix}.criteria", f"duplicate option keys {dupes!r}")
            return None
        if not MIN_CHOICE_OPTIONS <= len(keys) <= MAX_CHOICE_OPTIONS:
            where(
                f"{prefix}.criteria",
                f"choice needs {MIN_CHOICE_OPTIONS} to {MAX_CHOICE_OPTIONS} options, got {len(keys)}",
            )
            return None
        if any(k == "" for k in keys):
            where(f"{prefix}.criteria", "option keys must be non-empty strings")
            return None
        return tuple(keys), tuple(None if t is None else render_value(t) for _, t in pairs)
    # score
    if isinstance(criteria, dict):
        where(f"{prefix}.criteria", "score criteria must be an ordered array of levels (lowest first), not an object map")
        return None
    if not isinstance(criteria, list):
        where(f"{prefix}.criteria", "score criteria must be an ordered array of levels (lowest first)")
        return None
    if not MIN_SCORE_LEVELS <= len(criteria) <= MAX_SCORE_LEVELS:
        where(f"{prefix}.criteria", f"score needs {MIN_SCORE_LEVELS} to {MAX_SCORE_LEVELS} levels, got {len(criteria)}")
        return None
    return tuple(str(i) for i in range(len(criteria))), tuple(render_value(c) for c in criteria)


def _parse_label(
    qtype: str, raw: Any, keys: tuple[str, ...], where: Callable[[str, str], None], prefix: str
) -> int | None:
    if qtype == "noul":
        if not isinstance(raw, bool):
            where(f"{prefix}.label", f"noul label must be a boolean true/false, got {raw!r}")
            return None
        return 0 if raw else 1
    if qtype == "choice":
        if not isinstance(raw, str) or raw not in keys:
            shown = ", ".join(repr(k) for k in keys[:10]) + (" ..." if len(keys) > 10 else "")
            where(f"{prefix}.label", f"label {raw!r} is not among the options ({shown})")
            return None
        return keys.index(raw)
    if isinstance(raw, bool) or not isinstance(raw, int) or not 0 <= raw < len(keys):
        where(f"{prefix}.label", f"score label must be a zero-based level index in [0, {len(keys) - 1}], got {raw!r}")
        return None
    return raw


def _parse_soft_label(
    qtype: str, raw: Any, keys: tuple[str, ...], where: Callable[[str, str], None], prefix: str
) -> tuple[float, ...] | None:
    if not isinstance(raw, dict) or not raw:
        where(f"{prefix}.soft_label", "soft_label must be a non-empty object mapping option → probability")
        return None
    values = [0.0] * len(keys)
    ok = True
    for key, prob in raw.items():
        if key not in keys:
            where(f"{prefix}.soft_label", f"key {key!r} is not an option of this {qtype} question")
            ok = False
            continue
        if isinstance(prob, bool) or not isinstance(prob, (int, float)) or not math.isfinite(prob) or prob < 0:
            where(f"{prefix}.soft_label", f"probability for {key!r} must be a finite number ≥ 0, got {prob!r}")
            ok = False
            continue
        values[keys.index(key)] = float(prob)
    if ok and abs(sum(values) - 1.0) > _SOFT_LABEL_TOLERANCE:
        where(f"{prefix}.soft_label", f"probabilities must sum to 1, got {sum(values):.6f}")
        ok = False
    return tuple(values) if ok else None


def parse_record(
    obj: Any,
    *,
    file: str,
    line: int | None,
    group_key: str = DEFAULT_GROUP_KEY,
    require_group: bool = False,
    require_labels: bool = True,
    errors: list[FieldError],
) -> Record | None:
    """Validate one decoded JSON object into a :class:`Record`.

    Errors are appended to ``errors`` (every problem of the record, not just the
    first); the return value is None when any was found.
    """
    n_before = len(errors)

    def where(fld: str, message: str) -> None:
        errors.append(FieldError(file, line, fld, message))

    if not isinstance(obj, dict):
        where("<record>", f"a record must be a JSON object, got {type(obj).__name__}")
        return None
    rid = obj.get("id")
    if not isinstance(rid, str) or not rid:
        where("id", f"record id must be a non-empty string, got {rid!r}")
    if "state" not in obj:
        where("state", "missing")
    elif not _is_text_like(obj["state"]):
        where("state", f"state must be a string, object or array, got {type(obj['state']).__name__}")
    meta = obj.get("meta", {})
    if meta is None:
        meta = {}
    if not isinstance(meta, dict):
        where("meta", "meta must be an object")
        meta = {}
    group = meta.get(group_key)
    if group is not None and not isinstance(group, (str, int)):
        where(f"meta.{group_key}", f"group key must be a string or integer, got {group!r}")
        group = None
    if require_group and group in (None, ""):
        where(f"meta.{group_key}", "missing group key (needed for a group-disjoint split)")
    families = meta.get("family", {})
    if not isinstance(families, dict):
        where("meta.family", "meta.family must be an object mapping question id → family")
        families = {}

    questions_raw = obj.get("questions")
    questions: list[Question] = []
    if not isinstance(questions_raw, dict) or not questions_raw:
        where("questions", "questions must be a non-empty object mapping question id → question")
        questions_raw = {}
    if getattr(questions_raw, "duplicate_keys", ()):
        where("questions", f"duplicate question ids {list(questions_raw.duplicate_keys)!r}")
    for qid, q in questions_raw.items():
        prefix = f"questions.{qid}"
        if not isinstance(q, dict):
            where(prefix, "a question must be an object")
            continue
        qtype = q.get("type")
        if qtype not in QUESTION_TYPES:
            where(f"{prefix}.type", f"type must be one of {', '.join(QUESTION_TYPES)}, got {qtype!r}")
            continue
        instructions = q.get("instructions")
        if not _is_text_like(instructions) or instructions in ("", [], {}):
            where(f"{prefix}.instructions", "instructions must be a non-empty string, object or array")
        options = parse_options(qtype, q.get("criteria"), where, prefix)
        if options is None:
            continue
        keys, texts = options
        label = None
        if "label" in q:
            label = _parse_label(qtype, q["label"], keys, where, prefix)
        elif require_labels:
            where(f"{prefix}.label", "missing label")
        soft = _parse_soft_label(qtype, q["soft_label"], keys, where, prefix) if q.get("soft_label") is not None else None
        family = families.get(qid, qid)
        if not isinstance(family, str) or not family:
            where(f"meta.family.{qid}", f"family must be a non-empty string, got {family!r}")
            family = qid
        questions.append(
            Question(
                id=qid,
                type=qtype,
                instructions=instructions,
                criteria=q.get("criteria"),
                option_keys=keys,
                option_texts=texts,
                family=family,
                label=label,
                soft_label=soft,
            )
        )
    if len(errors) > n_before:
        return None
    return Record(
        id=rid,  # type: ignore[arg-type]
        state=obj["state"],
        questions=tuple(questions),
        meta=meta,
        group=None if group is None else str(group),
    )


def check_duplicate_ids(ids: Iterable[tuple[Any, int | None]], file: str, errors: list[FieldError]) -> None:
    """Report every record id seen more than once, at each repeated line (valid records or not)."""
    first_seen: dict[str, int | None] = {}
    for rid, line in ids:
        if not isinstance(rid, str):
            continue
        if rid in first_seen:
            errors.append(FieldError(file, line, "id", f"duplicate record id {rid!r} (first at line {first_seen[rid]})"))
        else:
            first_seen[rid] = line


def check_token_budget(
    pairs: Sequence[tuple[Record, int | None]],
    file: str,
    errors: list[FieldError],
    count_tokens: Callable[[list[str]], list[int]],
    budget: int = DEFAULT_TOKEN_BUDGET,
) -> None:
    """Report records whose state plus longest question is over ``budget`` tokens."""
    if not pairs:
        return
    texts: list[str] = []
    for record, _ in pairs:
        # The longest question by characters stands in for the longest by tokens (one tokenizer call per record).
        longest = max(
            (render_value(q.instructions) + " " + " ".join(k + " " + (t or "") for k, t in zip(q.option_keys, q.option_texts))
             for q in record.questions),
            key=len,
        )
        texts.append(render_value(record.state) + " " + longest)
    counts: list[int] = []
    chunk = 512  # one tokenizer call per chunk, so a long file shows its progress
    for start in track(range(0, len(texts), chunk), "count tokens", unit="record", total=len(texts),
                       weight=lambda s: min(chunk, len(texts) - s)):
        counts += count_tokens(texts[start:start + chunk])
    for (record, line), n in zip(pairs, counts):
        if n > budget:
            errors.append(
                FieldError(file, line, "state", f"state plus longest question is {n} tokens, over the budget of {budget} (tokens_exceeded)")
            )


def declared_splits(records: Sequence[Record], source: str, lines: Sequence[int | None] | None = None) -> dict[str, str]:
    """Splits fixed by the data itself (``meta.split``), checked consistent per group."""
    declared: dict[str, str] = {}
    errors: list[FieldError] = []
    for i, record in enumerate(records):
        split = record.meta.get("split")
        if split is None:
            continue
        line = lines[i] if lines else None
        if split not in SPLITS:
            errors.append(FieldError(source, line, "meta.split", f"unknown split {split!r}; allowed: {', '.join(SPLITS)}"))
            continue
        group = record.group or record.id
        if declared.setdefault(group, split) != split:
            errors.append(
                FieldError(source, line, "meta.split", f"group {group!r} is declared in {declared[group]!r} and {split!r}; splits must be group-disjoint")
            )
    if errors:
        raise DataValidationError(errors)
    return declared


def records_from_objects(
    objects: Sequence[tuple[Any, int | None]],
    *,
    file: str,
    group_key: str = DEFAULT_GROUP_KEY,
    require_group: bool = False,
    require_labels: bool = True,
    token_budget: int | None = DEFAULT_TOKEN_BUDGET,
    count_tokens: Callable[[list[str]], list[int]] | None = None,
    errors: list[FieldError] | None = None,
) -> tuple[Record, ...]:
    """Validate decoded objects; raise :class:`DataValidationError` with every error found."""
    errors = [] if errors is None else errors
    pairs: list[tuple[Record, int | None]] = []
    for obj, line in track(objects, "validate records", unit="record"):
        record = parse_record(
            obj, file=file, line=line, group_key=group_key, require_group=require_group,
            require_labels=require_labels, errors=errors,
        )
        if record is not None:
            pairs.append((record, line))
    if not objects and not errors:
        errors.append(FieldError(file, None, "<file>", "empty file: no records"))
    check_duplicate_ids(((o.get("id") if isinstance(o, dict) else None, line) for o, line in objects), file, errors)
    try:  # meta.split: a known split, the same for a whole group; each error on its record's line
        declared_splits([r for r, _ in pairs], file, [line for _, line in pairs])
    except DataValidationError as exc:
        errors.extend(exc.errors)
    if token_budget is not None:
        if count_tokens is None:
            from envloop_pipelines.core.tokens import count_tokens as default_counter

            count_tokens = default_counter
        check_token_budget(pairs, file, errors, count_tokens, token_budget)
    if errors:
        raise DataValidationError(errors)
    return tuple(r for r, _ in pairs)


# --------------------------------------------------------------------------- the JSONL shape


def record_to_json(record: Record) -> dict[str, Any]:
    """The record in its JSONL shape (inverse of :func:`parse_record`)."""
    questions: dict[str, Any] = {}
    for q in record.questions:
        body: dict[str, Any] = {"type": q.type, "instructions": q.instructions}
        if q.criteria is not None:
            body["criteria"] = q.criteria
        if q.label is not None:
            body["label"] = q.label_value()
        if q.soft_label is not None:
            body["soft_label"] = {k: p for k, p in zip(q.option_keys, q.soft_label) if p > 0}
        questions[q.id] = body
    return {"id": record.id, "state": record.state, "questions": questions, "meta": dict(record.meta)}
