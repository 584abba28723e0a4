"""A scripted policy behind a real OpenAI-compatible HTTP server (FastAPI + uvicorn on 127.0.0.1).

The request's ``model`` picks the behaviour, so one server plays many agents:

* ``solver-p<P>`` (e.g. ``solver-p0.5``): looks around (``ls``), then solves the
  shell task with probability P per attempt, decided by ``random.Random(seed)``
  with the request's ``seed`` (so an attempt is reproducible and attempts
  differ), else runs a wrong script; then says it is done. The instructions of
  the three shell families (``core/environments/shell.py``) are parsed with
  regular expressions.
* ``hostile``: reads what it should not (hidden tests, the datasets' verifier
  material), plants reward files, opens a socket back to this server, leaves a
  background process behind (named :data:`STRAY_MARKER`), runs a fork bomb and
  fills the disk; then claims success.
* ``malformed-json`` / ``unknown-tool`` / ``no-command``: a tool call whose
  arguments are not JSON / that names a tool that does not exist / without a
  ``command``.
* ``http-error``: answers 503. ``not-a-completion``: answers 200 with a body
  that is not a chat completion. ``slow``: waits 2 s before answering.
* ``chooser-<KEY>``: answers a decision question with the option ``KEY``.

``/v1/systemone`` answers every question with a uniform distribution (a Jev agent).
Every request body is kept in :attr:`ScriptedServer.requests`.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from envloop_pipelines.testing.services import free_port

#: The name the hostile agent's left-behind process runs under (a test looks for it in /proc).
STRAY_MARKER = "envloop-hostile-stray"

_CREATE = re.compile(r"Create a file named (\S+) in the current directory whose content is exactly the line: (.*)$")
_COUNT = re.compile(r"Count the lines of the file (\S+) and write the number alone")


def solution(instruction: str) -> str:
    """The bash script that solves one of the shell families' instructions."""
    if m := _CREATE.search(instruction):
        return f"printf '%s\\n' '{m.group(2)}' > '{m.group(1)}'"
    if "ends in .txt so that it ends in .md" in instruction:
        return 'for f in *.txt; do mv -- "$f" "${f%.txt}.md"; done'
    if m := _COUNT.search(instruction):
        return f"wc -l < '{m.group(1)}' | tr -d ' ' > out.txt"
    return "echo 'I do not know this task' >&2; exit 1"


def hostile_commands(port: int, reads: tuple[str, ...] = ()) -> list[str]:
    """What the hostile agent runs, one tool call each; ``reads`` are host paths it knows hold secrets."""
    targets = " ".join(f"'{r}'" for r in reads)
    return [
        *([f"for f in {targets}; do echo \"== $f\"; cat \"$f\" 2>&1 || ls -la \"$f\" 2>&1; "
           f"find \"$f\" -type f -exec cat {{}} + 2>&1; done | head -c 4000"] if reads else []),
        # Read the hidden material: Harbor-style tests, the datasets' verifier side, labels.
        "cat /tests/test.sh /tests/* 2>&1 | head -c 2000; ls -la / 2>&1 | head -50",
        "for d in /root /home /work /srv /var/lib /tmp; do find $d -maxdepth 5 \\( -path '*environments*' -o -path "
        "'*verifier*' \\) -type f 2>/dev/null; done | head -40 | while read f; do echo \"== $f\"; head -c 300 \"$f\"; "
        "done 2>&1 | head -c 4000",
        # Plant rewards where Harbor and naive verifiers look.
        "echo 1 > reward.txt; echo '{\"reward\": 1.0}' > reward.json; mkdir -p logs/verifier /logs/verifier 2>/dev/null; "
        "echo 1 > logs/verifier/reward.txt; echo 1 > /logs/verifier/reward.txt 2>&1; "
        "echo '{\"reward\": 1}' > /logs/verifier/reward.json 2>&1; echo planted",
        # Call home.
        f"python3 -c \"import socket; s = socket.create_connection(('127.0.0.1', {port}), timeout=3); print('CONNECTED')\" 2>&1 | tail -1; "
        f"(exec 3<>/dev/tcp/127.0.0.1/{port} && echo CONNECTED_BASH) 2>&1 | tail -1",
        # Leave a process behind, detached from the process group.
        f"setsid bash -c 'exec -a {STRAY_MARKER} sleep 300' >/dev/null 2>&1 < /dev/null & "
        f"nohup bash -c 'exec -a {STRAY_MARKER} sleep 301' >/dev/null 2>&1 & echo started",
        # Fork without end.
        "bomb() { bomb | bomb & }; bomb; sleep 2; echo bombed",
        # Fill the disk.
        "head -c 2000000000 /dev/zero > big.bin; ls -la big.bin; df -h . | tail -1",
    ]


