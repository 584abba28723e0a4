"""A task's releases in MLflow, read with MLflow's own tracking and registry API (``mlflow.MlflowClient``).

The registered model ``envloop-<task>`` holds one version per release and the ``champion`` alias; each version's
run holds the release's holdout metrics and its checkpoint as an artifact. The registry is the ledger's
projection (issue 34): the chain read here is refused when it disagrees with the release cards the steps
published (a moved alias, a forged tag). :class:`~envloop_pipelines.sdk.client.Client` reads its releases here.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from envloop_pipelines.core.ledger.projection import projection_error
from envloop_pipelines.core.services import PROBE_TIMEOUT_S, ServiceUnavailable, probe_tracking_uri
from envloop_pipelines.core.tracking import CHAMPION_ALIAS, HOLDOUT_PREFIX, TAG_CHECKPOINT, TAG_RELEASE, TAG_ROUND
from envloop_pipelines.sdk.errors import ClientError, UnavailableError
from envloop_pipelines.sdk.records import ReleaseInfo


class MlflowReleases:
    """The release chain, holdout metrics and checkpoints of a deployment's MLflow server.

    Args:
        uri: MLflow's tracking URI (``http://host:port``, or ``sqlite:///...`` on the same machine); ``None``:
            not set (every read raises, naming the setting).
        setting: Where ``uri`` came from, as errors name it (``mlflow_uri``, ``MLFLOW_TRACKING_URI``, ``--mlflow``).
        timeout_s: Per request; the first read probes the server once within ``min(timeout_s, 5)``.
    """

    def __init__(self, uri: str | None, setting: str, timeout_s: float) -> None:
        self.uri = uri
        self.setting = setting
        self.timeout_s = float(timeout_s)
        self._client: Any = None

    @property
    def client(self) -> Any:
        """``mlflow.MlflowClient`` on :attr:`uri`, once the server has answered its probe."""
        if self._client is None:
            if not self.uri:
                raise ClientError("mlflow_uri: not set; pass Client(..., mlflow_uri='http://host:port') "
                                  "or set MLFLOW_TRACKING_URI")
            # mlflow takes seconds to import: only a client that reads releases pays for it
            from mlflow import MlflowClient

            self.probe()
            self._client = MlflowClient(tracking_uri=self.uri, registry_uri=self.uri)
        return self._client

    def probe(self) -> None:
        """An MLflow server must answer ``/health`` (``core/services.py``): a dead URL fails here, in seconds, not
        after MLflow's own retries (minutes). A local store (``sqlite:///...``) needs no probe.

        Raises:
            UnavailableError: the server did not answer, or answered with an error (one line: URL and setting).
        """
        try:
            probe_tracking_uri(self.uri, self.setting, min(self.timeout_s, PROBE_TIMEOUT_S))
        except ServiceUnavailable as exc:
            raise UnavailableError(str(exc)) from None

    def releases(self, model: Callable[[], str], cards: Callable[[], Mapping[int, Mapping[str, Any]]], *,
                 with_cards: bool = True) -> list[ReleaseInfo]:
        """The release chain of the registered model ``model()`` (one model version per release), oldest first.

        ``cards()`` gives the release cards the steps published, by release number: the chain is refused when the
        registry disagrees with them. Both are asked for once MLflow has answered (they ask the webserver): an unset
        or dead MLflow fails first, naming its setting.

        Raises:
            UnavailableError: MLflow did not answer.
            ClientError: the registry is not the ledger's projection (the message says where they differ).
        """
        from mlflow.exceptions import MlflowException  # with the client above: mlflow is slow to import

        client = self.client
        model_name = model()
        try:
            versions = client.search_model_versions(f"name='{model_name}'")
        except MlflowException as exc:
            raise UnavailableError(f"MLflow at {self.uri}: {exc.message}") from None
        try:
            champion = str(client.get_model_version_by_alias(model_name, CHAMPION_ALIAS).version)
        except MlflowException:
            champion = None
        published = dict(cards())  # the ledger's, as the steps that published them recorded them
        mismatch = projection_error([published[k] for k in sorted(published)],
                                    [(str(v.version), v.tags or {}) for v in versions], champion, model_name)
        if mismatch:  # the registry is the ledger's projection (issue 34): a moved alias or a forged tag is refused
            raise ClientError(f"release chain refused: {mismatch}")
        if not with_cards:
            published = {}
        out = []
        for v in versions:
            if TAG_RELEASE not in (v.tags or {}):
                continue
            number = int(v.tags[TAG_RELEASE])
            metrics = client.get_run(v.run_id).data.metrics if v.run_id else {}
            holdout = {k[len(HOLDOUT_PREFIX):]: val for k, val in metrics.items() if k.startswith(HOLDOUT_PREFIX)}
            out.append(ReleaseInfo(release=number, model_version=str(v.version), round=v.tags.get(TAG_ROUND),
                                   checkpoint_sha256=v.tags.get(TAG_CHECKPOINT), mlflow_run_id=v.run_id,
                                   holdout=holdout, champion=str(v.version) == champion,
                                   card=published.get(number)))
        return sorted(out, key=lambda r: r.release)

    def download_checkpoint(self, release: ReleaseInfo, dest: str | os.PathLike[str]) -> Path:
        """Download a release's checkpoint into ``dest/<sha256>`` and verify it (an existing one is verified and
        reused); returns the directory.

        Raises:
            ClientError: the download does not verify against the release's sha256.
        """
        # torch comes with the checkpoint's readers: only a download pays for it
        from envloop_pipelines.core.model.checkpoint import checkpoint_hash, verify_checkpoint

        dest_dir = Path(dest)
        dest_dir.mkdir(parents=True, exist_ok=True)
        target = dest_dir / str(release.checkpoint_sha256)
        if not target.exists():
            staging = Path(tempfile.mkdtemp(prefix=".fetch-", dir=dest_dir))
            try:
                local = Path(self.client.download_artifacts(release.mlflow_run_id, "checkpoint", str(staging)))
                local.rename(target)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        verify_checkpoint(target)
        if release.checkpoint_sha256 and checkpoint_hash(target) != release.checkpoint_sha256:
            raise ClientError(f"release {release.release}: the downloaded checkpoint hashes to {checkpoint_hash(target)}, "
                              f"not {release.checkpoint_sha256}")
        return target

    def close_round_runs(self, task: Callable[[], str], key: str, status: str) -> list[str]:
        """End round ``key``'s MLflow runs (in the experiment ``task()``, asked once MLflow has answered) still
        RUNNING with ``status`` (what the deployment's sensor does)."""
        client = self.client
        experiment = client.get_experiment_by_name(task())
        if experiment is None:
            return []
        runs = client.search_runs([experiment.experiment_id], max_results=100,
                                  filter_string=f"tags.`{TAG_ROUND}` = '{key}' and attributes.status = 'RUNNING'")
        for r in runs:
            client.set_terminated(r.info.run_id, status=status)
        return [r.info.run_id for r in runs]


__all__ = ["MlflowReleases"]
