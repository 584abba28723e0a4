"""Evaluate an agent on an environment dataset: K attempts per environment, verified, summarised, stored.

:func:`evaluate_agent` opens a fresh episode (its own sandboxed working
directory) for every attempt, lets the agent act (:func:`~.runner.run_attempt`),
has the verifier judge the final state, and summarises: pass@1 and pass@k
with confidence intervals over environments (:mod:`.stats`), a table per
environment, and the cost in time and tokens.

Rule 4 (``docs/rsi-rules.md``, the loop's hidden environments): when the
evaluation touches environments of the ``heldout`` split, only aggregates
leave it. The result carries no per-environment table and no attempts, the
stored run holds the summary alone, and MLflow gets the aggregate metrics
alone. Per-environment tables and transcripts are for the other splits.

The stored run, under ``<home>/agent_evals/<dataset>/<version>/<run_id>/``:
``summary.json`` and (open splits) ``attempts.jsonl``; ``run_id`` is the
sha256 of the summary's configuration and of the attempts file, so a run is
never overwritten and identical runs share one folder.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from envloop_pipelines.core.agents.attempts import ATTEMPTS_FILE, Attempt, attempts_jsonl, write_attempts
from envloop_pipelines.core.agents.client import AgentSpec
from envloop_pipelines.core.agents.runner import AttemptLimits, run_attempt
from envloop_pipelines.core.agents.stats import PassAtK, default_ks, pass_at_k_summary
from envloop_pipelines.core.environments.spec import HOLDOUT_SPLIT
from envloop_pipelines.core.storage import atomic_write_json, canonical_json, envloop_home, sha256_bytes

log = logging.getLogger(__name__)

EVALS_DIR = "agent_evals"
SUMMARY_FILE = "summary.json"


class HoldoutAttemptsError(PermissionError):
    """Attempts on held-out environments were asked for one by one (only aggregates leave them)."""


@dataclass(frozen=True)
class EnvironmentRow:
    """One environment's line of the table (open splits only)."""

    environment_id: str
    attempts: int
    passed: int
    errors: int
    pass_rate: float
    mean_turns: float
    tokens: int
    wall_s: float


@dataclass(frozen=True)
class Cost:
    """What the evaluation cost.

    Attributes:
        elapsed_s: wall-clock seconds of the whole evaluation (attempts run side by side).
        attempt_s: seconds summed over attempts (agent + sandbox + verifier).
        mean_attempt_s: per attempt.
        prompt_tokens: prompt tokens summed over every model call.
        completion_tokens: completion tokens summed.
        tokens_per_attempt: prompt + completion tokens per attempt.
        tool_calls: commands run in sandboxes.
    """

    elapsed_s: float
    attempt_s: float
    mean_attempt_s: float
    prompt_tokens: int
    completion_tokens: int
    tokens_per_attempt: float
    tool_calls: int


