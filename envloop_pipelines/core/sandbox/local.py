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
  the overlays cover them, and an episode's folder is a tmpfs of its own (:func:`~.mounts.mount_scratch`), so
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

Where each part lives
=====================

This module holds the backend (:class:`LocalSandbox`) and the steps of one run;
the mechanisms it uses are modules of their own: :mod:`.host` (what the host
allows, the launcher's spec and its start), :mod:`.enter` (the launcher that
applies the spec), :mod:`.mounts` (the overlays, the private temp dirs, an
episode's scratch tmpfs), :mod:`.uids` (a fresh uid per run and the sweep of
its processes), :mod:`.workdir` (files written and the folder handed to the
uid without following a link), :mod:`.pipes` (the stdout/stderr tails, the
result channel, stdin) and :func:`~.base.classify` (the status, shared with
the docker and k8s backends).
"""

from __future__ import annotations

import logging
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from envloop_pipelines.core.sandbox import enter
from envloop_pipelines.core.sandbox.base import (
    RESULT_FD_ENV,
    SandboxCall,
    SandboxLimits,
    SandboxResult,
    classify,
    setup_error,
)
from envloop_pipelines.core.sandbox.host import SAFE_PATH, launch_spec, probe_host, start_launcher
from envloop_pipelines.core.sandbox.mounts import (
    PRIVATE_TMP_DIRS,
    Overlay,
    interpreter_paths,
    is_under,
    package_root,
    plan_overlays,
)
from envloop_pipelines.core.sandbox.pipes import Channel, Tail, feed
from envloop_pipelines.core.sandbox.tree import remove_tree
from envloop_pipelines.core.sandbox.uids import (
    DEFAULT_UID_RANGE,
    allocate_uid,
    count_tasks_of_self,
    is_the_command,
    kill_group,
    processes_of,
    sweep_uid,
)
from envloop_pipelines.core.sandbox.workdir import chown_tree, safe_write
from envloop_pipelines.core.storage import envloop_home

log = logging.getLogger(__name__)


class _Refused(Exception):
    """A run that cannot start; its message is the ``detail`` of the setup error :meth:`LocalSandbox.run` returns."""


def _prepare_workdir(work: Path, files: Mapping[str, bytes], hidden: Sequence[Path], uid: int | None) -> None:
    """Write ``files`` into ``work`` and hand it to the run's uid, or refuse (it is missing, or under a hidden path)."""
    if not work.is_dir():
        raise _Refused(f"working directory {work} does not exist")
    covering = [h for h in hidden if is_under(work, h)]
    if covering:
        raise _Refused(f"hidden path {covering[0]} contains the working directory {work}")
    try:
        for rel, data in files.items():
            safe_write(work, rel, data)
        if uid is not None:
            chown_tree(work, uid)
    except (OSError, ValueError) as exc:
        raise _Refused(f"preparing {work}: {exc}") from exc


def _plan_binds(binds: Mapping[str, str | Path], work: Path, cwd: str | None) -> dict[str, Path]:
    """``{target inside: host folder}`` of ``binds``, each checked, and ``cwd`` one of them (else refused)."""
    mounts: dict[str, Path] = {}
    for dst, src in binds.items():
        source = Path(src).resolve()
        if not os.path.isabs(dst) or os.path.normpath(dst) in ("/", *PRIVATE_TMP_DIRS) or not is_under(source, work):
            raise _Refused(f"binds: {dst!r} -> {src}: the target must be an absolute path other than / and the "
                           f"private temp dirs, the source a folder under the working directory {work}")
        target = Path(os.path.normpath(dst))
        fresh = not target.exists() and target.parent != Path("/") and not any(
            is_under(target, Path(t)) for t in PRIVATE_TMP_DIRS)
        covers = [k for k in interpreter_paths() if is_under(k, target)]
        if fresh or covers or target.is_symlink() or (target.exists() and not target.is_dir()):
            raise _Refused(f"binds: {dst!r} must be a folder that exists, or a new one right under / (a mount "
                           f"point), and must not cover the interpreter's paths {covers[:1]}")
        mounts[str(target)] = source
    if cwd is not None and os.path.normpath(cwd) not in mounts:
        raise _Refused(f"cwd {cwd!r} must be one of the binds {sorted(mounts)}")
    return mounts


