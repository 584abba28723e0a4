"""Run a verifier as its own process in the sandbox and read its verdict from the result channel.

:func:`verify_task` is the one door to the labels of a task's splits, for
every caller (the loop, ``envloop sandbox verify``, an environment, the SDK):

* it reads them through the private :mod:`envloop_pipelines.core.verify.labels`
  (no module outside ``core/verify/`` imports it), sends the bytes to the
  worker's stdin, copies the predictions file into the sandbox's fresh working
  directory, and reads the report from the pipe it owns. Nothing the worker
  (or anything else in the sandbox) writes to a file counts. It then checks
  that the report scored exactly the bytes it sent (the predictions and
  labels sha256);
* the hidden splits (test, holdout) answer with aggregate scores only: the
  worker runs ``--aggregate-only``, so no per-item score leaves the sandbox,
  and a predictions file that does not answer every question validly is
  refused (the aggregate of one chosen question is that question's score);
* the holdout is read only inside its release's one read: the caller hands
  the ledger's slot (:class:`HoldoutSlot`, which ``Ledger`` is) and the
  release, and a second read for the same release is refused by the slot.

Every outcome is a :class:`VerifierRun`: a crashed, killed or timed-out worker
gives ``status`` from the sandbox and ``report=None``, never an exception and
never a zero score.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Mapping, Protocol, Sequence, runtime_checkable

import pyarrow as pa

from envloop_pipelines.core.data.splits import HIDDEN_SPLITS
from envloop_pipelines.core.sandbox import Sandbox, SandboxLimits, SandboxResult, sandbox_from_env
from envloop_pipelines.core.sandbox.launch import DEFAULT_WORKER_LIMITS, WORKER_ENV, verifier_worker_argv
from envloop_pipelines.core.storage import envloop_home, sha256_bytes
from envloop_pipelines.core.verify.labels import split_labels
from envloop_pipelines.core.verify.protocol import VerifierReport, labels_to_bytes, prediction_format

log = logging.getLogger(__name__)

RunStatus = Literal["ok", "error", "timeout", "cpu_limit", "memory_exceeded", "killed", "file_size_exceeded"]


class HiddenSplitQueryError(PermissionError):
    """A query the hidden splits do not answer: per-item results, or a holdout read outside a release's one read."""


@runtime_checkable
class HoldoutSlot(Protocol):
    """The one holdout read of each release (rule 4); :class:`~envloop_pipelines.core.loop.ledger.Ledger` is one.

    ``read_holdout_once(release, read)`` calls ``read()`` at most once per release and keeps its
    JSON result; a second call for the same release raises
    (:class:`~envloop_pipelines.core.loop.ledger.HoldoutAlreadyReadError`), and a ``read()`` that
    raises leaves the slot free.
    """

    def read_holdout_once(self, release: int, read: Callable[[], Any]) -> Any:
        ...


class _FailedRead(Exception):
    """A verifier run that failed inside the holdout slot: the slot stays free, the run is returned."""

    def __init__(self, run: "VerifierRun") -> None:
        super().__init__(run.error)
        self.run = run


@dataclass(frozen=True)
class VerifierRun:
    """One sandboxed verifier run.

    Attributes:
        status: ``ok`` when a report came back and checks out; else the sandbox's status
            (``error`` when the worker reported a failure or the channel was unusable).
        report: the report, or None.
        sandbox: the sandbox's typed result (stdout/stderr tails, limits, isolation flags).
        worker_pid: the pid the worker reported (it matches ``sandbox.pid`` on the local backend).
        error: what went wrong, in words.
        elapsed_s: the worker's own time from start to report (imports included).
    """

    status: RunStatus
    report: VerifierReport | None
    sandbox: SandboxResult
    worker_pid: int | None = None
    error: str | None = None
    elapsed_s: float | None = None
    baseline_report: VerifierReport | None = None
    paired: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_dict(self, *, include_items: bool = True) -> dict[str, Any]:
        report = None
        if self.report is not None:
            report = self.report.to_dict() if include_items else self.report.aggregate()
        return {
            "status": self.status,
            "ok": self.ok,
            "error": self.error,
            "worker_pid": self.worker_pid,
            "elapsed_s": self.elapsed_s,
            "report": report,
            "baseline_report": None if self.baseline_report is None else (
                self.baseline_report.to_dict() if include_items else self.baseline_report.aggregate()),
            "paired": self.paired,
            "sandbox": self.sandbox.to_dict(include_channel=False),
        }


