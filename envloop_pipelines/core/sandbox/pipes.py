"""The pipes a local run's parent owns: stdout and stderr kept as tails, the result channel, stdin fed in.

Each is drained (or fed) by a thread of its own, so a command that floods one pipe never blocks on another,
and a hostile flood costs the parent a bounded buffer: :class:`Tail` keeps the last bytes and counts the rest,
:class:`Channel` records an overflow instead of cutting the result silently.
"""

from __future__ import annotations

import os
import threading


class Tail:
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


class Channel:
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


def feed(fd: int, data: bytes) -> threading.Thread:
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


__all__ = ["Channel", "Tail", "feed"]
