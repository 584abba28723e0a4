"""The sandboxed side of a user's environment generator (``generator=module:attr`` or an entry point).

Run as ``python -m envloop_pipelines.core.decision_loop.generator_worker`` inside the sandbox by
:class:`~envloop_pipelines.core.decision_loop.synthesis.SandboxedGenerator`. It reads one JSON document on stdin:

``{"spec": "module:attr", "describe": true}``
    load the generator and answer its ``name`` (the check at load time);
``{"spec": ..., "request": {"round", "clusters", "n_examples", "seed"}, "train": [rows]}``
    call ``synthesize(request, train)`` and answer ``{"name", "rows"}``, the rows as JSON objects.

The answer goes to the result channel (``$ENVLOOP_RESULT_FD``), never to a file: the parent owns that pipe. A
generator's own failure is answered as ``{"error": {"type", "message"}}`` with exit status 1. The worker runs
as the sandbox's uid with the label folder hidden, so the generator sees what it is given (the mined clusters
and the train rows) and nothing the loop's own user could read.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Any

from envloop_pipelines.core.sandbox.base import RESULT_FD_ENV


def _answer(body: dict[str, Any]) -> None:
    data = json.dumps(body, ensure_ascii=False, allow_nan=True).encode("utf-8")
    fd = int(os.environ[RESULT_FD_ENV])
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)


def run(payload: dict[str, Any]) -> dict[str, Any]:
    import pyarrow as pa

    from envloop_pipelines.core.data.question_table import QUESTION_SCHEMA
    from envloop_pipelines.core.decision_loop.failure_mining import FailureCluster
    from envloop_pipelines.core.decision_loop.synthesis import SNAPSHOT_SCHEMA, SynthesisRequest, resolve_generator

    spec = payload["spec"]
    generator = resolve_generator(spec, **dict(payload.get("kwargs") or {}))
    name = str(getattr(generator, "name", spec))
    if payload.get("describe"):
        return {"name": name}
    req = payload["request"]
    clusters = tuple(FailureCluster(**{**c, "key": dict(c["key"]), "example_ids": tuple(c["example_ids"])})
                     for c in req["clusters"])
    request = SynthesisRequest(round=req["round"], clusters=clusters, n_examples=int(req["n_examples"]),
                               seed=int(req["seed"]))
    train = pa.Table.from_pylist(payload["train"], schema=QUESTION_SCHEMA)
    table = generator.synthesize(request, train)
    if not isinstance(table, pa.Table):
        raise TypeError(f"environment generator {spec!r}: synthesize returned {type(table).__name__}, not a pyarrow Table")
    missing = [n for n in SNAPSHOT_SCHEMA.names if n not in table.column_names]
    if missing:
        raise TypeError(f"environment generator {spec!r}: its rows lack column(s) {missing} of SNAPSHOT_SCHEMA")
    return {"name": name, "rows": table.select(SNAPSHOT_SCHEMA.names).to_pylist()}


def main() -> int:
    try:
        payload = json.loads(sys.stdin.buffer.read().decode("utf-8"))
        _answer(run(payload))
        return 0
    except Exception as exc:  # the generator's failure, answered to the parent with its type
        traceback.print_exc()
        _answer({"error": {"type": type(exc).__name__, "message": str(exc)}})
        return 1


if __name__ == "__main__":
    sys.exit(main())
