"""The local sandbox's launcher: set up the isolation, then ``exec`` the command.

    ENVLOOP_LAUNCH_SPEC=SPEC_JSON python -I -S -B enter.py COMMAND [ARG ...]

:class:`~envloop_pipelines.core.sandbox.local.LocalSandbox` starts every run
through this script instead of a ``preexec_fn``. A ``preexec_fn`` runs Python
in the forked copy of the caller, and that caller is a busy process (torch's
OpenMP pool, Arrow's thread pools, gRPC, MLflow's and Dagster's threads): the
fork runs every library's ``pthread_atfork`` child handler and CPython's
at-fork hooks, and CPython warns that such a child may deadlock on a lock
another thread held. Without a ``preexec_fn``, ``subprocess`` starts this
script with ``vfork`` + ``exec``: no code of the caller runs in the child, and
the setup below happens in a fresh, single-threaded interpreter that imports
nothing but the standard library.

The order is the one the threat model needs: namespaces, mounts (private
propagation first; the binds, then the host's mounts below the overlays
detached, then the overlays and masks), then, with a PID namespace, a fork: the child is pid 1 of the new
namespace and mounts its own ``/proc`` (so ``ps`` and ``/proc/*/mountinfo``
show the run's processes only, and every process of the run dies with it),
while the launcher waits and ends as the child ended (same exit status, same
signal); then in the child rlimits, the uid switch, ``PR_SET_NO_NEW_PRIVS``, the
parent-death signal (after the credential change, which clears it), a clean
signal mask and default dispositions (``exec`` keeps ignored signals and the
mask, and Python ignores SIGPIPE and SIGXFSZ at start-up), then ``exec``. A
failure is written to the error descriptor named in the spec and the script
exits with :data:`SETUP_FAILED`; the command never runs.

Only the standard library: the script runs with ``-I -S`` (no site-packages,
no ``PYTHON*`` variables), before any path is masked.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import resource
import signal
import sys

# <sched.h>, <sys/mount.h>, <sys/prctl.h>
CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
CLONE_NEWNET = 0x40000000
CLONE_NEWPID = 0x20000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
#: The environment variable that carries the spec (JSON) to the launcher; removed before the command starts.
SPEC_ENV = "ENVLOOP_LAUNCH_SPEC"
#: ``argv[0]`` of the launcher: with a PID namespace it is pid 1 of the run, and ``ps`` there shows its
#: command line; the script comes as ``/dev/fd/N`` and the spec in the environment, so no host path shows.
LAUNCHER_NAME = "envloop-sandbox"
#: Exit status of a launcher whose setup failed (the reason is on the error descriptor).
SETUP_FAILED = 121


class SetupError(OSError):
    """A setup step failed; the message names it."""


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    libc.unshare.argtypes = [ctypes.c_int]
    libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    return libc


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise SetupError(err, f"{what}: {os.strerror(err)}")


def _mounts_below(tops: list[bytes], keep: list[bytes]) -> list[bytes]:
    """Mount points strictly below one of ``tops`` that hold none of ``keep``, deepest first."""

    def under(path: bytes, top: bytes) -> bool:
        return path.startswith(top.rstrip(b"/") + b"/")

    with open("/proc/self/mountinfo", "rb") as fh:
        # Field 5 is the mount point, with space, tab, newline and backslash as octal escapes (\040).
        points = {re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m.group(1), 8)]), line.split(b" ")[4])
                  for line in fh.read().splitlines() if line}
    found = [p for p in points if any(under(p, t) for t in tops) and not any(k == p or under(k, p) for k in keep)]
    return sorted(found, key=lambda p: p.count(b"/"), reverse=True)


def setup(spec: dict) -> None:
    """Apply ``spec`` (built by :func:`envloop_pipelines.core.sandbox.host.launch_spec`) to this process."""
    libc = _libc()

    def mount(source: bytes | None, target: bytes, fstype: bytes | None, flags: int, data: bytes | None) -> None:
        _check(libc.mount(source, target, fstype, flags, data), f"mount {target!r}")

    if spec.get("unshare"):
        _check(libc.unshare(spec["unshare"]), f"unshare({spec['unshare']:#x})")
    if spec.get("mount_ns"):
        # Private propagation first: nothing mounted below reaches the host's namespace.
        mount(None, b"/", None, MS_REC | MS_PRIVATE, None)
        # A folder of the working directory at the path the task names (a Harbor task's /app, the verifier's
        # /tests and /logs); its source is opened before any tmpfs covers it (a working directory shown at the
        # task's own paths is not bound back at its host path). An empty mount point is made where nothing is;
        # what the host has there is covered here only.
        tops = [os.fsencode(o["target"]) for o in spec.get("overlays", ())]
        binds = [(os.open(os.fsencode(src), os.O_PATH | os.O_DIRECTORY), os.fsencode(src), os.fsencode(dst))
                 for src, dst in spec.get("binds", ())]
        late = [b for b in binds if any(b[2] == t or b[2].startswith(t.rstrip(b"/") + b"/") for t in tops)]

        def bind(fd: int, target: bytes) -> None:
            if not os.path.isdir(target):
                os.makedirs(target, mode=0o755, exist_ok=True)
            mount(f"/proc/self/fd/{fd}".encode(), target, None, MS_BIND | MS_REC, None)
            os.close(fd)

        for fd, _, target in (b for b in binds if b not in late):  # before the mounts below are detached
            bind(fd, target)
        # Mounts of the host below what the overlays cover (another attempt's folder, this one's own) are
        # detached first: covered, they would still be listed in /proc/self/mountinfo with their host paths.
        keep = [os.fsencode(src) for overlay in spec.get("overlays", ()) for src, _ in overlay["keep"]]
        for point in _mounts_below(tops, [*keep, *(src for _, src, _ in late)]):
            if libc.umount2(point, MNT_DETACH) != 0 and ctypes.get_errno() not in (errno.EINVAL, errno.ENOENT):
                _check(-1, f"umount {point!r}")
        for overlay in spec.get("overlays", ()):
            target, options = os.fsencode(overlay["target"]), overlay["options"].encode()
            # Open the kept paths before the tmpfs covers them; bind them back through the fd.
            fds = [(os.open(os.fsencode(src), os.O_PATH), os.fsencode(rel), os.path.isdir(os.fsencode(src)))
                   for src, rel in overlay["keep"]]
            mount(b"tmpfs", target, b"tmpfs", MS_NOSUID | MS_NODEV, options)
            for fd, rel, is_dir in fds:
                dest = os.path.join(target, rel)
                if is_dir:
                    os.makedirs(dest, mode=0o755, exist_ok=True)
                else:
                    os.makedirs(os.path.dirname(dest), mode=0o755, exist_ok=True)
                    os.close(os.open(dest, os.O_CREAT | os.O_WRONLY, 0o644))
                mount(f"/proc/self/fd/{fd}".encode(), dest, None, MS_BIND | MS_REC, None)
                os.close(fd)
            if overlay["read_only"]:
                mount(None, target, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, options)
        for hidden in spec.get("hidden", ()):
            path = os.fsencode(hidden)
            if not os.path.lexists(path):
                continue  # under a private tmpfs already: nothing there to read
            if os.path.isdir(path):
                mount(b"tmpfs", path, b"tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, b"size=4k,mode=000")
            else:
                mount(b"/dev/null", path, None, MS_BIND, None)
                mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY, None)
        for fd, _, target in late:  # a target in a private temp dir: made in its fresh tmpfs
            bind(fd, target)
    parent = spec.get("parent_pid")
    if parent is not None and os.getppid() != parent:
        raise SetupError(0, f"the parent (pid {parent}) exited before the command started")
    if spec.get("unshare", 0) & CLONE_NEWPID:
        _check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")
        status_r, status_w = os.pipe()
        init = os.fork()
        if init:
            os.close(status_w)
            _end_as_the_run(init, status_r, spec.get("error_fd", -1), spec.get("report_fd", -1))
        os.close(status_r)
        # pid 1 of the run's own PID namespace: its own /proc, where only the run's processes are. It stays a
        # small init (reaps orphans, ignores what the run sends it) and the command is its child.
        mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
        command = os.fork()
        if command:
            _init(command, status_w, spec.get("error_fd", -1), spec.get("report_fd", -1))
        os.close(status_w)
        parent = None  # the init checked its parent; the command's parent is the init
    for which, soft, hard in spec.get("rlimits", ()):
        resource.setrlimit(which, (soft, hard))
    uid = spec.get("uid")
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    if spec.get("chdir"):
        os.chdir(os.fsencode(spec["chdir"]))
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
    # After the uid switch: a credential change clears the parent-death signal.
    _check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")
    if parent is not None and os.getppid() != parent:
        raise SetupError(0, f"the parent (pid {parent}) exited before the command started")
    # exec keeps ignored signals and the blocked mask: the command starts with the defaults.
    signal.pthread_sigmask(signal.SIG_SETMASK, ())
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            if signal.getsignal(sig) is not signal.SIG_DFL:
                signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError):
            continue


def _quiet(error_fd: int) -> None:
    """Close what the command alone holds: the error descriptor (its exec closes it: EOF) and the pipes."""
    if error_fd >= 0:
        os.close(error_fd)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)


def _init(command: int, status_w: int, error_fd: int, report_fd: int) -> None:
    """pid 1 of the run: reap every process until the command ends, hand its wait status to the launcher, exit.

    When pid 1 exits the kernel kills every other process of the namespace (``setsid``, ``nohup``, a double
    fork: none outlives the command); how many were left is written to ``report_fd`` first.
    """
    _quiet(error_fd)
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except InterruptedError:
            continue
        except ChildProcessError:
            status = 1 << 8
            break
        if pid == command:
            break
    if report_fd >= 0:
        left = 0
        for entry in os.listdir("/proc"):  # this namespace's own /proc: the run's processes only
            if entry.isdigit() and entry != "1":
                try:
                    with open(f"/proc/{entry}/stat", "rb") as fh:
                        left += fh.read().rsplit(b")", 1)[1].split()[0] != b"Z"
                except OSError:
                    continue
        os.write(report_fd, str(left).encode())
    os.write(status_w, status.to_bytes(4, "little"))
    os._exit(0)


def _end_as_the_run(init: int, status_r: int, error_fd: int, report_fd: int) -> None:
    """The launcher with a PID namespace: wait for the run's init, then end as the command ended.

    The exit status, or the signal (SIGXCPU, SIGKILL, ...), becomes the launcher's own, so the caller's ``wait4``
    reads the command's status and the CPU time of the whole run (usage of waited-for children adds up).
    """
    _quiet(error_fd)
    if report_fd >= 0:
        os.close(report_fd)  # the init's to write
    while True:
        try:
            os.waitpid(init, 0)
            break
        except InterruptedError:
            continue
    raw = os.read(status_r, 4)
    status = int.from_bytes(raw, "little") if len(raw) == 4 else 1 << 8
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, ())
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)  # a signal whose default is to go on (SIGCHLD, SIGWINCH): its number, as a shell says
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF)


def main(argv: list[str]) -> None:
    error_fd = -1
    try:
        if len(argv) < 1 or SPEC_ENV not in os.environ:
            raise SetupError(0, f"usage: {SPEC_ENV}=SPEC_JSON enter.py COMMAND [ARG ...]")
        spec = json.loads(os.environ.pop(SPEC_ENV))  # the command's environment is the caller's, without it
        error_fd = int(spec.get("error_fd", -1))
        if error_fd >= 0:
            os.set_inheritable(error_fd, False)  # closed by the exec: EOF tells the parent the command started
        if spec.get("report_fd", -1) >= 0:
            os.set_inheritable(spec["report_fd"], False)  # the init's, never the command's
        setup(spec)
        try:
            os.execvp(argv[0], argv)  # PATH comes from the environment the caller gave us
        except OSError as exc:
            raise SetupError(exc.errno, f"cannot execute {argv[0]!r}: {os.strerror(exc.errno or 0)}") from None
    except BaseException as exc:  # noqa: BLE001 - every failure is reported, then the launcher exits
        message = f"{type(exc).__name__}: {exc}".encode(errors="replace")[:4000]
        try:
            os.write(error_fd if error_fd >= 0 else 2, message)
        except OSError:
            pass
        os._exit(SETUP_FAILED)


if __name__ == "__main__":
    main(sys.argv[1:])
