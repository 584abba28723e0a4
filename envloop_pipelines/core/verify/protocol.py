"""The verifier protocol: a predictions file in, per-item scores and an aggregate report out.

Predictions file (what the model side writes)
    One row per question, as Parquet (``*.parquet``) or JSON Lines (``*.jsonl``)::

        record_id     string         the record's id
        question_id   string         the question's id within the record
        option_keys   list<string>   the question's options, in any order
        probs         list<double>   one probability per entry of option_keys

    Example JSONL line::

        {"record_id": "tickets/1", "question_id": "queue",
         "option_keys": ["billing", "shipping", "account"], "probs": [0.7, 0.2, 0.1]}

    Extra columns are ignored except ``answer`` (a free-text answer, read by
    the model grader). :func:`write_predictions` writes this format.

Scoring rules every verifier follows
    * The prediction rows are joined with the hidden labels on
      ``(record_id, question_id)``.
    * A question with no prediction is an item with status ``missing``: it
      counts as a failure (score 0, and wrong in ``accuracy_all``) and in the
      report's ``n_missing``; it is never left out or scored silently.
    * A row that fails validation (probabilities not finite, negative, not
      summing to 1 within 1e-4, keys not exactly the question's options, a
      duplicate row) makes the item ``invalid`` with the reason in ``error``;
      it counts as a failure too, in ``n_invalid``.
    * Rows whose ids match no question are ``extra``: counted and listed,
      never scored.
    * A file that cannot be read at all makes every item ``missing`` and sets
      ``file_error``.

The verifier never imports the model; the model side never imports this
package: predictions reach the verifier as a file, labels only through
:mod:`envloop_pipelines.core.verify.labels` in the parent process.
"""

from __future__ import annotations

import io
import json
import math
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Iterable, Literal, Mapping, Protocol, Sequence, runtime_checkable

import pyarrow as pa
import pyarrow.parquet as pq

from envloop_pipelines.core.storage import atomic_write_parquet, canonical_json, parquet_bytes, sha256_bytes

PREDICTION_SCHEMA = pa.schema(
    [
        pa.field("record_id", pa.string(), nullable=False),
        pa.field("question_id", pa.string(), nullable=False),
        pa.field("option_keys", pa.list_(pa.string()), nullable=False),
        pa.field("probs", pa.list_(pa.float64()), nullable=False),
    ]
)
PREDICTION_COLUMNS: tuple[str, ...] = tuple(PREDICTION_SCHEMA.names)
PREDICTION_FORMATS: tuple[str, ...] = ("parquet", "jsonl")
#: Probabilities must sum to 1 within this (the same tolerance as ``core.metrics.batch``).
PROB_SUM_TOLERANCE = 1e-4
#: The report lists at most this many extra ids (the count is always complete).
MAX_LISTED_EXTRA = 50
ItemStatus = Literal["scored", "missing", "invalid"]
ITEM_STATUSES: tuple[str, ...] = ("scored", "missing", "invalid")
VERIFIER_KINDS: tuple[str, ...] = ("rule", "grader", "terminal")


class PredictionFileError(ValueError):
    """The predictions file cannot be read as a whole (format, missing columns)."""


# --------------------------------------------------------------------------- predictions files


def prediction_format(path: str | Path) -> str:
    """``parquet`` or ``jsonl`` from the file name."""
    suffix = Path(path).suffix.lower().lstrip(".")
    fmt = {"parquet": "parquet", "pq": "parquet", "jsonl": "jsonl", "ndjson": "jsonl"}.get(suffix)
    if fmt is None:
        raise PredictionFileError(f"{path}: predictions must be .parquet or .jsonl, got {suffix!r}")
    return fmt


def write_predictions(path: str | Path, rows: Iterable[Mapping[str, Any]]) -> Path:
    """Write prediction rows (dicts with :data:`PREDICTION_COLUMNS`) as Parquet or JSONL by suffix."""
    path = Path(path)
    fmt = prediction_format(path)
    rows = [{k: row[k] for k in PREDICTION_COLUMNS} | ({"answer": row["answer"]} if "answer" in row else {}) for row in rows]
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    else:
        schema = PREDICTION_SCHEMA
        if rows and any("answer" in r for r in rows):
            schema = schema.append(pa.field("answer", pa.string()))
        atomic_write_parquet(path, pa.Table.from_pylist(rows, schema=schema), overwrite=True)
    return path


