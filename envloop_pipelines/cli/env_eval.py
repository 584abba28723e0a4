"""``envloop env eval`` and ``envloop env compare``: agents on an environment dataset, pass@k with CIs.

``eval`` runs K attempts of each agent (``--model``, repeatable: several agents
behind one URL, or ``--agent-url`` given once per model) on every environment
of a dataset, each attempt in its own sandbox, and prints pass@1 and pass@k
with their intervals, the per-environment table and the cost; the run is
stored under the home and logged to MLflow. ``compare`` prints the stored
runs of a dataset version side by side, one line per run.

On held-out environments (split ``heldout``) only aggregates are printed:
no per-environment table, no transcripts (rule 4 of the loop's rules).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Sequence

import click

from envloop_pipelines.core.sandbox.base import BACKENDS


def _pct(x: float) -> str:
    return f"{x:.3f}"


def _ci(p: Mapping[str, Any]) -> str:
    return f"{_pct(p['value'])} [{_pct(p['ci_low'])}, {_pct(p['ci_high'])}]"


def summary_lines(summary: Mapping[str, Any]) -> list[str]:
    """The printed report of one evaluation (from its summary)."""
    agent = summary["agent"]
    level = int(round(100 * summary["pass_at_k"][0]["confidence_level"]))
    lines = [
        f"dataset {summary['dataset']}@{summary['dataset_version'][:12]}  split {summary['split'] or 'all'}  "
        f"{summary['n_environments']} environments x {summary['attempts_per_environment']} attempts",
        f"agent   {agent['model']} at {agent['base_url']} ({agent['kind']})",
        "",
    ]
    for p in summary["pass_at_k"]:
        how = f"{'Wilson' if p['method'] == 'wilson' else 'bootstrap'} over {p['n_environments']} environments"
        lines.append(f"pass@{p['k']:<3} {_pct(p['value'])}  {level}% CI [{_pct(p['ci_low'])}, {_pct(p['ci_high'])}]  ({how})")
    st = summary["statuses"]
    errors = ", ".join(f"{reason} x{n}" for reason, n in summary.get("errors", {}).items())
    lines.append(f"attempts {summary['n_attempts']}: {st['passed']} passed, {st['failed']} failed, {st['error']} errors"
                 + (f" ({errors})" if errors else ""))
    for outcome, reason in (summary.get("why") or {}).items():
        lines.append(f"why      {outcome}: {reason}")
    c = summary["cost"]
    lines.append(f"cost     {c['elapsed_s']:.1f} s elapsed, {c['mean_attempt_s']:.2f} s per attempt; "
                 f"{c['prompt_tokens']} prompt + {c['completion_tokens']} completion tokens "
                 f"({c['tokens_per_attempt']:.0f} per attempt); {c['tool_calls']} tool calls")
    lines.append("")
    if summary["aggregate_only"]:
        lines.append("per-environment results withheld: held-out environments answer with aggregates only (rule 4)")
    else:
        rows = summary["per_environment"]
        width = max([len("environment")] + [len(r["environment_id"]) for r in rows])
        lines.append(f"{'environment':<{width}}  attempts  passed  rate   turns  tokens  wall_s")
        for r in rows:
            lines.append(f"{r['environment_id']:<{width}}  {r['attempts']:>8}  {r['passed']:>6}  {r['pass_rate']:.2f}  "
                         f"{r['mean_turns']:>5.1f}  {r['tokens']:>6}  {r['wall_s']:>6.2f}")
    if summary.get("run_dir"):
        lines.append(f"run     {summary['run_dir']}")
    return lines


def all_errored(summary: Mapping[str, Any]) -> bool:
    """Every attempt of the run ended in an error (a dead endpoint, a missing engine): it measured nothing."""
    return summary["n_attempts"] > 0 and summary["statuses"].get("error", 0) == summary["n_attempts"]


def comparison_lines(summaries: Sequence[Mapping[str, Any]]) -> list[str]:
    """One table, one line per evaluation: pass@1 and the largest pass@k with CIs, errors and cost.

    Runs whose every attempt errored measured nothing: they are listed apart, below the table, with why.
    """
    broken = [s for s in summaries if all_errored(s)]
    summaries = [s for s in summaries if not all_errored(s)]
    tail = []
    if broken:
        tail = ["", f"{len(broken)} run(s) where every attempt errored (no result; not in the table):"]
        for s in broken:
            reason = next(iter((s.get("why") or {}).values()), "") or ", ".join(s.get("errors") or {})
            tail.append(f"  {s['agent']['model']} at {s['agent']['base_url']}: {s['n_attempts']} errors: {reason}")
    if not summaries:
        return tail[1:]
    ks = sorted({p["k"] for s in summaries for p in s["pass_at_k"]})
    top = ks[-1]
    names = [f"{s['agent']['model']} at {s['agent']['base_url']}" for s in summaries]
    width = max([len("agent")] + [len(n) for n in names])
    head = f"{'agent':<{width}}  {'pass@1 [95% CI]':<22}"
    if top > 1:
        head += f"  {f'pass@{top} [95% CI]':<22}"
    head += "  envs  K  errors  s/attempt  tokens/attempt"
    lines = [head]
    for name, s in zip(names, summaries):
        by_k = {p["k"]: p for p in s["pass_at_k"]}
        line = f"{name:<{width}}  {_ci(by_k[1]):<22}"
        if top > 1:
            line += f"  {(_ci(by_k[top]) if top in by_k else '-'):<22}"
        line += (f"  {s['n_environments']:>4}  {s['attempts_per_environment']}  {s['statuses']['error']:>6}  "
                 f"{s['cost']['mean_attempt_s']:>9.2f}  {s['cost']['tokens_per_attempt']:>14.0f}")
        lines.append(line)
    return lines + tail


def _load_dataset(ref: str, home: Path | None) -> Any:
    from envloop_pipelines.core.agents.evaluate import load_environments

    try:
        return load_environments(ref, home=home)
    except (FileNotFoundError, ValueError, KeyError) as exc:
        raise click.BadParameter(str(exc), param_hint="--dataset") from None


@click.command("eval")
@click.option("--dataset", "dataset_ref", required=True, metavar="NAME[@VERSION]", help="The environment dataset.")
@click.option("--agent-url", "agent_urls", multiple=True, metavar="URL",
              help="The agent's API root (e.g. http://127.0.0.1:8000/v1); once, or once per --model.")
@click.option("--model", "models", multiple=True, help="The model name; repeat to compare agents.")
@click.option("--agent", "builtin_agent", type=click.Choice(["oracle"]), default=None,
              help="A built-in agent instead of an endpoint: oracle runs each task's own reference solution "
                   "(solution/solve.sh), to check an import.")
@click.option("--api-key-env", default=None, metavar="VAR", help="Environment variable holding the agent's bearer key.")
@click.option("--agent-kind", type=click.Choice(["chat", "jev"]), default="chat", show_default=True,
              help="chat: OpenAI-compatible chat with tools; jev: a Jev /systemone endpoint (decision environments).")
@click.option("--attempts", type=click.IntRange(min=1), default=1, show_default=True, help="K attempts per environment.")
@click.option("--split", default=None, help="Only this split's environments (train, heldout, ...).")
@click.option("--max-turns", type=click.IntRange(min=1), default=16, show_default=True, help="Model calls per attempt.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=8192, show_default=True,
              help="Completion tokens per attempt.")
@click.option("--wall-s", type=click.FloatRange(min=0, min_open=True), default=300.0, show_default=True,
              help="Seconds per attempt.")
@click.option("--workers", type=click.IntRange(min=1), default=4, show_default=True, help="Attempts run side by side.")
@click.option("--backend", type=click.Choice(BACKENDS), default="local", show_default=True,
              help="Where each attempt's commands and verifier run (envloop sandbox exec's backends).")
@click.option("--image", default=None, help="Container image of the docker and k8s backends.")
@click.option("--home", type=click.Path(file_okay=False, path_type=Path), default=None, help="The EnvLoop home.")
@click.option("--no-mlflow", is_flag=True, help="Do not log the run to MLflow.")
@click.option("--json", "as_json", is_flag=True, help="Print the summaries as JSON.")
def eval_command(dataset_ref: str, agent_urls: tuple[str, ...], models: tuple[str, ...], builtin_agent: str | None,
                 api_key_env: str | None,
                 agent_kind: str, attempts: int, split: str | None, max_turns: int, max_tokens: int, wall_s: float,
                 workers: int, backend: str, image: str | None, home: Path | None, no_mlflow: bool,
                 as_json: bool) -> None:
    """Evaluate agents on a dataset's environments: pass@1 and pass@k with CIs, per environment, cost."""
    from envloop_pipelines.core.agents.client import AgentSpec
    from envloop_pipelines.core.agents.evaluate import evaluate_agent, track_evaluation
    from envloop_pipelines.core.agents.runner import AttemptLimits

    if builtin_agent is not None and (agent_urls or models):
        raise click.UsageError("--agent oracle runs the tasks' own solutions: give it without --agent-url and --model")
    if builtin_agent is None and not (agent_urls and models):
        raise click.UsageError("give the agent: --agent-url URL --model M (or --agent oracle)")
    if len(agent_urls) not in (0, 1, len(models)):
        raise click.BadParameter(f"give --agent-url once, or once per --model ({len(models)}); got {len(agent_urls)}",
                                 param_hint="--agent-url")
    try:
        agents = [AgentSpec(url, model, api_key_env=api_key_env, kind=agent_kind)  # type: ignore[arg-type]
                  for url, model in zip(agent_urls * len(models) if len(agent_urls) == 1 else agent_urls, models)]
        if builtin_agent == "oracle":
            agents = [AgentSpec.oracle()]
        limits = AttemptLimits(max_turns=max_turns, max_tokens=max_tokens, wall_s=wall_s,
                               request_timeout_s=min(60.0, wall_s))
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    from envloop_pipelines.cli.sandbox import backend_options
    from envloop_pipelines.core.sandbox import make_sandbox

    options = backend_options(backend, image)
    sandbox = None if backend == "local" else make_sandbox(backend, **options)  # None: a local sandbox per episode
    if sandbox is not None and hasattr(sandbox, "available"):
        ok, why = sandbox.available()
        if not ok:
            raise click.ClickException(f"--backend {backend}: no {backend} engine answers on this machine ({why}); "
                                       f"start one, or use --backend local")
    dataset = _load_dataset(dataset_ref, home)
    tracker = None
    if not no_mlflow:
        from envloop_pipelines.core.tracking import MlflowTracker

        tracker = MlflowTracker(home=home)
    summaries = []
    for agent in agents:
        try:
            result = evaluate_agent(dataset, agent, attempts=attempts, split=split, limits=limits, workers=workers,
                                    sandbox=sandbox, home=home)
        except ValueError as exc:
            raise click.ClickException(str(exc)) from None
        summary = result.summary()
        if tracker is not None:
            summary["mlflow_run"] = track_evaluation(result, tracker).url
        summaries.append(summary)
        if not as_json:
            click.echo("\n".join(summary_lines(summary)))
            if summary.get("mlflow_run"):
                click.echo(f"mlflow  {summary['mlflow_run']}")
            click.echo("")
    if as_json:
        click.echo(json.dumps(summaries if len(summaries) > 1 else summaries[0], indent=2, default=str))
    elif len(summaries) > 1:
        click.echo("\n".join(comparison_lines(summaries)))
    broken = [s for s in summaries if all_errored(s)]
    if broken:
        names = ", ".join(f"{s['agent']['model']} at {s['agent']['base_url']}" for s in broken)
        reason = next(iter((broken[0].get("why") or {}).values()), "")
        raise click.ClickException(f"every attempt of {names} errored: the run measured nothing (stored, and marked so "
                                   f"in envloop env compare): {reason}")


