"""Experiment tracking: MLflow is the system of record.

An experiment per task; a parent run per round; child runs for the hypothesis,
training and evaluation; a registered model per task whose alias ``champion``
moves only on promotion. The default store is SQLite under the EnvLoop home;
``MLFLOW_TRACKING_URI`` (or an explicit URI) selects a server.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from envloop_pipelines.core.storage import envloop_home

log = logging.getLogger(__name__)

CHAMPION_ALIAS = "champion"


def model_name(task: str) -> str:
    """The MLflow registered model of a task's releases."""
    return f"envloop-{task}"


#: MLflow's own tag that nests a run under its parent in the UI.
PARENT_RUN_TAG = "mlflow.parentRunId"

# -- the only spelling of the loop's MLflow tags, run kinds and metric prefixes (docs/concepts.md) -------------
TAG_KIND = "envloop.kind"
TAG_ROUND = "envloop.round"
TAG_RELEASE = "envloop.release"
TAG_CHECKPOINT = "envloop.checkpoint_sha256"
TAG_HYPOTHESIS = "envloop.hypothesis_hash"
TAG_NOISE_KEY = "envloop.noise_key"
TAG_SUPERSEDED = "envloop.superseded"
#: ``"true"`` on a hypothesis run whose predicted effect is below the test's minimum detectable effect.
TAG_UNDERPOWERED = "envloop.underpowered"
#: Experiment tag: the ledger's chain head anchored outside the home (``<bytes>:<sha256>``, core/ledger/anchor.py).
TAG_LEDGER_HEAD = "envloop.ledger_head"

#: Values of ``envloop.kind``: a round step's run is named for its Dagster asset.
KIND_ROUND = "round"
KIND_NOISE_FLOOR = "noise_floor"
KIND_NULL_ARM = "null_arm"
KIND_LINEAGE_FLOOR = "lineage_floor"
KIND_HYPOTHESIS = "registered_hypothesis"
KIND_TRAINING = "lora_checkpoint"
KIND_REEVAL = "independent_reeval"
KIND_RELEASE = "release"
RUN_KINDS = (KIND_ROUND, KIND_NOISE_FLOOR, KIND_NULL_ARM, KIND_LINEAGE_FLOOR, KIND_HYPOTHESIS, KIND_TRAINING,
             KIND_REEVAL, KIND_RELEASE)

#: Metric name prefixes: ``holdout.family_macro_accuracy``, ``candidate.brier``, ``delta.ece`` ...
HOLDOUT_PREFIX = "holdout."

# -- agents in environments (core/agents): one agent's evaluation on one dataset version -------------------------
#: The run of ``envloop env eval`` / the Dagster asset ``agent_evaluation`` (experiment ``envs/<dataset>``).
KIND_AGENT_EVAL = "agent_evaluation"
TAG_DATASET = "envloop.dataset"
TAG_DATASET_VERSION = "envloop.dataset_version"
TAG_AGENT = "envloop.agent"
RUN_KINDS = (*RUN_KINDS, KIND_AGENT_EVAL)