def parse_predictions(data: bytes, fmt: str) -> list[dict[str, Any]]:
    """Prediction rows from file bytes; row-level problems are left for the verifier to report per item.

    Raises:
        PredictionFileError: when the file cannot be read at all or lacks a required column.
    """
    if fmt not in PREDICTION_FORMATS:
        raise PredictionFileError(f"unknown predictions format {fmt!r}; allowed: {', '.join(PREDICTION_FORMATS)}")
    if fmt == "parquet":
        try:
            table = pq.read_table(io.BytesIO(data))
        except Exception as exc:  # pyarrow raises several types for a bad file
            raise PredictionFileError(f"not a readable Parquet file: {exc}") from None
        missing = [c for c in ("record_id", "question_id", "option_keys", "probs") if c not in table.column_names]
        if missing:
            raise PredictionFileError(f"missing column(s) {missing}; required: {', '.join(PREDICTION_COLUMNS)}")
        keep = [c for c in (*PREDICTION_COLUMNS, "answer") if c in table.column_names]
        rows = table.select(keep).to_pylist()
        for i, row in enumerate(rows):
            row["_row"] = i
        return rows
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PredictionFileError(f"not UTF-8 at byte {exc.start}") from None
    rows = []
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            row = {"_error": f"invalid JSON: {exc.msg} at column {exc.colno}"}
        if not isinstance(row, dict):
            row = {"_error": f"a row must be a JSON object, got {type(row).__name__}"}
        row["_row"] = number
        rows.append(row)
    return rows


# --------------------------------------------------------------------------- results