@dataclass(frozen=True)
class AgentEvaluation:
    """The result of :func:`evaluate_agent`.

    Attributes:
        dataset: the dataset's name.
        dataset_version: its version.
        split: the split evaluated (None: every environment of the dataset).
        agent: the agent (``base_url``, ``model``, ``kind``).
        attempts_per_environment: K.
        n_environments: environments evaluated.
        n_attempts: attempts made.
        pass_at_k: pass@1 first, then the other k, each with its interval.
        statuses: attempts by status (``passed``, ``failed``, ``error``).
        cost: time and tokens.
        aggregate_only: the evaluation touched held-out environments: no table, no attempts.
        per_environment: the table (empty when ``aggregate_only``).
        attempts: the attempts (empty when ``aggregate_only``).
        limits: the attempts' limits.
        run_id: the stored run's id; ``run_dir`` its folder.
        errors: the distinct error reasons with their counts (open splits only).
        why: one example in words per outcome that is not a pass (open splits only): ``failed`` (the
            verifier's or the limit's reason) and ``error: <reason>`` (the whole error of the first such attempt).
    """

    dataset: str
    dataset_version: str
    split: str | None
    agent: Mapping[str, Any]
    attempts_per_environment: int
    n_environments: int
    n_attempts: int
    pass_at_k: tuple[PassAtK, ...]
    statuses: Mapping[str, int]
    cost: Cost
    aggregate_only: bool
    limits: Mapping[str, Any]
    per_environment: tuple[EnvironmentRow, ...] = ()
    attempts: tuple[Attempt, ...] = field(default=(), repr=False)
    errors: Mapping[str, int] = field(default_factory=dict)
    run_id: str = ""
    run_dir: str = ""
    why: Mapping[str, str] = field(default_factory=dict)

    @property
    def pass_at_1(self) -> PassAtK:
        return self.pass_at_k[0]

    @property
    def all_errored(self) -> bool:
        """Every attempt ended in an error (a dead endpoint, a missing engine): the run measured nothing."""
        return self.n_attempts > 0 and self.statuses.get("error", 0) == self.n_attempts

    def summary(self) -> dict[str, Any]:
        """Everything but the attempts, as JSON (what ``summary.json`` holds)."""
        out = asdict(self)
        out.pop("attempts")
        out["pass_at_k"] = [p.to_dict() for p in self.pass_at_k]
        return out


def load_environments(ref: str, *, home: str | Path | None = None) -> Any:
    """The environment dataset ``name[@version]`` under the home (core.environments' dataset store)."""
    from envloop_pipelines.core.environments.dataset import open_dataset

    return open_dataset(ref, home=home)


def _environments(dataset: Any, split: str | None, environment_ids: Sequence[str] | None) -> list[Any]:
    envs = list(dataset.environments)
    if split is not None:
        envs = [e for e in envs if e.split == split]
    if environment_ids is not None:
        wanted = set(environment_ids)
        unknown = sorted(wanted - {e.id for e in envs})
        if unknown:
            raise ValueError(f"environment(s) {unknown} are not in {dataset.name}@{dataset.version}"
                             + (f" split {split!r}" if split else ""))
        envs = [e for e in envs if e.id in wanted]
    if not envs:
        raise ValueError(f"{dataset.name}@{dataset.version} has no environments" + (f" in split {split!r}" if split else ""))
    return envs


def _error_attempt(dataset: Any, spec: Any, agent: AgentSpec, attempt: int, error: str) -> Attempt:
    return Attempt(dataset=dataset.name, dataset_version=dataset.version, environment_id=spec.id, split=spec.split,
                   seed=spec.seed, attempt=attempt, sampling_seed=0, agent=agent.to_dict(), messages=[],
                   status="error", error=error)


def task_attempt_limits(spec: Any, limits: AttemptLimits) -> AttemptLimits:
    """``limits`` with the attempt's wall time a Harbor task sets for itself (``[agent] timeout_sec``), if any."""
    timeout = ((spec.meta or {}).get("harbor") or {}).get("agent_timeout_sec")
    if not timeout:
        return limits
    return replace(limits, wall_s=float(timeout), request_timeout_s=min(limits.request_timeout_s, float(timeout)))


def _attempt_once(dataset: Any, spec: Any, agent: AgentSpec, attempt: int, limits: AttemptLimits,
                  open_episode: Callable[..., Any], sandbox: Any, work_root: Path | None, home: str | Path | None) -> Attempt:
    """One attempt, whatever happens: anything that goes wrong is this attempt's error, never the run's."""
    try:
        episode = open_episode(spec, sandbox=sandbox, work_root=work_root, home=home)
    except Exception as exc:
        log.exception("could not open an episode of %s", spec.id)
        return _error_attempt(dataset, spec, agent, attempt, f"episode: could not open: {type(exc).__name__}: {exc}")
    try:
        done = run_attempt(episode, agent, dataset=dataset.name, dataset_version=dataset.version, split=spec.split,
                           seed=spec.seed, attempt=attempt, limits=task_attempt_limits(spec, limits))
    except Exception as exc:  # run_attempt records what the agent does; this is a fault of ours, kept to the attempt
        log.exception("attempt %s/%d failed", spec.id, attempt)
        done = _error_attempt(dataset, spec, agent, attempt, f"episode: {type(exc).__name__}: {exc}")
    finally:
        try:
            episode.close()
        except Exception:
            log.exception("closing the episode of %s failed", spec.id)
    try:
        attempts_jsonl([done])  # what store_evaluation writes: a line that cannot be written fails here, alone
    except Exception as exc:
        log.exception("attempt %s/%d cannot be stored", spec.id, attempt)
        done = _error_attempt(dataset, spec, agent, attempt, f"storage: the attempt cannot be stored: {type(exc).__name__}: "
                                                             f"{str(exc)[:300]!a}")
    return done


