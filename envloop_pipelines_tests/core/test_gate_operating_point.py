"""Issue 45: the gate's measured operating point, on record per design, shown on the card and under the ledger.

The last test runs ``bench/bench_gate_evidence.py --smoke`` end to end (the cheap design: 40 users x 3 records,
2-step checkpoints): the plan is registered before anything trains and a second plan is refused, each replicate
is on record whole, the null candidates are refused by the real gate, and ``--record`` puts the design's point
where the card and the ledger read it. The design-scale figures are the bench's, not the suite's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from envloop_pipelines.core.decision_loop.promotion_decision import floor_limitation
from envloop_pipelines.core.ledger.event_log import EVENT_HYPOTHESIS_REGISTERED, EVENT_NULL_ARM
from envloop_pipelines.core.ledger.hypothesis import Gate
from envloop_pipelines.core.loop import operating_point as op
from envloop_pipelines.core.release.card import render_card

REPO = Path(__file__).resolve().parents[2]
GATE = dict(Gate().__dict__)


def _point(benchmark: str = "bv1", recipe: str = "r" * 64, arms: int = 2, *, promoted: int = 0) -> dict:
    return {"design": op.design_of(benchmark, recipe, arms, GATE), "measured": "2026-12-07",
            "null": {"n": 60, "promoted": promoted, "cp95": [0.0, 0.0596]},
            "power": {"+300 steps": {"n": 20, "promoted": 15, "mean_gain": 0.0231, "formula_power": 0.81}},
            "lineage_spread": {"control_sd": 0.006, "lineage_sd": 0.004, "n_control": 120, "n_lineage": 20,
                               "lineage_steps": 324, "bounded": True}}


def test_a_point_is_found_at_its_own_design_only(tmp_path: Path) -> None:
    path = tmp_path / "points.json"
    assert op.recorded_points(path) == [] and op.measured_operating_point("bv1", "r" * 64, 2, GATE, path=path) is None
    op.record_operating_point(_point(), path=path)
    op.record_operating_point(_point("bv2"), path=path)
    assert op.measured_operating_point("bv1", "r" * 64, 2, GATE, path=path)["design"]["benchmark_version"] == "bv1"
    # another K, recipe or gate is another design: no figure of a neighbour is shown for it
    assert op.measured_operating_point("bv1", "r" * 64, 3, GATE, path=path) is None
    assert op.measured_operating_point("bv1", "s" * 64, 2, GATE, path=path) is None
    assert op.measured_operating_point("bv1", "r" * 64, 2, {**GATE, "min_delta": 0.01}, path=path) is None
    op.record_operating_point(_point(promoted=1), path=path)  # a new measurement replaces its design's
    assert len(op.recorded_points(path)) == 2
    assert op.measured_operating_point("bv1", "r" * 64, 2, GATE, path=path)["null"]["promoted"] == 1
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="points.json"):
        op.recorded_points(path)


def test_the_text_names_the_rate_its_interval_and_the_power_or_says_none_is_measured() -> None:
    text = op.operating_point_text(_point())
    assert "false promotions 0/60" in text and "[0.000, 0.060]" in text and "power 15/20 for +300 steps" in text
    assert "the control floor bounds it" in text and "bench/bench_gate_evidence.py, 2026-12-07" in text
    assert "not measured at this design" in op.operating_point_text(None)
    assert "under way" not in text  # no plan named: nothing to compare against
    partial = op.operating_point_text({**_point(), "registered": {"null_seed": 60, "null_lever": 20, "power_300": 20}})
    assert "under way: 60 of the 80 registered null candidates on record" in partial
    whole = op.operating_point_text({**_point(), "registered": {"null_seed": 40, "null_lever": 20, "power_300": 20}})
    assert "under way" not in whole


def test_the_card_shows_the_point_and_says_whether_the_floor_bounds_the_champions_lineage() -> None:
    card = {"release": 2, "task": "t", "round": "r0001", "benchmark_version": "bv1", "data_snapshot": "d" * 16,
            "recipe_hash": "r" * 16, "checkpoint_sha256": "c" * 16, "gate": GATE, "noise_floor": 0.002,
            "gate_operating_point": _point(), "limitations": [floor_limitation(_point(), {"init": None})]}
    text = render_card(card)
    assert "- operating point: the gate's operating point at this design: false promotions 0/60" in text
    assert "324-step lineage of one budget round is 0.0040 against 0.0060" in text and "bounds it" in text
    bare = render_card({**card, "gate_operating_point": None,
                        "limitations": [floor_limitation(None, {"recipe_diff": {"max_steps": 300}})]})
    assert "- operating point: the gate's operating point is not measured at this design" in bare
    assert "no seed spread at such a lineage is on record" in bare
    old = {k: v for k, v in card.items() if k != "gate_operating_point"}  # a card written before issue 45
    assert "operating point" not in render_card(old)


def test_the_design_of_a_ledger_is_its_last_hypothesis_and_its_floors_arms() -> None:
    events = [{"kind": EVENT_NULL_ARM, "noise_key": "k1", "seed": s} for s in (0, 1)]
    assert op.design_from_events(events) is None  # no hypothesis yet
    events.append({"kind": EVENT_HYPOTHESIS_REGISTERED, "round": "r0001", "benchmark_version": "bv1",
                   "recipe_hash": "r" * 64, "gate": GATE})
    assert op.design_from_events(events) == op.design_of("bv1", "r" * 64, 2, GATE)
    old = [{"kind": EVENT_HYPOTHESIS_REGISTERED, "round": "r0001"}, *events[:2]]  # registered before issue 45
    assert op.design_from_events(old) is None


def test_the_packaged_record_is_valid_and_each_point_names_a_whole_design() -> None:
    for point in op.recorded_points():
        assert set(point["design"]) == {"benchmark_version", "recipe_hash", "noise_arms", "gate"}
        assert point["null"]["n"] >= 1 and point["measured"]


def _bench(results: Path, home: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "ENVLOOP_PROGRESS": "log", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, str(REPO / "bench" / "bench_gate_evidence.py"), "--smoke",
                           "--results", str(results), "--home", str(home), *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)


def test_the_cheap_design_runs_end_to_end_and_the_gate_refuses_its_null_candidates(tmp_path: Path) -> None:
    results, home = tmp_path / "results", tmp_path / "home"
    done = _bench(results, home)
    assert done.returncode == 0, done.stderr[-3000:]
    plan = json.loads((results / "plan.json").read_text())
    assert plan["counts"] == {"null_seed": 2, "null_lever": 1, "power_96": 1, "power_300": 1}
    records = [json.loads(p.read_text()) for p in sorted((results / "replicates").glob("r*.json"))]
    assert [r["replicate"] for r in records] == [0, 1]
    first = records[0]
    assert set(first["candidates"]) == {"null_seed", "null_lever", "power_96", "power_300"}
    assert set(records[1]["candidates"]) == {"null_seed"}
    seeds = [m["seed"] for r in records for m in [*r["arms"], *(c["member"] for c in r["candidates"].values())]]
    assert len(seeds) == len(set(seeds))  # disjoint: no checkpoint serves two replicates
    assert first["candidates"]["power_300"]["member"]["init_from"] == first["arms"][0]["checkpoint_sha256"]
    lever = first["candidates"]["null_lever"]["member"]
    assert lever["recipe_hash"] != first["arms"][0]["recipe_hash"]  # a lever: the hash changes, the model does not
    for r in records:  # at the cheap design the real gate refuses every null candidate, with its reasons
        for kind in ("null_seed", "null_lever"):
            if kind in r["candidates"]:
                decision = r["candidates"][kind]["decision"]
                assert decision["promote"] is False and decision["reasons"]
    assert "false promotions, null seed and null lever together: 0 / 3" in done.stdout
    assert "power, power_300: promoted" in done.stdout
    # the plan is registered: another plan in the same folder is refused, nothing is trained
    (results / "plan.json").write_text(json.dumps({**plan, "counts": {"null_seed": 99}}))
    refused = _bench(results, home)
    assert refused.returncode != 0 and "another plan is registered there" in refused.stderr
    # --record puts the point on record for its design (here a copy of the package's file, not the package's)
    (results / "plan.json").write_text(json.dumps(plan))
    target = tmp_path / "points.json"
    shown = _bench(results, home, "--report-only", "--record", "--points-file", str(target))
    assert shown.returncode == 0, shown.stderr[-2000:]
    d = plan["design"]
    point = op.measured_operating_point(d["benchmark_version"], d["recipe_hash"], d["noise_arms"], d["gate"],
                                        path=target)
    assert point is not None and point["null"] == {**point["null"], "n": 3, "promoted": 0}


def test_a_card_gated_by_a_lineage_floor_names_it_and_its_making() -> None:
    """Issue 45, item 2: a round over a champion a round made is gated by that champion's lineage floor; its card
    says so on the gate line and in its limitations, with the values and the making the arms repeated."""
    from envloop_pipelines.core.decision_loop.promotion_decision import floor_source
    from envloop_pipelines.core.decision_loop.step_records import MeasuredNoiseFloor
    from envloop_pipelines.core.loop.promotion import noise_floor_from_arms

    making = {"round": "r0001", "release": 2, "recipe_diff": {"max_steps": 300}, "parent_release": 1,
              "parent_checkpoint_sha256": "p" * 64, "init": "parent", "seed": 1001, "training_snapshot": "s" * 64}
    lineage = MeasuredNoiseFloor(floor=noise_floor_from_arms("lk", "family_macro_accuracy",
                                                             [{"family_macro_accuracy": 0.5269},
                                                              {"family_macro_accuracy": 0.5190}]),
                                 benchmark_version="bv1", recipe_hash="r" * 64, identity="i", source="lineage",
                                 champion_checkpoint_sha256="c" * 64, control_key="ck", making=making)
    text = floor_limitation(_point(), {"recipe_diff": {"max_steps": 24}}, lineage)
    assert text.startswith("The noise floor that gated this round was measured at the champion's own making: "
                           "release 2 (round r0001, recipe_diff {'max_steps': 300}, trained from release 1")
    assert "0.5269, 0.5190 on test: spread 0.0079" in text and "1 lineage arm(s)" in text
    card = {"release": 3, "task": "t", "round": "r0002", "benchmark_version": "bv1", "data_snapshot": "d" * 16,
            "recipe_hash": "r" * 16, "checkpoint_sha256": "c" * 16, "gate": GATE, "noise_floor": 0.0079,
            "noise_floor_source": floor_source(lineage), "limitations": [text]}
    rendered = render_card(card)
    assert ("- noise floor: 0.0079 (the lineage floor of release 2: its test score and its making, round r0001, "
            "repeated with fresh seeds: 0.5269, 0.5190; key lk)") in rendered
    control = MeasuredNoiseFloor(floor=lineage.floor, benchmark_version="bv1", recipe_hash="r" * 64, identity="i")
    assert floor_source(control) == {"source": "control", "key": "lk", "values": [0.5269, 0.519],
                                     "floor": pytest.approx(0.0079)}
    assert "the control recipe's null arms" in render_card({**card, "noise_floor_source": floor_source(control)})
    assert floor_limitation(_point(), {"init": None}, control) == floor_limitation(_point(), {"init": None})


def test_the_packaged_point_is_the_readme_demos_design() -> None:
    """The point on record is measured at ``make run``'s design, so the demo's cards show it (not a neighbour's)."""
    from envloop_pipelines.cli.demo import demo_loop_settings
    from envloop_pipelines.core.loop.config import LoopConfig

    demo = LoopConfig(**demo_loop_settings())
    designs = [p["design"] for p in op.recorded_points()]
    assert any(d["recipe_hash"] == demo.recipe_hash() and d["noise_arms"] == demo.noise_arms
               and d["gate"] == op.design_of("", "", 0, GATE)["gate"] for d in designs), designs
