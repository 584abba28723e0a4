"""LoRA SFT of a readout, calibration on val, and the checkpoint: :func:`train_checkpoint`.

Training runs on ``transformers.Trainer`` with a custom loss (soft
cross-entropy over each question's options), a custom collator (questions have
ragged option counts), and its optimizer split into two learning rates (``lr``
for LoRA, ``head_lr`` for the decision head). The Trainer brings the schedule,
gradient accumulation and clipping, bf16 and DeepSpeed on a GPU. The Trainer
subclass is in ``readout_trainer.py``, its dataset, collator and sampler in
``training_data.py``, the model it starts from in ``trainable_model.py``, the
run made ready before the first step in ``training_setup.py``, the fit on val
after training in ``val_calibration.py`` (and ``lexical_fit.py``), the
checkpoint's parts and their writing in ``checkpoint.py``; this module holds the
Trainer's arguments, the head warm-up and the sequence of steps.

Determinism: ``transformers.set_seed(recipe.seed)`` before the model is built
(LoRA and head initialisation), a sampler with its own seeded generator (the
data order is a function of the seed alone), no dataloader workers, and
``torch.use_deterministic_algorithms(True, warn_only=True)`` for the duration
of training (restored afterwards).

DeepSpeed: the recipe's config path goes to ``TrainingArguments(deepspeed=…)``
when a CUDA device is present; on CPU it is ignored with a log line.
``precision: bf16`` trains under bf16 autocast on a GPU and on a CPU with bf16
units (``avx512_bf16``: matrix products at ~2.5x the fp32 rate here, master
weights and optimizer state stay fp32); on a CPU without them it is ignored
with a log line.

Several processes (``accelerate launch --num_processes N -m envloop_pipelines.cli train …``):
every rank trains on its shard of each batch; rank 0 alone calibrates and writes the
checkpoint (atomically), and the other ranks return as soon as training ends
(:func:`is_main_process` tells a caller which one it is). The per-epoch losses in
``metrics.json`` are rank 0's micro-batches; ``provenance.json`` records ``world_size``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from envloop_pipelines.core.model.calibration import DEFAULT_SAFETY_FNR_TARGET
from envloop_pipelines.core.model.checkpoint import CheckpointParts, build_provenance, write_checkpoint
from envloop_pipelines.core.model.predict import json_safe, predictions_table, score_predictions
from envloop_pipelines.core.model.readout import QuestionInput, ReadoutModel
from envloop_pipelines.core.model.readout_trainer import TrainerRun, _epoch_losses, _loss_quarters, _trainer_class
from envloop_pipelines.core.model.recipe import Recipe, TrainerFields, resolve_deepspeed
from envloop_pipelines.core.model.trainable_model import _as_loaded
from envloop_pipelines.core.model.training_data import _Collator, _QuestionDataset, _targets
from envloop_pipelines.core.model.training_setup import PreparedRun, TableLike, labelled_questions, prepare_run
from envloop_pipelines.core.model.val_calibration import ValCalibration, calibrate_on_val

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- the Trainer's arguments


@contextlib.contextmanager
def _deterministic() -> Iterator[None]:
    """``torch.use_deterministic_algorithms(True, warn_only=True)`` for the block, then restore."""
    was, was_warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=was_warn)


def is_main_process() -> bool:
    """True in the process that writes checkpoints: global rank 0, or the only process."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank() == 0
    return int(os.environ.get("RANK", "0")) == 0


def deepspeed_config(recipe: TrainerFields, cuda: bool) -> Path | None:
    """The DeepSpeed config to pass through, or None (no config, or no GPU).

    Raises:
        ValueError: a ZeRO stage 3 config (naming the field).
    """
    import json

    path = resolve_deepspeed(recipe)
    if path is None:
        return None
    if not cuda:
        log.info("recipe.deepspeed=%s ignored: no CUDA device (DeepSpeed runs on GPUs only)", recipe.deepspeed)
        return None
    stage = json.loads(path.read_text()).get("zero_optimization", {}).get("stage", 0)
    if stage == 3:
        # ZeRO-3 shards the parameters themselves; the adapter, head and end-of-training
        # predictions here read whole parameters. LoRA's optimizer state is small: ZeRO-2 suffices.
        raise ValueError(f"recipe field 'deepspeed': {recipe.deepspeed!r} uses ZeRO stage 3, which train_checkpoint does not support; use stage 0-2")
    if "WORLD_SIZE" not in os.environ:
        # Launched as one plain process (not by deepspeed/torchrun/accelerate): a world of one.
        for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29511")):
            os.environ.setdefault(key, value)
        log.info("DeepSpeed in a single process: RANK=0 WORLD_SIZE=1 (launch with accelerate/deepspeed for several GPUs)")
    return path


