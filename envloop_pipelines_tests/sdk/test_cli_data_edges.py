"""``envloop data validate`` on what a person's file gets wrong (issue 27, item 10): every error on its line."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from envloop_pipelines.cli import main
from envloop_pipelines_tests.core.data.test_records import good_record, write_lines


def validate(path: Path, home: Path) -> "CliRunner.invoke":
    return CliRunner().invoke(main, ["data", "validate", str(path)], env={"ENVLOOP_HOME": str(home)},
                              catch_exceptions=False)


def with_split(rid: str, user: str, split: str) -> dict:
    record = good_record(rid, user=user)
    record["meta"]["split"] = split
    return record


def test_meta_split_errors_name_their_line(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "s.jsonl", [with_split("a", "u1", "train"), with_split("b", "u2", "tset"),
                                              with_split("c", "u1", "test")])
    result = validate(path, tmp_path / "home")
    assert result.exit_code == 1
    assert f"{path}:2: meta.split: unknown split 'tset'" in result.output, result.output
    assert f"{path}:3: meta.split: group 'u1' is declared in 'train' and 'test'" in result.output, result.output


def test_every_byte_that_is_not_utf8_is_reported_by_line_and_column(tmp_path: Path) -> None:
    good = json.dumps(good_record("a")).encode()
    bad = json.dumps(good_record("b")).encode().replace(b"charged", b"ch\xe4rged").replace(b"order", b"\xf6rder")
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(good + b"\n" + bad + b"\n" + b'{"id": "\xff"}\n')
    result = validate(path, tmp_path / "home")
    assert result.exit_code == 1
    first, second = bad.index(b"\xe4") + 1, bad.index(b"\xf6") + 1
    assert f"{path}:2: <encoding>: not UTF-8: byte 0xe4 at column {first}" in result.output, result.output
    assert f"{path}:2: <encoding>: not UTF-8: byte 0xf6 at column {second}" in result.output
    assert f"{path}:3: <encoding>: not UTF-8: byte 0xff at column 9" in result.output
    assert "3 error(s)" in result.output


def test_a_number_as_an_option_description_is_refused_as_the_server_refuses_it(tmp_path: Path) -> None:
    record = good_record("a", queue={"type": "choice", "instructions": "Which queue?",
                                     "criteria": {"billing": 1, "shipping": None, "account": "Logins"},
                                     "label": "billing"},
                         priority={"type": "score", "instructions": "How urgent?", "criteria": ["low", 2, "high"],
                                   "label": 1})
    path = write_lines(tmp_path / "n.jsonl", [record])
    result = validate(path, tmp_path / "home")
    assert result.exit_code == 1
    assert f"{path}:1: questions.queue.criteria: criteria['billing'] must be text, an object or an array, or null, got int" \
        in result.output, result.output
    assert f"{path}:1: questions.priority.criteria: criteria[1] must be text, an object or an array, got int" in result.output
