"""Issue 23, "labels never leave the verifier": a budget on the reads of ``test``.

Every ``test`` read is a ``test_read`` event naming its reader; a round (``round:<key>``) reads at most its
candidate, its champion and the TF-IDF baseline, the loop's setup (``setup:<noise floor key>``) its null
arms, continuation arms and TF-IDF baseline; beyond that a read is refused before any label is read, and
nothing is appended. A person's read (``adhoc``) stays allowed and logged. The first tests use the real
verifier on an imported task with hand-written predictions; the last one runs the loop's own setup and
round (``measure_noise_floor``, ``reevaluate``) on tiny real checkpoints.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from typing import Any

import pytest

from envloop_pipelines.core.ledger.event_log import EVENT_TEST_READ
from envloop_pipelines.core.ledger.ledger import Ledger
from envloop_pipelines.core.ledger.reads import ROUND_TEST_READ_BUDGET, TestReadBudgetError, reader_budget
from envloop_pipelines.core.storage import sha256_file
from envloop_pipelines.core.verify.labels import read_hidden_labels
from envloop_pipelines.core.verify.protocol import write_predictions
from envloop_pipelines.core.verify.runner import verify_task

from .test_verifier_doors import LABEL_LOG, TASK, _home, label_reads, oracle


def _variants(tmp_path: Path, home: Path, n: int) -> list[Path]:
    """``n`` complete predictions files on test, each a different file (its confidence differs)."""
    rows = oracle(read_hidden_labels(TASK, "test", home=home))
    out = []
    for i in range(n):
        p = 0.9 - 0.05 * i
        variant = [{**r, "probs": [p if q == max(r["probs"]) else (1 - p) / (len(r["probs"]) - 1) for q in r["probs"]]}
                   for r in rows]
        out.append(write_predictions(tmp_path / f"v{i}.jsonl", variant))
    return out


def trained_round(home: Path, key: str = "r0001") -> None:
    """Round ``key`` registered and its candidate trained: its own re-evaluation may read test (issue 34)."""
    from envloop_pipelines.core.ledger.event_log import EVENT_CHECKPOINT_TRAINED
    from envloop_pipelines.core.ledger.hypothesis import Gate, Hypothesis

    from .measured_power import measured_power

    ledger = Ledger(TASK, home)
    ledger.register_hypothesis(Hypothesis(task=TASK, round=key, benchmark_version="b", change={"kind": "data"},
                                          predicted_delta=0.01, gate=Gate(), seeds=(1,), recipe_hash="h",
                                          power=measured_power(0.01)))
    ledger.append(EVENT_CHECKPOINT_TRAINED, {"round": key, "checkpoint_sha256": f"c-{key}", "seed": 1},
                  key=f"arm:{key}:c-{key}")


def _events(home: Path) -> list[dict[str, Any]]:
    return list(Ledger(TASK, home).events(EVENT_TEST_READ))


def test_a_round_reads_three_files_and_a_fourth_is_refused_before_any_label_is_read(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    home = _home(tmp_path)
    candidate, champion, tfidf, fourth = _variants(tmp_path, home, 4)
    trained_round(home)
    reader = "round:r0001"
    # The round's own reads: the candidate paired with its champion, then the TF-IDF baseline.
    assert verify_task(TASK, "test", candidate, home=home, reader=reader, baseline_predictions=champion).ok
    assert verify_task(TASK, "test", tfidf, home=home, reader=reader).ok
    assert Ledger(TASK, home).test_files_read(reader) == {
        sha256_file(candidate): str(candidate), sha256_file(champion): str(champion), sha256_file(tfidf): str(tfidf)}
    events = _events(home)
    assert [e["reader"] for e in events] == [reader, reader] and events[0]["baseline_sha256"] == sha256_file(champion)

    # A retry of the same read is allowed, and is not a new event nor counted twice.
    assert verify_task(TASK, "test", candidate, home=home, reader=reader, baseline_predictions=champion).ok
    assert _events(home) == events

    # A fourth distinct file: refused before the labels are read; the ledger is byte for byte unchanged.
    ledger_bytes = Ledger(TASK, home).events_path.read_bytes()
    caplog.set_level(logging.INFO, logger=LABEL_LOG)
    caplog.clear()
    with pytest.raises(TestReadBudgetError) as refused:
        verify_task(TASK, "test", fourth, home=home, reader=reader)
    message = str(refused.value)
    assert isinstance(refused.value, PermissionError)
    assert "'round:r0001'" in message and f"budget is {ROUND_TEST_READ_BUDGET} distinct predictions files" in message
    assert "it has read 3" in message and candidate.name in message and tfidf.name in message
    assert fourth.name in message and "before any label is read" in message
    assert label_reads(caplog) == 0
    assert Ledger(TASK, home).events_path.read_bytes() == ledger_bytes
    # Nor may a known file bring a new one in as its baseline.
    with pytest.raises(TestReadBudgetError):
        verify_task(TASK, "test", candidate, home=home, reader=reader, baseline_predictions=fourth)
    assert Ledger(TASK, home).events_path.read_bytes() == ledger_bytes

    # Another round has its own budget; a person's read is not limited, and logged as adhoc.
    trained_round(home, "r0002")
    assert verify_task(TASK, "test", fourth, home=home, reader="round:r0002").ok
    for _ in range(2):
        assert verify_task(TASK, "test", fourth, home=home).ok
    adhoc = [e for e in _events(home) if e["reader"] == "adhoc"]
    assert len(adhoc) == 1 and adhoc[0]["predictions_sha256"] == sha256_file(fourth)


def test_a_gate_amendment_gives_the_round_one_more_read_for_its_fresh_seed_candidate(tmp_path: Path) -> None:
    """Rule 3 trains the candidate again on the amendment's fresh seeds; its re-evaluation reads that new file."""
    from envloop_pipelines.core.ledger.hypothesis import Gate, Hypothesis

    from .measured_power import measured_power

    home = _home(tmp_path)
    candidate, champion, tfidf, fresh, extra = _variants(tmp_path, home, 5)
    ledger = Ledger(TASK, home)
    ledger.register_hypothesis(Hypothesis(task=TASK, round="r0001", benchmark_version="b", change={"kind": "data"},
                                          predicted_delta=0.01, gate=Gate(), seeds=(1,), recipe_hash="h",
                                          power=measured_power(0.01)))
    trained_round(home)
    reader = "round:r0001"
    assert verify_task(TASK, "test", candidate, home=home, reader=reader, baseline_predictions=champion).ok
    assert verify_task(TASK, "test", tfidf, home=home, reader=reader).ok
    with pytest.raises(TestReadBudgetError):
        verify_task(TASK, "test", fresh, home=home, reader=reader, baseline_predictions=champion)
    ledger.amend_gate("r0001", Gate(min_delta=0.02), "a stricter bar")
    assert verify_task(TASK, "test", fresh, home=home, reader=reader, baseline_predictions=champion).ok
    with pytest.raises(TestReadBudgetError, match="budget is 4 .*for each of its 1 gate amendments"):
        verify_task(TASK, "test", extra, home=home, reader=reader)


