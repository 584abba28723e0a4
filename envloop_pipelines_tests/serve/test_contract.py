"""The Jev API contract (``docs/jev-api.md``), point by point, against the server running as a real process."""

from __future__ import annotations

import asyncio
import gzip
import json
import re

import httpx
import numpy as np
import pytest
from backports.zstd import compress as zstd_compress  # typesafe-sdk[zstd]: what the SDK compresses with

from envloop_pipelines.core.serve.answers import choice_confidence, expected_score, score_confidence
from envloop_pipelines.core.serve.schemas import plain_text_question
from envloop_pipelines_tests.serve.conftest import API_KEY, MAX_BODY_BYTES
from envloop_pipelines.testing.serve import ServerProcess, benchmark_records, jev_request

pytestmark = pytest.mark.integration

CONTRACT_EXAMPLE = {
    "model": "jev-latest",
    "state": "I was charged twice for my subscription and nobody answers my emails!",
    "questions": {
        "urgent": {"type": "noul", "instructions": "Is this urgent?", "criteria": {"true": "needs action today", "false": "can wait"}},
        "team": {"type": "choice", "instructions": "Which team should handle it?",
                 "criteria": {"billing": "Charges and refunds", "other": None}},
        "anger": {"type": "score", "instructions": "How angry is the customer?", "criteria": ["calm", "annoyed", "furious"]},
    },
}


def _post(client: httpx.Client, body: dict, **kw) -> httpx.Response:
    return client.post("/v1/systemone", json=body, **kw)


def _ok(client: httpx.Client, body: dict) -> dict:
    r = _post(client, body)
    assert r.status_code == 200, r.text
    return r.json()


def _probs(answer: dict) -> list[float]:
    if answer["type"] == "noul":
        return [answer["noul"], 1 - answer["noul"]]
    return list(answer["probabilities"].values())


def _jev_fields(answer: dict) -> set[str]:
    return {k for k in answer if not k.startswith("x_")}


# --------------------------------------------------------------------------- formulas (no server)


def test_confidence_formulas_reproduce_the_contract_examples() -> None:
    assert choice_confidence([0.88, 0.12]) == pytest.approx(0.76)
    assert score_confidence([0.0, 0.95, 0.05]) == pytest.approx(0.925)
    assert expected_score([0.0, 0.95, 0.05]) == pytest.approx(1.05)
    assert choice_confidence([0.25] * 4) == pytest.approx(0.0)
    assert choice_confidence([1.0, 0.0, 0.0]) == pytest.approx(1.0)
    assert score_confidence([0.2] * 5) == pytest.approx(0.0)
    assert score_confidence([0, 0, 1.0, 0]) == pytest.approx(1.0)
    # mode 0 of 4 levels: MAD_uniform = (1.5+0.5+0.5+1.5)/4 = 1.0 (about the centre 1.5); spread = 0.1*1 + 0.1*3 = 0.4
    assert score_confidence([0.8, 0.1, 0.0, 0.1]) == pytest.approx(1 - 0.4 / 1.0)


def test_plain_text_chat_format_parses_each_type() -> None:
    body = plain_text_question("Which team?\n- billing: Charges and refunds\n- other\nState:\nI was charged twice.\nTwice!")
    assert body == {"state": "I was charged twice.\nTwice!", "questions": {"q": {
        "type": "choice", "instructions": "Which team?", "criteria": {"billing": "Charges and refunds", "other": None}}}}
    score = plain_text_question("Type: score\nHow angry?\n- calm\n- furious: very\nState: fine")
    assert score["questions"]["q"]["criteria"] == ["calm", "furious: very"] and score["state"] == "fine"
    noul = plain_text_question("Is it urgent?\n- true: today")
    assert noul["questions"]["q"] == {"type": "noul", "instructions": "Is it urgent?", "criteria": {"true": "today"}}
    assert plain_text_question("Is it urgent?")["questions"]["q"]["type"] == "noul"


# --------------------------------------------------------------------------- answers


