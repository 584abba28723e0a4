"""The decision model as its own agent: sampled answers the verifier passed become training rows.

A small built-in task (20 users) and a small real champion (the packaged MiniLM decision head,
two optimizer steps): its calibrated distribution is sampled on the dev questions, the sandboxed
rule verifier judges the answers, and only the right ones come back, labelled with the sampled
option. The test reads the dev labels itself (as the verifier does) to check exactly that.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from envloop_pipelines.core.data.snapshots import open_task
from envloop_pipelines.core.decision_loop.self_answers import SelfAnswerGenerator, sample_options, verified_self_answers
from envloop_pipelines_tests.core.test_model_data import limit_threads_under_xdist

limit_threads_under_xdist()


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from envloop_pipelines.core.benchmark.builtin_task import generate_builtin_task
    from envloop_pipelines.testing.serve import build_checkpoint

    home = tmp_path_factory.mktemp("self-home")
    generate_builtin_task(task="pa", n_users=20, records_per_user=3, home=home)
    return {"home": home, "checkpoint": build_checkpoint(tmp_path_factory.mktemp("self-ckpt") / "ckpt")}


def test_sampling_follows_the_distribution() -> None:
    picks = sample_options([np.array([0.7, 0.2, 0.1])] * 4000, seed=3)
    share = np.bincount(picks, minlength=3) / 4000
    assert np.allclose(share, [0.7, 0.2, 0.1], atol=0.03)
    assert sample_options([np.array([0.5, 0.5])] * 10, seed=1) == sample_options([np.array([0.5, 0.5])] * 10, seed=1)
    assert sample_options([np.array([0.0, 1.0])] * 5, seed=0) == [1] * 5


def test_only_verified_self_answers_become_rows(setup: dict[str, Any]) -> None:
    snapshot = open_task("pa", home=setup["home"])
    table, stats = verified_self_answers(setup["checkpoint"], snapshot, split="dev", seed=7, home=setup["home"])
    labels = {(r["record_id"], r["question_id"]): r for r in snapshot.labels("dev").to_pylist()}
    assert stats.n_questions == snapshot.table("dev").num_rows and 0 < stats.n_passed < stats.n_questions
    assert table.num_rows == stats.n_passed and 0.0 < stats.pass_rate < 1.0
    for row in table.to_pylist():
        prov = json.loads(row["provenance"])
        truth = labels[(prov["source_record"], prov["question_id"])]
        # Every kept row is a right answer: the sampled option is the hidden label.
        assert row["label"] == truth["label"] and row["option_keys"][row["label"]] == prov["sampled_option"]
        assert row["soft_label"] is None and row["record_id"] == f"{prov['source_record']}~self-dev"
        assert prov["generator"] == "self_answers" and prov["checkpoint_sha256"] == stats.checkpoint_sha256
        assert 0.0 < prov["sampled_probability"] <= 1.0
    # The same seed samples the same answers; another seed others.
    again, _ = verified_self_answers(setup["checkpoint"], snapshot, split="dev", seed=7, home=setup["home"])
    assert again.equals(table)


def test_hidden_splits_and_train_are_refused(setup: dict[str, Any]) -> None:
    for split in ("test", "holdout", "train"):
        with pytest.raises(ValueError, match="self-answers sample on val or dev"):
            verified_self_answers(setup["checkpoint"], open_task("pa", home=setup["home"]), split=split,
                                  home=setup["home"])


def test_the_generator_aims_at_the_clusters_families_and_caps_the_rows(setup: dict[str, Any]) -> None:
    from envloop_pipelines.core.decision_loop.failure_mining import FailureCluster
    from envloop_pipelines.core.decision_loop.synthesis import SNAPSHOT_SCHEMA, SynthesisRequest

    table, _ = verified_self_answers(setup["checkpoint"], open_task("pa", home=setup["home"]), split="dev", seed=5,
                                     home=setup["home"])
    family = table.column("family").to_pylist()[0]
    cluster = FailureCluster(key={"family": family}, n=4, errors=2, confident_errors=1, error_rate=0.5, excess_errors=1.0,
                             example_ids=())
    generator = SelfAnswerGenerator(setup["checkpoint"], "pa", home=setup["home"])
    out = generator.synthesize(SynthesisRequest(round="r0001", clusters=(cluster,), n_examples=2, seed=5), table)
    assert out.schema == SNAPSHOT_SCHEMA and out.num_rows <= 2
    assert set(out.column("family").to_pylist()) <= {family} and generator.stats.n_passed >= out.num_rows