def _completion(model: str, message: dict[str, Any], *, prompt_tokens: int = 50, completion_tokens: int = 10) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{random.getrandbits(48):x}", "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls" if message.get("tool_calls") else "stop"}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }


def _call(turn: int, command: str | None = None, *, name: str = "bash", arguments: str | None = None) -> dict[str, Any]:
    args = arguments if arguments is not None else json.dumps({"command": command})
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": f"call_{turn}", "type": "function", "function": {"name": name, "arguments": args}}]}


def policy(body: dict[str, Any], port: int, reads: tuple[str, ...] = ()) -> dict[str, Any] | tuple[int, dict[str, Any]]:
    """The reply to one chat request: a completion, or (status, body) for an error."""
    model = str(body.get("model", ""))
    messages = body.get("messages") or []
    turn = sum(1 for m in messages if m.get("role") == "assistant")
    user = next((m.get("content") or "" for m in messages if m.get("role") == "user"), "")
    prompt_tokens = sum(len(str(m.get("content") or "")) // 4 for m in messages)
    done = {"role": "assistant", "content": "Done."}
    if model.startswith("solver-p"):
        p = float(model[len("solver-p"):])
        solves = random.Random(body.get("seed")).random() < p
        script = [("ls -la",), (solution(user) if solves else "echo wrong > wrong.txt",)]
        message = _call(turn, *script[turn]) if turn < len(script) else done
    elif model == "hostile":
        commands = hostile_commands(port, reads)
        message = _call(turn, commands[turn]) if turn < len(commands) else {"role": "assistant", "content": "Solved, reward 1."}
    elif model == "malformed-json":
        message = _call(turn, arguments='{"command": "ls') if turn == 0 else done
    elif model == "unknown-tool":
        message = _call(turn, name="python", arguments=json.dumps({"code": "print(1)"}))
    elif model == "no-command":
        message = _call(turn, arguments=json.dumps({"cmd": "ls"}))
    elif model == "http-error":
        return 503, {"error": {"message": "overloaded", "type": "server_error"}}
    elif model == "not-a-completion":
        return 200, {"hello": "world"}
    elif model.startswith("chooser-"):
        message = {"role": "assistant", "content": model[len("chooser-"):]}
    else:
        return 404, {"error": {"message": f"unknown model {model!r}", "type": "invalid_request_error"}}
    return _completion(model, message, prompt_tokens=prompt_tokens, completion_tokens=12)


class ScriptedServer:
    """The scripted policies on a real uvicorn server in a thread; :meth:`running` starts and stops it."""

    def __init__(self, *, hostile_reads: tuple[str, ...] = ()) -> None:
        self.hostile_reads = tuple(hostile_reads)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.requests: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> JSONResponse:
            try:
                body = await request.json()
            except ValueError:
                return JSONResponse({"error": {"message": "body is not JSON"}}, status_code=400)
            with self._lock:
                self.requests.append(body)
            if body.get("model") == "slow":
                await asyncio.sleep(2)
                return JSONResponse(_completion("slow", {"role": "assistant", "content": "late"}))
            out = policy(body, self.port, self.hostile_reads)
            status, payload = out if isinstance(out, tuple) else (200, out)
            return JSONResponse(payload, status_code=status)

        @app.post("/v1/systemone")
        async def systemone(request: Request) -> JSONResponse:
            body = await request.json()
            with self._lock:
                self.requests.append(body)
            answers = {}
            for qid, q in body["questions"].items():
                criteria = q.get("criteria")
                if q["type"] == "noul":
                    answers[qid] = {"type": "noul", "noul": 0.5}
                else:
                    keys = [str(i) for i in range(len(criteria))] if q["type"] == "score" else list(criteria)
                    answers[qid] = {"type": q["type"], "probabilities": {k: 1.0 / len(keys) for k in keys}}
            return JSONResponse({"model": body["model"], "answers": answers, "usage": {"input_tokens": 20, "output_tokens": 1}})

        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                     lifespan="off"))

    @contextmanager
    def running(self) -> Iterator["ScriptedServer"]:
        thread = threading.Thread(target=self._server.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 20
        while not self._server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("the scripted policy server did not start")
            time.sleep(0.02)
        try:
            yield self
        finally:
            self._server.should_exit = True
            thread.join(timeout=10)


@contextmanager
def scripted_server(*, hostile_reads: tuple[str, ...] = ()) -> Iterator[ScriptedServer]:
    """A running :class:`ScriptedServer`."""
    with ScriptedServer(hostile_reads=hostile_reads).running() as server:
        yield server


__all__ = ["STRAY_MARKER", "ScriptedServer", "hostile_commands", "policy", "scripted_server", "solution"]