def test_each_answer_type_follows_the_contract(client: httpx.Client, model_id: str) -> None:
    r = _post(client, CONTRACT_EXAMPLE)
    assert r.status_code == 200, r.text
    assert r.headers["x-typesafe-request-id"]
    out = r.json()
    assert out["model"] == model_id
    assert set(out["answers"]) == {"urgent", "team", "anger"}
    assert isinstance(out["usage"]["input_tokens"], int) and out["usage"]["input_tokens"] > 0
    assert out["usage"]["output_tokens"] == 3
    threshold = out["x_automation_threshold"]

    urgent = out["answers"]["urgent"]
    assert _jev_fields(urgent) == {"type", "noul"} and urgent["type"] == "noul"
    assert 0.0 <= urgent["noul"] <= 1.0

    team = out["answers"]["team"]
    assert _jev_fields(team) == {"type", "choice", "probabilities", "confidence"}
    assert list(team["probabilities"]) == ["billing", "other"]
    p = np.array(list(team["probabilities"].values()))
    assert np.all(np.isfinite(p)) and p.sum() == pytest.approx(1.0, abs=1e-9)
    assert team["choice"] == ["billing", "other"][int(np.argmax(p))]
    assert team["confidence"] == pytest.approx((p.max() - 0.5) / 0.5)

    anger = out["answers"]["anger"]
    assert _jev_fields(anger) == {"type", "score", "legend", "probabilities", "confidence"}
    assert anger["legend"] == {"0": "calm", "1": "annoyed", "2": "furious"}
    q = np.array([anger["probabilities"][k] for k in ("0", "1", "2")])
    assert q.sum() == pytest.approx(1.0, abs=1e-9)
    assert anger["score"] == pytest.approx(float(np.dot([0, 1, 2], q)))
    mode = int(np.argmax(q))
    mad_uniform = np.mean(np.abs(np.arange(3) - 1.0))  # the uniform distribution's MAD about its centre, level 1
    assert anger["confidence"] == pytest.approx(max(0.0, 1 - float(np.dot(q, np.abs(np.arange(3) - mode))) / mad_uniform))

    for a in out["answers"].values():  # the automation decision: defer below the release's threshold
        top = max(_probs(a))
        assert a["x_defer"] is (threshold is None or top < threshold)
        assert isinstance(a["x_truncated"], bool)


def test_state_instructions_and_criteria_in_every_form(client: httpx.Client) -> None:
    states = [
        "A customer writes: I was charged twice.",
        {"ticket": {"subject": "Double charge", "messages": [{"from": "customer", "text": "I was charged twice."}]}},
        [{"role": "customer", "text": "I was charged twice."}, {"role": "agent", "text": "Looking into it."}],
    ]
    instructions = [
        "Is `ticket.messages[0].text` about money?",
        {"task": "Decide whether the customer talks about money", "look_at": "ticket.messages[0].text"},
        ["Is this about money?", "Answer for the first message."],
    ]
    for state in states:
        for instr in instructions:
            body = {"model": "jev-latest", "state": state, "questions": {
                "n": {"type": "noul", "instructions": instr},
                "c": {"type": "choice", "instructions": instr, "criteria": {
                    "billing": {"covers": ["refunds", "charges"]}, "shipping": ["parcels", "delays"], "other": None, "tech": "Bugs"}},
                "s": {"type": "score", "instructions": instr, "criteria": ["none", {"level": "some"}, ["a", "lot"]]},
            }}
            out = _ok(client, body)["answers"]
            assert out["n"]["type"] == "noul"
            assert list(out["c"]["probabilities"]) == ["billing", "shipping", "other", "tech"]
            assert out["s"]["legend"] == {"0": "none", "1": {"level": "some"}, "2": ["a", "lot"]}


@pytest.mark.parametrize("criteria", [
    "omitted", None, {"true": "needs action today"}, {"false": "can wait"}, {"true": "today", "false": "later"},
    {"true": None, "false": None},
])
def test_noul_criteria_forms_answer_only_noul(client: httpx.Client, criteria: object) -> None:
    q: dict = {"type": "noul", "instructions": "Is this urgent?"}
    if criteria != "omitted":
        q["criteria"] = criteria
    out = _ok(client, {"model": "jev-latest", "state": "Server down for all users", "questions": {"u": q}})
    answer = out["answers"]["u"]
    assert _jev_fields(answer) == {"type", "noul"} and 0 <= answer["noul"] <= 1


