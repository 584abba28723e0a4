"""Training a decision head end to end: loss, calibration, checkpoint, exact re-scoring, init_from.

One small training run (24 records = 72 questions, soft labels included, one
long state that gets truncated) is shared by the module; it takes ~10 s on 2
CPU threads.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from safetensors.torch import load_file

from envloop_pipelines.core.metrics import point
from envloop_pipelines.core.model.calibration import Calibration, fit_calibration
from envloop_pipelines.core.model.checkpoint import (
    CheckpointIntegrityError,
    CheckpointParts,
    checkpoint_hash,
    load_checkpoint,
    read_predictions,
    sha256_file,
    verify_checkpoint,
    write_checkpoint,
)
from envloop_pipelines.core.model.predict import DecisionModel, evaluate_checkpoint, predictions_from_table
from envloop_pipelines.core.model.readout import as_questions
from envloop_pipelines.core.model.recipe import Recipe, RecipeError, recipe_hash
from envloop_pipelines.core.model.trainable_model import IncompatibleInitError, build_trainable_model
from envloop_pipelines.core.model.training import _fit_head_first, train_checkpoint
from envloop_pipelines.core.model.training_data import _Collator, _QuestionDataset
from envloop_pipelines.core.data.question_table import questions_table
from envloop_pipelines.core.data.records import Record
from envloop_pipelines.core.tokens import packaged_model_dir
from envloop_pipelines_tests.core.test_model_data import limit_threads_under_xdist, make_records, make_table

limit_threads_under_xdist()

RECIPE = Recipe(max_length=128, epochs=6, batch_size=8, eval_batch_size=16, lr=2e-3, head_lr=5e-3, seed=0)


def _train_records() -> list[Record]:
    records = list(make_records(24, soft_every=6))
    first = records[0]
    long_state = str(first.state) + " " + " ".join(f"filler{i}" for i in range(200))
    records[0] = Record(id=first.id, state=long_state, questions=first.questions, meta=first.meta, group=first.group)
    return records


@pytest.fixture(scope="module")
def val_table() -> pa.Table:
    return make_table(12, seed=1, start=500)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory, val_table: pa.Table) -> Path:
    out = tmp_path_factory.mktemp("train") / "ckpt"
    return train_checkpoint(questions_table(_train_records()), val_table, RECIPE, out, data_hash="snap-123")


def test_checkpoint_layout_and_manifest(ckpt: Path) -> None:
    names = {p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file()}
    for required in (
        "adapter/adapter_config.json", "adapter/adapter_model.safetensors", "head.safetensors", "calibration.json",
        "recipe.yaml", "data.json", "metrics.json", "provenance.json", "predictions.parquet", "manifest.json",
    ):
        assert required in names
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert set(manifest["files"]) == names - {"manifest.json"}
    assert all(manifest["files"][n] == sha256_file(ckpt / n) for n in manifest["files"])
    assert manifest["checkpoint_hash"] == checkpoint_hash(ckpt)
    assert not any(p.name.startswith(".") for p in ckpt.parent.iterdir()), "temporary directory left behind"


def test_loss_goes_down(ckpt: Path) -> None:
    train = json.loads((ckpt / "metrics.json").read_text())["train"]
    epochs = [e["mean_loss"] for e in train["epochs"]]
    assert len(epochs) == RECIPE.epochs
    assert epochs[-1] < epochs[0] - 0.15, epochs
    assert train["steps"] == RECIPE.epochs * 9  # 72 questions / batch 8
    assert train["n_questions"] == 72


def test_state_attention_head_trains_and_reloads_exactly(val_table: pa.Table, tmp_path: Path) -> None:
    recipe = RECIPE.replace(state_attention=True, epochs=3)
    out = train_checkpoint(questions_table(_train_records()), val_table, recipe, tmp_path / "ckpt", data_hash="snap-123")
    epochs = [e["mean_loss"] for e in json.loads((out / "metrics.json").read_text())["train"]["epochs"]]
    assert epochs[-1] < epochs[0] - 0.05, epochs  # 1.04 -> 0.95 here
    head = load_file(str(out / "head.safetensors"))
    assert head["head.query.weight"].shape == (384, 768) and head["head.proj.weight"].shape == (RECIPE.head_hidden, 3 * 384)
    saved = predictions_from_table(read_predictions(out))
    fresh = DecisionModel.load(out).predict(val_table)
    assert all(np.array_equal(s.logits, f.logits) for s, f in zip(saved, fresh))
    model, init_hash = build_trainable_model(recipe, init_from=out)
    live = model.head_state_dict()
    assert init_hash == checkpoint_hash(out) and all(torch.equal(head[k], live[k]) for k in head)


def test_head_warmup_fits_the_head_alone_on_the_frozen_encoder() -> None:
    recipe = RECIPE.replace(head_warmup_epochs=2)
    model, _ = build_trainable_model(recipe)
    questions = as_questions(questions_table(_train_records()))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    info = _fit_head_first(model, recipe, _QuestionDataset(model.encode_many(questions), [q.target() for q in questions]),
                           _Collator(model))
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all(n.startswith("head.") for n in changed), sorted(changed)  # the adapter did not move
    assert any("lora_" in n for n in trainable)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == trainable  # the adapter trains again next
    assert info["steps"] == 2 * 9 and info["epochs"] == 2
    assert info["last_epoch_loss"] < info["first_epoch_loss"]


def test_head_warmup_is_recorded_and_skipped_when_continuing(ckpt: Path, val_table: pa.Table, tmp_path: Path) -> None:
    recipe = RECIPE.replace(head_warmup_epochs=1, epochs=1)
    out = train_checkpoint(questions_table(_train_records()), val_table, recipe, tmp_path / "hw", data_hash="snap-123")
    train = json.loads((out / "metrics.json").read_text())["train"]
    assert train["head_warmup"]["steps"] == 9 and train["steps"] == 9
    saved = predictions_from_table(read_predictions(out))
    fresh = DecisionModel.load(out).predict(val_table)
    assert all(np.array_equal(s.logits, f.logits) for s, f in zip(saved, fresh))
    cont = train_checkpoint(make_table(8, seed=7, start=900), val_table, recipe.replace(max_steps=1), tmp_path / "cont",
                            data_hash="snap-2", init_from=ckpt)
    assert json.loads((cont / "metrics.json").read_text())["train"]["head_warmup"] is None


def test_truncation_is_counted_in_training_metrics(ckpt: Path) -> None:
    train = json.loads((ckpt / "metrics.json").read_text())["train"]
    assert train["n_truncated"] == 3  # the long state's three questions
    assert train["n_state_tokens_dropped"] > 0


def test_calibration_does_not_raise_val_nll(ckpt: Path, val_table: pa.Table) -> None:
    m = json.loads((ckpt / "metrics.json").read_text())
    assert m["val"]["calibrated"]["nll"] <= m["val"]["uncalibrated"]["nll"] + 1e-12
    cal = Calibration.from_dict(json.loads((ckpt / "calibration.json").read_text()))
    assert set(cal.temperatures) == {"noul", "choice", "score"}
    assert cal.error_budget == RECIPE.error_budget
    # Recompute from the raw logits: the stored temperatures are the NLL fit on val.
    dm = DecisionModel.load(ckpt)
    questions = as_questions(val_table)
    logits = dm.predict_logits(questions)
    labels = [q.label for q in questions]
    refit = fit_calibration(logits, labels, [q.type for q in questions], error_budget=RECIPE.error_budget)
    assert refit.temperatures == pytest.approx(cal.temperatures)
    raw = point.nll([np.exp(z - np.logaddexp.reduce(z)) for z in logits.__iter__()], labels)
    calibrated = point.nll([cal.apply(z, q.type) for z, q in zip(logits, questions)], labels)
    assert calibrated <= raw + 1e-12


def test_rescoring_from_disk_reproduces_predictions_exactly(ckpt: Path, val_table: pa.Table) -> None:
    saved = predictions_from_table(read_predictions(ckpt))
    fresh = DecisionModel.load(ckpt).predict(val_table)
    assert len(saved) == len(fresh) == val_table.num_rows
    for s, f in zip(saved, fresh):
        assert (s.record_id, s.question_id, s.option_keys) == (f.record_id, f.question_id, f.option_keys)
        assert np.array_equal(s.probs, f.probs)
        assert np.array_equal(s.logits, f.logits)
        assert abs(f.probs.sum() - 1) < 1e-12


def test_provenance_and_data(ckpt: Path) -> None:
    prov = json.loads((ckpt / "provenance.json").read_text())
    assert prov["recipe_hash"] == recipe_hash(RECIPE)
    assert prov["data_hash"] == "snap-123"
    assert prov["base_model_sha256"] == sha256_file(packaged_model_dir() / "model.safetensors")
    for pkg in ("python", "torch", "transformers", "peft"):
        assert prov["versions"][pkg]
    assert "git_commit" in prov and "git_dirty" in prov and prov["init_from"] is None
    assert json.loads((ckpt / "data.json").read_text())["data_hash"] == "snap-123"


def test_evaluate_checkpoint(ckpt: Path, val_table: pa.Table) -> None:
    result = evaluate_checkpoint(ckpt, val_table)
    for key in ("family_macro_accuracy", "accuracy", "brier", "nll", "ece", "coverage_at_5pct", "aurc", "n_truncated"):
        assert key in result
    assert result["n_questions"] == val_table.num_rows
    assert result["checkpoint_hash"] == checkpoint_hash(ckpt)
    assert result["family_macro_accuracy"] > 0.5  # trained: better than chance (1/3, 1/2, 1/3)
    stored = json.loads((ckpt / "metrics.json").read_text())["eval"]
    assert result["nll"] == pytest.approx(stored["nll"], abs=1e-12)


def _copy(ckpt: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(ckpt, dst)
    return dst


def test_flipped_byte_in_head_is_refused(ckpt: Path, tmp_path: Path) -> None:
    bad = _copy(ckpt, tmp_path)
    data = bytearray((bad / "head.safetensors").read_bytes())
    data[-5] ^= 0x01
    (bad / "head.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointIntegrityError, match=r"head\.safetensors") as err:
        load_checkpoint(bad)
    assert err.value.file == "head.safetensors"
    with pytest.raises(CheckpointIntegrityError):
        DecisionModel.load(bad)


def test_edited_calibration_is_refused(ckpt: Path, tmp_path: Path) -> None:
    bad = _copy(ckpt, tmp_path)
    cal = json.loads((bad / "calibration.json").read_text())
    cal["temperatures"]["choice"] = 0.5
    (bad / "calibration.json").write_text(json.dumps(cal))
    with pytest.raises(CheckpointIntegrityError, match=r"calibration\.json.*modified after writing") as err:
        evaluate_checkpoint(bad, make_table(1))
    assert err.value.file == "calibration.json"


def test_missing_and_extra_files_are_refused(ckpt: Path, tmp_path: Path) -> None:
    bad = _copy(ckpt, tmp_path)
    (bad / "adapter" / "adapter_model.safetensors").unlink()
    with pytest.raises(CheckpointIntegrityError, match="missing") as err:
        verify_checkpoint(bad)
    assert err.value.file == "adapter/adapter_model.safetensors"
    bad2 = tmp_path / "copy2"
    shutil.copytree(ckpt, bad2)
    (bad2 / "notes.txt").write_text("hi")
    with pytest.raises(CheckpointIntegrityError, match="not in the manifest") as err:
        verify_checkpoint(bad2)
    assert err.value.file == "notes.txt"
    (bad2 / "notes.txt").unlink()
    manifest = json.loads((bad2 / "manifest.json").read_text())
    manifest["checkpoint_hash"] = "0" * 64
    (bad2 / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointIntegrityError, match="manifest.json: its checkpoint_hash does not match"):
        verify_checkpoint(bad2)
    (bad2 / "manifest.json").unlink()
    with pytest.raises(CheckpointIntegrityError, match="manifest.json"):
        verify_checkpoint(bad2)


def test_checkpoints_are_never_overwritten(ckpt: Path, val_table: pa.Table) -> None:
    before = checkpoint_hash(ckpt)
    with pytest.raises(FileExistsError, match="never overwritten"):
        train_checkpoint(val_table, val_table, RECIPE, ckpt, data_hash="x")
    loaded = load_checkpoint(ckpt)
    with pytest.raises(FileExistsError, match="never overwritten"):
        write_checkpoint(ckpt, CheckpointParts(
            model=loaded.model, recipe=loaded.recipe, calibration=loaded.calibration, data={}, metrics={},
            provenance={}, predictions=read_predictions(ckpt),
        ))
    assert checkpoint_hash(ckpt) == before


def test_init_from_loads_the_saved_adapter_and_head(ckpt: Path) -> None:
    model, init_hash = build_trainable_model(RECIPE, init_from=ckpt)
    assert init_hash == checkpoint_hash(ckpt)
    from peft import get_peft_model_state_dict

    saved_adapter = load_file(str(ckpt / "adapter" / "adapter_model.safetensors"))
    live_adapter = get_peft_model_state_dict(model.encoder)
    assert set(saved_adapter) == set(live_adapter)
    assert all(torch.equal(saved_adapter[k], live_adapter[k]) for k in saved_adapter)
    saved_head = load_file(str(ckpt / "head.safetensors"))
    live_head = model.head_state_dict()
    assert set(saved_head) == set(live_head) and all(torch.equal(saved_head[k], live_head[k]) for k in saved_head)
    trainable = model.trainable_parameter_names()
    assert any("lora_" in n for n in trainable) and any(n.startswith("head.") for n in trainable)


def test_init_from_continues_training(ckpt: Path, val_table: pa.Table, tmp_path: Path) -> None:
    recipe = RECIPE.replace(epochs=1, max_steps=3)
    out = train_checkpoint(make_table(8, seed=7, start=900), val_table, recipe, tmp_path / "cont", data_hash="snap-2", init_from=ckpt)
    prov = json.loads((out / "provenance.json").read_text())
    assert prov["init_from"] == checkpoint_hash(ckpt)
    first = json.loads((ckpt / "metrics.json").read_text())["train"]["epochs"][0]["mean_loss"]
    cont = json.loads((out / "metrics.json").read_text())["train"]["epochs"][0]["mean_loss"]
    assert cont < first - 0.2  # starts from the trained weights, not from scratch
    load_checkpoint(out)


def test_init_from_an_incompatible_checkpoint_names_the_field(ckpt: Path, tmp_path: Path) -> None:
    with pytest.raises(IncompatibleInitError, match=r"lora\.r: recipe 4 vs checkpoint 8"):
        train_checkpoint(make_table(2), make_table(2), RECIPE.replace(lora={"r": 4}), tmp_path / "x", data_hash="h", init_from=ckpt)
    with pytest.raises(IncompatibleInitError, match=r"state_attention: recipe True vs checkpoint False"):
        train_checkpoint(make_table(2), make_table(2), RECIPE.replace(state_attention=True), tmp_path / "y", data_hash="h",
                         init_from=ckpt)


def test_training_is_deterministic(tmp_path: Path) -> None:
    recipe = RECIPE.replace(max_steps=2, batch_size=4)
    train, val = make_table(4, seed=3), make_table(2, seed=4, start=50)
    a = train_checkpoint(train, val, recipe, tmp_path / "a", data_hash="h")
    b = train_checkpoint(train, val, recipe, tmp_path / "b", data_hash="h")
    for name in ("adapter/adapter_model.safetensors", "head.safetensors", "calibration.json", "predictions.parquet"):
        assert sha256_file(a / name) == sha256_file(b / name), name
    # The identity leaves out metrics.json and provenance.json (timings, timestamps): same model, same hash.
    assert checkpoint_hash(a) == checkpoint_hash(b)
    assert checkpoint_hash(a) != checkpoint_hash(train_checkpoint(train, val, recipe.replace(seed=1), tmp_path / "c", data_hash="h"))


def test_unlabelled_training_questions_are_an_error(tmp_path: Path) -> None:
    table = make_table(2)
    unlabelled = table.set_column(table.schema.get_field_index("label"), "label", pa.nulls(table.num_rows, pa.int32()))
    unlabelled = unlabelled.set_column(unlabelled.schema.get_field_index("soft_label"), "soft_label", pa.nulls(table.num_rows, pa.list_(pa.float64())))
    with pytest.raises(ValueError, match=r"train: 6 question\(s\) have neither label nor soft_label: r0000/color"):
        train_checkpoint(unlabelled, table, RECIPE, tmp_path / "x", data_hash="h")
    assert not (tmp_path / "x").exists()


def test_deepspeed_config_passes_through_on_gpu_only(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from envloop_pipelines.core.model import training
    from envloop_pipelines.core.model.training import deepspeed_config as _deepspeed_config, trainer_arguments

    gpu_recipe = RECIPE.replace(deepspeed="packaged:deepspeed_zero2.json", precision="bf16")
    monkeypatch.setattr(training, "cpu_bf16", lambda: False)  # a CPU without bf16 units
    with caplog.at_level("INFO", logger="envloop_pipelines.core.model.training"):
        args = trainer_arguments(gpu_recipe, str(tmp_path), label_names=["targets"])
    assert args.deepspeed is None and not args.bf16 and args.use_cpu  # this machine has no GPU
    assert "ignored: no CUDA device" in caplog.text and "this CPU has no bf16 units" in caplog.text
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert _deepspeed_config(gpu_recipe, cuda=True).name == "deepspeed_zero2.json"
    stage3 = tmp_path / "z3.json"
    stage3.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    with pytest.raises(ValueError, match="recipe field 'deepspeed'.*ZeRO stage 3"):
        _deepspeed_config(RECIPE.replace(deepspeed=str(stage3)), cuda=True)


def test_bf16_trains_under_autocast_on_a_cpu_with_bf16_units(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """precision: bf16 on a CPU with bf16 units: the Trainer autocasts (the encoder's matmuls run in bf16), the
    weights stay fp32, and the checkpoint predicts in its inference precision as an fp32-trained one does."""
    from envloop_pipelines.core.model import training
    from envloop_pipelines.core.model.training import trainer_arguments

    monkeypatch.setattr(training, "cpu_bf16", lambda: True)
    recipe = RECIPE.replace(precision="bf16", max_steps=2)
    assert trainer_arguments(recipe, str(tmp_path / "args"), label_names=["targets"]).bf16
    seen: list[torch.dtype] = []
    real_linear = torch.nn.functional.linear

    def spy(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        out = real_linear(x, w, b)
        if torch.is_grad_enabled():  # the training steps, not the val pass
            seen.append(out.dtype)
        return out

    monkeypatch.setattr(torch.nn.functional, "linear", spy)
    out = train_checkpoint(make_table(6), make_table(4, seed=1, start=100), recipe, tmp_path / "ckpt", data_hash="h")
    monkeypatch.setattr(torch.nn.functional, "linear", real_linear)
    assert torch.bfloat16 in seen, "no bf16 matmul in training: autocast is off"
    model = DecisionModel.load(out)
    assert all(p.dtype == torch.float32 for p in model.model.parameters())


def test_encoder_dropout_sets_the_base_models_dropout_and_keeps_old_hashes() -> None:
    from envloop_pipelines.core.model.recipe import recipe_to_dict

    assert "encoder_dropout" not in recipe_to_dict(RECIPE)
    def encoder_dropouts(model: torch.nn.Module) -> set[float]:  # the base model's, not LoRA's own (lora.dropout)
        return {m.p for n, m in model.named_modules()
                if isinstance(m, torch.nn.Dropout) and ".encoder.layer." in n and "lora_dropout" not in n}

    assert encoder_dropouts(build_trainable_model(RECIPE.replace(encoder_dropout=0.0))[0]) == {0.0}
    assert encoder_dropouts(build_trainable_model(RECIPE)[0]) == {0.1}
    with pytest.raises(RecipeError, match="encoder_dropout"):
        RECIPE.replace(encoder_dropout=1.5)


def test_weights_left_in_bf16_are_rebuilt_as_the_checkpoint_loads_them() -> None:
    from peft import get_peft_model_state_dict

    from envloop_pipelines.core.model.trainable_model import _as_loaded

    model, _ = build_trainable_model(RECIPE)
    model = model.to(torch.bfloat16)  # what DeepSpeed's bf16 mode does to the whole module
    rebuilt = _as_loaded(model, RECIPE)
    assert rebuilt is not model and {p.dtype for p in rebuilt.parameters()} == {torch.float32}
    a, b = get_peft_model_state_dict(model.encoder), get_peft_model_state_dict(rebuilt.encoder)
    assert all(torch.equal(a[k].float(), b[k]) for k in a)
    assert all(torch.equal(v.float(), rebuilt.head_state_dict()[k]) for k, v in model.head_state_dict().items())
    fp32_model, _ = build_trainable_model(RECIPE)
    assert _as_loaded(fp32_model, RECIPE) is fp32_model and not fp32_model.training