def _environment(inside: str, extra_env: Mapping[str, str]) -> dict[str, str]:
    """The run's whole environment: nothing of the caller's but ``extra_env``."""
    return {
        # The project's interpreter first, so `python` means the one that has our packages.
        "PATH": f"{os.path.dirname(sys.executable)}:{SAFE_PATH}",
        "HOME": inside, "TMPDIR": inside, "PWD": inside, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
        "PYTHONNOUSERSITE": "1", "PYTHONDONTWRITEBYTECODE": "1",
        # One BLAS/OpenMP thread: threads count against RLIMIT_NPROC and the cores are shared.
        "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
        **{str(k): str(v) for k, v in extra_env.items()},
    }


def _rlimits(limits: SandboxLimits, uid: int | None) -> list[tuple[int, tuple[int, int]]]:
    """The rlimits the launcher sets before ``exec``: ``(which, (soft, hard))``."""
    mb = 1024 * 1024
    nproc = limits.nproc if uid is not None else count_tasks_of_self() + limits.nproc
    cpu = max(1, int(round(limits.cpu_s)))
    return [
        (resource.RLIMIT_AS, (limits.mem_mb * mb, limits.mem_mb * mb)),
        (resource.RLIMIT_CPU, (cpu, cpu + 1)),  # SIGXCPU at the limit, SIGKILL a second later
        (resource.RLIMIT_FSIZE, (limits.fsize_mb * mb, limits.fsize_mb * mb)),
        (resource.RLIMIT_NOFILE, (limits.nofile, limits.nofile)),
        (resource.RLIMIT_NPROC, (nproc, nproc)),
        (resource.RLIMIT_CORE, (0, 0)),
    ]


def _namespaces(net: bool, mount_ns: bool) -> int:
    """The ``unshare`` flags of a run: its own network, mounts and IPC, and processes where the host allows."""
    pid_ns = mount_ns and probe_host().pid_namespace
    return (enter.CLONE_NEWNET if net else 0) | (enter.CLONE_NEWNS | enter.CLONE_NEWIPC if mount_ns else 0) | (
        enter.CLONE_NEWPID if pid_ns else 0)


