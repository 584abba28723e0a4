"""Task snapshots: immutable, content-addressed, split, with hidden labels apart.

Layout under the EnvLoop home::

    tasks/<task>/current                         the snapshot id in use
    tasks/<task>/snapshots/<id>/manifest.json    version, splits, per-file sha256
    tasks/<task>/snapshots/<id>/train.parquet    questions with labels (also val, dev)
    tasks/<task>/snapshots/<id>/test.parquet     questions WITHOUT labels (also holdout)
    verifier/<task>/<id>/test.labels.parquet     labels of test and holdout, read by the verifier only
                                                 (owner-only: files 0400, folders 0700)

The training side opens a snapshot with :func:`open_task` (a round's step with :func:`open_pinned_task`,
once, handing the snapshot to the core functions it calls); it can read the
labels of train, val and dev and the inputs of test and holdout, never their
labels. The verifier reads hidden labels through
:mod:`envloop_pipelines.core.verify.labels`, a module private to ``core/verify/``.
"""

from __future__ import annotations

import json
import logging
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from envloop_pipelines.core.data.errors import DataValidationError, FieldError
from envloop_pipelines.core.data.question_table import INPUT_SCHEMA, LABEL_COLUMNS, questions_table
from envloop_pipelines.core.data.records import DEFAULT_GROUP_KEY, Record, declared_splits
from envloop_pipelines.core.data.splits import HIDDEN_SPLITS, OPEN_SPLITS, SPLITS, SplitFractions, assign_splits
from envloop_pipelines.core.storage import (
    atomic_write_bytes,
    atomic_write_json,
    canonical_json,
    envloop_home,
    make_read_only,
    parquet_bytes,
    publish_dir,
    sha256_bytes,
    sha256_file,
    staging_dir,
)

log = logging.getLogger(__name__)

MANIFEST_VERSION = 1
#: Columns the verifier needs beside the labels to score a prediction file.
HIDDEN_LABEL_COLUMNS: tuple[str, ...] = ("record_id", "question_id", "family", "type", "option_keys", *LABEL_COLUMNS)


class HiddenSplitError(PermissionError):
    """The training side asked for labels of a split only the verifier may read."""


class BenchmarkMismatchError(ValueError):
    """Two results from different benchmark versions were about to be compared."""


class SnapshotIntegrityError(RuntimeError):
    """A snapshot file no longer matches the hash in its manifest."""


@dataclass(frozen=True)
class SnapshotManifest:
    """What a snapshot holds, with the hash of every file."""

    task: str
    snapshot_id: str
    benchmark_version: str
    group_key: str
    fractions: Mapping[str, float]
    seed: int
    source: Mapping[str, Any]
    splits: Mapping[str, Mapping[str, Any]]
    hidden_labels: Mapping[str, Mapping[str, Any]]
    manifest_version: int = MANIFEST_VERSION
    extra: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "task": self.task,
            "snapshot_id": self.snapshot_id,
            "benchmark_version": self.benchmark_version,
            "group_key": self.group_key,
            "fractions": dict(self.fractions),
            "seed": self.seed,
            "source": dict(self.source),
            "splits": {k: dict(v) for k, v in self.splits.items()},
            "hidden_labels": {k: dict(v) for k, v in self.hidden_labels.items()},
            "manifest_version": self.manifest_version,
            "extra": dict(self.extra),
        }

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "SnapshotManifest":
        return cls(**{k: raw[k] for k in (
            "task", "snapshot_id", "benchmark_version", "group_key", "fractions", "seed", "source",
            "splits", "hidden_labels", "manifest_version",
        )}, extra=raw.get("extra", {}))


def task_dir(task: str, home: str | Path | None = None) -> Path:
    if not task or "/" in task or task.startswith("."):
        raise ValueError(f"task name {task!r} must be a non-empty name without '/' that does not start with '.'")
    return envloop_home(home) / "tasks" / task


def hidden_labels_dir(task: str, snapshot_id: str, home: str | Path | None = None) -> Path:
    return envloop_home(home) / "verifier" / task / snapshot_id


#: The label store is owner-only: the loop's uid (whose verifier parent reads the files and pipes them to the
#: worker) may read them; the sandbox's fresh uids, a server or trainer running as another account, and every
#: other user may not, even where no mount namespace masks the folder (threat model: core/sandbox/local.py).
HIDDEN_LABEL_FILE_MODE = 0o400
HIDDEN_LABEL_DIR_MODE = 0o700


