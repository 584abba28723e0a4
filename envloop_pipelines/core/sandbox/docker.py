"""The docker sandbox backend, through the docker SDK.

Threat model
============

Covered: every run is a fresh container with ``--network none``, a read-only
root filesystem, ``--cap-drop ALL``, ``no-new-privileges``, an unprivileged
user (``65534:65534`` by default), a memory limit with no extra swap, a CPU
share (``nano_cpus``), a pids limit, RLIMIT_CPU / RLIMIT_FSIZE / RLIMIT_NOFILE
as ulimits, a size-limited tmpfs on ``/tmp``, and a wall-clock limit after
which the container is killed. Nothing of the host is mounted: the working
directory travels in as a tar archive (``put_archive``) and, when the caller
gave one, back out (``get_archive``), so hidden host paths do not exist inside
(``hidden_paths_masked`` is true by construction). Stdin is written through
the attach socket; with ``SandboxCall(result_channel=True)`` the channel is
the container's stdout (``$ENVLOOP_RESULT_FD`` is 1), kept apart from stderr
by the engine.

Not covered: the container shares the host kernel (use a gVisor or Kata
``runtime`` for a stronger boundary); the engine's own socket is as powerful
as root, so whoever can reach it can undo all of this; CPU seconds used are
not reported (``cpu_s`` is 0.0 and the detail says so); ``/work`` is an
anonymous volume whose owner comes from the image: an image whose ``/work`` is
owned by the sandbox user lets the command write there (shell tasks need it),
a stock image gives a read-only ``/work`` (enough for a verifier worker).
The backend is exercised by the test suite only where an engine answers.
"""

from __future__ import annotations

import io
import logging
import shutil
import socket
import tarfile
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from envloop_pipelines.core.sandbox.base import (
    RESULT_FD_ENV,
    SandboxCall,
    SandboxLimits,
    SandboxResult,
    classify,
    setup_error,
)

log = logging.getLogger(__name__)

DEFAULT_IMAGE = "python:3.11-slim"
WORKDIR = "/work"
_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def _tar(root: Path | None, files: Mapping[str, bytes], uid: int, gid: int) -> bytes:
    """A tar of ``root``'s contents plus ``files``, owned by the sandbox user."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        def owned(info: tarfile.TarInfo) -> tarfile.TarInfo:
            info.uid, info.gid, info.uname, info.gname = uid, gid, "", ""
            return info

        if root is not None:
            for entry in sorted(root.iterdir()):
                tar.add(entry, arcname=entry.name, filter=owned)
        for rel, data in files.items():
            if Path(rel).is_absolute() or ".." in Path(rel).parts:
                raise ValueError(f"file name {rel!r} must be a relative path inside the working directory")
            info = owned(tarfile.TarInfo(rel))
            info.size, info.mode, info.mtime = len(data), 0o644, int(time.time())
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _untar_into(stream: bytes, dest: Path) -> None:
    """Replace ``dest``'s contents with the archive of ``/work`` (its top folder stripped)."""
    for entry in dest.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    with tarfile.open(fileobj=io.BytesIO(stream), mode="r") as tar:
        members = []
        for m in tar.getmembers():
            parts = Path(m.name).parts
            if len(parts) <= 1:
                continue
            m.name = str(Path(*parts[1:]))
            members.append(m)
        # filter="data": no absolute paths, no links out of dest, no device files, no set-uid bits.
        tar.extractall(dest, members=members, filter="data")


def _split_signal(code: int | None) -> tuple[int | None, int | None]:
    """The engine reports death by signal N as exit status 128 + N."""
    if code is not None and 128 < code < 128 + 65:
        return None, code - 128
    return code, None


