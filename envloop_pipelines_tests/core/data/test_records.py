"""Decision records: parsing, the bad-input list, the flattened table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from envloop_pipelines.core.data.errors import DataValidationError
from envloop_pipelines.core.data.jsonl import load_jsonl
from envloop_pipelines.core.data.question_table import INPUT_SCHEMA, QUESTION_SCHEMA, questions_table
from envloop_pipelines.core.data.records import record_to_json


def good_record(rid: str = "tickets/1", user: str = "u-1", **question_overrides) -> dict:
    questions = {
        "queue": {"type": "choice", "instructions": "Which queue handles this ticket?",
                  "criteria": {"billing": "Charges, refunds, invoices", "shipping": None, "account": None},
                  "label": "billing"},
        "refund": {"type": "noul", "instructions": "Does the customer ask for a refund?", "label": True},
        "priority": {"type": "score", "instructions": "How urgent is it?",
                     "criteria": ["low", "normal", "high", "critical"], "label": 2,
                     "soft_label": {"1": 0.5, "2": 0.5}},
    }
    questions.update(question_overrides)
    return {"id": rid, "state": "Subject: charged twice for order 1234",
            "questions": questions, "meta": {"user_id": user, "family": {"queue": "route"}}}


def write_lines(path: Path, lines: list[str | dict]) -> Path:
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x, ensure_ascii=False) for x in lines) + "\n",
                    encoding="utf-8")
    return path


def errors_of(path: Path, **kwargs) -> list:
    with pytest.raises(DataValidationError) as info:
        load_jsonl(path, **kwargs)
    return list(info.value.errors)


def test_good_file_parses_every_type(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "ok.jsonl", [good_record("a"), good_record("b", user="u-2")])
    report = load_jsonl(path)
    assert [r.id for r in report.records] == ["a", "b"]
    queue, refund, priority = report.records[0].questions
    assert queue.option_keys == ("billing", "shipping", "account") and queue.label == 0
    assert queue.family == "route"  # declared family
    assert refund.option_keys == ("true", "false") and refund.label == 0 and refund.family == "refund"
    assert priority.option_keys == ("0", "1", "2", "3") and priority.option_texts[2] == "high"
    assert priority.soft_label == (0.0, 0.5, 0.5, 0.0)
    assert report.records[0].group == "u-1"


def test_state_object_and_array_forms(tmp_path: Path) -> None:
    rec = good_record()
    rec["state"] = {"ticket": {"messages": [{"text": "héllo ✓"}]}}
    rec2 = good_record("b")
    rec2["state"] = ["line one", "line two"]
    report = load_jsonl(write_lines(tmp_path / "s.jsonl", [rec, rec2]))
    table = questions_table(report.records)
    assert "héllo ✓" in table.column("state_text")[0].as_py()
    assert table.schema.equals(QUESTION_SCHEMA)


# --- the bad-input list of docs/decision-data.md, each with its error -------------------------


@pytest.mark.parametrize(
    ("lines", "line", "field", "needle"),
    [
        (['{"id": "a", "state": "x", "questions": {'], 1, "<json>", "invalid JSON"),
        ([good_record(queue={"type": "choice", "instructions": "q", "criteria": {"a": None, "b": None}, "label": "c"})],
         1, "questions.queue.label", "not among the options"),
        ([good_record(refund={"type": "noul", "instructions": "q", "label": "yes"})],
         1, "questions.refund.label", "must be a boolean"),
        ([good_record(queue={"type": "choice", "instructions": "q", "criteria": {"a": None}, "label": "a"})],
         1, "questions.queue.criteria", "2 to 255 options, got 1"),
        ([good_record(queue={"type": "choice", "instructions": "q",
                             "criteria": {f"o{i}": None for i in range(256)}, "label": "o1"})],
         1, "questions.queue.criteria", "2 to 255 options, got 256"),
        ([good_record(priority={"type": "score", "instructions": "q", "criteria": {"low": "", "high": ""}, "label": 0})],
         1, "questions.priority.criteria", "not an object map"),
        (['{"id": "a", "state": "s", "meta": {"user_id": "u"}, "questions": {"q": {"type": "choice", '
          '"instructions": "i", "criteria": {"x": null, "x": "again", "y": null}, "label": "x"}}}'],
         1, "questions.q.criteria", "duplicate option keys ['x']"),
        ([good_record(priority={"type": "score", "instructions": "q", "criteria": ["a", "b"], "label": 5})],
         1, "questions.priority.label", "zero-based level index"),
        ([good_record(priority={"type": "score", "instructions": "q", "criteria": ["a", "b"], "label": 0,
                                "soft_label": {"0": 0.3, "1": 0.3}})],
         1, "questions.priority.soft_label", "sum to 1"),
        ([good_record(queue={"type": "ranking", "instructions": "q"})], 1, "questions.queue.type", "noul, choice, score"),
    ],
    ids=["invalid-json", "label-not-option", "noul-not-bool", "one-option", "256-options", "score-object-map",
         "duplicate-option-keys", "score-label-range", "soft-label-sum", "unknown-type"],
)
def test_bad_input_names_file_line_field(tmp_path: Path, lines, line, field, needle) -> None:
    path = write_lines(tmp_path / "bad.jsonl", lines)
    errors = errors_of(path)
    match = [e for e in errors if e.field == field and needle in e.message]
    assert match, errors
    assert match[0].file == str(path) and match[0].line == line
    assert f"{path}:{line}: {field}:" in str(DataValidationError(errors))


def test_255_options_accepted(tmp_path: Path) -> None:
    rec = good_record(queue={"type": "choice", "instructions": "q", "criteria": {f"o{i}": None for i in range(255)},
                             "label": "o254"})
    (record,) = load_jsonl(write_lines(tmp_path / "ok.jsonl", [rec])).records
    assert record.questions[0].n_options == 255 and record.questions[0].label == 254


def test_duplicate_record_ids_reported_at_the_repeat(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "dup.jsonl", [good_record("a"), good_record("b"), good_record("a")])
    (error,) = errors_of(path)
    assert (error.line, error.field) == (3, "id") and "first at line 1" in error.message


def test_missing_group_key_when_group_split_asked(tmp_path: Path) -> None:
    rec = good_record()
    del rec["meta"]["user_id"]
    path = write_lines(tmp_path / "nogroup.jsonl", [rec])
    load_jsonl(path)  # fine without a group split
    (error,) = errors_of(path, require_group=True)
    assert error.field == "meta.user_id" and "group" in error.message


def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n", encoding="utf-8")
    (error,) = errors_of(path)
    assert "empty file" in error.message


def test_non_utf8_file_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(json.dumps(good_record("a")).encode() + b"\n" + '{"id": "caf\u00e9"}'.encode("latin-1") + b"\n")
    (error,) = errors_of(path)
    assert error.line == 2 and error.field == "<encoding>" and "not UTF-8" in error.message


def test_state_over_token_budget(tmp_path: Path) -> None:
    rec = good_record()
    rec["state"] = "word " * 200
    path = write_lines(tmp_path / "long.jsonl", [good_record("short"), rec | {"id": "long"}])
    (error,) = errors_of(path, token_budget=100)
    assert error.line == 2 and error.field == "state" and "tokens_exceeded" in error.message


def test_all_errors_of_a_file_at_once(tmp_path: Path) -> None:
    bad_label = good_record("b", refund={"type": "noul", "instructions": "q", "label": 1})
    path = write_lines(tmp_path / "many.jsonl", ["{nope", good_record("a"), bad_label, good_record("a")])
    errors = errors_of(path)
    assert {(e.line, e.field) for e in errors} == {(1, "<json>"), (3, "questions.refund.label"), (4, "id")}


def test_record_json_round_trip(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "ok.jsonl", [good_record("a")])
    (record,) = load_jsonl(path).records
    again = write_lines(tmp_path / "again.jsonl", [record_to_json(record)])
    assert load_jsonl(again).records == (record,)


def test_table_schemas_split_labels_from_inputs(tmp_path: Path) -> None:
    report = load_jsonl(write_lines(tmp_path / "ok.jsonl", [good_record("a")]))
    table = questions_table(report.records)
    assert table.num_rows == 3
    assert "label" not in INPUT_SCHEMA.names and "soft_label" not in INPUT_SCHEMA.names
    assert table.column("label").to_pylist() == [0, 0, 2]
