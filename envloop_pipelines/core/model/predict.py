"""Batch prediction with a trained readout: calibrated probabilities per option.

:class:`DecisionModel` wraps a readout model and its calibration. Each question
is its own sequence, so its answer cannot depend on the other questions asked
about the same state. Questions are sorted by length before batching (fewer pad
tokens); results come back in input order.

Padding and exactness: padding is masked out, so a question's logits change
with its batch's padding only by float rounding (matrix products of other
shapes), ~1e-7 here. Given the same inputs, batch size and thread count, the
batches and hence the results are **bit-identical**, which is what the
checkpoint's reproducibility check relies on. For bit-exactness across batch
compositions, predict with ``batch_size=1``.

Threads: ``torch.set_num_threads`` is left to the caller.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pyarrow as pa
import torch

from envloop_pipelines.core.metrics.point import DEFAULT_ERROR_BUDGET, summarize
from envloop_pipelines.core.model.calibration import Calibration, softmax
from envloop_pipelines.core.model.lexical import LexicalModel, fuse
from envloop_pipelines.core.model.readout import Encoded, QuestionInput, ReadoutModel, as_questions
from envloop_pipelines.core.model.recipe import Recipe
from envloop_pipelines.core.progress import track
from envloop_pipelines.core.data.records import Record

log = logging.getLogger(__name__)

#: Columns of ``predictions.parquet`` (and of :func:`predictions_table`).
PREDICTION_SCHEMA = pa.schema(
    [
        pa.field("record_id", pa.string(), nullable=False),
        pa.field("question_id", pa.string(), nullable=False),
        pa.field("family", pa.string(), nullable=False),
        pa.field("type", pa.string(), nullable=False),
        pa.field("option_keys", pa.list_(pa.string()), nullable=False),
        pa.field("probs", pa.list_(pa.float64()), nullable=False),
        pa.field("logits", pa.list_(pa.float32()), nullable=False),
        pa.field("truncated", pa.bool_(), nullable=False),
        pa.field("n_state_tokens_dropped", pa.int32(), nullable=False),
    ]
)


@dataclass(frozen=True)
class QuestionPrediction:
    """The model's answer to one question.

    Attributes:
        record_id, question_id, family, type: Which question.
        option_keys: The options, in the question's order.
        probs: Calibrated probabilities (float64, sums to 1), one per option.
        logits: Raw logits (float32), one per option.
        truncated: Whether the state was cut to fit ``max_length``.
        n_state_tokens_dropped: How many state tokens were cut.
    """

    record_id: str
    question_id: str
    family: str
    type: str
    option_keys: tuple[str, ...]
    probs: np.ndarray
    logits: np.ndarray
    truncated: bool
    n_state_tokens_dropped: int

    @property
    def answer(self) -> str:
        """The most probable option's key (the first on an exact tie)."""
        return self.option_keys[int(np.argmax(self.probs))]

    @property
    def confidence(self) -> float:
        """The most probable option's probability."""
        return float(np.max(self.probs))

    def probabilities(self) -> dict[str, float]:
        """Probabilities keyed by option."""
        return {k: float(p) for k, p in zip(self.option_keys, self.probs)}


