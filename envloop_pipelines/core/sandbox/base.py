"""The sandbox protocol: limits in, one typed result out.

Every backend (:mod:`.local`, :mod:`.docker`, :mod:`.k8s`) runs a command
under :class:`SandboxLimits`, with the options of one :class:`SandboxCall`
(the same value for every backend), and answers with a :class:`SandboxResult`. A run
never raises for anything the command did (crash, timeout, memory, a hostile
fork bomb) and never reports a silent zero: the status names what happened and
the flags say which isolation the host actually gave; :func:`classify` names
that status from what ended the command, the same way for every backend.

The result channel
    A verdict must not depend on anything the sandboxed process can write
    besides the channel its parent owns. With ``SandboxCall(result_channel=True)``
    the backend opens a pipe (local) or uses the container's stdout (docker,
    k8s) and tells the command its number in ``$ENVLOOP_RESULT_FD``; what
    arrives there is :attr:`SandboxResult.channel`. Files in the working
    directory are never read back as a result.
"""

from __future__ import annotations

import json
import math
import signal
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, Mapping, Protocol, Sequence, runtime_checkable

SandboxStatus = Literal["ok", "error", "timeout", "cpu_limit", "memory_exceeded", "killed", "file_size_exceeded"]
SANDBOX_STATUSES: tuple[str, ...] = (
    "ok", "error", "timeout", "cpu_limit", "memory_exceeded", "killed", "file_size_exceeded",
)
BACKENDS: tuple[str, ...] = ("local", "docker", "k8s")
#: The environment variable naming the result channel's file descriptor inside the sandbox.
RESULT_FD_ENV = "ENVLOOP_RESULT_FD"
#: stdout/stderr keep their last 8 KiB: enough for a traceback, bounded for a hostile flood.
DEFAULT_TAIL_BYTES = 8 * 1024
#: The result channel holds a whole verifier report (per-item scores of ~10^5 questions is ~20 MiB).
DEFAULT_CHANNEL_BYTES = 64 * 1024 * 1024
# What a command prints when a limit ended it without a signal (RLIMIT_AS and RLIMIT_FSIZE make calls fail).
_MEMORY_MARKERS = ("MemoryError", "std::bad_alloc", "Cannot allocate memory", "out of memory", "xmalloc: cannot allocate",
                   "failed to map segment from shared object")
