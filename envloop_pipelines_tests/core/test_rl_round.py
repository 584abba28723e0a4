"""RL from verified attempts as a round: the SFT snapshot, and a whole round on CPU.

The end-to-end round runs on six shell environments (four to train on, two held
out): a scripted solver behind a real OpenAI-compatible server samples the
training attempts, the verified ones become the SFT snapshot, a tiny Qwen2
(hidden 32, 2 layers) is LoRA-trained on it, the trained policy and the base
are served by ``envloop serve``'s policy app and re-evaluated on the held-out
environments through the agent runner, two null arms measure the floor, and
the registered gate decides. A random tiny model passes nothing, so the
decision is a rejection: recorded in the ledger and in MLflow with its numbers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import pytest

from envloop_pipelines.core.agents.attempts import Attempt
from envloop_pipelines.core.environments.spec import EnvironmentSpec
from envloop_pipelines.core.ledger.ledger import Ledger
from envloop_pipelines.core.rl_loop.sft_snapshot import (
    ContaminatedSnapshotError,
    build_sft_snapshot,
    environment_text,
    read_sft_rows,
)
from envloop_pipelines.core.storage import canonical_json, sha256_bytes
from envloop_pipelines.testing.environments import shell_env
from envloop_pipelines_tests.core.test_causal_sft import BASH_TOOL, LORA, call, corpus, tiny_chat_lm
from envloop_pipelines_tests.core.test_model_data import limit_threads_under_xdist

limit_threads_under_xdist()


@dataclass(frozen=True)
class EnvDataset:
    """An environment dataset as the runner reads one: name, version, environments."""

    name: str
    environments: tuple[EnvironmentSpec, ...]

    @property
    def version(self) -> str:
        return sha256_bytes(canonical_json([e.fingerprint() for e in self.environments]))[:16]


def dataset(train: Sequence[int], heldout: Sequence[int]) -> EnvDataset:
    return EnvDataset("shell-rl", tuple([shell_env(s, split="train") for s in train]
                                        + [shell_env(s, split="heldout") for s in heldout]))


def attempt(env: EnvironmentSpec, n: int, *, passed: bool, command: str = "ls") -> Attempt:
    """An attempt in the runner's chat format (system, user, a bash call, its result, a last word)."""
    messages = [{"role": "system", "content": "You are an agent in a Linux sandbox."},
                {"role": "user", "content": env.instruction},
                {"role": "assistant", "content": None, "tool_calls": [call(0, command)]},
                {"role": "tool", "tool_call_id": "call_0", "content": "exit_code: 0\nstdout:\n\nstderr:\n"},
                {"role": "assistant", "content": "Done."}]
    return Attempt(dataset="shell-rl", dataset_version="v1", environment_id=env.id, split=env.split, seed=env.seed,
                   attempt=n, sampling_seed=100 + n, agent={"base_url": "http://x/v1", "model": "m", "kind": "chat"},
                   messages=messages, tools=[BASH_TOOL], passed=passed, status="passed" if passed else "failed")


def texts(ds: EnvDataset, split: str) -> dict[str, str]:
    return {e.id: environment_text(e) for e in ds.environments if e.split == split}


# --------------------------------------------------------------------------- the SFT snapshot


def test_the_snapshot_keeps_verified_attempts_with_their_provenance(tmp_path: Path) -> None:
    ds = dataset([0, 1, 2], [10])
    train = [e for e in ds.environments if e.split == "train"]
    attempts = [attempt(train[0], 0, passed=True), attempt(train[0], 1, passed=False), attempt(train[1], 0, passed=True),
                attempt(train[2], 0, passed=False)]
    snap = build_sft_snapshot(attempts, train_texts=texts(ds, "train"), holdout_texts=texts(ds, "heldout"), root=tmp_path)
    assert (snap.n_attempts, snap.n_passed, snap.n_rows, snap.n_removed) == (4, 2, 2, 0)
    rows = read_sft_rows(snap.path)
    assert [r["id"] for r in rows] == [f"{train[0].id}#0", f"{train[1].id}#0"]
    for row, a in zip(rows, [attempts[0], attempts[2]]):
        assert row["messages"] == [dict(m) for m in a.messages] and row["tools"] == [BASH_TOOL]
        assert row["provenance"] == {"dataset": "shell-rl", "dataset_version": "v1", "environment_id": a.environment_id,
                                     "split": "train", "seed": a.seed, "attempt": a.attempt, "sampling_seed": a.sampling_seed,
                                     "agent": dict(a.agent), "transcript_sha256": a.transcript_sha256()}
    # Content-addressed: the same attempts in another order give the same snapshot; the folder is its rows' hash.
    again = build_sft_snapshot(list(reversed(attempts)), train_texts=texts(ds, "train"), holdout_texts=texts(ds, "heldout"),
                               root=tmp_path)
    assert again.sha256 == snap.sha256 == Path(snap.path).name
    manifest = json.loads((Path(snap.path) / "manifest.json").read_text())
    assert manifest["n_rows"] == 2 and manifest["datasets"] == ["shell-rl@v1"] and snap.contamination["clean"]


