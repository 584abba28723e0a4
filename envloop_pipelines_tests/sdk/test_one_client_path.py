"""One client path (issue 25): both clients behind one protocol, Dagster's names spelled once, one hypothesis
parser and one budget loop for the CLI, the SDK and the daemon's schedule."""

from __future__ import annotations

import ast
import inspect
import json
import re
from pathlib import Path

import pytest

import envloop_pipelines
from envloop_pipelines import names
from envloop_pipelines.core.loop.budget import LoopBudget, NextRound, drive_loop, spent
from envloop_pipelines.core.decision_loop.proposals import ProposalError, parse_proposal
from envloop_pipelines.sdk.client import Client
from envloop_pipelines.sdk.local import LocalClient
from envloop_pipelines.sdk.protocol import LOOP_CLIENT_METHODS, LoopClient

PACKAGE = Path(envloop_pipelines.__file__).resolve().parent
VALID = {"change": {"kind": "data"}, "predicted_delta": 0.01, "seeds": 2}


# --------------------------------------------------------------------------- one protocol


def test_local_client_is_a_loop_client(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENVLOOP_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster"))
    client = LocalClient(task="personal_agent")
    assert isinstance(client, LoopClient)
    assert client.rounds() == [] and client.ledger() == [] and client.release_cards() == []


def _protocol_members() -> list[str]:
    return [n for n in vars(LoopClient) if not n.startswith("_") and n not in ("LOOP_CLIENT_METHODS",)]


@pytest.mark.parametrize("cls", [Client, LocalClient])
def test_both_clients_have_the_protocols_members(cls: type) -> None:
    # The remote Client's ``task`` asks its deployment, so isinstance() needs one: compare the classes instead.
    members = _protocol_members()
    assert set(LOOP_CLIENT_METHODS) | {"task"} == set(members)
    missing = [m for m in members if not hasattr(cls, m)]
    assert not missing, f"{cls.__name__} lacks {missing}"


@pytest.mark.parametrize("method", LOOP_CLIENT_METHODS)
def test_both_clients_take_the_protocols_arguments(method: str) -> None:
    """Every parameter the protocol names is in each client's signature: same name, kind and default."""
    wanted = inspect.signature(getattr(LoopClient, method)).parameters
    for cls in (Client, LocalClient):
        got = inspect.signature(getattr(cls, method)).parameters
        for name, p in wanted.items():
            assert name in got, f"{cls.__name__}.{method} has no parameter {name!r}"
            assert got[name].kind == p.kind, f"{cls.__name__}.{method}({name}): {got[name].kind} != {p.kind}"
            if p.default is not inspect.Parameter.empty and p.default is not Ellipsis:
                assert got[name].default == p.default, f"{cls.__name__}.{method}({name}) default"


def test_cli_reaches_rounds_only_through_a_client() -> None:
    """The CLI neither executes Dagster jobs nor asks the budget itself: it calls a client and prints (every file of
    the CLI: the loop's commands are split by idea, ``round.py``, ``loop_runs.py``, ``clients.py``, ``render.py``...)."""
    files = sorted((PACKAGE / "cli").glob("*.py"))
    assert {"round.py", "loop_runs.py", "clients.py", "render.py"} <= {p.name for p in files}
    for path in files:
        text = path.read_text(encoding="utf-8")
        for forbidden in ("execute_in_process", "next_round(", "start_loop(", "resolve_job_def", "loop_resource("):
            assert forbidden not in text, f"{path.name}: {forbidden}"


# --------------------------------------------------------------------------- Dagster's names, spelled once


def _string_constants(path: Path) -> list[tuple[int, str]]:
    """Every string literal of the file but those of ``__all__`` (Python names, not Dagster's)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    exports = {id(c) for n in ast.walk(tree) if isinstance(n, ast.Assign)
               and any(isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets) for c in ast.walk(n.value)}
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in exports]


def test_dagster_names_are_spelled_once() -> None:
    """Tags (``envloop/loop`` ...) and job names appear as a string only in ``names.py``."""
    spelled = {v for k, v in vars(names).items() if k.isupper() and isinstance(v, str)
               and (k.endswith("_TAG") or k.endswith("_JOB"))}
    assert {"envloop/loop", "round_job", "dagster/partition"} <= spelled
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "names.py":
            continue
        found += [f"{path.relative_to(PACKAGE)}:{line}: {value}" for line, value in _string_constants(path)
                  if value in spelled]
    assert not found, "spell these through envloop_pipelines.names:\n" + "\n".join(found)


def test_every_run_tag_is_defined_in_names() -> None:
    """A run tag (``envloop/...``, ``dagster/...``) is a constant of ``names.py``, wherever it is used: the
    GPU pool's and Dagster's no-retry tag were spelled in ``defs/rounds/assets.py`` and escaped the test above."""
    tag = re.compile(r"(envloop|dagster)/[A-Za-z_\-]+")
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "names.py":
            continue
        found += [f"{path.relative_to(PACKAGE)}:{line}: {value}" for line, value in _string_constants(path)
                  if tag.fullmatch(value)]
    assert not found, "define these run tags in envloop_pipelines/names.py:\n" + "\n".join(found)


def test_names_imports_nothing_of_ours() -> None:
    tree = ast.parse((PACKAGE / "names.py").read_text(encoding="utf-8"))
    imported = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert all(getattr(n, "module", "") == "__future__" for n in imported)


# --------------------------------------------------------------------------- one hypothesis parser


def test_parse_proposal_reads_every_form(tmp_path: Path) -> None:
    path = tmp_path / "hyp.json"
    path.write_text(json.dumps(VALID), encoding="utf-8")
    assert parse_proposal(VALID) == parse_proposal(json.dumps(VALID)) == parse_proposal(path) == VALID
    assert parse_proposal(str(path)) == VALID
    assert parse_proposal(None) is None and parse_proposal("  ") is None


def test_parse_proposal_names_file_line_and_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"change": {"kind": "data"},\n "seeds": [0,]}', encoding="utf-8")
    with pytest.raises(ProposalError, match=rf"^{re.escape(str(bad))}: line 2: "):
        parse_proposal(bad)
    with pytest.raises(ProposalError, match=r"^hypothesis: must be a JSON object"):
        parse_proposal("[1, 2]")
    with pytest.raises(ProposalError, match=r"'nope\.json' is neither JSON text nor a file"):
        parse_proposal("nope.json")
    with pytest.raises(ProposalError, match=r"^proposal_json: line 1: "):  # the launchpad's text is never a path
        parse_proposal("nope.json", source="proposal_json", text_only=True)
    with pytest.raises(ProposalError) as refused:
        parse_proposal({**VALID, "seed": 1, "seeds": [1, 1]})
    assert any("unknown field 'seed'" in e for e in refused.value.errors)
    assert any(e.startswith("seeds: a round's seeds are drawn by the loop") for e in refused.value.errors)


def test_every_door_uses_the_one_parser() -> None:
    for door in ("cli/clients.py", "sdk/client.py", "defs/rounds/assets.py"):
        text = (PACKAGE / door).read_text(encoding="utf-8")
        assert "parse_proposal(" in text, door
        assert "json.loads(proposal" not in text and "proposal_errors(" not in text, door


# --------------------------------------------------------------------------- one budget loop


def test_spent_is_the_budget_rule() -> None:
    budget = LoopBudget(max_rounds=3, patience=2, max_wall_s=100)
    assert spent(budget, [], 0) is None
    assert spent(budget, [True, False], 10) is None
    assert spent(budget, [False, False], 10) == "patience spent: 2 rounds without a promotion"
    assert spent(budget, [True, True, True], 10) == "budget spent: 3 of 3 rounds"
    assert spent(budget, [True], 101) == "wall time spent: 100s"


def test_drive_loop_runs_until_the_budget_or_a_failure() -> None:
    budget = LoopBudget(max_rounds=5, patience=2, max_wall_s=100)
    promoted: list[bool] = []
    outcomes = iter([True, False, False, True])

    def ask() -> NextRound:
        reason = spent(budget, promoted, 0)
        return NextRound(None, reason) if reason else NextRound(f"r{len(promoted) + 1:04d}", "within budget")

    def run(nxt: NextRound) -> bool:
        promoted.append(next(outcomes))
        return True

    assert drive_loop(ask, run) == "patience spent: 2 rounds without a promotion" and promoted == [True, False, False]
    assert drive_loop(lambda: NextRound("r0009", "go"), lambda nxt: False) == "round r0009 failed"


def _calls(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {n.func.id if isinstance(n.func, ast.Name) else getattr(n.func, "attr", "")
            for n in ast.walk(tree) if isinstance(n, ast.Call)}


def test_the_budget_loop_is_one_function() -> None:
    """The rule lives in ``budget.spent`` alone; the clients loop with ``drive_loop``; the daemon asks
    ``next_round``."""
    assert "spent" in _calls(PACKAGE / "core" / "loop" / "budget.py")  # next_round applies it
    assert {"drive_loop", "spent"} <= _calls(PACKAGE / "sdk" / "client.py")  # the remote client
    assert "drive_loop" in _calls(PACKAGE / "sdk" / "local.py")  # the CLI's local client
    assert {"start_loop", "next_round"} <= _calls(PACKAGE / "defs" / "rounds" / "schedules.py")
    assert "run_loop" in _calls(PACKAGE / "cli" / "round.py")  # envloop round start -> cli/loop_runs.py -> a client
    assert "run_loop" in _calls(PACKAGE / "cli" / "loop_runs.py")
    patience_rule = re.compile(r"\[-\s*[\w.]*patience")
    found = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if patience_rule.search(p.read_text())]
    assert found == ["core/loop/budget.py"], found