_FSIZE_MARKERS = ("File too large", "[Errno 27]", "File size limit exceeded")
_CPU_MARKERS = ("CPU time limit exceeded",)  # a shell reporting its child's SIGXCPU (exit 152)


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one sandboxed run.

    Attributes:
        cpu_s: CPU seconds per process (RLIMIT_CPU soft limit; SIGXCPU, then SIGKILL one second later).
        mem_mb: address space per process in MiB (RLIMIT_AS; a container's memory limit in docker/k8s).
            Python with numpy + pyarrow + scipy maps ~1.2 GiB of address space before doing anything,
            so verifier workers need ~2048; a shell script needs far less.
        wall_s: wall-clock seconds for the whole run; then the process group and every process of
            the run's uid are killed.
        fsize_mb: largest file the run may write, in MiB (RLIMIT_FSIZE).
        nofile: open file descriptors per process (RLIMIT_NOFILE).
        nproc: processes (and threads) of the run's uid (RLIMIT_NPROC; a pids limit in docker/k8s).
        tail_bytes: how much of stdout and stderr the result keeps (the tail).
        channel_bytes: the most the result channel may carry; more is an error, never truncated silently.
    """

    cpu_s: float = 10.0
    mem_mb: int = 2048
    wall_s: float = 30.0
    fsize_mb: int = 64
    nofile: int = 256
    nproc: int = 64
    tail_bytes: int = DEFAULT_TAIL_BYTES
    channel_bytes: int = DEFAULT_CHANNEL_BYTES

    def __post_init__(self) -> None:
        for name in ("cpu_s", "wall_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"SandboxLimits.{name} must be a positive finite number of seconds, got {value!r}")
        for name in ("mem_mb", "fsize_mb", "nofile", "nproc", "tail_bytes", "channel_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"SandboxLimits.{name} must be a positive integer, got {value!r}")
        if self.nofile < 8:
            raise ValueError(f"SandboxLimits.nofile must be at least 8 (stdio, the result pipe, a few files), got {self.nofile}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "SandboxLimits":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"unknown SandboxLimits field(s) {unknown}; allowed: {', '.join(sorted(known))}")
        return cls(**dict(raw))


@dataclass(frozen=True)
class SandboxResult:
    """What one sandboxed run did. JSON-serialisable (:meth:`to_dict`).

    Attributes:
        ok: the command exited 0 within every limit.
        exit_code: its exit status, or None when a signal ended it.
        signal: the signal that ended it, or None.
        status: ``ok``, ``error`` (non-zero exit or a sandbox setup failure; see ``detail``),
            ``timeout`` (killed at the wall limit), ``cpu_limit``, ``memory_exceeded``,
            ``killed`` (another signal), ``file_size_exceeded``.
        wall_s: wall-clock seconds from start to the last process gone.
        cpu_s: user + system CPU seconds of the command and the children it waited for.
        stdout_tail: the last ``tail_bytes`` of stdout (UTF-8, invalid bytes replaced).
        stderr_tail: the last ``tail_bytes`` of stderr.
        network_isolated: the command ran in a network namespace of its own (or ``--network none``).
        backend: ``local``, ``docker`` or ``k8s``.
        pid: the process id of the command, or of the local launcher that runs it in a PID namespace of its
            own (the process group the sandbox kills; the command is pid 2 there). Docker and k8s report 0.
        hidden_paths_masked: the hidden paths (verifier labels, the EnvLoop home's verifier dir)
            were masked by a mount namespace (local) or never mounted (docker, k8s).
        uid: the uid the command ran as (a fresh one per run on the local backend when root).
        processes_killed: processes still alive at the end that the sandbox killed (stray
            background jobs, a fork bomb's children).
        detail: why the status is what it is, in words.
        channel: what arrived on the result channel (``result_channel=True``), else None.
        stdout_bytes: total bytes written to stdout (the tail keeps the last ``tail_bytes``).
        stderr_bytes: total bytes written to stderr.
        limits: the limits the run had.
    """

    ok: bool
    exit_code: int | None
    signal: int | None
    status: SandboxStatus
    wall_s: float
    cpu_s: float
    stdout_tail: str
    stderr_tail: str
    network_isolated: bool
    backend: str
    pid: int
    hidden_paths_masked: bool = False
    uid: int | None = None
    processes_killed: int = 0
    detail: str = ""
    channel: str | None = None
    stdout_bytes: int = 0
    stderr_bytes: int = 0
    limits: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.status not in SANDBOX_STATUSES:
            raise ValueError(f"SandboxResult.status must be one of {', '.join(SANDBOX_STATUSES)}, got {self.status!r}")
        if self.ok != (self.status == "ok"):
            raise ValueError(f"SandboxResult.ok={self.ok} contradicts status {self.status!r}")

    def to_dict(self, *, include_channel: bool = True) -> dict[str, Any]:
        out = asdict(self)
        out["limits"] = dict(self.limits)
        if not include_channel:
            out.pop("channel")
        return out

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "SandboxResult":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in known})


@dataclass(frozen=True)
class SandboxCall:
    """The options of one sandboxed run: one value every backend's ``run`` takes, whatever the backend.

    Options a backend has no use for are read as their defaults or ignored, never refused by the caller's
    branching on the backend: the docker and k8s backends mount no host path, so ``hidden_paths``,
    ``conceal``, ``binds`` and ``cwd`` need nothing there.

    Attributes:
        limits: the limits (None: the sandbox's own).
        stdin: bytes fed to the command's stdin (then closed); None gives an empty stdin.
        workdir: a host directory the command runs in and whose changes persist (the state a terminal-state
            check inspects); None gives a fresh temporary directory, removed after.
        files: files to write into the working directory first (relative path → bytes).
        env: extra environment variables; the rest of the environment is scrubbed.
        result_channel: open the result channel (:data:`RESULT_FD_ENV`) and return what arrives.
        hidden_paths: host paths that must not be readable from inside, besides the sandbox's own.
        conceal: local: host paths replaced by an empty read-only folder, but for the interpreter's paths and
            the working directory under them, which are bound back (an episode conceals the checkout and the
            home). Needs a mount namespace; ignored without one.
        binds: local: ``{absolute path inside: folder under the working directory}``, where that folder also
            appears (a Harbor task's ``/app``). A path that does not exist is made as an empty folder (a mount
            point); what the host has there is covered inside. Needs a mount namespace; ignored without one.
        cwd: local: where the command starts (one of the ``binds``; ``HOME`` and ``TMPDIR`` too).
        package_on_path: local: the command imports ``envloop_pipelines`` from the folder this process imports
            it from (put on ``PYTHONPATH``, after ``env``; the sandbox scrubs the caller's), installed or a
            checkout; docker and k8s run their image's own install.
    """

    limits: SandboxLimits | None = None
    stdin: bytes | None = None
    workdir: str | Path | None = None
    files: Mapping[str, bytes] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)
    result_channel: bool = False
    hidden_paths: Sequence[str | Path] = ()
    conceal: Sequence[str | Path] = ()
    binds: Mapping[str, str | Path] = field(default_factory=dict)
    cwd: str | None = None
    package_on_path: bool = False

    def __post_init__(self) -> None:
        if self.limits is not None and not isinstance(self.limits, SandboxLimits):
            raise TypeError(f"SandboxCall.limits must be SandboxLimits or None, got {type(self.limits).__name__}")
        # Copies: the value stays what the caller built, whatever the caller's own objects do afterwards.
        object.__setattr__(self, "files", dict(self.files or {}))
        object.__setattr__(self, "env", dict(self.env or {}))
        object.__setattr__(self, "binds", dict(self.binds or {}))
        object.__setattr__(self, "hidden_paths", tuple(self.hidden_paths or ()))
        object.__setattr__(self, "conceal", tuple(self.conceal or ()))


def setup_error(backend: str, detail: str, limits: SandboxLimits, *, network_isolated: bool = False) -> SandboxResult:
    """The result of a run that could not start: status ``error``, never an exception."""
    return SandboxResult(
        ok=False, exit_code=None, signal=None, status="error", wall_s=0.0, cpu_s=0.0, stdout_tail="",
        stderr_tail="", network_isolated=network_isolated, backend=backend, pid=0, detail=f"setup: {detail}",
        limits=limits.to_dict(),
    )


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


@runtime_checkable
class Sandbox(Protocol):
    """Runs one command in isolation and reports a :class:`SandboxResult`."""

    backend: str

    def run(self, argv: Sequence[str], call: SandboxCall | None = None) -> SandboxResult:
        """Run ``argv`` and wait for it and every process it started.

        Args:
            argv: the command and its arguments (no shell).
            call: the run's options (:class:`SandboxCall`); None gives the defaults (the sandbox's own limits,
                an empty stdin, a fresh temporary working directory, no result channel).
        """
        ...

    def capabilities(self) -> dict[str, Any]:
        """What this backend can enforce on this host (network isolation, hiding paths, ...)."""
        ...
