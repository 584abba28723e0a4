"""Snapshots: content addressing, immutability, hidden labels, benchmark versions."""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from envloop_pipelines.core.data.datasets import import_file
from envloop_pipelines.core.data.errors import DataValidationError
from envloop_pipelines.core.data.snapshots import (
    BenchmarkMismatchError,
    HiddenSplitError,
    SnapshotIntegrityError,
    open_task,
    require_same_benchmark,
)
from envloop_pipelines.core.data.splits import OPEN_SPLITS, SPLITS
from envloop_pipelines.core.verify.labels import read_hidden_labels

from .test_records import good_record, write_lines


def dataset(tmp_path: Path, n_users: int = 30, name: str = "d.jsonl") -> Path:
    return write_lines(tmp_path / name, [good_record(f"r{u}-{k}", user=f"u{u}") for u in range(n_users) for k in range(2)])


def test_import_is_content_addressed_and_group_disjoint(tmp_path: Path) -> None:
    home = tmp_path / "home"
    snap = import_file(dataset(tmp_path), "tickets", home=home)
    again = import_file(dataset(tmp_path, name="copy.jsonl"), "tickets", home=home)
    assert snap.snapshot_id == again.snapshot_id  # same content → same snapshot
    assert len(list((home / "tasks" / "tickets" / "snapshots").iterdir())) == 1
    groups = {s: set(snap.table(s).column("group").to_pylist()) for s in SPLITS}
    for a, b in itertools.combinations(SPLITS, 2):
        assert not groups[a] & groups[b], (a, b)
    assert sum(m["records"] for m in snap.manifest.splits.values()) == 60
    snap.verify()
    other = import_file(dataset(tmp_path, n_users=31), "tickets", home=home)
    assert other.snapshot_id != snap.snapshot_id
    assert open_task("tickets", home=home).snapshot_id == other.snapshot_id  # current moved
    assert open_task("tickets", home=home, snapshot_id=snap.snapshot_id).snapshot_id == snap.snapshot_id


def test_hidden_labels_not_reachable_from_training_side(tmp_path: Path) -> None:
    home = tmp_path / "home"
    snap = import_file(dataset(tmp_path), "tickets", home=home)
    for split in ("test", "holdout"):
        table = snap.table(split)
        assert table.num_rows > 0
        assert "label" not in table.column_names and "soft_label" not in table.column_names
        with pytest.raises(HiddenSplitError, match="verifier only"):
            snap.labels(split)
    for split in OPEN_SPLITS:
        assert snap.labels(split).num_rows == snap.table(split).num_rows
    # No file under the task's snapshot directory carries a label column of a hidden split.
    for path in snap.path.glob("*.parquet"):
        if path.stem in ("test", "holdout"):
            assert "label" not in pq.read_schema(path).names
    # The verifier side reads them, checked against the manifest.
    labels = read_hidden_labels("tickets", "test", home=home)
    assert labels.num_rows == snap.table("test").num_rows
    assert labels.column("record_id").to_pylist() == snap.table("test").column("record_id").to_pylist()
    with pytest.raises(ValueError, match="not a hidden split"):
        read_hidden_labels("tickets", "train", home=home)


def test_tampering_is_detected(tmp_path: Path) -> None:
    home = tmp_path / "home"
    snap = import_file(dataset(tmp_path), "tickets", home=home)
    label_file = next((home / "verifier" / "tickets" / snap.snapshot_id).glob("test.labels.parquet"))
    os.chmod(label_file, 0o644)
    label_file.write_bytes(label_file.read_bytes() + b"x")
    with pytest.raises(SnapshotIntegrityError, match="test.labels.parquet"):
        read_hidden_labels("tickets", "test", home=home)
    train = snap.path / "train.parquet"
    os.chmod(train, 0o644)
    train.write_bytes(b"nope")
    with pytest.raises(SnapshotIntegrityError, match="train.parquet"):
        snap.verify()


def test_snapshot_files_are_read_only(tmp_path: Path) -> None:
    snap = import_file(dataset(tmp_path), "tickets", home=tmp_path / "home")
    for path in snap.path.iterdir():
        assert not os.stat(path).st_mode & 0o222, path


def test_bad_file_imports_nothing(tmp_path: Path) -> None:
    home = tmp_path / "home"
    bad = good_record("x", refund={"type": "noul", "instructions": "q", "label": "no"})
    path = write_lines(tmp_path / "bad.jsonl", [good_record("a"), bad])
    with pytest.raises(DataValidationError):
        import_file(path, "tickets", home=home)
    assert not (home / "tasks").exists() and not (home / "verifier").exists()


def test_declared_split_must_be_consistent_per_group(tmp_path: Path) -> None:
    a, b = good_record("a", user="u1"), good_record("b", user="u1")
    a["meta"]["split"], b["meta"]["split"] = "train", "test"
    with pytest.raises(DataValidationError, match="group-disjoint"):
        import_file(write_lines(tmp_path / "d.jsonl", [a, b]), "t", home=tmp_path / "home")


def test_results_from_different_versions_refuse_to_compare(tmp_path: Path) -> None:
    home = tmp_path / "home"
    v1 = import_file(dataset(tmp_path), "tickets", home=home).benchmark_version
    v2 = import_file(dataset(tmp_path, n_users=31), "tickets", home=home).benchmark_version
    assert require_same_benchmark(v1, v1) == v1
    with pytest.raises(BenchmarkMismatchError, match="never compared"):
        require_same_benchmark(v1, v2)


def test_summary_counts(tmp_path: Path) -> None:
    summary = import_file(dataset(tmp_path), "tickets", home=tmp_path / "home").summary()
    total = sum(s["questions"] for s in summary["splits"].values())
    assert total == 60 * 3
    assert sum(s["families"].get("route", 0) for s in summary["splits"].values()) == 60
    assert json.dumps(summary)  # JSON-safe
