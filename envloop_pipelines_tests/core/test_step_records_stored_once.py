"""Issue 25, "core still writes two step records itself at the IO manager's path": a round step's record is the
IO manager's to store (``resources/round_store.py``), not the core function's.

Parsed here: no function of ``core/decision_loop`` saves a round step's record through ``RoundStore.save``. The
decision's retry idempotence comes from the ledger (the record rides on ``round_decided``,
``Ledger.round_decision``), not from a file at the IO manager's path
(``test_floor_and_power.py::test_the_decision_lives_in_the_ledger_and_a_retry_returns_it``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import envloop_pipelines

DECISION_LOOP = Path(envloop_pipelines.__file__).resolve().parent / "core" / "decision_loop"


def _saves(folder: Path) -> set[tuple[str, str]]:
    found = set()
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "save"
                    and node.args):
                found.add((path.name, ast.unparse(node.args[0])))
    return found


def test_core_saves_no_round_step_record() -> None:
    assert _saves(DECISION_LOOP) == set()


def test_the_scan_sees_a_save(tmp_path: Path) -> None:
    """The scan is not blind: a step function that saves its own record is found."""
    (tmp_path / "verdict.py").write_text("def decide(store, decision, key):\n"
                                         "    store.save(PROMOTION_DECISION, decision, key)\n", encoding="utf-8")
    assert _saves(tmp_path) == {("verdict.py", "PROMOTION_DECISION")}
