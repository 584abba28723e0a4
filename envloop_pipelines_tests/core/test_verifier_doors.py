"""Issue 23, rule 4 at every door: the holdout slot, a crash after the read, the digits of an aggregate, a caller's runner.

Each test reproduces an audit break against the real verifier (a sandboxed worker, the real ledger).
"""

from __future__ import annotations

import logging
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from click.testing import CliRunner

from envloop_pipelines.cli.sandbox import sandbox as sandbox_cli
from envloop_pipelines.core.data.datasets import import_file
from envloop_pipelines.core.environments.decision import DecisionEnvironment
from envloop_pipelines.core.ledger.event_log import EVENT_HOLDOUT_READ, EVENT_TEST_READ
from envloop_pipelines.core.ledger.ledger import Ledger
from envloop_pipelines.core.ledger.reads import HoldoutAlreadyReadError, HoldoutSlotError
from envloop_pipelines.core.ledger.reads import open_holdout_slot  # the release step's own (no public opener)
from envloop_pipelines.core.sandbox import LocalSandbox, SandboxCall
from envloop_pipelines.core.verify.labels import read_hidden_labels
from envloop_pipelines.core.verify.protocol import hidden_split_decimals, write_predictions
from envloop_pipelines.core.ledger.reads import holdout_read_key
from envloop_pipelines.core.verify.runner import HiddenSplitQueryError, VerifierRunner, verify_task

from .data.test_snapshots import dataset

TASK = "tickets"
LABEL_LOG = "envloop_pipelines.core.verify.labels"


def _home(tmp_path: Path, n_users: int = 30) -> Path:
    home = tmp_path / "home"
    import_file(dataset(tmp_path, n_users=n_users), TASK, home=home)
    return home


def oracle(labels: pa.Table) -> list[dict[str, Any]]:
    rows = []
    for r in labels.to_pylist():
        target = int(np.argmax(r["soft_label"])) if r["soft_label"] is not None else r["label"]
        k = len(r["option_keys"])
        rows.append({"record_id": r["record_id"], "question_id": r["question_id"], "option_keys": r["option_keys"],
                     "probs": [0.9 if i == target else 0.1 / (k - 1) for i in range(k)]})
    return rows


def label_reads(caplog: pytest.LogCaptureFixture) -> int:
    return sum(1 for r in caplog.records if r.name == LABEL_LOG and "read hidden labels" in r.getMessage())


# --------------------------------------------------------------------------- item 2: the holdout slot


class ForgedSlot:
    """A duck-typed slot: it would let every read through, as often as asked."""

    def __init__(self) -> None:
        self.calls = 0

    def read_holdout_once(self, release: int, read: Any, **_: Any) -> Any:
        self.calls += 1
        return read()


def test_the_holdout_slot_is_the_task_homes_own_ledger_for_the_release_being_published(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LABEL_LOG)
    home = _home(tmp_path)
    path = write_predictions(tmp_path / "h.jsonl", oracle(read_hidden_labels(TASK, "holdout", home=home)))
    answers_env = DecisionEnvironment(TASK, "holdout", home=home)
    caplog.clear()
    # The audit's reproduction: a fresh ledger in another home "read" the holdout again and again.
    for _ in range(2):
        with pytest.raises(HiddenSplitQueryError, match="holdout_slot: Ledger at .* is not the ledger of task"):
            verify_task(TASK, "holdout", path, home=home, holdout_slot=Ledger(TASK, tmp_path / "other-home"), release=1)
    forged = ForgedSlot()
    with pytest.raises(HiddenSplitQueryError, match="holdout_slot: ForgedSlot"):
        verify_task(TASK, "holdout", path, home=home, holdout_slot=forged, release=1)
    assert forged.calls == 0 and label_reads(caplog) == 0  # refused before any label is read
    # The home's own ledger opens a slot only for the release being published now (release 1 here).
    own = Ledger(TASK, home)
    for release in (900, 901, 2):
        with pytest.raises(HoldoutSlotError, match=f"release {release}: the holdout is read only for the release "
                                                   f"being published now, release 1"):
            verify_task(TASK, "holdout", path, home=home, release=release)
        with pytest.raises(HoldoutSlotError):
            own.read_holdout_once(release, lambda: {"taken": True})
    assert label_reads(caplog) == 0 and not (own.root / "releases").exists()  # nothing written, nothing taken
    assert list(own.events(EVENT_HOLDOUT_READ)) == []
    # A person's read of release 1 (the release being published next) finds no slot the release step opened
    # for its predictions: refused before any label is read, nothing taken (it could otherwise take the slot
    # early and block the loop's real publish).
    with pytest.raises(HiddenSplitQueryError, match="release 1: no holdout slot is open for these predictions"):
        verify_task(TASK, "holdout", path, home=home, release=1)
    assert label_reads(caplog) == 0 and own.holdout_result(1) is None
    # An early slot for other predictions (only the release step opens one) does not block the real publish
    # either: it opens its own.
    open_holdout_slot(own, 1, "0" * 64 + ":-", by="an earlier attempt of the release step")
    with pytest.raises(HiddenSplitQueryError, match="no holdout slot is open for these predictions"):
        verify_task(TASK, "holdout", path, home=home, release=1)
    open_holdout_slot(own, 1, holdout_read_key(path), by="release step")
    # So release 1, the loop's real publish, is not blocked: its read goes through, once.
    run = verify_task(TASK, "holdout", path, home=home, holdout_slot=own, release=1)
    assert run.ok and run.report.accuracy_all == 1.0 and label_reads(caplog) == 1
    own.write_release_card(1, {"release": 1, "round": "r1"}, "# release 1\n")
    with pytest.raises(HoldoutAlreadyReadError, match="release 1 already read the holdout"):
        verify_task(TASK, "holdout", path, home=home, release=1)
    with pytest.raises(HiddenSplitQueryError, match="not the ledger of task"):
        answers_env.evaluate({}, holdout_slot=Ledger(TASK, tmp_path / "third-home"), release=2)
    assert label_reads(caplog) == 1 and [e["release"] for e in own.events(EVENT_HOLDOUT_READ)] == [1]


