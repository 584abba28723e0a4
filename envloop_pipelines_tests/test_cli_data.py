"""The ``envloop data`` commands, run as a user runs them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from envloop_pipelines.cli import main
from envloop_pipelines_tests.core.data.test_records import good_record, write_lines


def run(args: list[str], home: Path) -> "CliRunner.invoke":
    return CliRunner().invoke(main, args, env={"ENVLOOP_HOME": str(home)}, catch_exceptions=False)


def test_generate_import_show(tmp_path: Path) -> None:
    home = tmp_path / "home"
    result = run(["data", "generate", "--users", "30", "--records-per-user", "4", "--json"], home)
    assert result.exit_code == 0, result.output
    generated = json.loads(result.output)
    assert generated["records"] == 120
    assert Path(generated["path"]).exists()
    shown = json.loads(run(["data", "show", "personal_agent", "--json"], home).output)
    assert shown["snapshot_id"] == generated["summary"]["snapshot_id"]
    assert sum(s["records"] for s in shown["splits"].values()) == 120
    # Same seed → same snapshot; the file is byte-identical.
    again = json.loads(run(["data", "generate", "--users", "30", "--records-per-user", "4", "--json"], home).output)
    assert again["sha256"] == generated["sha256"] and again["summary"]["snapshot_id"] == shown["snapshot_id"]


def test_validate_reports_every_error_and_import_writes_nothing(tmp_path: Path) -> None:
    home = tmp_path / "home"
    bad = write_lines(tmp_path / "bad.jsonl", [good_record("a"), "{oops",
                                                good_record("b", refund={"type": "noul", "instructions": "q", "label": 3})])
    result = run(["data", "validate", str(bad)], home)
    assert result.exit_code == 1
    assert f"{bad}:2: <json>: invalid JSON" in result.output
    assert f"{bad}:3: questions.refund.label" in result.output
    result = run(["data", "import", str(bad), "--task", "tickets"], home)
    assert result.exit_code == 1 and not (home / "tasks").exists()


def test_import_and_show_a_user_file(tmp_path: Path) -> None:
    home = tmp_path / "home"
    good = write_lines(tmp_path / "t.jsonl", [good_record(f"r{i}", user=f"u{i}") for i in range(20)])
    assert "ok: " in run(["data", "validate", str(good)], home).output
    result = run(["data", "import", str(good), "--task", "tickets", "--fractions",
                  "train=0.5,val=0.1,dev=0.2,test=0.1,holdout=0.1"], home)
    assert result.exit_code == 0, result.output
    assert "train" in result.output and "route=" in result.output
    shown = run(["data", "show", "tickets"], home)
    assert shown.exit_code == 0 and "tickets" in shown.output
    missing = run(["data", "show", "nope"], home)
    assert missing.exit_code == 1 and "no snapshot" in missing.output


def test_bad_fractions_named(tmp_path: Path) -> None:
    good = write_lines(tmp_path / "t.jsonl", [good_record("r1")])
    result = CliRunner().invoke(main, ["data", "import", str(good), "--task", "t", "--fractions", "train=2"],
                                env={"ENVLOOP_HOME": str(tmp_path / "h")})
    assert result.exit_code == 2 and "--fractions" in result.output


def test_console_script_is_installed() -> None:
    exe = Path(sys.executable).with_name("envloop")
    out = subprocess.run([str(exe), "data", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "generate" in out.stdout
