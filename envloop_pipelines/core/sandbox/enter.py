"""The local sandbox's launcher: set up the isolation, then ``exec`` the command.

    python -I -S -B enter.py SPEC_JSON COMMAND [ARG ...]

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
propagation first), rlimits, the uid switch, ``PR_SET_NO_NEW_PRIVS``, the
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
import json
import os
import resource
import signal
import sys

# <sched.h>, <sys/mount.h>, <sys/prctl.h>
CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
#: Exit status of a launcher whose setup failed (the reason is on the error descriptor).
SETUP_FAILED = 121


class SetupError(OSError):
    """A setup step failed; the message names it."""


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    libc.unshare.argtypes = [ctypes.c_int]
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    return libc


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise SetupError(err, f"{what}: {os.strerror(err)}")


def setup(spec: dict) -> None:
    """Apply ``spec`` (built by :func:`envloop_pipelines.core.sandbox.local._launch_spec`) to this process."""
    libc = _libc()

    def mount(source: bytes | None, target: bytes, fstype: bytes | None, flags: int, data: bytes | None) -> None:
        _check(libc.mount(source, target, fstype, flags, data), f"mount {target!r}")

    if spec.get("unshare"):
        _check(libc.unshare(spec["unshare"]), f"unshare({spec['unshare']:#x})")
    if spec.get("mount_ns"):
        # Private propagation first: nothing mounted below reaches the host's namespace.
        mount(None, b"/", None, MS_REC | MS_PRIVATE, None)
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
        for src, dst in spec.get("binds", ()):
            # A folder of the working directory also at the path the task names (a Harbor task's /app): an
            # empty mount point is made where nothing is; what the host has there is covered here only.
            source, target = os.fsencode(src), os.fsencode(dst)
            if not os.path.isdir(target):
                os.makedirs(target, mode=0o755, exist_ok=True)
            mount(source, target, None, MS_BIND | MS_REC, None)
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
    parent = spec.get("parent_pid")
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


def main(argv: list[str]) -> None:
    error_fd = -1
    try:
        if len(argv) < 2:
            raise SetupError(0, "usage: enter.py SPEC_JSON COMMAND [ARG ...]")
        spec = json.loads(argv[0])
        error_fd = int(spec.get("error_fd", -1))
        if error_fd >= 0:
            os.set_inheritable(error_fd, False)  # closed by the exec: EOF tells the parent the command started
        setup(spec)
        try:
            os.execvp(argv[1], argv[1:])  # PATH comes from the environment the caller gave us
        except OSError as exc:
            raise SetupError(exc.errno, f"cannot execute {argv[1]!r}: {os.strerror(exc.errno or 0)}") from None
    except BaseException as exc:  # noqa: BLE001 - every failure is reported, then the launcher exits
        message = f"{type(exc).__name__}: {exc}".encode(errors="replace")[:4000]
        try:
            os.write(error_fd if error_fd >= 0 else 2, message)
        except OSError:
            pass
        os._exit(SETUP_FAILED)


if __name__ == "__main__":
    main(sys.argv[1:])
