"""Issue 26: no agent breaks an evaluation, defeats teardown, or sees what another attempt or the host holds.

Each test names the attack; where an isolation claim is made, a control shows what would leak without it.
The agent is a stdlib HTTP server whose replies are raw bytes, so a reply can carry what FastAPI would refuse
to encode (the JSON escape ``"\\ud800"``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

import envloop_pipelines
from envloop_pipelines.core.agents.attempts import read_attempts
from envloop_pipelines.core.agents.client import AgentSpec
from envloop_pipelines.core.agents.evaluate import evaluate_agent
from envloop_pipelines.core.environments.episode import open_episode
from envloop_pipelines.core.environments.final_state import FINAL_STATE_TOTAL_BYTES, snapshot_files
from envloop_pipelines.core.sandbox import LocalSandbox, SandboxCall, probe_host
from envloop_pipelines.core.sandbox.tree import remove_tree
from envloop_pipelines.testing.environments import shell_env, spec_set
from envloop_pipelines.testing.scripted_agents import solution

needs_isolation = pytest.mark.skipif(not (probe_host().mount_namespace and probe_host().setuid),
                                     reason="needs root: mount namespaces and a fresh uid per command")


def _completion(message: dict) -> dict:
    return {"id": "x", "object": "chat.completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10}}


def _call(turn: int, command: str) -> bytes:
    return json.dumps(_completion({"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call_{turn}", "type": "function",
         "function": {"name": "bash", "arguments": json.dumps({"command": command})}}]})).encode()


#: model -> the raw reply bodies of its turns, in order (the last one repeats).
SCRIPTS: dict[str, list[bytes]] = {
    # Invalid UTF-8 in a name, NUL in a file and in the output, a huge output, then a reply holding a lone
    # surrogate (the JSON escape "\ud800", valid JSON, not valid Unicode).
    "bytes": [
        _call(0, "touch $'caf\\xe9.txt'; printf 'a\\0b' > nul.bin; printf 'x\\0\\0\\0y'; ls"),
        _call(1, "head -c 3000000 /dev/zero; seq 1 200000"),
        b'{"id":"x","object":"chat.completion","created":0,"model":"m","choices":[{"index":0,"message":'
        b'{"role":"assistant","content":"done \\ud800 caf\\udce9"},"finish_reason":"stop"}],'
        b'"usage":{"prompt_tokens":5,"completion_tokens":5}}',
    ],
    # Teardown attacks: a 1,500-deep tree, folders of mode 000.
    "deep": [
        _call(0, "mkdir -p \"$(printf 'd/%.0s' $(seq 1500))\" && mkdir -p u/v/w && touch u/v/w/f && "
                 "chmod 000 u/v/w u/v u && echo made"),
        json.dumps(_completion({"role": "assistant", "content": "done"})).encode(),
    ],
}


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        turns = sum(1 for m in body["messages"] if m.get("role") == "assistant")
        if body["model"] == "solver":  # the honest agent beside them
            user = next(m["content"] for m in body["messages"] if m["role"] == "user")
            out = _call(0, solution(user)) if turns == 0 else json.dumps(
                _completion({"role": "assistant", "content": "done"})).encode()
        else:
            script = SCRIPTS[body["model"]]
            out = script[min(turns, len(script) - 1)]
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)


@contextmanager
def _server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()


def _episode_dirs(root: Path) -> list[str]:
    return sorted(p.name for p in root.glob("envloop-episode-*"))


@needs_isolation
def test_bytes_that_are_not_text_are_stored_losslessly_and_the_run_survives(tmp_path: Path) -> None:
    root = tmp_path / "work"
    root.mkdir()
    with _server() as url:
        result = evaluate_agent(spec_set("hostile", [shell_env(0)]), AgentSpec(url, "bytes"), attempts=2, workers=2,
                                work_root=root, home=tmp_path / "home")
    # The run is stored (before: 'utf-8' codec can't encode ... surrogates not allowed, nothing stored).
    assert result.run_dir and (Path(result.run_dir) / "summary.json").is_file()
    back = read_attempts(result.run_dir)
    assert [a.to_dict() for a in back] == [a.to_dict() for a in sorted(result.attempts, key=lambda a: a.key)]
    one = back[0]
    assert one.status == "failed" and one.turns == 3 and one.tool_calls == 2
    # The reply's lone surrogates are kept as they came, as JSON escapes in the file.
    assert one.messages[-1]["content"] == "done \ud800 caf\udce9"
    raw = (Path(result.run_dir) / "attempts.jsonl").read_bytes()
    assert b"\\ud800" in raw and raw.decode("utf-8")
    # The name that is not UTF-8: os.fsdecode's surrogate, which gives the bytes back.
    names = list(one.final_state["files"])
    assert "caf\udce9.txt" in names and os.fsencode("caf\udce9.txt") == b"caf\xe9.txt"
    # What the agent read: the byte as \xe9, NULs compact, the output's tail only.
    first = one.messages[3]["content"]
    assert "caf\\xe9.txt" in first and "x\\x00*3y" in first
    assert len(one.messages[5]["content"]) < 2 * 4000 + 200
    # A file with NUL is stored as base64, not as \u0000 escapes.
    assert one.final_state["files"]["nul.bin"] == {"bytes": 3, "truncated": False, "base64": "YQBi"}
    assert _episode_dirs(root) == []


def test_the_final_state_cap_holds_for_what_is_stored(tmp_path: Path) -> None:
    for n in range(300):
        (tmp_path / f"zeros-{n:03d}.bin").write_bytes(b"\0" * 16384)
    state = snapshot_files(tmp_path)
    stored = len(json.dumps(state, ensure_ascii=True, separators=(",", ":")))
    # Before: 200 files x 16 KiB of NUL as text, 19 MB of \u0000 escapes; now at most the cap.
    assert stored <= FINAL_STATE_TOTAL_BYTES + 100 and state["truncated"] is True
    assert 20 <= len(state["files"]) <= 200
    assert sum("base64" in e for e in state["files"].values()) >= 20


@needs_isolation
def test_a_1500_deep_tree_and_mode_000_folders_do_not_keep_the_episode_on_the_host(tmp_path: Path) -> None:
    root = tmp_path / "work"
    root.mkdir()
    with _server() as url:
        result = evaluate_agent(spec_set("deep", [shell_env(0)]), AgentSpec(url, "deep"), attempts=1, workers=1,
                                work_root=root, home=tmp_path / "home", store=False)
    (attempt,) = result.attempts
    # Before: RecursionError in snapshot_files (os.walk) at verification: an error with a traceback, and the
    # folder stayed (shutil.rmtree recurses too).
    assert attempt.status == "failed" and attempt.error == "", attempt.error
    assert "made" in attempt.messages[3]["content"]
    assert _episode_dirs(root) == []


def test_remove_tree_takes_what_shutil_leaves(tmp_path: Path) -> None:
    deep = tmp_path / "deep"
    deep.mkdir()
    subprocess.run(["bash", "-c", "for k in 1 2 3; do p=\"$(printf 'dd/%.0s' $(seq 1000))\"; mkdir -p \"$p\"; cd \"$p\"; "
                    "done; touch leaf"], cwd=deep, check=True)  # 3,000 deep: past PATH_MAX too
    locked = tmp_path / "locked"
    (locked / "a" / "b").mkdir(parents=True)
    (locked / "a" / "b" / "f").write_text("x")
    immutable = chattr = shutil.which("chattr") and subprocess.run(
        ["chattr", "+i", str(locked / "a" / "b" / "f")], capture_output=True).returncode == 0
    for p in (locked / "a" / "b", locked / "a"):
        p.chmod(0)
    # Control: the standard library leaves both behind.
    with pytest.raises(RecursionError):
        shutil.rmtree(deep, ignore_errors=True)
    if immutable:
        shutil.rmtree(locked, ignore_errors=True)
        assert locked.exists()
    remove_tree(deep)
    remove_tree(locked)
    assert not deep.exists() and not locked.exists(), chattr


@needs_isolation
def test_run_lock_dev_shm_and_tmp_are_private_to_each_command(tmp_path: Path) -> None:
    marks = {d: f"envloop-mark-{os.getpid()}-{d.strip('/').replace('/', '-')}" for d in ("/run/lock", "/dev/shm", "/tmp")}
    write = "; ".join(f"echo secret > {d}/{m}" for d, m in marks.items())
    read = "; ".join(f"cat {d}/{m} 2>&1" for d, m in marks.items())
    first = open_episode(shell_env(0), work_root=tmp_path)
    second = open_episode(shell_env(1), work_root=tmp_path)
    try:
        assert first.run(write).exit_code == 0
        seen = second.run(read)
        again = first.run(read)  # nor does the next command of the same attempt
    finally:
        first.close()
        second.close()
    assert "secret" not in seen.stdout_tail and "secret" not in again.stdout_tail
    assert all(not os.path.exists(f"{d}/{m}") for d, m in marks.items())  # nothing outlived the attempt
    # Control: without the private temp dirs the mark does reach the host, where the next attempt reads it.
    box = LocalSandbox(private_tmp=False)
    try:
        assert box.run(["/bin/sh", "-c", f"echo secret > /run/lock/{marks['/run/lock']}"]).exit_code == 0
        assert box.run(["/bin/cat", f"/run/lock/{marks['/run/lock']}"]).stdout_tail.strip() == "secret"
    finally:
        Path("/run/lock", marks["/run/lock"]).unlink(missing_ok=True)


@needs_isolation
def test_the_checkout_and_the_home_are_concealed_from_commands() -> None:
    checkout = Path(envloop_pipelines.__file__).resolve().parent.parent
    base = Path(tempfile.mkdtemp(prefix="envloop-conceal-"))  # world-traversable, unlike pytest's tmp root
    try:
        home = base / "home"
        home.mkdir()
        (home / "mlflow.db").write_text("home-secret")
        for p in (base, home, home / "mlflow.db"):
            p.chmod(0o755 if p.is_dir() else 0o644)
        work = base / "w"
        work.mkdir(mode=0o755)
        episode = open_episode(shell_env(0), work_root=work, home=home, sandbox=LocalSandbox(private_tmp=False))
        probe = (f"head -3 {checkout}/pyproject.toml 2>&1; ls {checkout}; cat {home}/mlflow.db 2>&1; "
                 f"python -c 'import pytest, ctrf; print(\"python ok\")'")
        try:
            seen = episode.run(probe)
        finally:
            episode.close()
        # Control: the same command in the same sandbox without the concealment reads both.
        bare = LocalSandbox(private_tmp=False).run(["/bin/bash", "-c", probe], SandboxCall(workdir=work))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    out = seen.stdout_tail + seen.stderr_tail
    assert seen.status == "ok", seen.detail
    assert "[build-system]" not in out and "README.md" not in out and "home-secret" not in out, out
    assert "python ok" in out  # the interpreter and its packages are bound back
    assert "[build-system]" in bare.stdout_tail and "README.md" in bare.stdout_tail
    assert "home-secret" in bare.stdout_tail


@needs_isolation
def test_envloop_env_eval_survives_the_hostile_agents_beside_an_honest_one(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from envloop_pipelines.cli import main
    from envloop_pipelines.core.environments.dataset import store_dataset

    episodes = tmp_path / "tmp"
    episodes.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(episodes))  # where every episode folder is made
    home = tmp_path / "home"
    store_dataset("three", [shell_env(s) for s in range(3)], source={"generator": "test"}, home=home)
    locks = set(os.listdir("/run/lock"))
    with _server() as url:
        ran = CliRunner().invoke(main, ["env", "eval", "--dataset", "three", "--agent-url", url, "--model", "bytes",
                                        "--model", "deep", "--model", "solver", "--attempts", "2", "--workers", "3",
                                        "--no-mlflow", "--json", "--home", str(home)], catch_exceptions=False)
    assert ran.exit_code == 0, ran.output
    summaries = json.loads(ran.output[ran.output.index("\n[\n") + 1:])  # after the progress lines
    by_model = {s["agent"]["model"]: s for s in summaries}
    # The hostile agents get nothing; their runs are stored; the honest one passes every attempt.
    assert by_model["bytes"]["statuses"]["passed"] == 0 and by_model["deep"]["statuses"]["passed"] == 0
    assert by_model["solver"]["statuses"] == {"passed": 6, "failed": 0, "error": 0}
    assert all((Path(s["run_dir"]) / "attempts.jsonl").is_file() for s in summaries)
    # Nothing left on the host: no episode folder, no lock file.
    assert sorted(os.listdir(episodes)) == [] and set(os.listdir("/run/lock")) == locks
