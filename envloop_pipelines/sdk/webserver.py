"""A Dagster webserver over its GraphQL API: the code location that serves ``round_job``, its runs and what its
steps recorded.

``dagster_graphql.DagsterGraphQLClient`` against the webserver: launch a job (``launchRun``), read and follow a run
(``runOrError``: status and step stats; ``logsForRun``: the steps' failures and progress lines) and read an
asset's materializations with their metadata (``assetOrError``). Nothing here knows the loop's rounds or
releases: :class:`~envloop_pipelines.sdk.client.Client` builds on it.
"""

from __future__ import annotations

import json
import time
import urllib.parse
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import requests.exceptions
from dagster_graphql import DagsterGraphQLClient, DagsterGraphQLClientError
from gql.transport.exceptions import TransportConnectionFailed, TransportServerError

from envloop_pipelines.core.progress import Progress, ensure_shown
from envloop_pipelines.names import PARTITION_TAG, ROUND_JOB
from envloop_pipelines.sdk import queries
from envloop_pipelines.sdk.errors import ClientError, RefusedError, UnavailableError
from envloop_pipelines.sdk.records import RunError, RunInfo


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


class DagsterWebserver:
    """A Dagster webserver serving this project's code location, driven over its GraphQL API.

    Args:
        dagster_url: The Dagster webserver, ``http://host:port`` (with its path prefix, if any).
        timeout_s: Per request: a webserver that does not answer within it raises :class:`UnavailableError`.
        headers: Extra HTTP headers for the webserver (an auth proxy's token, say).

    Raises:
        RefusedError: ``dagster_url`` is not an http(s) URL.
    """

    def __init__(self, dagster_url: str, *, timeout_s: float = 60.0, headers: Mapping[str, str] | None = None) -> None:
        self.dagster_url = dagster_url.rstrip("/")
        self.timeout_s = float(timeout_s)
        self._graphql = DagsterGraphQLClient(**_split_url(dagster_url), timeout=int(timeout_s),
                                             headers=dict(headers or {}))
        self._location: tuple[str, str] | None = None
        self._steps: dict[str, int] = {}

    # ------------------------------------------------------------------ GraphQL plumbing

    def _query(self, document: str, variables: Mapping[str, Any] | None = None) -> dict[str, Any]:
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
        """``result`` when its ``__typename`` is one of ``allowed``; else the SDK's error for that type
        (:func:`queries.error_class <envloop_pipelines.sdk.queries.error_class>`) with the server's message."""
        kind = result.get("__typename")
        if kind in allowed:
            return result
        message = result.get("message") or result.get("errors") or result
        raise queries.error_class(kind)(f"{kind}: {message}")

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


__all__ = ["DagsterWebserver"]
