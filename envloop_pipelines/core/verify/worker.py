"""The verifier worker: the process that scores, run inside the sandbox.

    python -m envloop_pipelines.core.verify.worker --kind rule \\
        --predictions predictions.parquet --labels-fd 0 --result-fd env

It reads the predictions file named on the command line and the labels from
an inherited file descriptor (``--labels-fd``, the parent writes the label
Parquet bytes into it) or an explicit path (``--labels``, for running a worker
by hand), scores, and writes one JSON object to the result channel
(``--result-fd env`` means ``$ENVLOOP_RESULT_FD``; default stdout)::

    {"ok": true, "worker_pid": 1234, "elapsed_s": 0.12, "report": {...}}
    {"ok": false, "worker_pid": 1234, "error": "..."}

With ``--aggregate-only`` (the runner sets it for test and holdout) the
reports carry no items and no extra ids, a predictions file that leaves a
question unanswered or invalid is refused, and every aggregate (and paired
delta) is rounded to what its CI can resolve
(:func:`~envloop_pipelines.core.verify.protocol.hidden_split_decimals`):
per-item correctness never leaves the sandbox, not even through the digits
of an aggregate.

It imports nothing of the model side and needs no access to the labels
directory: the sandbox masks it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from envloop_pipelines.core.sandbox.base import RESULT_FD_ENV

if TYPE_CHECKING:
    from envloop_pipelines.core.verify.protocol import VerifierReport


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="envloop-verify-worker", description=__doc__.split("\n")[0])
    p.add_argument("--kind", choices=("rule", "grader"), default="rule")
    p.add_argument("--predictions", required=True, type=Path, help="the predictions file (.parquet or .jsonl)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--labels", type=Path, help="a label Parquet file (running a worker by hand)")
    src.add_argument("--labels-fd", type=int, help="read the label Parquet bytes from this inherited descriptor")
    p.add_argument("--result-fd", default="1", help="descriptor of the result channel, or 'env' for $ENVLOOP_RESULT_FD")
    p.add_argument("--grader", default="text_match", help="scoring model of the grader kind (name or module:factory)")
    p.add_argument("--threshold", type=float, default=0.5, help="grader score that counts as correct")
    p.add_argument("--safety-family", action="append", default=[], help="families whose FNR the rule report includes")
    p.add_argument("--safety-threshold", action="append", default=[], type=_family_threshold, metavar="FAMILY=T",
                   help="the predictions' automation threshold on P(false) for a safety family: the rule report "
                        "adds its defer rate and the FNR of the automated answers")
    p.add_argument("--baseline-safety-threshold", action="append", default=[], type=_family_threshold,
                   metavar="FAMILY=T", help="the same for the baseline predictions")
    p.add_argument("--baseline-predictions", type=Path, default=None,
                   help="a second predictions file (the champion): also scored, plus paired deltas (rule kind)")
    p.add_argument("--seed", type=int, default=0, help="bootstrap seed of the paired deltas")
    p.add_argument("--aggregate-only", action="store_true",
                   help="a hidden split: send counts and aggregate scores only, no item, and refuse a predictions "
                        "file that does not answer every question validly")
    return p


def _family_threshold(text: str) -> tuple[str, float]:
    family, sep, value = text.partition("=")
    try:
        threshold = float(value)
    except ValueError:
        threshold = float("nan")
    if not sep or not family or threshold != threshold:
        raise argparse.ArgumentTypeError(f"{text!r} must look like FAMILY=THRESHOLD (a number or inf)")
    return family, threshold


def incomplete(report: "VerifierReport", what: str) -> str | None:
    """Why an aggregate-only run refuses ``report``, or None.

    Aggregate scores of a chosen subset of questions would tell per item whether an answer is
    right (a file with one valid row scores that row alone), so a hidden split is scored only
    when every question has a valid prediction.
    """
    if report.n_scored == report.n_items:
        return None
    return (f"{what}: a hidden split answers with aggregate scores only, on a predictions file that answers every "
            f"question validly; {report.n_scored} of {report.n_items} scored (missing {report.n_missing}, "
            f"invalid {report.n_invalid})" + (f"; file error: {report.file_error}" if report.file_error else ""))


def _result_fd(value: str) -> int:
    if value == "env":
        raw = os.environ.get(RESULT_FD_ENV)
        if raw is None:
            raise SystemExit(f"--result-fd env but ${RESULT_FD_ENV} is not set")
        return int(raw)
    return int(value)


def _write(fd: int, payload: dict) -> None:
    data = (json.dumps(payload, allow_nan=False) + "\n").encode("utf-8")
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    fd = _result_fd(args.result_fd)
    started = time.perf_counter()
    try:
        # Imported here so argument errors answer fast and the import cost shows in elapsed_s.
        from envloop_pipelines.core.storage import sha256_bytes
        from envloop_pipelines.core.verify.protocol import labels_from_bytes, prediction_format, score_file

        if args.labels_fd is not None:
            with os.fdopen(args.labels_fd, "rb", closefd=False) as fh:
                label_bytes = fh.read()
        else:
            label_bytes = args.labels.read_bytes()
        labels = labels_from_bytes(label_bytes)
        if args.kind == "rule":
            from envloop_pipelines.core.verify.rule import RuleVerifier

            verifier = RuleVerifier(safety_families=args.safety_family, safety_thresholds=dict(args.safety_threshold))
            baseline_verifier = RuleVerifier(safety_families=args.safety_family,
                                             safety_thresholds=dict(args.baseline_safety_threshold))
        else:
            from envloop_pipelines.core.verify.grader import ModelGrader

            verifier = ModelGrader(args.grader, threshold=args.threshold)
            baseline_verifier = verifier
        predictions = args.predictions.read_bytes()
        report = score_file(verifier, predictions, prediction_format(args.predictions), labels,
                            labels_sha256=sha256_bytes(label_bytes))
        reports = {"report": report}
        if args.baseline_predictions is not None:
            baseline = args.baseline_predictions.read_bytes()
            baseline_fmt = prediction_format(args.baseline_predictions)
            reports["baseline_report"] = score_file(baseline_verifier, baseline, baseline_fmt, labels,
                                                    labels_sha256=sha256_bytes(label_bytes))
        if args.aggregate_only:
            refused = [why for name, r in reports.items() if (why := incomplete(r, name.replace("_", " "))) is not None]
            if refused:
                _write(fd, {"ok": False, "worker_pid": os.getpid(), "error": "; ".join(refused)})
                return 1
            from envloop_pipelines.core.verify.protocol import round_hidden_report

            # Counts and aggregates only, rounded here, inside the sandbox, to what their CI can resolve.
            reports = {name: round_hidden_report(r.without_items()) for name, r in reports.items()}
        payload = {"ok": True, "worker_pid": os.getpid(), **{name: r.to_dict() for name, r in reports.items()}}
        if args.baseline_predictions is not None:
            from envloop_pipelines.core.verify.compare import paired_comparison
            from envloop_pipelines.core.verify.protocol import parse_predictions, round_hidden_paired

            payload["paired"] = paired_comparison(
                parse_predictions(predictions, prediction_format(args.predictions)),
                parse_predictions(baseline, baseline_fmt), labels, seed=args.seed,
                safety_families=args.safety_family,
            )
            if args.aggregate_only:
                payload["paired"] = round_hidden_paired(payload["paired"], report.n_items)
        payload["elapsed_s"] = round(time.perf_counter() - started, 6)
        _write(fd, payload)
        return 0
    except Exception as exc:  # the parent gets a typed failure, and the traceback on stderr
        traceback.print_exc()
        _write(fd, {"ok": False, "worker_pid": os.getpid(), "error": f"{type(exc).__name__}: {exc}"})
        return 1


def run_and_exit(argv: Sequence[str] | None = None) -> None:
    """Run :func:`main`, then leave at once with its status, skipping interpreter teardown.

    The verdict is on the result channel by then and nothing after it may change the outcome;
    the teardown is where, about once in 150 runs on two busy cores, a C++ library's static
    ``std::thread`` was still joinable and libstdc++ aborted the worker ("terminate called
    without an active exception", SIGABRT) after it had sent a complete report.
    """
    code = main(argv)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


if __name__ == "__main__":
    run_and_exit()
