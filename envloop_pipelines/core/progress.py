"""Progress of long work: a bar on a terminal, a line every few percent or every 30 s anywhere else.

One reporter for everything a person waits on (training steps, prediction batches, records
imported, users generated, the steps of a round). The same figures go to both places: done and
total, percent, elapsed time, rate and ETA.

* **Terminal** (the stream is a TTY): a ``tqdm`` bar on stderr.
* **Logs** (always, at the log cadence): INFO records on the logger ``envloop_pipelines.progress``
  (:data:`LOGGER`), one when the work crosses another :data:`EVERY_PCT` percent and at least once
  every :data:`EVERY_S` seconds, and one at the end, e.g.::

      train: 40% 8/20 step [00:12<00:18, 0.67 step/s] loss=0.6931

  Work shorter than :data:`QUIET_S` logs nothing, so a served request or a small test stays
  silent. Where the records go is the caller's choice: the CLI prints them on stderr when stderr
  is not a terminal (:func:`log_to_stream`); a Dagster instance that manages the logger
  (``python_logs.managed_python_loggers`` in ``dagster.yaml``) puts them in the run's event log.

``ENVLOOP_PROGRESS`` overrides the choice of the bar: ``auto`` (default: a bar when the stream is a
TTY), ``bar``, ``log`` (never a bar) or ``off`` (neither bar nor records).

No Dagster import here (core); ``transformers`` only inside :func:`trainer_callback`.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import IO, Any, TypeVar

LOGGER = "envloop_pipelines.progress"
log = logging.getLogger(LOGGER)

#: A log line each time the work crosses another multiple of this many percent ...
EVERY_PCT = 5.0
#: ... and at least this often (seconds), whatever the percent.
EVERY_S = 30.0
#: Work that ends within this many seconds logs nothing (and shows no bar).
QUIET_S = 1.0
MODE_ENV = "ENVLOOP_PROGRESS"
MODES = ("auto", "bar", "log", "off")

T = TypeVar("T")


def _clock(seconds: float | None) -> str:
    """``mm:ss`` or ``h:mm:ss`` (tqdm's format); ``?`` when unknown."""
    if seconds is None or not math.isfinite(seconds):
        return "?"
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


@dataclass(frozen=True)
class Figures:
    """Where a piece of work stands."""

    desc: str
    unit: str
    n: float
    total: float | None
    elapsed_s: float
    postfix: Mapping[str, Any]

    @property
    def rate(self) -> float | None:
        """Units per second so far (``None`` before any time has passed)."""
        return self.n / self.elapsed_s if self.elapsed_s > 0 else None

    @property
    def fraction(self) -> float | None:
        return min(1.0, self.n / self.total) if self.total else None

    @property
    def eta_s(self) -> float | None:
        """Seconds left at the rate so far (``None`` without a total or a rate)."""
        rate = self.rate
        if self.total is None or not rate:
            return None
        return max(0.0, (self.total - self.n) / rate)

    def line(self) -> str:
        """``desc: 40% 8/20 step [00:12<00:18, 0.67 step/s] loss=0.6931``."""
        rate = self.rate
        speed = f"{rate:.2f} {self.unit}/s" if rate is not None else f"? {self.unit}/s"
        n = f"{self.n:g}"
        if self.total is not None:
            head = f"{self.desc}: {math.floor(100 * (self.fraction or 0)):3d}% {n}/{self.total:g} {self.unit}"
            times = f"[{_clock(self.elapsed_s)}<{_clock(self.eta_s)}, {speed}]"
        else:
            head = f"{self.desc}: {n} {self.unit}"
            times = f"[{_clock(self.elapsed_s)}, {speed}]"
        tail = " ".join(f"{k}={_fmt(v)}" for k, v in self.postfix.items() if v not in ("", None))
        return f"{head} {times}" + (f" {tail}" if tail else "")


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _terminal_size(stream: IO[str]) -> tuple[int, int]:
    """``(columns, rows)`` of the terminal behind ``stream`` (0 for what it does not report)."""
    try:
        size = os.get_terminal_size(stream.fileno())
        return size.columns, size.lines
    except (AttributeError, OSError, ValueError):
        return 0, 0


def _terminal_width(stream: IO[str]) -> int:
    """The columns of the terminal behind ``stream`` (0 when it reports none)."""
    return _terminal_size(stream)[0]


def mode(stream: IO[str] | None = None) -> str:
    """``bar``, ``log`` or ``off`` for ``stream`` (default stderr), after ``ENVLOOP_PROGRESS``.

    Raises:
        ValueError: ``ENVLOOP_PROGRESS`` is not one of :data:`MODES`.
    """
    chosen = (os.environ.get(MODE_ENV) or "auto").strip().lower()
    if chosen not in MODES:
        raise ValueError(f"{MODE_ENV}={chosen!r} is not a progress mode; allowed: {', '.join(MODES)}")
    if chosen != "auto":
        return chosen
    stream = stream if stream is not None else sys.stderr
    try:
        return "bar" if stream is not None and stream.isatty() else "log"
    except (AttributeError, ValueError):  # a closed or odd stream
        return "log"


class Progress:
    """One piece of work: ``update()`` as it goes, ``close()`` at the end (or use it as a context manager).

    Args:
        desc: What is being done (``train``, ``predict``, ``import``, ``round r0003``).
        total: How many units make the whole (``None`` when unknown: no percent, no ETA).
        unit: The unit's name (``step``, ``q``, ``record``).
        stream: Where the bar goes (default stderr); log records go to :data:`LOGGER`.
        every_pct: A log line each time another ``every_pct`` percent is done.
        every_s: A log line at least this often.
        quiet_s: Nothing at all for work that ends sooner.
    """

    def __init__(self, desc: str, total: float | None = None, unit: str = "it", *, stream: IO[str] | None = None,
                 every_pct: float = EVERY_PCT, every_s: float = EVERY_S, quiet_s: float = QUIET_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if total is not None and total < 0:
            raise ValueError(f"progress total must be ≥ 0, got {total}")
        if every_pct <= 0 or every_s <= 0:
            raise ValueError(f"every_pct and every_s must be > 0, got {every_pct}, {every_s}")
        self.desc, self.total, self.unit = desc, total, unit
        self.every_pct, self.every_s, self.quiet_s = every_pct, every_s, quiet_s
        self._clock = clock
        self._started = clock()
        self._last_line = self._started
        self._last_mark = 0
        self._n: float = 0
        self._last_n: float = 0
        self._postfix: dict[str, Any] = {}
        self._lines = 0
        self._closed = False
        self._lock = threading.Lock()
        self._mode = mode(stream)
        self._bar = None
        if self._mode == "bar":
            from tqdm import tqdm

            out = stream if stream is not None else sys.stderr
            width, rows = _terminal_size(out)
            # A terminal that reports no size (a fresh pseudo-terminal) would get an empty bar from tqdm: 80 columns;
            # one that reports 0 rows, no bar at all (tqdm hides bars below the last row): a fixed size then.
            # leave=None: a bar inside another (training inside a round) vanishes when done; the outer one stays.
            dynamic = bool(width and rows)
            self._bar = tqdm(total=total, desc=desc, unit=unit, file=out, delay=quiet_s, leave=None, mininterval=0.2,
                             dynamic_ncols=dynamic, ncols=None if dynamic else (width or 80),
                             nrows=None if dynamic else (rows or 24))

    @property
    def n(self) -> float:
        return self._n

    def figures(self) -> Figures:
        return Figures(self.desc, self.unit, self._n, self.total, self._clock() - self._started, dict(self._postfix))

    def update(self, n: float = 1, **postfix: Any) -> None:
        """``n`` more units done; ``postfix`` figures (``loss=0.69``) are shown beside the counts."""
        with self._lock:
            if self._closed:
                return
            self._n += n
            if postfix:
                self._postfix.update(postfix)
            if self._bar is not None:
                if postfix:
                    self._bar.set_postfix({k: _fmt(v) for k, v in self._postfix.items() if v not in ("", None)},
                                          refresh=False)
                self._bar.update(n)
            self._maybe_log()

    def set_postfix(self, **postfix: Any) -> None:
        """Figures shown beside the counts (the latest loss, the step that runs)."""
        self.update(0, **postfix)

    def set_total(self, total: float | None) -> None:
        """The total, once it is known."""
        with self._lock:
            self.total = total
            if self._bar is not None:
                self._bar.total = total
                self._bar.refresh()

    def _maybe_log(self) -> None:
        if self._mode == "off":
            return
        now = self._clock()
        if now - self._started < self.quiet_s:
            return
        fraction = self.figures().fraction
        mark = int((fraction or 0.0) * 100 // self.every_pct) if fraction is not None else self._last_mark
        if mark > self._last_mark or now - self._last_line >= self.every_s:
            self._emit(now, mark)

    def _emit(self, now: float, mark: int) -> None:
        self._last_line, self._last_mark, self._last_n = now, mark, self._n
        self._lines += 1
        log.info(self.figures().line())

    def close(self) -> None:
        """The end: a last log line (unless the work was too short to mention) and the bar closed."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            now = self._clock()
            said = self._lines and self._last_n == self._n  # the last line already has these counts
            if self._mode != "off" and not said and (now - self._started >= self.quiet_s or self._lines):
                self._emit(now, self._last_mark)
            if self._bar is not None:
                self._bar.close()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def track(iterable: Iterable[T], desc: str, *, total: float | None = None, unit: str = "it",
          weight: Callable[[T], float] | None = None, **kwargs: Any) -> Iterator[T]:
    """Yield from ``iterable``, reporting each item as done once the loop body has run.

    Args:
        total: The whole (default ``len(iterable)`` when it has one).
        weight: Units an item counts for (default 1): a batch's size, say.
        kwargs: Passed to :class:`Progress`.
    """
    if total is None and hasattr(iterable, "__len__"):
        total = len(iterable)  # type: ignore[arg-type]
    with Progress(desc, total, unit, **kwargs) as bar:
        for item in iterable:
            yield item
            bar.update(weight(item) if weight is not None else 1)


def trainer_callback(desc: str = "train", *, loss: Callable[[], float | None] | None = None) -> Any:
    """A ``transformers.TrainerCallback`` reporting optimizer steps on the main process.

    Args:
        desc: The work's name in the bar and the lines.
        loss: Returns the latest training loss, shown beside the counts (the Trainer logs its loss
            only every ``logging_steps``; the caller usually has it at every step).
    """
    from transformers import TrainerCallback

    class _ProgressCallback(TrainerCallback):
        def __init__(self) -> None:
            self.bar: Progress | None = None

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.is_world_process_zero:
                self.bar = Progress(desc, total=state.max_steps or None, unit="step")

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self.bar is not None:
                latest = loss() if loss is not None else None
                extra = {"loss": float(latest)} if latest is not None else {}
                self.bar.update(state.global_step - self.bar.n, **extra)

        def on_log(self, args: Any, state: Any, control: Any, logs: Mapping[str, Any] | None = None,
                   **kwargs: Any) -> None:
            if self.bar is not None and logs and "loss" in logs:
                self.bar.set_postfix(loss=float(logs["loss"]))

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self.bar is not None:
                self.bar.close()
                self.bar = None

    return _ProgressCallback()


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a record comes (a test runner swaps it per command)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property  # type: ignore[override]
    def stream(self) -> IO[str]:
        return sys.stderr

    @stream.setter
    def stream(self, value: IO[str]) -> None:
        pass


def log_to_stream(stream: IO[str] | None = None) -> None:
    """Print progress records on ``stream`` (default stderr) as bare lines, and not through the root logger.

    For a command whose stderr is not a terminal (a log file, CI): the bar is off there, so the
    lines are how a person sees the work move. A second call replaces the first one's stream.
    """
    for old in [h for h in log.handlers if getattr(h, "_envloop_progress", False)]:
        log.removeHandler(old)
    handler = logging.StreamHandler(stream) if stream is not None else _StderrHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    handler._envloop_progress = True  # type: ignore[attr-defined]
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


def ensure_shown(stream: IO[str] | None = None) -> bool:
    """Make sure progress lines reach a person: in ``log`` mode with nothing to print :data:`LOGGER`'s records
    (no handler on it or above it: a notebook, a plain script), print them on ``stream`` (default stderr).

    For a library call a person watches (``Client.wait``): a command line or a Dagster run has set up its own
    handlers, and those are left alone. Returns whether a handler was added.
    """
    if mode(stream) != "log":
        return False
    logger: logging.Logger | None = log
    while logger is not None:
        if any(not isinstance(h, logging.NullHandler) for h in logger.handlers):
            return False
        logger = logger.parent if logger.propagate else None
    log_to_stream(stream)
    return True


def configure_command_line(stream: IO[str] | None = None) -> str:
    """Set up progress for a command: a bar on a terminal, bare lines on ``stream`` otherwise.

    Either way the records stay off the root logger (no second copy beside the bar or the lines);
    a Dagster run in the same process still receives them, through the handler it attaches to
    :data:`LOGGER` when its instance manages that logger. Returns the mode (``bar``, ``log``, ``off``).
    """
    chosen = mode(stream)
    if chosen == "log":
        log_to_stream(stream)
    log.propagate = False
    return chosen


__all__ = ["EVERY_PCT", "EVERY_S", "LOGGER", "MODES", "MODE_ENV", "QUIET_S", "Figures", "Progress", "configure_command_line",
           "ensure_shown", "log_to_stream", "mode", "track", "trainer_callback"]