def test_choice_accepts_2_to_255_options(client: httpx.Client) -> None:
    two = _ok(client, {"model": "jev-latest", "state": "s", "questions": {
        "q": {"type": "choice", "instructions": "Pick", "criteria": {"yes": None, "no": None}}}})
    assert set(two["answers"]["q"]["probabilities"]) == {"yes", "no"}

    keys = [f"team_{i:03d}" for i in range(255)]
    criteria = {k: (f"queue number {i}" if i % 3 else None) for i, k in enumerate(keys)}
    out = _ok(client, {"model": "jev-latest", "state": "Route this ticket about refunds.", "questions": {
        "route": {"type": "choice", "instructions": "Which queue?", "criteria": criteria}}})
    a = out["answers"]["route"]
    assert list(a["probabilities"]) == keys
    p = np.array(list(a["probabilities"].values()))
    assert p.sum() == pytest.approx(1.0, abs=1e-9) and np.all(p > 0)
    assert a["choice"] == keys[int(np.argmax(p))]
    assert a["confidence"] == pytest.approx((p.max() - 1 / 255) / (1 - 1 / 255))
    assert a["x_option_windows"] > 1  # 255 options cannot share one 128-token window

    for n in (1, 256):
        r = _post(client, {"model": "jev-latest", "state": "s", "questions": {
            "q": {"type": "choice", "criteria": {f"o{i}": None for i in range(n)}}}})
        assert r.status_code == 422, r.text
        assert f"got {n}" in r.json()["detail"][0]["msg"]


@pytest.mark.parametrize("levels", [2, 10])
def test_score_accepts_2_to_10_levels(client: httpx.Client, levels: int) -> None:
    criteria = [f"level {i}" for i in range(levels)]
    a = _ok(client, {"model": "jev-latest", "state": "s", "questions": {
        "q": {"type": "score", "instructions": "Rate", "criteria": criteria}}})["answers"]["q"]
    assert list(a["probabilities"]) == [str(i) for i in range(levels)]
    assert a["legend"] == {str(i): c for i, c in enumerate(criteria)}
    assert 0 <= a["score"] <= levels - 1


@pytest.mark.parametrize("criteria, fragment", [
    (["only"], "got 1"),
    ([f"l{i}" for i in range(11)], "got 11"),
    ({"low": "calm", "high": "angry"}, "not an object map"),
])
def test_score_level_errors(client: httpx.Client, criteria: object, fragment: str) -> None:
    r = _post(client, {"model": "jev-latest", "state": "s", "questions": {"q": {"type": "score", "criteria": criteria}}})
    assert r.status_code == 422
    detail = r.json()["detail"]
    assert detail[0]["loc"] == ["body", "questions", "q", "score", "criteria"] and fragment in detail[0]["msg"]


def test_question_ids_never_reach_the_model(client: httpx.Client) -> None:
    record = benchmark_records(n_users=1, records_per_user=3)[2]
    base = CONTRACT_EXAMPLE | {"state": record["state"]}
    questions = list(base["questions"].items())
    reference = _ok(client, base)["answers"]

    renamed = base | {"questions": {f"zz-{i}-{qid[::-1]}": q for i, (qid, q) in enumerate(questions)}}
    reordered = base | {"questions": dict(reversed(questions))}
    added = base | {"questions": {"extra1": {"type": "noul", "instructions": "Is it Monday?"}, **dict(questions),
                                  "extra2": {"type": "score", "instructions": "How long?", "criteria": ["short", "long"]}}}
    out_renamed = _ok(client, renamed)["answers"]
    out_reordered = _ok(client, reordered)["answers"]
    out_added = _ok(client, added)["answers"]
    for i, (qid, _) in enumerate(questions):
        ref = _probs(reference[qid])
        for other in (out_renamed[f"zz-{i}-{qid[::-1]}"], out_reordered[qid], out_added[qid]):
            # "beyond the server's own repeat noise": float rounding of differently padded batches (~1e-7)
            assert _probs(other) == pytest.approx(ref, abs=1e-5)
    assert list(out_reordered) == [qid for qid, _ in reversed(questions)]  # answers keyed as asked


