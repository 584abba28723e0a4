"""The local sandbox: a fresh, limited, isolated process on this machine.

Threat model
============

The sandbox runs code we do not trust: a candidate's shell answer, a verifier
worker parsing a predictions file a candidate wrote, a check script fed the
state a candidate left. It must keep that code from reading the hidden labels,
from planting a reward, from reaching the network, and from taking the machine
down with it.

Covered (when the host allows it; every run reports what it got):

* **A fresh process** per run, ``start_new_session`` (its own session and
  process group), with a **scrubbed environment** (PATH, HOME/TMPDIR in the
  working directory, locale, thread counts; nothing of the caller's, so no
  tokens or ``MLFLOW_TRACKING_URI`` leak in) and a **temporary working
  directory** (or the caller's state directory for terminal-state checks).
* **rlimits** set before ``exec``: address space (RLIMIT_AS), CPU seconds
  (RLIMIT_CPU: SIGXCPU, SIGKILL a second later), file size (RLIMIT_FSIZE),
  open files (RLIMIT_NOFILE), processes (RLIMIT_NPROC) and no core files.
* **A wall-clock limit** that kills the whole process group and then every
  process of the run's uid, so a child that called ``setsid`` to leave the
  group dies too; the same sweep runs after a normal exit, so background jobs
  never outlive the run (``processes_killed`` counts them).
* **A fresh uid per run** (when we are root): the command runs as an
  unprivileged uid nobody else uses (``setresuid``/``setresgid``, no
  supplementary groups, ``PR_SET_NO_NEW_PRIVS`` so set-uid binaries gain
  nothing). RLIMIT_NPROC counts processes per uid, so a fresh uid makes the
  process limit exact and the cleanup sweep precise; the uid owns only the
  working directory.
* **No network**: a new network namespace (``unshare(CLONE_NEWNET)``) holding
  only a loopback interface that is down, so connect, DNS and even
  ``127.0.0.1`` (the MLflow server, the Dagster daemon) fail. Where the host
  refuses the namespace (EPERM in an unprivileged container) the result says
  ``network_isolated: false``; nothing pretends.
* **Hidden files**: a new mount namespace (private propagation, so nothing
  leaks back to the host) mounts an empty, read-only, mode-000 tmpfs over each
  hidden path (by default ``<ENVLOOP_HOME>/verifier``, where the test and
  holdout labels live) and a private tmpfs over ``/tmp``, ``/var/tmp``,
  ``/dev/shm`` and ``/run/lock`` (only the working directory and the
  interpreter's paths are bound back in), so nothing a run writes outlives it
  there or is seen by another run. Paths a caller *conceals* (an episode: the
  source checkout and the EnvLoop home) become an empty read-only tmpfs with
  only the interpreter's paths and the working directory bound back. Directories the
  interpreter needs that are not world-traversable (a pyenv Python under
  ``/root``) are exposed the same way: a tmpfs over the ancestor with only the
  needed paths bound back, which also hides the rest of ``/root``.
* **Its own processes** (a PID namespace, where the host allows it): the launcher forks pid 1 of a new
  namespace, which mounts its own ``/proc`` and starts the command as pid 2; ``ps`` lists the run's
  processes only (pid 1 shows as ``envloop-sandbox ... /dev/fd/N``: the spec comes in the environment, the
  launcher's script through a descriptor, so no host path is in its command line), and when the command
  ends pid 1 exits and the kernel kills every process left in the namespace (``processes_killed`` counts
  them). ``HostSupport.pid_namespace`` says whether the host allowed it.
* **No host path in the mount table** for a command shown at the task's own paths (``binds``, a Harbor
  task's ``/app``): its working directory is not bound back at its host path (it is concealed), the host's
  mounts below the private temp dirs and concealed paths (another attempt's folder) are detached before
  the overlays cover them, and an episode's folder is a tmpfs of its own (:func:`mount_scratch`), so
  ``/proc/self/mountinfo`` shows ``/work`` as the source of ``/app``. The interpreter's paths, bound back,
  are still listed.
* **Owner-only label files**, a second lock under the mask: the label store
  is written owner-only by :mod:`envloop_pipelines.core.data.snapshots`
  (files 0400, folders 0700 from ``<home>/verifier`` down; a store written
  before, with 0444 files, is narrowed on the verifier's next read), so the
  run's fresh uid cannot open a label file even where the host refuses the
  mount namespace, and neither can a server or trainer running as another
  user, nor any other account on the machine.
* **One door to the labels**: only ``core/verify/`` reads them (a test fails
  when any other module imports its label reader), through
  :func:`~envloop_pipelines.core.verify.runner.verify_task`, which answers test
  and holdout with aggregate scores only (the worker sends no item back and
  refuses a predictions file that does not answer every question) and reads
  the holdout only inside a release's one read of the ledger.
* **The verifier gets its labels through a pipe**, never a path: the parent
  reads the label file and writes the bytes to the worker's stdin, so the
  worker needs no filesystem access to the labels and the masking above holds
  for it too.
* **The result channel** is a pipe the parent owns (``$ENVLOOP_RESULT_FD``),
  opened only when the caller asks for it; the verdict never comes from a file
  in the writable working directory, so a planted ``reward.json`` is ignored.
* **Files the parent writes** into a working directory a previous run owned
  are opened with ``O_NOFOLLOW`` through non-symlink directories, and the
  ownership hand-over never follows a symlink nor touches a file with more
  than one hard link, so a planted link cannot redirect root's writes.
* **Typed results**: crashes, timeouts, limits and setup failures come back
  as a :class:`~envloop_pipelines.core.sandbox.base.SandboxResult`, never as
  an exception that ends the round.

Not covered:

* **The loop's own uid.** The label files belong to the uid that runs the
  loop, whose verifier parent reads them; code running as that uid outside
  the sandbox can read them too. Training (the null arms and each round's
  candidate) and ``envloop serve`` run in that process or as that user, not in
  the sandbox, so on one machine it is the code rule above (no import of the
  label reader outside ``core/verify/``, tested), not the OS, that keeps them
  from the labels. Run the trainer or the server as another user for an OS
  barrier; on Kubernetes the label store is its own volume
  (``envloop-verifier``), mounted only in the steps that write or score labels
  (``k8s/README.md``), but ``noise_floor`` trains its null arms in a pod that
  mounts it.
* **Aggregates leak slowly.** A caller that sends many complete predictions
  files differing in one answer learns that answer from the change in the
  aggregate. The holdout allows one read per release, so this is open on
  ``test`` only: the loop reads it every round, and ``envloop sandbox verify``
  or an environment's ``evaluate`` any number of times; those reads are logged
  (``verifier run``), not counted or limited.
* **Kernel exploits and side channels.** This is process isolation on a shared
  kernel, not a VM; no seccomp filter narrows the syscalls. Use the docker or
  k8s backend (or gVisor/Kata under them) where that matters.
* **World-readable files** other than the hidden, masked and concealed paths
  (``/etc``, the virtualenv; the repository where the caller does not
  conceal it) are readable; a world-writable place outside ``/tmp``,
  ``/var/tmp``, ``/dev/shm`` and ``/run/lock`` would stay writable (this host
  has none; ``find / -xdev -type d -perm -0002`` lists them).
* **Bind targets** (``binds``, a Harbor task's ``/app``) that do not exist on the
  host are made there once, as empty root-owned folders (mount points).
* **Disk use** is bounded per file (RLIMIT_FSIZE) and by the private tmpfs
  size (``fsize_mb`` each), not in total inside a working directory the caller made (many files of the
  maximum size are possible; an episode's folder is a tmpfs of bounded size); use a quota or the docker
  backend's tmpfs size.
* **Memory** is bounded per process as address space, not as resident memory
  of the whole tree (cgroup v1 here; no per-run memory cgroup). ``nproc`` x
  ``mem_mb`` is the worst case.
* **CPU** is bounded per process; a tree of processes shares the wall limit.
* **/proc** is the host's where the host refuses a PID namespace (``pid_namespace: false``): process lists
  and command lines of other users are visible (not their environments or file descriptors), and the
  killed processes' zombies are reaped by the host's init. ``/sys`` is the host's in any case.
* The setup runs in :mod:`envloop_pipelines.core.sandbox.enter`, a small
  stdlib-only launcher that ``subprocess`` starts with ``vfork`` + ``exec``
  (no ``preexec_fn``), so no code of the caller (its at-fork handlers, its
  threads' objects) runs in the child; the launcher then execs the
  command, which keeps the pid.
* **Without root** there is no uid switch, no namespaces and no uid sweep (the
  process-group kill still runs; RLIMIT_NPROC is then the caller's count plus
  ``nproc``); the command runs as the owner of the label files and can read
  them. The result flags say so (``hidden_paths_masked: false``), and
  ``strict=True`` refuses to run.
* ``memory_exceeded`` is recognised from the command's own report
  (``MemoryError``, ``bad_alloc``, ``Cannot allocate memory``), since RLIMIT_AS
  makes allocations fail rather than killing the process.
"""

