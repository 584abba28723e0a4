"""A local run's uid and its processes: a fresh uid per run, and the sweep that leaves none of its processes alive.

RLIMIT_NPROC counts tasks per uid, so a uid nobody else uses makes the process limit exact and lets the parent
find every process the run started (a ``setsid`` escapee included) in ``/proc`` and kill it.
"""

from __future__ import annotations

import itertools
import os
import signal
import threading
import time

#: Fresh uids come from here: above the usual subuid ranges (100000 + 65536 * k for a few users).
DEFAULT_UID_RANGE: tuple[int, int] = (1_200_000, 1_000_000)
_uid_counter = itertools.count()
_uid_lock = threading.Lock()


def processes_of(uid: int) -> list[int]:
    """Live (non-zombie) processes whose real or effective uid is ``uid``."""
    out = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status", "rb") as fh:
                text = fh.read()
        except OSError:
            continue
        state = uids = None
        for line in text.split(b"\n"):
            if line.startswith(b"State:"):
                state = line.split()[1]
            elif line.startswith(b"Uid:"):
                uids = line.split()[1:3]
                break
        if uids and state != b"Z" and str(uid).encode() in uids:
            out.append(int(entry.name))
    return out


def is_the_command(pid: int) -> bool:
    """The run's command itself, in its own PID namespace: pid 2 there (pid 1 is the launcher's init)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as fh:
            for line in fh:
                if line.startswith(b"NSpid:"):
                    ids = line.split()[1:]
                    return len(ids) > 1 and ids[-1] == b"2"
    except OSError:
        pass
    return False


def kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def sweep_uid(uid: int, deadline_s: float = 5.0) -> set[int]:
    """SIGKILL every process of ``uid`` until none is left; returns the pids killed."""
    killed: set[int] = set()
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        pids = processes_of(uid)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except ProcessLookupError:
                pass
        time.sleep(0.01)
    return killed


def count_tasks_of_self() -> int:
    """Threads of every process of our uid: RLIMIT_NPROC counts tasks, not processes."""
    total = 0
    for pid in processes_of(os.getuid()):
        try:
            total += len(os.listdir(f"/proc/{pid}/task"))
        except OSError:
            continue
    return total


def allocate_uid(uid_range: tuple[int, int]) -> int:
    base, span = uid_range
    with _uid_lock:
        for _ in range(64):
            uid = base + (os.getpid() * 7919 + next(_uid_counter) * 104729) % span
            if not processes_of(uid):
                return uid
    raise RuntimeError(f"no free uid in [{base}, {base + span}) after 64 tries")


__all__ = ["DEFAULT_UID_RANGE", "allocate_uid", "count_tasks_of_self", "is_the_command", "kill_group",
           "processes_of", "sweep_uid"]
