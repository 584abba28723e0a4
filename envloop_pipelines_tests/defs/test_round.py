"""A full round materialized with an ephemeral Dagster instance on a small, learnable task and the packaged model.

The task is imported data (:func:`learnable_tickets`): short tickets whose queue and refund are stated in
one sentence each among random filler words, so a few dozen optimizer steps learn them. That is what lets
round 2's promotion go through the real gate: the bootstrap champion saw 2 steps and answers at chance,
the hypothesis trains 80 more, and the paired gain clears the measured noise floor with a CI above zero on
80 test questions (40 records), the default guards included. The built-in benchmark learns too slowly on
CPU for a test of this size to show a real gain.
"""

from __future__ import annotations

import json
from typing import Any

import dagster as dg
import pytest

from envloop_pipelines.core.data.snapshots import open_task
from envloop_pipelines.core.decision_loop.lora_checkpoint import train_candidate
from envloop_pipelines.core.decision_loop.noise_floor import measure_noise_floor
from envloop_pipelines.core.loop.config import round_key
from envloop_pipelines.core.decision_loop.step_records import RegisteredHypothesis, RoundDecision, TrainingSnapshot
from envloop_pipelines.core.ledger.store import RoundStore
from envloop_pipelines.core.loop.budget import LoopBudget, start_loop
from envloop_pipelines.core.ledger.event_log import LedgerError
from envloop_pipelines.core.ledger.hypothesis import Gate
from envloop_pipelines.core.ledger.ledger import Ledger
from envloop_pipelines.core.tracking import KIND_HYPOTHESIS, KIND_REEVAL, KIND_ROUND, KIND_TRAINING, TAG_KIND, TAG_ROUND, MlflowTracker
from envloop_pipelines.definitions import defs as load_code_location
from envloop_pipelines.defs.rounds.assets import ROUND_ASSETS, noise_floor, task_benchmark, with_upstream_sources
from envloop_pipelines.defs.rounds.checks import ROUND_CHECKS
from envloop_pipelines.defs.rounds.sensors import next_round_sensor
from envloop_pipelines.resources.loop import LoopResource, MlflowResource
from envloop_pipelines.resources.round_store import RoundStoreIOManager
from envloop_pipelines.resources.sandbox import SandboxResource
defs = load_code_location()

pytestmark = pytest.mark.slow
REPOSITORY = defs.get_repository_def()

TASK = "tickets"
# Small and fast: 400 one-record users (test and holdout: 40 records, 80 questions each), 2 null arms,
# 2 optimizer steps per arm (the champion answers at chance).
# The encoder and head alone (no lexical part, every layer trained: the CPU default before issue 24): this
# module's promoting round and its cards are about the loop's mechanics on a head that learns the cues; with
# the default's TF-IDF part the champion already answers these 80 lexically easy questions right at 2 steps.
LOOP = dict(task=TASK, noise_arms=2, n_synthesized=12, recipe_overrides=
            {"max_steps": 2, "max_length": 128, "lexical": False, "frozen_layers": 0, "family_head": False})
GENERATOR = "label_preserving_variants"  # imported data: variants of its own training rows
N_USERS = 400
# A person's hypothesis for round 2: 80 more steps from the champion, under the default gate (the measured
# floor x 1, the paired CI above zero, every guard). Measured in this loop (2 shared cores, ~50 s of training):
# 40 steps gained +0.0875 [-0.0375, +0.2] (refused: CI); 80 answer all 80 test questions right, +0.575
# [+0.4875, +0.6625] on family-macro accuracy over a floor of 0.075, ECE 0.0 (the champion: 0.425, chance).
PROMOTING = {"change": {"kind": "recipe", "recipe_diff": {"max_steps": 80}},
             "predicted_delta": 0.3,
             "rationale": "the bootstrap champion saw 2 steps and answers at chance; the stated cues are learnable"}

# Round 3, over release 2 (a champion a round made: 80 steps from release 1): gated by release 2's lineage floor
# (issue 45), which repeats its making with a fresh seed. The change is 2 steps more; the champion answers every
# test question right, so nothing can be promoted over it.
AFTER_PROMOTION = {"change": {"kind": "recipe", "recipe_diff": {"max_steps": 2}}, "predicted_delta": 0.01,
                   "rationale": "a round over a champion a round made: its lineage floor gates it"}

