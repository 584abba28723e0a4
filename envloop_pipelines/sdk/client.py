"""The ``Client``: rounds, decisions, releases and checkpoints of a running EnvLoop deployment.

Two engines' own APIs, nothing of ours in between:

* **Dagster's GraphQL API** (:class:`~envloop_pipelines.sdk.webserver.DagsterWebserver`, which ``Client``
  extends): add a ``rounds`` partition (``addDynamicPartition``), launch ``round_job`` or ``setup_job``
  (``launchRun``), follow a run (``runOrError``: status and step stats; ``logsForRun``: the
  steps' progress lines), and read what the steps recorded in their asset materializations:
  ``promotion_decision`` carries the round's typed decision, its ledger events and the release
  card it wrote; ``noise_floor`` the null arms and release 1 (``defs/rounds/metadata.py``).
* **MLflow's tracking and registry API** (:class:`~envloop_pipelines.sdk.releases.MlflowReleases`): the
  registered model ``envloop-<task>`` with one version per release and the ``champion`` alias; each
  version's run holds the release's holdout metrics and its checkpoint as an artifact.

A client never reads a deployment's EnvLoop home: what it shows is what the webserver and the
MLflow server expose, so the same client drives a local ``envloop ui`` (``http://127.0.0.1:3000``
and ``sqlite:///.envloop/mlflow.db`` or a local ``mlflow server``) and a Kubernetes deployment;
only the two URLs change. The loop's settings are the code location's (``ENVLOOP_<FIELD>`` on the
server): :meth:`Client.loop_settings` asks the webserver for its ``loop`` resource's configured values
(``sdk/loop_settings.py``); the one setting a client gives its own runs is the loop recipe override
(``Client(loop_settings={"recipe_overrides": ...})``, checked before anything is launched, sent in the run config
of the ``loop`` resource). A loop of rounds is driven from the client (:meth:`Client.run_loop`): one
round at a time, stopping on the budget (rounds, patience, wall time), with no daemon needed. The
ledger a client sees is the events the steps published (null arms, hypotheses, trained checkpoints,
rejections, decisions, releases), not the events only the daemon's sensors write (``round_failed``; a
failed round shows as a failed run instead).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from envloop_pipelines.console import quiet_third_party
from envloop_pipelines.core.decision_loop.proposals import ProposalError, parse_proposal
from envloop_pipelines.core.loop.budget import LoopBudget, NextRound, drive_loop, spent
from envloop_pipelines.core.loop.config import round_number
from envloop_pipelines.core.loop.round_claim import watch_or_cancel
from envloop_pipelines.core.serve.settings import source_from_release_checkpoint
from envloop_pipelines.core.services import PROBE_TIMEOUT_S, ServiceUnavailable, probe
from envloop_pipelines.core.tracking import model_name
from envloop_pipelines.names import (
    BUSY_WITH_TAG,
    CLIENT_TAG,
    HYPOTHESIS_ASSET,
    LOOP_TAG,
    PARTITION_TAG,
    REFUSED_BUSY,
    REFUSED_TAG,
    ROUND_JOB,
    ROUNDS_PARTITIONS,
    SETUP_JOB,
)
from envloop_pipelines.sdk import queries
from envloop_pipelines.sdk.errors import (
    BusyError,
    ClientError,
    NotFoundError,
    PromotionOutOfReach,
    RefusedError,
    RoundFailed,
    UnavailableError,
)
from envloop_pipelines.sdk.evaluate import evaluate
from envloop_pipelines.sdk.loop_settings import client_overrides, loop_run_config, reported_settings
from envloop_pipelines.sdk.predict import Answerer
from envloop_pipelines.sdk.recorded import DeploymentRecords
from envloop_pipelines.sdk.records import UNFINISHED, ReleaseInfo, RoundInfo, RoundRun, RunInfo
from envloop_pipelines.sdk.releases import MlflowReleases


def _hypothesis_json(hypothesis: Mapping[str, Any] | str | os.PathLike[str] | None) -> str | None:
    """A person's hypothesis (a mapping, JSON text or a JSON file) as checked JSON; ``None`` for the automatic one."""
    try:
        proposal = parse_proposal(hypothesis)
    except ProposalError as exc:
        raise RefusedError(str(exc)) from None
    return None if proposal is None else json.dumps(proposal, sort_keys=True)


