"""Request and response models of the Jev API and the OpenAI-compatible chat, and question → model input.

Validation is pydantic's; the *criteria* rules are the data format's own
(:func:`envloop_pipelines.core.data.records.parse_options`), called from the
validators here, so a question that a decision-record file accepts is exactly a
question the server accepts, with the same option order and the same messages:

* noul criteria are optional: omitted, ``null``, one side or both
  (``{"true": ..., "false": ...}``); the options are ``("true", "false")``.
* choice criteria map option → description or ``null`` (an array of option
  names is accepted too); 2 to 255 options; duplicate keys are an error (the
  body is decoded with :func:`~envloop_pipelines.core.data.json_text.decode_json`,
  which remembers them).
* score criteria are an ordered array of 2 to 10 levels, lowest first; an
  object map is an error. The option keys are ``"0"``, ``"1"``, ...

Question ids never reach the model: :func:`served_request` gives the model
positional ids (``q0``, ``q1``, ...) and a constant record id, and the model's
input (state, instructions, options) carries no id at all, so renaming, adding
or reordering questions cannot change an answer.

Chat (``POST /v1/chat/completions``): the *last user message* holds one
question, either

(a) a JSON object in the Jev request shape with exactly one question
    (``{"state": ..., "questions": {"<id>": {...}}}``; its ``model`` is ignored), or
(b) plain text::

        Type: choice                      (optional first line: noul | choice | score; default:
                                           noul without options or with only "true"/"false" ones,
                                           else choice)
        Which team should handle this?    (instructions: every line that is not an option or the state)
        - billing: Charges and refunds    (an option: "- key: description" or "- key")
        - other
        State:                            (optional: everything after it is the state;
        I was charged twice.               text on the "State:" line itself counts too)

    Score levels are listed lowest first as ``- <level description>``. For noul,
    ``- true: <description>`` / ``- false: <description>`` describe the sides.
    Without a ``State:`` block the state is empty.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from envloop_pipelines.core.model.readout import QuestionInput
from envloop_pipelines.core.data.json_text import decode_json, render_value
from envloop_pipelines.core.data.records import (
    MAX_CHOICE_OPTIONS,
    MAX_SCORE_LEVELS,
    MIN_CHOICE_OPTIONS,
    MIN_SCORE_LEVELS,
    parse_options,
)

_CONTENT_TYPES = Union[str, dict[str, Any], list[Any]]


def _content(value: Any) -> Any:
    if isinstance(value, (str, dict, list)):
        return value
    raise PydanticCustomError("content_type", "must be a string, an object or an array, got {got}", {"got": type(value).__name__})


#: A state, instruction or criterion: text, a JSON object or a JSON array (one error message for all three).
Content = Annotated[_CONTENT_TYPES, PlainValidator(_content, json_schema_input_type=_CONTENT_TYPES)]

#: The record id every served question carries (question ids never reach the model).
SERVED_RECORD_ID = "request"

#: Deepest JSON nesting accepted: rendering and validation recurse, and Python's stack is finite.
MAX_JSON_DEPTH = 128


def nesting_within(value: Any, limit: int) -> bool:
    """Whether ``value`` nests at most ``limit`` objects/arrays deep (checked without recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > limit:
            return False
        stack.extend((child, depth + 1) for child in children)
    return True


def _options(qtype: str, criteria: Any) -> tuple[tuple[str, ...], tuple[str | None, ...]]:
    """Options of a question by the data format's rules; raises PydanticCustomError with its message."""
    problems: list[str] = []
    descriptions: list[tuple[Any, Any]] = []
    if isinstance(criteria, dict):
        descriptions = list(criteria.items())
    elif isinstance(criteria, list) and qtype == "score":
        descriptions = list(enumerate(criteria))
    for key, desc in descriptions:
        if not (desc is None and qtype != "score") and not isinstance(desc, (str, dict, list)):
            allowed = "text, an object or an array" + ("" if qtype == "score" else ", or null")
            raise PydanticCustomError(
                "criteria_invalid", "{reason}", {"reason": f"criteria[{key!r}] must be {allowed}, got {type(desc).__name__}"}
            )
    parsed = parse_options(qtype, criteria, lambda _field, message: problems.append(message), "criteria")
    if parsed is None:
        raise PydanticCustomError("criteria_invalid", "{reason}", {"reason": "; ".join(problems) or "invalid criteria"})
    return parsed


def _criteria(qtype: str, schema_type: Any) -> PlainValidator:
    """The criteria validator of one question type: the data format's rules, one message per problem."""

    def check(value: Any) -> Any:
        _options(qtype, value)
        return value

    return PlainValidator(check, json_schema_input_type=schema_type)


# --------------------------------------------------------------------------- Jev request


class _Question(BaseModel):
    model_config = ConfigDict(extra="forbid")
    QTYPE: ClassVar[str] = ""

    instructions: Content | None = Field(
        None, description="What to decide; text, an object or an array (may point into the state with `backticked.paths`)."
    )

    def options(self) -> tuple[tuple[str, ...], tuple[str | None, ...]]:
        """``(option_keys, option_texts)`` in the question's order."""
        return _options(self.QTYPE, getattr(self, "criteria"))


class NoulQuestion(_Question):
    """A yes/no question; the answer is P(true)."""

    QTYPE: ClassVar[str] = "noul"
    type: Literal["noul"]
    criteria: Annotated[Any, _criteria("noul", dict[str, _CONTENT_TYPES | None] | None)] = Field(
        None, description="Optional descriptions of the sides: {'true': ..., 'false': ...}, one side, or null."
    )

    @model_validator(mode="after")
    def _something_to_decide(self) -> "NoulQuestion":
        described = isinstance(self.criteria, dict) and any(v is not None for v in self.criteria.values())
        if self.instructions in (None, "", [], {}) and not described:
            raise PydanticCustomError(
                "noul_empty", "a noul question needs instructions or a description of at least one side in criteria"
            )
        return self


class ChoiceQuestion(_Question):
    """One of 2 to 255 named options."""

    QTYPE: ClassVar[str] = "choice"
    type: Literal["choice"]
    criteria: Annotated[Any, _criteria("choice", dict[str, _CONTENT_TYPES | None] | list[str])] = Field(
        ..., description=f"Option → description or null ({MIN_CHOICE_OPTIONS} to {MAX_CHOICE_OPTIONS} options)."
    )


class ScoreQuestion(_Question):
    """An ordered scale of 2 to 10 levels, lowest first."""

    QTYPE: ClassVar[str] = "score"
    type: Literal["score"]
    criteria: Annotated[Any, _criteria("score", list[_CONTENT_TYPES])] = Field(
        ..., description=f"Ordered levels, lowest first ({MIN_SCORE_LEVELS} to {MAX_SCORE_LEVELS}); an object map is an error."
    )


Question = Annotated[Union[NoulQuestion, ChoiceQuestion, ScoreQuestion], Field(discriminator="type")]


class SystemOneRequest(BaseModel):
    """``POST /v1/systemone``: typed questions about one state."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(..., description="jev-latest, jev-preview, or the server's versioned model id.")
    state: Content = Field(..., description="What the questions are about: text, an object or an array.")
    questions: dict[str, Question] = Field(..., min_length=1, description="Questions keyed by ids of your choosing.")
    assets: Any = Field(None, description="Not supported: this server answers about text and JSON states only.")

    @field_validator("questions", mode="before")
    @classmethod
    def _no_duplicate_ids(cls, value: Any) -> Any:
        dupes = getattr(value, "duplicate_keys", ())
        if dupes:
            raise PydanticCustomError("duplicate_question_ids", "duplicate question ids {ids}", {"ids": list(dupes)})
        return value

    @field_validator("assets", mode="before")
    @classmethod
    def _no_assets(cls, value: Any) -> Any:
        if value is not None:
            raise PydanticCustomError(
                "assets_unsupported", "image assets are not supported: this server serves a text decision model"
            )
        return value


# --------------------------------------------------------------------------- what the model reads


@dataclass(frozen=True)
class ServedQuestion:
    """One question of a request, as the server keeps it (the client's id stays here, never in the model input)."""

    id: str
    type: str
    option_keys: tuple[str, ...]
    option_texts: tuple[str | None, ...]
    #: Score levels as sent (echoed in ``legend``); None for noul/choice.
    levels: tuple[Any, ...] | None
    instructions_text: str

    @property
    def budget_text(self) -> str:
        """The question's text for the token budget (instructions, then each option key and description)."""
        opts = " ".join(k + " " + (t or "") for k, t in zip(self.option_keys, self.option_texts))
        return f"{self.instructions_text} {opts}"


@dataclass(frozen=True)
class ServedRequest:
    """A validated request: its state text, its questions in request order, and the model inputs."""

    state_text: str
    questions: tuple[ServedQuestion, ...]
    inputs: tuple[QuestionInput, ...]


def served_request(request: SystemOneRequest) -> ServedRequest:
    """The request's questions and their model inputs, with positional ids in place of the client's."""
    state_text = render_value(request.state)
    served: list[ServedQuestion] = []
    inputs: list[QuestionInput] = []
    for i, (qid, q) in enumerate(request.questions.items()):
        keys, texts = q.options()
        instructions = render_value(q.instructions)
        served.append(
            ServedQuestion(
                id=qid,
                type=q.type,
                option_keys=keys,
                option_texts=texts,
                levels=tuple(q.criteria) if q.type == "score" else None,
                instructions_text=instructions,
            )
        )
        inputs.append(
            QuestionInput(
                record_id=SERVED_RECORD_ID,
                question_id=f"q{i}",
                type=q.type,
                family=q.type,
                state_text=state_text,
                instructions_text=instructions,
                option_keys=keys,
                option_texts=texts,
            )
        )
    return ServedRequest(state_text=state_text, questions=tuple(served), inputs=tuple(inputs))


# --------------------------------------------------------------------------- errors


def validation_details(error: ValidationError, prefix: tuple[str | int, ...] = ("body",)) -> list[dict[str, Any]]:
    """Pydantic errors as the contract's ``detail`` list: ``loc`` (prefixed), ``msg``, ``type`` (and a JSON-safe ``ctx``)."""
    out = []
    for e in error.errors(include_url=False, include_input=False):
        item: dict[str, Any] = {"loc": [*prefix, *e["loc"]], "msg": e["msg"], "type": e["type"]}
        ctx = e.get("ctx")
        if ctx:
            try:
                json.dumps(ctx)
                item["ctx"] = ctx
            except (TypeError, ValueError):
                item["ctx"] = {k: str(v) for k, v in ctx.items()}
        out.append(item)
    return out


class RequestValidationFailed(Exception):
    """A request failed validation; ``details`` is the contract's 422 ``detail`` list."""

    def __init__(self, details: list[dict[str, Any]]) -> None:
        super().__init__("; ".join(f"{'.'.join(map(str, d['loc']))}: {d['msg']}" for d in details))
        self.details = details


def parse_systemone(body: Any, *, prefix: tuple[str | int, ...] = ("body",)) -> SystemOneRequest:
    """Validate a decoded body (from :func:`decode_json`).

    Raises:
        RequestValidationFailed: with the contract's 422 details.
    """
    try:
        return SystemOneRequest.model_validate(body)
    except ValidationError as exc:
        raise RequestValidationFailed(validation_details(exc, prefix)) from None


# --------------------------------------------------------------------------- OpenAI-compatible chat


class ChatMessage(BaseModel):
    """One chat message; ``content`` is text or a list of parts (``{"type": "text", "text": ...}``)."""

    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise PydanticCustomError("content_part_unsupported", "only text content parts are supported")
            parts.append(part["text"])
        return "\n".join(parts)


class ChatCompletionRequest(BaseModel):
    """``POST /v1/chat/completions``: the fields that matter here; other OpenAI fields are accepted and ignored."""

    model_config = ConfigDict(extra="ignore")

    model: str
    messages: list[ChatMessage] = Field(..., min_length=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_CHOICE_OPTIONS)
    n: int | None = Field(None, ge=1, le=1, description="Only one choice: a decision has one answer.")
    stream: bool | None = Field(None, description="Not supported (a decision is one token).")

    @field_validator("stream")
    @classmethod
    def _no_stream(cls, value: bool | None) -> bool | None:
        if value:
            raise PydanticCustomError("stream_unsupported", "stream=true is not supported: the answer is a single option")
        return value

    def last_user_message(self) -> tuple[int, ChatMessage]:
        for i in range(len(self.messages) - 1, -1, -1):
            if self.messages[i].role == "user":
                return i, self.messages[i]
        raise RequestValidationFailed(
            [{"loc": ["body", "messages"], "msg": "no user message: the last user message holds the question", "type": "value_error"}]
        )


_TYPE_LINE = re.compile(r"^\s*type\s*:\s*(noul|choice|score)\s*$", re.IGNORECASE)
_STATE_LINE = re.compile(r"^\s*state\s*:(.*)$", re.IGNORECASE | re.DOTALL)
_OPTIONS_LINE = re.compile(r"^\s*options\s*:\s*$", re.IGNORECASE)


def plain_text_question(text: str) -> dict[str, Any]:
    """The plain-text chat format (module docstring) as a Jev request body with one question ``"q"``."""
    qtype: str | None = None
    instructions: list[str] = []
    options: list[str] = []
    state: list[str] | None = None
    for n, line in enumerate(text.splitlines()):
        if state is not None:
            state.append(line)
            continue
        stripped = line.strip()
        if qtype is None and not instructions and not options and _TYPE_LINE.match(line):
            qtype = _TYPE_LINE.match(line).group(1).lower()  # type: ignore[union-attr]
        elif (m := _STATE_LINE.match(line)) is not None:
            state = [m.group(1).strip()] if m.group(1).strip() else []
        elif _OPTIONS_LINE.match(line):
            continue
        elif stripped.startswith("- ") or stripped == "-":
            options.append(stripped[2:].strip())
        else:
            instructions.append(line)
    if qtype is None:
        named = {opt.partition(": ")[0].strip().removesuffix(":") for opt in options}
        qtype = "noul" if not options or named <= {"true", "false"} else "choice"
    body: dict[str, Any] = {"type": qtype, "instructions": "\n".join(instructions).strip()}
    if qtype == "score":
        body["criteria"] = options
    elif qtype == "choice":
        criteria: dict[str, Any] = {}
        dupes = []
        for opt in options:
            key, _, desc = opt.partition(": ")
            key = key.strip().removesuffix(":")
            if key in criteria:
                dupes.append(key)
            criteria[key] = desc.strip() or None
        if dupes:
            raise RequestValidationFailed(
                [{"loc": ["body", "messages", "content"], "msg": f"duplicate option keys {dupes!r}", "type": "value_error"}]
            )
        body["criteria"] = criteria
    elif options:
        sides: dict[str, Any] = {}
        for opt in options:
            key, _, desc = opt.partition(": ")
            sides[key.strip().removesuffix(":")] = desc.strip() or None
        body["criteria"] = sides
    return {"state": "\n".join(state).strip() if state is not None else "", "questions": {"q": body}}


def chat_question(request: ChatCompletionRequest) -> tuple[SystemOneRequest, str]:
    """The one question a chat request asks, as a validated Jev request, and its question id.

    Raises:
        RequestValidationFailed: the message is neither a valid JSON Jev body with one question nor the plain-text format.
    """
    index, message = request.last_user_message()
    prefix: tuple[str | int, ...] = ("body", "messages", index, "content")
    try:
        text = message.text()
    except PydanticCustomError as exc:
        raise RequestValidationFailed([{"loc": list(prefix), "msg": exc.message(), "type": exc.type}]) from None
    stripped = text.strip()
    body: Any = None
    if stripped.startswith("{"):
        try:
            body = decode_json(stripped)
        except json.JSONDecodeError as exc:
            raise RequestValidationFailed(
                [{"loc": [*prefix, exc.pos], "msg": f"JSON decode error: {exc.msg}", "type": "json_invalid"}]
            ) from None
        except (ValueError, RecursionError) as exc:
            raise RequestValidationFailed([{"loc": list(prefix), "msg": f"JSON decode error: {exc}", "type": "json_invalid"}]) from None
        if not nesting_within(body, MAX_JSON_DEPTH):
            raise RequestValidationFailed(
                [{"loc": list(prefix), "msg": f"JSON nested deeper than {MAX_JSON_DEPTH} levels", "type": "json_too_deep"}]
            )
        if not isinstance(body, dict):
            raise RequestValidationFailed([{"loc": list(prefix), "msg": "expected a JSON object", "type": "dict_type"}])
        body = dict(body)
        if isinstance(body.get("questions"), dict) and len(body["questions"]) != 1:
            raise RequestValidationFailed(
                [{"loc": [*prefix, "questions"], "msg": f"a chat completion asks exactly one question, got {len(body['questions'])}",
                  "type": "value_error"}]
            )
    else:
        body = plain_text_question(text)
    body["model"] = request.model
    parsed = parse_systemone(body, prefix=prefix)
    return parsed, next(iter(parsed.questions))


__all__ = [
    "MAX_JSON_DEPTH",
    "ChatCompletionRequest",
    "ChatMessage",
    "ChoiceQuestion",
    "Content",
    "NoulQuestion",
    "Question",
    "RequestValidationFailed",
    "SERVED_RECORD_ID",
    "ScoreQuestion",
    "ServedQuestion",
    "ServedRequest",
    "SystemOneRequest",
    "chat_question",
    "nesting_within",
    "parse_systemone",
    "plain_text_question",
    "served_request",
    "validation_details",
]
