"""What the local backend can enforce on this host, and how it starts a run behind the launcher.

:func:`launch_spec` is the JSON :mod:`.enter` applies (namespaces, overlays, rlimits, the uid);
:func:`start_launcher` starts a command behind it; :func:`probe_host` tries each mechanism once in a
throw-away child and remembers what the host allows (:class:`HostSupport`).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from envloop_pipelines.core.sandbox import enter
from envloop_pipelines.core.sandbox.mounts import Overlay
from envloop_pipelines.core.sandbox.uids import DEFAULT_UID_RANGE

log = logging.getLogger(__name__)

#: The PATH of a run (the project's interpreter's folder goes first) and of the probes.
SAFE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


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


def launch_spec(*, unshare: int = 0, mount_ns: bool = False, overlays: Sequence[Overlay] = (),
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


def start_launcher(spec: Mapping[str, Any], argv: Sequence[str], *, env: Mapping[str, str] | None = None,
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
        with start_launcher(spec, ["/bin/sh", "-c", ":"], env={"PATH": SAFE_PATH}, stdin=subprocess.DEVNULL,
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
        "network_namespace": launch_spec(unshare=enter.CLONE_NEWNET),
        "mount_namespace": launch_spec(unshare=enter.CLONE_NEWNS, mount_ns=True,
                                        overlays=[Overlay(Path("/tmp"), "size=4k", (), False)]),
        "setuid": launch_spec(uid=DEFAULT_UID_RANGE[0]),
        # Its own /proc needs the mount namespace too.
        "pid_namespace": launch_spec(unshare=enter.CLONE_NEWNS | enter.CLONE_NEWPID, mount_ns=True),
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


__all__ = ["HostSupport", "SAFE_PATH", "launch_spec", "probe_host", "start_launcher"]
