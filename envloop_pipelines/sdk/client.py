"""The ``Client``: rounds, decisions, releases and checkpoints of a running EnvLoop deployment.

Two engines' own APIs, nothing of ours in between:

* **Dagster's GraphQL API** (``dagster_graphql.DagsterGraphQLClient`` against the webserver):
  add a ``rounds`` partition (``addDynamicPartition``), launch ``round_job`` or ``setup_job``
  (``launchRun``), follow a run (``runOrError``: status and step stats; ``logsForRun``: the
  steps' progress lines), and read what the steps recorded in their asset materializations:
  ``promotion_decision`` carries the round's typed decision, its ledger events and the release
  card it wrote; ``noise_floor`` the null arms and release 1 (``defs/rounds/metadata.py``).
* **MLflow's tracking and registry API** (``mlflow.MlflowClient``): the registered model
  ``envloop-<task>`` with one version per release and the ``champion`` alias; each version's
  run holds the release's holdout metrics and its checkpoint as an artifact.

A client never reads a deployment's EnvLoop home: what it shows is what the webserver and the
MLflow server expose, so the same client drives a local ``envloop ui`` (``http://127.0.0.1:3000``
and ``sqlite:///.envloop/mlflow.db`` or a local ``mlflow server``) and a Kubernetes deployment;
only the two URLs change. The loop's settings are the code location's (``ENVLOOP_<FIELD>`` on the
server; :meth:`Client.loop_settings` reads them back). A loop of rounds is driven from the client
(:meth:`Client.run_loop`): one round at a time, stopping on the budget (rounds, patience, wall
time), with no daemon needed. The ledger a client sees is the events the steps published (null
arms, hypotheses, trained checkpoints, rejections, decisions, releases), not the events only the
daemon's sensors write (``round_failed``; a failed round shows as a failed run instead).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import urllib.parse
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from envloop_pipelines.core.loop.config import LoopConfig, round_key, round_number
from envloop_pipelines.core.decision_loop.step_records import RoundDecision
from envloop_pipelines.core.progress import Progress, ensure_shown
from envloop_pipelines.core.ledger.projection import projection_error
from envloop_pipelines.core.tracking import CHAMPION_ALIAS, HOLDOUT_PREFIX, TAG_CHECKPOINT, TAG_RELEASE, TAG_ROUND
from envloop_pipelines.defs.rounds.metadata import DECISION as DECISION_LABEL
from envloop_pipelines.defs.rounds.metadata import LEDGER_EVENTS as LEDGER_EVENTS_LABEL
from envloop_pipelines.defs.rounds.metadata import PROMOTION_WARNING as PROMOTION_WARNING_LABEL
from envloop_pipelines.defs.rounds.metadata import RELEASE_CARD as RELEASE_CARD_LABEL
from envloop_pipelines.sdk import queries
from envloop_pipelines.sdk.errors import (
    ClientError,
    NotFoundError,
    PromotionOutOfReach,
    RefusedError,
    UnavailableError,
)
from envloop_pipelines.sdk.predict import Answerer

#: Dagster's names in this project (the jobs, partitions, assets and tags a client reads and writes).
from envloop_pipelines.names import (  # noqa: E402 - re-exported under the SDK's names
    CLIENT_TAG,
    HYPOTHESIS_ASSET,
    LOOP_TAG,
    NOISE_FLOOR,
    PARTITION_TAG,
    PROMOTION_DECISION,
    REFUSED_TAG,
    ROUND_JOB,
    ROUNDS_PARTITIONS,
    SETUP_JOB,
)
#: Run statuses that are final.
FINISHED = ("SUCCESS", "FAILURE", "CANCELED")
#: Run statuses of a run that has not ended (queued, starting, running, being cancelled).
UNFINISHED = ("QUEUED", "NOT_STARTED", "STARTING", "STARTED", "CANCELING")


@dataclass(frozen=True)
class RunError:
    """Why a run failed: the failed step (``None`` for a run that failed outside a step), its own error message
    (the exception the step raised, not Dagster's wrapper) and the exception's class."""

    step: str | None
    message: str
    error_class: str | None = None

    def __str__(self) -> str:
        return f"{self.step}: {self.message}" if self.step else self.message


class RoundFailed(ClientError):
    """A round's (or the setup's) run ended without a decision; ``reason`` is the failed step's own error."""

    def __init__(self, message: str, run: "RunInfo", reason: RunError | None = None) -> None:
        super().__init__(message)
        self.run = run
        self.reason = reason


@dataclass(frozen=True)
class StepInfo:
    """One step of a run: its key (an asset or a check), status and times (epoch seconds)."""

    key: str
    status: str
    start_time: float | None
    end_time: float | None


@dataclass(frozen=True)
class RunInfo:
    """A Dagster run as the webserver reports it."""

    run_id: str
    job: str
    status: str
    partition: str | None
    start_time: float | None
    end_time: float | None
    created: float | None
    tags: Mapping[str, str]
    steps: tuple[StepInfo, ...]
    #: The steps this run executes when it runs a subset of its job (a retry from the failed step); else None.
    step_keys: tuple[str, ...] | None = None

    @property
    def finished(self) -> bool:
        return self.status in FINISHED

    @property
    def success(self) -> bool:
        return self.status == "SUCCESS"

    @property
    def first_step_start(self) -> float | None:
        """When the first step of the run started (epoch seconds), if one has."""
        starts = [s.start_time for s in self.steps if s.start_time]
        return min(starts) if starts else None

    @classmethod
    def from_graphql(cls, raw: Mapping[str, Any]) -> "RunInfo":
        tags = {t["key"]: t["value"] for t in raw.get("tags") or []}
        steps = tuple(StepInfo(s["stepKey"], s["status"], s.get("startTime"), s.get("endTime"))
                      for s in raw.get("stepStats") or [])
        return cls(run_id=raw["runId"], job=raw.get("jobName") or "", status=raw["status"],
                   partition=tags.get(PARTITION_TAG), start_time=raw.get("startTime"), end_time=raw.get("endTime"),
                   created=raw.get("creationTime"), tags=tags, steps=steps,
                   step_keys=tuple(raw["stepKeysToExecute"]) if raw.get("stepKeysToExecute") else None)


@dataclass(frozen=True)
class RoundRun:
    """A round the client launched: its key (the ``rounds`` partition) and its Dagster run."""

    key: str
    run_id: str
    launched_at: float