class DockerSandbox:
    """Runs commands in a fresh, locked-down container (see the threat model above).

    Args:
        limits: default limits.
        image: the image (it needs the command's interpreter; verifier workers need this project).
        client: a ``docker.DockerClient`` (default: ``docker.from_env()`` on the first run).
        user: ``uid:gid`` inside the container.
        cpus: CPU share (``nano_cpus``), besides the CPU-seconds ulimit.
        runtime: an OCI runtime name (``runsc`` for gVisor), or None for the engine's default.
        tmp_size_mb: size of the ``/tmp`` tmpfs.
    """

    backend = "docker"

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        *,
        image: str = DEFAULT_IMAGE,
        client: Any = None,
        user: str = "65534:65534",
        cpus: float = 1.0,
        runtime: str | None = None,
        tmp_size_mb: int = 64,
    ) -> None:
        self.limits = limits or SandboxLimits()
        self.image = image
        self._client = client
        uid, sep, gid = user.partition(":")
        if not (uid.isdigit() and sep and gid.isdigit()):
            raise ValueError(f"user must be 'uid:gid' with numbers, got {user!r}")
        if int(uid) == 0:
            raise ValueError("user must not be root (uid 0) in the docker sandbox")
        self.user, self.uid, self.gid = user, int(uid), int(gid)
        if cpus <= 0:
            raise ValueError(f"cpus must be positive, got {cpus}")
        self.cpus = cpus
        self.runtime = runtime
        self.tmp_size_mb = tmp_size_mb

    def client(self) -> Any:
        if self._client is None:
            import docker

            self._client = docker.from_env()
        return self._client

    def available(self) -> tuple[bool, str]:
        """Whether an engine answers, and why not."""
        try:
            self.client().ping()
        except Exception as exc:  # the SDK raises DockerException, requests errors, FileNotFoundError
            return False, f"{type(exc).__name__}: {exc}"
        return True, "ok"

    def capabilities(self) -> dict[str, Any]:
        ok, why = self.available()
        return {"backend": self.backend, "engine": ok, "detail": why, "network_isolated": True,
                "hidden_paths_masked": True, "image": self.image, "runtime": self.runtime}

    def create_kwargs(self, argv: Sequence[str], limits: SandboxLimits, env: Mapping[str, str], stdin: bool) -> dict[str, Any]:
        """The ``containers.create`` arguments: every isolation setting in one place (tests read it)."""
        from docker.types import Mount, Ulimit

        mb = 1024 * 1024
        cpu = max(1, int(round(limits.cpu_s)))
        kwargs: dict[str, Any] = {
            "image": self.image,
            "command": list(argv),
            "working_dir": WORKDIR,
            "user": self.user,
            "environment": dict(env),
            "network_mode": "none",
            "network_disabled": True,
            "read_only": True,
            "mem_limit": f"{limits.mem_mb}m",
            "memswap_limit": f"{limits.mem_mb}m",  # equal to mem_limit: no swap on top
            "nano_cpus": int(self.cpus * 1e9),
            "pids_limit": limits.nproc,
            "ulimits": [
                Ulimit(name="cpu", soft=cpu, hard=cpu + 1),
                Ulimit(name="fsize", soft=limits.fsize_mb * mb, hard=limits.fsize_mb * mb),
                Ulimit(name="nofile", soft=limits.nofile, hard=limits.nofile),
                Ulimit(name="core", soft=0, hard=0),
            ],
            "cap_drop": ["ALL"],
            "security_opt": ["no-new-privileges"],
            "tmpfs": {"/tmp": f"size={self.tmp_size_mb}m,mode=1777"},
            "mounts": [Mount(target=WORKDIR, source=None, type="volume")],
            "stdin_open": stdin,
            # detach=False with stdin_open makes the SDK set StdinOnce: stdin closes when our attach ends.
            "detach": not stdin,
            "labels": {"envloop.sandbox": "true"},
        }
        if self.runtime:
            kwargs["runtime"] = self.runtime
        return kwargs

    def run(self, argv: Sequence[str], call: SandboxCall | None = None) -> SandboxResult:
        """Run ``argv`` in a fresh container; see :meth:`envloop_pipelines.core.sandbox.base.Sandbox.run`.

        ``call.hidden_paths``, ``conceal``, ``binds`` and ``cwd`` need nothing here: no host path is mounted
        into the container.
        """
        call = call or SandboxCall()
        limits = call.limits or self.limits
        stdin, workdir = call.stdin, call.workdir
        if not argv:
            return setup_error(self.backend, "empty command", limits)
        ok, why = self.available()
        if not ok:
            return setup_error(self.backend, f"docker engine unavailable: {why}", limits)
        client = self.client()
        full_env = {"PATH": _PATH, "HOME": WORKDIR, "TMPDIR": "/tmp", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1",
                    "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", **dict(call.env)}
        if call.result_channel:
            full_env[RESULT_FD_ENV] = "1"
        root = None if workdir is None else Path(workdir)
        container = None
        started = time.monotonic()
        try:
            archive = _tar(root, call.files, self.uid, self.gid)
            container = client.containers.create(**self.create_kwargs(argv, limits, full_env, stdin is not None))
            container.put_archive(WORKDIR, archive)
            sock = None
            if stdin is not None:
                sock = client.api.attach_socket(container.id, params={"stdin": 1, "stream": 1})
            container.start()
            if sock is not None:
                raw = getattr(sock, "_sock", sock)
                try:
                    raw.sendall(stdin)
                    raw.shutdown(socket.SHUT_WR)
                except OSError:
                    pass  # the command exited without reading; its status says why
                finally:
                    sock.close()
            timed_out = False
            try:
                code = container.wait(timeout=limits.wall_s)["StatusCode"]
            except Exception:  # requests' ReadTimeout / ConnectionError: the wall limit passed
                timed_out = True
                container.kill()
                code = container.wait(timeout=30)["StatusCode"]
            wall = time.monotonic() - started
            container.reload()
            state = container.attrs.get("State", {})
            out = container.logs(stdout=True, stderr=False) or b""
            err = container.logs(stdout=False, stderr=True) or b""
            if root is not None:
                stream, _ = container.get_archive(WORKDIR)
                _untar_into(b"".join(stream), root)
        except Exception as exc:  # the engine refused something: a typed error, never a crash of the round
            log.warning("docker sandbox failed: %s", exc)
            return setup_error(self.backend, f"{type(exc).__name__}: {exc}", limits)
        finally:
            if container is not None:
                try:
                    container.remove(v=True, force=True)
                except Exception as exc:  # leave it to the engine's cleanup; say so
                    log.warning("could not remove container %s: %s", getattr(container, "id", "?"), exc)
        exit_code, sig = _split_signal(code)
        tail = limits.tail_bytes
        stdout_text = out[-tail:].decode("utf-8", errors="replace")
        stderr_text = err[-tail:].decode("utf-8", errors="replace")
        if state.get("OOMKilled"):
            status, detail = "memory_exceeded", f"the engine's OOM killer ended it at {limits.mem_mb} MiB"
        else:
            status, detail = classify(exit_code=exit_code, sig=sig, cpu_s=0.0, limits=limits, timed_out=timed_out,
                                      stderr=stderr_text, stdout=stdout_text)
        channel = None
        if call.result_channel:
            channel = out.decode("utf-8", errors="replace")
            if len(out) > limits.channel_bytes and status == "ok":
                status, detail = "error", f"the result channel carried more than {limits.channel_bytes} bytes"
        return SandboxResult(
            ok=status == "ok", exit_code=exit_code, signal=sig, status=status, wall_s=round(wall, 4), cpu_s=0.0,
            stdout_tail=stdout_text, stderr_tail=stderr_text, network_isolated=True, backend=self.backend, pid=0,
            hidden_paths_masked=True, uid=self.uid, processes_killed=0,
            detail=f"{detail} (docker reports no CPU seconds)", channel=channel, stdout_bytes=len(out),
            stderr_bytes=len(err), limits=limits.to_dict(),
        )


__all__ = ["DEFAULT_IMAGE", "DockerSandbox"]