def _run(dataset: Any, envs: Sequence[Any], agent: AgentSpec, attempts: int, limits: AttemptLimits, workers: int,
         sandbox: Any, work_root: str | Path | None, home: str | Path | None) -> list[Attempt]:
    from envloop_pipelines.core.environments.episode import open_episode

    from envloop_pipelines.core.progress import Progress

    jobs = [(spec, a) for spec in envs for a in range(attempts)]
    root = Path(work_root) if work_root is not None else None
    passed = [0]
    lock = threading.Lock()
    with Progress(f"eval {agent.model} on {dataset.name}", total=len(jobs), unit="attempt") as bar:

        def one(job: tuple[Any, int]) -> Attempt:
            done = _attempt_once(dataset, job[0], agent, job[1], limits, open_episode, sandbox, root, home)
            with lock:
                passed[0] += done.passed
                bar.update(1, passed=passed[0])
            return done

        with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="attempt") as pool:
            return list(pool.map(one, jobs))


def _check_counts(attempts: int, workers: int) -> None:
    if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1:
        raise ValueError(f"attempts must be a positive integer (K attempts per environment), got {attempts!r}")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be a positive integer, got {workers!r}")


def run_attempts(
    dataset: Any,
    agent: AgentSpec,
    *,
    attempts: int,
    split: str | None = None,
    environment_ids: Sequence[str] | None = None,
    limits: AttemptLimits = AttemptLimits(),
    workers: int = 4,
    sandbox: Any = None,
    work_root: str | Path | None = None,
    home: str | Path | None = None,
) -> list[Attempt]:
    """K attempts of ``agent`` at each environment of ``dataset`` (open splits only), with transcripts.

    This is the sampler of training attempts (passed ones become SFT rows). Held-out environments
    are refused: only :func:`evaluate_agent`'s aggregates leave them.

    Raises:
        HoldoutAttemptsError: the selection holds a held-out environment.
        ValueError: unknown environments, an empty selection, bad counts.
    """
    _check_counts(attempts, workers)
    envs = _environments(dataset, split, environment_ids)
    held = [e.id for e in envs if e.split == HOLDOUT_SPLIT]
    if held:
        raise HoldoutAttemptsError(
            f"{len(held)} environment(s) of {dataset.name}@{dataset.version} are held out ({held[:3]}...): attempts on "
            f"them never leave the evaluation one by one; evaluate_agent reports their aggregates")
    return _run(dataset, envs, agent, attempts, limits, workers, sandbox, work_root, home)


def pass_counts(
    dataset: Any,
    agent: AgentSpec,
    *,
    attempts: int,
    split: str,
    limits: AttemptLimits = AttemptLimits(),
    workers: int = 4,
    home: str | Path | None = None,
) -> dict[str, tuple[int, int]]:
    """K attempts of ``agent`` at each environment of ``split``: per environment ``(attempts, passes)`` only.

    What a paired comparison of two policies needs (the same per-attempt sampling seeds whichever policy
    answers), without the transcripts: the caller aggregates the counts (:func:`.stats.pass_at_k_summary`,
    :func:`.stats.mean_ci`) and, for held-out environments, must let only the aggregates leave (rule 4).
    """
    _check_counts(attempts, workers)
    counts: dict[str, tuple[int, int]] = {}
    for a in _run(dataset, _environments(dataset, split, None), agent, attempts, limits, workers, None, None, home):
        n, c = counts.get(a.environment_id, (0, 0))
        counts[a.environment_id] = (n + 1, c + int(a.passed))
    return counts