from __future__ import annotations

import errno
import functools
import itertools
import json
import logging
import os
import resource
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from envloop_pipelines.core.sandbox import enter
from envloop_pipelines.core.sandbox.base import (
    RESULT_FD_ENV,
    SandboxLimits,
    SandboxResult,
    SandboxStatus,
    setup_error,
)
from envloop_pipelines.core.sandbox.tree import remove_tree, walk
from envloop_pipelines.core.storage import envloop_home

log = logging.getLogger(__name__)

#: Fresh uids come from here: above the usual subuid ranges (100000 + 65536 * k for a few users).
DEFAULT_UID_RANGE: tuple[int, int] = (1_200_000, 1_000_000)
#: Places every uid may write to; each gets a private tmpfs in the run's mount namespace.
PRIVATE_TMP_DIRS: tuple[str, ...] = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_MEMORY_MARKERS = ("MemoryError", "std::bad_alloc", "Cannot allocate memory", "out of memory", "xmalloc: cannot allocate",
                   "failed to map segment from shared object")
_FSIZE_MARKERS = ("File too large", "[Errno 27]", "File size limit exceeded")
_CPU_MARKERS = ("CPU time limit exceeded",)  # a shell reporting its child's SIGXCPU (exit 152)
_uid_counter = itertools.count()
_uid_lock = threading.Lock()


