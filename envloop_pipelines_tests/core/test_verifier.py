"""Verifiers: per-item scores, explicit failures, the sandboxed worker, determinism, independence."""

from __future__ import annotations

import ast
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pyarrow as pa
import pytest
from click.testing import CliRunner

from envloop_pipelines.cli.sandbox import sandbox as sandbox_cli
from envloop_pipelines.core.metrics import point
from envloop_pipelines.core.data.datasets import import_file
from envloop_pipelines.core.sandbox import SandboxLimits, probe_host
from envloop_pipelines.core.verify.grader import GradeRequest, ModelGrader, TextMatchScorer, load_scoring_model
from envloop_pipelines.core.verify.labels import read_hidden_labels
from envloop_pipelines.core.verify.protocol import (
    PredictionFileError,
    VerifierReport,
    labels_to_bytes,
    parse_predictions,
    score_file,
    write_predictions,
)
from envloop_pipelines.core.verify.rule import RuleVerifier
from envloop_pipelines.core.verify.runner import DEFAULT_WORKER_LIMITS, VerifierRunner, verify_task

from .data.test_snapshots import dataset

PACKAGE = Path(__file__).resolve().parents[2] / "envloop_pipelines"


@pytest.fixture(scope="module")
def task(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("verify")
    home = root / "home"
    snap = import_file(dataset(root), "tickets", home=home)
    labels = read_hidden_labels("tickets", "test", home=home)
    return {"home": home, "snap": snap, "labels": labels, "root": root}


def oracle_rows(labels: pa.Table, *, confidence: float = 0.9) -> list[dict[str, Any]]:
    """Predictions putting ``confidence`` on the labelled option (the soft label's argmax for soft items)."""
    rows = []
    for r in labels.to_pylist():
        keys = r["option_keys"]
        target = int(np.argmax(r["soft_label"])) if r["soft_label"] is not None else r["label"]
        rest = (1 - confidence) / (len(keys) - 1)
        rows.append({"record_id": r["record_id"], "question_id": r["question_id"], "option_keys": keys,
                     "probs": [confidence if i == target else rest for i in range(len(keys))]})
    return rows


# --------------------------------------------------------------------------- the rule verifier


def test_rule_scores_match_core_metrics(task: dict[str, Any]) -> None:
    labels = task["labels"]
    rows = oracle_rows(labels)
    report = RuleVerifier().score(rows, labels)
    assert report.n_items == labels.num_rows == report.n_scored and report.complete
    assert report.n_missing == report.n_invalid == report.n_extra == 0
    hard = [i for i in report.items if i.correct is not None]
    soft = [i for i in report.items if i.correct is None]
    assert hard and soft  # the fixture has both kinds (priority carries a soft label)
    assert all(i.correct and i.score == 1.0 for i in hard) and report.accuracy_all == 1.0
    # Per item: Brier against the one-hot label, 0.9 on the label of a 3-option question -> 0.1^2 + 2 * 0.05^2.
    queue = next(i for i in report.items if i.question_id == "queue")
    assert queue.brier == pytest.approx(0.1 ** 2 + 2 * 0.05 ** 2) and queue.nll == pytest.approx(-math.log(0.9))
    # Soft item: the soft label {1: .5, 2: .5}; argmax at 1 -> score .5, Brier against the soft target.
    prio = next(i for i in report.items if i.question_id == "priority")
    expected = np.sum((np.array([1 / 30, 0.9, 1 / 30, 1 / 30]) - np.array([0, 0.5, 0.5, 0])) ** 2)
    assert prio.score == pytest.approx(0.5) and prio.brier == pytest.approx(expected)
    # The aggregate is core.metrics.point.summarize, and the per-item scores average to it.
    probs = [np.array(r["probs"]) for r in rows]
    rows_l = labels.to_pylist()
    lab = [r["label"] if r["soft_label"] is None else -1 for r in rows_l]
    soft_l = [None if r["soft_label"] is None else np.array(r["soft_label"]) for r in rows_l]
    assert report.metrics["brier"] == pytest.approx(point.brier(probs, lab, soft_labels=soft_l))
    assert report.metrics["brier"] == pytest.approx(np.mean([i.brier for i in report.items]))
    assert report.metrics["nll"] == pytest.approx(np.mean([i.nll for i in report.items]))
    assert report.metrics["accuracy"] == 1.0 and report.metrics["n_questions"] == labels.num_rows


def test_missing_extra_and_invalid_rows_are_explicit_failures(task: dict[str, Any]) -> None:
    labels = task["labels"]
    rows = oracle_rows(labels)
    missing = rows.pop(0)
    rows[0] = {**rows[0], "probs": [p * 0.9 for p in rows[0]["probs"]]}  # sums to 0.9
    rows[1] = {**rows[1], "option_keys": [*rows[1]["option_keys"][:-1], "bogus"]}
    rows[2] = {**rows[2], "probs": [float("nan")] + rows[2]["probs"][1:]}
    rows[3] = {**rows[3], "probs": [-0.1, 1.1] + [0.0] * (len(rows[3]["probs"]) - 2)}
    rows.append(dict(rows[4]))  # a duplicate row
    rows.append({"record_id": "nobody", "question_id": "queue", "option_keys": ["a", "b"], "probs": [0.5, 0.5]})
    report = RuleVerifier().score(rows, labels)
    by_key = {(i.record_id, i.question_id): i for i in report.items}
    gone = by_key[(missing["record_id"], missing["question_id"])]
    assert gone.status == "missing" and gone.score == 0.0 and gone.error == "no prediction for this question"
    errors = [by_key[(r["record_id"], r["question_id"])].error for r in rows[:5]]
    assert errors[0].startswith("probs sum to 0.900000, not 1")
    assert errors[1].startswith("option_keys do not match the question's options (missing") and "'bogus'" in errors[1]
    assert errors[2] == "probs contain a non-finite value"
    assert errors[3] == "probs contain a negative value"
    assert errors[4].startswith("2 prediction rows for this question")
    assert (report.n_missing, report.n_invalid, report.n_extra) == (1, 5, 1)
    assert report.n_scored + report.n_missing + report.n_invalid == report.n_items
    assert report.extra_ids == (("nobody", "queue"),) and not report.complete
    assert report.metrics["n_questions"] == report.n_scored  # the aggregate covers scored items only ...
    hard_failures = sum(1 for i in report.items if i.status != "scored" and i.correct is False)
    hard = sum(1 for i in report.items if i.correct is not None)
    assert report.accuracy_all == pytest.approx((hard - hard_failures) / hard)  # ... accuracy_all counts failures
    assert report.mean_score == pytest.approx(sum(i.score for i in report.items) / report.n_items)


def test_options_in_any_order_score_the_same(task: dict[str, Any]) -> None:
    labels = task["labels"]
    rows = oracle_rows(labels, confidence=0.7)
    shuffled = [{**r, "option_keys": r["option_keys"][::-1], "probs": r["probs"][::-1]} for r in rows]
    assert RuleVerifier().score(shuffled, labels).items == RuleVerifier().score(rows, labels).items


def test_jsonl_and_parquet_files_give_the_same_scores(task: dict[str, Any], tmp_path: Path) -> None:
    labels = task["labels"]
    rows = oracle_rows(labels, confidence=0.6)
    a = write_predictions(tmp_path / "p.jsonl", rows).read_bytes()
    b = write_predictions(tmp_path / "p.parquet", rows).read_bytes()
    ra = score_file(RuleVerifier(), a, "jsonl", labels)
    rb = score_file(RuleVerifier(), b, "parquet", labels)
    assert ra.items == rb.items and ra.metrics == rb.metrics
    bad = score_file(RuleVerifier(), b"not parquet", "parquet", labels)
    assert bad.file_error.startswith("not a readable Parquet file") and bad.n_missing == bad.n_items and bad.n_scored == 0
    with pytest.raises(PredictionFileError, match="missing column"):
        parse_predictions(labels_to_bytes(labels.select(["record_id"])), "parquet")
    broken = parse_predictions(b'{"record_id": "r"}\nnot json\n', "jsonl")
    assert broken[1]["_error"].startswith("invalid JSON") and broken[1]["_row"] == 2


def test_report_round_trips_through_json(task: dict[str, Any]) -> None:
    report = RuleVerifier().score(oracle_rows(task["labels"])[1:], task["labels"])
    again = VerifierReport.from_dict(json.loads(json.dumps(report.to_dict(), allow_nan=False)))
    assert again.fingerprint() == report.fingerprint() and again.items == report.items


# --------------------------------------------------------------------------- the grader


def test_model_grader_scores_answers_with_a_scoring_model(task: dict[str, Any]) -> None:
    labels = task["labels"]
    rows = oracle_rows(labels)
    text = {"queue": "billing", "refund": "true"}
    for r in rows:
        r["answer"] = text.get(r["question_id"], "1")
    rows[0]["answer"] = "the billing queue"  # partial credit: token F1 = 2 * (1/3 * 1) / (1/3 + 1) = 0.5
    report = ModelGrader("text_match", threshold=0.6).score(rows[:-1], labels)
    assert report.kind == "grader" and report.n_missing == 1
    first = report.items[0]
    assert first.score == pytest.approx(0.5) and first.correct is False
    assert all(i.score == 1.0 and i.correct for i in report.items[1:-1] if i.correct is not None)
    assert report.provenance["scoring_model"] == "text_match/1"
    scorer = TextMatchScorer()
    req = GradeRequest("r", "q", ("a", "b"), None, (0.25, 0.75), "b", None)
    assert list(scorer.grade([req])) == [0.75]
    with pytest.raises(ValueError, match="package.module:factory"):
        load_scoring_model("nonsense")


# --------------------------------------------------------------------------- the sandboxed worker


def test_sandboxed_verifier_is_deterministic_and_matches_in_process(task: dict[str, Any], tmp_path: Path) -> None:
    labels = task["labels"]
    path = write_predictions(tmp_path / "preds.parquet", oracle_rows(labels, confidence=0.8)[2:])
    runner = VerifierRunner()
    runs = [runner.run(path, labels) for _ in range(3)]
    assert all(r.ok for r in runs), [r.error for r in runs]
    assert len({r.report.fingerprint() for r in runs}) == 1  # the same verdict, three times
    local = score_file(RuleVerifier(), path.read_bytes(), "parquet", labels, labels_sha256=runs[0].report.provenance["labels_sha256"])
    assert local.fingerprint() == runs[0].report.fingerprint()
    support = probe_host()
    for run in runs:
        # Its own process: with a PID namespace the worker is pid 2 of its own (pid 1 is the sandbox's init) and
        # sandbox.pid is the launcher's pid on the host.
        assert run.worker_pid == (2 if support.pid_namespace else run.sandbox.pid) and run.sandbox.pid != os.getpid()
        assert run.sandbox.backend == "local" and run.sandbox.status == "ok"
    assert len({r.sandbox.pid for r in runs}) == 3
    assert runs[0].sandbox.network_isolated == support.network_namespace
    assert runs[0].sandbox.hidden_paths_masked == support.mount_namespace
    assert runs[0].report.n_missing == 2


class _HostileRunner(VerifierRunner):
    """A 'worker' that plants a reward file and prints a perfect report everywhere but the channel."""

    def __init__(self, code: str) -> None:
        super().__init__(limits=SandboxLimits(wall_s=20))
        self.code = code

    def worker_argv(self, kind: str, predictions_name: str, **_: Any) -> list[str]:
        return [self.python, "-c", self.code]


FAKE = json.dumps({"ok": True, "worker_pid": 1, "report": {"kind": "rule", "mean_score": 1.0}})


def test_a_planted_reward_is_ignored(task: dict[str, Any], tmp_path: Path) -> None:
    path = write_predictions(tmp_path / "p.jsonl", oracle_rows(task["labels"]))
    plant = f"open('reward.json', 'w').write('{{\"reward\": 1.0}}')\nopen('report.json', 'w').write({FAKE!r})\nprint({FAKE!r})\n"
    silent = _HostileRunner(plant).run(path, task["labels"])
    assert silent.status == "error" and silent.report is None
    assert silent.error == "the worker exited 0 but sent nothing on the result channel"
    forged = _HostileRunner(
        "import os, json\n"
        "report = {'kind': 'rule', 'n_items': 0, 'n_scored': 0, 'n_missing': 0, 'n_invalid': 0, 'n_extra': 0,"
        " 'complete': True, 'metrics': {}, 'accuracy_all': 1.0, 'mean_score': 1.0, 'items': [], 'provenance': {}}\n"
        "os.write(int(os.environ['ENVLOOP_RESULT_FD']), json.dumps({'ok': True, 'report': report}).encode())\n"
    ).run(path, task["labels"])
    assert forged.status == "error" and forged.report is None and "sha256 differs" in forged.error


def test_worker_failures_are_typed_runs(task: dict[str, Any], tmp_path: Path) -> None:
    path = write_predictions(tmp_path / "p.jsonl", oracle_rows(task["labels"]))
    garbage = VerifierRunner(limits=SandboxLimits(wall_s=30, mem_mb=2048)).run(path, b"these are not labels")
    assert garbage.status == "error" and garbage.report is None and garbage.error.startswith("error: ArrowInvalid")
    assert "Traceback" in garbage.sandbox.stderr_tail
    starved = VerifierRunner(limits=SandboxLimits(wall_s=30, mem_mb=100)).run(path, task["labels"])
    assert starved.status == "memory_exceeded" and starved.report is None
    # A wall limit no machine can meet: in 5 ms the sandbox's launcher cannot even start the interpreter, let alone
    # import pyarrow and score (a limit of 0.3 s was met by a fast CI machine, so the run came back "ok").
    slow = VerifierRunner(limits=SandboxLimits(wall_s=0.005, mem_mb=2048)).run(path, task["labels"])
    assert slow.status == "timeout" and slow.report is None and slow.error.startswith("timeout"), slow.error


def test_the_worker_status_is_its_verdict_not_its_teardown(task: dict[str, Any], tmp_path: Path) -> None:
    """A teardown that aborts (as a C++ library's joinable static std::thread did, ~1 run in 150) changes nothing."""
    preds = write_predictions(tmp_path / "p.jsonl", oracle_rows(task["labels"]))
    labels = tmp_path / "labels.parquet"
    labels.write_bytes(labels_to_bytes(task["labels"]))
    code = ("import atexit, os, sys\natexit.register(os.abort)\nfrom envloop_pipelines.core.verify import worker\n"
            "worker.run_and_exit(sys.argv[1:])")
    argv = ["--predictions", str(preds), "--labels", str(labels), "--result-fd", "1"]
    proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["report"]["metrics"]["accuracy"] == 1.0
    control = subprocess.run([sys.executable, "-c", code.replace("run_and_exit", "main"), *argv],
                             capture_output=True, text=True, timeout=120)
    assert control.returncode == -signal.SIGABRT and json.loads(control.stdout)["ok"]  # the hook does bite


def test_verify_task_and_the_cli(task: dict[str, Any], tmp_path: Path) -> None:
    path = write_predictions(tmp_path / "p.jsonl", oracle_rows(task["labels"]))
    run = verify_task("tickets", "test", path, home=task["home"])
    assert run.ok and run.report.complete and run.report.accuracy_all == 1.0
    result = CliRunner().invoke(sandbox_cli, ["verify", "--task", "tickets", "--split", "test", "--predictions", str(path),
                                              "--home", str(task["home"]), "--kind", "grader"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["status"] == "ok" and out["report"]["kind"] == "grader" and "items" not in out["report"]
    assert out["report"]["n_items"] == task["labels"].num_rows and out["worker_pid"] == (2 if probe_host().pid_namespace else out["sandbox"]["pid"])
    assert DEFAULT_WORKER_LIMITS.mem_mb >= 1024
    # A hidden split's report carries no items, even to the caller of verify_task.
    assert run.report.items == () and run.report.n_scored == task["labels"].num_rows


def _cli_verify(task: dict[str, Any], path: Path, *args: str) -> Any:
    return CliRunner().invoke(sandbox_cli, ["verify", "--task", "tickets", "--predictions", str(path),
                                            "--home", str(task["home"]), *args])


def test_the_cli_never_answers_per_item_on_a_hidden_split(task: dict[str, Any], tmp_path: Path) -> None:
    """Rule 4 through the CLI: --items on test or holdout is refused before any label is read."""
    path = write_predictions(tmp_path / "p.jsonl", oracle_rows(task["labels"]))
    for split in ("test", "holdout"):
        result = _cli_verify(task, path, "--split", split, "--items", "--release", "1")
        assert result.exit_code == 2 and f"--items: {split} answers with aggregate scores only" in result.output
    # One chosen row scored alone would be that row's verdict: the worker refuses a partial file.
    one = write_predictions(tmp_path / "one.jsonl", oracle_rows(task["labels"])[:1])
    partial = _cli_verify(task, one, "--split", "test")
    out = json.loads(partial.output)
    assert partial.exit_code == 1 and out["report"] is None and "aggregate scores only" in out["error"]
    # Open splits still give per-item scores to whoever asks.
    from envloop_pipelines.core.data.snapshots import open_task

    dev = open_task("tickets", home=task["home"]).labels("dev")
    dev_path = write_predictions(tmp_path / "dev.jsonl", oracle_rows(dev))
    open_run = _cli_verify(task, dev_path, "--split", "dev", "--items")
    assert open_run.exit_code == 0 and len(json.loads(open_run.output)["report"]["items"]) == dev.num_rows


def test_a_second_holdout_read_through_the_cli_is_refused(task: dict[str, Any], tmp_path: Path) -> None:
    """Rule 4 through the CLI: a holdout read is a published release's one read, in the ledger's slot."""
    from envloop_pipelines.core.ledger.event_log import EVENT_HOLDOUT_READ
    from envloop_pipelines.core.ledger.ledger import Ledger

    holdout = read_hidden_labels("tickets", "holdout", home=task["home"])
    path = write_predictions(tmp_path / "h.jsonl", oracle_rows(holdout))
    no_release = _cli_verify(task, path, "--split", "holdout")
    assert no_release.exit_code == 2 and "--split holdout needs --release N" in no_release.output
    unpublished = _cli_verify(task, path, "--split", "holdout", "--release", "7")
    assert unpublished.exit_code == 2 and "release 7 of 'tickets' is not published" in unpublished.output
    ledger = Ledger("tickets", task["home"])
    # Release 1 read its holdout when it was published (as publish_release does); release 2's card was written
    # without its read (as a home from before the read was recorded could hold).
    ledger.read_holdout_once(1, lambda: {"family_macro_accuracy": 0.5})
    for release in (1, 2):
        ledger.write_release_card(release, {"release": release, "round": f"r{release}"}, f"# release {release}\n")
    second = _cli_verify(task, path, "--split", "holdout", "--release", "1")
    assert second.exit_code == 2 and "release 1 already read the holdout" in second.output
    # A published release never reads the holdout again, even one whose card was written without its read.
    late = _cli_verify(task, path, "--split", "holdout", "--release", "2")
    assert late.exit_code == 2 and "release 2 is published" in late.output, late.output
    assert ledger.holdout_result(2) is None
    assert [e["release"] for e in ledger.events(EVENT_HOLDOUT_READ)] == [1]
    # Past the CLI, verify_task itself takes no holdout read without a release.
    from envloop_pipelines.core.verify.runner import HiddenSplitQueryError

    with pytest.raises(HiddenSplitQueryError, match="read once per release"):
        verify_task("tickets", "holdout", path, home=task["home"])


# --------------------------------------------------------------------------- independence


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def _modules_under(*parts: str) -> Sequence[Path]:
    root = PACKAGE.joinpath(*parts)
    return sorted(root.rglob("*.py")) if root.is_dir() else []


def test_the_model_side_never_imports_the_verifier_and_vice_versa() -> None:
    model_side = [*_modules_under("core", "model"), *_modules_under("core", "benchmark")]
    for path in model_side:
        bad = sorted(n for n in _imports(path) if n.startswith("envloop_pipelines.core.verify"))
        assert not bad, f"{path} imports {bad}"
    for path in _modules_under("core", "verify"):
        bad = sorted(n for n in _imports(path) if n.startswith("envloop_pipelines.core.model"))
        assert not bad, f"{path} imports {bad}"


def test_paired_comparison_runs_inside_the_sandboxed_verifier(task: dict[str, Any], tmp_path: Path) -> None:
    labels = task["labels"]
    better = write_predictions(tmp_path / "better.parquet", oracle_rows(labels, confidence=0.9))
    uniform = [dict(r, probs=[1 / len(r["option_keys"])] * len(r["option_keys"])) for r in oracle_rows(labels)]
    worse = write_predictions(tmp_path / "worse.parquet", uniform)
    run = VerifierRunner().run(better, labels, baseline_predictions=worse, seed=3)
    assert run.ok, run.error
    assert run.baseline_report is not None and run.baseline_report.metrics["brier"] > run.report.metrics["brier"]
    brier = run.paired["deltas"]["brier"]
    # Same questions, candidate − baseline: the oracle's Brier is lower on every question.
    assert brier["delta"] == pytest.approx(run.report.metrics["brier"] - run.baseline_report.metrics["brier"])
    assert brier["ci_high"] < 0
    assert run.paired["n_questions"] == labels.num_rows and run.paired["n_excluded"] == 0
    same = VerifierRunner().run(better, labels, baseline_predictions=better)
    assert same.paired["deltas"]["family_macro_accuracy"] == {**same.paired["deltas"]["family_macro_accuracy"],
                                                              "delta": 0.0, "ci_low": 0.0, "ci_high": 0.0}


def test_paired_comparison_gives_each_family_and_safety_family_its_own_ci(task: dict[str, Any]) -> None:
    from envloop_pipelines.core.verify.compare import SAFETY_CONFIDENCE_LEVEL, paired_comparison

    labels = task["labels"]
    champion = oracle_rows(labels)
    # The candidate is wrong on every route question and answers "false" to every refund (a noul whose
    # true answer is "true" here): route accuracy falls by 1 and refund's FNR rises from 0 to 1.
    candidate = []
    for row, lab in zip(oracle_rows(labels), labels.to_pylist()):
        if lab["family"] in ("route", "refund"):
            k = len(row["option_keys"])
            wrong = (lab["label"] + 1) % k
            row = dict(row, probs=[0.9 if i == wrong else 0.1 / (k - 1) for i in range(k)])
        candidate.append(row)
    out = paired_comparison(candidate, champion, labels, n_resamples=200, safety_families=("refund", "absent"))
    assert set(out["families"]) == {"route", "refund"}  # priority is soft-labelled only: no accuracy to compare
    route = out["families"]["route"]
    assert (route["delta"], route["ci_low"], route["ci_high"], route["se"]) == (-1.0, -1.0, -1.0, 0.0)
    assert route["confidence_level"] == 0.95 and route["n_clusters"] == route["n_questions"]
    assert set(out["safety"]) == {"refund"}  # a declared family absent from the split has no FNR
    refund = out["safety"]["refund"]
    assert refund["delta"] == 1.0 and refund["confidence_level"] == SAFETY_CONFIDENCE_LEVEL
    same = paired_comparison(champion, champion, labels, n_resamples=50, safety_families=("refund",))
    assert same["families"]["route"]["delta"] == 0.0 and same["safety"]["refund"]["ci_low"] == 0.0


def test_the_verifier_scores_each_files_own_safety_threshold(task: dict[str, Any], tmp_path: Path) -> None:
    labels = task["labels"]
    # Every refund question's true answer is "true"; the candidate says "false" at 0.9 on all of them.
    rows = []
    for row, lab in zip(oracle_rows(labels), labels.to_pylist()):
        if lab["family"] == "refund":
            row = dict(row, probs=[0.1, 0.9])
        rows.append(row)
    candidate = write_predictions(tmp_path / "cand.parquet", rows)
    baseline = write_predictions(tmp_path / "base.parquet", oracle_rows(labels))
    run = VerifierRunner().run(candidate, labels, baseline_predictions=baseline, safety_families=["refund"],
                               safety_thresholds={"refund": 0.85}, baseline_safety_thresholds={"refund": math.inf})
    assert run.ok, run.error
    got = run.report.metrics
    # argmax misses every positive; at threshold 0.85 every one is automated as "false": FNR 1, nothing deferred
    assert (got["fnr/refund"], got["fnr_automated/refund"], got["defer_rate/refund"]) == (1.0, 1.0, 0.0)
    base = run.baseline_report.metrics
    assert (base["fnr/refund"], base["fnr_automated/refund"], base["defer_rate/refund"]) == (0.0, 0.0, 1.0)
    stricter = VerifierRunner().run(candidate, labels, safety_families=["refund"], safety_thresholds={"refund": 0.95})
    assert (stricter.report.metrics["fnr_automated/refund"], stricter.report.metrics["defer_rate/refund"]) == (0.0, 1.0)
    plain = VerifierRunner().run(candidate, labels, safety_families=["refund"])
    assert "defer_rate/refund" not in plain.report.metrics  # no threshold given: nothing to report