_FILLER = ("apple river stone cloud pencil garden window mirror candle ladder basket forest engine violin tunnel "
           "harbor meadow copper silver velvet marble lantern compass orchard canyon glacier falcon dolphin tiger "
           "cactus pepper ginger walnut almond saddle anchor beacon bridge castle desert island jungle valley "
           "summit temple throne vessel wagon yacht zebra badge bottle button carpet cellar chimney cradle "
           "curtain dagger feather fountain goblet hammer helmet kettle lever magnet needle paddle pillow puzzle "
           "quiver ribbon rocket scroll shield spoon statue sword tablet teapot thimble torch trumpet umbrella "
           "vase whistle wreath acorn blossom bramble clover daisy fern heather ivy lily maple moss nettle oak "
           "orchid pine poppy reed rose sage thistle tulip willow yarrow amber azure beige coral crimson ivory "
           "jade lemon lilac mauve navy olive peach plum ruby scarlet teal violet").split()
_QUEUE_CUES = {"billing": "I was charged twice on my card this month.",
               "shipping": "My parcel never arrived at the front door.",
               "account": "I cannot log in to my profile page anymore."}


def learnable_tickets(n_users: int, seed: int = 0) -> list[dict[str, Any]]:
    """One ticket per user: the queue and the refund each stated in a sentence among 24 random filler words.

    The filler keeps any two states far apart (no 5-gram near-duplicates across splits, so the contamination
    check passes on the base data); the stated cues make the questions learnable in a few dozen steps.
    """
    import random

    rng = random.Random(seed)
    records = []
    for u in range(n_users):
        queue, refund = rng.choice(sorted(_QUEUE_CUES)), rng.random() < 0.5
        words = [rng.choice(_FILLER) for _ in range(24)]
        cut = rng.randrange(4, 20)
        ask = "Refund requested: please give me my money back." if refund else "No refund is needed, keep the money."
        state = " ".join([f"Ticket {u}:", " ".join(words[:cut]) + ".", f"Queue {queue}: {_QUEUE_CUES[queue]}", ask,
                          " ".join(words[cut:]) + "."])
        records.append({"id": f"t/{u:04d}", "state": state, "meta": {"user_id": f"u{u:04d}"}, "questions": {
            "queue": {"type": "choice", "instructions": "Which queue handles this ticket?",
                      "criteria": {"billing": None, "shipping": None, "account": None}, "label": queue},
            "refund": {"type": "noul", "instructions": "Does the customer ask for a refund?", "label": refund}}})
    return records


def hypothesis_config(proposal: dict[str, Any] | None) -> dict[str, Any]:
    if proposal is None:
        return {}
    return {"ops": {"registered_hypothesis": {"config": {"proposal_json": json.dumps(proposal)}}}}


@pytest.fixture(scope="module")
def loop_env(tmp_path_factory: pytest.TempPathFactory, monkeypatch_module: pytest.MonkeyPatch) -> dict[str, Any]:
    from envloop_pipelines.core.data.datasets import import_file

    import itertools

    from envloop_pipelines.core.decision_loop import registered_hypothesis

    root = tmp_path_factory.mktemp("loop")
    home = root / "home"
    monkeypatch_module.setenv("ENVLOOP_HOME", str(home))
    # The loop draws a round's seed at random when it registers the hypothesis (issue 34); this module's figures
    # (round 2's promotion, its ECE of 0.0) were measured on the seeds it used before, the recipe's seed + 1000 +
    # the round's number (rounds 1 and 2 register in that order), so the draws are pinned to them here.
    seeds = itertools.count(1001)
    monkeypatch_module.setattr(registered_hypothesis, "draw_seeds",
                               lambda count=1, used=(): tuple(next(seeds) for _ in range(count)))
    monkeypatch_module.delenv("MLFLOW_TRACKING_URI", raising=False)
    data = root / "tickets.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in learnable_tickets(N_USERS)), encoding="utf-8")
    import_file(data, TASK, home=home)  # task_benchmark then opens it
    loop = LoopResource(home=str(home), generator=GENERATOR, **LOOP)
    resources = {"loop": loop, "mlflow": MlflowResource(home=str(home)), "io_manager": RoundStoreIOManager(loop=loop),
                 "sandbox": SandboxResource()}
    instance = dg.DagsterInstance.ephemeral()
    setup = dg.materialize([task_benchmark, noise_floor], resources=resources, instance=instance)
    assert setup.success
    results = {}
    for key, proposal in (("r0001", None), ("r0002", PROMOTING), ("r0003", AFTER_PROMOTION)):
        if key == "r0002":
            # The leaky round runs while the champion still fails on dev: a round mines failure clusters and
            # calls its generator only when there are some (round 2's champion answers every question right).
            results["r0050"] = leaky_round(home, instance, resources)
        instance.add_dynamic_partitions("rounds", [key])
        results[key] = dg.materialize(with_upstream_sources(ROUND_ASSETS + ROUND_CHECKS), partition_key=key, resources=resources,
                                      instance=instance, run_config=hypothesis_config(proposal))
        assert results[key].success
    return {"home": home, "loop": loop, "resources": resources, "instance": instance, "results": results,
            "config": loop.config(), "tracker": MlflowTracker(home=home)}


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def decision(env: dict[str, Any], key: str) -> dict[str, Any]:
    return RoundStore(TASK, env["home"]).load("promotion_decision", RoundDecision, key).to_dict()