class DecisionModel:
    """A readout model with its calibration: ``predict(questions) → calibrated probabilities``.

    With a lexical part (the hybrid readout, recipe key ``lexical``) the logits are
    ``z_head + w · log p_lexical`` (:func:`~envloop_pipelines.core.model.lexical.fuse`) before the
    calibration; ``predictions.parquet``, the verifier and ``envloop serve`` all read these fused logits.
    """

    def __init__(self, model: ReadoutModel, calibration: Calibration | None = None, *, batch_size: int = 32,
                 lexical: LexicalModel | None = None, precision: str = "fp32") -> None:
        """Wrap an in-memory readout (put in eval mode); ``calibration=None`` means temperature 1.

        ``precision``: the numeric format of the forward passes (the recipe's ``inference_precision``):
        ``bf16`` runs them under bf16 autocast, so matrix products take the CPU's bf16 units.
        """
        if precision not in ("fp32", "bf16"):
            raise ValueError(f"precision must be fp32 or bf16, got {precision!r}")
        self.model = model.eval()
        self.calibration = calibration if calibration is not None else Calibration()
        self.batch_size = batch_size
        self.lexical = lexical
        self.precision = precision
        self.recipe: Recipe | None = None
        self.checkpoint_hash: str | None = None

    @classmethod
    def load(cls, ckpt_dir: str | Path, *, batch_size: int | None = None, device: str | torch.device | None = None) -> "DecisionModel":
        """Load a checkpoint (manifest verified first) for prediction, in its recipe's inference precision."""
        from envloop_pipelines.core.model.checkpoint import load_checkpoint

        return cls.from_checkpoint(load_checkpoint(ckpt_dir), batch_size=batch_size, device=device)

    @classmethod
    def from_checkpoint(cls, ckpt: Any, *, batch_size: int | None = None,
                        device: str | torch.device | None = None) -> "DecisionModel":
        """A loaded checkpoint (``checkpoint.LoadedCheckpoint``) for prediction: its calibration, lexical
        part and inference precision."""
        model = ckpt.model
        if device is not None:
            model = model.to(device)
        dm = cls(model, ckpt.calibration, batch_size=batch_size or ckpt.recipe.eval_batch_size, lexical=ckpt.lexical,
                 precision=ckpt.recipe.inference_precision)
        dm.recipe = ckpt.recipe
        dm.checkpoint_hash = ckpt.checkpoint_hash
        return dm

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # ------------------------------------------------------------------ raw

    def _run(self, questions: Sequence[QuestionInput], batch_size: int | None) -> tuple[list[np.ndarray], list[Encoded]]:
        """Logits per question (input order) and the encodings."""
        bs = batch_size or self.batch_size
        encoded = self.model.encode_many(questions)
        # Stable sort by length: same inputs → same batches → same numbers.
        order = sorted(range(len(encoded)), key=lambda i: (len(encoded[i]), i))
        out: list[np.ndarray | None] = [None] * len(encoded)
        device = self.device
        was_training = self.model.training
        self.model.eval()
        autocast = torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=self.precision == "bf16")
        try:
            with torch.inference_mode(), autocast:
                for start in track(range(0, len(order), bs), "predict", unit="q", total=len(order),
                                   weight=lambda s: min(bs, len(order) - s)):
                    idx = order[start : start + bs]
                    batch = self.model.collate([encoded[i] for i in idx])
                    batch = {k: v.to(device) for k, v in batch.items()}
                    logits = self.model(**batch).float().cpu().numpy()
                    for row, i in enumerate(idx):
                        out[i] = logits[row, : encoded[i].n_options].copy()
        finally:
            self.model.train(was_training)
        if self.lexical is not None and self.lexical.weight:
            out = fuse(out, self.lexical.log_probs(questions), self.lexical.weight)  # type: ignore[arg-type]
        return out, encoded  # type: ignore[return-value]

    def predict_logits(
        self, data: pa.Table | Sequence[Record] | Sequence[QuestionInput], *, batch_size: int | None = None
    ) -> list[np.ndarray]:
        """Raw (uncalibrated) logits per question, float32, in input order."""
        logits, _ = self._run(as_questions(data), batch_size)
        return logits

    # ------------------------------------------------------------------ calibrated

    def predict(
        self, data: pa.Table | Sequence[Record] | Sequence[QuestionInput], *, batch_size: int | None = None
    ) -> list[QuestionPrediction]:
        """Calibrated probabilities per question, in input order.

        Args:
            data: A question table (``QUESTION_SCHEMA`` or ``INPUT_SCHEMA``), records, or questions.
            batch_size: Questions per forward pass (default: the model's).
        """
        questions = as_questions(data)
        logits, encoded = self._run(questions, batch_size)
        return [self._prediction(q, z, e) for q, z, e in zip(questions, logits, encoded)]

    def _prediction(self, q: QuestionInput, z: np.ndarray, e: Encoded) -> QuestionPrediction:
        return QuestionPrediction(
            record_id=q.record_id,
            question_id=q.question_id,
            family=q.family,
            type=q.type,
            option_keys=q.option_keys,
            probs=self.calibration.apply(z, q.type),
            logits=z,
            truncated=e.truncated,
            n_state_tokens_dropped=e.n_state_tokens_dropped,
        )

    def recalibrate(self, predictions: Sequence[QuestionPrediction]) -> list[QuestionPrediction]:
        """The same predictions with ``probs`` recomputed from their logits under this model's calibration."""
        return [dataclasses.replace(p, probs=self.calibration.apply(p.logits, p.type)) for p in predictions]

    def automate(self, prediction: QuestionPrediction) -> bool:
        """Whether the calibrated confidence clears the automation threshold fitted on val."""
        return self.calibration.automate(prediction.probs)


# --------------------------------------------------------------------------- tables and metrics


def predictions_table(predictions: Sequence[QuestionPrediction]) -> pa.Table:
    """Predictions as a :data:`PREDICTION_SCHEMA` table (what ``predictions.parquet`` holds)."""
    return pa.table(
        {
            "record_id": [p.record_id for p in predictions],
            "question_id": [p.question_id for p in predictions],
            "family": [p.family for p in predictions],
            "type": [p.type for p in predictions],
            "option_keys": [list(p.option_keys) for p in predictions],
            "probs": [np.asarray(p.probs, dtype=np.float64).tolist() for p in predictions],
            "logits": [np.asarray(p.logits, dtype=np.float32).tolist() for p in predictions],
            "truncated": [bool(p.truncated) for p in predictions],
            "n_state_tokens_dropped": [int(p.n_state_tokens_dropped) for p in predictions],
        },
        schema=PREDICTION_SCHEMA,
    )


