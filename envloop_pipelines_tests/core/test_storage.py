"""Temp files and staging directories a killed writer leaves behind are swept; a live writer's are not."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

from envloop_pipelines.core.storage import atomic_write_bytes, publish_dir, staging_dir, sweep_stale

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
