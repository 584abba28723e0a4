"""LoRA SFT of a readout, calibration on val, and the checkpoint: :func:`train_checkpoint`.

Training runs on ``transformers.Trainer`` with a custom loss (soft
cross-entropy over each question's options), a custom collator (questions have
ragged option counts), and its optimizer split into two learning rates (``lr``
for LoRA, ``head_lr`` for the decision head). The Trainer brings the schedule,
gradient accumulation and clipping, bf16 and DeepSpeed on a GPU.

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
import dataclasses
import logging
import math
import os
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from torch.utils.data import Dataset, RandomSampler

from envloop_pipelines.core.model.calibration import DEFAULT_SAFETY_FNR_TARGET, fit_calibration
from envloop_pipelines.core.model.lexical import LexicalModel, fit_lexical_weight, fuse, head_share
from envloop_pipelines.core.model.checkpoint import (
    build_provenance,
    load_checkpoint,
    write_checkpoint,
)
from envloop_pipelines.core.model.predict import (
    DecisionModel,
    QuestionPrediction,
    evaluate_checkpoint,
    json_safe,
    predictions_table,
    score_predictions,
)
from envloop_pipelines.core.model.readout import (
    Encoded,
    QuestionInput,
    ReadoutModel,
    as_questions,
    soft_cross_entropy,
)
from envloop_pipelines.core.model.readouts import build_readout_model
from envloop_pipelines.core.model.recipe import Recipe, TrainerFields, resolve_deepspeed
from envloop_pipelines.core.data.records import Record

log = logging.getLogger(__name__)

TableLike = pa.Table | Sequence[Record] | Sequence[QuestionInput]


class IncompatibleInitError(ValueError):
    """``init_from`` names a checkpoint whose readout, base model or LoRA shape differs from the recipe's."""


# --------------------------------------------------------------------------- data


class _QuestionDataset(Dataset):
    """Encoded questions with their targets, in a fixed order."""

    def __init__(self, encoded: Sequence[Encoded], targets: Sequence[np.ndarray]) -> None:
        self.encoded = list(encoded)
        self.targets = list(targets)

    def __len__(self) -> int:
        return len(self.encoded)

    def __getitem__(self, i: int) -> tuple[Encoded, np.ndarray]:
        return self.encoded[i], self.targets[i]


class _Collator:
    """The readout's collate plus padded targets (ragged options → one tensor)."""

    def __init__(self, model: ReadoutModel) -> None:
        self.model = model

    def __call__(self, items: Sequence[tuple[Encoded, np.ndarray]]) -> dict[str, torch.Tensor]:
        batch = self.model.collate([e for e, _ in items])
        k = batch["option_mask"].shape[1]
        targets = torch.zeros((len(items), k), dtype=torch.float32)
        for i, (_, t) in enumerate(items):
            targets[i, : len(t)] = torch.as_tensor(t, dtype=torch.float32)
        batch["targets"] = targets
        return batch


def _targets(questions: Sequence[QuestionInput], split: str) -> list[np.ndarray]:
    out, missing = [], []
    for q in questions:
        t = q.target()
        if t is None:
            missing.append(q.key)
        else:
            out.append(t)
    if missing:
        shown = ", ".join(missing[:10]) + (" ..." if len(missing) > 10 else "")
        raise ValueError(f"{split}: {len(missing)} question(s) have neither label nor soft_label: {shown}")
    return out


class LengthGroupedSampler(torch.utils.data.Sampler):
    """A seeded order whose consecutive ``batch_size`` runs hold questions of similar length.

    Each epoch: shuffle, cut into chunks of 50 batches, sort each chunk by length, cut into
    batches, shuffle the full batches and put the one short batch last (the DataLoader batches
    consecutive indices, so a short batch in the middle would shift every batch after it).
    Every question is seen once per epoch, as with a random order; padding falls with the spread
    of lengths inside a batch.
    """

    def __init__(self, lengths: Sequence[int], batch_size: int, generator: torch.Generator) -> None:
        self.lengths = list(lengths)
        self.batch_size = batch_size
        self.generator = generator

    def __len__(self) -> int:
        return len(self.lengths)

    def __iter__(self) -> Iterator[int]:
        order = torch.randperm(len(self.lengths), generator=self.generator).tolist()
        chunk = 50 * self.batch_size
        batches: list[list[int]] = []
        for start in range(0, len(order), chunk):
            part = sorted(order[start:start + chunk], key=lambda i: -self.lengths[i])
            batches += [part[i:i + self.batch_size] for i in range(0, len(part), self.batch_size)]
        full = [b for b in batches if len(b) == self.batch_size]
        short = [i for b in batches if len(b) < self.batch_size for i in b]
        shuffled = [full[i] for i in torch.randperm(len(full), generator=self.generator).tolist()]
        return iter([i for b in shuffled for i in b] + short)