def test_every_asset_and_check_materialized(loop_env: dict[str, Any]) -> None:
    for key, result in loop_env["results"].items():
        if key == "r0050":
            continue  # blocked by its contamination check (test_contaminated_snapshot_is_blocked)
        keys = {e.asset_key.to_user_string() for e in result.get_asset_materialization_events()}
        assert keys == {a.key.to_user_string() for a in ROUND_ASSETS}
        checks = {e.check_name: e.passed for e in result.get_asset_check_evaluations()}
        assert checks["snapshot_is_uncontaminated"] and checks["snapshot_schema_is_valid"]
        assert checks["checkpoint_reproduces"]  # rule 8: re-scored from disk, identical predictions


def test_each_check_receives_its_rounds_record_and_is_recorded_for_that_round(loop_env: dict[str, Any]) -> None:
    """The checks take their asset's typed record from the IO manager (no store read by hand) and are
    partitioned by round: each evaluation names the round it checked, and the instance keeps it per round."""
    import inspect

    from envloop_pipelines.defs.rounds import checks

    assert "RoundStore" not in inspect.getsource(checks)
    for check in ROUND_CHECKS:
        spec = next(iter(check.check_specs))
        assert check.partitions_def is not None and check.partitions_def.name == "rounds"
        assert spec.asset_key.path[-1] in inspect.signature(check.op.compute_fn.decorated_fn).parameters
    for key in ("r0001", "r0002"):
        evaluations = loop_env["results"][key].get_asset_check_evaluations()
        assert len(evaluations) == len(ROUND_CHECKS) and {e.partition for e in evaluations} == {key}
        assert all(e.passed for e in evaluations if e.check_name != "candidate_is_calibrated")


def test_metadata_a_person_wants(loop_env: dict[str, Any]) -> None:
    events = {e.asset_key.to_user_string(): e.materialization.metadata
              for e in loop_env["results"]["r0001"].get_asset_materialization_events()}
    assert "| family_macro_accuracy |" in events["independent_reeval"]["test_metrics"].value
    assert "TF-IDF + LR" in events["independent_reeval"]["test_metrics"].value
    assert "data:image/png;base64," in events["baseline_eval"]["reliability"].value
    assert "data:image/png;base64," in events["promotion_decision"]["release_chain"].value
    assert len(events["registered_hypothesis"]["hash"].value) == 64
    assert "mlflow_run_id" in events["lora_checkpoint"]