def test_rows_that_touch_the_held_out_environments_are_removed_or_refused(tmp_path: Path) -> None:
    ds = dataset([0, 1], [10])
    train = [e for e in ds.environments if e.split == "train"]
    held = next(e for e in ds.environments if e.split == "heldout")
    # A training environment that is a copy of the held-out one under another id (its text is the same).
    twin = EnvironmentSpec(id="shell/twin", kind="terminal", instruction=held.instruction, files=dict(held.files),
                           verifier=held.verifier, seed=held.seed, split="train")
    attempts = [attempt(train[0], 0, passed=True), attempt(held, 0, passed=True), attempt(twin, 0, passed=True)]
    train_texts = {**texts(ds, "train"), twin.id: environment_text(twin)}
    snap = build_sft_snapshot(attempts, train_texts=train_texts, holdout_texts=texts(ds, "heldout"), root=tmp_path)
    assert (snap.n_passed, snap.n_rows, snap.n_removed) == (3, 1, 2)
    assert [r["id"] for r in snap.rows()] == [f"{train[0].id}#0"]
    flagged = {f["id"]: f for f in snap.contamination["flagged"]}
    assert set(flagged) == {f"{held.id}#0", "shell/twin#0"} and snap.contamination["removed"] == sorted(flagged)
    assert "the environment is held out" in flagged[f"{held.id}#0"]["reasons"]
    assert flagged["shell/twin#0"]["test"] == "exact" and flagged["shell/twin#0"]["reasons"][0]["matches"] == held.id
    with pytest.raises(ContaminatedSnapshotError, match="2 of 3 SFT rows overlap"):
        build_sft_snapshot(attempts, train_texts=train_texts, holdout_texts=texts(ds, "heldout"), root=tmp_path / "r",
                           policy="refuse")


def test_a_tampered_snapshot_is_refused(tmp_path: Path) -> None:
    ds = dataset([0], [10])
    train = ds.environments[0]
    snap = build_sft_snapshot([attempt(train, 0, passed=True)], train_texts=texts(ds, "train"),
                              holdout_texts=texts(ds, "heldout"), root=tmp_path)
    rows_file = Path(snap.path) / "rows.jsonl"
    rows_file.chmod(0o644)
    rows_file.write_text(rows_file.read_text().replace("Done.", "Done!"))
    with pytest.raises(ValueError, match="does not match the snapshot"):
        read_sft_rows(snap.path)


def test_the_paired_delta_ci_is_the_agent_stats_bootstrap() -> None:
    """The RL comparison's delta CI comes from agents/stats.py (environments resampled), a point when nothing moves."""
    from envloop_pipelines.core.agents.stats import mean_ci

    diffs = [0.0, 0.5, 1.0, 0.25, -0.25, 0.5]
    low, high = mean_ci(diffs, seed=3)
    assert low < sum(diffs) / len(diffs) < high and (low, high) == mean_ci(diffs, seed=3)
    assert mean_ci([0.0, 0.0, 0.0]) == (0.0, 0.0) and mean_ci([0.5]) == (0.5, 0.5)


# --------------------------------------------------------------------------- a whole round


def round_lm(path: Path, ds: EnvDataset) -> Path:
    """A tiny chat LM whose tokenizer was trained on shell transcripts like the ones the round samples."""
    from envloop_pipelines.testing.scripted_agents import solution

    rows = [{"messages": [{"role": "system", "content": "You are an agent in a Linux sandbox with no network."},
                          {"role": "user", "content": e.instruction},
                          {"role": "assistant", "content": None, "tool_calls": [call(0, solution(e.instruction))]},
                          {"role": "tool", "tool_call_id": "call_0", "content": "exit_code: 0\nstdout:\n\nstderr:\n"},
                          {"role": "assistant", "content": "Done."}], "tools": [BASH_TOOL]} for e in ds.environments]
    return tiny_chat_lm(path, corpus(rows))


