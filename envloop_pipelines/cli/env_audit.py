"""``envloop env audit``: can a dataset's tasks be passed without being solved?

Runs each task's own solution (the control) and the scripted hostile strategies of
:mod:`envloop_pipelines.core.environments.audit` against the task's verifier, in the real sandbox, and
prints per task whether any strategy earned the reward, and which.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import click


def audit_lines(report: Mapping[str, Any]) -> list[str]:
    """The printed report (from :meth:`AuditReport.to_dict`)."""
    tasks = report["tasks"]
    width = max([len("task"), *(len(t["environment_id"]) for t in tasks)])
    lines = [f"audit {report['dataset']}@{report['version'][:12]}  {len(tasks)} tasks x "
             f"{len(report['strategies'])} hostile strategies, each task's solution as the control", "",
             f"{'task':<{width}}  oracle   verdict    passed by"]
    for t in tasks:
        oracle = "none" if t["oracle"] is None else ("passed" if t["oracle"]["passed"] else t["oracle"]["status"])
        lines.append(f"{t['environment_id']:<{width}}  {oracle:<7}  {t['verdict']:<9}  "
                     f"{', '.join(t['passed_by']) or '-'}")
    lines.append("")
    lines.append(f"{report['hackable']} of {len(tasks)} tasks can be passed without being solved"
                 + ("; 'unchecked': the task's own solution did not pass, so its verifier proves nothing here"
                    if any(t["verdict"] == "unchecked" for t in tasks) else ""))
    if report["skipped"]:
        lines.append(f"skipped {len(report['skipped'])} decision environments (no verifier an agent can reach)")
    return lines


@click.command("audit")
@click.argument("dataset_ref", metavar="NAME[@VERSION]")
@click.option("--workers", type=click.IntRange(min=1), default=1, show_default=True, help="Tasks audited side by side.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON (every trial's verdict).")
@click.option("--home", type=click.Path(path_type=Path), default=None, help="The EnvLoop home (default: $ENVLOOP_HOME).")
def audit_command(dataset_ref: str, workers: int, as_json: bool, home: Path | None) -> None:
    """Try scripted hostile strategies against every task's verifier; name the tasks they pass and how.

    The strategies plant what a verifier might pick up (reward files, dotfiles in HOME, modules beside the
    working directory, pytest configuration), link the paths the tests read to the tests, make the files the
    tests compare the same, and leave background writers. Exits 1 when a task can be passed without being solved.
    """
    from envloop_pipelines.core.environments.audit import audit_dataset
    from envloop_pipelines.core.environments.dataset import open_dataset

    try:
        dataset = open_dataset(dataset_ref, home=home)
    except (FileNotFoundError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    report = audit_dataset(dataset, workers=workers, home=home).to_dict()
    click.echo(json.dumps(report, indent=2) if as_json else "\n".join(audit_lines(report)))
    if report["hackable"]:
        raise SystemExit(1)