def test_the_loop_proposes_its_own_experiment_and_the_ui_plots_its_numbers(loop_env: dict[str, Any]) -> None:
    from envloop_pipelines.core.decision_loop.proposer import LEVERS

    ledger = Ledger(TASK, loop_env["home"])
    auto, person = ledger.hypothesis("r0001"), ledger.hypothesis("r0002")
    # r0001 had no hypothesis: the proposer chose a lever, registered its prediction and every lever it weighed
    assert auto.change["lever"] in LEVERS and auto.author == "auto"
    prediction = auto.change["prediction"]
    assert prediction["low"] <= auto.predicted_delta <= prediction["high"] and prediction["seconds"] > 0
    assert auto.rationale.startswith(f"proposer: lever {auto.change['lever']} (") and "Weighed:" in auto.rationale
    assert "lever" not in person.change  # a person's hypothesis is taken as given
    decided = {e["round"]: e for e in ledger.events("round_decided")}
    assert decided["r0001"]["lever"] == auto.change["lever"] and decided["r0002"]["lever"] == "recipe"
    assert decided["r0001"]["train_s"] > 0 and len(decided["r0001"]["champion_checkpoint_sha256"]) == 64
    assert decision(loop_env, "r0001")["lever"] == auto.change["lever"]
    for key in ("r0001", "r0002"):
        meta = {e.asset_key.to_user_string(): e.materialization.metadata
                for e in loop_env["results"][key].get_asset_materialization_events()}["promotion_decision"]
        for name in ("predicted_delta", "delta", "ci_low", "ci_high", "bar", "mde", "ci_half_width", "noise_floor",
                     "champion_score", "candidate_score"):
            assert isinstance(meta[name], dg.FloatMetadataValue), name
            assert meta[name].value == round(meta[name].value, 6)  # no 0.0040000000000000036 in the plots
        assert meta["predicted_delta"].value == ledger.hypothesis(key).predicted_delta


def test_mlflow_records_hypothesis_before_training(loop_env: dict[str, Any]) -> None:
    tracker: MlflowTracker = loop_env["tracker"]
    for key in ("r0001", "r0002"):
        hyp = tracker.find_run(TASK, {TAG_ROUND: key, TAG_KIND: KIND_HYPOTHESIS})
        train = tracker.find_run(TASK, {TAG_ROUND: key, TAG_KIND: KIND_TRAINING})
        evaluation = tracker.find_run(TASK, {TAG_ROUND: key, TAG_KIND: KIND_REEVAL})
        parent = tracker.find_run(TASK, {TAG_ROUND: key, TAG_KIND: KIND_ROUND})
        h, t, e = (tracker.run_data(r.run_id) for r in (hyp, train, evaluation))
        assert h.info.end_time <= t.info.start_time  # registered (and closed) before training started
        assert h.data.tags["mlflow.parentRunId"] == t.data.tags["mlflow.parentRunId"] == parent.run_id
        assert h.data.params["hash"] == Ledger(TASK, loop_env["home"]).hypothesis(key).hash
        assert "candidate.family_macro_accuracy" in e.data.metrics and "tfidf.brier" in e.data.metrics
        assert "dagster.run_id" in t.data.tags and t.data.tags["dagster.partition"] == key


def test_alias_moves_only_on_promotion(loop_env: dict[str, Any]) -> None:
    tracker: MlflowTracker = loop_env["tracker"]
    ledger = Ledger(TASK, loop_env["home"])
    releases = ledger.releases()
    d1, d2 = decision(loop_env, "r0001"), decision(loop_env, "r0002")
    promoted = [d for d in (d1, d2) if d["promote"]]
    assert d2["promote"], d2["reasons"]
    # Through the real gate: the registered gate is the default one, and the gain cleared the bar (the measured
    # floor x 1, or the arms' seed bound minus the champion, whichever is larger) with the paired CI above zero;
    # the guards held.
    assert ledger.hypothesis("r0002").gate == Gate() and ledger.effective_gate("r0002") == Gate()
    checks = d2["checks"]
    assert checks["noise_floor"] > 0 and checks["seed_bound"] is not None
    assert checks["bar"] == pytest.approx(max(checks["noise_floor"], checks["seed_gap"]))
    assert checks["gain"] > checks["bar"] and checks["ci_low"] > 0, checks
    assert len(releases) == 1 + len(promoted)  # the bootstrap champion plus each promotion
    champion = releases[-1]
    assert tracker.champion_version(f"envloop-{TASK}") == champion["model_version"]
    assert champion["round"] == "r0002" and champion["parent_release"] == releases[-2]["release"]
    versions = tracker.client.search_model_versions(f"name='envloop-{TASK}'")
    assert len(versions) == len(releases)
    if not d1["promote"]:
        assert any(e["round"] == "r0001" for e in ledger.events("candidate_rejected"))
        assert any(e["round"] == "r0001" for e in ledger.events("hypothesis_refuted"))