def snapshot_loss_fell(policy_path: str, snapshot_path: str) -> tuple[float, float]:
    """The mean loss on the snapshot's rows of the base model and of the trained policy; asserts it fell.

    The trainer's per-step losses are each one shuffled batch before its update, and the transcripts hold
    real sandbox output (``ls -la``: uids, times), so a first-versus-last step comparison moves with the
    content; the whole snapshot scored before and after training does not."""
    import torch

    from envloop_pipelines.core.model.causal_sft import encode_chat, load_tokenizer, read_policy_checkpoint
    from envloop_pipelines.core.model.policy import load_policy

    policy = read_policy_checkpoint(policy_path)
    rows = read_sft_rows(snapshot_path)
    tokenizer = load_tokenizer(policy.base_model)

    def mean_loss(model: Any) -> float:
        total = 0.0
        for row in rows:
            enc = encode_chat(tokenizer, row["messages"], row["tools"], max_length=1536)
            with torch.no_grad():
                total += float(model(input_ids=torch.tensor([enc.input_ids]), labels=torch.tensor([enc.labels])).loss)
        return total / len(rows)

    base = mean_loss(load_policy(policy.base_model, device="cpu"))
    tuned = mean_loss(load_policy(policy.base_model, policy.adapter_dir, device="cpu"))
    assert rows and tuned < base, (base, tuned)
    return base, tuned


@pytest.fixture(scope="module")
def round_setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    import yaml

    from envloop_pipelines.core.rl_loop.round_config import RlRoundConfig
    from envloop_pipelines.core.model.causal_sft import CausalSftRecipe

    ds = dataset([0, 1, 2, 3], [10, 11])
    home = tmp_path_factory.mktemp("rl-home")
    lm = round_lm(tmp_path_factory.mktemp("rl-lm") / "tiny-policy", ds)
    recipe = CausalSftRecipe(base_model=str(lm), max_length=1536, lora=LORA, lr=2e-2, epochs=2, batch_size=4,
                             warmup_ratio=0.0, lr_scheduler="constant_with_warmup")
    recipe_file = lm.parent / "recipe.yaml"  # a round's recipe is a file, as a person's launch names one
    recipe_file.write_text(yaml.safe_dump(recipe.to_dict()))
    config = RlRoundConfig(task="shell-rl", recipe=str(recipe_file), attempts=2, eval_attempts=2, noise_arms=2,
                           max_turns=2, attempt_tokens=64, wall_s=60.0, completion_tokens=12, workers=2, home=str(home))
    assert config.load_recipe() == recipe
    return {"dataset": ds, "home": home, "config": config}


def decide_given(config: Any, tracker: Any, hypothesis: Any, snap: Any, policy: Any, comparison: Any, floor: Any,
                 **candidate: Any) -> Any:
    """``decide_rl_round`` on given records: the snapshot, a trained policy, a comparison and a floor."""
    from envloop_pipelines.core.rl_loop.step_records import RlCandidate, RlNoiseFloor, RlReevaluation, RlSampling, RlSnapshot
    from envloop_pipelines.core.rl_loop.run_round import decide_rl_round

    key = hypothesis.round
    fields = {"checkpoint_sha256": policy.sha256, "path": str(policy.path), "model": f"policy-{policy.sha256[:12]}",
              **candidate}
    return decide_rl_round(config, tracker, hypothesis, RlSampling(key, "", snap.n_attempts, snap.n_passed),
                           RlSnapshot(round=key, **snap.to_dict()), RlCandidate(round=key, **fields),
                           RlNoiseFloor(key, floor), RlReevaluation(key, comparison))


