"""Issue 23, items 6 and 8: a floor belongs to one recipe, and the MDE is the one a candidate really faces.

The fixture is a tiny imported task with a noise floor and release 1 written by hand (nothing is
trained): the null arms' and the continuation arm's test predictions are files, which the real
sandboxed verifier pairs on the real test split; ``register_hypothesis`` and ``decide_round`` write the
real ledger, round store and MLflow.
"""

from __future__ import annotations

import hashlib
import importlib.util
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from envloop_pipelines.cli.render import decision_lines
from envloop_pipelines.core.metrics.paired import minimum_detectable_effect
from envloop_pipelines.core.data.datasets import import_file
from envloop_pipelines.core.loop.config import LoopConfig
from envloop_pipelines.core.decision_loop.promotion_decision import FloorRecipeError, decide_round
from envloop_pipelines.core.ledger.event_log import EVENT_CHECKPOINT_TRAINED, EVENT_ROUND_DECIDED
from envloop_pipelines.core.ledger.hypothesis import Gate, Hypothesis
from envloop_pipelines.core.ledger.ledger import Ledger
from envloop_pipelines.core.ledger.reads import ROUND_TEST_READ_BUDGET
from envloop_pipelines.core.model.checkpoint import RECIPE_FILE
from envloop_pipelines.core.model.recipe import dump_recipe
from envloop_pipelines.core.verify.runner import read_result_digest
from envloop_pipelines.core.loop.promotion import gate_bar, noise_floor_from_arms
from envloop_pipelines.core.decision_loop.step_records import (
    EnvironmentSynthesis,
    MeasuredNoiseFloor,
    Reevaluation,
    RegisteredHypothesis,
    TrainedCheckpoint,
    TrainingSnapshot,
)
from envloop_pipelines.core.decision_loop.noise_floor import continuation_path, noise_floor_key
from envloop_pipelines.core.decision_loop.registered_hypothesis import UnmeasuredPowerError, paired_noise, register_hypothesis
from envloop_pipelines.core.ledger.store import RoundStore
from envloop_pipelines.core.storage import atomic_write_json, atomic_write_parquet
from envloop_pipelines.core.tracking import KIND_HYPOTHESIS, TAG_KIND, TAG_ROUND, MlflowTracker

from .data.test_snapshots import dataset
from .measured_power import measured_power

METRIC = "family_macro_accuracy"
Z975, Z80 = 1.959964, 0.841621


def _predictions(test: pa.Table, answers: list[int]) -> pa.Table:
    probs = []
    for keys, a in zip(test.column("option_keys").to_pylist(), answers):
        p = np.full(len(keys), 0.1 / (len(keys) - 1))
        p[a % len(keys)] = 0.9
        probs.append(p.tolist())
    return pa.table({"record_id": test.column("record_id"), "question_id": test.column("question_id"),
                     "option_keys": test.column("option_keys"), "probs": probs})


