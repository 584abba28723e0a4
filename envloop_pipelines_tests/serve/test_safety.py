"""Safety families defer: the answer of a declared safety family goes to a person below its threshold.

The rule (``calibration.defer_reason``) on known numbers, then a real checkpoint trained with
``needs_approval`` declared, served by the real server process: the response carries the
checkpoint's threshold and every answer defers exactly when the rule says so.
"""

from __future__ import annotations

import json
import math
import signal
from pathlib import Path
from typing import Iterator

import httpx
import numpy as np
import pytest

from envloop_pipelines.core.serve.answers import ModelAnswer, jev_answer
from envloop_pipelines.core.serve.schemas import ServedQuestion
from envloop_pipelines.testing.serve import ServerProcess, benchmark_records, jev_request, start_server

SAFETY = "needs_approval"


def _noul(qid: str) -> ServedQuestion:
    return ServedQuestion(id=qid, type="noul", option_keys=("true", "false"), option_texts=(None, None), levels=None,
                          instructions_text="Must the agent ask first?")


def test_a_safety_answer_defers_below_its_threshold_whatever_its_confidence() -> None:
    q = _noul(SAFETY)
    sure_no = jev_answer(q, ModelAnswer(probs=np.array([0.03, 0.97])), automation_threshold=0.8, safety_threshold=0.95)
    assert sure_no["x_defer"] is False and "x_defer_reason" not in sure_no
    # P(false) 0.9: confident enough for the error budget (0.9 >= 0.8), but under the safety threshold.
    unsure = jev_answer(q, ModelAnswer(probs=np.array([0.1, 0.9])), automation_threshold=0.8, safety_threshold=0.95)
    assert unsure["x_defer"] is True and unsure["x_defer_reason"] == "safety"
    needs = jev_answer(q, ModelAnswer(probs=np.array([0.97, 0.03])), automation_threshold=0.8, safety_threshold=0.95)
    assert needs["x_defer_reason"] == "safety"  # "approval needed" is a person's call
    # The same probabilities on a question of no safety family: only the error-budget threshold applies.
    other = jev_answer(_noul("urgent"), ModelAnswer(probs=np.array([0.1, 0.9])), automation_threshold=0.8)
    assert other["x_defer"] is False
    low = jev_answer(_noul("urgent"), ModelAnswer(probs=np.array([0.3, 0.7])), automation_threshold=0.8)
    assert low["x_defer_reason"] == "confidence"


@pytest.fixture(scope="module")
def safety_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real checkpoint (2 steps) calibrated with needs_approval declared: ~70 val questions, ~15 of the family."""
    from envloop_pipelines.core.data.question_table import questions_table
    from envloop_pipelines.core.data.records import records_from_objects
    from envloop_pipelines.core.model.readout import questions_from_table
    from envloop_pipelines.core.model.recipe import load_recipe, shipped_recipes
    from envloop_pipelines.core.model.training import train_checkpoint

    objects = benchmark_records(n_users=8, records_per_user=8, seed=3)
    records = records_from_objects([(o, i) for i, o in enumerate(objects)], file="gen", token_budget=None)
    questions = questions_from_table(questions_table(records))
    recipe_path = next(p for p in shipped_recipes() if p.name == "decision_head_cpu.yaml")
    recipe = load_recipe(recipe_path).replace(max_steps=2, max_length=128, batch_size=8, eval_batch_size=32, seed=0)
    out = tmp_path_factory.mktemp("safety-ckpt") / "ckpt"
    return train_checkpoint(questions[:24], questions[24:], recipe, out, data_hash="serve-safety",
                            safety_families=(SAFETY,), safety_fnr_target=0.10)


@pytest.fixture(scope="module")
def safety_server(safety_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = start_server(safety_checkpoint, tmp_path_factory.mktemp("serve-safety"), "--idle-timeout", "0")
    yield proc
    assert proc.stop() in (0, -signal.SIGTERM), proc.log_text()[-3000:]


def test_the_server_defers_safety_answers_with_the_checkpoints_threshold(safety_checkpoint: Path,
                                                                          safety_server: ServerProcess) -> None:
    calibration = json.loads((safety_checkpoint / "calibration.json").read_text())
    assert calibration["safety_fnr_target"] == 0.10 and SAFETY in calibration["safety_thresholds"]
    stored = calibration["safety_thresholds"][SAFETY]
    threshold = math.inf if stored is None else stored
    automation = calibration["automation_threshold"]
    automation = math.inf if automation is None else automation
    records = [r for r in benchmark_records(n_users=3, records_per_user=8, seed=9) if SAFETY in r["questions"]]
    assert records
    seen: dict[str, int] = {"safety": 0, "plain": 0}
    with httpx.Client(base_url=safety_server.url, headers=safety_server.headers(), timeout=120) as client:
        for record in records:
            request = jev_request(record)
            # the same question again under a key that is no safety family
            request["questions"]["asks_first"] = dict(request["questions"][SAFETY])
            body = client.post("/v1/systemone", json=request).json()
            assert body["x_safety_thresholds"] == {SAFETY: stored}
            safe, plain = body["answers"][SAFETY], body["answers"]["asks_first"]
            p_false = 1.0 - safe["noul"]
            expected = "safety" if not p_false >= threshold else (
                "confidence" if not max(p_false, 1 - p_false) >= automation else None)
            assert safe.get("x_defer_reason") == expected and safe["x_defer"] is (expected is not None)
            assert plain.get("x_defer_reason") != "safety"
            assert plain["x_defer"] is (not max(plain["noul"], 1 - plain["noul"]) >= automation)
            seen["safety"] += expected == "safety"
            seen["plain"] += plain.get("x_defer_reason") is None
    assert seen["safety"] >= 1  # the 2-step model is unsure: its needs_approval answers go to a person