def test_an_rl_round_runs_end_to_end_and_the_gate_rejects_a_policy_that_passes_nothing(round_setup: dict[str, Any]) -> None:
    import time

    from dataclasses import replace

    from envloop_pipelines.core.rl_loop.run_round import run_rl_round
    from envloop_pipelines.core.tracking import MlflowTracker
    from envloop_pipelines.defs.rl.serving import serve_policy
    from envloop_pipelines.testing.scripted_agents import scripted_server

    ds, home, config = round_setup["dataset"], round_setup["home"], round_setup["config"]
    tracker = MlflowTracker(home=home)
    t0 = time.monotonic()
    with scripted_server() as server:
        config = replace(config, sampler_url=server.url, sampler_model="solver-p0.75")
        result = run_rl_round(config, ds, tracker, serve_policy)
    elapsed = time.monotonic() - t0

    # Sampling: 4 training environments x 2 attempts by the solver; the verified ones are the snapshot.
    snap = result.snapshot
    assert snap["n_attempts"] == 8 and 1 <= snap["n_passed"] <= 8 and snap["n_rows"] == snap["n_passed"]
    assert snap["contamination"]["clean"]
    rows = read_sft_rows(snap["path"])
    assert all(r["provenance"]["split"] == "train" and r["provenance"]["dataset_version"] == ds.version for r in rows)
    sampled = {(a["environment_id"], a["attempt"]): a for a in map(json.loads, (
        home / "loops" / "shell-rl" / "rounds" / result.round / "sampled_attempts" / "attempts.jsonl").read_text().splitlines())}
    for row in rows:  # each row is its attempt's transcript, verbatim
        source = sampled[(row["provenance"]["environment_id"], row["provenance"]["attempt"])]
        assert source["passed"] and row["messages"] == source["messages"]
        assert row["provenance"]["transcript_sha256"] == sha256_bytes(canonical_json(source["messages"]))

    # Training happened: the candidate's loss fell on the verified transcripts.
    snapshot_loss_fell(result.candidate["path"], snap["path"])
    # Re-evaluation: aggregates only; a random 32-wide LM solves no shell task, trained or not.
    comp = result.comparison
    assert comp["candidate"]["pass_at_1"] == 0.0 and comp["parent"]["pass_at_1"] == 0.0
    assert comp["candidate"]["n_environments"] == 2 and comp["candidate"]["n_attempts"] == 4
    assert set(comp) == {"candidate", "parent", "delta", "attempts_per_environment"}
    assert comp["delta"] == {"delta": 0.0, "ci_low": 0.0, "ci_high": 0.0, "confidence_level": 0.95, "n_environments": 2}
    # The gate: an honest rejection, for the reasons the registered gate gives.
    assert not result.promoted and result.release is None
    assert any("does not exceed the bar" in r for r in result.reasons)
    assert any("CI lower end +0.0000 is not above zero" in r for r in result.reasons)
    assert len(result.noise_floor["values"]) == 2 and result.noise_floor["floor"] == 0.0

    ledger = Ledger("shell-rl", home)
    kinds = [e["kind"] for e in ledger.events()]
    assert kinds == ["hypothesis_registered", "lora_checkpoint_trained", "null_arm", "null_arm", "candidate_rejected",
                     "hypothesis_refuted", "round_decided"]
    rejected = next(ledger.events("candidate_rejected"))
    assert rejected["reasons"] == list(result.reasons) and rejected["checkpoint_sha256"] == result.candidate["checkpoint_sha256"]
    assert rejected["delta"]["delta"] == 0.0 and rejected["sft_snapshot"] == snap["sha256"]
    hyp = ledger.require_hypothesis(result.round)
    assert hyp.change["kind"] == "rl_from_verified_attempts" and hyp.gate.primary_metric == "pass_at_1"
    assert hyp.change["sampler"]["model"] == "solver-p0.75" and hyp.hash == result.hypothesis_hash
    assert not ledger.releases()

    # MLflow: the round and its steps, under the loop's run kinds.
    from envloop_pipelines.core.tracking import KIND_HYPOTHESIS, KIND_NOISE_FLOOR, KIND_NULL_ARM, KIND_REEVAL, KIND_ROUND, KIND_TRAINING, TAG_KIND

    client = tracker.client
    exp = client.get_experiment_by_name("shell-rl")
    runs = client.search_runs([exp.experiment_id], max_results=50)
    by_kind: dict[str, list[Any]] = {}
    for r in runs:
        by_kind.setdefault(r.data.tags[TAG_KIND], []).append(r)
    assert {k: len(v) for k, v in by_kind.items()} == {KIND_ROUND: 1, KIND_HYPOTHESIS: 1, KIND_TRAINING: 1,
                                                        KIND_NOISE_FLOOR: 1, KIND_NULL_ARM: 2, KIND_REEVAL: 1}
    round_metrics = by_kind[KIND_ROUND][0].data.metrics
    assert round_metrics["delta.pass_at_1"] == 0.0 and round_metrics["verified_attempts"] == snap["n_passed"]
    assert by_kind[KIND_REEVAL][0].data.metrics["candidate.pass_at_1"] == 0.0
    assert by_kind[KIND_ROUND][0].info.status == "FINISHED"

    # Decided once: a retry returns the ledger's decision without sampling again.
    assert run_rl_round(config, ds, tracker, serve_policy, key=result.round) == result
    # The driver hands the records to the steps; storing them at the RL IO manager's paths is Dagster's part.
    from envloop_pipelines.core.rl_loop.step_records import RL_STEP_RECORDS
    from envloop_pipelines.core.ledger.store import RoundStore

    store = RoundStore("shell-rl", home)
    assert not any(store.step_path(step, result.round).exists() for step in RL_STEP_RECORDS)
    print(f"RL round on CPU: {elapsed:.1f} s ({result.seconds})")


