"""Micro-batching: concurrent requests gathered into one forward pass.

Each request submits its questions and gets an ``asyncio.Future`` of its own.
One loop takes the oldest waiting request, then gathers more for at most
``max_wait_s`` (the *bounded wait*) or until ``max_batch`` questions (the
*bounded batch*; a request is never split, so a request larger than
``max_batch`` runs alone), and runs the whole batch in a single worker thread
(:func:`~envloop_pipelines.core.serve.inference.predict_jobs`: one ``predict``
call, whose questions are sorted by length and run ``forward_batch`` at a
time, so each forward pass pads little). Results come back as one list per request, in submission order, and
each list resolves that request's future, so answers never cross requests.
While a batch runs, new requests queue up and form the next batch: the busier
the server, the larger its batches. The wait is only spent while some other
request is on its way (received, being read and validated: see
:meth:`MicroBatcher.arriving`); a lone request runs at once instead of paying
``max_wait_s`` for company that is not coming.

Load shedding: at most ``max_queue`` questions may *wait* (the running batch
is not counted); a request that would push the waiting count past it is
refused at once with :class:`Overloaded`, carrying a ``Retry-After`` estimate
from the recent throughput, unless nothing is waiting (a lone request larger
than the queue is admitted rather than refused forever).

With ``enabled=False`` every request runs alone, immediately (the
"micro-batching off" arm of the benchmark).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import functools
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

from envloop_pipelines.core.model.readout import QuestionInput
from envloop_pipelines.core.serve.inference import predict_jobs
from envloop_pipelines.core.serve.lifecycle import ModelHolder

log = logging.getLogger(__name__)


class Overloaded(Exception):
    """The waiting queue is full; retry after ``retry_after_s`` seconds."""

    def __init__(self, retry_after_s: float, queued: int, capacity: int) -> None:
        super().__init__(f"overloaded: {queued} questions waiting (capacity {capacity}); retry after {retry_after_s:.0f} s")
        self.retry_after_s = retry_after_s
        self.queued = queued
        self.capacity = capacity


@dataclass
class _Job:
    questions: Sequence[QuestionInput]
    future: asyncio.Future[Any]
    enqueued: float = field(default_factory=time.perf_counter)

    @property
    def n(self) -> int:
        return len(self.questions)


class MicroBatcher:
    """Gather, run in one worker thread, resolve per request (see the module docstring)."""

    def __init__(
        self,
        holder: ModelHolder,
        *,
        max_batch: int = 64,
        forward_batch: int | None = None,
        max_wait_s: float = 0.005,
        max_queue: int = 256,
        enabled: bool = True,
        run: Callable[..., list[Any]] = predict_jobs,
        on_batch: Callable[[int, int, float, float], None] | None = None,
    ) -> None:
        """
        Args:
            holder: Gives the model (loading it when cold).
            max_batch: Questions per gathered batch (one ``run`` call).
            forward_batch: Questions per forward pass within it (default: ``max_batch``).
            max_wait_s: How long a batch's first request waits for company.
            max_queue: Questions allowed to wait.
            enabled: False runs every request alone.
            run: ``run(dm, jobs, batch_size=...)`` → one result or exception per job (runs in the worker thread).
            on_batch: Called after each batch with (questions, requests, seconds in the model, oldest wait in seconds).
        """
        self.holder = holder
        self.max_batch = max_batch
        self.forward_batch = forward_batch or max_batch
        self.max_wait_s = max_wait_s
        self.max_queue = max_queue
        self.enabled = enabled
        self._run_fn = run
        self._on_batch = on_batch
        self._queue: collections.deque[_Job] = collections.deque()
        self._queued_questions = 0
        self._running_questions = 0
        self._wake = asyncio.Event()
        self._arriving = 0
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="envloop-serve-model")
        self._task: asyncio.Task[None] | None = None
        self._throughput: float | None = None  # questions per second, exponential moving average

    # ------------------------------------------------------------------ state

    @property
    def queued_questions(self) -> int:
        """Questions waiting (not yet in a running batch)."""
        return self._queued_questions

    @property
    def running_questions(self) -> int:
        return self._running_questions

    def retry_after_s(self) -> float:
        """Seconds until the waiting questions are likely done (≥ 1, rounded up)."""
        if not self._throughput:
            return 1.0
        backlog = self._queued_questions + self._running_questions
        return float(min(60, max(1, math.ceil(backlog / self._throughput))))

    # ------------------------------------------------------------------ submit

    @contextlib.contextmanager
    def arriving(self) -> Iterator[None]:
        """Mark a request as on its way to :meth:`submit` (while its body is read and validated)."""
        self._arriving += 1
        try:
            yield
        finally:
            self._arriving -= 1
            self._wake.set()  # a gatherer waiting for this request stops waiting if it never comes

    def submit(self, questions: Sequence[QuestionInput]) -> asyncio.Future[Any]:
        """Queue one request's questions; its future resolves to that request's answers.

        Raises:
            Overloaded: the waiting queue would exceed ``max_queue`` questions.
            RuntimeError: the batcher is not running.
        """
        if self._task is None or self._task.done():
            raise RuntimeError("the batcher is not running")
        n = len(questions)
        if self._queued_questions > 0 and self._queued_questions + n > self.max_queue:
            raise Overloaded(self.retry_after_s(), self._queued_questions, self.max_queue)
        job = _Job(questions, asyncio.get_running_loop().create_future())
        self._queue.append(job)
        self._queued_questions += n
        self._wake.set()
        return job.future

    # ------------------------------------------------------------------ the loop

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="envloop-serve-batcher")

    async def stop(self, timeout_s: float = 30.0) -> None:
        """Finish what is queued (up to ``timeout_s``), then stop the loop and the worker thread."""
        deadline = time.monotonic() + timeout_s
        while (self._queue or self._running_questions) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        for job in self._queue:
            if not job.future.done():
                job.future.set_exception(RuntimeError("server shutting down"))
        self._queue.clear()
        self._executor.shutdown(wait=True, cancel_futures=True)

    async def _gather(self) -> list[_Job]:
        while not self._queue:
            self._wake.clear()
            await self._wake.wait()
        batch = [self._queue.popleft()]
        n = batch[0].n
        if self.enabled:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.max_wait_s
            while n < self.max_batch:
                if self._queue:
                    if n + self._queue[0].n > self.max_batch:
                        break
                    job = self._queue.popleft()
                    batch.append(job)
                    n += job.n
                    continue
                remaining = deadline - loop.time()
                if remaining <= 0 or self._arriving == 0:
                    break
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), remaining)
                except asyncio.TimeoutError:
                    break
        self._queued_questions -= n
        return batch

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [job for job in await self._gather() if not job.future.done()]  # done: the caller gave up
            if not batch:
                continue
            n = sum(job.n for job in batch)
            self._running_questions = n
            oldest_wait = time.perf_counter() - min(job.enqueued for job in batch)
            t0 = time.perf_counter()
            try:
                async with self.holder.use() as dm:
                    call = functools.partial(self._run_fn, dm, [job.questions for job in batch], batch_size=self.forward_batch)
                    results = await loop.run_in_executor(self._executor, call)
            except asyncio.CancelledError:
                for job in batch:
                    if not job.future.done():
                        job.future.set_exception(RuntimeError("server shutting down"))
                raise
            except Exception as exc:  # noqa: BLE001 - the batch's requests get the error; the loop goes on
                log.exception("batch of %d questions failed", n)
                for job in batch:
                    if not job.future.done():
                        job.future.set_exception(exc)
                continue
            finally:
                self._running_questions = 0
            seconds = time.perf_counter() - t0
            rate = n / seconds if seconds > 0 else None
            if rate:
                self._throughput = rate if self._throughput is None else 0.7 * self._throughput + 0.3 * rate
            for job, result in zip(batch, results, strict=True):
                if job.future.done():
                    continue
                if isinstance(result, Exception):
                    job.future.set_exception(result)
                else:
                    job.future.set_result(result)
            if self._on_batch is not None:
                self._on_batch(n, len(batch), seconds, oldest_wait)


__all__ = ["MicroBatcher", "Overloaded"]