# --------------------------------------------------------------------------- host support


@dataclass(frozen=True)
class HostSupport:
    """What the local backend can enforce on this host (probed once per process)."""

    root: bool
    network_namespace: bool
    mount_namespace: bool
    setuid: bool
    detail: str
    pid_namespace: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {"root": self.root, "network_namespace": self.network_namespace,
                "mount_namespace": self.mount_namespace, "pid_namespace": self.pid_namespace,
                "setuid": self.setuid, "detail": self.detail}


def _launch_spec(*, unshare: int = 0, mount_ns: bool = False, overlays: Sequence["_Overlay"] = (),
                 hidden: Sequence[Path] = (), rlimits: Sequence[tuple[int, tuple[int, int]]] = (),
                 uid: int | None = None, error_fd: int | None = None, report_fd: int | None = None,
                 binds: Mapping[str, Path] | None = None, cwd: str | None = None) -> dict[str, Any]:
    """The JSON the launcher applies (:func:`envloop_pipelines.core.sandbox.enter.setup`)."""
    return {
        "binds": [[os.fsdecode(src), dst] for dst, src in (binds or {}).items()], "chdir": cwd,
        "unshare": unshare, "mount_ns": mount_ns, "hidden": [os.fsdecode(p) for p in hidden],
        "overlays": [{"target": os.fsdecode(o.target), "options": o.options, "read_only": o.read_only,
                      "keep": [[os.fsdecode(k), os.fsdecode(k.relative_to(o.target))] for k in o.keep]}
                     for o in overlays],
        "rlimits": [[which, soft, hard] for which, (soft, hard) in rlimits], "uid": uid,
        "error_fd": -1 if error_fd is None else error_fd, "parent_pid": os.getpid(),
        "report_fd": -1 if report_fd is None else report_fd,
    }


def _start_launcher(spec: Mapping[str, Any], argv: Sequence[str], *, env: Mapping[str, str] | None = None,
                    pass_fds: Sequence[int] = (), **popen: Any) -> subprocess.Popen:
    """Start ``argv`` behind the launcher that applies ``spec`` (see :mod:`~envloop_pipelines.core.sandbox.enter`).

    The launcher's command line holds no host path (with a PID namespace it is the run's pid 1, which ``ps``
    shows): its script is read from an inherited descriptor (``/dev/fd/N``), the spec comes in the environment.
    """
    script = os.open(enter.__file__, os.O_RDONLY)
    try:
        return subprocess.Popen(
            [enter.LAUNCHER_NAME, "-I", "-S", "-B", f"/dev/fd/{script}", *argv], executable=sys.executable,
            env={**(os.environ if env is None else env), enter.SPEC_ENV: json.dumps(spec)},
            pass_fds=(*pass_fds, script), close_fds=True, start_new_session=True, **popen)
    finally:
        os.close(script)


def _probe(spec: Mapping[str, Any]) -> str | None:
    """Run ``:`` behind the launcher with ``spec``; None when it worked, else the reason."""
    try:
        with _start_launcher(spec, ["/bin/sh", "-c", ":"], env={"PATH": _PATH}, stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) as proc:
            _, stderr = proc.communicate(timeout=10)
    except (subprocess.SubprocessError, OSError) as exc:
        return f"{type(exc).__name__}: {exc}"
    if proc.returncode != 0:
        return stderr.decode(errors="replace").strip()[-500:] or f"exited {proc.returncode}"
    return None


@functools.lru_cache(maxsize=1)
def probe_host() -> HostSupport:
    """Try each isolation mechanism once in a throw-away child and remember the answer."""
    reasons: list[str] = []
    specs = {
        "network_namespace": _launch_spec(unshare=enter.CLONE_NEWNET),
        "mount_namespace": _launch_spec(unshare=enter.CLONE_NEWNS, mount_ns=True,
                                        overlays=[_Overlay(Path("/tmp"), "size=4k", (), False)]),
        "setuid": _launch_spec(uid=DEFAULT_UID_RANGE[0]),
        # Its own /proc needs the mount namespace too.
        "pid_namespace": _launch_spec(unshare=enter.CLONE_NEWNS | enter.CLONE_NEWPID, mount_ns=True),
    }
    results = {}
    for name, spec in specs.items():
        reason = _probe(spec)
        results[name] = reason is None
        if reason:
            reasons.append(f"{name}: {reason}")
    support = HostSupport(root=os.geteuid() == 0, detail="; ".join(reasons) or "all mechanisms available", **results)
    log.info("local sandbox host support: %s", support.as_dict())
    return support


# --------------------------------------------------------------------------- paths