def predictions_from_table(table: pa.Table) -> list[QuestionPrediction]:
    """Inverse of :func:`predictions_table` (float64 probs, float32 logits: bit-exact)."""
    cols = {name: table.column(name).to_pylist() for name in PREDICTION_SCHEMA.names}
    return [
        QuestionPrediction(
            record_id=cols["record_id"][i],
            question_id=cols["question_id"][i],
            family=cols["family"][i],
            type=cols["type"][i],
            option_keys=tuple(cols["option_keys"][i]),
            probs=np.asarray(cols["probs"][i], dtype=np.float64),
            logits=np.asarray(cols["logits"][i], dtype=np.float32),
            truncated=cols["truncated"][i],
            n_state_tokens_dropped=cols["n_state_tokens_dropped"][i],
        )
        for i in range(table.num_rows)
    ]


def json_safe(value: Any) -> Any:
    """JSON-safe: nan/inf → None, numpy scalars → Python."""
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, (np.floating, float)):
        v = float(value)
        return v if math.isfinite(v) else None
    if isinstance(value, np.integer):
        return int(value)
    return value


def labelled(questions: Sequence[QuestionInput]) -> list[int]:
    """Indices of the questions with a label or a soft label."""
    return [i for i, q in enumerate(questions) if q.label is not None or q.soft_label is not None]


def score_predictions(
    predictions: Sequence[QuestionPrediction],
    questions: Sequence[QuestionInput],
    *,
    error_budget: float = DEFAULT_ERROR_BUDGET,
    safety_families: Sequence[str] = (),
    raw: bool = False,
) -> dict[str, Any]:
    """``summarize`` over the labelled questions, plus truncation counts (JSON-safe).

    Args:
        raw: Score ``softmax(logits)`` (temperature 1) instead of the calibrated probabilities.
    """
    idx = labelled(questions)
    out: dict[str, Any] = {}
    if idx:
        probs = [softmax(predictions[i].logits) if raw else predictions[i].probs for i in idx]
        out.update(
            summarize(
                probs,
                [questions[i].label if questions[i].label is not None else -1 for i in idx],
                [questions[i].family for i in idx],
                soft_labels=[None if questions[i].soft_label is None else np.asarray(questions[i].soft_label) for i in idx],
                qtypes=[questions[i].type for i in idx],
                safety_families=safety_families,
                error_budget=error_budget,
            )
        )
    out["n_predicted"] = len(predictions)
    out["n_unlabelled"] = len(predictions) - len(idx)
    out["n_truncated"] = sum(1 for p in predictions if p.truncated)
    out["n_state_tokens_dropped"] = sum(int(p.n_state_tokens_dropped) for p in predictions)
    return json_safe(out)


def evaluate_checkpoint(
    ckpt_dir: str | Path,
    table: pa.Table | Sequence[Record] | Sequence[QuestionInput],
    *,
    safety_families: Sequence[str] = (),
    batch_size: int | None = None,
    device: str | torch.device | None = None,
) -> dict[str, Any]:
    """Load a checkpoint (verified), predict ``table``, and summarise the metrics.

    Args:
        ckpt_dir: The checkpoint directory.
        table: The questions to score (labels needed for the metrics).
        safety_families: Families whose false-negative rate is reported (``fnr/<family>``).
        batch_size: Prediction batch (default: the recipe's ``eval_batch_size``).
        device: Where to run (default CPU); predictions are bit-identical to the
            checkpoint's own only on the device kind it was trained on.

    Returns:
        ``summarize`` keys on the calibrated probabilities, the automated
        share at the checkpoint's threshold, truncation counts, and the
        checkpoint's identity (``checkpoint_hash``, ``recipe_hash``, ``data_hash``).
    """
    from envloop_pipelines.core.model.checkpoint import load_checkpoint

    ckpt = load_checkpoint(ckpt_dir)
    dm = DecisionModel.from_checkpoint(ckpt, batch_size=batch_size, device=device)
    questions = as_questions(table)
    preds = dm.predict(questions)
    out = score_predictions(
        preds, questions, error_budget=ckpt.calibration.error_budget, safety_families=safety_families
    )
    automated = [dm.automate(p) for p in preds]
    out["automated_share"] = float(np.mean(automated)) if automated else None
    out["automation_threshold"] = json_safe(ckpt.calibration.automation_threshold)
    out["checkpoint"] = str(ckpt.path)
    out["checkpoint_hash"] = ckpt.checkpoint_hash
    out["recipe_hash"] = ckpt.provenance.get("recipe_hash")
    out["data_hash"] = ckpt.provenance.get("data_hash")
    return out