def _files(home: Path) -> dict[str, str]:
    """Every file under ``home`` but MLflow's and the verifier's scratch, by content hash."""
    return {str(p.relative_to(home)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(home.rglob("*"))
            if p.is_file() and "mlflow" not in p.name and "mlruns" not in p.parts}


@pytest.fixture()
def loop(tmp_path: Path) -> dict[str, Any]:
    """A floor whose two null arms give the same answers but one (the demo's near-agreeing arms), a
    continuation arm that disagrees with the control on most questions, and release 1 = the control arm."""
    home = tmp_path / "home"
    snap = import_file(dataset(tmp_path), "tickets", home=home)
    config = LoopConfig(task="tickets", home=str(home), noise_arms=2, safety_families=())
    store = RoundStore(config.task, config.home)
    key = noise_floor_key(snap.benchmark_version, config)
    test = snap.table("test")
    n = test.num_rows
    rng = np.random.default_rng(0)
    control = rng.integers(0, 7, n).tolist()
    twin = list(control)
    twin[0] += 1  # the second null arm: one answer apart
    moved = [a + 1 for a in control]  # trained on from the control: every answer moves
    arms = []
    for seed, answers in ((0, control), (1, twin)):
        path = atomic_write_parquet(store.noise / key / f"arm-seed{seed}-test.parquet", _predictions(test, answers))
        arms.append({"seed": seed, "test_predictions": str(path), "checkpoint": "/none", "checkpoint_sha256": "c0"})
    cont = atomic_write_parquet(store.noise / key / "continuation-seed5000-test.parquet", _predictions(test, moved))
    atomic_write_json(continuation_path(store, key), {"noise_key": key, "arms": [
        {"seed": 5000, "init_from": "c0", "test_predictions": str(cont)}]})
    floor = noise_floor_from_arms(key, METRIC, [{METRIC: 0.50}, {METRIC: 0.51}], arms)
    measured = MeasuredNoiseFloor(floor=floor, benchmark_version=snap.benchmark_version,
                                  recipe_hash=config.recipe_hash(), identity="i")
    atomic_write_json(store.noise / f"{key}.json", measured.to_dict())
    Ledger(config.task, config.home).write_release_card(1, {
        "round": "bootstrap", "release": 1, "benchmark_version": snap.benchmark_version,
        "recipe_hash": config.recipe_hash(), "checkpoint_dir": "/none", "checkpoint_sha256": "c0",
        "test": {METRIC: 0.50}}, "# release 1\n")
    return {"config": config, "home": home, "measured": measured, "tracker": MlflowTracker(home=home),
            "benchmark": snap.benchmark_version, "n": n, "test": test, "task": snap}


def _synthesis(key: str) -> EnvironmentSynthesis:
    return EnvironmentSynthesis(round=key, generator="builtin_targeted", n_rows=0, per_cluster={}, clusters=(),
                                path="", sha256="")


# -- item 8: an honest MDE ---------------------------------------------------------------------------------

def test_the_mde_formula_accounts_for_the_bar() -> None:
    # The textbook MDE without a bar (unchanged), and with one: max(bar, z·se) + z_power·se.
    assert minimum_detectable_effect(0.01) == pytest.approx((Z975 + Z80) * 0.01, rel=1e-5)
    assert minimum_detectable_effect(0.01, bar=0.05) == pytest.approx(0.05 + Z80 * 0.01, rel=1e-5)
    assert minimum_detectable_effect(0.01, bar=0.01) == pytest.approx((Z975 + Z80) * 0.01, rel=1e-5)
    # The issue's figures: the null arms' se 0.0027 gave 0.0076 for a round whose CI is ±0.033 (se ≈ 0.017);
    # the se a round really shows gives an MDE within a factor 1.5 of that half-width.
    assert minimum_detectable_effect(0.0027) == pytest.approx(0.0076, abs=1e-4)
    honest = minimum_detectable_effect(0.017, bar=0.03)
    assert 1.0 < honest / (Z975 * 0.017) < 1.5
    with pytest.raises(ValueError, match="bar"):
        minimum_detectable_effect(0.01, bar=-0.1)


def test_the_mde_comes_from_the_continuation_arm_not_from_null_arms_that_agree(loop: dict[str, Any]) -> None:
    config = loop["config"]
    noise = paired_noise(config, loop["task"])
    assert noise is not None and noise["pairs"] == [
        "continuation arm seed 5000 (trained from the control arm, seed 0) vs the control arm"]
    se = noise["deltas"][METRIC]["se"]
    # The null arms differ on one question: their paired se would be ~0; the continuation arm's is large.
    assert se > 0.05
    registered = register_hypothesis(config, loop["task"], _synthesis("r0001"), loop["tracker"])
    power = registered.hypothesis.power
    bar = gate_bar(Gate(), loop["measured"].floor, 0.50)["bar"]
    assert bar == pytest.approx(loop["measured"].floor.seed_bound() - 0.50)
    assert power["se"] == pytest.approx(se) and power["bar"] == pytest.approx(bar)
    assert power["mde"] == pytest.approx(max(bar, Z975 * se) + Z80 * se, rel=1e-5)
    assert power["n_pairs"] == 1 and power["underpowered"] is True


def test_the_mde_pools_earlier_rounds_of_this_ledger(loop: dict[str, Any]) -> None:
    config = loop["config"]
    first = paired_noise(config, loop["task"])["deltas"][METRIC]["se"]
    ledger = Ledger(config.task, config.home)
    h = Hypothesis(task=config.task, round="r0001", benchmark_version=loop["benchmark"], change={},
                   predicted_delta=0.01, gate=Gate(), seeds=(1,), recipe_hash=config.recipe_hash(),
                   power=measured_power(0.01))
    ledger.register_hypothesis(h)
    RoundStore(config.task, config.home).save("independent_reeval", Reevaluation(
        round="r0001", benchmark_version=loop["benchmark"], candidate={}, champion={}, tfidf_baseline={},
        paired={"deltas": {METRIC: {"delta": 0.0, "ci_low": -0.1, "ci_high": 0.1, "se": 0.2,
                                    "confidence_level": 0.95}}}, complete=True, verifier_pid=None, verifier={},
        candidate_checkpoint_sha256="c1", champion_checkpoint_sha256="c0"), "r0001")
    ledger.append(EVENT_ROUND_DECIDED, {"round": "r0001", "promoted": False, "observed_delta": 0.0, "release": None},
                  key="decided:r0001")
    pooled = paired_noise(config, loop["task"])
    assert pooled["deltas"][METRIC]["n_pairs"] == 2 and "round r0001: candidate vs champion" in pooled["pairs"]
    assert pooled["deltas"][METRIC]["se"] == pytest.approx(math.sqrt((first ** 2 + 0.2 ** 2) / 2))


def test_a_hypothesis_without_an_mde_is_not_registered(loop: dict[str, Any]) -> None:
    config, home, tracker = loop["config"], loop["home"], loop["tracker"]
    before = _files(home)
    # A round run with another recipe (a launchpad recipe_overrides): no floor for it, so no MDE.
    other = LoopConfig(task="tickets", home=str(home), noise_arms=2, safety_families=(),
                       recipe_overrides={"max_steps": 3})
    with pytest.raises(UnmeasuredPowerError, match="no minimum detectable effect: no noise floor for this loop's recipe"):
        register_hypothesis(other, loop["task"], _synthesis("r0001"), tracker)
    # The floor of this recipe, but no continuation arm and no earlier round: no se a candidate shows.
    continuation_path(RoundStore(config.task, config.home), loop["measured"].floor.key).unlink()
    before = _files(home)
    with pytest.raises(UnmeasuredPowerError, match="no continuation arm"):
        register_hypothesis(config, loop["task"], _synthesis("r0001"), tracker)
    assert _files(home) == before  # ledger, hypothesis files, round store unchanged
    assert Ledger(config.task, config.home).hypothesis("r0001") is None
    assert tracker.find_run(config.task, {TAG_ROUND: "r0001", TAG_KIND: KIND_HYPOTHESIS}) is None


# -- item 6: a floor belongs to one recipe -----------------------------------------------------------------

def _round(loop: dict[str, Any], *, recipe_hash: str, gain: float) -> tuple[Any, ...]:
    config = loop["config"]
    power = {"metric": METRIC, "mde": 0.0476, "se": 0.017, "bar": 0.03}
    h = Hypothesis(task=config.task, round="r0001", benchmark_version=loop["benchmark"], change={},
                   predicted_delta=0.01, gate=Gate(), seeds=(1,), recipe_hash=recipe_hash, power=power)
    digest = Ledger(config.task, config.home).register_hypothesis(h)
    registered = RegisteredHypothesis(hypothesis=h, hash=digest, mlflow_run_id="m", mlflow_url="u")
    snapshot = TrainingSnapshot(round="r0001", sha256="d", path="/d", n_rows=1, n_base=1, n_synthesized=0,
                                n_removed=0, contamination={"clean": True}, schema_ok=True,
                                benchmark_version=loop["benchmark"])
    # The candidate's checkpoint as training records it: the loop's recipe with the hypothesis's seed.
    ckpt = Path(config.home) / "c1"
    ckpt.mkdir(exist_ok=True)
    (ckpt / RECIPE_FILE).write_text(dump_recipe(config.load_recipe().replace(seed=1)), encoding="utf-8")
    candidate = TrainedCheckpoint(round="r0001", checkpoint=str(ckpt), checkpoint_sha256="c1", init_from="c0",
                                  snapshot_sha256="d", seed=1, train_s=1.0, metrics={}, mlflow_run_id="m",
                                  mlflow_url="u", hypothesis_hash=digest)
    reeval = Reevaluation(round="r0001", benchmark_version=loop["benchmark"], candidate={METRIC: 0.5 + gain, "ece": 0.0},
                          champion={METRIC: 0.50}, tfidf_baseline={},
                          paired={"deltas": {METRIC: {"delta": gain, "ci_low": gain - 0.033, "ci_high": gain + 0.033,
                                                      "se": 0.017}}},
                          complete=True, verifier_pid=None, verifier={}, candidate_checkpoint_sha256="c1",
                          champion_checkpoint_sha256="c0")
    # The round's own paired read of its candidate, as the verifier records it (its result's digest).
    ledger = Ledger(config.task, config.home)
    ledger.append(EVENT_CHECKPOINT_TRAINED, {"round": "r0001", "checkpoint_sha256": "c1", "seed": 1},
                  key="arm:r0001:c1")
    if ledger.round_candidate_read("r0001") is None:
        with ledger.reading_test("round:r0001", "p" * 64, "b" * 64, budget=ROUND_TEST_READ_BUDGET) as record:
            record("ok", result_sha256=read_result_digest(reeval.candidate, reeval.champion, reeval.paired))
    return registered, snapshot, candidate, reeval


def test_a_floor_of_another_recipe_gates_no_round(loop: dict[str, Any]) -> None:
    config, measured = loop["config"], loop["measured"]
    registered, snapshot, candidate, reeval = _round(loop, recipe_hash=config.recipe_hash(), gain=0.30)
    foreign = MeasuredNoiseFloor(floor=measured.floor, benchmark_version=measured.benchmark_version,
                                 recipe_hash="0" * 64, identity="i")
    before = _files(loop["home"])
    with pytest.raises(FloorRecipeError, match="noise_floor.recipe_hash 0000000000000000 is not the recipe of the "
                                               "candidate's parent"):
        decide_round(config, loop["task"], registered, snapshot, candidate, reeval, foreign, loop["tracker"])
    assert _files(loop["home"]) == before  # no decision, no ledger event, no release
    assert list(Ledger(config.task, config.home).events(EVENT_ROUND_DECIDED)) == []


def test_a_round_of_another_recipe_than_the_floor_is_not_decided(loop: dict[str, Any]) -> None:
    config = loop["config"]
    registered, snapshot, candidate, reeval = _round(loop, recipe_hash="1" * 64, gain=0.30)
    with pytest.raises(FloorRecipeError, match=r"is not the round's recipe \(hypothesis.recipe_hash 1111"):
        decide_round(config, loop["task"], registered, snapshot, candidate, reeval, loop["measured"], loop["tracker"])
    assert list(Ledger(config.task, config.home).events(EVENT_ROUND_DECIDED)) == []


def test_the_floor_of_the_parents_recipe_decides_and_the_line_shows_the_mde(loop: dict[str, Any]) -> None:
    config = loop["config"]
    registered, snapshot, candidate, reeval = _round(loop, recipe_hash=config.recipe_hash(), gain=0.001)
    decision = decide_round(config, loop["task"], registered, snapshot, candidate, reeval, loop["measured"], loop["tracker"])
    assert not decision.promote
    assert decision.checks["mde"] == 0.0476 and decision.checks["ci_half_width"] == pytest.approx(0.033)
    line = decision_lines("r0001", decision)[0]
    assert f"bar {decision.checks['bar']:.4f}, MDE 0.0476 vs CI half-width 0.0330" in line


def test_the_decision_lives_in_the_ledger_and_a_retry_returns_it(loop: dict[str, Any]) -> None:
    """Issue 25: core writes no step record at the IO manager's path. The decision rides on ``round_decided``;
    ``rounds/<round>/promotion_decision.json`` is the IO manager's, and a retry returns the ledger's decision
    (on the old code core wrote the file itself)."""
    import dataclasses

    config = loop["config"]
    registered, snapshot, candidate, reeval = _round(loop, recipe_hash=config.recipe_hash(), gain=0.001)
    decision = decide_round(config, loop["task"], registered, snapshot, candidate, reeval, loop["measured"],
                            loop["tracker"])
    ledger = Ledger(config.task, config.home)
    assert not RoundStore(config.task, config.home).step_path("promotion_decision", "r0001").exists()
    assert ledger.round_decision("r0001") == decision.to_dict()
    # A retry of the step (even handed other numbers) returns the decision made, decides nothing again.
    _, _, _, better = _round(loop, recipe_hash=config.recipe_hash(), gain=0.30)
    again = decide_round(config, loop["task"], registered, snapshot, dataclasses.replace(candidate), better,
                         loop["measured"], loop["tracker"])
    assert again == decision and not again.promote
    assert len(list(ledger.events(EVENT_ROUND_DECIDED))) == 1


# -- the A/A bench's replicate design ----------------------------------------------------------------------

def _bench() -> Any:
    path = Path(__file__).resolve().parents[2] / "bench" / "bench_aa.py"
    spec = importlib.util.spec_from_file_location("bench_aa_under_test", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_aa_bench_draws_replicates_without_reuse() -> None:
    bench = _bench()
    # As in the loop, the champion is the floor's control arm: 3 arms + a candidate, 4 checkpoints a replicate.
    disjoint = bench.disjoint_replicates(24, arms=3)
    assert len(disjoint) == 6
    used = [i for r in disjoint for i in r.members]
    assert len(used) == len(set(used)) == 24  # no checkpoint in two replicates: they are independent
    assert all(r.champion == r.arms[0] and r.candidate not in r.arms for r in disjoint)
    # A champion apart from the arms: 5 a replicate, 4 disjoint ones in 24.
    apart = bench.disjoint_replicates(24, arms=3, separate_champion=True)
    assert len(apart) == 4 and all(r.champion not in r.arms and len(r.members) == 5 for r in apart)
    draws = bench.resampled_replicates(24, arms=3, n=50, seed=0)
    assert len(draws) == 50 and all(len(r.members) == 4 for r in draws)  # no reuse inside a draw
    assert len({r.members for r in draws}) > 40  # fresh draws, not one replicate repeated
    # The jackknife interval over the pool brackets the resampled rate.
    outcomes = [r.candidate % 5 == 0 for r in draws]
    rate, low, high = bench.jackknife_interval(draws, outcomes, 24)
    assert rate == pytest.approx(np.mean(outcomes)) and 0.0 <= low <= rate <= high <= 1.0 and high > low
    with pytest.raises(ValueError, match="needs 4 checkpoints"):
        bench.resampled_replicates(3, arms=3, n=1)