def test_release_card_holdout_first_and_baseline_beside(loop_env: dict[str, Any]) -> None:
    ledger = Ledger(TASK, loop_env["home"])
    card = ledger.releases()[-1]
    markdown = (ledger.release_dir(card["release"]) / "card.md").read_text()
    assert markdown.index("## Holdout") < markdown.index("## Test")
    assert "TF-IDF + LR" in markdown and "## Paired deltas" in markdown
    assert "- bar: " in markdown and "seed bound" in markdown  # the bar the gain cleared, and what set it
    assert card["paired_deltas"]["family_macro_accuracy"]["ci_low"] is not None
    assert card["amendments"] == [] and card["gate"]["min_delta"] == 0.0
    # Every release, the bootstrap one included, has TF-IDF + LR beside it on test and on the holdout,
    # the holdout's from the same one read (paired release − TF-IDF).
    reads = list(ledger.events("holdout_read"))
    for release in ledger.releases():
        assert release["tfidf_baseline_test"]["family_macro_accuracy"] is not None, release["release"]
        assert 0 <= release["holdout_tfidf"]["family_macro_accuracy"] <= 1
        paired = release["holdout_vs_tfidf"]["family_macro_accuracy"]
        # Each of the three is rounded to the hidden split's count decimals, so they agree within 1.5 steps.
        from envloop_pipelines.core.verify.protocol import hidden_split_decimals

        step = 10.0 ** -hidden_split_decimals(int(release["holdout"]["n_questions"]))[0]
        assert paired["delta"] == pytest.approx(release["holdout"]["family_macro_accuracy"]
                                                - release["holdout_tfidf"]["family_macro_accuracy"], abs=1.5 * step)
        assert paired["ci_low"] <= paired["delta"] <= paired["ci_high"]
        assert sum(1 for e in reads if e.get("release") == release["release"]) == 1
    assert "release − TF-IDF (95% CI)" in markdown


def test_reeval_ran_the_verifier_in_another_process(loop_env: dict[str, Any]) -> None:
    import os

    reeval = json.loads(RoundStore(TASK, loop_env["home"]).step_path("independent_reeval", "r0001").read_text())
    assert reeval["verifier_pid"] != os.getpid()
    assert reeval["complete"]


def test_no_second_holdout_read_and_cards_never_rewritten(loop_env: dict[str, Any]) -> None:
    from envloop_pipelines.core.ledger.ledger import ReleaseCardExistsError
    from envloop_pipelines.core.ledger.reads import HoldoutAlreadyReadError

    from pathlib import Path

    from envloop_pipelines.core.data.snapshots import open_task
    from envloop_pipelines.core.release.publish import holdout_metrics

    ledger = Ledger(TASK, loop_env["home"])
    card = ledger.releases()[-1]
    reads = len(list(ledger.events("holdout_read")))
    with pytest.raises(HoldoutAlreadyReadError, match="each release reads it once"):
        ledger.read_holdout_once(card["release"], lambda: {"family_macro_accuracy": 1.0})
    # The loop's own path (the release step's read, through the verifier and the ledger's slot) is refused too.
    with pytest.raises(HoldoutAlreadyReadError, match=f"release {card['release']} already read the holdout"):
        holdout_metrics(loop_env["config"], Path(card["checkpoint_dir"]), open_task(TASK, home=loop_env["home"]),
                        loop_env["home"] / "again-holdout.parquet", ledger=ledger, release=card["release"])
    assert len(list(ledger.events("holdout_read"))) == reads
    # The card's limitations hold for this task: imported data, no renderer it never saw.
    assert card["limitations"][0].startswith("The benchmark is imported data (tickets.jsonl")
    assert not any("renderer" in line for line in card["limitations"])
    with pytest.raises(ReleaseCardExistsError, match="never rewritten"):
        ledger.write_release_card(card["release"], {**card, "holdout": {"family_macro_accuracy": 1.0}}, "edited")
    old = card["holdout"]["family_macro_accuracy"]
    ledger.append_erratum(card["release"], "holdout.family_macro_accuracy", old, old - 0.01, "recomputed by hand")
    again = ledger.releases()[-1]
    assert again["holdout"]["family_macro_accuracy"] == old  # the old number stays
    assert again["errata"][-1]["new"] == pytest.approx(old - 0.01)