class VerifierRunner:
    """Runs ``python -m envloop_pipelines.core.verify.worker`` in a sandbox.

    Args:
        sandbox: the sandbox (default: ``$ENVLOOP_SANDBOX``, else the local backend).
        limits: the worker's limits (default: :data:`DEFAULT_WORKER_LIMITS`).
        python: the interpreter inside the sandbox (default: this one; a container's ``python``).
    """

    def __init__(self, sandbox: Sandbox | None = None, *, limits: SandboxLimits | None = None, python: str | None = None) -> None:
        self.sandbox = sandbox or sandbox_from_env()
        self.limits = limits or DEFAULT_WORKER_LIMITS
        self.python = python or (sys.executable if self.sandbox.backend == "local" else "python")

    def run(
        self,
        predictions: str | Path | bytes,
        labels: pa.Table | bytes,
        *,
        kind: str = "rule",
        predictions_format: str | None = None,
        grader: str = "text_match",
        threshold: float = 0.5,
        safety_families: Sequence[str] = (),
        hidden_paths: Sequence[str | Path] = (),
        baseline_predictions: str | Path | None = None,
        seed: int = 0,
        aggregate_only: bool = False,
        safety_thresholds: Mapping[str, float] | None = None,
        baseline_safety_thresholds: Mapping[str, float] | None = None,
    ) -> VerifierRun:
        """Score ``predictions`` against ``labels`` in a fresh sandboxed worker.

        Args:
            predictions: a predictions file path, or its bytes with ``predictions_format``.
            labels: the label table or its Parquet bytes (from :func:`labels_to_bytes`).
            kind: ``rule`` or ``grader``.
            predictions_format: ``parquet`` or ``jsonl`` when ``predictions`` is bytes.
            grader: the grader kind's scoring model.
            threshold: the grader kind's pass threshold.
            safety_families: families whose false-negative rate the rule report includes.
            hidden_paths: more paths to mask inside the sandbox (the labels' directory).
            baseline_predictions: the champion's predictions file: the worker scores it too and
                returns paired deltas (candidate − baseline) with record-clustered bootstrap CIs.
            seed: the bootstrap seed of the paired deltas.
            aggregate_only: the worker answers with counts and aggregate scores only and refuses a
                predictions file that leaves a question unanswered or invalid (hidden splits).
            safety_thresholds: the predictions' automation thresholds on P(false) per safety family (from
                their checkpoint's calibration): the rule report adds ``defer_rate/<family>`` and
                ``fnr_automated/<family>``.
            baseline_safety_thresholds: the same for ``baseline_predictions``.
        """
        if kind not in ("rule", "grader"):
            raise ValueError(f"verifier kind {kind!r} does not run as a worker; allowed: rule, grader")
        if isinstance(predictions, (str, Path)):
            fmt = predictions_format or prediction_format(predictions)
            pred_bytes = Path(predictions).read_bytes()
        else:
            if predictions_format is None:
                raise ValueError("predictions_format is required when predictions are bytes")
            fmt, pred_bytes = predictions_format, predictions
        label_bytes = labels if isinstance(labels, bytes) else labels_to_bytes(labels)
        name = f"predictions.{fmt}"
        argv = self.worker_argv(kind, name, grader=grader, threshold=threshold, safety_families=safety_families,
                                aggregate_only=aggregate_only, safety_thresholds=safety_thresholds,
                                baseline_safety_thresholds=baseline_safety_thresholds)
        files = {name: pred_bytes}
        base_sha = None
        if baseline_predictions is not None:
            base_name = f"baseline.{prediction_format(baseline_predictions)}"
            files[base_name] = Path(baseline_predictions).read_bytes()
            base_sha = sha256_bytes(files[base_name])
            argv += ["--baseline-predictions", base_name, "--seed", str(seed)]
        result = self.sandbox.run(argv, limits=self.limits, stdin=label_bytes, files=files,
                                  env=WORKER_ENV, result_channel=True, hidden_paths=hidden_paths)
        return self._read(result, sha256_bytes(pred_bytes), sha256_bytes(label_bytes), base_sha)

    def worker_argv(self, kind: str, predictions_name: str, *, grader: str, threshold: float,
                    safety_families: Sequence[str], aggregate_only: bool = False,
                    safety_thresholds: Mapping[str, float] | None = None,
                    baseline_safety_thresholds: Mapping[str, float] | None = None) -> list[str]:
        """The worker's command line (:func:`~envloop_pipelines.core.sandbox.launch.verifier_worker_argv`)."""
        return verifier_worker_argv(self.python, kind, predictions_name, grader=grader, threshold=threshold,
                                    safety_families=safety_families, aggregate_only=aggregate_only,
                                    safety_thresholds=safety_thresholds,
                                    baseline_safety_thresholds=baseline_safety_thresholds)

    @staticmethod
    def _read(result: SandboxResult, pred_sha: str, label_sha: str, baseline_sha: str | None = None) -> VerifierRun:
        payload: dict[str, Any] | None = None
        if result.channel:
            try:
                payload = json.loads(result.channel)
            except json.JSONDecodeError as exc:
                return VerifierRun("error", None, result, error=f"result channel is not JSON: {exc}")
        if not result.ok:
            error = (payload or {}).get("error") or result.detail
            return VerifierRun(result.status, None, result, worker_pid=(payload or {}).get("worker_pid"),
                               error=f"{result.status}: {error}")
        if payload is None:
            return VerifierRun("error", None, result, error="the worker exited 0 but sent nothing on the result channel")
        if not payload.get("ok"):
            return VerifierRun("error", None, result, worker_pid=payload.get("worker_pid"), error=payload.get("error"))
        try:
            report = VerifierReport.from_dict(payload["report"])
        except (KeyError, TypeError, ValueError) as exc:
            return VerifierRun("error", None, result, error=f"malformed report: {exc!r}")
        prov = report.provenance
        if prov.get("predictions_sha256") != pred_sha or prov.get("labels_sha256") != label_sha:
            return VerifierRun("error", None, result, worker_pid=payload.get("worker_pid"),
                               error="the report does not name the predictions and labels that were sent (sha256 differs)")
        baseline = None
        if baseline_sha is not None:
            try:
                baseline = VerifierReport.from_dict(payload["baseline_report"])
            except (KeyError, TypeError, ValueError) as exc:
                return VerifierRun("error", None, result, error=f"malformed baseline report: {exc!r}")
            if baseline.provenance.get("predictions_sha256") != baseline_sha or "paired" not in payload:
                return VerifierRun("error", None, result, worker_pid=payload.get("worker_pid"),
                                   error="the baseline report does not name the baseline predictions that were sent")
        return VerifierRun("ok", report, result, worker_pid=payload.get("worker_pid"), elapsed_s=payload.get("elapsed_s"),
                           baseline_report=baseline, paired=payload.get("paired"))


