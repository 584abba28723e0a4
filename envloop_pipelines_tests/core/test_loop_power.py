"""A hypothesis's power at registration: the MDE at the measured noise, and the underpowered flag.

The fixture is a tiny imported task (a handful of test records) with a noise floor whose two null
arms' and one continuation arm's test predictions are written by hand, so nothing is trained: the
verifier pairs the continuation arm with the control arm on the real test split, and
``register_hypothesis`` writes the real ledger and a real MLflow run.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from envloop_pipelines.core.metrics.paired import minimum_detectable_effect
from envloop_pipelines.core.data.datasets import import_file
from envloop_pipelines.core.loop.config import LoopConfig
from envloop_pipelines.core.ledger.event_log import EVENT_HYPOTHESIS_REGISTERED
from envloop_pipelines.core.ledger.hypothesis import Gate, Hypothesis
from envloop_pipelines.core.ledger.ledger import Ledger
from envloop_pipelines.core.loop.promotion import hypothesis_power, noise_floor_from_arms
from envloop_pipelines.core.decision_loop.step_records import EnvironmentSynthesis, MeasuredNoiseFloor
from envloop_pipelines.core.decision_loop.noise_floor import continuation_path, noise_floor_key
from envloop_pipelines.core.decision_loop.registered_hypothesis import paired_noise, register_hypothesis
from envloop_pipelines.core.ledger.store import RoundStore
from envloop_pipelines.core.storage import atomic_write_json, atomic_write_parquet
from envloop_pipelines.core.tracking import KIND_HYPOTHESIS, TAG_KIND, TAG_ROUND, TAG_UNDERPOWERED, MlflowTracker

from .data.test_snapshots import dataset


def _arm_predictions(test: pa.Table, rng: np.random.Generator) -> pa.Table:
    """Sharp random answers (each question's argmax drawn at random): two such arms disagree a lot."""
    probs = []
    for keys in test.column("option_keys").to_pylist():
        p = np.full(len(keys), 0.1 / (len(keys) - 1))
        p[rng.integers(len(keys))] = 0.9
        probs.append(p.tolist())
    return pa.table({"record_id": test.column("record_id"), "question_id": test.column("question_id"),
                     "option_keys": test.column("option_keys"), "probs": probs})


@pytest.fixture(scope="module")
def loop(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("power")
    home = root / "home"
    snap = import_file(dataset(root), "tickets", home=home)
    config = LoopConfig(task="tickets", home=str(home), noise_arms=2, safety_families=())
    store = RoundStore(config.task, config.home)
    key = noise_floor_key(snap.benchmark_version, config)
    test = snap.table("test")
    rng = np.random.default_rng(0)
    arms = []
    for seed in (0, 1):
        path = atomic_write_parquet(store.noise / key / f"arm-seed{seed}-test.parquet", _arm_predictions(test, rng))
        arms.append({"seed": seed, "test_predictions": str(path)})
    cont = atomic_write_parquet(store.noise / key / "continuation-seed5000-test.parquet", _arm_predictions(test, rng))
    atomic_write_json(continuation_path(store, key), {"noise_key": key, "arms": [
        {"seed": 5000, "test_predictions": str(cont)}]})
    floor = noise_floor_from_arms(key, "family_macro_accuracy",
                                  [{"family_macro_accuracy": 0.5}, {"family_macro_accuracy": 0.6}], arms)
    measured = MeasuredNoiseFloor(floor=floor, benchmark_version=snap.benchmark_version,
                                  recipe_hash=config.recipe_hash(), identity="i")
    atomic_write_json(store.noise / f"{key}.json", measured.to_dict())
    return {"config": config, "tracker": MlflowTracker(home=home), "n_test": test.num_rows, "task": snap}


def _synthesis(key: str) -> EnvironmentSynthesis:
    return EnvironmentSynthesis(round=key, generator="builtin_targeted", n_rows=0, per_cluster={}, clusters=(),
                                path="", sha256="")


def test_paired_noise_of_the_continuation_arm_is_measured_once_by_the_verifier(loop: dict[str, Any]) -> None:
    noise = paired_noise(loop["config"], loop["task"])
    assert noise is not None and noise["source"].startswith("candidate-vs-champion paired se on test")
    assert noise["pairs"] == ["continuation arm seed 5000 (trained from the control arm, seed 0) vs the control arm"]
    primary = noise["deltas"]["family_macro_accuracy"]
    assert primary["n_questions"] == loop["n_test"] and primary["confidence_level"] == 0.95
    assert 0.05 < primary["se"] < 0.5  # a handful of records and arms that disagree: a wide test
    assert paired_noise(loop["config"], loop["task"]) == noise  # kept beside the floor


def test_an_underpowered_hypothesis_is_flagged_and_a_powered_one_is_not(loop: dict[str, Any]) -> None:
    config, tracker = loop["config"], loop["tracker"]
    se = paired_noise(config, loop["task"])["deltas"]["family_macro_accuracy"]["se"]
    # No champion in this fixture: the bar is the floor (0.6 - 0.5); the MDE clears it and the CI's zero.
    mde = max(0.1, 1.959964 * se) + 0.841621 * se
    # The loop's own guess (+0.01 for a first round) on a test split of a few records: far below the MDE.
    weak = register_hypothesis(config, loop["task"], _synthesis("r0001"), tracker)
    assert weak.hypothesis.power["mde"] == pytest.approx(mde, rel=1e-5) and weak.hypothesis.underpowered
    assert weak.hypothesis.power["predicted_effect"] == pytest.approx(0.01)
    # A person predicting an effect above the MDE: the same test has the power to see it.
    strong = register_hypothesis(config, loop["task"], _synthesis("r0002"), tracker,
                                 proposal={"predicted_delta": round(mde + 0.05, 4), "rationale": "a large change"})
    assert strong.hypothesis.power["mde"] == pytest.approx(mde, rel=1e-5) and not strong.hypothesis.underpowered
    ledger = Ledger(config.task, config.home)
    events = {e["round"]: e for e in ledger.events(EVENT_HYPOTHESIS_REGISTERED)}
    assert (events["r0001"]["underpowered"], events["r0002"]["underpowered"]) == (True, False)
    assert events["r0001"]["mde"] == pytest.approx(mde, rel=1e-5)
    # The power is part of the registered (hashed, immutable) hypothesis; the gate is the default, unchanged.
    assert ledger.hypothesis("r0001") == weak.hypothesis and weak.hypothesis.gate == Gate()
    for key, flag in (("r0001", "true"), ("r0002", "false")):
        run = tracker.find_run(config.task, {TAG_ROUND: key, TAG_KIND: KIND_HYPOTHESIS})
        data = tracker.client.get_run(run.run_id).data
        assert data.tags[TAG_UNDERPOWERED] == flag
        assert data.metrics["mde"] == pytest.approx(mde, rel=1e-5)
    # A retry registers nothing new and keeps the recorded power.
    again = register_hypothesis(config, loop["task"], _synthesis("r0001"), tracker)
    assert again.hash == weak.hash and again.hypothesis.power == weak.hypothesis.power


def test_hypothesis_power_in_the_gate_direction_and_without_noise() -> None:
    noise = {"source": "s", "deltas": {"brier": {"se": 0.01, "confidence_level": 0.95}}}
    lower = hypothesis_power(noise, Gate(primary_metric="brier", direction="decrease"), -0.03)
    assert lower["predicted_effect"] == 0.03 and lower["mde"] == pytest.approx(minimum_detectable_effect(0.01))
    assert lower["underpowered"] is False  # 0.03 > 0.028
    assert hypothesis_power(noise, Gate(primary_metric="brier", direction="decrease"), -0.02)["underpowered"] is True
    unknown = hypothesis_power(None, Gate(), 0.01)
    assert unknown["mde"] is None and unknown["underpowered"] is None and "why_unmeasured" in unknown
    # A hypothesis registered before power was recorded keeps its hash (the field is left out of its content).
    old = Hypothesis(task="t", round="r0001", benchmark_version="b", change={}, predicted_delta=0.01, gate=Gate(),
                     seeds=(1,), recipe_hash="h", created_at=1.0)
    assert "power" not in old.to_dict() and not old.underpowered
    assert Hypothesis.from_dict(json.loads(json.dumps({**old.to_dict(), "hash": old.hash}))).hash == old.hash
    assert math.isclose(minimum_detectable_effect(0.01), 0.0280159, rel_tol=1e-5)