def restrict_hidden_labels(folder: Path, home: str | Path | None = None) -> None:
    """Make a snapshot's label folder owner-only: its files 0400, it and its parents up to ``<home>/verifier`` 0700.

    Called when labels are written and when they are read, so a label store written before
    (world-readable 0444 files) is narrowed the first time the verifier reads it.
    """
    root = (envloop_home(home) / "verifier").resolve()
    folder = folder.resolve()
    if root != folder and root not in folder.parents:
        raise ValueError(f"{folder} is not under the label store {root}")

    def narrow(path: Path, mode: int) -> None:
        st = path.lstat()
        if st.st_mode & 0o777 == mode:
            return
        try:
            path.chmod(mode)
        except OSError as exc:  # another user's store, a read-only mount: say so, never fail the read for it
            log.warning("cannot make %s owner-only (mode %o, owner uid %d): %s", path, st.st_mode & 0o777, st.st_uid, exc)

    for path in folder.iterdir():
        if path.is_file() and not path.is_symlink():
            narrow(path, HIDDEN_LABEL_FILE_MODE)
    current = folder
    while True:
        narrow(current, HIDDEN_LABEL_DIR_MODE)
        if current == root:
            break
        current = current.parent


def create_snapshot(
    records: Sequence[Record],
    task: str,
    *,
    source: Mapping[str, Any],
    fractions: SplitFractions = SplitFractions(),
    seed: int = 0,
    group_key: str = DEFAULT_GROUP_KEY,
    home: str | Path | None = None,
    extra: Mapping[str, Any] | None = None,
) -> "TaskSnapshot":
    """Split ``records`` by group and write an immutable, content-addressed snapshot.

    Either the whole snapshot (inputs, hidden labels, manifest, then the task's
    ``current`` pointer) is published or nothing is: every directory is written
    in a staging place and renamed into position.

    Args:
        records: validated records, each with a group (``meta.<group_key>``).
        task: the task name.
        source: provenance of the input (path, sha256, format).
        fractions: share of groups per split.
        seed: split seed.
        group_key: the meta key splits are disjoint on.
        home: the EnvLoop home (default: ``$ENVLOOP_HOME`` or ``./.envloop``).
        extra: more provenance to keep in the manifest (for example the generator config).
    """
    missing = [FieldError(str(source.get("path", "<records>")), None, f"meta.{group_key}", f"record {r.id!r} has no group key")
               for r in records if not r.group]
    if missing:
        raise DataValidationError(missing)
    assignment = assign_splits(
        (r.group for r in records), fractions, seed, declared=declared_splits(records, str(source.get("path", "<records>")))
    )
    by_split: dict[str, list[Record]] = defaultdict(list)
    for record in records:
        by_split[assignment[record.group]].append(record)  # type: ignore[index]

    open_files: dict[str, bytes] = {}
    label_files: dict[str, bytes] = {}
    splits_meta: dict[str, dict[str, Any]] = {}
    labels_meta: dict[str, dict[str, Any]] = {}
    for split in SPLITS:
        table = questions_table(sorted(by_split.get(split, []), key=lambda r: r.id))
        counts = {
            "records": len(by_split.get(split, [])),
            "questions": table.num_rows,
            "groups": len({r.group for r in by_split.get(split, [])}),
        }
        if split in HIDDEN_SPLITS:
            inputs = table.select(INPUT_SCHEMA.names)
            labels = table.select(list(HIDDEN_LABEL_COLUMNS))
            open_files[split] = parquet_bytes(inputs)
            label_files[split] = parquet_bytes(labels)
            labels_meta[split] = {"file": f"{split}.labels.parquet", "sha256": sha256_bytes(label_files[split])}
        else:
            open_files[split] = parquet_bytes(table)
        splits_meta[split] = {"file": f"{split}.parquet", "sha256": sha256_bytes(open_files[split]), **counts}

    content = {
        "splits": {s: m["sha256"] for s, m in splits_meta.items()},
        "hidden_labels": {s: m["sha256"] for s, m in labels_meta.items()},
        "group_key": group_key,
    }
    snapshot_id = sha256_bytes(canonical_json(content))
    manifest = SnapshotManifest(
        task=task,
        snapshot_id=snapshot_id,
        benchmark_version=f"{task}@{snapshot_id[:12]}",
        group_key=group_key,
        fractions=fractions.as_dict(),
        seed=seed,
        source=dict(source),
        splits=splits_meta,
        hidden_labels=labels_meta,
        extra=dict(extra or {}),
    )

    # Hidden labels first: a snapshot is never visible without its labels. Owner-only from the start.
    labels_final = hidden_labels_dir(task, snapshot_id, home)
    if not labels_final.exists():
        staged = staging_dir(labels_final.parent)
        for split, data in label_files.items():
            atomic_write_bytes(staged / f"{split}.labels.parquet", data)
        publish_dir(staged, labels_final)
    restrict_hidden_labels(labels_final, home)

    snapshots = task_dir(task, home) / "snapshots"
    final = snapshots / snapshot_id
    if not final.exists():
        staged = staging_dir(snapshots)
        for split, data in open_files.items():
            atomic_write_bytes(staged / f"{split}.parquet", data)
        atomic_write_json(staged / "manifest.json", manifest.to_dict())
        make_read_only(staged)
        publish_dir(staged, final)
    atomic_write_bytes(task_dir(task, home) / "current", (snapshot_id + "\n").encode(), overwrite=True)
    return TaskSnapshot(final)