# --------------------------------------------------------------------------- item 11: a crash after the read

_CRASH_AFTER_READ = """
import os, signal, sys
from envloop_pipelines.core.verify.runner import verify_task
from envloop_pipelines.core.ledger.ledger import Ledger
from envloop_pipelines.core.ledger.reads import open_holdout_slot
from envloop_pipelines.core.ledger.reads import holdout_read_key
open_holdout_slot(Ledger("tickets", sys.argv[2]), 1, holdout_read_key(sys.argv[1]), by="release step")
run = verify_task("tickets", "holdout", sys.argv[1], home=sys.argv[2], holdout_slot=Ledger("tickets", sys.argv[2]),
                  release=1)
assert run.ok, run.error
print(repr(run.report.metrics["family_macro_accuracy"]), flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # the release step dies between the read and the card
"""


def test_a_crash_between_the_holdout_read_and_the_card_finishes_from_the_stored_read(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    home = _home(tmp_path)
    labels = read_hidden_labels(TASK, "holdout", home=home)
    path = write_predictions(tmp_path / "h.jsonl", oracle(labels))
    crashed = subprocess.run([sys.executable, "-c", _CRASH_AFTER_READ, str(path), str(home)], capture_output=True,
                             text=True, timeout=180)
    assert crashed.returncode == -9, crashed.stderr[-2000:]
    ledger = Ledger(TASK, home)
    assert ledger.releases() == [] and ledger.holdout_result(1) is not None  # read, no card
    caplog.set_level(logging.INFO, logger=LABEL_LOG)
    caplog.clear()
    # The retry gets the stored read back: no second read of the labels, the same numbers, one ledger event.
    retry = verify_task(TASK, "holdout", path, home=home, holdout_slot=ledger, release=1)
    assert retry.ok and label_reads(caplog) == 0
    assert repr(retry.report.metrics["family_macro_accuracy"]) == crashed.stdout.strip()
    assert retry.report.items == () and retry.report.n_items == labels.num_rows
    assert "stored holdout read" in retry.sandbox.detail
    assert [e["release"] for e in ledger.events(EVENT_HOLDOUT_READ)] == [1]
    # A read of other predictions (another checkpoint) for release 1 is still refused: one read per release.
    rows = oracle(labels)
    rows[0] = {**rows[0], "probs": list(reversed(rows[0]["probs"]))}
    other = write_predictions(tmp_path / "other.jsonl", rows)
    with pytest.raises(HiddenSplitQueryError, match="no holdout slot is open for these predictions"):
        verify_task(TASK, "holdout", other, home=home, release=1)
    open_holdout_slot(ledger, 1, holdout_read_key(other), by="a second release step")  # even with a slot of its own
    with pytest.raises(HoldoutAlreadyReadError, match="for other predictions"):
        verify_task(TASK, "holdout", other, home=home, release=1)
    assert label_reads(caplog) == 0
    # The card is written from the stored read; after it, even the same read is refused.
    ledger.write_release_card(1, {"release": 1, "holdout": dict(retry.report.metrics)}, "# release 1\n")
    with pytest.raises(HoldoutAlreadyReadError, match="each release reads it once"):
        verify_task(TASK, "holdout", path, home=home, release=1)
    assert label_reads(caplog) == 0 and len(list(ledger.events(EVENT_HOLDOUT_READ))) == 1


# --------------------------------------------------------------------------- item 3: the digits of an aggregate


def _attack_rows(labels: pa.Table, signs: list[int]) -> tuple[list[dict[str, Any]], list[dict[str, Any]], float]:
    """The audit's file: (1 ± 8^-j)/2 on 12 two-option hard questions, uniform elsewhere.

    Returns the rows, the 12 targeted labels, and the summed nll of the uniform questions (known to the attacker:
    log k for a k-option question, soft-labelled or not).
    """
    rows, targets, base = [], [], 0.0
    for r in labels.to_pylist():
        k = len(r["option_keys"])
        j = len(targets) + 1
        if k == 2 and r["soft_label"] is None and j <= 12:
            e = 8.0 ** -j * signs[j - 1]
            rows.append({**{c: r[c] for c in ("record_id", "question_id", "option_keys")}, "probs": [(1 + e) / 2, (1 - e) / 2]})
            targets.append(r)
        else:
            rows.append({**{c: r[c] for c in ("record_id", "question_id", "option_keys")}, "probs": [1.0 / k] * k})
            base += math.log(k)
    assert len(targets) == 12
    return rows, targets, base


def _decode(nll: float, n: int, base: float, signs: list[int]) -> list[int]:
    """The attacker's decoder: the 12 labels (option index) from one mean nll, largest weight first."""
    rest = nll * n - base - 12 * math.log(2)  # = sum_j -log(1 ± s_j e_j): + when the label is option 0
    out = []
    for j in range(1, 13):
        e = 8.0 ** -j * signs[j - 1]
        c0, c1 = -math.log(1 + e), -math.log(1 - e)
        label = 0 if (rest < 0) == (c0 < 0) else 1
        out.append(label)
        rest -= c0 if label == 0 else c1
    return out


def test_attack_3_one_crafted_file_recovers_no_label_from_the_rounded_aggregates(tmp_path: Path) -> None:
    from envloop_pipelines.core.verify.rule import RuleVerifier

    from .data.test_records import good_record, write_lines

    rng = np.random.default_rng(23)
    noul = {"type": "noul", "instructions": "Does the customer ask for a refund?"}
    records = [good_record(f"r{u}-{k}", user=f"u{u}", refund={**noul, "label": bool(rng.random() < 0.5)})
               for u in range(525) for k in range(2)]  # ~315 test questions, as the built-in benchmark's 314
    home = tmp_path / "home"
    import_file(write_lines(tmp_path / "d.jsonl", records), TASK, home=home)
    labels = read_hidden_labels(TASK, "test", home=home)
    n = labels.num_rows
    assert 300 <= n <= 330 and hidden_split_decimals(n) == (3, 2)
    signs = [1] * 12
    rows, targets, base = _attack_rows(labels, signs)
    truth = [t["label"] for t in targets]
    assert 0 < sum(truth) < 12  # both answers occur among the 12 targeted questions
    # What a full-precision nll gives away: the decoder reads all 12 labels from the exact value.
    exact = RuleVerifier().score(rows, labels).metrics["nll"]
    assert _decode(exact, n, base, signs) == truth
    # Through the verifier's door: the score aggregates do not depend on the 12 targeted labels at all. The same
    # answer comes back for files that encode them with other signs (as if the labels were others: the mirror
    # reads as the complement), so the attacker's guess is the same whatever the labels: chance.
    patterns = [signs, [-x for x in signs], [int(x) for x in rng.choice([-1, 1], 12)],
                [int(x) for x in rng.choice([-1, 1], 12)]]
    runs = []
    for i, pattern in enumerate(patterns):
        attack, _, _ = _attack_rows(labels, pattern)
        runs.append(verify_task(TASK, "test", write_predictions(tmp_path / f"attack{i}.jsonl", attack), home=home))
        assert runs[-1].ok, runs[-1].error
    reported = runs[0].report.metrics
    assert reported["nll"] == round(reported["nll"], 2) and reported["nll"] != exact
    for name in ("nll", "brier"):  # the probability-weighted scores (ece, aurc and accuracy count right answers)
        assert {r.report.metrics[name] for r in runs} == {reported[name]}, name
    recovered = [sum(a == b for a, b in zip(_decode(reported["nll"], n, base, p), truth)) for p in patterns]
    assert recovered[0] + recovered[1] == 12  # one guess, read as a labelling and as its complement
    # 12 of 12 at full precision; now no better than a guess that reads nothing (the more common answer).
    assert recovered[0] <= max(truth.count(0), truth.count(1)), (recovered, truth)
    # Count aggregates keep their count (3 decimals at n ≈ 315: a step under 1/n), nothing finer.
    assert reported["accuracy"] == round(reported["accuracy"], 3)


# --------------------------------------------------------------------------- item 4: a caller's runner


class SpyRunner(VerifierRunner):
    """A caller's runner that keeps every label table it is handed."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[Any] = []

    def run(self, predictions: Any, labels: Any, **kw: Any) -> Any:
        self.seen.append(labels)
        return super().run(predictions, labels, **kw)


class SpySandbox(LocalSandbox):
    """A caller's sandbox that keeps the stdin (the label bytes) of every run."""

    def __init__(self) -> None:
        super().__init__()
        self.stdin: list[bytes] = []

    def run(self, argv: Any, call: SandboxCall | None = None) -> Any:
        self.stdin.append((call.stdin if call else None) or b"")
        return super().run(argv, call)


def test_hidden_labels_never_reach_a_callers_runner_or_sandbox(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LABEL_LOG)
    home = _home(tmp_path)
    path = write_predictions(tmp_path / "t.jsonl", oracle(read_hidden_labels(TASK, "test", home=home)))
    caplog.clear()
    spy, box = SpyRunner(), SpySandbox()
    ledger_before = (home / "loops" / TASK / "ledger.jsonl")
    for runner in (spy, VerifierRunner(sandbox=box)):
        for split in ("test", "holdout"):
            with pytest.raises(HiddenSplitQueryError, match=f"runner: {split} is scored only by the verifier's own"):
                verify_task(TASK, split, path, home=home, runner=runner, release=1 if split == "holdout" else None)
        with pytest.raises(HiddenSplitQueryError, match="runner: test is scored only"):
            DecisionEnvironment(TASK, "test", home=home, runner=runner)
    with pytest.raises(HiddenSplitQueryError, match="grader: test is scored only by a built-in grader"):
        verify_task(TASK, "test", path, home=home, kind="grader", grader="os:getcwd")
    assert spy.seen == [] and box.stdin == [] and label_reads(caplog) == 0
    assert not ledger_before.exists()  # a refusal writes nothing
    cli = CliRunner().invoke(sandbox_cli, ["verify", "--task", TASK, "--split", "test", "--predictions", str(path),
                                           "--home", str(home), "--backend", "docker", "--image", "spy:latest"])
    assert cli.exit_code == 2 and "--backend, --image: test is scored only in the sandbox the deployment" in cli.output
    # The verifier's own runner still scores test, and an open split still takes a caller's runner.
    assert verify_task(TASK, "test", path, home=home).ok
    from envloop_pipelines.core.data.snapshots import open_task

    dev = open_task(TASK, home=home).labels("dev")
    assert verify_task(TASK, "dev", write_predictions(tmp_path / "d.jsonl", oracle(dev)), home=home, runner=spy).ok
    assert len(spy.seen) == 1 and spy.seen[0].num_rows == dev.num_rows


# --------------------------------------------------------------------------- every test read is a ledger event


def test_every_test_read_is_a_ledger_event(tmp_path: Path) -> None:
    home = _home(tmp_path)
    labels = read_hidden_labels(TASK, "test", home=home)
    path = write_predictions(tmp_path / "t.jsonl", oracle(labels))
    partial = write_predictions(tmp_path / "p.jsonl", oracle(labels)[:1])
    runs = [verify_task(TASK, "test", p, home=home) for p in (path, path, partial)]
    assert [r.ok for r in runs] == [True, True, False]
    events = list(Ledger(TASK, home).events(EVENT_TEST_READ))
    # The same file read twice is one read (keyed by reader and sha256; test_gate_leftovers_test_reads.py).
    assert [e["status"] for e in events] == ["ok", "error"] and len({e["event_id"] for e in events}) == 2
    assert {e["reader"] for e in events} == {"adhoc"}
    from envloop_pipelines.core.storage import sha256_bytes

    assert events[0]["predictions_sha256"] == sha256_bytes(path.read_bytes()) and events[0]["split"] == "test"
    from envloop_pipelines.core.data.snapshots import open_task

    dev = write_predictions(tmp_path / "d.jsonl", oracle(open_task(TASK, home=home).labels("dev")))
    assert verify_task(TASK, "dev", dev, home=home).ok  # an open split: no event
    assert len(list(Ledger(TASK, home).events(EVENT_TEST_READ))) == 2