def cpu_bf16() -> bool:
    """Whether this CPU multiplies bf16 matrices natively (``avx512_bf16`` or AMX), so bf16 autocast pays."""
    try:
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except AttributeError:  # an older torch without the probes: stay in fp32
        return False


def trainer_arguments(recipe: TrainerFields, output_dir: str, *, label_names: Sequence[str],
                      log_every_step: bool = False) -> Any:
    """The ``TrainingArguments`` of a recipe: the one builder of both trainers (decision model, causal SFT).

    The recipe's trainer fields as they are, except: without CUDA ``deepspeed`` is ignored, and
    ``precision: bf16`` too where the CPU has no bf16 units (:func:`cpu_bf16`), each with a log line. No checkpoints, no evaluation, no reports, no
    progress bars, no dataloader workers (determinism).

    Args:
        recipe: a decision :class:`Recipe` or a causal-SFT recipe (their shared :class:`TrainerFields`).
        output_dir: the Trainer's scratch directory.
        label_names: the batch keys that hold the labels (``targets`` for the decision model).
        log_every_step: record the loss of every optimizer step in ``trainer.state.log_history``
            (causal SFT's per-step losses); off, the Trainer logs nothing.
    """
    from transformers import TrainingArguments

    cuda = torch.cuda.is_available()
    deepspeed = deepspeed_config(recipe, cuda)
    bf16 = recipe.precision == "bf16"
    if bf16 and not cuda and not cpu_bf16():
        log.info("recipe.precision=bf16 ignored: this CPU has no bf16 units (avx512_bf16); training in fp32")
        bf16 = False
    logging_args: dict[str, Any] = {"logging_strategy": "steps", "logging_steps": 1} if log_every_step else {
        "logging_strategy": "no"}
    return TrainingArguments(
        output_dir=output_dir,
        num_train_epochs=recipe.epochs,
        max_steps=recipe.max_steps if recipe.max_steps is not None else -1,
        per_device_train_batch_size=recipe.batch_size,
        gradient_accumulation_steps=recipe.grad_accum,
        learning_rate=recipe.lr,
        weight_decay=recipe.weight_decay,
        warmup_steps=recipe.warmup_ratio,  # a float in [0, 1) is a ratio of the total steps
        lr_scheduler_type=recipe.lr_scheduler,
        max_grad_norm=recipe.max_grad_norm,
        seed=recipe.seed,
        data_seed=recipe.seed,
        bf16=bf16,
        deepspeed=str(deepspeed) if deepspeed is not None else None,
        use_cpu=not cuda,
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        disable_tqdm=True,
        remove_unused_columns=False,
        dataloader_num_workers=0,
        dataloader_pin_memory=False,
        label_names=list(label_names),
        **logging_args,
    )


# --------------------------------------------------------------------------- one run of the Trainer


def _run_trainer(model: ReadoutModel, recipe: Recipe, dataset: Dataset, collator: _Collator) -> TrainerRun:
    """Train ``model``'s trainable parameters on ``dataset`` as ``recipe`` says, with the readout trainer."""
    from transformers.trainer_callback import PrinterCallback

    from envloop_pipelines.core.progress import trainer_callback

    with tempfile.TemporaryDirectory(prefix="envloop-trainer-") as tmp:
        trainer = _trainer_class()(
            model=model,
            args=trainer_arguments(recipe, tmp, label_names=["targets"]),
            train_dataset=dataset,
            data_collator=collator,
            recipe=recipe,
        )
        trainer.remove_callback(PrinterCallback)
        # a bar on a terminal, a line every few percent in logs (the Dagster run's log included)
        trainer.add_callback(trainer_callback(loss=lambda: trainer.loss_log[-1][1] if trainer.loss_log else None))
        t0 = time.perf_counter()
        result = trainer.train()
        seconds = time.perf_counter() - t0
        run = TrainerRun(
            model=trainer.model,  # unwrapped (DeepSpeed keeps its engine in model_wrapped)
            steps=int(result.global_step),
            seconds=seconds,
            loss_log=list(trainer.loss_log),
            step_seconds=list(trainer.step_seconds),
            main_process=trainer.is_world_process_zero(),
            world_size=int(trainer.args.world_size),
            used_deepspeed=trainer.args.deepspeed is not None,
        )
        del trainer
    return run


def train_readout(model: ReadoutModel, questions: Sequence[QuestionInput], recipe: Recipe) -> TrainerRun:
    """Train a readout already built (its LoRA, and head if any) on labelled questions, as ``recipe`` says.

    The training of :func:`train_checkpoint` alone (the same trainer, data order and determinism), with no
    calibration and no checkpoint: for a model that is not built from a recipe's base model directory, such
    as ``bench/bench_gpu.py``'s randomly initialised causal LM.
    """
    encoded = model.encode_many(questions)
    with _deterministic():
        return _run_trainer(model, recipe, _QuestionDataset(encoded, _targets(questions, "train")), _Collator(model))


