"""``envloop env``: environment datasets (list, show, generate, Harbor export and import) and agent evaluation.

The group is defined here with the dataset commands; ``cli/__init__.py`` registers every command on it
(these and ``eval`` / ``compare`` from :mod:`envloop_pipelines.cli.env_eval`) with ``env.add_command``.
``show`` prints what an agent sees and the counts, never a verifier, an expected state or a solution.
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Any, Callable, Mapping

import click

_INSTRUCTION_WIDTH = 64


@click.group()
def env() -> None:
    """Environment datasets: executable, replayable environments, Harbor folders and agent evaluation."""


def _home_option(fn: Callable) -> Callable:
    return click.option("--home", type=click.Path(file_okay=False, path_type=Path), default=None,
                        help="The EnvLoop home.")(fn)


def _counts(counts: Mapping[str, Any], key: str) -> str:
    return ", ".join(f"{k} {n}" for k, n in counts.get(key, {}).items()) or "-"


def _source(source: Mapping[str, Any]) -> str:
    if "import" in source:
        return f"import {source['import']} {source.get('path', '')}".strip()
    rest = " ".join(f"{k}={v}" for k, v in source.items() if k != "generator" and v is not None)
    return f"generator {source.get('generator', '?')}" + (f" {rest}" if rest else "")


def _when(created_at: float) -> str:
    return dt.datetime.fromtimestamp(created_at, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _open(ref: str, home: Path | None) -> Any:
    from envloop_pipelines.core.environments.dataset import open_dataset

    try:
        return open_dataset(ref, home=home)
    except (FileNotFoundError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None


def _stored(dataset: Any, verb: str) -> str:
    counts = dataset.manifest["counts"]
    return (f"{verb} {dataset.name}@{dataset.version}: {counts['environments']} environments "
            f"(splits: {_counts(counts, 'splits')}; kinds: {_counts(counts, 'kinds')})")


@click.command("list")
@_home_option
@click.option("--json", "as_json", is_flag=True, help="Print the manifests as JSON.")
def list_command(home: Path | None, as_json: bool) -> None:
    """Every stored dataset version: name, version, when, environments by split and kind, where it came from."""
    from envloop_pipelines.core.environments.dataset import datasets_root, list_datasets

    rows = list_datasets(home=home)
    if as_json:
        click.echo(json.dumps(rows, indent=2, sort_keys=True))
        return
    if not rows:
        click.echo(f"no environment datasets under {datasets_root(home)}; envloop env generate or envloop env import "
                   f"makes one")
        return
    width = max(len("dataset"), *(len(r["name"]) for r in rows))
    click.echo(f"{'dataset':<{width}}  version       created                  envs  splits                  source")
    for r in rows:
        if "error" in r:
            click.echo(f"{r['name']:<{width}}  {r['version'][:12]}  unreadable: {r['error']}")
            continue
        c = r["counts"]
        click.echo(f"{r['name']:<{width}}  {r['version'][:12]}  {_when(r['created_at'])}  {c['environments']:>4}  "
                   f"{_counts(c, 'splits'):<22}  {_source(r['source'])}")


@click.command("show")
@click.argument("dataset_ref", metavar="NAME[@VERSION]")
@click.option("--environment", "environment_id", default=None, metavar="ID",
              help="Print one environment's agent view (instruction, files or question, limits) as JSON.")
@click.option("--json", "as_json", is_flag=True, help="Print the manifest and every agent view as JSON.")
@_home_option
def show_command(dataset_ref: str, environment_id: str | None, as_json: bool, home: Path | None) -> None:
    """A dataset's counts and what agents see of each environment (never its verifier or solution)."""
    dataset = _open(dataset_ref, home)
    views = dataset.agent_views()
    if environment_id is not None:
        hits = [v for v in views if v["id"] == environment_id]
        if not hits:
            raise click.ClickException(f"{dataset.name}@{dataset.version[:12]} has no environment {environment_id!r}")
        click.echo(json.dumps(hits[0], indent=2, sort_keys=True))
        return
    if as_json:
        click.echo(json.dumps({"manifest": dict(dataset.manifest), "environments": views}, indent=2, sort_keys=True))
        return
    m, c = dataset.manifest, dataset.manifest["counts"]
    click.echo(f"dataset  {dataset.name}@{dataset.version}")
    click.echo(f"created  {_when(m['created_at'])} by {_source(m['source'])}")
    click.echo(f"counts   {c['environments']} environments; splits: {_counts(c, 'splits')}; "
               f"kinds: {_counts(c, 'kinds')}; verifiers: {_counts(c, 'verifiers')}")
    click.echo(f"path     {dataset.path}")
    click.echo("")
    width = max(len("environment"), *(len(v["id"]) for v in views))
    click.echo(f"{'environment':<{width}}  kind      split    files  instruction")
    for v in views:
        text = " ".join(v["instruction"].split())
        if len(text) > _INSTRUCTION_WIDTH:
            text = text[: _INSTRUCTION_WIDTH - 3] + "..."
        click.echo(f"{v['id']:<{width}}  {v['kind']:<8}  {v['split']:<7}  {len(v['files']):>5}  {text}")


@click.command("export")
@click.argument("dataset_ref", metavar="NAME[@VERSION]")
@click.option("--format", "fmt", type=click.Choice(["harbor"]), default="harbor", show_default=True,
              help="The folder format.")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="A new (or empty) folder for the tasks.")
@click.option("--include-heldout", is_flag=True,
              help="Also export held-out environments (their tests and solutions are written owner-only).")
