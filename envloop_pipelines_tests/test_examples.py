"""The example notebook runs, cell by cell, in a real Jupyter kernel, and shows its work (issue 37).

``examples/loop_sdk.ipynb`` is executed with ``nbclient`` (the ``notebook`` extra) on a home of its own: set up,
a round started and a second start refused, the round watched with progress to its decision, the release chain,
and a prediction. The executed copy is written beside the test's temporary files (its outputs are asserted here).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.integration]

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "loop_sdk.ipynb"


def _text(cell: dict) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream":
            parts.append(out["text"])
        elif out.get("output_type") == "error":
            parts.append("\n".join(out.get("traceback", [])))
        else:
            parts.append(str((out.get("data") or {}).get("text/plain", "")))
    return "".join(parts)


def test_the_sdk_notebook_runs_and_shows_the_round_its_decision_the_releases_and_a_prediction(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("ENVLOOP_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("ENVLOOP_PROGRESS", raising=False)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(NOTEBOOK.parents[1]), os.environ.get("PYTHONPATH", "")]))
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(notebook, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    nbformat.write(notebook, tmp_path / "loop_sdk.executed.ipynb")
    text = "\n".join(_text(c) for c in notebook.cells if c.cell_type == "code")

    assert "set up: True" in text
    assert re.search(r"setup: 100% \d+/\d+ step \[", text), text  # progress where stderr is no terminal
    started = re.search(r"started: (r\d{4}) run (\S+)", text)
    assert started, text
    key, run_id = started.groups()
    assert (f"refused: round {key} of task 'personal_agent' is running (run {run_id}, started by "
            f"LocalClient.start_round") in text
    assert re.search(rf"round {key}: 100% 13/13 step \[", text), text
    assert re.search(rf"{key}: run SUCCESS; (promoted|rejected)", text), text
    assert re.search(r"release 1: round \S+, checkpoint [0-9a-f]{12}, holdout family-macro accuracy \d\.\d{4}", text)
    assert re.search(r"champion: release \d+", text), text
    assert "model: envloop-personal_agent-r0001" in text, text
    assert "refused: the server at in process answered 422: questions.q: Input tag 'banana'" in text  # no raw JSON
    noise = ("Traceback", "Loading weights", "FutureWarning", "TqdmWarning", "was never awaited")
    assert not [n for n in noise if n in text], text