# --------------------------------------------------------------------------- the head warm-up


def _fit_head_first(model: ReadoutModel, recipe: Recipe, dataset: Dataset, collator: _Collator) -> dict[str, Any]:
    """Fit the fresh head alone on the frozen encoder for ``recipe.head_warmup_epochs`` (linear probing).

    LoRA training that starts from a random head moves the encoder's features to suit that head; a
    head fitted first on the pretrained features gives the adapter a useful gradient from its first
    step (LP-FT, Kumar et al., 2022). The adapter's parameters are frozen meanwhile, so the encoder
    runs forward only. The head's learning rate and the recipe's schedule apply.

    Returns:
        What the phase did: epochs, steps, seconds, and the mean loss of its first and last epochs.
    """
    frozen = [p for name, p in model.named_parameters() if p.requires_grad and not name.startswith("head.")]
    for p in frozen:
        p.requires_grad_(False)
    try:
        run = _run_trainer(model, recipe.replace(epochs=recipe.head_warmup_epochs, max_steps=None), dataset, collator)
    finally:
        for p in frozen:
            p.requires_grad_(True)
    epochs = _epoch_losses(run.loss_log)
    log.info("head warm-up: %d steps in %.1fs on the frozen encoder, last epoch loss %.4f",
             run.steps, run.seconds, epochs[-1]["mean_loss"] if epochs else math.nan)
    return {"epochs": recipe.head_warmup_epochs, "steps": run.steps, "seconds": run.seconds,
            "first_epoch_loss": epochs[0]["mean_loss"] if epochs else None,
            "last_epoch_loss": epochs[-1]["mean_loss"] if epochs else None}


def _warm_up_head(prepared: PreparedRun, recipe: Recipe, init_from: str | Path | None) -> dict[str, Any] | None:
    """The head warm-up (:func:`_fit_head_first`) when the recipe asks for one and the head is fresh."""
    if recipe.head_warmup_epochs and init_from is not None:
        log.info("head_warmup_epochs=%d skipped: the head comes fitted from %s", recipe.head_warmup_epochs, init_from)
        return None
    if recipe.head_warmup_epochs:
        return _fit_head_first(prepared.model, recipe, prepared.dataset, prepared.collator)
    return None


# --------------------------------------------------------------------------- after the last step


def _metrics(recipe: Recipe, prepared: PreparedRun, run: TrainerRun, fit: ValCalibration,
             head_warmup: dict[str, Any] | None, *, train_q: Sequence[QuestionInput], val_q: Sequence[QuestionInput],
             eval_q: Sequence[QuestionInput], eval_split: str, t_start: float) -> dict[str, Any]:
    """What ``metrics.json`` holds: the training run, val before and after calibration, the eval split."""
    epochs = _epoch_losses(run.loss_log)
    return {
        "train": {
            "n_questions": len(train_q),
            "n_truncated": int(prepared.n_truncated),
            "n_state_tokens_dropped": int(sum(e.n_state_tokens_dropped for e in prepared.encoded)),
            "epochs": epochs,
            "first_epoch_loss": epochs[0]["mean_loss"] if epochs else None,
            "last_epoch_loss": epochs[-1]["mean_loss"] if epochs else None,
            "loss_quarters": _loss_quarters(run.loss_log),
            "steps": run.steps,
            "seconds": run.seconds,
            "seconds_per_step": float(np.mean(run.step_seconds)) if run.step_seconds else None,
            "questions_per_second": sum(n for _, _, n in run.loss_log) / run.seconds if run.seconds > 0 else None,
            "head_warmup": head_warmup,
            "feature_pass": prepared.feature_pass,
            "lexical": fit.lexical_fit,
            "family_slots": prepared.family_slots,
            "trainable_parameters": int(prepared.n_trainable),
            "total_parameters": int(prepared.n_total),
        },
        "val": {
            "uncalibrated": score_predictions(fit.val_raw, val_q, error_budget=recipe.error_budget, raw=True),
            "calibrated": score_predictions(fit.val_calibrated, val_q, error_budget=recipe.error_budget),
        },
        "calibration": fit.calibration.to_dict(),
        "eval": score_predictions(fit.eval_predictions, eval_q, error_budget=recipe.error_budget),
        "eval_split": eval_split,
        "wall_seconds": time.perf_counter() - t_start,
    }