def test_unicode_round_trips_byte_for_byte(client: httpx.Client) -> None:
    keys = ["café", "cafe\u0301", "日本語", "🙂 smile", "ключ", 'quote " and \\ backslash', "tab\there", "Ω≈ç√"]
    qid = "ユニコード-🙂"
    body = {"model": "jev-latest", "state": {"текст": "Ünïcödé state ✓"}, "questions": {
        qid: {"type": "choice", "instructions": "Which one? 選んで", "criteria": {k: None for k in keys}},
        "lvl": {"type": "score", "instructions": "Rate", "criteria": ["niedrig ↓", "hoch ↑"]},
    }}
    r = _post(client, body)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("application/json")
    out = json.loads(r.content.decode("utf-8"))
    back = list(out["answers"][qid]["probabilities"])
    assert [k.encode("utf-8") for k in back] == [k.encode("utf-8") for k in keys]  # NFC and NFD "café" stay distinct
    assert out["answers"][qid]["choice"] in keys
    assert out["answers"]["lvl"]["legend"] == {"0": "niedrig ↓", "1": "hoch ↑"}
    for k in ("café", "日本語", "🙂 smile"):
        assert json.dumps(k, ensure_ascii=False)[1:-1].encode("utf-8") in r.content  # sent as UTF-8, not \u-escaped


def test_token_budget_is_enforced_with_tokens_exceeded(client: httpx.Client) -> None:
    q = {"type": "noul", "instructions": "Is this urgent?"}
    over_state = _post(client, {"model": "jev-latest", "state": "word " * 33_000, "questions": {"u": q}})
    assert over_state.status_code == 400, over_state.text
    detail = over_state.json()["detail"]
    assert detail["error_type"] == "tokens_exceeded" and "32768" in detail["message"]

    # each question 14k tokens: state + longest ≈ 14k (under 32k), the request ≈ 70k (over 64k)
    many = {f"q{i}": {"type": "noul", "instructions": "word " * 14_000} for i in range(5)}
    over_total = _post(client, {"model": "jev-latest", "state": "short", "questions": many})
    assert over_total.status_code == 400
    assert over_total.json()["detail"]["error_type"] == "tokens_exceeded" and "65536" in over_total.json()["detail"]["message"]

    # within budget, but the instructions alone are longer than the model's window: refused, not cut
    wide = _post(client, {"model": "jev-latest", "state": "s", "questions": {"u": {"type": "noul", "instructions": "word " * 300}}})
    assert wide.status_code == 400 and wide.json()["detail"]["error_type"] == "tokens_exceeded"
    assert "window" in wide.json()["detail"]["message"]

    # within budget, a state longer than the model's window: answered, and flagged rather than silently cut
    long_ok = _ok(client, {"model": "jev-latest", "state": "word " * 2_000, "questions": {"u": q}})
    assert long_ok["answers"]["u"]["x_truncated"] is True
    assert long_ok["usage"]["input_tokens"] >= 2_000


def test_model_aliases_answer_with_the_versioned_id(client: httpx.Client, model_id: str) -> None:
    outs = [_ok(client, CONTRACT_EXAMPLE | {"model": m}) for m in ("jev-latest", "jev-preview", model_id)]
    assert {o["model"] for o in outs} == {model_id}
    for o in outs[1:]:
        assert _probs(o["answers"]["team"]) == pytest.approx(_probs(outs[0]["answers"]["team"]), abs=1e-5)


def test_models_routes(client: httpx.Client, model_id: str) -> None:
    jev = client.get("/v1/models").json()
    assert set(jev) == {"models"}
    assert [m["name"] for m in jev["models"]] == [model_id, "jev-latest", "jev-preview"]
    for m in jev["models"]:
        assert set(m) == {"name", "description", "release_date"} and re.fullmatch(r"\d{4}-\d{2}-\d{2}", m["release_date"])
    oa = client.get("/openai/v1/models").json()
    assert oa["object"] == "list" and [m["id"] for m in oa["data"]] == [model_id, "jev-latest", "jev-preview"]
    assert client.get(f"/openai/v1/models/{model_id}").json()["id"] == model_id