@click.command("compare")
@click.option("--dataset", "dataset_ref", required=True, metavar="NAME[@VERSION]",
              help="The dataset (default version: the latest stored).")
@click.option("--split", default=None, help="Only runs of this split ('all' for runs over every environment).")
@click.option("--home", type=click.Path(file_okay=False, path_type=Path), default=None, help="The EnvLoop home.")
def compare_command(dataset_ref: str, split: str | None, home: Path | None) -> None:
    """The stored evaluations of a dataset version side by side: one line per agent run."""
    from envloop_pipelines.core.agents.evaluate import stored_evaluations

    dataset = _load_dataset(dataset_ref, home)
    summaries = stored_evaluations(dataset.name, dataset.version, home=home)
    if split is not None:
        summaries = [s for s in summaries if (s["split"] or "all") == split]
    if not summaries:
        raise click.ClickException(f"no stored evaluations of {dataset.name}@{dataset.version[:12]}"
                                   + (f" split {split}" if split else "") + "; run envloop env eval first")
    click.echo(f"dataset {dataset.name}@{dataset.version[:12]}: {len(summaries)} evaluation(s)")
    click.echo("\n".join(comparison_lines(summaries)))


@click.group("traces")
def traces() -> None:
    """Attempts' transcripts as chat JSONL (what harbor traces export gives; what SFT and RL snapshots read)."""


