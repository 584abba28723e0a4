"""The clients people already have, installed from PyPI, pointed at the server by base URL only.

* ``typesafe-sdk`` (TypeSafe's official Python SDK): ``system_one`` parses every answer type,
  ``models.list()`` parses the Jev listing, API errors map to the SDK's exception classes.
* ``openai`` (OpenAI's official Python client): a chat completion whose logprobs carry the options.
"""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import httpx2
import openai
import pytest
from typesafe_sdk import (
    AsyncTypeSafeClient,
    Choice,
    ChoiceAnswer,
    Noul,
    NoulAnswer,
    RetryPolicy,
    Score,
    ScoreAnswer,
    TypeSafeAuthenticationError,
    TypeSafeClient,
    TypeSafeNotFoundError,
    TypeSafeUnprocessableEntityError,
)

from envloop_pipelines_tests.serve.conftest import API_KEY, OTHER_KEY
from envloop_pipelines.testing.serve import ServerProcess

pytestmark = pytest.mark.integration

STATE = "Hi, I was charged twice for my March invoice. Please refund one of the charges today!"
NO_RETRY = RetryPolicy(max_retries=0)


@pytest.fixture(scope="module")
def ts(server: ServerProcess):
    with TypeSafeClient(api_key=API_KEY, base_url=server.url, retry=NO_RETRY) as c:
        yield c