def test_a_round_whose_policy_passes_nothing_has_nothing_to_train_on(round_setup: dict[str, Any], tmp_path: Path) -> None:
    from dataclasses import replace

    from envloop_pipelines.core.rl_loop.run_round import run_rl_round
    from envloop_pipelines.core.tracking import MlflowTracker
    from envloop_pipelines.defs.rl.serving import serve_policy

    ds = dataset([0, 1], [10])
    config = replace(round_setup["config"], task="shell-rl-self", attempts=1, home=str(tmp_path), max_turns=1,
                     attempt_tokens=12)
    result = run_rl_round(config, ds, MlflowTracker(home=tmp_path), serve_policy)  # samples with the base model
    assert result.sampler["kind"] == "current_policy" and result.sampler["model"].startswith("base-")
    assert result.snapshot["n_attempts"] == 2 and result.snapshot["n_rows"] == 0 and not result.promoted
    assert result.reasons == ("no verified attempt to train on: the sampler passed 0 of 2 attempts and 0 were removed "
                              "as contamination",)
    kinds = [e["kind"] for e in Ledger("shell-rl-self", tmp_path).events()]
    assert kinds == ["hypothesis_registered", "candidate_rejected", "hypothesis_refuted", "round_decided"]


def test_round_settings_are_validated(round_setup: dict[str, Any]) -> None:
    from envloop_pipelines.core.ledger.hypothesis import GateTooLooseError
    from envloop_pipelines.core.rl_loop.round_config import RlRoundConfig
    from envloop_pipelines.core.rl_loop.round_steps import register_rl_hypothesis
    from envloop_pipelines.core.tracking import MlflowTracker

    recipe = round_setup["config"].recipe
    with pytest.raises(ValueError, match="noise_arms must be ≥ 2"):
        RlRoundConfig(task="t", recipe=recipe, noise_arms=1)
    with pytest.raises(ValueError, match="sampler_url and sampler_model go together"):
        RlRoundConfig(task="t", recipe=recipe, sampler_url="http://127.0.0.1:1/v1")
    with pytest.raises(ValueError, match="give the dataset"):
        RlRoundConfig(recipe=recipe)
    assert RlRoundConfig(dataset="shell@abc").task == "rl-shell"
    loose = RlRoundConfig(task="loose", recipe=recipe, floor_multiplier=0.5, home=str(round_setup["home"]))
    with pytest.raises(GateTooLooseError, match="floor_multiplier"):
        register_rl_hypothesis(loose, round_setup["dataset"], "r0001", MlflowTracker(home=round_setup["home"]),
                               sampler={"kind": "test"})