@dataclass(frozen=True)
class RoundInfo:
    """A round: its key, its latest run (if any) and its decision (once decided)."""

    key: str
    run: RunInfo | None
    decision: RoundDecision | None

    @property
    def status(self) -> str:
        """``decided``, or the latest run's status (``STARTED``, ``FAILURE`` ...), or ``not started``."""
        if self.decision is not None:
            return "decided"
        return self.run.status if self.run is not None else "not started"


@dataclass(frozen=True)
class ReleaseInfo:
    """A release: the registered model version in MLflow, its holdout metrics, and its card."""

    release: int
    model_version: str
    round: str | None
    checkpoint_sha256: str | None
    mlflow_run_id: str | None
    holdout: Mapping[str, float]
    champion: bool
    card: Mapping[str, Any] | None = field(default=None, compare=False)


def _own_error(event: Mapping[str, Any]) -> tuple[str, str | None]:
    """``(message, exception class)`` of a failure event: the step's own error, not Dagster's wrapper around it."""
    described = (event.get("failureMetadata") or {}).get("description")
    error = event.get("error") or {}
    chain = [link["error"] for link in error.get("errorChain") or []]
    own = chain[-1] if chain else error
    if described:
        return described, own.get("className") or error.get("className")
    message = (own.get("message") or event.get("message") or "").strip()
    return message, own.get("className")


def _split_url(url: str) -> dict[str, Any]:
    """``http://host:port/prefix`` as DagsterGraphQLClient's arguments; raises ClientError naming the field."""
    parsed = urllib.parse.urlparse(url if "://" in url else f"http://{url}")
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise RefusedError(f"dagster_url: {url!r} is not an http(s) URL of a Dagster webserver (http://host:port)")
    prefix = parsed.path.rstrip("/")
    if prefix.endswith("/graphql"):
        prefix = prefix[: -len("/graphql")]
    return {"hostname": parsed.hostname, "port_number": parsed.port, "use_https": parsed.scheme == "https",
            "path_prefix": prefix}


def _hypothesis_json(hypothesis: Mapping[str, Any] | str | os.PathLike[str] | None) -> str | None:
    """A person's hypothesis (a mapping, JSON text or a JSON file) as checked JSON; ``None`` for the automatic one."""
    from envloop_pipelines.core.decision_loop.proposals import ProposalError, parse_proposal

    try:
        proposal = parse_proposal(hypothesis)
    except ProposalError as exc:
        raise RefusedError(str(exc)) from None
    return None if proposal is None else json.dumps(proposal, sort_keys=True)


