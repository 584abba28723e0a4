"""The user documentation in ``docs/`` runs: every JSON, JSONL, YAML and CSV example is real.

The examples are fenced code blocks whose info string says what they are (GitHub shows
only the first word, the language):

* ``jsonl file=NAME``, ``csv file=NAME``, ``yaml file=NAME`` (``docs/decision-data.md``): a
  file, written into a fresh working directory in document order. ``bad`` marks a file that
  must fail; any other one must pass ``envloop data validate`` (CSV with the mapping written
  before it).
* ``console``: ``$ envloop ...`` commands, each followed by exactly what it prints (stdout and
  stderr). They run in document order through the real CLI (click's ``CliRunner``) in the
  working directory, with ``ENVLOOP_HOME`` in a temporary folder shown as ``<home>`` and the
  working directory shown as ``/path/to``. ``...`` in an expected line matches any text; the
  exit status must be 1 when the output starts with ``error:`` and 0 otherwise.
* ``json request`` / ``json request invalid`` + ``json 422`` / ``json response`` / ``json chat`` /
  ``json chat-response`` / ``json 401`` / ``json 404`` / ``json models`` (``docs/serving.md``):
  checked against the server's own pydantic models and answer functions, and (for the HTTP
  error bodies and the model listing) against the app itself, in process, with no model
  loaded and no server started.
* ``json hypothesis`` (``docs/loop-rules.md``): a hypothesis file for ``--hypothesis``.
* ``bash http`` (``docs/http-api.md``): the curl requests of the HTTP API, run as written, in document
  order, against a real webserver and MLflow server by ``integration/test_remote.py``.
* ``json decision`` (``docs/http-api.md``): what the decision request prints: the fields of a
  ``RoundDecision``.
* ``python sdk`` (``docs/http-api.md``): SDK code; it must parse and call only what ``Client`` has.

No example may be left untagged: an untagged JSON/JSONL/YAML/CSV block fails the suite.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
DOC_FILES = sorted(DOCS.glob("*.md"))
EXPECTED_DOCS = ("agents.md", "concepts.md", "decision-data.md", "gpu-check.md", "http-api.md", "loop-rules.md",
                 "serving.md")

#: Fence roles by language; a JSON/JSONL/YAML/CSV block without one of these is an untested example.
JSON_ROLES = {"request", "chat", "response", "chat-response", "422", "401", "404", "models", "hypothesis", "decision"}
FILE_LANGS = {"jsonl", "csv", "yaml"}


@dataclasses.dataclass(frozen=True)
class Fence:
    doc: str
    line: int
    lang: str
    tags: frozenset[str]
    attrs: dict[str, str]
    text: str

    def where(self) -> str:
        return f"{self.doc}:{self.line}"


def fences(path: Path) -> list[Fence]:
    """The fenced code blocks of a Markdown file (``` fences, not nested)."""
    out: list[Fence] = []
    lines = path.read_text(encoding="utf-8").split("\n")
    i = 0
    while i < len(lines):
        m = re.match(r"^```(.*)$", lines[i])
        if not m:
            i += 1
            continue
        info = m.group(1).split()
        start = i + 1
        j = start
        while j < len(lines) and lines[j].rstrip() != "```":
            j += 1
        assert j < len(lines), f"{path.name}:{i + 1}: unclosed code fence"
        attrs = dict(t.split("=", 1) for t in info[1:] if "=" in t)
        tags = frozenset(t for t in info[1:] if "=" not in t)
        out.append(Fence(path.name, i + 1, info[0] if info else "", tags, attrs, "\n".join(lines[start:j])))
        i = j + 1
    return out


def doc_fences(name: str) -> list[Fence]:
    return fences(DOCS / name)


# --------------------------------------------------------------------------- every example is tagged and tested


def test_the_docs_exist() -> None:
    assert sorted(p.name for p in DOC_FILES) == sorted(EXPECTED_DOCS)


@pytest.mark.parametrize("path", DOC_FILES, ids=lambda p: p.name)
def test_every_example_is_tagged(path: Path) -> None:
    for f in fences(path):
        if f.lang in FILE_LANGS:
            assert "file" in f.attrs, f"{f.where()}: a {f.lang} example needs file=NAME so a test writes and checks it"
            assert f.doc == "decision-data.md", f"{f.where()}: file examples are run in decision-data.md only"
        elif f.lang == "json":
            roles = f.tags - {"invalid"}
            assert len(roles) == 1 and roles <= JSON_ROLES, f"{f.where()}: a json example needs one role of {sorted(JSON_ROLES)}"
        elif f.lang == "console":
            assert f.doc == "decision-data.md", f"{f.where()}: console sessions are run in decision-data.md only"
        elif f.lang == "python":
            assert f.tags == {"sdk"} and f.doc == "http-api.md", f"{f.where()}: python examples are `python sdk` in http-api.md"
        elif "http" in f.tags:
            assert f.lang == "bash" and f.tags == {"http"} and f.doc == "http-api.md", (
                f"{f.where()}: HTTP requests are `bash http` blocks in http-api.md")
        else:
            assert f.lang in ("", "bash", "text"), f"{f.where()}: unknown example language {f.lang!r}"
            assert f.tags <= {"output"}, f"{f.where()}: unknown tags {sorted(f.tags)}"
            if f.lang in ("", "text"):
                body = f.text.strip()
                assert not (body.startswith("{") or body.startswith("[")), f"{f.where()}: JSON in an untested block"


# --------------------------------------------------------------------------- decision-data.md: files and console sessions


def _matches(expected: str, actual: str) -> bool:
    pattern = ".*".join(re.escape(part) for part in expected.split("..."))
    return re.fullmatch(pattern, actual) is not None


def _sessions(fs: list[Fence]) -> list[tuple[str, list[str]]]:
    """``(command, expected output lines)`` of every console block, in order."""
    out: list[tuple[str, list[str]]] = []
    for f in fs:
        for line in f.text.split("\n"):
            if line.startswith("$ "):
                assert line.startswith("$ envloop "), f"{f.where()}: only envloop commands run here: {line}"
                out.append((line[len("$ envloop "):], []))
            else:
                assert out, f"{f.where()}: output before any command"
                out[-1][1].append(line)
    return out


def test_decision_data_examples_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Files are written and console sessions run in document order; outputs match exactly."""
    from envloop_pipelines.cli import main

    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir()
    monkeypatch.chdir(work)
    runner = CliRunner()
    written: dict[str, Fence] = {}
    used: set[str] = set()
    mapping: str | None = None
    fs = doc_fences("decision-data.md")
    assert any(f.lang == "console" for f in fs)
    for f in fs:
        if f.lang in FILE_LANGS:
            name = f.attrs["file"]
            assert name not in written, f"{f.where()}: {name} is written twice"
            (work / name).write_text(f.text + "\n" if f.text else "", encoding="utf-8")
            written[name] = f
            if f.lang == "yaml":
                from envloop_pipelines.core.data.tabular import ColumnMapping

                ColumnMapping.from_file(work / name)  # every mapping example loads
                mapping = name
            continue
        if f.lang != "console":
            continue
        for command, expected in _sessions([f]):
            args = shlex.split(command)
            used.update(a for a in args if a in written)
            result = runner.invoke(main, args, env={"ENVLOOP_HOME": str(home)})
            assert result.exception is None or isinstance(result.exception, SystemExit), (
                f"{f.where()}: `envloop {command}` raised {result.exception!r}")
            actual = result.output.replace(str(home), "<home>").replace(str(work), "/path/to")
            got = [line.rstrip() for line in actual.rstrip("\n").split("\n")]
            want = [line.rstrip() for line in expected]
            assert len(got) == len(want) and all(_matches(w, g) for w, g in zip(want, got)), (
                f"{f.where()}: `envloop {command}` printed:\n" + "\n".join(got) + "\n\nthe docs say:\n" + "\n".join(want))
            failed = bool(got) and got[0].startswith("error:")
            assert result.exit_code == (1 if failed else 0), f"{f.where()}: `envloop {command}` exited {result.exit_code}"
    for name, f in written.items():  # every good data file validates on its own (a CSV with the page's mapping)
        if f.lang == "yaml" or "bad" in f.tags:
            continue
        args = ["data", "validate", name] + (["--mapping", mapping] if f.lang == "csv" and mapping else [])
        result = runner.invoke(main, args, env={"ENVLOOP_HOME": str(home)})
        assert result.exit_code == 0, f"{f.where()}: a good example must validate:\n{result.output}"
    bad = {n for n, f in written.items() if "bad" in f.tags}
    assert bad, "decision-data.md shows no bad input"
    assert bad <= used, f"bad examples no console session runs: {sorted(bad - used)}"


# --------------------------------------------------------------------------- serving.md: request bodies and answers


def _decode(f: Fence) -> Any:
    from envloop_pipelines.core.data.json_text import decode_json

    try:
        return decode_json(f.text)
    except json.JSONDecodeError as exc:
        raise AssertionError(f"{f.where()}: not JSON: {exc}") from None


def _serving_fences(*roles: str) -> list[Fence]:
    return [f for f in doc_fences("serving.md") if f.lang == "json" and f.tags & set(roles)]


def test_request_examples_validate() -> None:
    from envloop_pipelines.core.serve.schemas import RequestValidationFailed, parse_systemone

    fs = doc_fences("serving.md")
    requests = [f for f in fs if f.lang == "json" and "request" in f.tags]
    assert any("invalid" not in f.tags for f in requests) and any("invalid" in f.tags for f in requests)
    for i, f in enumerate(fs):
        if not (f.lang == "json" and "request" in f.tags):
            continue
        if "invalid" not in f.tags:
            try:
                parse_systemone(_decode(f))
            except RequestValidationFailed as exc:
                raise AssertionError(f"{f.where()}: the example is rejected: {exc}") from None
            continue
        following = fs[i + 1] if i + 1 < len(fs) else None
        assert following is not None and following.lang == "json" and "422" in following.tags, (
            f"{f.where()}: an invalid request is followed by the json 422 body it gets")
        with pytest.raises(RequestValidationFailed) as info:
            parse_systemone(_decode(f))
        assert {"detail": info.value.details} == _decode(following), (
            f"{following.where()}: the server answers\n{json.dumps({'detail': info.value.details}, ensure_ascii=False)}")


def test_chat_examples_validate() -> None:
    from envloop_pipelines.core.serve.schemas import ChatCompletionRequest, chat_question

    chats = _serving_fences("chat")
    assert chats
    for f in chats:
        request = ChatCompletionRequest.model_validate(_decode(f))
        parsed, qid = chat_question(request)
        assert len(parsed.questions) == 1 and qid in parsed.questions, f.where()


def _input_tokens(served: Any) -> int:
    """``usage.input_tokens`` as the server counts it (core/serve/app.py)."""
    from envloop_pipelines.core.tokens import count_tokens

    counts = count_tokens([served.state_text] + [q.budget_text for q in served.questions])
    inner = [max(0, c - 2) for c in counts]
    return inner[0] + sum(inner[1:]) + 2


def _probs(answer: dict[str, Any], keys: tuple[str, ...]) -> list[float]:
    if answer["type"] == "noul":
        return [answer["noul"], 1.0 - answer["noul"]]
    return [answer["probabilities"][k] for k in keys]


def _same(expected: Any, actual: Any, where: str) -> None:
    if isinstance(expected, float) or isinstance(actual, float):
        assert isinstance(actual, (int, float)) and math.isclose(expected, actual, abs_tol=5e-4), f"{where}: {expected} != {actual}"
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and set(expected) == set(actual), f"{where}: keys {sorted(expected)} != {sorted(actual)}"
        for k in expected:
            _same(expected[k], actual[k], f"{where}.{k}")
    elif isinstance(expected, list):
        assert isinstance(actual, list) and len(expected) == len(actual), f"{where}: {expected!r} != {actual!r}"
        for i, (e, a) in enumerate(zip(expected, actual)):
            _same(e, a, f"{where}[{i}]")
    else:
        assert expected == actual, f"{where}: {expected!r} != {actual!r}"


def test_response_examples_are_what_the_server_computes() -> None:
    """Each response's answers are ``jev_answer`` of its probabilities for the request shown before it."""
    from envloop_pipelines.core.serve.answers import ModelAnswer, jev_answer
    from envloop_pipelines.core.serve.schemas import parse_systemone, served_request

    fs = [f for f in doc_fences("serving.md") if f.lang == "json"]
    checked = 0
    for i, f in enumerate(fs):
        if "response" not in f.tags:
            continue
        request = next((r for r in reversed(fs[:i]) if "request" in r.tags and "invalid" not in r.tags), None)
        assert request is not None, f"{f.where()}: a response follows the request it answers"
        served = served_request(parse_systemone(_decode(request)))
        body = _decode(f)
        assert set(body) == {"model", "answers", "usage", "x_automation_threshold", "x_checkpoint_sha256"}, f.where()
        assert re.fullmatch(r"envloop-[A-Za-z0-9._-]+-r\d{4}", body["model"]), f"{f.where()}: a versioned model id"
        assert list(body["answers"]) == [q.id for q in served.questions], f"{f.where()}: one answer per question, in order"
        threshold = body["x_automation_threshold"]
        for q in served.questions:
            shown = body["answers"][q.id]
            probs = _probs(shown, q.option_keys)
            assert math.isclose(sum(probs), 1.0, abs_tol=1e-9), f"{f.where()}: {q.id} probabilities sum to {sum(probs)}"
            computed = jev_answer(q, ModelAnswer(probs=probs), automation_threshold=threshold)
            _same(computed, shown, f"{f.where()}: answers.{q.id}")
        assert body["usage"] == {"input_tokens": _input_tokens(served), "output_tokens": len(served.questions)}, (
            f"{f.where()}: usage is {_input_tokens(served)} input tokens")
        checked += 1
    assert checked


def test_chat_response_examples_are_what_the_server_computes() -> None:
    import numpy as np

    from envloop_pipelines.core.serve.answers import ModelAnswer, chosen_option, jev_answer, option_logprobs
    from envloop_pipelines.core.serve.schemas import ChatCompletionRequest, chat_question, served_request

    fs = [f for f in doc_fences("serving.md") if f.lang == "json"]
    checked = 0
    for i, f in enumerate(fs):
        if "chat-response" not in f.tags:
            continue
        chat = next((c for c in reversed(fs[:i]) if "chat" in c.tags), None)
        assert chat is not None, f"{f.where()}: a chat response follows the chat request it answers"
        request = ChatCompletionRequest.model_validate(_decode(chat))
        served = served_request(chat_question(request)[0])
        [q] = served.questions
        body = _decode(f)
        answer = body["x_answer"]
        probs = np.asarray(_probs(answer, q.option_keys))
        threshold = body["x_automation_threshold"]
        _same(jev_answer(q, ModelAnswer(probs=probs), automation_threshold=threshold), answer, f"{f.where()}: x_answer")
        [choice] = body["choices"]
        assert choice["message"]["content"] == chosen_option(q, probs), f.where()
        expected_logprobs = option_logprobs(q, probs, request.top_logprobs) if request.logprobs else None
        _same(expected_logprobs, choice["logprobs"], f"{f.where()}: logprobs")
        tokens = _input_tokens(served)
        assert body["usage"] == {"prompt_tokens": tokens, "completion_tokens": 1, "total_tokens": tokens + 1}, (
            f"{f.where()}: usage is {tokens} prompt tokens")
        assert body["object"] == "chat.completion" and body["model"] == _decode(f)["model"]
        checked += 1
    assert checked


# --------------------------------------------------------------------------- serving.md: HTTP bodies from the app itself

#: The server the HTTP examples describe: release 3 of task ``tickets`` (the model is never loaded).
DOC_CHECKPOINT_SHA = "9f2c4e1ab07d" + "0" * 52


@pytest.fixture(scope="module")
def doc_app(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from starlette.testclient import TestClient

    from envloop_pipelines.core.serve.app import create_app
    from envloop_pipelines.core.serve.settings import ServeSettings

    def no_model() -> Any:
        raise AssertionError("the documented examples never reach the model")

    settings = ServeSettings(
        checkpoint_dir=tmp_path_factory.mktemp("ckpt"), model_id="envloop-tickets-r0003", release=3, task="tickets",
        release_date="2025-06-02", expected_checkpoint_sha256=DOC_CHECKPOINT_SHA, api_keys=("sk-doc",), preload=False,
    )
    return TestClient(create_app(settings, loader=no_model))


def _one(role: str) -> Fence:
    [f] = _serving_fences(role)
    return f


def test_http_error_examples_are_what_the_app_answers(doc_app: Any) -> None:
    request = next(f for f in _serving_fences("request") if "invalid" not in f.tags)
    body = request.text
    unauth = doc_app.post("/v1/systemone", content=body, headers={"content-type": "application/json"})
    assert unauth.status_code == 401 and unauth.json() == _decode(_one("401")), unauth.text
    wrong = json.loads(body) | {"model": "gpt-4o"}
    unknown = doc_app.post("/v1/systemone", json=wrong, headers={"Authorization": "Bearer sk-doc"})
    assert unknown.status_code == 404 and unknown.json() == _decode(_one("404")), unknown.text
    invalid = next(f for f in _serving_fences("request") if "invalid" in f.tags)
    answered = doc_app.post("/v1/systemone", content=invalid.text.encode(),
                            headers={"Authorization": "Bearer sk-doc", "content-type": "application/json"})
    assert answered.status_code == 422 and answered.json() == _decode(
        next(f for f in _serving_fences("422") if f.line > invalid.line)), answered.text


def test_models_example_is_what_the_app_lists(doc_app: Any) -> None:
    listed = doc_app.get("/v1/models", headers={"Authorization": "Bearer sk-doc"})
    assert listed.status_code == 200 and listed.json() == _decode(_one("models")), listed.text


# --------------------------------------------------------------------------- loop-rules.md and concepts.md


def test_hypothesis_examples(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A valid hypothesis file passes ``--hypothesis``'s checks, its gate and recipe change are valid; an invalid
    one is refused by ``envloop round start`` with the documented message, before anything runs."""
    from envloop_pipelines.cli import main
    from envloop_pipelines.cli import round as cli_round
    from envloop_pipelines.core.ledger.hypothesis import recipe_diff
    from envloop_pipelines.core.ledger.hypothesis import Gate
    from envloop_pipelines.core.decision_loop.registered_hypothesis import proposal_errors
    from envloop_pipelines.core.model.recipe import DEFAULT_RECIPE, load_recipe

    def no_loop(**_: Any) -> None:
        raise AssertionError("an invalid hypothesis file must be refused before the loop starts")

    monkeypatch.setattr(cli_round, "run_loop", no_loop)
    monkeypatch.chdir(tmp_path)
    fs = doc_fences("loop-rules.md")
    examples = [(i, f) for i, f in enumerate(fs) if f.lang == "json" and "hypothesis" in f.tags]
    assert any("invalid" in f.tags for _, f in examples) and any("invalid" not in f.tags for _, f in examples)
    for i, f in examples:
        body = _decode(f)
        if "invalid" not in f.tags:
            assert proposal_errors(body) == [], f.where()
            Gate(**body.get("gate", {}))
            load_recipe(DEFAULT_RECIPE, recipe_diff(body["change"]))
            continue
        following = fs[i + 1] if i + 1 < len(fs) else None
        assert following is not None and following.lang == "text" and "output" in following.tags, (
            f"{f.where()}: an invalid hypothesis is followed by the text output it gets")
        (tmp_path / "hyp.json").write_text(f.text, encoding="utf-8")
        result = CliRunner().invoke(main, ["round", "start", "--hypothesis", "hyp.json"],
                                    env={"ENVLOOP_HOME": str(tmp_path / "home")})
        assert result.exit_code == 2 and following.text.strip() in result.output, result.output


# --------------------------------------------------------------------------- http-api.md (the requests run in integration/)


def test_http_api_decision_example_is_a_round_decision() -> None:
    from envloop_pipelines.core.decision_loop.step_records import RoundDecision

    [f] = [f for f in doc_fences("http-api.md") if f.lang == "json" and "decision" in f.tags]
    shown = _decode(f)
    fields = {x.name for x in dataclasses.fields(RoundDecision)}
    assert set(shown) - {"delta"} <= fields, f"{f.where()}: not RoundDecision fields: {sorted(set(shown) - fields)}"
    assert isinstance(shown["promote"], bool) and isinstance(shown["delta"], float)
    assert re.fullmatch(r"r\d{4}", shown["round"]) and all(isinstance(r, str) for r in shown["reasons"])
    assert (shown["release"] is None) is (not shown["promote"])


def test_http_api_requests_use_the_sdk_names() -> None:
    """The curl requests ask for the jobs, partitions, assets and metadata the SDK and the code use."""
    from envloop_pipelines.defs.rounds.metadata import DECISION
    from envloop_pipelines import names

    text = "\n".join(f.text for f in doc_fences("http-api.md") if "http" in f.tags)
    for name in (names.ROUND_JOB, names.SETUP_JOB, names.PROMOTION_DECISION, names.HYPOTHESIS_ASSET, names.PARTITION_TAG,
                 f'partitionsDefName: \\"{names.ROUNDS_PARTITIONS}\\"', f'select(.label == "{DECISION}")'):
        assert name in text, f"http-api.md: the requests do not use {name!r}"


def test_sdk_examples_call_only_what_the_client_has() -> None:
    import ast

    from envloop_pipelines.sdk.client import Client

    for f in [f for f in doc_fences("http-api.md") if f.lang == "python"]:
        tree = ast.parse(f.text)
        called = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                  and n.value.id in ("client", "Client")}
        assert called and called <= set(dir(Client)), f"{f.where()}: Client has no {sorted(called - set(dir(Client)))}"
    prose = re.sub(r"```.*?```", "", (DOCS / "http-api.md").read_text(encoding="utf-8"), flags=re.DOTALL)
    named = set(re.findall(r"`(?:client|Client)\.(\w+)", prose))
    assert named and named <= set(dir(Client)), f"http-api.md names Client.{sorted(named - set(dir(Client)))}"


def _table(text: str, heading: str) -> list[list[str]]:
    """The rows (cells stripped) of the first Markdown table after ``heading``."""
    section = text.split(heading, 1)[1]
    rows = []
    for line in section.split("\n"):
        if line.startswith("|"):
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif rows:
            break
    return rows[2:]  # header and rule


def _names(cell: str) -> set[str]:
    return set(re.findall(r"`([^`]+)`", cell))


def test_concept_table_spells_tracking_and_ledger_names() -> None:
    """MLflow kinds and ledger events in the concept table are the constants' spelling, and every one is there."""
    from envloop_pipelines.core import tracking
    from envloop_pipelines.core.ledger import event_log

    text = (DOCS / "concepts.md").read_text(encoding="utf-8")
    rows = _table(text, "## The concepts")
    assert len(rows) == 20 and all(len(r) == 7 for r in rows), "the concept table has 20 concepts in 7 columns"
    kinds = {n for r in rows for n in _names(r[4]) if "." not in n}  # not the params `recipe.*`
    events = {n for r in rows for n in _names(r[5]) if "." not in n}  # not `change.recipe_overrides`
    assert kinds == set(tracking.RUN_KINDS), f"table {sorted(kinds)} vs tracking.RUN_KINDS {sorted(tracking.RUN_KINDS)}"
    assert events <= set(event_log.EVENT_KINDS), f"not ledger events: {sorted(events - set(event_log.EVENT_KINDS))}"
    every_doc = "".join(p.read_text(encoding="utf-8") for p in DOC_FILES)
    missing = [k for k in event_log.EVENT_KINDS if f"`{k}`" not in every_doc]
    assert not missing, f"ledger events the docs never name: {missing}"
    for old, new in event_log.LEGACY_EVENT_KINDS.items():
        assert f"`{old}` → `{new}`" in text, f"the Renamed list names the event {old} → {new}"
    tags = [v for k, v in vars(tracking).items() if k.startswith("TAG_")]
    assert {r[0].strip("`") for r in _table(text, "MLflow runs carry these tags")} == set(tags)
    assert f"`{tracking.HOLDOUT_PREFIX}<metric>`" in text


def test_concept_table_names_exist() -> None:
    """Every core function and Dagster asset, sensor or schedule of the concept table is defined under that name."""
    text = (DOCS / "concepts.md").read_text(encoding="utf-8")
    rows = _table(text, "## The concepts")

    def defined(name: str, package: str) -> bool:
        pattern = re.compile(rf"^\s*(?:async\s+)?def {re.escape(name)}\b|^{re.escape(name)}\s*=", re.M)
        return any(pattern.search(p.read_text(encoding="utf-8")) for p in (ROOT / "envloop_pipelines" / package).rglob("*.py"))

    for row in rows:
        for name in _names(row[1]):
            if re.fullmatch(r"[a-z_]+", name):
                assert defined(name, "core"), f"core function {name} ({row[0]}) is not defined in envloop_pipelines/core"
        for name in _names(row[3]):
            if re.fullmatch(r"[a-z_]+", name) and name != "rounds" and not name.startswith("r0"):
                assert defined(name, "defs"), f"Dagster definition {name} ({row[0]}) is not defined in envloop_pipelines/defs"


def test_concept_table_names_the_module_each_concept_lives_in() -> None:
    """Issue 36: the module column names files that exist, and each core function or class of a row is defined
    in one of the modules its row names (a function that moves takes its row's module with it)."""
    text = (DOCS / "concepts.md").read_text(encoding="utf-8")
    package = ROOT / "envloop_pipelines"
    for row in _table(text, "## The concepts"):
        modules = [m for m in _names(row[2]) if m.endswith(".py")]
        assert modules, f"{row[0]}: no module named"
        missing = [m for m in modules if not (package / m).is_file()]
        assert not missing, f"{row[0]}: no such module {missing}"
        sources = "\n".join((package / m).read_text(encoding="utf-8") for m in modules)
        for name in _names(row[1]) | {n for n in _names(row[2]) if not n.endswith(".py")}:
            name = name.split(".")[0].split("[")[0]
            if re.fullmatch(r"[A-Za-z_]+", name):
                assert re.search(rf"^\s*(?:def|class) {name}\b", sources, re.M), \
                    f"{row[0]}: {name} is not defined in {modules}"


def test_loop_settings_are_loop_config() -> None:
    """The "Loop settings" table lists exactly LoopConfig's fields, with their env variable and CLI option."""
    from envloop_pipelines.core.loop.config import env_name, loop_fields

    text = (DOCS / "concepts.md").read_text(encoding="utf-8")
    rows = _table(text, "## Loop settings")
    documented = [r[0].strip("`") for r in rows]
    assert documented == [f.name for f in loop_fields()]
    from envloop_pipelines.cli import main

    start = main.commands["round"].commands["start"]  # type: ignore[attr-defined]
    options = {o for p in start.params for o in p.opts}
    for old in ("--synthesized", "--users", "--records-per-user"):  # the Renamed list's old flags still accepted
        assert old in options and f"`{old}`" in text
    assert "--override" not in options and "`--override`" in text  # removed (issue 36), and the list says so
    for row in rows:
        name = row[0].strip("`")
        option = "--recipe-override" if name == "recipe_overrides" else f"--{name.replace('_', '-')}"  # KEY=VALUE, repeated
        assert f"`{env_name(name)}`" == row[1] and f"`{option}`" == row[2], row
        assert option in options, f"envloop round start has no {option}"


def test_loop_rules_name_real_modules() -> None:
    """Every module loop-rules.md names exists (in the package, or at that path from the root: ``bench/...``)."""
    text = (DOCS / "loop-rules.md").read_text(encoding="utf-8")
    modules = set(re.findall(r"`((?:[a-z_]+/)*[a-z_]+\.py)`", text))
    assert {"ledger.py", "promotion.py", "contamination.py"} <= {m.rsplit("/", 1)[-1] for m in modules}
    package = ROOT / "envloop_pipelines"
    for module in sorted(modules):
        assert (ROOT / module).is_file() or list(package.rglob(module)), \
            f"loop-rules.md names {module}, which is not in envloop_pipelines/ nor at that path"


# --------------------------------------------------------------------------- links and the README


LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


@pytest.mark.parametrize("path", [README, *DOC_FILES], ids=lambda p: p.name)
def test_relative_links_resolve(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    text = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    for target in LINK.findall(text):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve()
        assert resolved.exists(), f"{path.name}: link to {target} does not resolve"
        if anchor and resolved.suffix == ".md":
            assert anchor in _anchors(resolved), f"{path.name}: {target}: no heading #{anchor} in {resolved.name}"


def _anchors(path: Path) -> set[str]:
    out = set()
    for line in path.read_text(encoding="utf-8").split("\n"):
        m = re.match(r"^#+\s+(.*)$", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            out.add(slug)
    return out


def test_in_page_anchors_resolve() -> None:
    for path in DOC_FILES:
        text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.DOTALL)
        for target in LINK.findall(text):
            if target.startswith("#"):
                assert target[1:] in _anchors(path), f"{path.name}: no heading {target}"


def test_readme_points_to_docs_not_shared() -> None:
    text = README.read_text(encoding="utf-8")
    assert "shared/" not in text
    for name in EXPECTED_DOCS:
        assert f"](docs/{name}" in text, f"README.md links docs/{name}"


def test_every_bench_sets_up_progress_for_its_command_line() -> None:
    """A bench is a command: ``ENVLOOP_PROGRESS=log`` must print its progress lines (a bench with no handler
    printed none), so each ``main`` calls ``progress.configure_command_line`` as the CLI does."""
    import ast

    benches = sorted((ROOT / "bench").glob("bench_*.py"))
    assert benches
    for path in benches:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        [main] = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main"]
        calls = {c.func.id for c in ast.walk(main) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)}
        assert "configure_command_line" in calls, f"{path.name}: main() does not call configure_command_line()"