def test_auth_on_every_route_but_health(server: ServerProcess) -> None:
    assert httpx.get(f"{server.url}/health").status_code == 200
    for method, path in (("GET", "/v1/models"), ("GET", "/openai/v1/models"), ("GET", "/metrics"), ("GET", "/openapi.json"),
                         ("POST", "/v1/systemone"), ("POST", "/v1/chat/completions"), ("POST", "/openai/v1/chat/completions")):
        for headers in ({}, {"Authorization": "Bearer wrong-key"}, {"Authorization": f"Basic {API_KEY}"}):
            r = httpx.request(method, f"{server.url}{path}", headers=headers, json=CONTRACT_EXAMPLE)
            assert r.status_code == 401, (method, path, headers, r.text)
            assert r.json()["detail"]["error_type"] == "authentication_error"
            assert r.headers["www-authenticate"] == "Bearer"
    ok = httpx.get(f"{server.url}/metrics", headers=server.headers())
    assert ok.status_code == 200 and "envloop_serve_requests_total" in ok.text
    assert httpx.get(f"{server.url}/openapi.json", headers=server.headers()).json()["paths"]["/v1/systemone"]


def test_request_id_header_is_echoed_or_made(client: httpx.Client) -> None:
    r = client.get("/v1/models", headers={"x-request-id": "client-123"})
    assert r.headers["x-typesafe-request-id"] == "client-123" == r.headers["x-request-id"]
    r2 = client.get("/nope")
    assert r2.headers["x-typesafe-request-id"].startswith("req_")


# --------------------------------------------------------------------------- bad requests: each kind, its 4xx shape

_DUPLICATE_OPTIONS = (
    '{"model":"jev-latest","state":"s","questions":{"q":{"type":"choice","criteria":{"a":null,"a":null,"b":null}}}}'
)
_LONE_SURROGATE = '{"model":"jev-latest","state":"bad \\ud800 here","questions":{"q":{"type":"noul","instructions":"x"}}}'

