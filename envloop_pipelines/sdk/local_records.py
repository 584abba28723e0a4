"""What this machine's EnvLoop home and Dagster instance recorded, read in this process: runs, rounds and their
decisions, the ledger, the release chain, and a release's answers.

:class:`~envloop_pipelines.sdk.local.LocalClient` builds on it to run the loop; on its own it only reads (a client
made without loop settings).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import dagster as dg

from envloop_pipelines.core.decision_loop.step_records import RoundDecision
from envloop_pipelines.core.ledger.event_log import EVENT_KINDS
from envloop_pipelines.core.ledger.ledger import Ledger
from envloop_pipelines.core.ledger.store import RoundStore
from envloop_pipelines.core.loop.config import round_key, round_number
from envloop_pipelines.core.serve.settings import source_from_release
from envloop_pipelines.defs.rounds.recovery import reap_orphaned_runs
from envloop_pipelines.names import NOISE_FLOOR, PARTITION_TAG, ROUND_JOB, ROUNDS_PARTITIONS
from envloop_pipelines.sdk.errors import NotFoundError, RefusedError
from envloop_pipelines.sdk.instance import open_instance, run_error, run_info
from envloop_pipelines.sdk.predict import Answerer
from envloop_pipelines.sdk.records import ReleaseInfo, RoundInfo, RunError, RunInfo


class LocalRecords:
    """The rounds, runs, ledger and releases of one task in this machine's home and Dagster instance.

    Args:
        task: The task whose records are read.
    """

    def __init__(self, task: str) -> None:
        self._task = task
        self._home: str | None = None  # the EnvLoop home: None is $ENVLOOP_HOME, else ./.envloop
        self._instance: Any = None
        self._answers = Answerer()

    @property
    def task(self) -> str:
        """The task whose records this client reads (and whose loop it runs)."""
        return self._task

    @property
    def instance(self) -> Any:
        """The local Dagster instance (``$DAGSTER_HOME``)."""
        if self._instance is None:
            self._instance = open_instance()
        return self._instance

    def reap_orphans(self) -> list[Any]:
        """Mark failed every unfinished run of this host whose worker process is gone; the runs marked."""
        return list(reap_orphaned_runs(self.instance))

    def is_set_up(self) -> bool:
        """Whether the noise floor (and so release 1) has been materialized on this instance."""
        return self.instance.get_latest_materialization_event(dg.AssetKey(NOISE_FLOOR)) is not None

    # ------------------------------------------------------------------ what the steps recorded

    def run(self, run_id: str) -> RunInfo:
        """A run of the local instance.

        Raises:
            NotFoundError: no such run.
        """
        found = self.instance.get_run_by_id(run_id)
        if found is None:
            raise NotFoundError(f"run: no run {run_id!r} on the local instance")
        return run_info(found)

    def run_error(self, run_id: str) -> RunError | None:
        """Why a run failed: the first failed step's own error (``None`` when the log names none)."""
        return run_error(self.instance, run_id)

    def decision(self, key: str) -> RoundDecision | None:
        """Round ``key``'s decision, or ``None`` while it is undecided."""
        return RoundStore(self.task, self._home).load("promotion_decision", RoundDecision, key)

    def rounds(self) -> list[RoundInfo]:
        """This home's rounds, in order: each with its latest run on the local instance and its decision."""
        keys = set(round_key(n) for n in RoundStore(self.task, self._home).started_rounds())
        keys |= set(self.instance.get_dynamic_partitions(ROUNDS_PARTITIONS))
        out = []
        for key in sorted(keys, key=round_number):
            runs = self.instance.get_runs(filters=dg.RunsFilter(job_name=ROUND_JOB, tags={PARTITION_TAG: key}),
                                          limit=1)
            out.append(RoundInfo(key, run_info(runs[0]) if runs else None, self.decision(key)))
        return out

    def ledger(self, kind: str | None = None) -> list[dict[str, Any]]:
        """The task's ledger events, oldest first (only those of ``kind``, if given)."""
        if kind is not None and kind not in EVENT_KINDS:
            raise RefusedError(f"kind: {kind!r} is not a ledger event kind; allowed: {', '.join(EVENT_KINDS)}")
        return list(Ledger(self.task, self._home).events(kind))

    def release_cards(self) -> list[dict[str, Any]]:
        """The release chain as cards (holdout first, errata beside), oldest first."""
        return list(Ledger(self.task, self._home).releases())

    def releases(self, *, with_cards: bool = True) -> list[ReleaseInfo]:
        """The release chain from the ledger's cards, oldest first (no MLflow model version here)."""
        return [ReleaseInfo(release=int(c["release"]), model_version="", round=c.get("round"),
                            checkpoint_sha256=c.get("checkpoint_sha256"), mlflow_run_id=None,
                            holdout=dict(c.get("holdout") or {}), champion=bool(c.get("champion")),
                            card=c if with_cards else None) for c in self.release_cards()]

    # ------------------------------------------------------------------ predict: a release, here or served

    def predict(self, request: Mapping[str, Any] | Sequence[Mapping[str, Any]], *, url: str | None = None,
                release: int | str = "champion", api_key: str | None = None) -> Any:
        """A release's answers to a Jev request (``{"state": ..., "questions": {...}}``; a labelled decision record
        works too: its labels and meta are left out), or to a list of them.

        With ``url`` the request goes to a served release (``envloop serve``, ``POST <url>/v1/systemone``);
        without, the release's checkpoint from this home's release chain is answered in this process by the
        same server code (kept loaded until :meth:`close`): the numbers are the ones ``envloop serve`` gives.

        Raises:
            RefusedError: the request was refused (the message is the server's own, naming the field), or
                ``release`` is neither a release number nor ``"champion"``.
            NotFoundError: no such release.
            UnavailableError: the server at ``url`` did not answer.
        """
        return self._answers.predict(request, url=url, api_key=api_key, source=lambda: self._release_source(release))

    def _release_source(self, release: int | str) -> Any:
        try:
            return source_from_release(self.task, release, home=self._home)
        except LookupError as exc:
            raise NotFoundError(f"release: {exc}") from None
        except ValueError as exc:
            raise RefusedError(f"release: {exc}") from None

    def close(self) -> None:
        """Stop the in-process servers :meth:`predict` started (their models are unloaded)."""
        self._answers.close()


__all__ = ["LocalRecords"]