def test_a_failed_read_is_logged_with_its_status_and_its_retry_beside_it(tmp_path: Path) -> None:
    home = _home(tmp_path)
    [good] = _variants(tmp_path, home, 1)
    partial = write_predictions(tmp_path / "p.jsonl", oracle(read_hidden_labels(TASK, "test", home=home))[:1])
    reader = "setup:abc"
    assert not verify_task(TASK, "test", partial, home=home, reader=reader, read_budget=2).ok
    assert not verify_task(TASK, "test", partial, home=home, reader=reader, read_budget=2).ok  # retried: one event
    assert verify_task(TASK, "test", good, home=home, reader=reader, read_budget=2).ok
    assert [(e["reader"], e["status"]) for e in _events(home)] == [(reader, "error"), (reader, "ok")]
    with pytest.raises(TestReadBudgetError, match="'setup:abc'.*budget is 2"):
        verify_task(TASK, "test", write_predictions(tmp_path / "x.jsonl", oracle(
            read_hidden_labels(TASK, "test", home=home))), home=home, reader=reader, read_budget=2)


def test_readers_and_budgets_are_checked() -> None:
    assert reader_budget("adhoc") is None
    assert reader_budget("round:r0007") == ROUND_TEST_READ_BUDGET == 3
    assert reader_budget("setup:k", 6) == 6
    assert reader_budget("floor:k", 1) == 1  # a champion's lineage floor: its K - 1 lineage arms (issue 45)
    for reader, budget, field in (("round:r0001", 10, "read_budget"), ("setup:k", None, "read_budget"),
                                  ("floor:k", None, "read_budget"), ("floor:", 1, "reader"),
                                  ("setup:k", 0, "read_budget"), ("adhoc", 3, "read_budget"),
                                  ("me", None, "reader"), ("round:", None, "reader"), (None, None, "reader")):
        with pytest.raises(ValueError, match=f"^{field}:"):
            reader_budget(reader, budget)


def test_an_unknown_reader_is_refused_before_the_verifier_runs(tmp_path: Path) -> None:
    home = _home(tmp_path)
    [path] = _variants(tmp_path, home, 1)
    with pytest.raises(ValueError, match="reader: must be"):
        verify_task(TASK, "test", path, home=home, reader="someone")
    assert _events(home) == []