BAD_REQUESTS = [
    # (name, method, path, request kwargs, status, error_type or None for the 422 list, a loc that must appear)
    ("malformed json", "POST", "/v1/systemone", {"content": b'{"model": "jev-latest", "state": '}, 422, None, None),
    ("not utf-8", "POST", "/v1/systemone", {"content": b'{"state": "\xff\xfe"}'}, 422, None, None),
    ("json array body", "POST", "/v1/systemone", {"json": [1, 2]}, 422, None, None),
    ("missing state", "POST", "/v1/systemone", {"json": {"model": "jev-latest", "questions": CONTRACT_EXAMPLE["questions"]}},
     422, None, ["body", "state"]),
    ("missing model", "POST", "/v1/systemone", {"json": {"state": "s", "questions": CONTRACT_EXAMPLE["questions"]}},
     422, None, ["body", "model"]),
    ("no questions", "POST", "/v1/systemone", {"json": {"model": "jev-latest", "state": "s", "questions": {}}},
     422, None, ["body", "questions"]),
    ("too many questions", "POST", "/v1/systemone", {"json": {"model": "jev-latest", "state": "s", "questions": {
        f"q{i}": {"type": "noul", "instructions": "x"} for i in range(129)}}}, 422, None, ["body", "questions"]),
    ("state is a number", "POST", "/v1/systemone", {"json": CONTRACT_EXAMPLE | {"state": 42}}, 422, None, ["body", "state"]),
    ("unknown question type", "POST", "/v1/systemone",
     {"json": {"model": "jev-latest", "state": "s", "questions": {"q": {"type": "box", "instructions": "x"}}}},
     422, None, ["body", "questions", "q"]),
    ("score as an object map", "POST", "/v1/systemone",
     {"json": {"model": "jev-latest", "state": "s", "questions": {"q": {"type": "score", "criteria": {"a": "b", "c": "d"}}}}},
     422, None, ["body", "questions", "q", "score", "criteria"]),
    ("choice with one option", "POST", "/v1/systemone",
     {"json": {"model": "jev-latest", "state": "s", "questions": {"q": {"type": "choice", "criteria": {"a": None}}}}},
     422, None, ["body", "questions", "q", "choice", "criteria"]),
    ("choice without criteria", "POST", "/v1/systemone",
     {"json": {"model": "jev-latest", "state": "s", "questions": {"q": {"type": "choice", "instructions": "x"}}}},
     422, None, ["body", "questions", "q", "choice", "criteria"]),
    ("duplicate option keys", "POST", "/v1/systemone", {"content": _DUPLICATE_OPTIONS.encode()},
     422, None, ["body", "questions", "q", "choice", "criteria"]),
    ("noul criteria with other keys", "POST", "/v1/systemone",
     {"json": {"model": "jev-latest", "state": "s", "questions": {"q": {"type": "noul", "instructions": "x", "criteria": {"maybe": "?"}}}}},
     422, None, ["body", "questions", "q", "noul", "criteria"]),
    ("noul with nothing to decide", "POST", "/v1/systemone",
     {"json": {"model": "jev-latest", "state": "s", "questions": {"q": {"type": "noul"}}}}, 422, None, ["body", "questions", "q", "noul"]),
    ("unknown question field", "POST", "/v1/systemone",
     {"json": {"model": "jev-latest", "state": "s", "questions": {"q": {"type": "noul", "instructions": "x", "label": True}}}},
     422, None, ["body", "questions", "q", "noul", "label"]),
    ("instructions a number", "POST", "/v1/systemone",
     {"json": {"model": "jev-latest", "state": "s", "questions": {"q": {"type": "noul", "instructions": 3}}}},
     422, None, ["body", "questions", "q", "noul", "instructions"]),
    ("image assets", "POST", "/v1/systemone", {"json": CONTRACT_EXAMPLE | {"assets": {"img": {"type": "image", "part": "a"}}}},
     422, None, ["body", "assets"]),
    ("lone surrogate", "POST", "/v1/systemone", {"content": _LONE_SURROGATE.encode()}, 422, None, ["body"]),
    ("nesting past the decoder's stack", "POST", "/v1/systemone", {"content": b"[" * 100_000 + b"]" * 100_000}, 422, None, ["body"]),
    ("nesting past 128 levels", "POST", "/v1/systemone",
     {"content": ('{"model":"jev-latest","state":' + "[" * 3000 + "]" * 3000 + ',"questions":{"q":{"type":"noul","instructions":"x"}}}').encode()},
     422, None, ["body"]),
    ("a 5000-digit integer", "POST", "/v1/systemone",
     {"content": b'{"model":"jev-latest","state":{"n":' + b"9" * 5000 + b'},"questions":{"q":{"type":"noul","instructions":"x"}}}'},
     422, None, ["body"]),
    ("chat without messages", "POST", "/v1/chat/completions", {"json": {"model": "jev-latest", "messages": []}},
     422, None, ["body", "messages"]),
    ("chat with two questions", "POST", "/v1/chat/completions", {"json": {"model": "jev-latest", "messages": [
        {"role": "user", "content": json.dumps({"state": "s", "questions": CONTRACT_EXAMPLE["questions"]})}]}},
     422, None, ["body", "messages", 0, "content", "questions"]),
    ("chat json nested past 128 levels", "POST", "/v1/chat/completions", {"json": {"model": "jev-latest", "messages": [
        {"role": "user", "content": '{"state": ' + "[" * 3000 + "]" * 3000 + "}"}]}}, 422, None, ["body", "messages", 0, "content"]),
    ("chat stream", "POST", "/v1/chat/completions", {"json": {"model": "jev-latest", "stream": True,
                                                              "messages": [{"role": "user", "content": "Is it urgent?"}]}},
     422, None, ["body", "stream"]),
    ("unknown model", "POST", "/v1/systemone", {"json": CONTRACT_EXAMPLE | {"model": "gpt-9"}}, 404, "unknown", None),
    ("chat unknown model", "POST", "/v1/chat/completions",
     {"json": {"model": "gpt-9", "messages": [{"role": "user", "content": "Is it urgent?"}]}}, 404, "unknown", None),
    ("body too large", "POST", "/v1/systemone", {"content": b"{" + b" " * (MAX_BODY_BYTES + 10) + b"}"}, 413, "unknown", None),
    ("gzip bomb", "POST", "/v1/systemone",
     {"content": gzip.compress(b" " * (MAX_BODY_BYTES * 4)), "headers": {"Content-Encoding": "gzip"}}, 413, "unknown", None),
    ("zstd bomb", "POST", "/v1/systemone",
     {"content": zstd_compress(b" " * (MAX_BODY_BYTES * 4)), "headers": {"Content-Encoding": "zstd"}}, 413, "unknown", None),
    ("bad gzip data", "POST", "/v1/systemone", {"content": b"not gzip", "headers": {"Content-Encoding": "gzip"}}, 400, "unknown", None),
    ("unsupported encoding", "POST", "/v1/systemone",
     {"content": b"{}", "headers": {"Content-Encoding": "br"}}, 415, "unknown", None),
    ("multipart", "POST", "/v1/systemone", {"files": {"request": ("r.json", b"{}", "application/json")}}, 415, "unknown", None),
    ("unknown route", "GET", "/v2/nothing", {}, 404, "unknown", None),
    ("wrong method", "GET", "/v1/systemone", {}, 405, "unknown", None),
]