def _world_traversable(path: Path) -> bool:
    try:
        return bool(os.stat(path).st_mode & stat.S_IXOTH)
    except OSError:
        return False


def _is_under(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def _minimal(paths: Sequence[Path]) -> list[Path]:
    """Drop paths that lie under another path of the list."""
    out: list[Path] = []
    for p in sorted(set(paths), key=lambda x: len(x.parts)):
        if not any(_is_under(p, q) for q in out):
            out.append(p)
    return out


def interpreter_paths() -> list[Path]:
    """Paths the project's Python needs to start and import ``envloop_pipelines``."""
    import envloop_pipelines

    candidates = [Path(sys.prefix), Path(sys.base_prefix), Path(os.path.realpath(sys.executable)).parent,
                  Path(envloop_pipelines.__file__).resolve().parent.parent]
    candidates += [Path(p) for p in sys.path if p and os.path.isdir(p)]
    return [p.resolve() for p in candidates if p.exists()]


@dataclass(frozen=True)
class _Overlay:
    """A tmpfs over ``target`` with ``keep`` (absolute host paths under it) bound back in."""

    target: Path
    options: str
    keep: tuple[Path, ...]
    read_only: bool


def _plan_overlays(keep: Sequence[Path], private_tmp: bool, tmp_size_mb: int,
                   conceal: Sequence[Path] = ()) -> list[_Overlay]:
    concealed = _minimal([Path(c).resolve() for c in conceal if Path(c).exists()])
    # A kept path at or above a concealed one cannot be kept whole (the checkout holds the virtualenv):
    # what is kept inside the concealed path is bound back into its overlay instead.
    keep = _minimal([k for k in (p.resolve() for p in keep if p.exists())
                     if not any(_is_under(c, k) for c in concealed)])
    targets: dict[Path, tuple[str, bool]] = {}
    if private_tmp:
        for name in PRIVATE_TMP_DIRS:
            path = Path(name)
            if path.is_dir() and not path.is_symlink():
                targets[path.resolve()] = (f"size={tmp_size_mb}m,mode=1777", False)
    # Concealed paths (the checkout, the EnvLoop home): an empty read-only folder, the kept paths bound back.
    # One under a private temp dir is hidden by that tmpfs already.
    for path in concealed:
        if not any(_is_under(path, t) or _is_under(t, path) for t in targets):
            targets[path] = ("size=64k,mode=755", True)
    # The topmost ancestor of a needed path that "other" cannot traverse (``/root`` 0700 with a
    # pyenv Python inside): a read-only tmpfs over it with only the needed paths bound back.
    for path in keep:
        for ancestor in reversed(path.parents):
            if ancestor != Path("/") and not _world_traversable(ancestor):
                if not any(_is_under(ancestor, t) for t in targets):
                    targets[ancestor] = ("size=64k,mode=755", True)
                break
    # A concealed path under another overlay is hidden by it already (only the kept paths come back there).
    for path in concealed:
        if path in targets and any(t != path and _is_under(path, t) for t in targets):
            del targets[path]
    overlays = []
    for target, (options, read_only) in sorted(targets.items(), key=lambda kv: len(kv[0].parts)):
        inside = tuple(p for p in keep if p != target and _is_under(p, target))
        overlays.append(_Overlay(target, options, inside, read_only))
    return overlays


# --------------------------------------------------------------------------- I/O


class _Tail:
    """Drains a pipe, keeping the last ``keep`` bytes and the total count."""

    def __init__(self, fd: int, keep: int) -> None:
        self.fd, self.keep = fd, keep
        self.buf = bytearray()
        self.total = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while chunk := os.read(self.fd, 65536):
                self.total += len(chunk)
                self.buf += chunk
                if len(self.buf) > 2 * self.keep:
                    del self.buf[: len(self.buf) - self.keep]
        except OSError:
            pass

    def text(self) -> str:
        # Bytes that are not UTF-8 come back as \\xNN escapes (lossless, and what an agent can type back).
        return bytes(self.buf[-self.keep:]).decode("utf-8", errors="backslashreplace")


class _Channel:
    """Drains the result pipe up to ``cap`` bytes; more is recorded as an overflow, never cut silently."""

    def __init__(self, fd: int, cap: int) -> None:
        self.fd, self.cap = fd, cap
        self.buf = bytearray()
        self.overflow = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while chunk := os.read(self.fd, 1 << 20):
                if len(self.buf) + len(chunk) > self.cap:
                    self.overflow = True  # keep draining so the writer never blocks
                    continue
                self.buf += chunk
        except OSError:
            pass


def _feed(fd: int, data: bytes) -> threading.Thread:
    def run() -> None:
        try:
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
        except OSError:
            pass  # the command closed stdin or died; its status says why
        finally:
            os.close(fd)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


# --------------------------------------------------------------------------- processes


def _processes_of(uid: int) -> list[int]:
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


def _is_the_command(pid: int) -> bool:
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


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _sweep_uid(uid: int, deadline_s: float = 5.0) -> set[int]:
    """SIGKILL every process of ``uid`` until none is left; returns the pids killed."""
    killed: set[int] = set()
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        pids = _processes_of(uid)
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


def _count_tasks_of_self() -> int:
    """Threads of every process of our uid: RLIMIT_NPROC counts tasks, not processes."""
    total = 0
    for pid in _processes_of(os.getuid()):
        try:
            total += len(os.listdir(f"/proc/{pid}/task"))
        except OSError:
            continue
    return total


def _allocate_uid(uid_range: tuple[int, int]) -> int:
    base, span = uid_range
    with _uid_lock:
        for _ in range(64):
            uid = base + (os.getpid() * 7919 + next(_uid_counter) * 104729) % span
            if not _processes_of(uid):
                return uid
    raise RuntimeError(f"no free uid in [{base}, {base + span}) after 64 tries")


# --------------------------------------------------------------------------- files


def _safe_write(root: Path, rel: str, data: bytes) -> None:
    """Write ``root/rel`` without following any symlink a previous run may have planted."""
    parts = Path(rel).parts
    if not parts or Path(rel).is_absolute() or ".." in parts:
        raise ValueError(f"file name {rel!r} must be a relative path inside the working directory")
    current = root
    for part in parts[:-1]:
        current = current / part
        if current.is_symlink():
            raise ValueError(f"{current} is a symlink; refusing to write through it")
        current.mkdir(exist_ok=True)
    fd = os.open(current / parts[-1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)


def _chown_tree(root: Path, uid: int) -> None:
    """Give the run's uid its working directory.

    Never follows symlinks and skips files with more than one hard link: a
    previous run's link to a file outside the directory must not make us
    change that file's owner.
    """
    os.chown(root, uid, uid, follow_symlinks=False)
    os.chmod(root, 0o700)
    for dirpath, dirnames, filenames in walk(root):  # no recursion: a previous run may have left any depth
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            try:
                st = os.lstat(path)
                if stat.S_ISLNK(st.st_mode) or (not stat.S_ISDIR(st.st_mode) and st.st_nlink > 1):
                    continue
                os.chown(path, uid, uid, follow_symlinks=False)
            except OSError as exc:
                if exc.errno not in (errno.ENAMETOOLONG, errno.ENOENT):  # past PATH_MAX: left as it is
                    raise


def _libc() -> Any:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
    return libc


def mount_scratch(path: str | Path, size_mb: int) -> bool:
    """Mount a fresh tmpfs of ``size_mb`` MiB (mode 0700) over the empty folder ``path``, in this host's namespace.

    An episode's folder lives on one: a bind of a folder of it shows the folder's path *on that tmpfs*
    (``/work``) in ``/proc/self/mountinfo``, never its host path, and its disk use is bounded in total.
    Returns False where the host refuses (no root); the folder is then an ordinary one.
    """
    if os.geteuid() != 0:
        return False
    options = f"size={int(size_mb)}m,mode=0700".encode()
    return _libc().mount(b"tmpfs", os.fsencode(path), b"tmpfs", 2 | 4, options) == 0  # MS_NOSUID | MS_NODEV


def unmount_scratch(path: str | Path) -> None:
    """Detach the tmpfs :func:`mount_scratch` put at ``path`` (its files go with it, whatever they are).

    Raises:
        OSError: the host refused.
    """
    if _libc().umount2(os.fsencode(path), 2) != 0:  # MNT_DETACH
        import ctypes

        err = ctypes.get_errno()
        raise OSError(err, f"umount {path}: {os.strerror(err)}")


# --------------------------------------------------------------------------- the backend


def classify(
    *,
    exit_code: int | None,
    sig: int | None,
    cpu_s: float,
    limits: SandboxLimits,
    timed_out: bool,
    stderr: str,
    stdout: str = "",
) -> tuple[SandboxStatus, str]:
    """Name what ended a run, most specific cause first."""
    if timed_out:
        return "timeout", f"killed at the wall limit of {limits.wall_s:g}s"
    if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu_s >= limits.cpu_s - 0.05):
        return "cpu_limit", f"CPU limit of {limits.cpu_s:g}s reached (used {cpu_s:.2f}s)"
    if sig == signal.SIGXFSZ:
        return "file_size_exceeded", f"wrote past the file size limit of {limits.fsize_mb} MiB (SIGXFSZ)"
    if exit_code == 0 and sig is None:
        return "ok", "exited 0"
    text = stderr + "\n" + stdout
    if exit_code == 128 + signal.SIGXCPU and any(m in text for m in _CPU_MARKERS):
        return "cpu_limit", f"a child reached the CPU limit of {limits.cpu_s:g}s (SIGXCPU)"
    if any(m in text for m in _MEMORY_MARKERS):
        return "memory_exceeded", f"an allocation failed under the address-space limit of {limits.mem_mb} MiB"
    if any(m in text for m in _FSIZE_MARKERS):
        return "file_size_exceeded", f"a write failed at the file size limit of {limits.fsize_mb} MiB (EFBIG)"
    if sig is not None:
        return "killed", f"killed by signal {signal.Signals(sig).name if sig in signal.valid_signals() else sig}"
    return "error", f"exited {exit_code}"


class LocalSandbox:
    """Runs commands in a fresh, limited, isolated process on this machine (see the threat model above).

    Args:
        limits: default limits of a run.
        isolate_network: run in a new network namespace where the host allows it.
        mask_paths: mask the hidden paths in the run's mount namespace (the namespace itself is used
            whenever the host allows it: it also exposes the interpreter and gives private temp dirs).
        switch_uid: run as a fresh unprivileged uid (root only).
        hidden_paths: paths never readable inside; None means ``<ENVLOOP_HOME>/verifier``,
            resolved at each run (never at import time).
        readable_paths: paths the command must reach even below a directory "other" cannot
            traverse (the interpreter's paths are always included).
        private_tmp: a private tmpfs over ``/tmp``, ``/var/tmp``, ``/dev/shm`` (the working directory and
            the interpreter's paths are bound back in).
        work_root: where temporary working directories are made (default: the system temp dir).
        uid_range: ``(first, count)`` of the uids handed out per run.
        strict: refuse to run (status ``error``) when network isolation or masking is unavailable.
    """

    backend = "local"

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        *,
        isolate_network: bool = True,
        mask_paths: bool = True,
        switch_uid: bool = True,
        hidden_paths: Sequence[str | Path] | None = None,
        readable_paths: Sequence[str | Path] = (),
        private_tmp: bool = True,
        work_root: str | Path | None = None,
        uid_range: tuple[int, int] = DEFAULT_UID_RANGE,
        strict: bool = False,
    ) -> None:
        self.limits = limits or SandboxLimits()
        self.isolate_network = isolate_network
        self.mask_paths = mask_paths
        self.switch_uid = switch_uid
        self.hidden_paths = None if hidden_paths is None else tuple(Path(p) for p in hidden_paths)
        self.readable_paths = tuple(Path(p) for p in readable_paths)
        self.private_tmp = private_tmp
        self.work_root = None if work_root is None else Path(work_root)
        if len(uid_range) != 2 or uid_range[0] < 1000 or uid_range[1] < 1:
            raise ValueError(f"uid_range must be (first >= 1000, count >= 1), got {uid_range!r}")
        self.uid_range = uid_range
        self.strict = strict

    def capabilities(self) -> dict[str, Any]:
        support = probe_host()
        return {
            "backend": self.backend,
            **support.as_dict(),
            "network_isolated": self.isolate_network and support.network_namespace,
            "hidden_paths_masked": self.mask_paths and support.mount_namespace,
            "private_tmp": self.private_tmp and support.mount_namespace,
            "uid_switch": self.switch_uid and support.setuid,
        }

    def _hidden(self, extra: Sequence[str | Path]) -> list[Path]:
        base = [envloop_home() / "verifier"] if self.hidden_paths is None else list(self.hidden_paths)
        # Resolved: the mount lands on the real directory, whatever alias a command uses to reach it.
        return [Path(p).resolve() for p in [*base, *extra]]

    def run(
        self,
        argv: Sequence[str],
        *,
        limits: SandboxLimits | None = None,
        stdin: bytes | None = None,
        workdir: str | Path | None = None,
        files: Mapping[str, bytes] | None = None,
        env: Mapping[str, str] | None = None,
        result_channel: bool = False,
        hidden_paths: Sequence[str | Path] = (),
        conceal: Sequence[str | Path] = (),
        binds: Mapping[str, str | Path] | None = None,
        cwd: str | None = None,
    ) -> SandboxResult:
        """Run ``argv``; see :meth:`envloop_pipelines.core.sandbox.base.Sandbox.run`.

        Options of this backend (they need a mount namespace and are ignored without one):

        * ``conceal``: host paths replaced by an empty read-only folder, but for the interpreter's paths and the
          working directory under them, which are bound back (an episode conceals the checkout and the home).
        * ``binds``: ``{absolute path inside: folder under the working directory}``, where that folder also
          appears (a Harbor task's ``/app``). A path that does not exist is made as an empty folder (a mount
          point); what the host has there is covered inside.
        * ``cwd``: where the command starts (one of the ``binds``; ``HOME`` and ``TMPDIR`` too).
        """
        limits = limits or self.limits
        if not argv:
            return setup_error(self.backend, "empty command", limits)
        support = probe_host()
        net = self.isolate_network and support.network_namespace
        # The mount namespace also exposes the interpreter below /root and gives private temp dirs,
        # so it is used whenever the host allows it; mask_paths only decides the hidden-path masks.
        mount_ns = support.mount_namespace
        masked = mount_ns and self.mask_paths
        uid = None
        if self.switch_uid and support.setuid:
            try:
                uid = _allocate_uid(self.uid_range)
            except RuntimeError as exc:
                return setup_error(self.backend, str(exc), limits)
        if self.strict and not (net and masked):
            return setup_error(self.backend, f"strict sandbox refused: host support {support.as_dict()}", limits)

        own_dir = workdir is None
        try:
            work = Path(tempfile.mkdtemp(prefix="envloop-sandbox-", dir=self.work_root)) if own_dir else Path(workdir).resolve()
        except OSError as exc:
            return setup_error(self.backend, f"working directory: {exc}", limits)
        try:
            hidden = self._hidden(hidden_paths) if self.mask_paths else []
            return self._run(argv, limits, stdin, work, files or {}, env or {}, result_channel, hidden, net, mount_ns,
                             masked, uid, [Path(c) for c in conceal], dict(binds or {}), cwd)
        finally:
            if own_dir:
                try:
                    remove_tree(work)
                except OSError:
                    log.exception("could not remove the run's folder %s", work)

    def _run(
        self,
        argv: Sequence[str],
        limits: SandboxLimits,
        stdin: bytes | None,
        work: Path,
        files: Mapping[str, bytes],
        extra_env: Mapping[str, str],
        result_channel: bool,
        hidden: list[Path],
        net: bool,
        mount_ns: bool,
        masked: bool,
        uid: int | None,
        conceal: Sequence[Path] = (),
        binds: Mapping[str, str | Path] | None = None,
        cwd: str | None = None,
    ) -> SandboxResult:
        def fail(detail: str) -> SandboxResult:
            return setup_error(self.backend, detail, limits)

        if not work.is_dir():
            return fail(f"working directory {work} does not exist")
        covering = [h for h in hidden if _is_under(work, h)]
        if covering:
            return fail(f"hidden path {covering[0]} contains the working directory {work}")
        try:
            for rel, data in files.items():
                _safe_write(work, rel, data)
            if uid is not None:
                _chown_tree(work, uid)
        except (OSError, ValueError) as exc:
            return fail(f"preparing {work}: {exc}")

        mounts: dict[str, Path] = {}
        if mount_ns:  # without a mount namespace the command sees the working directory where it is
            for dst, src in (binds or {}).items():
                source = Path(src).resolve()
                if not os.path.isabs(dst) or os.path.normpath(dst) in ("/", *PRIVATE_TMP_DIRS) or not _is_under(source, work):
                    return fail(f"binds: {dst!r} -> {src}: the target must be an absolute path other than / and the "
                                f"private temp dirs, the source a folder under the working directory {work}")
                target = Path(os.path.normpath(dst))
                fresh = not target.exists() and target.parent != Path("/") and not any(
                    _is_under(target, Path(t)) for t in PRIVATE_TMP_DIRS)
                covers = [k for k in interpreter_paths() if _is_under(k, target)]
                if fresh or covers or target.is_symlink() or (target.exists() and not target.is_dir()):
                    return fail(f"binds: {dst!r} must be a folder that exists, or a new one right under / (a mount "
                                f"point), and must not cover the interpreter's paths {covers[:1]}")
                mounts[str(target)] = source
            if cwd is not None and os.path.normpath(cwd) not in mounts:
                return fail(f"cwd {cwd!r} must be one of the binds {sorted(mounts)}")
        inside = os.path.normpath(cwd) if cwd is not None and mounts else str(work)
        env = {
            # The project's interpreter first, so `python` means the one that has our packages.
            "PATH": f"{os.path.dirname(sys.executable)}:{_PATH}",
            "HOME": inside, "TMPDIR": inside, "PWD": inside, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
            "PYTHONNOUSERSITE": "1", "PYTHONDONTWRITEBYTECODE": "1",
            # One BLAS/OpenMP thread: threads count against RLIMIT_NPROC and the cores are shared.
            "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
            **{str(k): str(v) for k, v in extra_env.items()},
        }
        mb = 1024 * 1024
        nproc = limits.nproc if uid is not None else _count_tasks_of_self() + limits.nproc
        cpu = max(1, int(round(limits.cpu_s)))
        rlimits = [
            (resource.RLIMIT_AS, (limits.mem_mb * mb, limits.mem_mb * mb)),
            (resource.RLIMIT_CPU, (cpu, cpu + 1)),  # SIGXCPU at the limit, SIGKILL a second later
            (resource.RLIMIT_FSIZE, (limits.fsize_mb * mb, limits.fsize_mb * mb)),
            (resource.RLIMIT_NOFILE, (limits.nofile, limits.nofile)),
            (resource.RLIMIT_NPROC, (nproc, nproc)),
            (resource.RLIMIT_CORE, (0, 0)),
        ]
        # A working directory shown at the task's own paths (binds) is not bound back at its host path, and is
        # concealed where no private temp dir covers it: the command never learns or reaches where it lives.
        shown = [] if mounts else [work]
        overlays = _plan_overlays([*interpreter_paths(), *self.readable_paths, *shown], self.private_tmp,
                                  limits.fsize_mb, [*conceal, *([work] if mounts else [])]) if mount_ns else []
        pid_ns = mount_ns and probe_host().pid_namespace
        flags = (enter.CLONE_NEWNET if net else 0) | (enter.CLONE_NEWNS | enter.CLONE_NEWIPC if mount_ns else 0) | (
            enter.CLONE_NEWPID if pid_ns else 0)

        err_r, err_w = os.pipe()
        # With a PID namespace the run's init reports how many processes the command left behind (they die
        # with it, before any sweep of the uid could count them).
        rep_r, rep_w = os.pipe()
        chan_r = chan_w = -1
        pass_fds: tuple[int, ...] = (err_w, rep_w)
        if result_channel:
            chan_r, chan_w = os.pipe()
            env[RESULT_FD_ENV] = str(chan_w)
            pass_fds += (chan_w,)
        spec = _launch_spec(unshare=flags, mount_ns=mount_ns, overlays=overlays, hidden=hidden, rlimits=rlimits,
                            uid=uid, error_fd=err_w, report_fd=rep_w, binds=mounts,
                            cwd=inside if mounts and cwd is not None else None)
        started = time.monotonic()
        try:
            proc = _start_launcher(spec, argv, env=env, pass_fds=pass_fds, stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=work, restore_signals=True)
        except (OSError, subprocess.SubprocessError) as exc:
            for fd in (err_r, err_w, rep_r, rep_w, chan_r, chan_w):
                if fd >= 0:
                    os.close(fd)
            return fail(f"starting the sandbox launcher: {type(exc).__name__}: {exc}")
        os.close(err_w)  # the launcher holds the only write end; its exec (or exit) closes it
        os.close(rep_w)
        setup_errors = _Tail(err_r, 4000)
        left_behind = _Tail(rep_r, 64)
        channel = None
        if result_channel:
            os.close(chan_w)  # the child holds the only write end now
            channel = _Channel(chan_r, limits.channel_bytes)
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        out = _Tail(proc.stdout.fileno(), limits.tail_bytes)
        err = _Tail(proc.stderr.fileno(), limits.tail_bytes)
        feeder = _feed(os.dup(proc.stdin.fileno()), stdin or b"")
        proc.stdin.close()

        waited: dict[str, Any] = {}
        done = threading.Event()

        def wait() -> None:
            _, status, usage = os.wait4(proc.pid, 0)
            waited.update(status=status, usage=usage)
            done.set()

        threading.Thread(target=wait, daemon=True).start()
        timed_out = not done.wait(limits.wall_s)
        # Stray background jobs, setsid escapees, a fork bomb's children: counted before the kill
        # (SIGKILL is delivered asynchronously, so a count after it undercounts), then killed.
        strays = set(_processes_of(uid)) if uid is not None else set()
        command = {p for p in strays if _is_the_command(p)}  # not a stray: the command the caller ran
        _kill_group(proc.pid)
        if timed_out:
            done.wait(10)
        if uid is not None:
            strays |= _sweep_uid(uid)
        strays -= {proc.pid, *command}
        for reader in (out, err, setup_errors, left_behind, *( [channel] if channel else [] )):
            reader.thread.join(5)
        feeder.join(1)
        wall = time.monotonic() - started
        for pipe in (proc.stdout, proc.stderr):
            pipe.close()
        if channel is not None:
            os.close(chan_r)
        os.close(err_r)
        os.close(rep_r)
        reported = left_behind.text().strip()
        killed = max(len(strays), int(reported) if reported.isdigit() else 0)
        if setup_errors.total:
            # The launcher could not isolate the run (or exec the command): the command never ran.
            return fail(setup_errors.text())

        status_word = waited.get("status")
        usage = waited.get("usage")
        exit_code = sig = None
        if status_word is not None:
            if os.WIFSIGNALED(status_word):
                sig = os.WTERMSIG(status_word)
            else:
                exit_code = os.waitstatus_to_exitcode(status_word)
            proc.returncode = os.waitstatus_to_exitcode(status_word)
        cpu_s = (usage.ru_utime + usage.ru_stime) if usage is not None else 0.0
        stdout_text, stderr_text = out.text(), err.text()
        status, detail = classify(exit_code=exit_code, sig=sig, cpu_s=cpu_s, limits=limits, timed_out=timed_out,
                                  stderr=stderr_text, stdout=stdout_text)
        channel_text = None
        if channel is not None:
            channel_text = bytes(channel.buf).decode("utf-8", errors="replace")
            if channel.overflow and status == "ok":
                status, detail = "error", f"the result channel carried more than {limits.channel_bytes} bytes"
        return SandboxResult(
            ok=status == "ok", exit_code=exit_code, signal=sig, status=status, wall_s=round(wall, 4),
            cpu_s=round(cpu_s, 4), stdout_tail=stdout_text, stderr_tail=stderr_text, network_isolated=net,
            backend=self.backend, pid=proc.pid, hidden_paths_masked=masked, uid=uid if uid is not None else os.getuid(),
            processes_killed=killed, detail=detail, channel=channel_text, stdout_bytes=out.total,
            stderr_bytes=err.total, limits=limits.to_dict(),
        )


__all__ = ["HostSupport", "LocalSandbox", "classify", "interpreter_paths", "mount_scratch", "probe_host",
           "unmount_scratch"]