def default_tracking_uri(home: str | Path | None = None) -> str:
    """``$MLFLOW_TRACKING_URI`` if set, else SQLite under the EnvLoop home."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    path = envloop_home(home) / "mlflow.db"
    path.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path}"


def default_artifact_root(home: str | Path | None = None) -> str:
    return (envloop_home(home) / "mlartifacts").as_uri()


@dataclass(frozen=True)
class TrackedRun:
    run_id: str
    experiment_id: str
    url: str


class Tracker(Protocol):
    """What the loop needs from a tracking system (MLflow is the real one)."""

    def start_run(self, experiment: str, name: str, *, parent_run_id: str | None = None,
                  tags: Mapping[str, str] | None = None) -> TrackedRun: ...
    def find_run(self, experiment: str, tags: Mapping[str, str]) -> TrackedRun | None: ...
    def running_runs(self, experiment: str, tags: Mapping[str, str]) -> list[str]: ...
    def log_params(self, run_id: str, params: Mapping[str, Any]) -> None: ...
    def log_metrics(self, run_id: str, metrics: Mapping[str, float], step: int | None = None) -> None: ...
    def set_tags(self, run_id: str, tags: Mapping[str, str]) -> None: ...
    def set_experiment_tag(self, experiment: str, key: str, value: str) -> None: ...
    def experiment_tag(self, experiment: str, key: str) -> str | None: ...
    def log_artifact(self, run_id: str, path: str | Path, artifact_path: str | None = None) -> None: ...
    def end_run(self, run_id: str, status: str = "FINISHED") -> None: ...
    def artifact_uri(self, run_id: str) -> str: ...
    def register_version(self, model_name: str, source: str, run_id: str, tags: Mapping[str, str] | None = None) -> str: ...
    def set_champion(self, model_name: str, version: str) -> None: ...
    def champion_version(self, model_name: str) -> str | None: ...


#: MLflow's final run statuses: a round's runs end FINISHED (decided), FAILED (a step failed) or KILLED (cancelled).
RUN_FINISHED, RUN_FAILED, RUN_KILLED = "FINISHED", "FAILED", "KILLED"


def close_round_runs(tracker: Tracker, task: str, key: str, status: str, *, parent_only: bool = False) -> list[str]:
    """End the round's MLflow runs still RUNNING with ``status``: its parent run (``envloop.kind=round``) and,
    unless ``parent_only``, the child run of a step that died with it. Returns the ids it closed.

    A failed round closes them FAILED, a cancelled one KILLED. A decided round (``parent_only``) closes its
    parent FINISHED whatever it was: a retry's steps start fresh children under the parent an earlier
    failure or cancel closed, and the decision is the round's last word.
    """
    if status not in (RUN_FINISHED, RUN_FAILED, RUN_KILLED):
        raise ValueError(f"status: {status!r} is not one of {RUN_FINISHED}, {RUN_FAILED}, {RUN_KILLED}")
    if parent_only:
        parent = tracker.find_run(task, {TAG_ROUND: key, TAG_KIND: KIND_ROUND})
        closed = [parent.run_id] if parent is not None else []
    else:
        closed = tracker.running_runs(task, {TAG_ROUND: key})
    for run_id in closed:
        tracker.end_run(run_id, status)
    return closed


class MlflowTracker:
    """:class:`Tracker` over ``mlflow.MlflowClient`` (SQLite, Postgres or an HTTP server)."""

    def __init__(self, tracking_uri: str | None = None, *, home: str | Path | None = None,
                 ui_base_url: str | None = None) -> None:
        from mlflow import MlflowClient

        self.tracking_uri = tracking_uri or default_tracking_uri(home)
        self.artifact_root = default_artifact_root(home)
        self.client = MlflowClient(tracking_uri=self.tracking_uri, registry_uri=self.tracking_uri)
        self.ui_base_url = ui_base_url or (self.tracking_uri if self.tracking_uri.startswith("http") else None)

    # -- runs --------------------------------------------------------------------------------
    def experiment_id(self, name: str) -> str:
        exp = self.client.get_experiment_by_name(name)
        if exp is not None:
            return exp.experiment_id
        artifact_location = None if self.tracking_uri.startswith("http") else f"{self.artifact_root}/{name}"
        try:
            return self.client.create_experiment(name, artifact_location=artifact_location)
        except Exception:
            exp = self.client.get_experiment_by_name(name)
            if exp is None:
                raise
            return exp.experiment_id

    def run_url(self, experiment_id: str, run_id: str) -> str:
        if self.ui_base_url:
            return f"{self.ui_base_url.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"
        return f"{self.tracking_uri}#/experiments/{experiment_id}/runs/{run_id}"

    def start_run(self, experiment: str, name: str, *, parent_run_id: str | None = None,
                  tags: Mapping[str, str] | None = None) -> TrackedRun:
        exp_id = self.experiment_id(experiment)
        all_tags = {k: str(v) for k, v in (tags or {}).items()}
        if parent_run_id:
            all_tags[PARENT_RUN_TAG] = parent_run_id
        run = self.client.create_run(exp_id, run_name=name, tags=all_tags)
        return TrackedRun(run.info.run_id, exp_id, self.run_url(exp_id, run.info.run_id))

    def find_run(self, experiment: str, tags: Mapping[str, str]) -> TrackedRun | None:
        """The most recent run of ``experiment`` carrying all ``tags`` (for idempotent retries)."""
        exp = self.client.get_experiment_by_name(experiment)
        if exp is None:
            return None
        query = " and ".join(f"tags.`{k}` = '{v}'" for k, v in tags.items())
        runs = self.client.search_runs([exp.experiment_id], filter_string=query, max_results=1,
                                       order_by=["attributes.start_time DESC"])
        if not runs:
            return None
        return TrackedRun(runs[0].info.run_id, exp.experiment_id, self.run_url(exp.experiment_id, runs[0].info.run_id))

    def running_runs(self, experiment: str, tags: Mapping[str, str]) -> list[str]:
        """Ids of the runs of ``experiment`` carrying all ``tags`` that are still RUNNING."""
        exp = self.client.get_experiment_by_name(experiment)
        if exp is None:
            return []
        query = " and ".join([f"tags.`{k}` = '{v}'" for k, v in tags.items()] + ["attributes.status = 'RUNNING'"])
        return [r.info.run_id for r in self.client.search_runs([exp.experiment_id], filter_string=query, max_results=100)]

    def log_params(self, run_id: str, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        existing = self.client.get_run(run_id).data.params
        fresh = [Param(k, str(v)[:6000]) for k, v in params.items() if k not in existing]
        if fresh:
            self.client.log_batch(run_id, params=fresh)

    def log_metrics(self, run_id: str, metrics: Mapping[str, float], step: int | None = None) -> None:
        import math
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k.replace("@", "_"), float(v), now, step or 0) for k, v in metrics.items()
                 if v is not None and math.isfinite(float(v))]
        if batch:
            self.client.log_batch(run_id, metrics=batch)

    def set_tags(self, run_id: str, tags: Mapping[str, str]) -> None:
        for k, v in tags.items():
            self.client.set_tag(run_id, k, str(v))

    def set_experiment_tag(self, experiment: str, key: str, value: str) -> None:
        self.client.set_experiment_tag(self.experiment_id(experiment), key, str(value))

    def experiment_tag(self, experiment: str, key: str) -> str | None:
        """The experiment's tag ``key`` (``None`` when the experiment or the tag does not exist; nothing is created)."""
        exp = self.client.get_experiment_by_name(experiment)
        return None if exp is None else exp.tags.get(key)

    def log_artifact(self, run_id: str, path: str | Path, artifact_path: str | None = None) -> None:
        path = Path(path)
        if path.is_dir():
            self.client.log_artifacts(run_id, str(path), artifact_path)
        else:
            self.client.log_artifact(run_id, str(path), artifact_path)

    def end_run(self, run_id: str, status: str = "FINISHED") -> None:
        self.client.set_terminated(run_id, status=status)

    def run_data(self, run_id: str) -> Any:
        return self.client.get_run(run_id)

    def artifact_uri(self, run_id: str) -> str:
        """Where the run's artifacts live (a registered version's ``source`` is below it)."""
        return self.client.get_run(run_id).info.artifact_uri

    # -- registry ----------------------------------------------------------------------------
    def register_version(self, model_name: str, source: str, run_id: str, tags: Mapping[str, str] | None = None) -> str:
        """Register ``source`` (below run ``run_id``'s artifacts) as a version of ``model_name``; a run that
        already has a version of it (a retry after a crash between the registration and the release card) gets
        that version back, not a second one."""
        from mlflow.exceptions import MlflowException

        try:
            self.client.create_registered_model(model_name)
        except MlflowException:
            pass  # already registered
        registered = [v for v in self.client.search_model_versions(f"name='{model_name}' and run_id='{run_id}'")
                      if v.source == source]
        if registered:
            return str(min(int(v.version) for v in registered))
        mv = self.client.create_model_version(model_name, source=source, run_id=run_id,
                                              tags={k: str(v) for k, v in (tags or {}).items()})
        return str(mv.version)

    def set_champion(self, model_name: str, version: str) -> None:
        self.client.set_registered_model_alias(model_name, CHAMPION_ALIAS, version)

    def champion_version(self, model_name: str) -> str | None:
        from mlflow.exceptions import MlflowException

        try:
            return str(self.client.get_model_version_by_alias(model_name, CHAMPION_ALIAS).version)
        except MlflowException:
            return None