class Client:
    """Drive an EnvLoop deployment: its Dagster webserver and its MLflow tracking server.

    Args:
        dagster_url: The Dagster webserver, ``http://host:port`` (with its path prefix, if any).
        mlflow_uri: MLflow's tracking URI (``http://host:port``, or ``sqlite:///...`` on the same
            machine); default ``$MLFLOW_TRACKING_URI``. Needed for releases, the champion and
            checkpoints only.
        timeout_s: Per request, to both servers: a server that does not answer within it raises
            :class:`UnavailableError`. Before any work (:meth:`probe`: :meth:`setup`, :meth:`start_round`,
            the first MLflow read) each server is asked once, without retries, within ``min(timeout_s, 5)``: a
            dead URL fails in seconds, naming it, instead of after MLflow's own retries.
        headers: Extra HTTP headers for the webserver (an auth proxy's token, say).
        mlflow_setting: Where ``mlflow_uri`` came from, as errors name it (default ``mlflow_uri``, or
            ``MLFLOW_TRACKING_URI`` when it was read from there; the CLI says ``--mlflow``).

    Example::

        from envloop_pipelines.sdk import Client

        client = Client("http://127.0.0.1:3000", mlflow_uri="http://127.0.0.1:5000")
        client.setup()                                   # benchmark + noise floor, once
        round_ = client.run_round()                      # start, wait with progress, read the decision
        print(round_.decision.promote, round_.decision.reasons)
        ckpt = client.fetch_checkpoint("champion", "./models")
    """

    def __init__(self, dagster_url: str, mlflow_uri: str | None = None, *, timeout_s: float = 60.0,
                 headers: Mapping[str, str] | None = None, mlflow_setting: str | None = None) -> None:
        from dagster_graphql import DagsterGraphQLClient

        self.dagster_url = dagster_url.rstrip("/")
        self.mlflow_uri = mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI") or None
        self.mlflow_setting = mlflow_setting or ("mlflow_uri" if mlflow_uri else "MLFLOW_TRACKING_URI")
        self.timeout_s = float(timeout_s)
        self._graphql = DagsterGraphQLClient(**_split_url(dagster_url), timeout=int(timeout_s),
                                             headers=dict(headers or {}))
        self._location: tuple[str, str] | None = None
        self._settings: dict[str, Any] | None = None
        self._steps: dict[str, int] = {}
        self._mlflow: Any = None
        self._models_dir: str | None = None
        self._answers = Answerer(self.timeout_s)

    # ------------------------------------------------------------------ GraphQL plumbing

    def _query(self, document: str, variables: Mapping[str, Any] | None = None) -> dict[str, Any]:
        import requests.exceptions
        from dagster_graphql import DagsterGraphQLClientError
        from gql.transport.exceptions import TransportConnectionFailed, TransportServerError

        try:
            with warnings.catch_warnings():  # dagster_graphql passes variables the way gql 4 deprecates
                warnings.simplefilter("ignore", DeprecationWarning)
                return self._graphql._execute(document, dict(variables or {}))
        except DagsterGraphQLClientError as exc:
            cause = exc.__cause__
            detail = f"{type(cause).__name__}: {cause}" if cause is not None else str(exc)
            detail = " ".join(detail.split())[:300]
            unreachable = isinstance(cause, (requests.exceptions.ConnectionError, requests.exceptions.Timeout,
                                             TransportConnectionFailed, TransportServerError))
            kind = UnavailableError if unreachable else ClientError
            raise kind(f"the Dagster webserver at {self.dagster_url} did not answer: {detail}") from None

    @staticmethod
    def _ok(result: Mapping[str, Any], *allowed: str) -> Mapping[str, Any]:
        """``result`` when its ``__typename`` is one of ``allowed``; else a ClientError with the server's message."""
        kind = result.get("__typename")
        if kind in allowed:
            return result
        message = result.get("message") or result.get("errors") or result
        error = (NotFoundError if str(kind).endswith("NotFoundError")
                 else RefusedError if kind in ("RunConfigValidationInvalid", "DuplicateDynamicPartitionError",
                                               "InvalidStepError", "InvalidOutputError", "RunConflict")
                 else ClientError)
        raise error(f"{kind}: {message}")

    def location(self) -> tuple[str, str]:
        """``(code location, repository)`` holding ``round_job``, found once and kept."""
        if self._location is None:
            repos = self._ok(self._query(queries.REPOSITORIES)["repositoriesOrError"], "RepositoryConnection")
            found = [(n["location"]["name"], n["name"]) for n in repos["nodes"]
                     if any(j["name"] == ROUND_JOB for j in n["jobs"])]
            if not found:
                raise ClientError(f"no code location at {self.dagster_url} has the job {ROUND_JOB!r}: "
                                  f"is it serving envloop_pipelines.definitions?")
            if len(found) > 1:
                raise ClientError(f"several code locations at {self.dagster_url} have {ROUND_JOB!r}: {found}")
            self._location = found[0]
        return self._location

    def _repo(self) -> dict[str, str]:
        location, repository = self.location()
        return {"repositoryLocationName": location, "repositoryName": repository}

    # ------------------------------------------------------------------ the code location's loop

    def loop_settings(self) -> dict[str, Any]:
        """The loop the code location runs (its ``loop`` resource: ``LoopConfig`` names, defaults filled in).

        What the resource is configured with in the code location: every ``ENVLOOP_<FIELD>`` set when the
        code location loaded, the rest ``LoopConfig``'s defaults.
        """
        if self._settings is None:
            repo = self._ok(self._query(queries.RESOURCES, {"repo": self._repo()})["repositoryOrError"], "Repository")
            loop = next((r for r in repo["allTopLevelResourceDetails"] if r["name"] == "loop"), None)
            if loop is None:
                raise ClientError(f"the code location {self.location()[0]!r} has no 'loop' resource")
            values = {v["key"]: json.loads(v["value"]) for v in loop["configuredValues"] if v["type"] == "VALUE"}
            values = {k: v for k, v in values.items() if v is not None}  # unset: ENVLOOP_<FIELD> in the run
            names = {f for f in LoopConfig.__dataclass_fields__}
            self._settings = LoopConfig.from_settings({k: v for k, v in values.items() if k in names}).to_settings()
        return dict(self._settings)

    @property
    def task(self) -> str:
        return str(self.loop_settings()["task"])

    @property
    def model_name(self) -> str:
        """The MLflow registered model of the task's releases."""
        return LoopConfig(task=self.task).model_name

    # ------------------------------------------------------------------ runs

    def _launch(self, job: str, *, run_config: Mapping[str, Any] | None = None,
                tags: Mapping[str, str] | None = None) -> str:
        params = {"selector": {**self._repo(), "jobName": job}, "runConfigData": dict(run_config or {}),
                  "executionMetadata": {"tags": [{"key": k, "value": str(v)} for k, v in (tags or {}).items()]}}
        result = self._ok(self._query(queries.LAUNCH_RUN, {"params": params})["launchRun"], "LaunchRunSuccess")
        return str(result["run"]["runId"])

    def run(self, run_id: str) -> RunInfo:
        """One run: status, partition, tags and step stats."""
        return RunInfo.from_graphql(self._ok(self._query(queries.RUN, {"runId": run_id})["runOrError"], "Run"))

    def runs(self, job: str = ROUND_JOB, *, partition: str | None = None, limit: int = 50,
             statuses: Sequence[str] | None = None) -> list[RunInfo]:
        """Runs of ``job``, newest first (of one ``rounds`` partition, of these statuses, when given)."""
        run_filter: dict[str, Any] = {"pipelineName": job}
        if partition is not None:
            run_filter["tags"] = [{"key": PARTITION_TAG, "value": partition}]
        if statuses is not None:
            run_filter["statuses"] = list(statuses)
        result = self._ok(self._query(queries.RUNS, {"filter": run_filter, "limit": limit})["runsOrError"], "Runs")
        return [RunInfo.from_graphql(r) for r in result["results"]]

    def job_steps(self, job: str) -> int:
        """How many steps (assets and checks) a run of ``job`` executes."""
        if job not in self._steps:
            selector = {**self._repo(), "pipelineName": job}
            result = self._ok(self._query(queries.JOB_STEPS, {"job": selector})["pipelineOrError"], "Pipeline")
            self._steps[job] = len(result["solids"])
        return self._steps[job]

    def _events(self, run_id: str) -> list[dict[str, Any]]:
        """Every event of a run's log with a message (its failures with their errors), oldest first.

        Raises:
            NotFoundError: no run ``run_id``.
        """
        events: list[dict[str, Any]] = []
        cursor: str | None = None
        for _ in range(1000):  # a page is at most 1000 events; a run has far fewer pages
            result = self._ok(self._query(queries.RUN_FAILURES, {"runId": run_id, "after": cursor})["logsForRun"],
                              "EventConnection")
            events += [e for e in result["events"] if e.get("message") is not None]
            cursor = result.get("cursor") or cursor
            if not result.get("hasMore") or not result["events"]:
                break
        return events

    def run_error(self, run_id: str) -> RunError | None:
        """Why a run failed: the first failed step and the error it raised (its own message); ``None`` if none failed.

        Dagster wraps a step's exception (``DagsterExecutionStepExecutionError: Error occurred while executing
        op ...``); the step's own is the last link of the error's chain, or a ``dagster.Failure``'s description.

        Raises:
            NotFoundError: no run ``run_id``.
        """
        run_failure: RunError | None = None
        for e in self._events(run_id):
            if e["__typename"] == "ExecutionStepFailureEvent":
                return RunError(e.get("stepKey"), *_own_error(e))
            if e["__typename"] == "RunFailureEvent" and run_failure is None:
                message, error_class = _own_error(e)
                run_failure = RunError(None, message, error_class)
        return run_failure

    def logs(self, run_id: str, *, tail: int | None = 50) -> list[str]:
        """The last ``tail`` messages of a run's log (all with ``None``): ``HH:MM:SS LEVEL step: message``.

        Raises:
            NotFoundError: no run ``run_id``.
        """
        lines = []
        for e in self._events(run_id):
            when = time.strftime("%H:%M:%S", time.gmtime(float(e.get("timestamp") or 0) / 1000))
            step = f"{e['stepKey']}: " if e.get("stepKey") else ""
            message = e["message"]
            if e["__typename"] in ("ExecutionStepFailureEvent", "RunFailureEvent") and e.get("error"):
                message = f"{message} {_own_error(e)[0]}"  # the step's own error, not only "step failed"
            lines.append(f"{when} {e.get('level') or 'INFO'} {step}{message}")
        return lines[-tail:] if tail else lines

    def cancel(self, run_id: str, *, wait: bool = True, timeout_s: float = 120.0) -> RunInfo:
        """Cancel a run: its steps are interrupted and the run ends ``CANCELED``; its MLflow runs end ``KILLED``.

        With ``wait`` the run is followed until it has stopped (at most ``timeout_s``); a run that has
        ended already is returned as it is. The deployment's sensor closes the round's MLflow runs; a
        client with ``mlflow_uri`` closes them too (a deployment without a daemon runs no sensor).

        Raises:
            NotFoundError: no run ``run_id``.
            ClientError: the webserver could not cancel it (the message says why).
        """
        info = self.run(run_id)
        if info.finished:
            return info
        result = self._query(queries.TERMINATE_RUN, {"runId": run_id, "policy": "SAFE_TERMINATE"})["terminateRun"]
        self._ok(result, "TerminateRunSuccess")
        if not wait:
            return self.run(run_id)
        info = self.wait(run_id, progress=False, poll_s=1.0, timeout_s=timeout_s)
        if info.partition and self.mlflow_uri:
            self._close_mlflow_round(info.partition, "KILLED")
        return info

    def _close_mlflow_round(self, key: str, status: str) -> list[str]:
        """End the round's MLflow runs still RUNNING with ``status`` (what the deployment's sensor does)."""
        experiment = self.mlflow.get_experiment_by_name(self.task)
        if experiment is None:
            return []
        runs = self.mlflow.search_runs([experiment.experiment_id], max_results=100,
                                       filter_string=f"tags.`{TAG_ROUND}` = '{key}' and attributes.status = 'RUNNING'")
        for r in runs:
            self.mlflow.set_terminated(r.info.run_id, status=status)
        return [r.info.run_id for r in runs]

    def retry(self, run: str, *, wait: bool = False, progress: bool = True,
              timeout_s: float | None = None) -> RoundRun | RoundInfo:
        """Run a failed or cancelled round again: Dagster's re-execution of its run from the failed step.

        The steps that succeeded are not run again (their stored values are read back); the retry has the
        failed run's config (its hypothesis) and tags. ``run`` is a run id or a round key (its latest run
        whose hypothesis was not refused).
        Returns the retry's :class:`RoundRun`, or with ``wait`` the round once the retry has ended.

        Raises:
            NotFoundError: no such run or round.
            RefusedError: the run did not fail (it succeeded or is still going), or its hypothesis was
                refused (it would be refused again: start a new round with a corrected hypothesis).
            RoundFailed: with ``wait``, the retry failed too.
        """
        if run.startswith("r") and run[1:].isdigit():
            runs = self.runs(ROUND_JOB, partition=run, limit=20)
            if not runs:
                raise NotFoundError(f"round: no run of round {run!r} at {self.dagster_url}")
            if self.decision(run) is not None:
                raise RefusedError(f"round {run} is decided; nothing to retry")
            # the latest run that can run again: a run whose hypothesis was refused would be refused again
            info = next((r for r in runs if not r.tags.get(REFUSED_TAG)), runs[0])
        else:
            info = self.run(run)
        if info.status not in ("FAILURE", "CANCELED"):
            raise RefusedError(f"run {info.run_id} is {info.status}: only a failed or cancelled run is retried")
        if info.tags.get(REFUSED_TAG):
            reason = self.run_error(info.run_id)
            raise RefusedError(f"run {info.run_id}: its hypothesis was refused ({reason}); a retry would be refused "
                               f"again: start a new round with a corrected hypothesis")
        started = time.time()
        params = {"parentRunId": info.run_id, "strategy": "FROM_FAILURE",
                  "extraTags": [{"key": CLIENT_TAG, "value": "sdk"}]}
        result = self._ok(self._query(queries.REEXECUTE_RUN, {"params": params})["launchRunReexecution"],
                          "LaunchRunSuccess")
        launched = RoundRun(key=info.partition or "", run_id=str(result["run"]["runId"]), launched_at=started)
        if not wait:
            return launched
        return self._finish_round(launched, progress=progress, timeout_s=timeout_s)

    def _finish_round(self, launched: RoundRun, *, progress: bool, poll_s: float = 2.0,
                      timeout_s: float | None = None) -> RoundInfo:
        """Wait for a round's run; the round with its decision, or RoundFailed with the failed step's error."""
        info = self.wait(launched.run_id, progress=progress, poll_s=poll_s, timeout_s=timeout_s)
        decision = self.decision(launched.key) if info.success else None
        if not info.success or decision is None:
            reason = self.run_error(info.run_id) if info.status == "FAILURE" else None
            why = f": {reason}" if reason is not None else " without a decision"
            hint = "" if info.status == "CANCELED" or (reason and info.tags.get(REFUSED_TAG)) else (
                f"; Client.retry({launched.key!r}) runs it again from the failed step")
            raise RoundFailed(f"round {launched.key}: run {info.run_id} ended {info.status}{why}{hint}", info, reason)
        return RoundInfo(launched.key, info, decision)

    def _progress_lines(self, run_id: str, cursor: str | None) -> tuple[list[tuple[str | None, str]], str | None]:
        """The run's INFO log messages after ``cursor`` as ``(step, message)`` (the steps' progress lines), and the new cursor."""
        result = self._query(queries.RUN_LOGS, {"runId": run_id, "after": cursor})["logsForRun"]
        if result.get("__typename") != "EventConnection":
            return [], cursor
        lines = [(e.get("stepKey"), e["message"]) for e in result["events"]
                 if e.get("__typename") == "LogMessageEvent" and e.get("level") == "INFO" and e.get("message")]
        return lines, result.get("cursor") or cursor

    def wait(self, run_id: str, *, progress: bool = True, poll_s: float = 2.0, timeout_s: float | None = None,
             desc: str | None = None) -> RunInfo:
        """Follow a run until it ends; returns it (whatever its status).

        With ``progress``, a bar over the run's steps (a line every few percent or 30 s when stderr is
        not a terminal), with the step that runs and its latest progress line (training, say) beside it.

        Raises:
            ClientError: ``timeout_s`` passed first (the run goes on).
        """
        info = self.run(run_id)
        if progress:
            ensure_shown()  # a notebook or a script: the progress lines go to stderr, where a person sees them
        # A retry runs the failed step and those after it: its bar counts what it runs, not the whole job.
        total = len(info.step_keys) if info.step_keys else self.job_steps(info.job)
        bar = Progress(desc or (f"round {info.partition}" if info.partition else info.job),
                       total=total, unit="step") if progress else None
        cursor: str | None = None
        latest: dict[str | None, str] = {}  # the last progress line of each step
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            while True:
                done = sum(1 for s in info.steps if s.status in ("SUCCESS", "FAILURE", "SKIPPED"))
                if bar is not None:
                    running = [s.key for s in info.steps if s.status == "IN_PROGRESS"]
                    lines, cursor = self._progress_lines(run_id, cursor)
                    latest.update(lines)
                    detail = next((latest[k] for k in running if k in latest), "")
                    # before the first step: QUEUED (a queued instance needs dagster-daemon) or STARTING
                    waiting = info.status if info.status in ("QUEUED", "NOT_STARTED", "STARTING") else None
                    bar.update(done - bar.n, now=",".join(running) or waiting, detail=detail or None)
                if info.finished:
                    return info
                if deadline is not None and time.monotonic() > deadline:
                    raise ClientError(f"run {run_id} is still {info.status} after {timeout_s:.0f}s")
                time.sleep(poll_s)
                info = self.run(run_id)
        finally:
            if bar is not None:
                bar.close()

    # ------------------------------------------------------------------ setup and rounds

    def is_set_up(self) -> bool:
        """Whether the noise floor (and so release 1) has been materialized."""
        return bool(self._materializations(NOISE_FLOOR, limit=1))

    def setup(self, *, wait: bool = True, progress: bool = True) -> RunInfo:
        """Launch ``setup_job`` (the task's benchmark and noise floor, release 1 on a fresh task).

        Cached on the server per benchmark version and recipe, so running it again is cheap.

        Raises:
            UnavailableError: a server did not answer its probe (:meth:`probe`).
            RoundFailed: the setup run failed.
        """
        self.probe()
        run_id = self._launch(SETUP_JOB, tags={CLIENT_TAG: "sdk"})
        if not wait:
            return self.run(run_id)
        info = self.wait(run_id, progress=progress, desc="setup")
        if not info.success:
            reason = self.run_error(run_id) if info.status == "FAILURE" else None
            raise RoundFailed(f"setup run {run_id} ended {info.status}" + (f": {reason}" if reason else ""), info, reason)
        warning = self.promotion_warning()
        if warning:
            warnings.warn(f"task {self.task}: {warning}", PromotionOutOfReach, stacklevel=2)
        return info

    def promotion_warning(self) -> str | None:
        """Why no candidate can be promoted with the measured noise floor (the bar is above what the metric can
        still gain over the champion), or ``None`` when one can; :meth:`setup` warns with it."""
        found = self._materializations(NOISE_FLOOR, limit=1)
        return found[0]["metadata"].get(PROMOTION_WARNING_LABEL) if found else None

    def round_keys(self) -> list[str]:
        """Every ``rounds`` partition, in order."""
        result = self._ok(self._query(queries.PARTITION_KEYS, {"asset": {"path": [PROMOTION_DECISION]}})[
            "assetNodeOrError"], "AssetNode")
        return sorted(result["partitionKeys"] or [], key=round_number)

    def next_round_key(self) -> str:
        """The key after the last ``rounds`` partition (``r0001`` for the first)."""
        keys = self.round_keys()
        return round_key(round_number(keys[-1]) + 1 if keys else 1)

    def add_round(self, key: str | None = None) -> str:
        """Add a ``rounds`` partition (the next key by default) and return its key.

        Raises:
            ClientError: ``key`` is not a round key, or the partition exists.
        """
        key = key or self.next_round_key()
        try:
            round_number(key)
        except ValueError as exc:
            raise ClientError(f"key: {exc}") from None
        result = self._query(queries.ADD_PARTITION, {"repo": self._repo(), "partitions": ROUNDS_PARTITIONS,
                                                     "key": key})["addDynamicPartition"]
        if result.get("__typename") == "DuplicateDynamicPartitionError":
            raise ClientError(f"key: round {key} exists already; leave key out for the next one ({self.next_round_key()})")
        self._ok(result, "AddDynamicPartitionSuccess")
        return key

    def start_round(self, hypothesis: Mapping[str, Any] | str | os.PathLike[str] | None = None, *,
                    key: str | None = None, tags: Mapping[str, str] | None = None) -> RoundRun:
        """Add the next round's partition and launch its run; returns at once (see :meth:`wait`).

        Args:
            hypothesis: A person's hypothesis (a mapping, JSON text or a JSON file); ``None``: the
                round derives one from the champion's failures. Checked here, before anything is launched.
            key: A round key of your choosing (default: the next one).
            tags: Extra tags of the Dagster run.

        One round at a time: a round of the deployment that has not ended refuses the start (naming it and its
        run); two starts that pass this check together are told apart by the round's first step, which claims the
        task's round on the deployment (``core/loop/round_claim.py``): the second run ends refused, having
        written nothing.

        Raises:
            RefusedError: a round runs on the deployment (the message names it and its run).
            UnavailableError: a server did not answer its probe (:meth:`probe`).
            ClientError: a bad hypothesis (the message names the field), the setup has not run, or
                the server refused the launch.
        """
        started = time.time()
        proposal = _hypothesis_json(hypothesis)
        self.probe()
        if not self.is_set_up():
            raise ClientError(f"the task {self.task!r} has no noise floor yet: run Client.setup() "
                              f"(setup_job) before the first round")
        self.ensure_no_round_running()
        key = self.add_round(key)
        run_config: dict[str, Any] = {}
        if proposal is not None:
            run_config = {"ops": {HYPOTHESIS_ASSET: {"config": {"proposal_json": proposal}}}}
        run_id = self._launch(ROUND_JOB, run_config=run_config,
                              tags={PARTITION_TAG: key, CLIENT_TAG: "sdk", **dict(tags or {})})
        return RoundRun(key=key, run_id=run_id, launched_at=started)

    def ensure_no_round_running(self) -> None:
        """Refuse while a round of the deployment has not ended.

        Raises:
            RefusedError: a round runs; the message names it and its run.
        """
        running = self.runs(ROUND_JOB, statuses=UNFINISHED, limit=1)
        if running:
            run = running[0]
            raise RefusedError(f"round {run.partition} of task {self.task!r} is running (run {run.run_id}, "
                               f"{run.status}): wait for it or cancel it first")

    def run_round(self, hypothesis: Mapping[str, Any] | str | os.PathLike[str] | None = None, *,
                  progress: bool = True, poll_s: float = 2.0, timeout_s: float | None = None,
                  tags: Mapping[str, str] | None = None) -> RoundInfo:
        """Start a round, wait for it with progress, and return it with its decision.

        Raises:
            RoundFailed: the run ended without a decision.
        """
        launched = self.start_round(hypothesis, tags=tags)
        return self._finish_round(launched, progress=progress, poll_s=poll_s, timeout_s=timeout_s)

    def run_loop(self, *, rounds: int, patience: int = 2, max_wall_s: float = 6 * 3600,
                 hypothesis: Mapping[str, Any] | str | os.PathLike[str] | None = None, progress: bool = True,
                 on_round: Callable[[RoundInfo], None] | None = None) -> list[RoundInfo]:
        """Run rounds one after another while the budget lasts (the loop's budget, driven from here).

        Stops after ``rounds`` rounds, after ``patience`` rounds in a row without a promotion, or when
        ``max_wall_s`` has passed; the hypothesis (if any) is the first round's, later rounds derive theirs.

        Raises:
            ClientError: a budget that is not positive (naming the field).
            RoundFailed: a round ended without a decision (the rounds before it are in ``error.run``'s history).
        """
        for name, value in (("rounds", rounds), ("patience", patience), ("max_wall_s", max_wall_s)):
            if not value > 0:
                raise ClientError(f"{name}: the loop's budget must be positive, got {value}")
        from envloop_pipelines.core.loop.budget import LoopBudget, NextRound, drive_loop, spent

        budget = LoopBudget(max_rounds=rounds, patience=patience, max_wall_s=max_wall_s)
        started, done = time.monotonic(), []
        loop_id = f"sdk-{int(time.time())}"

        def ask() -> NextRound:  # the deployment's ledger is not ours to read: the budget counts this loop's rounds
            reason = spent(budget, [bool(r.decision and r.decision.promote) for r in done], time.monotonic() - started)
            return NextRound(None, reason) if reason else NextRound(f"round {len(done) + 1}", "within budget")

        def run(nxt: NextRound) -> bool:
            result = self.run_round(None if done else hypothesis, progress=progress, tags={LOOP_TAG: loop_id})
            done.append(result)
            if on_round is not None:
                on_round(result)
            return True  # a round without a decision raised RoundFailed

        drive_loop(ask, run)
        return done

    # ------------------------------------------------------------------ what the steps recorded

    def _materializations(self, asset: str, *, partitions: Sequence[str] | None = None,
                          limit: int | None = None) -> list[dict[str, Any]]:
        """Materializations of ``asset``, newest first, each with ``metadata`` as a dict of plain values."""
        variables = {"asset": {"path": [asset]}, "partitions": list(partitions) if partitions is not None else None,
                     "limit": limit}
        result = self._query(queries.MATERIALIZATIONS, variables)["assetOrError"]
        if result.get("__typename") == "AssetNotFoundError":
            return []
        out = []
        for m in self._ok(result, "Asset")["assetMaterializations"]:
            metadata: dict[str, Any] = {}
            for entry in m["metadataEntries"]:
                kind = entry["__typename"]
                if kind == "JsonMetadataEntry":
                    metadata[entry["label"]] = json.loads(entry["jsonString"])
                else:
                    metadata[entry["label"]] = next((v for k, v in entry.items() if k not in ("label", "__typename")),
                                                    None)
            out.append({"run_id": m["runId"], "partition": m["partition"], "timestamp": float(m["timestamp"]) / 1000,
                        "metadata": metadata})
        return sorted(out, key=lambda m: -m["timestamp"])

    def decision(self, key: str) -> RoundDecision | None:
        """The round's decision (``promotion_decision``), ``None`` until it is decided.

        Raises:
            NotFoundError: there is no round ``key``.
        """
        for m in self._materializations(PROMOTION_DECISION, partitions=[key], limit=1):
            raw = m["metadata"].get(DECISION_LABEL)
            if raw is not None:
                return RoundDecision.from_dict(raw)
        keys = self.round_keys()
        if key not in keys:
            raise NotFoundError(f"round: no round {key!r} at {self.dagster_url}; rounds: {', '.join(keys) or 'none'}")
        return None

    def round(self, key: str) -> RoundInfo:
        """One round: its latest run and its decision.

        Raises:
            ClientError: there is no such round.
        """
        if key not in self.round_keys():
            raise NotFoundError(f"round: no round {key!r} at {self.dagster_url}; rounds: {', '.join(self.round_keys()) or 'none'}")
        runs = self.runs(ROUND_JOB, partition=key, limit=1)
        return RoundInfo(key, runs[0] if runs else None, self.decision(key))

    def rounds(self) -> list[RoundInfo]:
        """Every round, oldest first, with its latest run and decision."""
        decisions: dict[str, RoundDecision] = {}
        for m in self._materializations(PROMOTION_DECISION):
            raw = m["metadata"].get(DECISION_LABEL)
            if m["partition"] and raw is not None and m["partition"] not in decisions:
                decisions[m["partition"]] = RoundDecision.from_dict(raw)
        latest: dict[str, RunInfo] = {}
        for run in self.runs(ROUND_JOB, limit=500):
            if run.partition and run.partition not in latest:
                latest[run.partition] = run
        return [RoundInfo(k, latest.get(k), decisions.get(k)) for k in self.round_keys()]

    def ledger(self, kind: str | None = None) -> list[dict[str, Any]]:
        """The ledger events the steps published (null arms, hypotheses, checkpoints, decisions, releases), oldest first.

        Raises:
            RefusedError: ``kind`` is not a ledger event kind (the message lists them).
        """
        from envloop_pipelines.core.ledger.event_log import EVENT_KINDS

        if kind is not None and kind not in EVENT_KINDS:
            raise RefusedError(f"kind: {kind!r} is not a ledger event kind; allowed: {', '.join(EVENT_KINDS)}")
        events: dict[str, dict[str, Any]] = {}
        for asset in (NOISE_FLOOR, PROMOTION_DECISION):
            for m in self._materializations(asset):
                for e in m["metadata"].get(LEDGER_EVENTS_LABEL) or []:
                    events.setdefault(e.get("event_id") or json.dumps(e, sort_keys=True), e)
        out = sorted(events.values(), key=lambda e: e.get("at") or 0)
        return [e for e in out if kind is None or e.get("kind") == kind]

    def cards(self) -> dict[int, dict[str, Any]]:
        """Release cards by release number, as the steps that published them recorded them."""
        cards: dict[int, dict[str, Any]] = {}
        for asset in (NOISE_FLOOR, PROMOTION_DECISION):
            for m in self._materializations(asset):
                card = m["metadata"].get(RELEASE_CARD_LABEL)
                if card and int(card["release"]) not in cards:
                    cards[int(card["release"])] = card
        return cards

    def card(self, release: int | str = "champion") -> dict[str, Any]:
        """One release's card (``"champion"``: the current champion's).

        Raises:
            ClientError: no such release.
        """
        number = self._release_number(release)
        card = self.cards().get(number)
        if card is None:
            raise NotFoundError(f"release: release {number} has no card at {self.dagster_url}")
        return card

    # ------------------------------------------------------------------ MLflow: releases, champion, checkpoints

    @property
    def mlflow(self) -> Any:
        """``mlflow.MlflowClient`` on :attr:`mlflow_uri`."""
        if self._mlflow is None:
            if not self.mlflow_uri:
                raise ClientError("mlflow_uri: not set; pass Client(..., mlflow_uri='http://host:port') "
                                  "or set MLFLOW_TRACKING_URI")
            from mlflow import MlflowClient

            self._probe_mlflow()
            self._mlflow = MlflowClient(tracking_uri=self.mlflow_uri, registry_uri=self.mlflow_uri)
        return self._mlflow

    def _probe_mlflow(self) -> None:
        """An MLflow server must answer ``/health`` (``core/services.py``): a dead URL fails here, in seconds, not
        after MLflow's own retries (minutes). A local store (``sqlite:///...``) needs no probe.

        Raises:
            UnavailableError: the server did not answer, or answered with an error (one line: URL and setting).
        """
        from envloop_pipelines.core.services import PROBE_TIMEOUT_S, ServiceUnavailable, probe_tracking_uri

        try:
            probe_tracking_uri(self.mlflow_uri, self.mlflow_setting, min(self.timeout_s, PROBE_TIMEOUT_S))
        except ServiceUnavailable as exc:
            raise UnavailableError(str(exc)) from None

    def probe(self) -> None:
        """Fail in seconds when the Dagster webserver, or the MLflow server (when ``mlflow_uri`` is set), does not
        answer: one request each, no retries, within ``min(timeout_s, 5)``. Done before any work by
        :meth:`setup` and :meth:`start_round` (so :meth:`run_round` and :meth:`run_loop`).

        Raises:
            UnavailableError: a server did not answer; the one-line message names its URL and the setting.
        """
        from envloop_pipelines.core.services import PROBE_TIMEOUT_S, ServiceUnavailable, probe

        try:  # any answer shows the webserver is up (a proxy in front may refuse /server_info itself)
            probe(self.dagster_url, name="the Dagster webserver", setting="dagster_url", path="/server_info",
                  timeout_s=min(self.timeout_s, PROBE_TIMEOUT_S), http_error_fails=False)
        except ServiceUnavailable as exc:
            raise UnavailableError(str(exc)) from None
        self._probe_mlflow()

    def releases(self, *, with_cards: bool = True) -> list[ReleaseInfo]:
        """The release chain from the MLflow registry (one model version per release), oldest first."""
        from mlflow.exceptions import MlflowException

        try:
            versions = self.mlflow.search_model_versions(f"name='{self.model_name}'")
        except MlflowException as exc:
            raise UnavailableError(f"MLflow at {self.mlflow_uri}: {exc.message}") from None
        try:
            champion = str(self.mlflow.get_model_version_by_alias(self.model_name, CHAMPION_ALIAS).version)
        except MlflowException:
            champion = None
        cards = self.cards()  # the ledger's, as the steps that published them recorded them
        mismatch = projection_error([cards[k] for k in sorted(cards)],
                                    [(str(v.version), v.tags or {}) for v in versions], champion, self.model_name)
        if mismatch:  # the registry is the ledger's projection (issue 34): a moved alias or a forged tag is refused
            raise ClientError(f"release chain refused: {mismatch}")
        if not with_cards:
            cards = {}
        out = []
        for v in versions:
            if TAG_RELEASE not in (v.tags or {}):
                continue
            number = int(v.tags[TAG_RELEASE])
            metrics = self.mlflow.get_run(v.run_id).data.metrics if v.run_id else {}
            holdout = {k[len(HOLDOUT_PREFIX):]: val for k, val in metrics.items() if k.startswith(HOLDOUT_PREFIX)}
            out.append(ReleaseInfo(release=number, model_version=str(v.version), round=v.tags.get(TAG_ROUND),
                                   checkpoint_sha256=v.tags.get(TAG_CHECKPOINT), mlflow_run_id=v.run_id,
                                   holdout=holdout, champion=str(v.version) == champion, card=cards.get(number)))
        return sorted(out, key=lambda r: r.release)

    def release_cards(self) -> list[dict[str, Any]]:
        """The releases as the local ledger's cards look: the card, with MLflow's version, holdout and champion flag."""
        out = []
        for r in self.releases():
            card = dict(r.card or {"release": r.release, "round": r.round, "checkpoint_sha256": r.checkpoint_sha256})
            card.setdefault("errata", [])
            out.append({**card, "model_version": r.model_version, "mlflow_run_id": r.mlflow_run_id,
                        "holdout": card.get("holdout") or dict(r.holdout), "champion": r.champion})
        return out

    def champion(self) -> ReleaseInfo | None:
        """The release the ``champion`` alias points at (``None`` before release 1)."""
        return next((r for r in self.releases() if r.champion), None)

    def _release_number(self, release: int | str) -> int:
        if release == "champion":
            champ = self.champion()
            if champ is None:
                raise NotFoundError(f"release: the task {self.task!r} has no champion yet (run setup first)")
            return champ.release
        try:
            return int(release)
        except (TypeError, ValueError):
            raise RefusedError(f"release: {release!r} is neither a release number nor 'champion'") from None

    def fetch_checkpoint(self, release: int | str = "champion", dest: str | os.PathLike[str] = ".") -> Path:
        """Download a release's checkpoint from MLflow into ``dest/<sha256>`` and verify it.

        The directory is named by the checkpoint's identity (as in the loop's own store); an existing
        one with that name is verified and reused. Returns the directory.

        Raises:
            ClientError: no such release, or the download does not verify against the release's sha256.
        """
        from envloop_pipelines.console import quiet_third_party
        from envloop_pipelines.core.model.checkpoint import checkpoint_hash, verify_checkpoint

        quiet_third_party()  # the CLI's filters (a download's and a model's bars and notes), for a script or notebook
        number = self._release_number(release)
        found = next((r for r in self.releases(with_cards=False) if r.release == number), None)
        if found is None or not found.mlflow_run_id:
            raise NotFoundError(f"release: no release {number} of {self.model_name} in MLflow at {self.mlflow_uri}")
        dest_dir = Path(dest)
        dest_dir.mkdir(parents=True, exist_ok=True)
        target = dest_dir / str(found.checkpoint_sha256)
        if not target.exists():
            staging = Path(tempfile.mkdtemp(prefix=".fetch-", dir=dest_dir))
            try:
                local = Path(self.mlflow.download_artifacts(found.mlflow_run_id, "checkpoint", str(staging)))
                local.rename(target)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        verify_checkpoint(target)
        if found.checkpoint_sha256 and checkpoint_hash(target) != found.checkpoint_sha256:
            raise ClientError(f"release {number}: the downloaded checkpoint hashes to {checkpoint_hash(target)}, "
                              f"not {found.checkpoint_sha256}")
        return target

    # ------------------------------------------------------------------ predict: a served release, or here

    def predict(self, request: Mapping[str, Any] | Sequence[Mapping[str, Any]], *, url: str | None = None,
                release: int | str = "champion", dest: str | os.PathLike[str] | None = None,
                api_key: str | None = None) -> Any:
        """A release's answers to a Jev request (``{"state": ..., "questions": {...}}``; a labelled decision record
        works too: its labels and meta are left out), or to a list of them.

        With ``url`` the request goes to a served release (``envloop serve``, ``POST <url>/v1/systemone``);
        without, the release's checkpoint is fetched from MLflow (:meth:`fetch_checkpoint`, into ``dest``, default
        a temporary folder kept for this client) and answered in this process by the same server code
        (``core/serve/app.py``, in process): the numbers are the ones ``envloop serve`` gives.

        Raises:
            RefusedError: the server refused the request (the message is its own, naming the field).
            NotFoundError: no such release.
            UnavailableError: the server at ``url`` did not answer.
        """
        return self._answers.predict(request, url=url, api_key=api_key,
                                     source=lambda: self._release_source(release, dest))

    def _release_source(self, release: int | str, dest: str | os.PathLike[str] | None) -> Any:
        """The model source of a release's checkpoint, fetched from MLflow into ``dest`` (default: this client's
        temporary folder); it answers as the release (``envloop-<task>-r<NNNN>``), as the LocalClient's does."""
        from envloop_pipelines.core.serve.settings import source_from_release_checkpoint

        if dest is None:
            if self._models_dir is None:
                self._models_dir = tempfile.mkdtemp(prefix="envloop-models-")
            dest = self._models_dir
        number = self._release_number(release)
        return source_from_release_checkpoint(self.fetch_checkpoint(number, dest), self.task, number)

    def close(self) -> None:
        """Stop the in-process servers :meth:`predict` started (their models are unloaded)."""
        self._answers.close()

    # ------------------------------------------------------------------ eval (runs here)

    @staticmethod
    def evaluate(checkpoint: str | os.PathLike[str], *, records: str | os.PathLike[str] | None = None,
                 task: str | None = None, split: str = "dev", home: str | os.PathLike[str] | None = None) -> dict[str, Any]:
        """Metrics of a checkpoint on labelled data, computed on this machine (as ``envloop eval``).

        Args:
            checkpoint: A checkpoint directory (:meth:`fetch_checkpoint` gives one).
            records: A JSONL/CSV/Parquet file of labelled decision records; or
            task, split, home: an open split (``dev``, ``val``, ``train``) of a task in a local EnvLoop home.

        Raises:
            ClientError: neither or both of ``records`` and ``task``, or a split the verifier keeps.
        """
        from envloop_pipelines.core.benchmark import SAFETY_FAMILIES
        from envloop_pipelines.core.model.predict import evaluate_checkpoint

        if (records is None) == (task is None):
            raise ClientError("records/task: give exactly one: a file of labelled records, or a task and an open split")
        if records is not None:
            from envloop_pipelines.core.data.records import questions_table
            from envloop_pipelines.core.data.tabular import load_records

            table = questions_table(load_records(Path(records), require_group=False).records)
            source = {"records": str(records)}
        else:
            if split not in ("dev", "val", "train"):
                raise ClientError(f"split: {split!r} is not an open split (dev, val, train); test and holdout are "
                                  f"scored by the verifier only")
            from envloop_pipelines.core.data.snapshots import open_task

            snapshot = open_task(str(task), home=home)
            table = snapshot.table(split)
            source = {"task": str(task), "split": split, "benchmark_version": snapshot.benchmark_version}
        return {**evaluate_checkpoint(checkpoint, table, safety_families=SAFETY_FAMILIES), **source}


__all__ = ["Client", "ClientError", "NotFoundError", "PromotionOutOfReach", "RefusedError", "ReleaseInfo", "RoundFailed", "RoundInfo", "RoundRun",
           "RunError", "RunInfo", "StepInfo", "UnavailableError"]