def predict_table(checkpoint: str | Path, table: pa.Table, *, cache_dir: str | Path | None = None) -> pa.Table:
    """A checkpoint's calibrated predictions on a question table (only the inputs are read, never labels).

    With ``cache_dir`` the predictions are computed once per (checkpoint identity, inputs) and reused:
    see :func:`prediction_cache_key`. A champion is then not re-scored every round on a test split it
    has already answered; a changed checkpoint, question or prediction code misses.
    """
    from envloop_pipelines.core.model.readout import questions_from_table

    path: Path | None = None
    if cache_dir is not None:
        from envloop_pipelines.core.model.checkpoint import verify_checkpoint

        verify_checkpoint(checkpoint)  # the identity the key names is the one on disk
        path = Path(cache_dir) / f"{prediction_cache_key(checkpoint, table)}.parquet"
        if path.is_file():
            import pyarrow.parquet as pq

            log.info("predictions of %s on %d questions reused from %s", checkpoint, table.num_rows, path)
            return pq.read_table(path).cast(PREDICTION_SCHEMA)
    out = predictions_table(DecisionModel.load(checkpoint).predict(questions_from_table(table)))
    if path is not None:
        from envloop_pipelines.core.storage import atomic_write_parquet

        atomic_write_parquet(path, out, overwrite=True)
    return out


#: Bumped whenever prediction code changes what a checkpoint answers (reused predictions then miss).
PREDICTION_CODE_VERSION = "1"
#: The columns a prediction reads (labels never take part in the key or the prediction).
PREDICTION_INPUT_COLUMNS = ("record_id", "question_id", "family", "type", "state_text", "instructions_text",
                            "option_keys", "option_texts")


def prediction_cache_key(checkpoint: str | Path, table: pa.Table) -> str:
    """sha256 of the checkpoint's identity, the inputs' canonical JSON, the prediction code and torch versions."""
    from envloop_pipelines.core.model.checkpoint import checkpoint_hash
    from envloop_pipelines.core.storage import canonical_json, sha256_bytes

    cols = [c for c in PREDICTION_INPUT_COLUMNS if c in table.column_names]
    inputs = sha256_bytes(canonical_json(table.select(cols).to_pylist()))
    return sha256_bytes(canonical_json({"checkpoint": checkpoint_hash(checkpoint), "inputs": inputs,
                                        "code": PREDICTION_CODE_VERSION, "torch": torch.__version__}))


def score_table(table: pa.Table, predictions: pa.Table, safety_families: Sequence[str] = ()) -> dict[str, Any]:
    """Metrics of ``predictions`` on an open split's question table (train/val/dev: the caller holds the labels)."""
    from envloop_pipelines.core.model.readout import questions_from_table

    return score_predictions(predictions_from_table(predictions), questions_from_table(table),
                             safety_families=safety_families)


def rescore_matches(checkpoint: str | Path, table: pa.Table) -> dict[str, Any]:
    """Re-score a checkpoint from disk on its own eval questions and compare with its end-of-training predictions.

    Returns:
        ``identical`` (bit-for-bit), ``n_questions`` and ``max_abs_diff`` over the saved predictions.
    """
    import pyarrow.parquet as pq

    saved = pq.read_table(Path(checkpoint) / "predictions.parquet").to_pylist()
    wanted = {(r["record_id"], r["question_id"]) for r in saved}
    rows = [i for i, key in enumerate(zip(table.column("record_id").to_pylist(), table.column("question_id").to_pylist()))
            if key in wanted]
    fresh = {(p["record_id"], p["question_id"]): p["probs"]
             for p in predict_table(checkpoint, table.take(pa.array(rows, pa.int64()))).to_pylist()}
    diffs = [float(np.max(np.abs(np.asarray(fresh[(r["record_id"], r["question_id"])]) - np.asarray(r["probs"]))))
             if (r["record_id"], r["question_id"]) in fresh else float("inf") for r in saved]
    identical = all(fresh.get((r["record_id"], r["question_id"])) == r["probs"] for r in saved)
    return {"identical": identical, "n_questions": len(saved), "max_abs_diff": max(diffs) if diffs else 0.0}


__all__ = [
    "DecisionModel",
    "PREDICTION_SCHEMA",
    "QuestionPrediction",
    "evaluate_checkpoint",
    "json_safe",
    "predictions_from_table",
    "predict_table",
    "predictions_table",
    "rescore_matches",
    "score_predictions",
    "score_table",
]