class _Launch:
    """One started run: the launcher's process, the pipes the parent owns and the threads that drain them.

    Raises:
        _Refused: the launcher could not be started (every pipe opened for it is closed again).
    """

    def __init__(self, argv: Sequence[str], spec: Mapping[str, Any], env: dict[str, str], work: Path,
                 stdin: bytes | None, limits: SandboxLimits, result_channel: bool) -> None:
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
        spec = launch_spec(**spec, error_fd=err_w, report_fd=rep_w)
        self.started = time.monotonic()
        try:
            proc = start_launcher(spec, argv, env=env, pass_fds=pass_fds, stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=work, restore_signals=True)
        except (OSError, subprocess.SubprocessError) as exc:
            for fd in (err_r, err_w, rep_r, rep_w, chan_r, chan_w):
                if fd >= 0:
                    os.close(fd)
            raise _Refused(f"starting the sandbox launcher: {type(exc).__name__}: {exc}") from exc
        self.proc = proc
        os.close(err_w)  # the launcher holds the only write end; its exec (or exit) closes it
        os.close(rep_w)
        self.err_r, self.rep_r, self.chan_r = err_r, rep_r, chan_r
        self.setup_errors = Tail(err_r, 4000)
        self.left_behind = Tail(rep_r, 64)
        self.channel: Channel | None = None
        if result_channel:
            os.close(chan_w)  # the child holds the only write end now
            self.channel = Channel(chan_r, limits.channel_bytes)
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        self.out = Tail(proc.stdout.fileno(), limits.tail_bytes)
        self.err = Tail(proc.stderr.fileno(), limits.tail_bytes)
        self.feeder = feed(os.dup(proc.stdin.fileno()), stdin or b"")
        proc.stdin.close()
        self.waited: dict[str, Any] = {}
        self.done = threading.Event()

    def wait(self, wall_s: float) -> bool:
        """Wait for the launcher up to ``wall_s``; True when the wall limit passed first."""
        def wait() -> None:
            _, status, usage = os.wait4(self.proc.pid, 0)
            self.waited.update(status=status, usage=usage)
            self.done.set()

        threading.Thread(target=wait, daemon=True).start()
        return not self.done.wait(wall_s)

    def end(self, uid: int | None, timed_out: bool) -> int:
        """Kill the process group and every process of ``uid``; the number of processes left behind."""
        # Stray background jobs, setsid escapees, a fork bomb's children: counted before the kill
        # (SIGKILL is delivered asynchronously, so a count after it undercounts), then killed.
        strays = set(processes_of(uid)) if uid is not None else set()
        command = {p for p in strays if is_the_command(p)}  # not a stray: the command the caller ran
        kill_group(self.proc.pid)
        if timed_out:
            self.done.wait(10)
        if uid is not None:
            strays |= sweep_uid(uid)
        strays -= {self.proc.pid, *command}
        for reader in (self.out, self.err, self.setup_errors, self.left_behind, *([self.channel] if self.channel else [])):
            reader.thread.join(5)
        self.feeder.join(1)
        self.wall = time.monotonic() - self.started
        for pipe in (self.proc.stdout, self.proc.stderr):
            pipe.close()
        if self.channel is not None:
            os.close(self.chan_r)
        os.close(self.err_r)
        os.close(self.rep_r)
        reported = self.left_behind.text().strip()
        return max(len(strays), int(reported) if reported.isdigit() else 0)

    def outcome(self) -> tuple[int | None, int | None, float]:
        """``(exit_code, signal, cpu_s)`` of the launcher (the command, which it became or ran as pid 2)."""
        status_word = self.waited.get("status")
        usage = self.waited.get("usage")
        exit_code = sig = None
        if status_word is not None:
            if os.WIFSIGNALED(status_word):
                sig = os.WTERMSIG(status_word)
            else:
                exit_code = os.waitstatus_to_exitcode(status_word)
            self.proc.returncode = os.waitstatus_to_exitcode(status_word)
        cpu_s = (usage.ru_utime + usage.ru_stime) if usage is not None else 0.0
        return exit_code, sig, cpu_s


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

    def run(self, argv: Sequence[str], call: SandboxCall | None = None) -> SandboxResult:
        """Run ``argv``; see :meth:`envloop_pipelines.core.sandbox.base.Sandbox.run`.

        This backend reads every option of ``call``; ``conceal``, ``binds`` and ``cwd`` need a mount namespace
        and are ignored without one.
        """
        call = call or SandboxCall()
        limits = call.limits or self.limits
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
                uid = allocate_uid(self.uid_range)
            except RuntimeError as exc:
                return setup_error(self.backend, str(exc), limits)
        if self.strict and not (net and masked):
            return setup_error(self.backend, f"strict sandbox refused: host support {support.as_dict()}", limits)

        own_dir = call.workdir is None
        try:
            work = (Path(tempfile.mkdtemp(prefix="envloop-sandbox-", dir=self.work_root)) if own_dir
                    else Path(call.workdir).resolve())
        except OSError as exc:
            return setup_error(self.backend, f"working directory: {exc}", limits)
        try:
            hidden = self._hidden(call.hidden_paths) if self.mask_paths else []
            return self._run(argv, call, limits, work, hidden, net=net, mount_ns=mount_ns, masked=masked, uid=uid)
        finally:
            if own_dir:
                try:
                    remove_tree(work)
                except OSError:
                    log.exception("could not remove the run's folder %s", work)

    def _run(self, argv: Sequence[str], call: SandboxCall, limits: SandboxLimits, work: Path, hidden: list[Path], *,
             net: bool, mount_ns: bool, masked: bool, uid: int | None) -> SandboxResult:
        """One run in ``work`` with the isolation :meth:`run` chose: prepare, launch, wait, sweep, report."""
        cwd = call.cwd
        try:
            _prepare_workdir(work, call.files, hidden, uid)
            # Without a mount namespace the command sees the working directory where it is.
            mounts = _plan_binds(call.binds, work, cwd) if mount_ns else {}
        except _Refused as exc:
            return setup_error(self.backend, str(exc), limits)
        inside = os.path.normpath(cwd) if cwd is not None and mounts else str(work)
        extra_env = {**call.env, **({"PYTHONPATH": str(package_root())} if call.package_on_path else {})}
        overlays = self._overlays(work, mounts, [Path(c) for c in call.conceal], limits) if mount_ns else []
        spec = {"unshare": _namespaces(net, mount_ns), "mount_ns": mount_ns, "overlays": overlays, "hidden": hidden,
                "rlimits": _rlimits(limits, uid), "uid": uid, "binds": mounts,
                "cwd": inside if mounts and cwd is not None else None}
        try:
            launch = _Launch(argv, spec, _environment(inside, extra_env), work, call.stdin, limits, call.result_channel)
        except _Refused as exc:
            return setup_error(self.backend, str(exc), limits)
        timed_out = launch.wait(limits.wall_s)
        killed = launch.end(uid, timed_out)
        if launch.setup_errors.total:
            # The launcher could not isolate the run (or exec the command): the command never ran.
            return setup_error(self.backend, launch.setup_errors.text(), limits)
        return self._result(launch, limits, timed_out, killed, net=net, masked=masked, uid=uid)

    def _overlays(self, work: Path, mounts: Mapping[str, Path], conceal: Sequence[Path],
                  limits: SandboxLimits) -> list[Overlay]:
        """The tmpfs overlays of a run's mount namespace and the host paths bound back under them."""
        # A working directory shown at the task's own paths (binds) is not bound back at its host path, and is
        # concealed where no private temp dir covers it: the command never learns or reaches where it lives.
        shown = [] if mounts else [work]
        return plan_overlays([*interpreter_paths(), *self.readable_paths, *shown], self.private_tmp,
                             limits.fsize_mb, [*conceal, *([work] if mounts else [])])

    def _result(self, launch: _Launch, limits: SandboxLimits, timed_out: bool, killed: int, *, net: bool,
                masked: bool, uid: int | None) -> SandboxResult:
        """The typed result of a run that started: its status, tails, channel and the isolation it had."""
        exit_code, sig, cpu_s = launch.outcome()
        stdout_text, stderr_text = launch.out.text(), launch.err.text()
        status, detail = classify(exit_code=exit_code, sig=sig, cpu_s=cpu_s, limits=limits, timed_out=timed_out,
                                  stderr=stderr_text, stdout=stdout_text)
        channel_text = None
        if launch.channel is not None:
            channel_text = bytes(launch.channel.buf).decode("utf-8", errors="replace")
            if launch.channel.overflow and status == "ok":
                status, detail = "error", f"the result channel carried more than {limits.channel_bytes} bytes"
        return SandboxResult(
            ok=status == "ok", exit_code=exit_code, signal=sig, status=status, wall_s=round(launch.wall, 4),
            cpu_s=round(cpu_s, 4), stdout_tail=stdout_text, stderr_tail=stderr_text, network_isolated=net,
            backend=self.backend, pid=launch.proc.pid, hidden_paths_masked=masked,
            uid=uid if uid is not None else os.getuid(), processes_killed=killed, detail=detail, channel=channel_text,
            stdout_bytes=launch.out.total, stderr_bytes=launch.err.total, limits=limits.to_dict(),
        )


__all__ = ["LocalSandbox"]