def test_a_round_that_clears_the_gate_publishes_a_release_the_next_round_samples_with(round_setup: dict[str, Any],
                                                                                      tmp_path: Path) -> None:
    """The promotion path, on given aggregates (a tiny random LM never earns one) and a real policy checkpoint."""
    from dataclasses import replace

    from envloop_pipelines.core.ledger.reads import HoldoutAlreadyReadError
    from envloop_pipelines.core.loop.promotion import noise_floor_from_arms
    from envloop_pipelines.core.rl_loop.step_records import ArmScore, HoldoutComparison, RlRoundResult
    from envloop_pipelines.core.rl_loop.round_steps import current_policy, register_rl_hypothesis, train_policy
    from envloop_pipelines.core.tracking import KIND_RELEASE, TAG_KIND, MlflowTracker

    ds = round_setup["dataset"]
    config = replace(round_setup["config"], task="shell-rl-promote", home=str(tmp_path))
    tracker = MlflowTracker(home=tmp_path)
    train_env = ds.environments[0]
    snap = build_sft_snapshot([attempt(train_env, 0, passed=True)], train_texts=texts(ds, "train"),
                              holdout_texts=texts(ds, "heldout"), root=tmp_path / "snapshots")
    policy = train_policy(snap.rows(), config.load_recipe().replace(epochs=1), tmp_path / "policies", snap.sha256)
    assert current_policy(config) is None  # no release yet: rounds sample with the base model

    def decide(key: str, gain: float, low: float) -> RlRoundResult:
        hyp = register_rl_hypothesis(config, ds, key, tracker, sampler={"kind": "test"})
        comparison = HoldoutComparison(
            candidate=ArmScore(gain, max(0.0, gain - 0.25), min(1.0, gain + 0.25), 2, 4), parent=ArmScore(0.0, 0.0, 0.0, 2, 4),
            delta={"delta": gain, "ci_low": low, "ci_high": gain + 0.25, "confidence_level": 0.95, "n_environments": 2},
            attempts_per_environment=2)
        floor = noise_floor_from_arms(f"floor-{key}", "pass_at_1", [{"pass_at_1": 0.5}, {"pass_at_1": 0.75}])  # 0.25
        return decide_given(config, tracker, hyp, snap, policy, comparison, floor)

    # Under the floor (0.20 <= 0.25): rejected, whatever the CI says.
    low = decide("r0001", 0.20, 0.05)
    assert not low.promoted and "does not exceed the bar 0.2500" in low.reasons[0]
    # Over the floor with a CI above zero: a release, its card naming the policy.
    high = decide("r0002", 0.75, 0.5)
    assert high.promoted and high.release == 1 and high.reasons == ("cleared the gate, the floor and every guard",)
    ledger = Ledger(config.task, tmp_path)
    [card] = ledger.releases()
    assert card["policy_checkpoint"] == policy.path and card["checkpoint_sha256"] == policy.sha256
    assert card["holdout"]["candidate"]["pass_at_1"] == 0.75 and card["kind"] == "rl_from_verified_attempts"
    with pytest.raises(HoldoutAlreadyReadError):  # the release's one holdout read is spent
        ledger.read_holdout_once(1, lambda: {})
    assert current_policy(config).sha256 == policy.sha256  # the next round samples with the released policy
    kinds = [e["kind"] for e in ledger.events()]
    assert kinds == ["hypothesis_registered", "candidate_rejected", "hypothesis_refuted", "round_decided",
                     "hypothesis_registered", "holdout_read", "release_promoted", "round_decided"]
    runs = tracker.client.search_runs([tracker.client.get_experiment_by_name(config.task).experiment_id], max_results=50)
    [release_run] = [r for r in runs if r.data.tags[TAG_KIND] == KIND_RELEASE]
    # Published as the decision loop's releases are (release_checkpoint): the policy checkpoint is the release run's
    # artifact, registered as a version of the task's model, and the champion alias points at it.
    model = config.loop_config().model_name
    assert high.model_version == card["model_version"] == tracker.champion_version(model) == "1"
    version = tracker.client.get_model_version(model, "1")
    assert version.run_id == card["mlflow_run_id"] == release_run.info.run_id
    assert version.source.endswith("/checkpoint") and version.tags["envloop.round"] == "r0002"
    logged = {Path(a.path).name for a in tracker.client.list_artifacts(release_run.info.run_id, "checkpoint")}
    assert logged == {p.name for p in Path(policy.path).iterdir()}
    assert release_run.data.metrics["holdout.candidate.pass_at_1"] == 0.75
    assert release_run.data.metrics["holdout.parent.pass_at_1"] == 0.0
    assert release_run.data.tags["envloop.checkpoint_sha256"] == policy.sha256 and release_run.info.status == "FINISHED"
    assert card["release"] == 1 and card["holdout"] == json.loads(
        (ledger.release_dir(1) / "holdout.json").read_text())["result"]
    markdown = (ledger.release_dir(1) / "card.md").read_text()
    assert markdown.startswith("# Release 1 — shell-rl-promote (rl_from_verified_attempts)")
    assert "| release | 0.7500 | [0.5000, 1.0000] | 2 | 4 |" in markdown and "MLflow model version: 1" in markdown
    assert "paired delta release − parent: +0.7500 [+0.5000, +1.0000]" in markdown
    assert decide("r0002", 0.75, 0.5) == high  # decided once: the ledger's decision
    from envloop_pipelines.core.ledger.store import RoundStore

    assert ledger.round_decision("r0002") == json.loads(json.dumps(high.to_dict()))
    assert not RoundStore(config.task, tmp_path).step_path("rl_decision", "r0002").exists()