@pytest.mark.slow  # four checkpoints of one optimizer step each, ~1 min on 2 cores
def test_the_loops_own_setup_and_round_read_test_within_their_budgets(tmp_path: Path) -> None:
    """The real setup (null arms, release 1, continuation arm, its paired noise) and a round's re-evaluation, on
    checkpoints of two optimizer steps: every read names its reader and stays within its budget; a retry of the
    round's re-evaluation reads nothing new; one more file for the round is refused."""
    from envloop_pipelines.core.data.datasets import import_file
    from envloop_pipelines.core.data.snapshots import open_task
    from envloop_pipelines.core.decision_loop.independent_reeval import reevaluate
    from envloop_pipelines.core.decision_loop.training_dataset_snapshot import snapshot_rows
    from envloop_pipelines.core.decision_loop.lora_checkpoint import train_into_store
    from envloop_pipelines.core.loop.config import LoopConfig
    from envloop_pipelines.core.decision_loop.step_records import TrainedCheckpoint
    from envloop_pipelines.core.release.tracked_runs import verify_predictions
    from envloop_pipelines.core.decision_loop.noise_floor import continuation_path, measure_noise_floor, setup_reader
    from envloop_pipelines.core.decision_loop.registered_hypothesis import paired_noise
    from envloop_pipelines.core.decision_loop.training_dataset_snapshot import checked_training_snapshot
    from envloop_pipelines.core.ledger.store import RoundStore
    from envloop_pipelines.core.decision_loop.synthesis import SNAPSHOT_SCHEMA
    from envloop_pipelines.core.tracking import MlflowTracker

    from .data.test_records import good_record, write_lines

    home = tmp_path / "home"
    rng = random.Random(0)
    records = []
    for u in range(30):  # states far apart (no shared 13-gram), so the contamination check keeps every train row
        for k in range(2):
            records.append({**good_record(f"r{u}-{k}", user=f"u{u}"),
                            "state": " ".join(f"w{rng.randrange(10**6)}" for _ in range(16))})
    import_file(write_lines(tmp_path / "d.jsonl", records), TASK, home=home)
    config = LoopConfig(task=TASK, home=str(home), noise_arms=2, safety_families=(),
                        recipe_overrides={"max_steps": 1, "max_length": 64, "warmup_ratio": 0.0})
    tracker = MlflowTracker(home=home)
    ledger = Ledger(TASK, home)

    task = open_task(TASK, home=home)
    measured = measure_noise_floor(config, task, tracker)  # null arms, release 1 (the control arm), continuation arm
    assert paired_noise(config, task) is not None  # the continuation arm paired with the control: the setup's read
    setup = setup_reader(config, measured.floor.key)
    assert setup == {"reader": f"setup:{measured.floor.key}", "read_budget": 2 + 1 + 1}
    arms = [a["test_predictions"] for a in measured.floor.arms]
    [continuation] = [a["test_predictions"] for a in json.loads(
        continuation_path(RoundStore(TASK, home), measured.floor.key).read_text())["arms"]]
    setup_read = ledger.test_files_read(setup["reader"])
    # The null arms, the continuation arm, the TF-IDF baseline (two files with equal bytes are one file).
    assert set(setup_read.values()) <= {*arms, continuation, str(RoundStore(TASK, home).noise / "tfidf-test.parquet")}
    assert len(setup_read) <= setup["read_budget"]
    paired = [e for e in ledger.events(EVENT_TEST_READ) if e["reader"] == setup["reader"] and e["baseline"]]
    assert [(e["predictions"], e["baseline"]) for e in paired] == [(continuation, arms[0])]  # vs the control arm

    snapshot = checked_training_snapshot(config, task, SNAPSHOT_SCHEMA.empty_table(), round="r0001")
    control = Path(measured.floor.arms[0]["checkpoint"])
    recipe = config.load_recipe().replace(seed=1001)
    ckpt = train_into_store(RoundStore(TASK, home), snapshot_rows(snapshot), task.table("val"), recipe,
                            data_hash=snapshot.sha256, init_from=control)
    candidate = TrainedCheckpoint(round="r0001", checkpoint=str(ckpt), checkpoint_sha256=ckpt.name,
                                  init_from=control.name, snapshot_sha256=snapshot.sha256, seed=1001, train_s=0.0,
                                  metrics={}, mlflow_run_id="", mlflow_url="", hypothesis_hash="h")
    trained_round(home)
    reevaluate(config, task, candidate, snapshot, tracker)
    read = ledger.test_files_read("round:r0001")
    assert len(read) == ROUND_TEST_READ_BUDGET  # its candidate, its champion, the TF-IDF baseline
    assert {e["reader"] for e in ledger.events(EVENT_TEST_READ)} == {setup["reader"], "round:r0001"}  # no adhoc read
    before = list(ledger.events(EVENT_TEST_READ))
    reevaluate(config, task, candidate, snapshot, tracker)  # a retry of the step: the same reads, nothing new
    assert ledger.test_files_read("round:r0001") == read and list(ledger.events(EVENT_TEST_READ)) == before
    with pytest.raises(TestReadBudgetError, match="'round:r0001'"):  # a null arm's file is not the round's to read
        verify_predictions(config, "test", Path(measured.floor.arms[1]["test_predictions"]), reader="round:r0001")