@traces.command("export")
@click.option("--dataset", "dataset_ref", required=True, metavar="NAME[@VERSION]",
              help="The dataset (default version: the latest stored).")
@click.option("--run", "run_ids", multiple=True, metavar="RUN_ID", help="Only these stored runs (default: every one).")
@click.option("--status", "statuses", multiple=True, type=click.Choice(["passed", "failed", "error"]),
              help="Only attempts with this verdict (repeatable; default: all).")
@click.option("--out", required=True, type=click.Path(dir_okay=False, path_type=Path), help="A new JSONL file.")
@click.option("--home", type=click.Path(file_okay=False, path_type=Path), default=None, help="The EnvLoop home.")
def traces_export(dataset_ref: str, run_ids: tuple[str, ...], statuses: tuple[str, ...], out: Path,
                  home: Path | None) -> None:
    """Write the stored attempts of a dataset version as chat JSONL, one attempt a line, filtered by verdict.

    Held-out evaluations stored no attempts and give none.
    """
    from envloop_pipelines.core.agents.attempts import attempt_json, chat_rows, read_attempts
    from envloop_pipelines.core.agents.evaluate import stored_evaluations
    from envloop_pipelines.core.storage import atomic_write_bytes

    dataset = _load_dataset(dataset_ref, home)
    summaries = [s for s in stored_evaluations(dataset.name, dataset.version, home=home)
                 if not run_ids or s.get("run_id") in run_ids]
    missing = sorted(set(run_ids) - {s.get("run_id") for s in summaries})
    if missing:
        raise click.BadParameter(f"no stored run {missing} of {dataset.name}@{dataset.version[:12]}", param_hint="--run")
    if out.exists():
        raise click.ClickException(f"{out} exists; traces go to a new file")
    rows = []
    for s in summaries:
        if s.get("aggregate_only") or not s.get("run_dir") or not (Path(s["run_dir"]) / "attempts.jsonl").is_file():
            continue
        rows += [{**r, "metadata": {**r["metadata"], "run_id": s.get("run_id")}}
                 for r in chat_rows(read_attempts(s["run_dir"]), statuses or None)]
    atomic_write_bytes(out, b"".join(attempt_json(r) + b"\n" for r in rows))
    click.echo(f"wrote {len(rows)} attempt(s) of {len(summaries)} run(s) of {dataset.name}@{dataset.version[:12]} to {out}"
               + (f" (status {', '.join(statuses)})" if statuses else ""))


__all__ = ["compare_command", "comparison_lines", "eval_command", "summary_lines", "traces", "traces_export"]