def verify_task(
    task: str,
    split: str,
    predictions: str | Path,
    *,
    kind: str = "rule",
    snapshot_id: str | None = None,
    home: str | Path | None = None,
    runner: VerifierRunner | None = None,
    holdout_slot: HoldoutSlot | None = None,
    release: int | None = None,
    **options: Any,
) -> VerifierRun:
    """Score a predictions file on a task's split in a sandboxed worker: the one door to the labels.

    The labels' directory (``<home>/verifier``) is masked inside the sandbox
    even when ``home`` is not the default one. On ``test`` and ``holdout`` the
    run answers with aggregate scores only (its reports carry no items) and
    refuses a predictions file that does not answer every question validly.

    Args:
        task: the task name.
        split: the split to score on.
        predictions: the predictions file.
        kind: ``rule`` or ``grader``.
        snapshot_id: the snapshot (default: the task's current one).
        home: the EnvLoop home.
        runner: the sandboxed runner (default: ``$ENVLOOP_SANDBOX``, else the local backend).
        holdout_slot: the ledger (its ``read_holdout_once``); required for ``holdout``.
        release: the release whose one holdout read this is; required for ``holdout``.
        options: more :meth:`VerifierRunner.run` options (``safety_families``, ``baseline_predictions``, ``seed``).

    Raises:
        HiddenSplitQueryError: ``holdout`` without a slot and a release (or a slot on another split).
        HoldoutAlreadyReadError: from the slot, when the release already read the holdout.
    """
    hidden = split in HIDDEN_SPLITS
    if split == "holdout" and (holdout_slot is None or release is None):
        raise HiddenSplitQueryError(
            f"task {task!r}: the holdout is read once per release, inside the ledger's read "
            f"(Ledger.read_holdout_once): pass holdout_slot and release")
    if split != "holdout" and (holdout_slot is not None or release is not None):
        raise ValueError(f"holdout_slot and release apply to the holdout only, not to {split!r}")
    runner = runner or VerifierRunner()

    def score() -> VerifierRun:
        labels = split_labels(task, split, snapshot_id=snapshot_id, home=home)
        return runner.run(predictions, labels, kind=kind, hidden_paths=[envloop_home(home) / "verifier"],
                          aggregate_only=hidden, **options)

    if split == "holdout":
        assert holdout_slot is not None and release is not None
        kept: list[VerifierRun] = []

        def read() -> dict[str, Any]:
            run = score()
            if not run.ok:
                raise _FailedRead(run)  # a failed read does not consume the release's holdout
            kept.append(run)
            assert run.report is not None
            return dict(run.report.metrics)

        try:
            holdout_slot.read_holdout_once(release, read)
        except _FailedRead as failed:
            run = failed.run
        else:
            run = kept[0]
    else:
        run = score()
    log.info("verifier run %s", json.dumps({"task": task, "split": split, "status": run.status, "release": release,
                                             "n_items": run.report.n_items if run.report else None}))
    return run


__all__ = ["DEFAULT_WORKER_LIMITS", "WORKER_ENV", "HiddenSplitQueryError", "HoldoutSlot", "VerifierRun", "VerifierRunner",
           "verify_task"]