def test_round_without_hypothesis_is_refused(loop_env: dict[str, Any]) -> None:
    env = loop_env
    store = RoundStore(TASK, env["home"])
    registered = store.load("registered_hypothesis", RegisteredHypothesis, "r0001")
    snapshot = store.load("training_dataset_snapshot", TrainingSnapshot, "r0001")
    task = open_task(TASK, home=env["home"])
    from dataclasses import replace

    with pytest.raises(LedgerError, match="no registered hypothesis"):
        train_candidate(env["config"], task, registered, replace(snapshot, round="r0099"), env["tracker"])
    with pytest.raises(LedgerError, match="is not the one registered"):  # a hypothesis handed in must be the ledger's
        train_candidate(env["config"], task, replace(registered, hash="0" * 64), snapshot, env["tracker"])
    env["instance"].add_dynamic_partitions("rounds", ["r0098"])
    from envloop_pipelines.defs.rounds.assets import lora_checkpoint

    result = dg.materialize(with_upstream_sources([lora_checkpoint]), partition_key="r0098", resources=env["resources"],
                            instance=env["instance"], raise_on_error=False)
    assert not result.success
    assert not RoundStore(TASK, env["home"]).step_path("lora_checkpoint", "r0098").exists()


def test_hypothesis_is_immutable(loop_env: dict[str, Any]) -> None:
    from dataclasses import replace

    from envloop_pipelines.core.ledger.hypothesis import HypothesisImmutableError

    ledger = Ledger(TASK, loop_env["home"])
    registered = ledger.hypothesis("r0001")
    assert ledger.register_hypothesis(registered) == registered.hash  # a retry is a no-op
    with pytest.raises(HypothesisImmutableError, match="immutable"):
        ledger.register_hypothesis(replace(registered, predicted_delta=0.5))


def tick_sensor(env: dict[str, Any]) -> Any:
    with dg.build_sensor_context(instance=env["instance"], resources=env["resources"],
                                 repository_def=REPOSITORY) as context:
        with dg.partition_loading_context(dynamic_partitions_store=env["instance"]):
            return next_round_sensor.evaluate_tick(context)


def test_sensor_ticks_request_the_next_round_until_the_budget_is_spent(loop_env: dict[str, Any]) -> None:
    from envloop_pipelines.core.loop.budget import last_round_number

    env = loop_env
    home = env["home"]
    start_loop(TASK, "test-loop", LoopBudget(max_rounds=1, patience=1), home=home)
    expected = round_key(last_round_number(TASK, home) + 1)
    assert expected not in {"r0001", "r0002"}
    # The tick's run request is validated against the instance's partitions, which the daemon adds from
    # the tick's own dynamic_partitions_requests first; the test adds it the same way.
    env["instance"].add_dynamic_partitions("rounds", [expected])
    # A tick evaluated twice (a replay after a crash) asks for the same run key, so Dagster starts one run.
    ticks = [tick_sensor(env) for _ in range(2)]
    for tick in ticks:
        (request,) = tick.run_requests
        assert request.partition_key == expected
        assert request.run_key == f"test-loop:{expected}"
        assert tick.dynamic_partitions_requests[0].partition_keys == [expected]
    # While that round is undecided the sensor waits; once decided, the one-round budget is spent.
    RoundStore(TASK, home).round_dir(expected)
    tick = tick_sensor(env)
    assert not tick.run_requests and "not decided yet" in tick.skip_message
    Ledger(TASK, home).append("round_decided", {"round": expected, "promoted": False, "observed_delta": 0.0,
                                                            "release": None}, key=f"decided:{expected}")
    tick = tick_sensor(env)
    assert not tick.run_requests and "budget spent" in tick.skip_message


