"""Issue 23, "fresh seeds enforced", in the RL round: after a gate amendment, the candidate policy must be trained
on the fresh seeds the amendment requires (rule 3); the decision reads the seed from the policy checkpoint.

On a tiny real policy (the RL round tests' chat LM), decided on given aggregates as the promotion test does.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from envloop_pipelines.core.ledger.event_log import LedgerError
from envloop_pipelines.core.ledger.hypothesis import Gate
from envloop_pipelines.core.ledger.ledger import Ledger
from envloop_pipelines.core.rl_loop.sft_snapshot import build_sft_snapshot

from . import test_rl_round
from .test_rl_round import attempt, decide_given, texts

#: The RL round tests' tiny chat LM and round settings (a module fixture of test_rl_round.py).
round_setup = test_rl_round.round_setup


def test_an_amended_rl_round_refuses_a_candidate_on_a_used_seed(round_setup: dict[str, Any], tmp_path: Path) -> None:
    from envloop_pipelines.core.loop.promotion import noise_floor_from_arms
    from envloop_pipelines.core.rl_loop.step_records import ArmScore, HoldoutComparison, RlRoundResult
    from envloop_pipelines.core.rl_loop.run_round import candidate_seed, decided_rl_round
    from envloop_pipelines.core.rl_loop.round_steps import register_rl_hypothesis, train_policy
    from envloop_pipelines.core.tracking import MlflowTracker

    ds = round_setup["dataset"]
    config = replace(round_setup["config"], task="shell-rl-amended", home=str(tmp_path))
    tracker = MlflowTracker(home=tmp_path)
    ledger = Ledger(config.task, tmp_path)
    registered = register_rl_hypothesis(config, ds, "r0001", tracker, sampler={"kind": "test"})
    hyp = registered.hypothesis
    snap = build_sft_snapshot([attempt(ds.environments[0], 0, passed=True)], train_texts=texts(ds, "train"),
                              holdout_texts=texts(ds, "heldout"), root=tmp_path / "snapshots")
    recipe = config.load_recipe().replace(epochs=1)
    stale = train_policy(snap.rows(), recipe, tmp_path / "policies", snap.sha256)  # the hypothesis's seed
    assert candidate_seed({"path": stale.path}) == config.load_recipe().seed == hyp.seeds[0]

    amendment = ledger.amend_gate("r0001", Gate(primary_metric="pass_at_1", min_delta=0.1), "a stricter bar after a look")
    fresh = ledger.candidate_seeds("r0001")
    assert fresh == tuple(amendment["seeds"]) and not set(fresh) & set(hyp.seeds)

    comparison = HoldoutComparison(
        candidate=ArmScore(0.75, 0.5, 1.0, 2, 4), parent=ArmScore(0.0, 0.0, 0.0, 2, 4),
        delta={"delta": 0.75, "ci_low": 0.5, "ci_high": 1.0, "confidence_level": 0.95, "n_environments": 2},
        attempts_per_environment=2)
    floor = noise_floor_from_arms("floor-r0001", "pass_at_1", [{"pass_at_1": 0.5}, {"pass_at_1": 0.75}])

    def decide(policy: Any, **candidate: Any) -> RlRoundResult:
        return decide_given(config, tracker, registered, snap, policy, comparison, floor, **candidate)

    events = list(ledger.events())
    # Trained on the hypothesis's seed: refused, whatever seed the result claims; nothing recorded.
    for claimed in ({}, {"seed": fresh[0]}):
        with pytest.raises(LedgerError, match=rf"seed: the candidate was trained on seed {recipe.seed}, not on "
                                              rf"the fresh seeds \(\[{fresh[0]}\]\) its gate amendment 1"):
            decide(stale, **claimed)
    assert list(ledger.events()) == events and decided_rl_round(config, "r0001") is None
    # Trained on the fresh seed (what run_rl_round trains on: Ledger.candidate_seeds): decided.
    policy = train_policy(snap.rows(), recipe.replace(seed=fresh[0]), tmp_path / "policies", snap.sha256)
    decided = decide(policy)
    assert decided.promoted and decided.release == 1
    assert [e["kind"] for e in ledger.events()][len(events):] == ["holdout_read", "release_promoted", "round_decided"]