@_home_option
def export_command(dataset_ref: str, fmt: str, out: Path, include_heldout: bool, home: Path | None) -> None:
    """Write a dataset's terminal environments as Harbor task folders (one per environment) under --out.

    Held-out environments only with --include-heldout, and then never into the checkout or the EnvLoop home.
    """
    from envloop_pipelines.core.environments.harbor_export import HoldoutExportError, export_harbor

    dataset = _open(dataset_ref, home)
    inside = _inside_shared(out, home)
    if inside and include_heldout:
        raise click.UsageError(f"--out {out} is inside {inside}: held-out tests and solutions go to a folder outside "
                               f"it (a checkout gets committed and shared)")
    try:
        done = export_harbor(dataset, out, include_heldout=include_heldout)
    except (FileExistsError, HoldoutExportError) as exc:
        raise click.ClickException(str(exc)) from None
    if inside:
        click.echo(f"note: {done.out} is inside {inside}; sandboxed agents do not see it (the checkout and the home "
                   f"are concealed from their commands), but anyone with the checkout does", err=True)
    click.echo(f"exported {len(done.tasks)} environments of {dataset.name}@{dataset.version[:12]} as Harbor tasks "
               f"to {done.out}")
    kept = len(done.tasks) - len(done.rewritten)
    if kept:
        click.echo(f"{kept} imported Harbor task(s) written back as they came: every file byte for byte")
    if done.rewritten:
        click.echo(f"{len(done.rewritten)} written in EnvLoop's form (task.toml, environment/, tests/, solution/ made "
                   f"from the environment; docs/agents.md, 'Harbor task folders'): {', '.join(done.rewritten[:5])}"
                   f"{', ...' if len(done.rewritten) > 5 else ''}")
    if done.skipped:
        click.echo(f"skipped {len(done.skipped)} decision environments (Harbor tasks are terminal ones)")


def _inside_shared(out: Path, home: Path | None) -> str | None:
    """``the repository``/``the EnvLoop home`` when ``out`` lies inside it, else None."""
    import envloop_pipelines
    from envloop_pipelines.core.storage import envloop_home

    target = out.resolve()
    checkout = Path(envloop_pipelines.__file__).resolve().parent.parent
    places = [(envloop_home(home), f"the EnvLoop home {envloop_home(home)}")]
    if (checkout / "pyproject.toml").is_file():
        places.append((checkout, f"the repository {checkout}"))
    for root, name in places:
        if target == root or root in target.parents:
            return name
    return None


@click.command("import")
@click.argument("path", type=click.Path(exists=True, path_type=Path))
@click.option("--name", default=None, help="The dataset's name (default: the folder's name).")
@click.option("--format", "fmt", type=click.Choice(["harbor"]), default="harbor", show_default=True,
              help="The folder format.")
@_home_option
def import_command(path: Path, name: str | None, fmt: str, home: Path | None) -> None:
    """Import a Harbor task folder, or a folder of them, as an environment dataset (tests/ stay hidden)."""
    from envloop_pipelines.core.environments.harbor_import import import_harbor

    notes: list[str] = []
    try:
        dataset = import_harbor(path, name=name, home=home, on_note=notes.append)
    except (FileNotFoundError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(_stored(dataset, "imported"))
    for text in notes:  # a file kept but not used, a line of the tests that needs the network
        click.echo(f"note  {text}")
    notes = sum(len(e.meta.get("harbor", {}).get("not_reproduced", [])) for e in dataset.environments)
    if notes:
        click.echo(f"{notes} Dockerfile steps or settings are not reproduced here (envloop env show "
                   f"{dataset.name} --environment ID lists them under meta.harbor.not_reproduced)")


@click.group("generate")
def generate() -> None:
    """Build a dataset from a generator: the shell family, or a task snapshot's decision questions."""


@generate.command("shell")
@click.option("--name", required=True, help="The dataset's name.")
@click.option("--n", "n", type=click.IntRange(min=1), default=12, show_default=True, help="Environments.")
@click.option("--heldout", type=click.IntRange(min=0), default=0, show_default=True,
              help="How many of them are held out (split heldout, drawn with the seed).")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True,
              help="The first environment's seed (they are seed .. seed+n-1) and the split's seed.")
@_home_option
def generate_shell(name: str, n: int, heldout: int, seed: int, home: Path | None) -> None:
    """Terminal environments of the shell family (create a file, rename extensions, count lines)."""
    _generate("shell", name, home, n=n, heldout=heldout, seed=seed)


@generate.command("decision")
@click.option("--name", required=True, help="The dataset's name.")
@click.option("--task", required=True, help="The task whose snapshot holds the questions.")
@click.option("--split", type=click.Choice(["train", "val", "dev"]), default="dev", show_default=True,
              help="The snapshot split (test and holdout labels stay with the verifier).")
@click.option("--n", "n", type=click.IntRange(min=1), default=None, help="How many questions (default: all).")
@click.option("--heldout", type=click.IntRange(min=0), default=0, show_default=True,
              help="How many of them are held out.")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True, help="The seed of both draws.")
@click.option("--snapshot", "snapshot_id", default=None, help="The snapshot id (default: the task's current one).")
@_home_option
def generate_decision(name: str, task: str, split: str, n: int | None, heldout: int, seed: int,
                      snapshot_id: str | None, home: Path | None) -> None:
    """Decision environments from a task snapshot's questions, each verified by the rule verifier on its label."""
    _generate("decision", name, home, task=task, split=split, n=n, heldout=heldout, seed=seed,
              snapshot_id=snapshot_id)


def _generate(generator: str, name: str, home: Path | None, **params: Any) -> None:
    from envloop_pipelines.core.environments.generators import generate_dataset

    try:
        dataset = generate_dataset(generator, name, home=home, **params)
    except (FileNotFoundError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(_stored(dataset, "stored"))


__all__ = ["env", "export_command", "generate", "import_command", "list_command", "show_command"]