def _promoting_round(round_setup: dict[str, Any], tmp_path: Path, task: str) -> dict[str, Any]:
    """A trained policy and the records of round r0001 that promote it (given aggregates)."""
    from dataclasses import replace

    from envloop_pipelines.core.loop.promotion import noise_floor_from_arms
    from envloop_pipelines.core.rl_loop.round_steps import register_rl_hypothesis, train_policy
    from envloop_pipelines.core.rl_loop.step_records import ArmScore, HoldoutComparison
    from envloop_pipelines.core.tracking import MlflowTracker

    ds = round_setup["dataset"]
    config = replace(round_setup["config"], task=task, home=str(tmp_path))
    tracker = MlflowTracker(home=tmp_path)
    snap = build_sft_snapshot([attempt(ds.environments[0], 0, passed=True)], train_texts=texts(ds, "train"),
                              holdout_texts=texts(ds, "heldout"), root=tmp_path / "snapshots")
    policy = train_policy(snap.rows(), config.load_recipe().replace(epochs=1), tmp_path / "policies", snap.sha256)
    hyp = register_rl_hypothesis(config, ds, "r0001", tracker, sampler={"kind": "test"})
    comparison = HoldoutComparison(
        candidate=ArmScore(0.75, 0.5, 1.0, 2, 4), parent=ArmScore(0.0, 0.0, 0.0, 2, 4),
        delta={"delta": 0.75, "ci_low": 0.5, "ci_high": 1.0, "confidence_level": 0.95, "n_environments": 2},
        attempts_per_environment=2)
    floor = noise_floor_from_arms("floor-r0001", "pass_at_1", [{"pass_at_1": 0.5}, {"pass_at_1": 0.75}])
    return {"args": (config, tracker, hyp, snap, policy, comparison, floor), "config": config, "tracker": tracker,
            "ledger": Ledger(task, tmp_path)}


class _Crash(Exception):
    """The worker died here (a fault injected into the real step)."""


def _crash_at(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str, when: Any = lambda *a, **k: True) -> None:
    real = getattr(owner, name)

    def dies(*args: Any, **kwargs: Any) -> Any:
        if when(*args, **kwargs):
            raise _Crash(f"the worker died in {name}")
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, dies)


def _one_release_published(round_: dict[str, Any]) -> None:
    from envloop_pipelines.core.tracking import KIND_RELEASE, TAG_KIND

    ledger, tracker, config = round_["ledger"], round_["tracker"], round_["config"]
    assert [c["release"] for c in ledger.releases()] == [1]  # on the old code: [1, 2]
    assert [e["release"] for e in ledger.events("release_promoted")] == [1]
    assert len(list(ledger.events("holdout_read"))) == 1 and ledger.round_decision("r0001")["release"] == 1
    runs = tracker.client.search_runs([tracker.client.get_experiment_by_name(config.task).experiment_id])
    [release_run] = [r for r in runs if r.data.tags[TAG_KIND] == KIND_RELEASE]
    assert release_run.info.status == "FINISHED"
    [version] = tracker.client.search_model_versions(f"name='{config.loop_config().model_name}'")
    assert str(version.version) == "1" == ledger.releases()[0]["model_version"] == tracker.champion_version(
        config.loop_config().model_name) and version.run_id == release_run.info.run_id