def _table(attempts: Sequence[Attempt]) -> tuple[EnvironmentRow, ...]:
    by_env: dict[str, list[Attempt]] = {}
    for a in attempts:
        by_env.setdefault(a.environment_id, []).append(a)
    rows = []
    for env_id in sorted(by_env):
        group = by_env[env_id]
        passed = sum(a.passed for a in group)
        rows.append(EnvironmentRow(
            environment_id=env_id, attempts=len(group), passed=passed, errors=sum(a.status == "error" for a in group),
            pass_rate=passed / len(group), mean_turns=sum(a.turns for a in group) / len(group),
            tokens=sum(a.prompt_tokens + a.completion_tokens for a in group), wall_s=round(sum(a.wall_s for a in group), 3)))
    return tuple(rows)


def _error_reasons(attempts: Sequence[Attempt]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for a in attempts:
        if a.status == "error":
            reason = _printable(a.error.split(":")[0] if a.error else "error")
            counts[reason] = counts.get(reason, 0) + 1
    return dict(sorted(counts.items()))


def _printable(text: str, limit: int = 400) -> str:
    """``text`` as valid Unicode (a lone surrogate becomes its ``\\udcXX`` escape), at most ``limit`` characters."""
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def failure_reason(attempt: Attempt) -> str:
    """Why an attempt did not pass, in a line: its error, the limit that ended it, or what the verifier said."""
    if attempt.error:
        return _printable(attempt.error)
    score = attempt.score or {}
    details = score.get("details") or {}
    check = details.get("check") or {}
    failing = [f"{c.get('name')}: {c.get('detail')}" for c in check.get("checks") or [] if not c.get("ok")]
    if failing:
        return _printable("the check failed: " + "; ".join(failing))
    tests = details.get("tests")
    if tests:
        output = str(tests.get("stdout_tail") or "") + "\n" + str(tests.get("stderr_tail") or "")
        lines = [ln for ln in output.splitlines() if ln.strip()]
        return _printable(f"the tests gave reward {details.get('reward')}: " + " | ".join(lines[-3:]))
    if details.get("error"):
        return _printable(str(details["error"]))
    return f"the verifier's score {score.get('value')}"


def _why(attempts: Sequence[Attempt]) -> dict[str, str]:
    out: dict[str, str] = {}
    for a in sorted(attempts, key=lambda x: x.key):
        if a.status == "failed":
            out.setdefault("failed", failure_reason(a))
        elif a.status == "error":
            reason = _printable(a.error.split(":")[0] if a.error else "error")
            out.setdefault(f"error: {reason}", failure_reason(a))
    return dict(sorted(out.items()))


def evaluation_run_id(config: Mapping[str, Any], attempts_bytes: bytes) -> str:
    """The stored run's id: sha256 of the configuration and the attempts' bytes (first 16 hex)."""
    return sha256_bytes(canonical_json(dict(config)) + b"\n" + sha256_bytes(attempts_bytes).encode())[:16]


def evaluate_agent(
    dataset: Any,
    agent: AgentSpec,
    *,
    attempts: int,
    split: str | None = None,
    environment_ids: Sequence[str] | None = None,
    limits: AttemptLimits = AttemptLimits(),
    ks: Sequence[int] | None = None,
    workers: int = 4,
    sandbox: Any = None,
    work_root: str | Path | None = None,
    home: str | Path | None = None,
    store: bool = True,
    seed: int = 0,
) -> AgentEvaluation:
    """Evaluate ``agent`` on ``dataset``: K attempts per environment, pass@k with CIs, the table, the cost.

    Args:
        dataset: the environment dataset (core.environments' loaded dataset).
        agent: the agent's endpoint.
        attempts: K, attempts per environment.
        split: evaluate only this split's environments (None: all).
        environment_ids: evaluate only these.
        limits: each attempt's turns, tokens and wall time.
        ks: the k of pass@k (default: 1, powers of two, K).
        workers: attempts run side by side (each in its own sandbox).
        sandbox: the sandbox backend for the episodes (default: the environments' own, local).
        work_root: where episodes make their working directories.
        home: the EnvLoop home (where the run is stored).
        store: write the run under the home.
        seed: the bootstrap's seed.

    Returns:
        The evaluation. With held-out environments in it: aggregates only.
    """
    _check_counts(attempts, workers)
    envs = _environments(dataset, split, environment_ids)
    aggregate_only = any(e.split == HOLDOUT_SPLIT for e in envs)
    t0 = time.monotonic()
    done = _run(dataset, envs, agent, attempts, limits, workers, sandbox, work_root, home)
    elapsed = time.monotonic() - t0
    counts = {}
    for a in done:
        n, c = counts.get(a.environment_id, (0, 0))
        counts[a.environment_id] = (n + 1, c + int(a.passed))
    rows = pass_at_k_summary(counts, ks or default_ks(attempts), seed=seed)
    n = len(done)
    prompt = sum(a.prompt_tokens for a in done)
    completion = sum(a.completion_tokens for a in done)
    attempt_s = sum(a.wall_s for a in done)
    cost = Cost(elapsed_s=round(elapsed, 3), attempt_s=round(attempt_s, 3), mean_attempt_s=round(attempt_s / n, 4),
                prompt_tokens=prompt, completion_tokens=completion, tokens_per_attempt=(prompt + completion) / n,
                tool_calls=sum(a.tool_calls for a in done))
    statuses = {s: sum(a.status == s for a in done) for s in ("passed", "failed", "error")}
    result = AgentEvaluation(
        dataset=dataset.name, dataset_version=dataset.version, split=split, agent=agent.to_dict(),
        attempts_per_environment=attempts, n_environments=len(envs), n_attempts=n, pass_at_k=tuple(rows),
        statuses=statuses, cost=cost, aggregate_only=aggregate_only, limits=limits.to_dict(),
        per_environment=() if aggregate_only else _table(done), attempts=() if aggregate_only else tuple(done),
        errors={} if aggregate_only else _error_reasons(done), why={} if aggregate_only else _why(done))
    if store:
        result = store_evaluation(result, home=home)
    return result


def store_evaluation(result: AgentEvaluation, *, home: str | Path | None = None) -> AgentEvaluation:
    """Write the run under ``<home>/agent_evals/<dataset>/<version>/<run_id>/``; returns it with its id and folder."""
    data = b"" if result.aggregate_only else attempts_jsonl(result.attempts)
    config = {"dataset": result.dataset, "dataset_version": result.dataset_version, "split": result.split,
              "agent": dict(result.agent), "attempts": result.attempts_per_environment, "limits": dict(result.limits)}
    run_id = evaluation_run_id(config, data)
    folder = envloop_home(home) / EVALS_DIR / result.dataset / result.dataset_version / run_id
    stored = AgentEvaluation(**{**{f: getattr(result, f) for f in result.__dataclass_fields__},
                                "run_id": run_id, "run_dir": str(folder)})
    if not (folder / SUMMARY_FILE).exists():
        if not result.aggregate_only:
            write_attempts(folder, result.attempts)
        atomic_write_json(folder / SUMMARY_FILE, stored.summary())
    return stored


def replay(attempt: Attempt, *, home: str | Path | None = None, sandbox: Any = None,
           work_root: str | Path | None = None) -> Any:
    """Re-run a stored attempt's tool calls (or its answer) in a fresh episode of its environment; the verdict.

    The environment is looked up in the attempt's dataset version under ``home``.

    Raises:
        ValueError: the dataset version or the environment is not there.
    """
    from envloop_pipelines.core.agents.runner import replay_in
    from envloop_pipelines.core.environments.episode import open_episode

    dataset = load_environments(f"{attempt.dataset}@{attempt.dataset_version}", home=home)
    (spec,) = _environments(dataset, None, [attempt.environment_id])
    episode = open_episode(spec, sandbox=sandbox, work_root=None if work_root is None else Path(work_root), home=home)
    try:
        return replay_in(attempt, episode)
    finally:
        episode.close()


def stored_evaluations(dataset: str, version: str | None = None, *, home: str | Path | None = None) -> list[dict[str, Any]]:
    """The summaries of the stored runs of ``dataset`` (of one version, or of all), oldest first.

    Raises:
        ValueError: a ``summary.json`` that is not JSON, naming the file.
    """
    import json

    root = envloop_home(home) / EVALS_DIR / dataset
    pattern = f"{version}/*/{SUMMARY_FILE}" if version else f"*/*/{SUMMARY_FILE}"
    out = []
    for path in sorted(root.glob(pattern), key=lambda p: p.stat().st_mtime):
        try:
            out.append(json.loads(path.read_text(encoding="utf-8")))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{exc.lineno}: not JSON ({exc.msg})") from None
    return out


def experiment_name(dataset: str) -> str:
    """The MLflow experiment of a dataset's evaluations: ``envs/<dataset>``."""
    return f"envs/{dataset}"


def track_evaluation(result: AgentEvaluation, tracker: Any) -> Any:
    """Log an evaluation as one MLflow run (kind ``agent_evaluation``) and return it (a ``TrackedRun``).

    Params: the dataset, version, split, agent, K and limits. Metrics: ``pass_at_<k>`` with
    ``pass_at_<k>.ci_low`` / ``.ci_high``, the status counts and the cost. Artifacts: ``summary.json``
    and, on open splits, ``attempts.jsonl`` (held-out evaluations log aggregates only).
    """
    from envloop_pipelines.core.tracking import KIND_AGENT_EVAL, TAG_AGENT, TAG_DATASET, TAG_DATASET_VERSION, TAG_KIND

    agent = AgentSpec(result.agent["base_url"], result.agent["model"], kind=result.agent.get("kind", "chat"))
    run = tracker.start_run(experiment_name(result.dataset), f"{agent.model} on {result.dataset}@{result.dataset_version[:12]}",
                            tags={TAG_KIND: KIND_AGENT_EVAL, TAG_DATASET: result.dataset,
                                  TAG_DATASET_VERSION: result.dataset_version, TAG_AGENT: agent.label})
    try:
        params = {"dataset": result.dataset, "dataset_version": result.dataset_version, "split": result.split or "all",
                  "agent.base_url": agent.base_url, "agent.model": agent.model, "agent.kind": agent.kind,
                  "attempts": result.attempts_per_environment, "n_environments": result.n_environments,
                  "aggregate_only": result.aggregate_only, "run_id": result.run_id,
                  **{f"limits.{k}": v for k, v in result.limits.items()}}
        tracker.log_params(run.run_id, params)
        metrics: dict[str, float] = {}
        for p in result.pass_at_k:
            metrics[f"pass_at_{p.k}"] = p.value
            metrics[f"pass_at_{p.k}.ci_low"] = p.ci_low
            metrics[f"pass_at_{p.k}.ci_high"] = p.ci_high
        metrics.update({f"attempts.{k}": float(v) for k, v in result.statuses.items()})
        metrics.update({f"cost.{k}": float(v) for k, v in asdict(result.cost).items()})
        tracker.log_metrics(run.run_id, metrics)
        if result.run_dir:
            folder = Path(result.run_dir)
            for name in (SUMMARY_FILE, ATTEMPTS_FILE):
                if (folder / name).exists():
                    tracker.log_artifact(run.run_id, folder / name)
    except BaseException:
        tracker.end_run(run.run_id, "FAILED")
        raise
    tracker.end_run(run.run_id)
    return run


__all__ = ["AgentEvaluation", "Cost", "EVALS_DIR", "EnvironmentRow", "HoldoutAttemptsError", "failure_reason",
           "SUMMARY_FILE", "evaluate_agent", "evaluation_run_id", "experiment_name", "load_environments", "pass_counts", "replay", "run_attempts", "store_evaluation", "stored_evaluations",
           "track_evaluation"]
