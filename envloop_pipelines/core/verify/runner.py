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
  a predictions file that does not answer every question validly is
  refused (the aggregate of one chosen question is that question's score),
  and every aggregate is rounded inside the sandbox to what its CI can
  resolve (:func:`~envloop_pipelines.core.verify.protocol.round_hidden_aggregates`);
* the hidden splits are scored only by the verifier's own runner, in the
  sandbox the deployment configures (its :class:`~envloop_pipelines.core.sandbox.SandboxSettings`,
  handed down by the caller as a value: the backend is one of the built-in
  ones and the verifier builds it), with a built-in grader: a caller's runner,
  sandbox object or grader plug-in is refused there, so hidden labels never
  reach caller code;
* every ``test`` read is a ``test_read`` event of the task's ledger naming its
  reader (``adhoc`` for a person's call, ``round:<key>``, ``setup:<noise floor key>``, ``floor:<lineage key>``);
  a loop reader reads test only within its budget of distinct predictions
  files, refused before the labels are read beyond it
  (:class:`~envloop_pipelines.core.ledger.reads.TestReadBudgetError`);
  the holdout is read only inside its release's one read, in the task home's own
  ledger (the verifier opens it; a slot that is not that ledger is refused),
  for the release being published now; a retry of the same read after a
  crash gets the stored read back, not a second one.

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
from envloop_pipelines.core.ledger.reads import holdout_read_key
from envloop_pipelines.core.sandbox import (
    Sandbox,
    SandboxCall,
    SandboxLimits,
    SandboxResult,
    SandboxSettings,
    make_sandbox,
)
from envloop_pipelines.core.sandbox.launch import DEFAULT_WORKER_LIMITS, WORKER_ENV, verifier_worker_argv
from envloop_pipelines.core.storage import canonical_json, envloop_home, sha256_bytes, sha256_file
from envloop_pipelines.core.verify.grader import BUILTIN_SCORERS
from envloop_pipelines.core.verify.labels import split_labels
from envloop_pipelines.core.verify.protocol import VerifierReport, labels_to_bytes, prediction_format

log = logging.getLogger(__name__)

RunStatus = Literal["ok", "error", "timeout", "cpu_limit", "memory_exceeded", "killed", "file_size_exceeded"]


class HiddenSplitQueryError(PermissionError):
    """A query the hidden splits do not answer: per-item results, or a holdout read outside a release's one read."""


@runtime_checkable
class HoldoutSlot(Protocol):
    """The one holdout read of each release (rule 4): the shape of :class:`~envloop_pipelines.core.ledger.ledger.Ledger`.

    :func:`verify_task` takes no object of this shape on trust: it reads the holdout only in the task
    home's own ``Ledger`` and refuses any other slot.

    ``read_holdout_once(release, read)`` calls ``read()`` at most once per release and keeps its
    JSON result; a second call for the same release raises
    (:class:`~envloop_pipelines.core.ledger.reads.HoldoutAlreadyReadError`), and a ``read()`` that
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
        worker_pid: the pid the worker reported (on the local backend 2, its pid in the run's own PID namespace,
            or ``sandbox.pid`` where the host gives none).
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
        sandbox: the sandbox, or the settings to build it from (:func:`~envloop_pipelines.core.sandbox.make_sandbox`);
            default: the local backend.
        limits: the worker's limits (default: :data:`DEFAULT_WORKER_LIMITS`).
        python: the interpreter inside the sandbox (default: this one; a container's ``python``).
    """

    def __init__(self, sandbox: Sandbox | SandboxSettings | None = None, *, limits: SandboxLimits | None = None,
                 python: str | None = None) -> None:
        if sandbox is None or isinstance(sandbox, SandboxSettings):
            sandbox = make_sandbox(sandbox or SandboxSettings())
        self.sandbox = sandbox
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
        result = self.sandbox.run(argv, SandboxCall(
            limits=self.limits, stdin=label_bytes, files=files, env=WORKER_ENV, result_channel=True,
            hidden_paths=hidden_paths, package_on_path=True))
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
    sandbox: SandboxSettings | None = None,
    holdout_slot: HoldoutSlot | None = None,
    release: int | None = None,
    reader: str = "adhoc",
    read_budget: int | None = None,
    **options: Any,
) -> VerifierRun:
    """Score a predictions file on a task's split in a sandboxed worker: the one door to the labels.

    The labels' directory (``<home>/verifier``) is masked inside the sandbox
    even when ``home`` is not the default one. On ``test`` and ``holdout`` the
    run answers with aggregate scores only (its reports carry no items, and
    every aggregate is rounded to what its CI can resolve:
    :func:`~envloop_pipelines.core.verify.protocol.round_hidden_aggregates`),
    refuses a predictions file that does not answer every question validly,
    and runs in the verifier's own sandbox, the one the deployment configures
    (``sandbox``: settings, a value; the verifier builds the sandbox of a built-in
    backend from them): a caller's runner, sandbox object or grader plug-in never
    receives hidden labels. Each ``test`` read is a ``test_read`` event of the
    task's ledger naming its ``reader``, keyed by the reader and the sha256 of the
    predictions and baseline (a retry of the same read is not a new event); a
    loop reader (a round, the loop's setup) may score at most its budget of
    distinct predictions files on test, and a read beyond it is refused before
    the labels are read (``Ledger.reading_test``); an ``adhoc`` read is not
    limited, only logged. Each ``holdout`` read is its release's one read in
    that ledger, for the release being published now only.

    Args:
        task: the task name.
        split: the split to score on.
        predictions: the predictions file.
        kind: ``rule`` or ``grader``.
        snapshot_id: the snapshot (default: the task's current one).
        home: the EnvLoop home.
        runner: the sandboxed runner, on open splits only (default: the verifier's own, in ``sandbox``);
            refused on test and holdout.
        sandbox: the deployment's sandbox settings (default: the local backend): the verifier's own runner
            runs there, on every split. A value, not a sandbox object: one of the built-in backends, built
            here (a sandbox of the caller's own goes in ``runner``, on open splits).
        holdout_slot: optional, for ``holdout``: must be the task's own ledger in ``home`` (the
            verifier opens that ledger itself; any other object is refused).
        release: the release whose one holdout read this is; required for ``holdout``, and it must be
            the release being published now (``Ledger.next_release_number``).
        reader: who reads ``test``: ``adhoc`` (default: a person's CLI, SDK or environment call),
            ``round:<round key>`` (its candidate, champion and TF-IDF baseline: 3 files) or
            ``setup:<noise floor key>`` or ``floor:<lineage floor key>`` (with ``read_budget``); see
            ``ledger.reader_budget``.
        read_budget: a setup or floor reader's budget of distinct predictions files on test.
        options: more :meth:`VerifierRunner.run` options (``safety_families``, ``baseline_predictions``, ``seed``).

    Raises:
        HiddenSplitQueryError: ``holdout`` without a release, a caller's runner or grader plug-in on a
            hidden split, or a slot that is not the task home's ledger.
        TypeError: ``sandbox`` is not :class:`~envloop_pipelines.core.sandbox.SandboxSettings` (a sandbox object).
        HoldoutAlreadyReadError: from the ledger, when the release already read the holdout.
        HoldoutSlotError: from the ledger, when ``release`` is not the release being published now.
        TestReadBudgetError: a ``test`` read beyond the reader's budget (nothing read, nothing appended).
        ValueError: an unknown reader or a bad budget.
    """
    from envloop_pipelines.core.ledger.reads import reader_budget

    budget = reader_budget(reader, read_budget)
    hidden = split in HIDDEN_SPLITS
    if split == "holdout" and release is None:
        raise HiddenSplitQueryError(
            f"task {task!r}: the holdout is read once per release, inside the ledger's read "
            f"(Ledger.read_holdout_once): pass release (the release being published now)")
    if split != "holdout" and (holdout_slot is not None or release is not None):
        raise ValueError(f"holdout_slot and release apply to the holdout only, not to {split!r}")
    if sandbox is not None and type(sandbox) is not SandboxSettings:  # a subclass could build its own sandbox
        raise TypeError(f"sandbox: the deployment's SandboxSettings (a value), not {type(sandbox).__name__}; a sandbox "
                        f"of your own goes in runner=VerifierRunner(sandbox), on open splits only")
    if runner is not None and sandbox is not None:
        raise ValueError("runner and sandbox: pass one (the runner already has its sandbox)")
    if hidden and runner is not None:
        raise HiddenSplitQueryError(
            f"runner: {split} is scored only by the verifier's own runner in the sandbox the deployment "
            f"configures (sandbox=SandboxSettings); a caller's runner or sandbox never receives hidden labels")
    if hidden and kind == "grader" and options.get("grader", "text_match") not in BUILTIN_SCORERS:
        raise HiddenSplitQueryError(
            f"grader: {split} is scored only by a built-in grader ({', '.join(sorted(BUILTIN_SCORERS))}); "
            f"a plug-in {options.get('grader')!r} would run with the hidden labels")
    ledger = _task_ledger(task, home, holdout_slot) if hidden else None
    runner = runner or VerifierRunner(make_sandbox(sandbox or SandboxSettings()))

    def score() -> VerifierRun:
        labels = split_labels(task, split, snapshot_id=snapshot_id, home=home)
        return runner.run(predictions, labels, kind=kind, hidden_paths=[envloop_home(home) / "verifier"],
                          aggregate_only=hidden, **options)

    if split == "holdout":
        assert ledger is not None and release is not None
        ledger.require_publishable(release)  # a published or far-ahead release says so first
        read_key = holdout_read_key(predictions, options.get("baseline_predictions"))
        slot = ledger.holdout_slot(release)
        if slot is None or slot.get("read_key") != read_key:
            raise HiddenSplitQueryError(
                f"release {release}: no holdout slot is open for these predictions; the release step opens it "
                f"(core/release/publish.py) for the checkpoint it publishes, right before its one read, so the "
                f"holdout is never read for anything else")
        kept: list[VerifierRun] = []

        def read() -> dict[str, Any]:
            run = score()
            if not run.ok:
                raise _FailedRead(run)  # a failed read does not consume the release's holdout
            kept.append(run)
            return _stored_read(run)

        try:
            stored = ledger.read_holdout_once(release, read, key=read_key)
        except _FailedRead as failed:
            run = failed.run
        else:
            run = kept[0] if kept else _from_stored_read(stored)
    elif split == "test":
        assert ledger is not None
        baseline = options.get("baseline_predictions")
        with ledger.reading_test(reader, _file_sha(predictions), _file_sha(baseline), budget=budget,
                                 predictions=str(predictions), baseline=None if baseline is None else str(baseline)
                                 ) as record:  # refused here, before any label is read, beyond the budget
            run = score()
            record(run.status, verifier=kind, **({"result_sha256": read_result_digest(
                run.report.metrics, None if run.baseline_report is None else run.baseline_report.metrics,
                run.paired)} if run.ok else {}))
    else:
        run = score()
    log.info("verifier run %s", json.dumps({"task": task, "split": split, "status": run.status, "release": release,
                                             "reader": reader if split == "test" else None,
                                             "n_items": run.report.n_items if run.report else None}))
    return run


def read_result_digest(metrics: Mapping[str, Any], baseline: Mapping[str, Any] | None,
                       paired: Mapping[str, Any] | None) -> str:
    """sha256 of a test read's aggregates as the verifier answered them (its ``test_read`` event records it).

    The decision checks the re-evaluation it is handed against it (issue 34: an edited
    ``independent_reeval.json`` is refused, not promoted).
    """
    body = {"metrics": dict(metrics), "baseline": None if baseline is None else dict(baseline),
            "paired": None if paired is None else json.loads(json.dumps(paired, default=str))}
    return sha256_bytes(canonical_json(body))


def _task_ledger(task: str, home: str | Path | None, slot: Any) -> Any:
    """The task home's own ledger; ``slot``, when given, must be that very ledger (same task, same folder)."""
    from envloop_pipelines.core.ledger.ledger import Ledger
    from envloop_pipelines.core.ledger.store import loop_dir

    if slot is not None:
        own = loop_dir(task, home).resolve()
        if not isinstance(slot, Ledger) or slot.task != task or Path(slot.root).resolve() != own:
            where = getattr(slot, "root", None)
            raise HiddenSplitQueryError(
                f"holdout_slot: {type(slot).__name__} at {where} is not the ledger of task {task!r} in its home "
                f"({own}); the verifier reads the holdout only in the task home's own ledger")
    return Ledger(task, home)


def _file_sha(path: str | Path | None) -> str | None:
    return None if path is None else sha256_file(path)


def _stored_read(run: VerifierRun) -> dict[str, Any]:
    """What the ledger keeps of a holdout read: the aggregates the caller got, enough to give them again."""
    assert run.report is not None
    return {"metrics": dict(run.report.metrics), "report": run.report.aggregate(),
            "baseline_report": None if run.baseline_report is None else run.baseline_report.aggregate(),
            "paired": run.paired, "worker_pid": run.worker_pid, "elapsed_s": run.elapsed_s,
            "sandbox": run.sandbox.to_dict(include_channel=False)}


def _from_stored_read(stored: Mapping[str, Any]) -> VerifierRun:
    """The run a stored holdout read gave (a retry after a crash between the read and the card): no new read."""
    sandbox = SandboxResult(**{**stored["sandbox"], "detail": "the release's stored holdout read (not run again)"})
    baseline = stored.get("baseline_report")
    return VerifierRun("ok", VerifierReport.from_dict(stored["report"]), sandbox, worker_pid=stored.get("worker_pid"),
                       elapsed_s=stored.get("elapsed_s"),
                       baseline_report=None if baseline is None else VerifierReport.from_dict(baseline),
                       paired=stored.get("paired"))


__all__ = ["DEFAULT_WORKER_LIMITS", "WORKER_ENV", "HiddenSplitQueryError", "HoldoutSlot", "VerifierRun", "VerifierRunner",
           "verify_task"]
