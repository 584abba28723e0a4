"""``envloop data``: generate the built-in benchmark, validate, import and show decision data."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from envloop_pipelines.core.data.errors import DataValidationError


def _echo_json(value: Any) -> None:
    click.echo(json.dumps(value, indent=2, ensure_ascii=False, sort_keys=False))


def _fail_on_data_errors(fn):  # noqa: ANN001, ANN202 - click callback decorator
    """Turn a :class:`DataValidationError` into a readable message and exit code 1."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        try:
            return fn(*args, **kwargs)
        except DataValidationError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(1)
        except FileNotFoundError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(1)

    return wrapper


# --------------------------------------------------------------------------- data


@click.group()
def data() -> None:
    """Decision data: generate the built-in benchmark, validate, import, show."""


def _print_summary(summary: dict[str, Any]) -> None:
    click.echo(f"task {summary['task']}  snapshot {summary['snapshot_id'][:12]}  version {summary['benchmark_version']}")
    header = f"{'split':<8} {'groups':>6} {'records':>7} {'questions':>9}  by family / by type"
    click.echo(header)
    for split, s in summary["splits"].items():
        fam = ", ".join(f"{k}={v}" for k, v in s["families"].items())
        typ = ", ".join(f"{k}={v}" for k, v in s["types"].items())
        click.echo(f"{split:<8} {s['groups']:>6} {s['records']:>7} {s['questions']:>9}  {fam}  |  {typ}")


@data.command("generate")
@click.option("--users", "n_users", type=int, default=None, help="Number of users (default: the benchmark default).")
@click.option("--records-per-user", type=int, default=None, help="Records (states) per user.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--task", default="personal_agent", show_default=True, help="Task name to import the benchmark as.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Where to write the JSONL (default: <home>/generated/<task>-seed<S>.jsonl).")
@click.option("--no-import", is_flag=True, help="Only write the JSONL file.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@_fail_on_data_errors
def data_generate(n_users: int | None, records_per_user: int | None, seed: int, task: str, out: Path | None,
                  no_import: bool, as_json: bool) -> None:
    """Generate the built-in personal-agent benchmark and import it as a task."""
    from envloop_pipelines.core.benchmark.builtin_task import generate_builtin_task

    result = generate_builtin_task(task=task, n_users=n_users, records_per_user=records_per_user, seed=seed,
                                   out=out, do_import=not no_import)
    if as_json:
        _echo_json(result)
        return
    click.echo(f"wrote {result['records']} records to {result['path']} (sha256 {result['sha256'][:12]}) "
               f"in {result['generate_s']:.2f}s")
    if "summary" in result:
        click.echo(f"imported in {result['import_s']:.2f}s")
        _print_summary(result["summary"])


@data.command("validate")
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--mapping", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Column mapping (YAML/JSON) for CSV and Parquet files.")
@click.option("--require-group/--no-require-group", default=True, show_default=True,
              help="Every record needs a group key (needed to import with a group split).")
@_fail_on_data_errors
def data_validate(file: Path, mapping: Path | None, require_group: bool) -> None:
    """Check FILE against the decision-record contract; print every error at once."""
    from envloop_pipelines.core.data.tabular import ColumnMapping, load_records

    report = load_records(file, mapping=ColumnMapping.from_file(mapping) if mapping else None, require_group=require_group)
    n_questions = sum(len(r.questions) for r in report.records)
    click.echo(f"ok: {file}: {len(report.records)} records, {n_questions} questions")


@data.command("import")
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--task", required=True, help="Task name.")
@click.option("--mapping", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Column mapping (YAML/JSON) for CSV and Parquet files.")
@click.option("--fractions", default="train=0.6,val=0.1,dev=0.1,test=0.1,holdout=0.1", show_default=True,
              help="Share of groups per split.")
@click.option("--seed", type=int, default=0, show_default=True, help="Split seed.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@_fail_on_data_errors
def data_import(file: Path, task: str, mapping: Path | None, fractions: str, seed: int, as_json: bool) -> None:
    """Validate FILE and import it as an immutable, content-addressed snapshot of TASK."""
    from envloop_pipelines.core.data.datasets import import_file
    from envloop_pipelines.core.data.splits import SplitFractions
    from envloop_pipelines.core.data.tabular import ColumnMapping

    try:
        split_fractions = SplitFractions.parse(fractions)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--fractions") from None
    snapshot = import_file(file, task, mapping=ColumnMapping.from_file(mapping) if mapping else None,
                           fractions=split_fractions, seed=seed)
    summary = snapshot.summary()
    if as_json:
        _echo_json(summary)
    else:
        _print_summary(summary)


@data.command("show")
@click.argument("task")
@click.option("--json", "as_json", is_flag=True, help="Print as JSON.")
@_fail_on_data_errors
def data_show(task: str, as_json: bool) -> None:
    """Counts per split, family and question type of TASK's current snapshot."""
    from envloop_pipelines.core.data.snapshots import open_task

    summary = open_task(task).summary()
    if as_json:
        _echo_json(summary)
    else:
        _print_summary(summary)