def leaky_round(home: Any, instance: dg.DagsterInstance, resources: dict[str, Any]) -> Any:
    """Round r0050 with a generator that copies test states into training, under contamination_policy=refuse."""
    loop = LoopResource(home=str(home), contamination_policy="refuse",
                        generator="envloop_pipelines_tests.defs.test_round:LeakyGenerator", **LOOP)
    leaky = {"loop": loop, "mlflow": resources["mlflow"], "io_manager": RoundStoreIOManager(loop=loop),
             "sandbox": resources["sandbox"]}
    instance.add_dynamic_partitions("rounds", ["r0050"])
    return dg.materialize(with_upstream_sources(ROUND_ASSETS + ROUND_CHECKS), partition_key="r0050", resources=leaky,
                          instance=instance, raise_on_error=False)


def test_contaminated_snapshot_is_blocked(loop_env: dict[str, Any]) -> None:
    result = loop_env["results"]["r0050"]
    checks = {e.check_name: e for e in result.get_asset_check_evaluations()}
    assert checks["snapshot_is_uncontaminated"].passed is False
    assert checks["snapshot_is_uncontaminated"].metadata["exact"].value >= 1
    materialized = {e.asset_key.to_user_string() for e in result.get_asset_materialization_events()}
    assert "training_dataset_snapshot" in materialized
    assert "lora_checkpoint" not in materialized and "promotion_decision" not in materialized


class LeakyGenerator:
    """A plug-in generator that copies test states into training (what the check must catch).

    It runs in the sandbox, which gives it the train rows and nothing of the home, so it remakes the task's
    records (:func:`learnable_tickets` is deterministic) and copies every state that is not in train.
    """

    name = "leaky"

    def synthesize(self, request: Any, train: Any) -> Any:
        from envloop_pipelines.core.decision_loop.synthesis import with_provenance

        in_train = set(train.column("state_text").to_pylist())
        hidden = [r["state"] for r in learnable_tickets(N_USERS) if r["state"] not in in_train]
        rows = [dict(train.slice(0, 1).to_pylist()[0]) for _ in hidden]
        for k, (row, state) in enumerate(zip(rows, hidden)):
            row["state_text"] = state
            row["record_id"] += f"~leak{k}"
        import pyarrow as pa

        from envloop_pipelines.core.data.question_table import QUESTION_SCHEMA

        return with_provenance(pa.Table.from_pylist(rows, schema=QUESTION_SCHEMA), json.dumps({"cluster": "leak"}))


def test_ledger_keeps_every_arm_and_hypothesis(loop_env: dict[str, Any]) -> None:
    ledger = Ledger(TASK, loop_env["home"])
    kinds = [e["kind"] for e in ledger.events()]
    assert kinds.count("null_arm") == 2
    assert {e["round"] for e in ledger.events("hypothesis_registered")} >= {"r0001", "r0002"}
    assert {e.get("round") for e in ledger.events("lora_checkpoint_trained")} >= {"r0001", "r0002"}
    # Replaying an event does not duplicate it.
    before = len(list(ledger.events()))
    ledger.append("round_decided", {"round": "r0001"}, key="decided:r0001")
    assert len(list(ledger.events())) == before


def test_noise_floor_is_cached(loop_env: dict[str, Any]) -> None:
    result = measure_noise_floor(loop_env["config"], open_task(TASK, home=loop_env["home"]), loop_env["tracker"])
    assert result.cached is True and len(result.floor.values) == 2
    assert result.floor.floor == pytest.approx(max(result.floor.values) - min(result.floor.values))


