"""Issue 25, "core still writes two step records itself at the IO manager's path": a round step's record is the
IO manager's to store (``resources/round_store.py``), not the core function's.

Parsed here: no function of ``core/decision_loop`` saves a round step's record through ``RoundStore.save`` but
the decision, whose record is written before ``decide_round`` returns on purpose: a retry of the step finds it
and returns the same decision (``verdict.decide_round`` reads it first) instead of deciding and publishing again.
"""

from __future__ import annotations

import ast
from pathlib import Path

import envloop_pipelines

DECISION_LOOP = Path(envloop_pipelines.__file__).resolve().parent / "core" / "decision_loop"
#: (file, first argument of ``.save``) pairs allowed: the decision, kept for the retry's idempotence.
ALLOWED = {("verdict.py", "PROMOTION_DECISION")}


def _saves() -> set[tuple[str, str]]:
    found = set()
    for path in sorted(DECISION_LOOP.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "save"
                    and node.args):
                found.add((path.name, ast.unparse(node.args[0])))
    return found


def test_core_saves_no_round_step_record_but_the_decision() -> None:
    assert _saves() <= ALLOWED, sorted(_saves() - ALLOWED)


def test_the_scan_sees_a_save() -> None:
    """The scan is not blind: the decision's own save is found."""
    assert ("verdict.py", "PROMOTION_DECISION") in _saves()