def _checkpoint_parts(recipe: Recipe, model: ReadoutModel, prepared: PreparedRun, run: TrainerRun, fit: ValCalibration,
                      metrics: dict[str, Any], *, data_hash: str, eval_split: str, n_train: int, n_val: int,
                      n_eval: int) -> CheckpointParts:
    """The checkpoint's parts: the trained model, its calibration, the metrics, provenance and data."""
    provenance = build_provenance(recipe, data_hash, init_from_hash=prepared.init_hash,
                                  extra={"world_size": run.world_size,
                                         "deepspeed": recipe.deepspeed if run.used_deepspeed else None})
    data = {"data_hash": data_hash, "eval_split": eval_split, "n_train": n_train, "n_val": n_val, "n_eval": n_eval}
    return CheckpointParts(
        model=model,
        recipe=recipe,
        calibration=fit.calibration,
        data=data,
        metrics=json_safe(metrics),
        provenance=provenance,
        predictions=predictions_table(fit.eval_predictions),
        lexical=fit.lexical,
    )


def _log_summary(recipe: Recipe, run: TrainerRun, metrics: dict[str, Any]) -> None:
    """One line: steps, seconds, the loss from first to last epoch, the val NLL before and after calibration."""
    log.info(
        "trained %s: %d steps in %.1fs, loss %.4f → %.4f; val nll %.4f → %.4f after calibration",
        recipe.readout, run.steps, run.seconds, metrics["train"]["first_epoch_loss"] or math.nan,
        metrics["train"]["last_epoch_loss"] or math.nan,
        metrics["val"]["uncalibrated"].get("nll") or math.nan, metrics["val"]["calibrated"].get("nll") or math.nan,
    )


# --------------------------------------------------------------------------- the public entry point


def train_checkpoint(
    train_table: TableLike,
    val_table: TableLike,
    recipe: Recipe,
    out_dir: str | Path,
    *,
    data_hash: str,
    init_from: str | Path | None = None,
    eval_table: TableLike | None = None,
    eval_split: str = "val",
    safety_families: Sequence[str] = (),
    safety_fnr_target: float = DEFAULT_SAFETY_FNR_TARGET,
) -> Path:
    """Train a readout with LoRA, calibrate it on val, and write a checkpoint directory.

    Args:
        train_table: Training questions (a question table, records, or questions), labelled.
        val_table: Validation questions, labelled: calibration (per-type temperature and
            the automation threshold at ``recipe.error_budget``) is fitted on them.
        recipe: The recipe.
        out_dir: The checkpoint directory to create (must not exist).
        data_hash: The data snapshot hash, stored in ``data.json`` and the provenance.
        init_from: A checkpoint to continue from (its adapter and head), instead of the base model.
        eval_table: Questions whose end-of-training predictions go to
            ``predictions.parquet`` (default: ``val_table``).
        eval_split: Name of that split, recorded in ``data.json``.
        safety_families: Declared safety families: each gets an automation threshold on val for
            ``safety_fnr_target`` in the calibration (below it, its answers defer to a person).
        safety_fnr_target: The val false-negative rate of those thresholds.

    Returns:
        The checkpoint directory.
    """
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"checkpoint directory {out_dir} already exists; checkpoints are never overwritten")
    if not isinstance(data_hash, str) or not data_hash:
        raise ValueError("data_hash must be a non-empty string (the data snapshot hash)")
    train_q, val_q, eval_q, train_targets = labelled_questions(train_table, val_table, eval_table)

    t_start = time.perf_counter()
    with _deterministic():
        prepared = prepare_run(recipe, train_q, train_targets, init_from)
        head_warmup = _warm_up_head(prepared, recipe, init_from)
        run = _run_trainer(prepared.model, recipe, prepared.dataset, prepared.collator)
    if not run.main_process:
        # Several processes trained together (DeepSpeed/DDP): rank 0 alone calibrates and writes. The
        # directory does not exist yet here (rank 0 renames it into place when done): callers check
        # is_main_process() before reading it.
        log.info("not the main process: leaving calibration and the checkpoint %s to rank 0", out_dir)
        return out_dir
    model = _as_loaded(run.model, recipe)
    fit = calibrate_on_val(model, recipe, train_q, val_q, None if eval_table is None else eval_q,
                           safety_families=safety_families, safety_fnr_target=safety_fnr_target)
    metrics = _metrics(recipe, prepared, run, fit, head_warmup, train_q=train_q, val_q=val_q, eval_q=eval_q,
                       eval_split=eval_split, t_start=t_start)
    parts = _checkpoint_parts(recipe, model, prepared, run, fit, metrics, data_hash=data_hash, eval_split=eval_split,
                              n_train=len(train_q), n_val=len(val_q), n_eval=len(eval_q))
    _log_summary(recipe, run, metrics)
    return write_checkpoint(out_dir, parts)


__all__ = [
    "cpu_bf16",
    "deepspeed_config",
    "is_main_process",
    "train_checkpoint",
    "train_readout",
    "trainer_arguments",
]
