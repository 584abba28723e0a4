"""``LoopClient``: what every client of the loop answers, here (:class:`~envloop_pipelines.sdk.local.LocalClient`)
or on a deployment (:class:`~envloop_pipelines.sdk.Client`).

The CLI drives the loop through this protocol only: ``envloop round start`` without ``--remote`` gets a
local client, with ``--remote URL`` the remote one, and prints what either returns.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

from envloop_pipelines.sdk.records import ReleaseInfo, RoundInfo, RoundRun, RunError, RunInfo


@runtime_checkable
class LoopClient(Protocol):
    """The loop's operations both clients implement (same names, same keyword arguments).

    Errors are the SDK's (:class:`~envloop_pipelines.sdk.ClientError` and its kinds; a round without a
    decision raises :class:`~envloop_pipelines.sdk.RoundFailed`).
    """

    @property
    def task(self) -> str:
        """The task the client's loop runs."""
        ...

    def is_set_up(self) -> bool:
        """Whether the noise floor (and so release 1) exists."""
        ...

    def setup(self, *, wait: bool = True, progress: bool = True) -> RunInfo:
        """Run the setup job (benchmark and noise floor)."""
        ...

    def promotion_warning(self) -> str | None:
        """Why no candidate can be promoted with the measured noise floor, or ``None``."""
        ...

    def start_round(self, hypothesis: Any = None, *, key: str | None = None,
                    tags: Mapping[str, str] | None = None) -> RoundRun:
        """Start the next round and return at once (follow it with :meth:`wait`); refused while a round of the task runs."""
        ...

    def probe(self) -> None:
        """Raise ``UnavailableError`` in seconds, naming the URL and its setting, when a server it uses is dead."""
        ...

    def ensure_no_round_running(self) -> None:
        """Raise ``RefusedError`` naming the round and its run while a round of the task runs."""
        ...

    def run_round(self, hypothesis: Any = None, *, progress: bool = True,
                  tags: Mapping[str, str] | None = None) -> RoundInfo:
        """Run the next round to its end and return it with its decision."""
        ...

    def wait(self, run_id: str, *, progress: bool = True, poll_s: float = 2.0, timeout_s: float | None = None,
             desc: str | None = None) -> RunInfo:
        """Follow a run until it ends; the run, whatever its status."""
        ...

    def cancel(self, run_id: str, *, wait: bool = True, timeout_s: float = 120.0) -> RunInfo:
        """Cancel a run: it ends ``CANCELED``, its round's MLflow runs ``KILLED``."""
        ...

    def run_loop(self, *, rounds: int, patience: int = 2, max_wall_s: float = 6 * 3600,
                 hypothesis: Any = None, progress: bool = True,
                 on_round: Callable[[RoundInfo], None] | None = None) -> list[RoundInfo]:
        """Run rounds while the budget lasts (``core.loop.budget.drive_loop``)."""
        ...

    def retry(self, run: Any, *, wait: bool = ..., progress: bool = True) -> Any:
        """Run a failed round again."""
        ...

    def run(self, run_id: str) -> RunInfo:
        """One Dagster run."""
        ...

    def run_error(self, run_id: str) -> RunError | None:
        """Why a run failed: the failed step's own error."""
        ...

    def decision(self, key: str) -> Any:
        """A round's decision, or ``None`` while it is undecided."""
        ...

    def rounds(self) -> list[RoundInfo]:
        """Every round with its latest run and its decision."""
        ...

    def ledger(self, kind: str | None = None) -> list[dict[str, Any]]:
        """The ledger's events, oldest first."""
        ...

    def releases(self, *, with_cards: bool = True) -> list[ReleaseInfo]:
        """The release chain, oldest first."""
        ...

    def release_cards(self) -> list[dict[str, Any]]:
        """The release chain as cards (the local ledger's shape), oldest first."""
        ...

    def predict(self, request: Any, *, url: str | None = None, release: int | str = "champion",
                api_key: str | None = None) -> Any:
        """A release's answers to a Jev request (or a list of them): served at ``url``, or in this process."""
        ...

    def close(self) -> None:
        """Stop what :meth:`predict` loaded in this process."""
        ...


#: The methods of :class:`LoopClient` (the test compares both clients' signatures on these).
LOOP_CLIENT_METHODS: tuple[str, ...] = ("probe", "is_set_up", "setup", "promotion_warning", "ensure_no_round_running",
                                        "start_round", "run_round", "wait",
                                        "cancel", "run_loop", "retry", "run", "run_error", "decision", "rounds",
                                        "ledger", "releases", "release_cards", "predict", "close")

__all__ = ["LOOP_CLIENT_METHODS", "LoopClient"]