@pytest.mark.parametrize("name, method, path, kwargs, status, error_type, loc", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_request_gets_its_4xx_shape(client: httpx.Client, name: str, method: str, path: str, kwargs: dict, status: int,
                                        error_type: str | None, loc: list | None) -> None:
    r = client.request(method, path, **kwargs)
    assert r.status_code == status, r.text
    assert r.headers["x-typesafe-request-id"]
    detail = r.json()["detail"]
    if error_type is None:
        assert isinstance(detail, list) and detail
        for d in detail:
            assert isinstance(d["loc"], list) and d["loc"][0] == "body" and isinstance(d["msg"], str) and isinstance(d["type"], str)
        if loc is not None:
            assert loc in [d["loc"] for d in detail], detail
    else:
        assert set(detail) == {"error_type", "message"} and detail["error_type"] == error_type and detail["message"]
    if path.endswith("/chat/completions"):
        assert r.json()["error"]["message"]


@pytest.mark.parametrize("encoding, compress", [("gzip", gzip.compress), ("zstd", zstd_compress)])
def test_compressed_bodies_are_accepted(client: httpx.Client, encoding: str, compress) -> None:
    r = client.post("/v1/systemone", content=compress(json.dumps(CONTRACT_EXAMPLE).encode()),
                    headers={"Content-Encoding": encoding, "Content-Type": "application/json"})
    assert r.status_code == 200, r.text


# --------------------------------------------------------------------------- micro-batching


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


def test_concurrent_requests_share_batches_without_mixing_answers(server: ServerProcess) -> None:
    records = benchmark_records(n_users=3, records_per_user=8, seed=3)
    bodies = []
    for i, record in enumerate(records):
        body = jev_request(record)
        # a question unique to this request: its own option keys
        body["questions"][f"own-{i}"] = {"type": "choice", "instructions": f"Which tag fits request {i}?",
                                         "criteria": {f"tag-{i}-{j}": None for j in range(2 + i % 4)}}
        bodies.append(body)
    with httpx.Client(base_url=server.url, headers=server.headers(), timeout=120) as c:
        reference = [c.post("/v1/systemone", json=b).json()["answers"] for b in bodies]  # one at a time
        before = c.get("/metrics").text

    async def fire() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers(), timeout=120,
                                     limits=httpx.Limits(max_connections=64)) as ac:
            return await asyncio.gather(*(ac.post("/v1/systemone", json=b) for b in bodies))

    responses = asyncio.run(fire())
    for body, ref, r in zip(bodies, reference, responses):
        assert r.status_code == 200, r.text
        answers = r.json()["answers"]
        assert list(answers) == list(body["questions"])
        for qid, a in answers.items():
            assert a["type"] == body["questions"][qid]["type"]
            if a["type"] != "noul":
                assert list(a["probabilities"]) == list(ref[qid]["probabilities"])
            assert _probs(a) == pytest.approx(_probs(ref[qid]), abs=1e-5)
    after = httpx.get(f"{server.url}/metrics", headers=server.headers()).text
    batches = _metric(after, "envloop_serve_batch_requests_count") - _metric(before, "envloop_serve_batch_requests_count")
    singles = (_metric(after, 'envloop_serve_batch_requests_bucket{le="1.0"}')
               - _metric(before, 'envloop_serve_batch_requests_bucket{le="1.0"}'))
    assert batches < len(bodies), "concurrent requests should share forward passes"
    assert batches - singles >= 1, "at least one batch held several requests"
    assert "envloop_serve_shed_total{" not in after  # nothing was shed: the default queue holds them all
