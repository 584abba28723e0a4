"""In process, no model: settings validation, keys, release resolution, the CLI's refusals, the lifecycle's guards."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner
from starlette.testclient import TestClient

from envloop_pipelines.cli.serve import serve
from envloop_pipelines.core.ledger.ledger import Ledger
from envloop_pipelines.core.serve.app import create_app
from envloop_pipelines.core.serve.lifecycle import CheckpointMismatchError, ModelHolder
from envloop_pipelines.core.serve.settings import (
    ServeSettings,
    SettingsError,
    load_api_keys,
    settings_for,
    source_from_release,
)


def _settings(tmp_path: Path, **kw) -> ServeSettings:
    return ServeSettings(**({"checkpoint_dir": tmp_path, "model_id": "envloop-t-r0001", "api_keys": ("k",)} | kw))


def test_settings_refuse_a_server_without_keys_unless_auth_is_off(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="no API keys"):
        ServeSettings(checkpoint_dir=tmp_path, model_id="envloop-t-r0001")
    assert ServeSettings(checkpoint_dir=tmp_path, model_id="envloop-t-r0001", auth_off=True).auth_off
    assert "secret-key" not in repr(_settings(tmp_path, api_keys=("secret-key",)))  # keys never printed


@pytest.mark.parametrize("field, value, fragment", [
    ("model_id", "jev-latest", "not one of the aliases"),
    ("model_id", "has space", "model_id"),
    ("max_batch", 0, "max_batch"),
    ("idle_timeout_s", -1.0, "idle_timeout_s"),
    ("max_inflight_per_key", 0, "max_inflight_per_key"),
    ("state_token_budget", 100_000, "at most request_token_budget"),
    ("api_keys", ("has space",), "printable ASCII"),
])
def test_settings_name_the_bad_field(tmp_path: Path, field: str, value: object, fragment: str) -> None:
    with pytest.raises(SettingsError, match=fragment):
        _settings(tmp_path, **{field: value})


def test_keys_from_file_and_environment(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_text("# team keys\nalpha\n\n beta  # ci\nalpha\n", encoding="utf-8")
    assert load_api_keys(f, environ={"ENVLOOP_SERVE_KEYS": "gamma, delta beta"}) == ("alpha", "beta", "gamma", "delta")
    assert load_api_keys(None, environ={}) == ()


def _write_card(home: Path, task: str, release: int, ckpt: Path, sha: str) -> None:
    Ledger(task, home).write_release_card(
        release, {"release": release, "round": f"r{release + 3:04d}", "checkpoint_dir": str(ckpt), "checkpoint_sha256": sha},
        f"# release {release}\n")


def test_release_resolution_champion_and_numbers(tmp_path: Path) -> None:
    for n in (1, 2, 3):
        (tmp_path / f"ck{n}").mkdir()
        _write_card(tmp_path, "tickets", n, tmp_path / f"ck{n}", f"{n}" * 64)
    champion = source_from_release("tickets", "champion", home=tmp_path)
    assert (champion.release, champion.model_id, champion.checkpoint_dir) == (3, "envloop-tickets-r0003", tmp_path / "ck3")
    assert champion.expected_checkpoint_sha256 == "3" * 64
    second = source_from_release("tickets", 2, home=tmp_path)
    assert second.model_id == "envloop-tickets-r0002" and second.checkpoint_dir == tmp_path / "ck2"
    with pytest.raises(LookupError, match="no release 9"):
        source_from_release("tickets", 9, home=tmp_path)
    with pytest.raises(LookupError, match="no releases yet"):
        source_from_release("empty-task", "champion", home=tmp_path)
    s = settings_for(champion, api_keys=("k",))
    assert s.accepted_models == ("jev-latest", "jev-preview", "envloop-tickets-r0003")


def test_cli_refuses_unclear_sources_and_missing_keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ENVLOOP_SERVE_KEYS", raising=False)
    runner = CliRunner()
    r = runner.invoke(serve, [])
    assert r.exit_code == 2 and "nothing to serve" in r.output
    r = runner.invoke(serve, ["--checkpoint", str(tmp_path), "--task", "t"])
    assert r.exit_code == 2 and "not both" in r.output
    r = runner.invoke(serve, ["--task", "t", "--release", "latest", "--home", str(tmp_path)])
    assert r.exit_code == 2 and "'champion'" in r.output
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "manifest.json").write_text(json.dumps({"files": {"a": "0" * 64}}), encoding="utf-8")
    r = runner.invoke(serve, ["--checkpoint", str(ck)])
    assert r.exit_code == 2 and "no API keys" in r.output


def test_holder_refuses_a_checkpoint_that_is_not_the_release(tmp_path: Path) -> None:
    fake = SimpleNamespace(checkpoint_hash="a" * 64, calibration=SimpleNamespace(automation_threshold=0.9))
    holder = ModelHolder(lambda: fake, idle_timeout_s=None, expected_checkpoint_sha256="b" * 64)
    with pytest.raises(CheckpointMismatchError):
        asyncio.run(holder.ensure_loaded())
    ok = ModelHolder(lambda: fake, idle_timeout_s=None, expected_checkpoint_sha256="a" * 64)
    assert asyncio.run(ok.ensure_loaded()) is fake and ok.state == "warm" and ok.automation_threshold == 0.9
    assert ok.unload() and ok.state == "cold" and ok.automation_threshold == 0.9


def test_auth_off_accepts_requests_with_and_without_a_bearer_header(tmp_path: Path) -> None:
    app = create_app(ServeSettings(checkpoint_dir=tmp_path, model_id="envloop-t-r0001", auth_off=True, preload=False),
                     loader=lambda: None)
    with TestClient(app) as c:
        for headers in ({}, {"Authorization": "Bearer whatever"}, {"Authorization": "Basic xyz"}):
            assert c.get("/v1/models", headers=headers).status_code == 200
            assert c.get("/metrics", headers=headers).status_code == 200


def test_a_server_fault_is_a_500_in_the_contract_shape(tmp_path: Path) -> None:
    def broken() -> object:
        raise RuntimeError("disk on fire")

    app = create_app(_settings(tmp_path, preload=False, api_keys=("k",)), loader=broken)
    body = {"model": "jev-latest", "state": "s", "questions": {"q": {"type": "noul", "instructions": "?"}}}
    with TestClient(app, raise_server_exceptions=False) as c:
        assert c.get("/health").json()["state"] == "cold"
        r = c.post("/v1/systemone", json=body, headers={"Authorization": "Bearer k"})
        assert r.status_code == 500
        assert r.json() == {"detail": {"error_type": "unknown", "message": f"internal server error (request id {r.headers['x-request-id']})"}}
        bad = c.post("/v1/systemone", json={"state": "s"}, headers={"Authorization": "Bearer k"})
        assert bad.status_code == 422  # a bad request never reaches the broken model
