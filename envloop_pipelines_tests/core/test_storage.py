"""Temp files and staging directories a killed writer leaves behind are swept; a live writer's are not.
Parquet is written in one encoding, atomically, and never over an existing file unless asked."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from envloop_pipelines.core.storage import (
    atomic_write_bytes,
    atomic_write_parquet,
    parquet_bytes,
    publish_dir,
    staging_dir,
    sweep_stale,
)

WRITER = textwrap.dedent("""
    import os, sys, time
    from envloop_pipelines.core.storage import staging_dir
    staged = staging_dir(sys.argv[1])
    (staged / "half.bin").write_bytes(b"x" * 1000)
    # a temp file of an atomic write, as if killed between write and rename
    fd = os.open(os.path.join(sys.argv[1], f".final.bin~{os.getpid()}~{os.uname().nodename}~abc.tmp"), os.O_CREAT | os.O_WRONLY)
    os.write(fd, b"partial"); os.close(fd)
    print(staged, flush=True)
    time.sleep(600)
""")


def test_a_killed_writers_leftovers_are_swept(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    staged = Path(proc.stdout.readline().strip())
    assert staged.is_dir() and staged.name.startswith(f".staging~{proc.pid}~{socket.gethostname()}~")
    assert sweep_stale(tmp_path) == []  # the writer is alive: nothing of it is touched
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    other_host = tmp_path / ".staging~1~some-other-host~xyz"
    other_host.mkdir()
    (tmp_path / "final.bin").write_bytes(b"published")
    removed = sorted(p.name for p in sweep_stale(tmp_path))
    assert len(removed) == 2 and removed[1] == staged.name and removed[0].endswith(".tmp")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".staging~1~some-other-host~xyz", "final.bin"]


def test_staging_sweeps_first_and_own_files_survive(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".staging~{dead.pid}~{socket.gethostname()}~old"
    stale.mkdir()
    fresh = staging_dir(tmp_path)
    assert not stale.exists() and fresh.exists() and f"~{os.getpid()}~" in fresh.name
    (fresh / "a").write_text("a")
    assert publish_dir(fresh, tmp_path / "done") and (tmp_path / "done" / "a").read_text() == "a"
    atomic_write_bytes(tmp_path / "x.bin", b"1")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["done", "x.bin"]


# --------------------------------------------------------------------------- Parquet

TABLE = pa.table({"record_id": ["r1", "r2", "r2"], "probs": [[0.25, 0.75], [1.0, 0.0], [0.5, 0.5]], "n": [1, 2, 3]})


def test_parquet_bytes_are_the_snapshot_encoding_and_repeat(tmp_path: Path) -> None:
    """Data snapshots are addressed by the sha256 of these bytes: the encoding must stay the one they used."""
    sink = pa.BufferOutputStream()
    pq.write_table(TABLE, sink, compression="zstd", use_dictionary=True, write_statistics=False)
    assert parquet_bytes(TABLE) == parquet_bytes(TABLE.slice(0)) == sink.getvalue().to_pybytes()
    path = atomic_write_parquet(tmp_path / "t.parquet", TABLE)
    column = pq.ParquetFile(path).metadata.row_group(0).column(0)
    assert column.compression == "ZSTD" and not column.is_stats_set


def test_atomic_write_parquet_writes_the_table_and_leaves_no_temp_file(tmp_path: Path) -> None:
    path = atomic_write_parquet(tmp_path / "nested" / "t.parquet", TABLE)
    assert path == tmp_path / "nested" / "t.parquet"
    assert pq.read_table(path).equals(TABLE)
    assert path.read_bytes() == parquet_bytes(TABLE)
    assert [p.name for p in path.parent.iterdir()] == ["t.parquet"]


def test_atomic_write_parquet_refuses_to_overwrite_unless_asked(tmp_path: Path) -> None:
    path = atomic_write_parquet(tmp_path / "t.parquet", TABLE)
    smaller = TABLE.slice(0, 1)
    with pytest.raises(FileExistsError, match="never overwritten"):
        atomic_write_parquet(path, smaller)
    assert pq.read_table(path).num_rows == 3  # untouched
    atomic_write_parquet(path, smaller, overwrite=True)
    assert pq.read_table(path).num_rows == 1
    assert [p.name for p in tmp_path.iterdir()] == ["t.parquet"]


def test_a_failed_parquet_write_leaves_neither_the_file_nor_a_temp_file(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    def no_rename(src: str, dst: str) -> None:
        raise OSError("disk gone")

    monkeypatch.setattr(os, "replace", no_rename)
    with pytest.raises(OSError, match="disk gone"):
        atomic_write_parquet(tmp_path / "t.parquet", TABLE)
    assert list(tmp_path.iterdir()) == []