def test_a_round_over_a_promoted_champion_is_gated_by_its_lineage_floor(loop_env: dict[str, Any]) -> None:
    """Issue 45, item 2: release 2 was made by round r0002 (80 steps from release 1 on r0002's snapshot), not by
    the control recipe, so round r0003 measures a floor at its making: release 2's test score and one lineage arm
    (the making repeated with a fresh seed), and registers and decides over that floor; rounds over release 1 are
    gated by the control floor, as before."""
    from envloop_pipelines.core.decision_loop.champion_noise_floor import (
        SOURCE_CONTROL,
        SOURCE_LINEAGE,
        gating_floor_error,
        lineage_path,
        measure_champion_noise_floor,
    )
    from envloop_pipelines.core.decision_loop.step_records import MeasuredNoiseFloor
    from envloop_pipelines.core.loop.promotion import gate_bar
    from envloop_pipelines.core.model.checkpoint import read_recipe
    from envloop_pipelines.core.model.recipe import recipe_to_dict

    home, config = loop_env["home"], loop_env["config"]
    store, ledger = RoundStore(TASK, home), Ledger(TASK, home)
    control = store.load("noise_floor", MeasuredNoiseFloor)
    for key in ("r0001", "r0002"):  # over release 1, the control arm: the control floor, unchanged
        gating = store.load("champion_noise_floor", MeasuredNoiseFloor, key)
        assert gating.source == SOURCE_CONTROL and gating.floor == control.floor
        assert decision(loop_env, key)["checks"]["noise_floor_source"] == SOURCE_CONTROL
    release1, release2 = ledger.releases()[:2]
    assert release2["round"] == "r0002"
    lineage = store.load("champion_noise_floor", MeasuredNoiseFloor, "r0003")
    assert lineage.source == SOURCE_LINEAGE and lineage.control_key == control.floor.key
    assert lineage.champion_checkpoint_sha256 == release2["checkpoint_sha256"]
    # K = noise_arms values: the champion's own test score first, then its making repeated with a fresh seed.
    champion_arm, arm = lineage.floor.arms
    assert len(lineage.floor.values) == config.noise_arms == 2
    assert lineage.floor.values[0] == release2["test"]["family_macro_accuracy"]
    assert champion_arm["role"] == "champion" and arm["role"] == "lineage_arm"
    assert lineage.floor.values[1] == arm["metrics"]["family_macro_accuracy"]
    assert lineage.floor.floor == pytest.approx(max(lineage.floor.values) - min(lineage.floor.values))
    making = lineage.making
    assert making["round"] == "r0002" and making["recipe_diff"] == {"max_steps": 80}
    assert making["parent_release"] == 1 and making["parent_checkpoint_sha256"] == release1["checkpoint_sha256"]
    # The arm is release 2's recipe but for the seed, trained on r0002's rows from release 1 (rule 2's identity).
    champ_recipe, arm_recipe = (recipe_to_dict(read_recipe(p)) for p in (release2["checkpoint_dir"], arm["checkpoint"]))
    assert arm_recipe["seed"] != champ_recipe["seed"]
    assert {k: v for k, v in arm_recipe.items() if k != "seed"} == {k: v for k, v in champ_recipe.items() if k != "seed"}
    trained = [e for e in ledger.events("lora_checkpoint_trained") if e.get("role") == "lineage_arm"]
    assert [(e["checkpoint_sha256"], e["init_from"]) for e in trained] == [
        (arm["checkpoint_sha256"], release1["checkpoint_sha256"])]
    assert trained[0]["family_macro_accuracy"] == arm["metrics"]["family_macro_accuracy"]  # rule 5: with its number
    # Its test read is its own reader's, within its budget (rule 4).
    reads = [e for e in ledger.events("test_read") if str(e.get("reader", "")).startswith("floor:")]
    assert [e["reader"] for e in reads] == [f"floor:{lineage.floor.key}"]
    # The round registered its MDE and was decided over that floor: one bar from registration to decision.
    d3 = decision(loop_env, "r0003")
    assert not d3["promote"] and d3["noise_floor"] == lineage.floor.floor
    assert d3["checks"]["noise_floor_source"] == SOURCE_LINEAGE
    bar = gate_bar(ledger.effective_gate("r0003"), lineage.floor, release2["test"]["family_macro_accuracy"])["bar"]
    assert d3["checks"]["bar"] == pytest.approx(bar) == pytest.approx(ledger.hypothesis("r0003").power["bar"])
    # Measured once per champion: asked again, the cache answers and nothing is trained.
    events = len(list(ledger.events()))
    again = measure_champion_noise_floor(config, open_task(TASK, home=home), control, loop_env["tracker"])
    assert again.cached and again.floor == lineage.floor and lineage_path(store, lineage.floor.key).is_file()
    assert len(list(ledger.events())) == events
    # The control floor cannot gate a round over release 2, nor its lineage floor one over release 1.
    assert "is the control floor; a round over release 2" in gating_floor_error(control, release2)
    assert "cannot gate a round over release 1" in gating_floor_error(lineage, release1)
    assert gating_floor_error(lineage, release2) is None and gating_floor_error(control, release1) is None