class Client(DeploymentRecords):
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
        loop_settings: The loop settings this client's runs (its setup and its rounds) take: only
            ``{"recipe_overrides": {...}}``, the loop recipe override, spelled as ``LocalClient``'s; the other
            settings are the deployment's. Checked here, before anything is launched, as ``LocalClient`` checks
            it (``check_recipe_overrides``: a misspelled field is refused naming a close match), and applied on top
            of the deployment's own override, through the run config of the ``loop`` resource. The noise floor is
            measured per recipe: give the setup and every round the same override (a round whose recipe is not
            the floor's is refused: when it registers where no floor of its recipe was measured, else by its
            decision, ``FloorRecipeError``).

    Raises:
        RefusedError: ``dagster_url`` is not an http(s) URL, or ``loop_settings`` is refused (naming the setting,
            or the recipe field, a close match and the fields).

    Example::

        from envloop_pipelines.sdk import Client

        client = Client("http://127.0.0.1:3000", mlflow_uri="http://127.0.0.1:5000")
        client.setup()                                   # benchmark + noise floor, once
        round_ = client.run_round()                      # start, wait with progress, read the decision
        print(round_.decision.promote, round_.decision.reasons)
        ckpt = client.fetch_checkpoint("champion", "./models")
    """

    def __init__(self, dagster_url: str, mlflow_uri: str | None = None, *, timeout_s: float = 60.0,
                 headers: Mapping[str, str] | None = None, mlflow_setting: str | None = None,
                 loop_settings: Mapping[str, Any] | None = None) -> None:
        self._overrides = client_overrides(loop_settings)  # first: a misspelled recipe field, before any request
        super().__init__(dagster_url, timeout_s=timeout_s, headers=headers)
        uri = mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI") or None
        self._releases = MlflowReleases(uri, mlflow_setting or ("mlflow_uri" if mlflow_uri else "MLFLOW_TRACKING_URI"),
                                        self.timeout_s)
        self._settings: dict[str, Any] | None = None
        self._configured: list[dict[str, str]] = []  # the loop resource's configured values, as reported
        self._models_dir: str | None = None
        self._answers = Answerer(self.timeout_s)

    @property
    def mlflow_uri(self) -> str | None:
        """MLflow's tracking URI (``mlflow_uri``, else ``$MLFLOW_TRACKING_URI``); ``None`` when neither is set."""
        return self._releases.uri

    @property
    def mlflow_setting(self) -> str:
        """Where :attr:`mlflow_uri` came from, as errors name it."""
        return self._releases.setting

    # ------------------------------------------------------------------ the code location's loop

    def loop_settings(self) -> dict[str, Any]:
        """The loop the code location runs, as the deployment reports it (``LoopConfig`` names): its ``loop``
        resource's configured values, read over GraphQL.

        Each ``ENVLOOP_<FIELD>`` set when the code location loaded is a configured value; a setting left unset there
        is ``LoopConfig``'s default. Nothing is read on this machine: ``home`` is the deployment's (``None``: its
        default), and ``safety_families`` are the configured ones (a run adds those its task declares).
        ``recipe_overrides`` is the one this client's runs take: the deployment's, with this client's
        (``loop_settings``) on top.

        Raises:
            ClientError: the code location has no ``loop`` resource, or a setting of it is an environment variable
                the webserver does not show.
        """
        if self._settings is None:
            repo = self._ok(self._query(queries.RESOURCES, {"repo": self._repo()})["repositoryOrError"], "Repository")
            loop = next((r for r in repo["allTopLevelResourceDetails"] if r["name"] == "loop"), None)
            if loop is None:
                raise ClientError(f"the code location {self.location()[0]!r} has no 'loop' resource")
            self._settings = reported_settings(loop["configuredValues"])
            self._configured = list(loop["configuredValues"])
        if not self._overrides:
            return dict(self._settings)
        return {**self._settings, "recipe_overrides": {**self._settings["recipe_overrides"], **self._overrides}}

    def _loop_run_config(self) -> dict[str, Any]:
        """The run config of this client's runs' ``loop`` resource (``{}`` without an override: the deployment's)."""
        if not self._overrides:
            return {}
        self.loop_settings()
        return loop_run_config(self._configured, self._overrides)

    @property
    def task(self) -> str:
        return str(self.loop_settings()["task"])

    @property
    def model_name(self) -> str:
        """The MLflow registered model of the task's releases."""
        return model_name(self.task)

    # ------------------------------------------------------------------ runs of rounds

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
        return self._releases.close_round_runs(lambda: self.task, key, status)

    def retry(self, run: str, *, wait: bool = False, progress: bool = True,
              timeout_s: float | None = None) -> RoundRun | RoundInfo:
        """Run a failed or cancelled round again: Dagster's re-execution of its run from the failed step.

        The steps that succeeded are not run again (their stored values are read back); the retry has the
        failed run's config (its hypothesis, its loop recipe override) and tags. ``run`` is a run id or a round key
        (its latest run whose hypothesis was not refused).
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
            self._raise_if_busy(info, reason)
            why = f": {reason}" if reason is not None else " without a decision"
            hint = "" if info.status == "CANCELED" or (reason and info.tags.get(REFUSED_TAG)) else (
                f"; Client.retry({launched.key!r}) runs it again from the failed step")
            raise RoundFailed(f"round {launched.key}: run {info.run_id} ended {info.status}{why}{hint}", info, reason)
        return RoundInfo(launched.key, info, decision)

    # ------------------------------------------------------------------ setup and rounds

    def setup(self, *, wait: bool = True, progress: bool = True) -> RunInfo:
        """Launch ``setup_job`` (the task's benchmark and noise floor, release 1 on a fresh task).

        Cached on the server per benchmark version and recipe, so running it again is cheap. Refused before the
        launch while a setup or a round of the deployment has not ended (:meth:`ensure_no_round_running`); two
        setups that pass this check together are told apart by the setup's first step, which claims the task's
        loop on the deployment (``core/loop/round_claim.py``): the second run ends refused, having generated and
        written nothing, and raises :class:`BusyError` too.

        Raises:
            UnavailableError: a server did not answer its probe (:meth:`probe`).
            BusyError: another run of the task's loop runs (the message names it and how to follow or cancel it).
            RoundFailed: the setup run failed.
        """
        self.probe()
        self.ensure_no_round_running()
        run_id = self._launch(SETUP_JOB, run_config=self._loop_run_config(), tags={CLIENT_TAG: "sdk"})
        if not wait:
            return self.run(run_id)
        info = self.wait(run_id, progress=progress, desc="setup")
        if not info.success:
            reason = self.run_error(run_id) if info.status == "FAILURE" else None
            self._raise_if_busy(info, reason)
            raise RoundFailed(f"setup run {run_id} ended {info.status}" + (f": {reason}" if reason else ""), info, reason)
        warning = self.promotion_warning()
        if warning:
            warnings.warn(f"task {self.task}: {warning}", PromotionOutOfReach, stacklevel=2)
        return info

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
            BusyError: a round or the setup runs on the deployment (the message names it and its run).
            UnavailableError: a server did not answer its probe (:meth:`probe`).
            ClientError: a bad hypothesis (the message names the field), the setup has not run, or
                the server refused the launch.
        """
        started = time.time()
        proposal = _hypothesis_json(hypothesis)
        self.probe()
        self.ensure_no_round_running()  # first: while the setup runs, a start is told so, not that there is none
        if not self.is_set_up():
            raise ClientError(f"the task {self.task!r} has no noise floor yet: run Client.setup() "
                              f"(setup_job) before the first round")
        key = self.add_round(key)
        run_config = self._loop_run_config()  # the loop's recipe override, as the setup's: the floor's recipe
        if proposal is not None:
            run_config["ops"] = {HYPOTHESIS_ASSET: {"config": {"proposal_json": proposal}}}
        run_id = self._launch(ROUND_JOB, run_config=run_config,
                              tags={PARTITION_TAG: key, CLIENT_TAG: "sdk", **dict(tags or {})})
        return RoundRun(key=key, run_id=run_id, launched_at=started)

    def ensure_no_round_running(self) -> None:
        """Refuse while a round or the setup of the deployment has not ended (two requests, within ``timeout_s``).

        Raises:
            BusyError: a round or the setup runs; the message, one line, names it, its run and how to follow or
                cancel it.
        """
        for job in (SETUP_JOB, ROUND_JOB):
            running = self.runs(job, statuses=UNFINISHED, limit=1)
            if running:
                run = running[0]
                what = "the setup" if job == SETUP_JOB else f"round {run.partition}"
                raise BusyError(f"{what} of task {self.task!r} is running (run {run.run_id}, {run.status}): "
                                f"{watch_or_cancel(run.run_id, self.dagster_url)}", run.run_id)

    def _raise_if_busy(self, info: RunInfo, reason: Any) -> None:
        """A run its first step refused because another run of the task's loop held the claim: :class:`BusyError`
        with the step's one line (naming that run)."""
        if info.tags.get(REFUSED_TAG) == REFUSED_BUSY:
            holder = info.tags.get(BUSY_WITH_TAG)
            message = (reason.message if reason is not None else
                       f"run {info.run_id} was refused: another run of task {self.task!r} holds its loop")
            if holder:  # the step names the deployment's own commands; a person here follows it with --remote
                message = message.replace(watch_or_cancel(holder), watch_or_cancel(holder, self.dagster_url))
            raise BusyError(message, holder)

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

    # ------------------------------------------------------------------ what the steps recorded (DeploymentRecords)

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
        return self._releases.client

    def probe(self) -> None:
        """Fail in seconds when the Dagster webserver, or the MLflow server (when ``mlflow_uri`` is set), does not
        answer: one request each, no retries, within ``min(timeout_s, 5)``. Done before any work by
        :meth:`setup` and :meth:`start_round` (so :meth:`run_round` and :meth:`run_loop`).

        Raises:
            UnavailableError: a server did not answer; the one-line message names its URL and the setting.
        """
        try:  # any answer shows the webserver is up (a proxy in front may refuse /server_info itself)
            probe(self.dagster_url, name="the Dagster webserver", setting="dagster_url", path="/server_info",
                  timeout_s=min(self.timeout_s, PROBE_TIMEOUT_S), http_error_fails=False)
        except ServiceUnavailable as exc:
            raise UnavailableError(str(exc)) from None
        self._releases.probe()

    def releases(self, *, with_cards: bool = True) -> list[ReleaseInfo]:
        """The release chain from the MLflow registry (one model version per release), oldest first."""
        return self._releases.releases(lambda: self.model_name, self.cards, with_cards=with_cards)

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
        quiet_third_party()  # the CLI's filters (a download's and a model's bars and notes), for a script or notebook
        number = self._release_number(release)
        found = next((r for r in self.releases(with_cards=False) if r.release == number), None)
        if found is None or not found.mlflow_run_id:
            raise NotFoundError(f"release: no release {number} of {self.model_name} in MLflow at {self.mlflow_uri}")
        return self._releases.download_checkpoint(found, dest)

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

    evaluate = staticmethod(evaluate)


__all__ = ["Client"]