def _clean(value: Any) -> Any:
    """JSON-safe: NaN/inf become None (a metric with nothing to measure), tuples become lists."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


@dataclass(frozen=True)
class ItemScore:
    """One question's score.

    Attributes:
        status: ``scored``, ``missing`` (no prediction) or ``invalid`` (see ``error``).
        score: the item's score in [0, 1]: 1/0 for a hard label, the soft label's mass on the
            chosen option for a soft label, the grader's score for a graded item; 0 for a failure.
        correct: the chosen option is the label (None for a soft-labelled item);
            False for a failure on a hard-labelled item.
        predicted: the chosen option key (argmax; the first on a tie), None for a failure.
        brier: summed over options, against the soft label when there is one; None for a failure.
        nll: ``-sum_k y_k log p_k`` (p clipped at 1e-12); None for a failure.
        error: why the item is ``invalid`` (or ``missing``).
    """

    record_id: str
    question_id: str
    family: str
    type: str
    status: ItemStatus
    score: float
    correct: bool | None = None
    predicted: str | None = None
    brier: float | None = None
    nll: float | None = None
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return _clean(asdict(self))


@dataclass(frozen=True)
class VerifierReport:
    """Per-item scores and the aggregate of one verifier run.

    Attributes:
        kind: the verifier kind (``rule``, ``grader``).
        n_items: questions in the labels (every one gets an item).
        n_scored / n_missing / n_invalid: items by status; they add up to ``n_items``.
        n_extra: prediction rows whose ids match no question; ``extra_ids`` lists the first ones.
        complete: every item was scored and no row was extra.
        metrics: the aggregate over scored items (``core.metrics.point.summarize`` for the rule kind).
        accuracy_all: correct over all hard-labelled items, failures counted as wrong.
        mean_score: mean item score over all items, failures counted as 0.
        file_error: why the whole predictions file could not be read, else None.
        items: one :class:`ItemScore` per question, in label order; empty in the report of a
            hidden split (:meth:`without_items`).
        provenance: hashes of the predictions and labels, the verifier and its version.
    """

    kind: str
    n_items: int
    n_scored: int
    n_missing: int
    n_invalid: int
    n_extra: int
    complete: bool
    metrics: Mapping[str, Any]
    accuracy_all: float | None
    mean_score: float | None
    items: tuple[ItemScore, ...]
    extra_ids: tuple[tuple[str, str], ...] = ()
    file_error: str | None = None
    provenance: Mapping[str, Any] = field(default_factory=dict)

    def aggregate(self) -> dict[str, Any]:
        """Everything but the items."""
        out = self.to_dict()
        out.pop("items")
        return out

    def without_items(self) -> "VerifierReport":
        """The report a hidden split answers with: counts and aggregate scores, no item and no extra id.

        Neither per-item correctness nor which of the caller's ids matched no question leaves the
        verifier (``n_extra`` still counts them).
        """
        return replace(self, items=(), extra_ids=())

    def to_dict(self) -> dict[str, Any]:
        return _clean(
            {
                "kind": self.kind,
                "n_items": self.n_items,
                "n_scored": self.n_scored,
                "n_missing": self.n_missing,
                "n_invalid": self.n_invalid,
                "n_extra": self.n_extra,
                "complete": self.complete,
                "metrics": dict(self.metrics),
                "accuracy_all": self.accuracy_all,
                "mean_score": self.mean_score,
                "extra_ids": [list(x) for x in self.extra_ids],
                "file_error": self.file_error,
                "provenance": dict(self.provenance),
                "items": [i.to_dict() for i in self.items],
            }
        )

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "VerifierReport":
        item_fields = {f.name for f in fields(ItemScore)}
        return cls(
            kind=raw["kind"], n_items=raw["n_items"], n_scored=raw["n_scored"], n_missing=raw["n_missing"],
            n_invalid=raw["n_invalid"], n_extra=raw["n_extra"], complete=raw["complete"],
            metrics=dict(raw["metrics"]), accuracy_all=raw["accuracy_all"], mean_score=raw["mean_score"],
            items=tuple(ItemScore(**{k: v for k, v in i.items() if k in item_fields}) for i in raw.get("items", ())),
            extra_ids=tuple(tuple(x) for x in raw.get("extra_ids", ())),  # type: ignore[misc]
            file_error=raw.get("file_error"), provenance=dict(raw.get("provenance", {})),
        )

    def fingerprint(self) -> str:
        """sha256 of the canonical report: the same verdict on the same inputs gives the same hash."""
        return sha256_bytes(canonical_json(self.to_dict()))


@runtime_checkable
class Verifier(Protocol):
    """Scores prediction rows against labels. Implementations never import the model."""

    kind: str

    def score(
        self, rows: Sequence[Mapping[str, Any]], labels: pa.Table, *, provenance: Mapping[str, Any] | None = None
    ) -> VerifierReport:
        """Per-item scores and the aggregate.

        Args:
            rows: prediction rows from :func:`parse_predictions`.
            labels: the label table (:data:`~envloop_pipelines.core.data.snapshots.HIDDEN_LABEL_COLUMNS`).
            provenance: what to record about the inputs (hashes), merged into the report's.
        """
        ...


# --------------------------------------------------------------------------- hidden-split aggregates

#: Aggregates that count questions (a share of them): rounded to the count's own resolution.
COUNT_METRICS: frozenset[str] = frozenset({"family_macro_accuracy", "accuracy", "accuracy_all", "n_questions",
                                           "coverage_at_error_budget", "false_negative_rate"})
COUNT_METRIC_PREFIXES: tuple[str, ...] = ("acc/", "fnr/", "fnr_automated/", "defer_rate/", "coverage_at_")


def hidden_split_decimals(n_items: int) -> tuple[int, int]:
    """The decimals a hidden split's aggregates keep, from its number of questions ``n``: ``(count, score)``.

    * A count metric (accuracy, a family's accuracy, an FNR, a coverage, a defer rate: a share of
      questions) keeps ``ceil(log10 n)`` decimals, a step no larger than ``1/n``: the count itself,
      nothing finer (nothing finer exists).
    * Every other aggregate (nll, brier, ece, aurc, a grader's mean score) is a probability-weighted
      mean whose weights the caller chooses; it keeps ``ceil(log10 sqrt n)`` decimals, a step of at
      most ``1/sqrt n``, below the standard error of a mean of ``n`` items, so no CI can resolve a
      finer difference, and items weighted by a caller's chosen probabilities (the attack that read
      12 labels from one full-precision nll) fall below the step together.

    n = 314: 3 and 2 decimals (steps 0.001 and 0.01).
    """
    n = max(1, int(n_items))
    if n == 1:
        return 0, 0
    return math.ceil(math.log10(n)), math.ceil(math.log10(n) / 2)


def _is_count(name: str) -> bool:
    return name in COUNT_METRICS or name.startswith(COUNT_METRIC_PREFIXES)


def _round_value(value: Any, decimals: int) -> Any:
    if isinstance(value, float) and math.isfinite(value):
        return round(value, decimals)
    return value


def round_hidden_metrics(values: Mapping[str, Any], n_items: int) -> dict[str, Any]:
    """A hidden split's aggregate metrics rounded by :func:`hidden_split_decimals` (count or score metric by name)."""
    count, score = hidden_split_decimals(n_items)
    return {k: _round_value(v, count if _is_count(k) else score) for k, v in values.items()}


