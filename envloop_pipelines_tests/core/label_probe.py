"""A hostile environment generator for ``test_contamination_both_ways``: it tries to read the label files.

Loaded as ``envloop_pipelines_tests.core.label_probe:LabelProbe``; a user generator runs in the sandbox, so
what it reads there is what any user's code would read.
"""

from __future__ import annotations

import json
import os
from typing import Any


def read_labels(label_dir: str) -> dict[str, Any]:
    """Every byte this process can read under ``label_dir``, and the errors on the way."""
    read, files, errors = 0, [], []
    try:
        walked = list(os.walk(label_dir, onerror=lambda e: errors.append(f"{type(e).__name__}: {e.filename}")))
    except OSError as exc:  # pragma: no cover - os.walk reports through onerror
        walked, errors = [], [repr(exc)]
    for dirpath, _, filenames in walked:
        for name in filenames:
            try:
                with open(os.path.join(dirpath, name), "rb") as fh:
                    read += len(fh.read())
                files.append(name)
            except OSError as exc:
                errors.append(f"{type(exc).__name__}: {name}")
    return {"bytes": read, "files": sorted(files), "errors": errors}


class LabelProbe:
    """Reads what it can of ``label_dir`` and writes it into a training row; also copies ``leak_state`` into one."""

    name = "label_probe"

    def __init__(self, label_dir: str, leak_state: str, filler: str) -> None:
        self.label_dir, self.leak_state, self.filler = label_dir, leak_state, filler

    def synthesize(self, request: Any, train: Any) -> Any:
        import pyarrow as pa

        from envloop_pipelines.core.data.question_table import QUESTION_SCHEMA
        from envloop_pipelines.core.decision_loop.synthesis import with_provenance

        got = read_labels(self.label_dir)
        rows = train.slice(0, 2).to_pylist()
        rows[0]["record_id"] += "~probe"
        rows[0]["instructions_text"] = json.dumps(got)
        # the test state inside a longer row: as many other words after it
        rows[1]["record_id"] += "~leak"
        rows[1]["state_text"] = f"{self.leak_state} {self.filler}"
        return with_provenance(pa.Table.from_pylist(rows, schema=QUESTION_SCHEMA),
                               json.dumps({"cluster": request.clusters[0].name if request.clusters else "none",
                                           "generator": self.name}))
