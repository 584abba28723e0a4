"""``envloop round cancel RUN_ID``: the CLI parses and prints; the client (local here) cancels."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import pytest
from click.testing import CliRunner

from envloop_pipelines.cli import main
from envloop_pipelines.names import HOST_TAG, PARTITION_TAG, PID_TAG
from envloop_pipelines_tests.test_cli_round_retry import _started_run


def test_an_unknown_run_is_named_and_exits_1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENVLOOP_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster"))
    result = CliRunner().invoke(main, ["round", "cancel", "no-such-run"])
    assert result.exit_code == 1 and "no run 'no-such-run'" in result.output


def test_a_run_whose_worker_is_gone_ends_canceled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    monkeypatch.setenv("ENVLOOP_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster"))
    from envloop_pipelines.sdk.instance import dagster_home

    dagster_home()
    instance = dg.DagsterInstance.get()
    # a worker pid that cannot exist (above the kernel's pid_max)
    run = _started_run(instance, {PARTITION_TAG: "r0001", HOST_TAG: socket.gethostname(), PID_TAG: str(2**22 + 1)})
    assert run.status == dg.DagsterRunStatus.STARTED
    result = CliRunner().invoke(main, ["round", "cancel", run.run_id])
    assert result.exit_code == 0, result.output
    assert f"run {run.run_id}: CANCELED (round r0001)" in result.output
    assert instance.get_run_by_id(run.run_id).status == dg.DagsterRunStatus.CANCELED