def round_hidden_report(report: "VerifierReport") -> "VerifierReport":
    """The aggregate-only report with every aggregate rounded (:func:`hidden_split_decimals`)."""
    count, score = hidden_split_decimals(report.n_items)
    return replace(report, metrics=round_hidden_metrics(report.metrics, report.n_items),
                   accuracy_all=_round_value(report.accuracy_all, count),
                   mean_score=_round_value(report.mean_score, score))


def round_hidden_paired(paired: Mapping[str, Any], n_items: int) -> dict[str, Any]:
    """Paired deltas (``compare.paired_comparison``) rounded like their metric: delta, CI ends and se."""
    count, score = hidden_split_decimals(n_items)

    def one(metric: str, d: Any) -> Any:
        if not isinstance(d, Mapping):
            return d
        decimals = count if _is_count(metric) else score
        return {k: _round_value(v, decimals) if k in ("delta", "ci_low", "ci_high", "se") else v for k, v in d.items()}

    out = dict(paired)
    out["deltas"] = {m: one(m, d) for m, d in (paired.get("deltas") or {}).items()}
    out["families"] = {f: one("accuracy", d) for f, d in (paired.get("families") or {}).items()}
    out["safety"] = {f: one("false_negative_rate", d) for f, d in (paired.get("safety") or {}).items()}
    return out


def labels_to_bytes(labels: pa.Table) -> bytes:
    """Parquet bytes of a label table, the form the worker receives on its stdin.

    The project's one encoding, :func:`~envloop_pipelines.core.storage.parquet_bytes`.
    """
    return parquet_bytes(labels)


def labels_from_bytes(data: bytes) -> pa.Table:
    return pq.read_table(io.BytesIO(data))


def score_file(verifier: Verifier, predictions: bytes, fmt: str, labels: pa.Table, *, labels_sha256: str | None = None) -> VerifierReport:
    """Parse a predictions file and score it; an unreadable file is a report, not an exception."""
    provenance = {"predictions_sha256": sha256_bytes(predictions), "predictions_format": fmt}
    if labels_sha256:
        provenance["labels_sha256"] = labels_sha256
    try:
        rows = parse_predictions(predictions, fmt)
        file_error = None
    except PredictionFileError as exc:
        rows, file_error = [], str(exc)
    report = verifier.score(rows, labels, provenance=provenance)
    if file_error is None:
        return report
    items = tuple(
        ItemScore(i.record_id, i.question_id, i.family, i.type, "missing", 0.0,
                  correct=None if i.correct is None else False, error=f"predictions file unreadable: {file_error}")
        for i in report.items
    )
    return VerifierReport(
        kind=report.kind, n_items=report.n_items, n_scored=0, n_missing=report.n_items, n_invalid=0, n_extra=0,
        complete=False, metrics={}, accuracy_all=report.accuracy_all, mean_score=report.mean_score, items=items,
        file_error=file_error, provenance=report.provenance,
    )


__all__ = [
    "COUNT_METRICS",
    "COUNT_METRIC_PREFIXES",
    "ITEM_STATUSES",
    "ItemScore",
    "PREDICTION_COLUMNS",
    "PREDICTION_FORMATS",
    "PREDICTION_SCHEMA",
    "PROB_SUM_TOLERANCE",
    "PredictionFileError",
    "VERIFIER_KINDS",
    "Verifier",
    "VerifierReport",
    "labels_from_bytes",
    "labels_to_bytes",
    "parse_predictions",
    "prediction_format",
    "hidden_split_decimals",
    "round_hidden_metrics",
    "round_hidden_paired",
    "round_hidden_report",
    "score_file",
    "write_predictions",
]
