"""The served model's life: lazy load, idle unload (scale to zero), reload on demand.

:class:`ModelHolder` owns the one :class:`DecisionModel` of a server. The first
request (or startup, with ``preload``) loads it; every load is a *cold start*,
timed, logged and counted. A watcher unloads the model once nobody has used it
for ``idle_timeout_s``: the model is dropped, the garbage collector runs, CUDA's
cache is emptied where there is one, and glibc's ``malloc_trim`` hands freed
heap pages back to the operating system, so the process's resident memory
actually falls. The next request loads it again and succeeds; it just waits
for the cold start.

A model in use (``async with holder.use() as dm``) is never unloaded: the
watcher unloads only while no one holds it.

The checkpoint is verified at every load (manifest, base model sha256), and
when the release card named a checkpoint sha256, the loaded checkpoint must
have it, so a directory changed on disk between loads is refused, not served.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import logging
import os
import time
from typing import AsyncIterator, Callable

from envloop_pipelines.core.model.predict import DecisionModel

log = logging.getLogger(__name__)


def resident_bytes() -> int | None:
    """The process's resident set size in bytes (Linux ``/proc``; None elsewhere)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def release_memory() -> None:
    """Collect garbage and hand freed memory back: CUDA's cache, then glibc's heap (``malloc_trim``)."""
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:  # pragma: no cover - torch is always there in practice  # noqa: BLE001
        log.debug("torch cache release skipped", exc_info=True)
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


class CheckpointMismatchError(RuntimeError):
    """The checkpoint on disk is not the one the release card names."""


class ModelHolder:
    """Load on demand, unload when idle (see the module docstring)."""

    def __init__(
        self,
        loader: Callable[[], DecisionModel],
        *,
        idle_timeout_s: float | None,
        expected_checkpoint_sha256: str | None = None,
        on_load: Callable[[float], None] | None = None,
        on_unload: Callable[[], None] | None = None,
    ) -> None:
        """
        Args:
            loader: Builds the model (runs in a worker thread).
            idle_timeout_s: Idle seconds before the model is unloaded; None never unloads.
            expected_checkpoint_sha256: The sha256 the loaded checkpoint must have (release card), or None.
            on_load: Called with the cold-start seconds after each load.
            on_unload: Called after each unload.
        """
        self._loader = loader
        self.idle_timeout_s = idle_timeout_s
        self.expected_checkpoint_sha256 = expected_checkpoint_sha256
        self._on_load = on_load
        self._on_unload = on_unload
        self._model: DecisionModel | None = None
        self._lock = asyncio.Lock()
        self._users = 0
        self._last_used = time.monotonic()
        self._loading = False
        self._watcher: asyncio.Task[None] | None = None
        self.cold_starts = 0
        self.unloads = 0
        self.last_cold_start_s: float | None = None
        #: The checkpoint's automation threshold and sha256, kept across unloads (same checkpoint every load).
        self.automation_threshold: float | None = None
        #: Its safety families' thresholds on P("false") (empty when it declares none).
        self.safety_thresholds: dict[str, float] = {}
        self.checkpoint_sha256: str | None = expected_checkpoint_sha256

    # ------------------------------------------------------------------ state

    @property
    def state(self) -> str:
        """``warm`` (loaded), ``loading``, or ``cold`` (scaled to zero: the next request loads it)."""
        if self._model is not None:
            return "warm"
        return "loading" if self._loading else "cold"

    @property
    def model(self) -> DecisionModel | None:
        return self._model

    @property
    def idle_seconds(self) -> float:
        return 0.0 if self._users else time.monotonic() - self._last_used

    # ------------------------------------------------------------------ load / unload

    async def ensure_loaded(self) -> DecisionModel:
        """The model, loading it first if it is cold (one load at a time; concurrent callers wait for it)."""
        if self._model is not None:
            return self._model
        async with self._lock:
            if self._model is not None:
                return self._model
            self._loading = True
            t0 = time.perf_counter()
            try:
                model = await asyncio.to_thread(self._loader)
            finally:
                self._loading = False
            if self.expected_checkpoint_sha256 and model.checkpoint_hash != self.expected_checkpoint_sha256:
                raise CheckpointMismatchError(
                    f"checkpoint sha256 {model.checkpoint_hash} differs from the release card's {self.expected_checkpoint_sha256}"
                )
            seconds = time.perf_counter() - t0
            self._model = model
            self.automation_threshold = float(model.calibration.automation_threshold)
            self.safety_thresholds = dict(getattr(model.calibration, "safety_thresholds", {}))
            self.checkpoint_sha256 = model.checkpoint_hash
            self._last_used = time.monotonic()
            self.cold_starts += 1
            self.last_cold_start_s = seconds
            log.info("cold start: model loaded in %.3f s (cold start #%d, rss %s bytes)", seconds, self.cold_starts, resident_bytes())
            if self._on_load is not None:
                self._on_load(seconds)
            return model

    @contextlib.asynccontextmanager
    async def use(self) -> AsyncIterator[DecisionModel]:
        """Hold the model (loading it if cold); it is not unloaded while held."""
        self._users += 1
        try:
            yield await self.ensure_loaded()
        finally:
            self._users -= 1
            self._last_used = time.monotonic()

    def unload(self, reason: str = "idle") -> bool:
        """Drop the model and release its memory; False when it was not loaded or is in use."""
        if self._model is None or self._users:
            return False
        before = resident_bytes()
        self._model = None
        release_memory()
        self.unloads += 1
        log.info("scaled to zero (%s): model unloaded, rss %s → %s bytes", reason, before, resident_bytes())
        if self._on_unload is not None:
            self._on_unload()
        return True

    # ------------------------------------------------------------------ the idle watcher

    async def start(self, *, preload: bool) -> None:
        """Load now when ``preload``; start the idle watcher when there is an idle timeout."""
        if preload:
            await self.ensure_loaded()
        if self.idle_timeout_s is not None:
            self._watcher = asyncio.create_task(self._watch(), name="envloop-serve-idle-watcher")

    async def _watch(self) -> None:
        assert self.idle_timeout_s is not None
        period = min(1.0, max(0.05, self.idle_timeout_s / 4))
        while True:
            await asyncio.sleep(period)
            if self._model is not None and not self._users and not self._lock.locked() and self.idle_seconds >= self.idle_timeout_s:
                self.unload("idle")

    async def stop(self) -> None:
        """Stop the watcher and unload."""
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
            self._watcher = None
        self.unload("shutdown")


__all__ = ["CheckpointMismatchError", "ModelHolder", "release_memory", "resident_bytes"]