@dataclass(frozen=True)
class TaskSnapshot:
    """The training-side view of a snapshot: open splits with labels, hidden splits without."""

    path: Path

    @property
    def manifest(self) -> SnapshotManifest:
        return SnapshotManifest.from_dict(json.loads((self.path / "manifest.json").read_text(encoding="utf-8")))

    @property
    def snapshot_id(self) -> str:
        return self.path.name

    @property
    def benchmark_version(self) -> str:
        return self.manifest.benchmark_version

    def table(self, split: str) -> pa.Table:
        """The questions of ``split``; test and holdout come without label columns."""
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; allowed: {', '.join(SPLITS)}")
        return pq.read_table(self.path / f"{split}.parquet")

    def labels(self, split: str) -> pa.Table:
        """Labels of an open split; hidden splits raise :class:`HiddenSplitError`."""
        if split in HIDDEN_SPLITS:
            raise HiddenSplitError(
                f"labels of {split!r} are read by the verifier only, which answers with aggregate scores "
                f"(envloop_pipelines.core.verify.runner.verify_task); "
                f"training-side code may read {', '.join(OPEN_SPLITS)}"
            )
        return self.table(split).select(list(HIDDEN_LABEL_COLUMNS))

    def verify(self) -> None:
        """Recompute every file's sha256 against the manifest."""
        for split, meta in self.manifest.splits.items():
            path = self.path / meta["file"]
            if not path.exists() or sha256_file(path) != meta["sha256"]:
                raise SnapshotIntegrityError(f"{path}: missing or sha256 differs from the manifest ({split})")

    def summary(self) -> dict[str, Any]:
        """Counts per split, family and question type."""
        out: dict[str, Any] = {"task": self.manifest.task, "snapshot_id": self.snapshot_id,
                               "benchmark_version": self.benchmark_version, "splits": {}}
        for split in SPLITS:
            table = self.table(split).select(["family", "type"])
            meta = self.manifest.splits[split]
            out["splits"][split] = {
                "records": meta["records"],
                "questions": meta["questions"],
                "groups": meta["groups"],
                "families": dict(sorted(Counter(table.column("family").to_pylist()).items())),
                "types": dict(sorted(Counter(table.column("type").to_pylist()).items())),
            }
        return out


def open_task(task: str, *, snapshot_id: str | None = None, home: str | Path | None = None) -> TaskSnapshot:
    """Open the task's current snapshot (or a given one)."""
    root = task_dir(task, home)
    if snapshot_id is None:
        pointer = root / "current"
        if not pointer.exists():
            raise FileNotFoundError(
                f"task {task!r} has no snapshot under {root}; run `envloop data import FILE --task {task}` "
                f"or `envloop data generate`"
            )
        snapshot_id = pointer.read_text().strip()
    path = root / "snapshots" / snapshot_id
    if not (path / "manifest.json").exists():
        raise FileNotFoundError(f"snapshot {snapshot_id} of task {task!r} not found under {root / 'snapshots'}")
    return TaskSnapshot(path)


def require_same_benchmark(*versions: str, task: str | None = None, why: str = "") -> str:
    """Refuse to compare results from different benchmark versions.

    Args:
        versions: the benchmark versions the results come from.
        task: the task, named in the error when given.
        why: what the versions are, added to the error.

    Returns the common version.
    """
    distinct = sorted(set(versions))
    if len(distinct) != 1:
        raise BenchmarkMismatchError(
            (f"task {task!r}: " if task else "")
            + f"results come from different benchmark versions {distinct}; they are never compared"
            + (f" ({why})" if why else "")
        )
    return distinct[0]


def open_pinned_task(task: str, benchmark_version: str, *, home: str | Path | None = None) -> TaskSnapshot:
    """The task's current snapshot, refused unless it is ``benchmark_version`` (the version a round pinned).

    A step of a round opens the task once with this and hands the snapshot to the core functions it
    calls: a task re-imported after ``task_benchmark`` pinned its version is refused, never read.

    Raises:
        BenchmarkMismatchError: the current snapshot is another benchmark version; the error names the task
            and both versions.
        FileNotFoundError: the task has no snapshot.
    """
    snapshot = open_task(task, home=home)
    current = snapshot.benchmark_version
    require_same_benchmark(benchmark_version, current, task=task,
                           why=f"task_benchmark pinned {benchmark_version}, the task's current snapshot is {current}: "
                               f"it was re-imported since; materialize task_benchmark and noise_floor again "
                               f"(setup_job) before a round reads it")
    return snapshot