def test_a_retry_after_a_crash_between_the_card_and_the_decision_publishes_no_second_release(
        round_setup: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both loops publish through ``release_checkpoint``. A worker that died after the release card and before
    ``round_decided`` left an undecided round with a release; its retry published the same checkpoint again as
    release 2 (a second holdout read, run, version and card). It returns the round's release 1 now."""
    from envloop_pipelines.core.ledger.event_log import LedgerError
    from envloop_pipelines.core.release.publish import release_checkpoint

    round_ = _promoting_round(round_setup, tmp_path, "shell-rl-crash")
    _crash_at(monkeypatch, Ledger, "append", lambda self, kind, *a, **k: kind == "round_decided")
    with pytest.raises(_Crash):
        decide_given(*round_["args"])
    monkeypatch.undo()
    ledger = round_["ledger"]
    assert [c["release"] for c in ledger.releases()] == [1] and ledger.round_decision("r0001") is None

    retried = decide_given(*round_["args"])
    assert retried.promoted and retried.release == 1 and retried.model_version == "1"
    _one_release_published(round_)
    # The round's release is of its checkpoint: another one handed to the same round is refused, nothing written.
    other = tmp_path / "policies" / "another-checkpoint"
    other.mkdir()
    with pytest.raises(LedgerError, match="a round publishes one release"):
        release_checkpoint(round_["config"].loop_config(), round_["tracker"], checkpoint=other, read_holdout=None,
                           card=None, round_key="r0001")
    assert [c["release"] for c in ledger.releases()] == [1]


def test_a_retry_after_a_crash_before_the_card_registers_no_second_version(
        round_setup: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker that died after registering the release's version and moving the alias, before the card: the retry
    finished from the stored read but started a second release run and registered the checkpoint again (version 2,
    the alias moved to it, version 1 left an orphan of the same release). It carries on in the first run now."""
    round_ = _promoting_round(round_setup, tmp_path, "shell-rl-crash-card")
    _crash_at(monkeypatch, Ledger, "write_release_card")
    with pytest.raises(_Crash):
        decide_given(*round_["args"])
    monkeypatch.undo()
    assert round_["ledger"].releases() == [] and len(list(round_["ledger"].events("holdout_read"))) == 1

    retried = decide_given(*round_["args"])
    assert retried.promoted and retried.release == 1 and retried.model_version == "1"
    _one_release_published(round_)


def test_a_decided_round_lives_in_the_ledger_not_at_the_io_managers_path(round_setup: dict[str, Any],
                                                                          tmp_path: Path) -> None:
    """Issue 25: core writes no record at the RL IO manager's path (``rounds/<round>/rl_decision.json`` is Dagster's
    to store); the round's ``round_decided`` event carries the decision, and a retry returns it from there."""
    from dataclasses import replace

    from envloop_pipelines.core.ledger.store import RoundStore
    from envloop_pipelines.core.rl_loop.round_steps import (
        measure_rl_noise_floor,
        reevaluate_rl,
        register_rl_hypothesis,
        train_rl_candidate,
    )
    from envloop_pipelines.core.rl_loop.run_round import RL_DECISION, decide_rl_round, decided_rl_round, run_rl_round
    from envloop_pipelines.core.rl_loop.step_records import RL_STEP_RECORDS, RlRoundResult, RlSampling, RlSnapshot
    from envloop_pipelines.core.tracking import MlflowTracker

    ds = round_setup["dataset"]
    config = replace(round_setup["config"], task="shell-rl-decided", home=str(tmp_path))
    tracker = MlflowTracker(home=tmp_path)
    hyp = register_rl_hypothesis(config, ds, "r0001", tracker, sampler={"kind": "test"})
    # The sampler passed nothing: steps 4 to 6 are skipped and the round is decided as a rejection (no model runs).
    failed = [attempt(e, 0, passed=False) for e in ds.environments if e.split == "train"]
    snap = build_sft_snapshot(failed, train_texts=texts(ds, "train"), holdout_texts=texts(ds, "heldout"),
                              root=tmp_path / "snapshots")
    snapshot = RlSnapshot(round="r0001", **snap.to_dict())
    candidate = train_rl_candidate(config, hyp, snapshot, tracker)
    floor = measure_rl_noise_floor(config, ds, snapshot, candidate, tracker, lambda *a, **k: None)
    reeval = reevaluate_rl(config, ds, hyp, candidate, tracker, lambda *a, **k: None)
    assert decided_rl_round(config, "r0001") is None
    result = decide_rl_round(config, tracker, hyp, RlSampling("r0001", "", len(failed), 0), snapshot, candidate, floor,
                             reeval)
    assert not result.promoted and result.reasons[0].startswith("no verified attempt to train on")

    store = RoundStore(config.task, tmp_path)
    assert not any(store.step_path(step, "r0001").exists() for step in RL_STEP_RECORDS), \
        sorted(p.name for p in store.round_dir("r0001").iterdir())
    [decided] = Ledger(config.task, tmp_path).events("round_decided")
    assert decided["decision"] == json.loads(json.dumps(result.to_dict()))
    assert RlRoundResult.from_dict(Ledger(config.task, tmp_path).round_decision("r0001")) == result
    # A retry, through the step or the driver, returns the ledger's decision: nothing is decided or sampled again.
    events = list(Ledger(config.task, tmp_path).events())
    assert decide_rl_round(config, tracker, hyp, RlSampling("r0001", "", 0, 0), snapshot, candidate, floor,
                           reeval) == result
    assert run_rl_round(config, ds, tracker, lambda *a, **k: None, key="r0001") == result
    assert list(Ledger(config.task, tmp_path).events()) == events
    assert not store.step_path(RL_DECISION, "r0001").exists()

    # A round decided before the event carried its record: its stored file is read.
    older = replace(result, round="r0002")
    Ledger(config.task, tmp_path).append("round_decided", {"round": "r0002", "promoted": False, "observed_delta": None,
                                                           "release": None}, key="decided:r0002")
    assert Ledger(config.task, tmp_path).round_decision("r0002") is None
    store.save(RL_DECISION, older, "r0002")
    assert decided_rl_round(config, "r0002") == older
    assert Ledger(config.task, tmp_path).round_decision("r0003") is None and decided_rl_round(config, "r0003") is None
