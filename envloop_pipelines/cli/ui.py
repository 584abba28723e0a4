"""``envloop ui``: ``dagster dev`` on this project's workspace (the Dagster UI and its daemon), run as one process
group that stops as a whole, on the instance in ``$DAGSTER_HOME``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import click


def dagster_home() -> Path:
    """``$DAGSTER_HOME`` with the package's instance file (:func:`envloop_pipelines.sdk.instance.dagster_home`)."""
    from envloop_pipelines.sdk.instance import dagster_home as home

    return home()


@click.command("ui")
@click.option("--port", type=int, default=3000, show_default=True)
@click.option("--host", default="127.0.0.1", show_default=True)
def ui(port: int, host: str) -> None:
    """Start `dagster dev` on this project's workspace (the Dagster UI and daemon)."""
    home = dagster_home()
    workspace = Path(__file__).resolve().parents[2] / "workspace.yaml"
    argv = [str(Path(sys.executable).with_name("dagster")), "dev", "-h", host, "-p", str(port)]
    argv += ["-w", str(workspace)] if workspace.exists() else ["-m", "envloop_pipelines.definitions"]
    click.echo(f"DAGSTER_HOME={home}; {' '.join(argv)}")
    raise SystemExit(run_process_group(argv))


def run_process_group(argv: list[str], *, grace_s: float = 20.0) -> int:
    """Run ``argv`` in its own process group and return its exit status; on SIGINT/SIGTERM (or any exit of ours)
    the whole group is stopped: ``dagster dev``'s webserver, daemon and code servers go with it.

    SIGTERM to the group first, SIGKILL to what is left after ``grace_s``.
    """
    import signal

    proc = subprocess.Popen(argv, start_new_session=True)

    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline:
                proc.poll()  # reap the leader: a zombie still counts as a member of its group
                try:
                    os.killpg(proc.pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.2)
            else:
                continue
            break
        proc.poll()


__all__ = ["dagster_home", "run_process_group", "ui"]
