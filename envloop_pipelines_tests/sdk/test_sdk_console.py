"""What a person sees from the SDK in a notebook or a script (issue 37): the LocalClient's progress lines where
stderr is no terminal (the remote client printed them, the LocalClient nothing for ~15 min), the CLI's filters of
third-party noise on predict and fetch_checkpoint, and a malformed request refused in words, not raw 422 JSON."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from envloop_pipelines.sdk.errors import RefusedError
from envloop_pipelines.sdk.predict import answer


def _python(code: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("ENVLOOP_PROGRESS", "HF_HUB_DISABLE_PROGRESS_BARS", "MLFLOW_TRACKING_URI")}
    env.update(ENVLOOP_HOME=str(tmp_path / "home"), DAGSTER_HOME=str(tmp_path / "dagster"))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    return done


LOCAL_PROGRESS = """
import time
import dagster as dg
from envloop_pipelines.sdk.instance import watch_steps
with watch_steps(dg.DagsterInstance.ephemeral(), "no-such-run", 3, "setup", poll_s=0.2):
    time.sleep(1.6)
"""


def test_the_local_clients_progress_reaches_a_script_whose_stderr_is_no_terminal(tmp_path: Path) -> None:
    done = _python(LOCAL_PROGRESS, tmp_path)
    assert any(line.startswith("setup:   0% 0/3 step [") for line in done.stderr.splitlines()), done.stderr


FILTERS = """
import os, warnings
from envloop_pipelines.sdk.client import Client
from envloop_pipelines.sdk.errors import NotFoundError, UnavailableError
from envloop_pipelines.sdk.local import LocalClient

def installed():
    return (os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS") == "1"
            and any(f[1] is not None and "is_gradient_checkpointing" in f[1].pattern for f in warnings.filters))

assert not installed()
try:
    {call}
except ({error}) as exc:
    print(type(exc).__name__)
print(installed())
"""


@pytest.mark.parametrize("call,error", [
    ("LocalClient(task='personal_agent').predict({'state': {}, 'questions': {}}, release=7)", "NotFoundError"),
    ("Client('http://127.0.0.1:9', mlflow_uri='http://127.0.0.1:9').fetch_checkpoint(1, '.')", "UnavailableError"),
])
def test_predict_and_fetch_checkpoint_install_the_clis_filters(call: str, error: str, tmp_path: Path) -> None:
    done = _python(FILTERS.format(call=call, error=error), tmp_path)
    assert done.stdout.split() == [error, "True"], (done.stdout, done.stderr)


def test_a_malformed_request_is_refused_naming_each_field_and_its_reason() -> None:
    body = {"detail": [{"loc": ["body", "questions", "q1", "type"], "msg": "Input should be 'single_choice'",
                        "type": "literal_error"},
                       {"loc": ["body", "state"], "msg": "Field required", "type": "missing"}]}
    with pytest.raises(RefusedError) as refused:
        answer(lambda path, json: httpx.Response(422, json=body), {}, "in process")
    assert str(refused.value) == ("the server at in process answered 422: questions.q1.type: Input should be "
                                  "'single_choice'; state: Field required")
    with pytest.raises(RefusedError, match=r"answered 400: 12 tokens over the limit \(tokens_exceeded\)$"):
        answer(lambda path, json: httpx.Response(400, json={"detail": {"error_type": "tokens_exceeded",
                                                                       "message": "12 tokens over the limit"}}),
               {}, "in process")


def test_a_cancelled_round_is_called_cancelled_in_its_worker_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 37: the worker log of a round that ``LocalClient.cancel`` stopped said it failed."""
    import json

    from envloop_pipelines.sdk import worker
    from envloop_pipelines.sdk.errors import RoundFailed
    from envloop_pipelines.sdk.records import RunInfo
    from envloop_pipelines.sdk.local import LocalClient

    spec = tmp_path / "abc.json"
    spec.write_text(json.dumps({"settings": {"task": "personal_agent", "home": str(tmp_path)}, "key": "r0004",
                                "proposal": None, "run_id": "abc", "tags": {}}), encoding="utf-8")
    info = RunInfo(run_id="abc", job="round_job", status="CANCELED", partition="r0004", start_time=None,
                   end_time=None, created=None, tags={}, steps=())

    def cancelled(self: LocalClient, *args: object, **kwargs: object) -> None:
        raise RoundFailed("round r0004 failed; see `envloop ledger` and the Dagster run abc", info, None)

    monkeypatch.setattr(LocalClient, "run_round", cancelled)
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # quiet_third_party leaves what is set alone
    monkeypatch.setenv("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    monkeypatch.setenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    assert worker.main([str(spec)]) == 1
    err = capsys.readouterr().err.strip()
    assert err == "round r0004: cancelled (run abc ended CANCELED); `envloop round retry` runs it again", err