def _systemone(server: ServerProcess, body: dict) -> dict:
    r = httpx.post(f"{server.url}/v1/systemone", json=body, headers=server.headers(), timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


# --------------------------------------------------------------------------- typesafe-sdk


def test_typesafe_sdk_parses_every_answer_type(ts: TypeSafeClient, model_id: str) -> None:
    result = ts.system_one(
        state=STATE,
        questions={
            "urgent": Noul(instructions="Is this urgent?", criteria={"true": "must be handled today"}),
            "described": Noul(criteria={"false": "a routine question"}),
            "team": Choice(instructions="Which team?", criteria={"billing": "Charges and refunds", "tech": None, "sales": None}),
            "anger": Score(instructions="How angry is the customer?", criteria=["calm", "annoyed", {"level": "furious"}]),
            "raw_noul": {"type": "noul", "instructions": "Does the customer ask for a refund?"},
            "raw_choice": {"type": "choice", "instructions": "Language?", "criteria": {"en": None, "fr": None}},
        },
    )
    assert result.model == model_id
    assert result.request_id
    assert isinstance(result.usage.input_tokens, int) and result.usage.input_tokens > 0
    assert result.usage.output_tokens == 6
    assert set(result.nouls) == {"urgent", "described", "raw_noul"}
    assert set(result.choices) == {"team", "raw_choice"} and set(result.scores) == {"anger"}
    for a in result.nouls.values():
        assert isinstance(a, NoulAnswer) and 0 <= a.noul <= 1
    team = result.choices["team"]
    assert isinstance(team, ChoiceAnswer) and team.choice in ("billing", "tech", "sales")
    assert team.choice == max(team.probabilities, key=team.probabilities.get)
    assert sum(team.probabilities.values()) == pytest.approx(1.0)
    anger = result.scores["anger"]
    assert isinstance(anger, ScoreAnswer)
    assert anger.legend == {0: "calm", 1: "annoyed", 2: {"level": "furious"}}  # the SDK turns level keys into ints
    assert set(anger.probabilities) == {0, 1, 2}
    assert anger.score == pytest.approx(sum(i * p for i, p in anger.probabilities.items()))
    assert 0 <= anger.confidence <= 1
    raw = result.raw_http_response.json()  # our x_ fields ride along; the SDK ignores them
    assert isinstance(raw["answers"]["team"]["x_defer"], bool)


class _Recording(httpx2.HTTPTransport):
    """The SDK's own transport, remembering the headers it sent."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[httpx2.Headers] = []

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        self.sent.append(request.headers)
        return super().handle_request(request)


def test_typesafe_sdk_structured_state_unicode_and_255_options(server: ServerProcess) -> None:
    keys = [f"équipe-{i:03d}-🙂" for i in range(255)]
    transport = _Recording()
    with TypeSafeClient(api_key=API_KEY, base_url=server.url, retry=NO_RETRY, transport=transport) as ts:
        result = ts.system_one(
            state={"ticket": {"subject": "Doppelte Abbuchung", "messages": [{"text": "Zweimal belastet – bitte erstatten"}]}},
            questions={"route": Choice(instructions="Which queue handles `ticket.messages[0].text`?", criteria={k: None for k in keys})},
            model="jev-preview",
        )
    route = result.choices["route"]
    assert list(route.probabilities) == keys and route.choice in keys
    assert transport.sent[-1]["content-encoding"] == "zstd"  # the SDK compresses bodies over 1 KiB; the server reads them


def test_typesafe_sdk_lists_models(ts: TypeSafeClient, model_id: str) -> None:
    names = [m.name for m in ts.models.list().models]
    assert names == [model_id, "jev-latest", "jev-preview"]


def test_typesafe_sdk_errors_map_to_its_exceptions(server: ServerProcess, ts: TypeSafeClient) -> None:
    with TypeSafeClient(api_key="not-a-key", base_url=server.url, retry=NO_RETRY) as bad:
        with pytest.raises(TypeSafeAuthenticationError) as auth:
            bad.system_one(state="s", questions={"q": Noul(instructions="?")})
    assert auth.value.status == 401 and auth.value.request_id
    with pytest.raises(TypeSafeUnprocessableEntityError) as invalid:
        ts.system_one(state="s", questions={"q": {"type": "score", "criteria": {"low": "a", "high": "b"}}})
    assert "object map" in str(invalid.value)
    with pytest.raises(TypeSafeNotFoundError):
        ts.system_one(state="s", questions={"q": Noul(instructions="?")}, model="jev-ultra")


def test_async_typesafe_sdk_concurrent_calls_keep_their_answers(server: ServerProcess) -> None:
    async def main() -> list:
        async with AsyncTypeSafeClient(api_key=OTHER_KEY, base_url=server.url, retry=NO_RETRY) as c:
            return await asyncio.gather(*(
                c.system_one(state=f"Ticket {i}: please help with order {i}",
                             questions={f"q{i}": Choice(instructions="Which tag?", criteria={f"tag{i}-a": None, f"tag{i}-b": None})})
                for i in range(12)
            ))

    for i, result in enumerate(asyncio.run(main())):
        assert list(result.answers) == [f"q{i}"]
        assert set(result.choices[f"q{i}"].probabilities) == {f"tag{i}-a", f"tag{i}-b"}


# --------------------------------------------------------------------------- openai


@pytest.fixture(scope="module")
def oa(server: ServerProcess):
    with openai.OpenAI(api_key=API_KEY, base_url=f"{server.url}/v1", max_retries=0) as c:
        yield c


PLAIN_CHAT = """Which team should handle this ticket?
- billing: Charges and refunds
- tech: Bugs and outages
- sales
State:
Hi, I was charged twice for my March invoice. Please refund one of the charges today!"""


def test_openai_chat_completion_carries_option_logprobs(server: ServerProcess, oa: openai.OpenAI, model_id: str) -> None:
    resp = oa.chat.completions.create(
        model="jev-latest",
        messages=[{"role": "system", "content": "You route tickets."}, {"role": "user", "content": PLAIN_CHAT}],
        logprobs=True,
        top_logprobs=2,
    )
    assert resp.model == model_id and resp.object == "chat.completion"
    choice = resp.choices[0]
    assert choice.finish_reason == "stop" and choice.message.role == "assistant"
    assert choice.message.content in ("billing", "tech", "sales")
    token = choice.logprobs.content[0]
    assert token.token == choice.message.content and token.bytes == list(token.token.encode())
    top = token.top_logprobs
    assert len(top) == 2 and top[0].token == choice.message.content and top[0].logprob >= top[1].logprob
    assert resp.usage.prompt_tokens > 0 and resp.usage.completion_tokens == 1

    # the same question through the Jev API gives the same probabilities
    jev = _systemone(server, {"model": "jev-latest", "state": STATE, "questions": {"team": {
        "type": "choice", "instructions": "Which team should handle this ticket?",
        "criteria": {"billing": "Charges and refunds", "tech": "Bugs and outages", "sales": None}}}})
    probs = jev["answers"]["team"]["probabilities"]
    for t in top:
        assert math.exp(t.logprob) == pytest.approx(probs[t.token], abs=1e-5)


def test_openai_chat_with_a_jev_json_body_lists_every_option(oa: openai.OpenAI) -> None:
    body = {"state": {"customer": "Lena", "text": "Third time I write. Nothing works!!"},
            "questions": {"anger": {"type": "score", "instructions": "How angry?", "criteria": ["calm", "annoyed", "furious", "livid"]}}}
    resp = oa.chat.completions.create(model="jev-preview", messages=[{"role": "user", "content": json.dumps(body)}], logprobs=True)
    content = resp.choices[0].message.content
    top = resp.choices[0].logprobs.content[0].top_logprobs
    assert content in ("0", "1", "2", "3")
    assert sorted(t.token for t in top) == ["0", "1", "2", "3"]  # no top_logprobs: every option
    assert sum(math.exp(t.logprob) for t in top) == pytest.approx(1.0, abs=1e-6)
    extra = resp.model_extra or {}
    assert extra["x_answer"]["type"] == "score" and set(extra["x_answer"]["legend"]) == {"0", "1", "2", "3"}


def test_openai_noul_without_logprobs(oa: openai.OpenAI) -> None:
    resp = oa.chat.completions.create(model="jev-latest", messages=[{"role": "user", "content": "Is this spam?\nState:\nWIN A PRIZE NOW"}])
    assert resp.choices[0].message.content in ("true", "false") and resp.choices[0].logprobs is None


def test_openai_client_under_the_openai_prefix_lists_models_and_chats(server: ServerProcess, model_id: str) -> None:
    with openai.OpenAI(api_key=API_KEY, base_url=f"{server.url}/openai/v1", max_retries=0) as c:
        assert [m.id for m in c.models.list()] == [model_id, "jev-latest", "jev-preview"]
        assert c.models.retrieve("jev-latest").id == "jev-latest"
        resp = c.chat.completions.create(model=model_id, messages=[{"role": "user", "content": PLAIN_CHAT}], logprobs=True, top_logprobs=3)
        assert len(resp.choices[0].logprobs.content[0].top_logprobs) == 3


def test_openai_errors_map_to_its_exceptions(server: ServerProcess, oa: openai.OpenAI) -> None:
    with openai.OpenAI(api_key="wrong", base_url=f"{server.url}/v1", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.chat.completions.create(model="jev-latest", messages=[{"role": "user", "content": "Is it urgent?"}])
    with pytest.raises(openai.UnprocessableEntityError) as invalid:
        oa.chat.completions.create(model="jev-latest", messages=[{"role": "user", "content": "Pick one\n- only"}])
    assert "2 to 255 options" in str(invalid.value)
    with pytest.raises(openai.NotFoundError):
        oa.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "Is it urgent?"}])