# --------------------------------------------------------------------------- trainer


def _trainer_class() -> type:
    """The Trainer subclass (built lazily: importing ``transformers.Trainer`` is slow)."""
    from transformers import Trainer, TrainerCallback

    class _EpochLossCallback(TrainerCallback):
        def __init__(self, owner: Any) -> None:
            self.owner = owner
            self._t0 = 0.0

        def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.owner.epoch_index += 1

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self._t0 = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.owner.step_seconds.append(time.perf_counter() - self._t0)

    class ReadoutTrainer(Trainer):
        """Soft cross-entropy over each question's options; two learning rates; a seeded data order."""

        # compute_loss returns a per-micro-batch mean: let the Trainer divide by grad_accum.
        loss_is_scaled_for_ga = False

        def __init__(self, *args: Any, recipe: Recipe, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.recipe = recipe
            self.epoch_index = -1
            self.loss_log: list[tuple[int, float, int]] = []  # (epoch, loss, questions)
            self.step_seconds: list[float] = []
            self.add_callback(_EpochLossCallback(self))

        def compute_loss(self, model: Any, inputs: dict[str, torch.Tensor], return_outputs: bool = False,
                         num_items_in_batch: Any = None) -> Any:
            targets = inputs.pop("targets")
            logits = model(**inputs)
            loss = soft_cross_entropy(logits, inputs["option_mask"], targets)
            if model.training:
                self.loss_log.append((max(self.epoch_index, 0), float(loss.detach()), int(targets.shape[0])))
            return (loss, logits) if return_outputs else loss

        def create_optimizer(self, model: Any = None) -> torch.optim.Optimizer:
            if self.optimizer is None:
                opt_model = self.model if model is None else model
                groups: dict[tuple[float, float], list[torch.nn.Parameter]] = {}
                for name, p in opt_model.named_parameters():
                    if not p.requires_grad:
                        continue
                    lr = self.recipe.head_lr if name.startswith("head.") else self.recipe.lr
                    decay = 0.0 if (p.ndim < 2) else self.recipe.weight_decay  # no decay on biases
                    groups.setdefault((lr, decay), []).append(p)
                self.optimizer = torch.optim.AdamW(
                    [{"params": ps, "lr": lr, "weight_decay": wd} for (lr, wd), ps in groups.items()],
                    lr=self.recipe.lr,
                    betas=(0.9, 0.999),
                    eps=1e-8,
                )
            return self.optimizer

        def _get_train_sampler(self, train_dataset: Any = None) -> torch.utils.data.Sampler:
            ds = train_dataset if train_dataset is not None else self.train_dataset
            generator = torch.Generator().manual_seed(self.recipe.seed)
            if self.recipe.length_grouped:
                return LengthGroupedSampler([len(e) for e in ds.encoded], self.recipe.batch_size, generator)
            return RandomSampler(ds, generator=generator)

    return ReadoutTrainer


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


# --------------------------------------------------------------------------- model building


def _check_init_compatible(recipe: Recipe, saved: Recipe, ckpt_dir: Path) -> None:
    problems = []
    for name in ("readout", "base_model"):
        if getattr(recipe, name) != getattr(saved, name):
            problems.append(f"{name}: recipe {getattr(recipe, name)!r} vs checkpoint {getattr(saved, name)!r}")
    for name in ("r", "target_modules"):
        if getattr(recipe.lora, name) != getattr(saved.lora, name):
            problems.append(f"lora.{name}: recipe {getattr(recipe.lora, name)!r} vs checkpoint {getattr(saved.lora, name)!r}")
    if recipe.readout == "decision_head":
        for name in ("head_hidden", "state_attention", "family_head"):
            if getattr(recipe, name) != getattr(saved, name):
                problems.append(f"{name}: recipe {getattr(recipe, name)!r} vs checkpoint {getattr(saved, name)!r}")
    if problems:
        raise IncompatibleInitError(f"init_from {ckpt_dir}: cannot continue training: " + "; ".join(problems))


def build_trainable_model(recipe: Recipe, *, init_from: str | Path | None = None) -> tuple[ReadoutModel, str | None]:
    """The model to train: fresh LoRA and head (seeded), or a checkpoint's adapter and head.

    Returns:
        The model (train mode, LoRA and head trainable) and the init checkpoint's hash (or None).

    Raises:
        IncompatibleInitError: the checkpoint's readout, base model, LoRA rank/targets or head width differ.
        CheckpointIntegrityError: the checkpoint fails verification.
    """
    from transformers import set_seed

    set_seed(recipe.seed)
    if init_from is None:
        model = build_readout_model(recipe, trainable=True)
        init_hash = None
    else:
        from envloop_pipelines.core.model.checkpoint import read_recipe

        init_from = Path(init_from)
        _check_init_compatible(recipe, read_recipe(init_from), init_from)
        ckpt = load_checkpoint(init_from, trainable=True)
        model, init_hash = ckpt.model, ckpt.checkpoint_hash
        if recipe.lora.dropout != ckpt.recipe.lora.dropout or recipe.lora.alpha != ckpt.recipe.lora.alpha:
            log.info("init_from: LoRA alpha/dropout come from the checkpoint's adapter (%s), not the recipe", init_from)
    model.train()
    return model, init_hash


def _as_loaded(model: ReadoutModel, recipe: Recipe) -> ReadoutModel:
    """The trained model as :func:`load_checkpoint` will rebuild it, in eval mode.

    Usually the trained model itself. When training changed the dtype of its
    weights (DeepSpeed with bf16 casts the whole module, base included), a fresh
    fp32 base gets the trained adapter and head instead, so that the
    end-of-training predictions are exactly what the checkpoint reproduces.
    """
    if all(p.dtype == torch.float32 for p in model.parameters()):
        model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
        return model
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    adapter = {k: v.detach().float().cpu() for k, v in get_peft_model_state_dict(model.encoder).items()}
    head = {k: (v.float() if v.is_floating_point() else v) for k, v in model.head_state_dict().items()}
    device = next(model.parameters()).device
    log.info("rebuilding the trained model in fp32 on a fresh base (training left %s weights)", {str(p.dtype) for p in model.parameters()})
    fresh = build_readout_model(recipe, trainable=False)
    set_peft_model_state_dict(fresh.encoder, adapter)
    fresh.load_head_state_dict(head)
    return fresh.to(device).eval()


# --------------------------------------------------------------------------- the public entry point


def _epoch_losses(loss_log: Sequence[tuple[int, float, int]]) -> list[dict[str, float]]:
    by_epoch: dict[int, list[tuple[float, int]]] = {}
    for epoch, loss, n in loss_log:
        by_epoch.setdefault(epoch, []).append((loss, n))
    return [
        {"epoch": e + 1, "mean_loss": float(sum(l * n for l, n in rows) / sum(n for _, n in rows)), "micro_batches": len(rows)}
        for e, rows in sorted(by_epoch.items())
    ]


def _loss_quarters(loss_log: Sequence[tuple[int, float, int]]) -> list[float] | None:
    """The mean training loss over each quarter of the micro-batches, in order: whether the loss was still
    falling when training stopped (the proposer's under-training signal; the per-epoch means cannot say
    it for a run shorter than an epoch). ``None`` below four micro-batches."""
    if len(loss_log) < 4:
        return None
    quarters = np.array_split(np.arange(len(loss_log)), 4)
    return [float(sum(loss_log[i][1] * loss_log[i][2] for i in q) / sum(loss_log[i][2] for i in q)) for q in quarters]


@dataclass
class TrainerRun:
    """What one ``Trainer.train()`` left behind, read before the trainer is dropped.

    ``step_seconds`` holds each optimizer step's wall time (its ``grad_accum`` micro-batches, clipping and the
    optimizer's update); ``loss_log`` each micro-batch's ``(epoch, loss, questions)``.
    """

    model: ReadoutModel
    steps: int
    seconds: float
    loss_log: list[tuple[int, float, int]]
    step_seconds: list[float]
    main_process: bool
    world_size: int
    used_deepspeed: bool


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


def _feature_pass(model: ReadoutModel, encoded: Sequence[Encoded]) -> dict[str, Any] | None:
    """With ``frozen_layers``: run the frozen layers once per distinct training input (or find them cached).

    Done before the first step so that step times measure training alone; what it found and
    computed is recorded in ``metrics.json`` (``train.feature_pass``).
    """
    cache = getattr(model, "feature_cache", None)
    if not getattr(model, "frozen_layers", 0) or cache is None:
        return None
    before, started = cache.stats(), time.perf_counter()
    for e in encoded:
        model.lower_features(e)
    after = cache.stats()
    return {"seconds": round(time.perf_counter() - started, 3), "computed": after["misses"] - before["misses"],
            "reused_from_memory": after["hits"] - before["hits"],
            "reused_from_disk": after["disk_hits"] - before["disk_hits"]}


def _family_slots(questions: Sequence[QuestionInput]) -> dict[str, int]:
    """With ``family_head``: each training family's parameter slot (recorded in ``metrics.json``).

    Two families on one slot share their per-family parameters (the hash is fixed, so they always
    will): said in a warning, since each then reads a mix of both families' parameters.
    """
    from envloop_pipelines.core.model.decision_head import family_slot

    slots = {f: family_slot(f) for f in sorted({q.family for q in questions})}
    by_slot: dict[int, list[str]] = {}
    for family, slot in slots.items():
        by_slot.setdefault(slot, []).append(family)
    for slot, names in by_slot.items():
        if len(names) > 1:
            log.warning("family_head: families %s share parameter slot %d", names, slot)
    return slots


def _fit_lexical(recipe: Recipe, train_q: Sequence[QuestionInput], val_q: Sequence[QuestionInput],
                 val_raw: Sequence[QuestionPrediction]) -> tuple[LexicalModel, dict[str, Any]]:
    """The hybrid readout's lexical part: fitted on train, its fusion weight chosen on val (calibrated NLL)."""
    t0 = time.perf_counter()
    lexical = LexicalModel(seed=recipe.seed).fit(train_q)
    weight, tried = fit_lexical_weight([p.logits for p in val_raw], lexical.log_probs(val_q), val_q,
                                       error_budget=recipe.error_budget)
    lexical.weight = weight
    share = head_share([p.logits for p in val_raw], lexical.log_probs(val_q), weight)
    log.info("lexical readout: weight %g on val (calibrated val NLL by weight: %s); the head's share %s", weight,
             tried, "n/a" if share is None else f"{share:.2f}")
    return lexical, {"weight": weight, "val_nll_by_weight": tried, "head_share": share,
                     "seconds": time.perf_counter() - t0, "families": len(lexical.families)}


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
    train_q, val_q = as_questions(train_table), as_questions(val_table)
    eval_q = val_q if eval_table is None else as_questions(eval_table)
    if not train_q:
        raise ValueError("train: no questions to train on")
    if not val_q:
        raise ValueError("val: no questions to calibrate on")
    train_targets = _targets(train_q, "train")
    _targets(val_q, "val")

    t_start = time.perf_counter()
    with _deterministic():
        model, init_hash = build_trainable_model(recipe, init_from=init_from)
        encoded = model.encode_many(train_q)
        n_trunc = sum(e.truncated for e in encoded)
        if n_trunc:
            log.warning("train: %d of %d questions had their state truncated to max_length=%d", n_trunc, len(encoded), recipe.max_length)
        feature_pass = _feature_pass(model, encoded)
        family_slots = _family_slots(train_q) if recipe.family_head else None
        n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        n_total = sum(p.numel() for p in model.parameters())
        dataset, collator = _QuestionDataset(encoded, train_targets), _Collator(model)
        head_warmup: dict[str, Any] | None = None
        if recipe.head_warmup_epochs and init_from is not None:
            log.info("head_warmup_epochs=%d skipped: the head comes fitted from %s", recipe.head_warmup_epochs, init_from)
        elif recipe.head_warmup_epochs:
            head_warmup = _fit_head_first(model, recipe, dataset, collator)
        run = _run_trainer(model, recipe, dataset, collator)
    if not run.main_process:
        # Several processes trained together (DeepSpeed/DDP): rank 0 alone calibrates and writes. The
        # directory does not exist yet here (rank 0 renames it into place when done): callers check
        # is_main_process() before reading it.
        log.info("not the main process: leaving calibration and the checkpoint %s to rank 0", out_dir)
        return out_dir
    model = _as_loaded(run.model, recipe)

    # Calibration on val: raw logits → per-type temperature and automation threshold.
    dm = DecisionModel(model, None, batch_size=recipe.eval_batch_size, precision=recipe.inference_precision)
    val_raw = dm.predict(val_q)
    lexical, lexical_fit = _fit_lexical(recipe, train_q, val_q, val_raw) if recipe.lexical else (None, None)
    if lexical is not None:
        dm.lexical = lexical
        val_raw = [dataclasses.replace(p, logits=z) for p, z in
                   zip(val_raw, fuse([p.logits for p in val_raw], lexical.log_probs(val_q), lexical.weight or 0.0))]
    calibration = fit_calibration(
        [p.logits for p in val_raw],
        [q.label if q.label is not None else -1 for q in val_q],
        [q.type for q in val_q],
        soft_labels=[None if q.soft_label is None else np.asarray(q.soft_label) for q in val_q],
        error_budget=recipe.error_budget,
        families=[q.family for q in val_q],
        safety_families=tuple(safety_families),
        safety_fnr_target=safety_fnr_target,
    )
    dm.calibration = calibration
    val_cal = dm.recalibrate(val_raw)
    eval_preds: list[QuestionPrediction] = val_cal if eval_table is None else dm.predict(eval_q)

    epochs = _epoch_losses(run.loss_log)
    n_steps = run.steps
    metrics: dict[str, Any] = {
        "train": {
            "n_questions": len(train_q),
            "n_truncated": int(n_trunc),
            "n_state_tokens_dropped": int(sum(e.n_state_tokens_dropped for e in encoded)),
            "epochs": epochs,
            "first_epoch_loss": epochs[0]["mean_loss"] if epochs else None,
            "last_epoch_loss": epochs[-1]["mean_loss"] if epochs else None,
            "loss_quarters": _loss_quarters(run.loss_log),
            "steps": n_steps,
            "seconds": run.seconds,
            "seconds_per_step": float(np.mean(run.step_seconds)) if run.step_seconds else None,
            "questions_per_second": sum(n for _, _, n in run.loss_log) / run.seconds if run.seconds > 0 else None,
            "head_warmup": head_warmup,
            "feature_pass": feature_pass,
            "lexical": lexical_fit,
            "family_slots": family_slots,
            "trainable_parameters": int(n_trainable),
            "total_parameters": int(n_total),
        },
        "val": {
            "uncalibrated": score_predictions(val_raw, val_q, error_budget=recipe.error_budget, raw=True),
            "calibrated": score_predictions(val_cal, val_q, error_budget=recipe.error_budget),
        },
        "calibration": calibration.to_dict(),
        "eval": score_predictions(eval_preds, eval_q, error_budget=recipe.error_budget),
        "eval_split": eval_split,
        "wall_seconds": time.perf_counter() - t_start,
    }
    provenance = build_provenance(recipe, data_hash, init_from_hash=init_hash,
                                  extra={"world_size": run.world_size,
                                         "deepspeed": recipe.deepspeed if run.used_deepspeed else None})
    data = {"data_hash": data_hash, "eval_split": eval_split, "n_train": len(train_q), "n_val": len(val_q), "n_eval": len(eval_q)}
    log.info(
        "trained %s: %d steps in %.1fs, loss %.4f → %.4f; val nll %.4f → %.4f after calibration",
        recipe.readout, n_steps, run.seconds, metrics["train"]["first_epoch_loss"] or math.nan,
        metrics["train"]["last_epoch_loss"] or math.nan,
        metrics["val"]["uncalibrated"].get("nll") or math.nan, metrics["val"]["calibrated"].get("nll") or math.nan,
    )
    return write_checkpoint(
        out_dir,
        model=model,
        recipe=recipe,
        calibration=calibration,
        data=data,
        metrics=json_safe(metrics),
        provenance=provenance,
        predictions=predictions_table(eval_preds),
        lexical=lexical,
    )


__all__ = [
    "IncompatibleInitError",
    "TrainerRun",
    "build_trainable_model",
    "cpu_bf16",
    "deepspeed_config",
    "evaluate_checkpoint",
    "is_main_process",
    "train_checkpoint",
    "train_readout",
    "trainer_arguments",
]
