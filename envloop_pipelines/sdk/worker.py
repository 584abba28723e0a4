"""A round's worker process: :meth:`LocalClient.start_round <envloop_pipelines.sdk.local.LocalClient.start_round>`
runs the round's job here, apart from the process that asked, and returns at once.

    python -m envloop_pipelines.sdk.worker SPEC.json

``SPEC.json`` (written by ``start_round``): the loop's settings, the round key, the hypothesis (or ``null``),
the run id to use and the run's extra tags. The run is the same in-process Dagster execution
``envloop round start`` does, on the same instance (``$DAGSTER_HOME``), tagged with this process as its worker:
``LocalClient.cancel`` interrupts it with SIGINT (Dagster ends the run ``CANCELED``), and a worker that
dies is found by the orphan reaper like any other. Its output goes to ``SPEC.log`` beside the spec.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from envloop_pipelines.console import quiet_third_party
from envloop_pipelines.sdk.errors import ClientError, RoundFailed
from envloop_pipelines.sdk.instance import SILENT
from envloop_pipelines.sdk.local import LocalClient


def main(argv: list[str] | None = None) -> int:
    """Run the round the spec names; 0 when it was decided, 1 when it failed or was cancelled."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m envloop_pipelines.sdk.worker SPEC.json", file=sys.stderr)
        return 2
    quiet_third_party()
    spec = json.loads(Path(args[0]).read_text(encoding="utf-8"))
    client = LocalClient(spec["settings"], notify=print, door=spec.get("door"))
    client.run_logging = SILENT  # this log says how the round ended, in one line (the run's event log has the rest)
    try:
        result = client.run_round(spec["proposal"], key=spec["key"], run_id=spec["run_id"], tags=spec["tags"],
                                  progress=False)
    except RoundFailed as exc:
        if exc.run is not None and exc.run.status == "CANCELED":  # LocalClient.cancel: not a failure to debug
            print(f"round {spec['key']}: cancelled (run {exc.run.run_id} ended CANCELED); `envloop round retry` "
                  f"runs it again", file=sys.stderr)
        else:
            print(f"round {spec['key']}: failed: {exc}" + (f" ({exc.reason})" if exc.reason else ""), file=sys.stderr)
        return 1
    except ClientError as exc:
        print(f"round {spec['key']}: {exc}", file=sys.stderr)
        return 1
    print(f"round {result.key}: {'promoted' if result.decision.promote else 'rejected'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
