"""CSV and Parquet decision data through a column mapping.

A mapping says which column holds the state, the group and the record id, and
for each question its type, text, options and label column. Every row becomes
a record in the JSONL shape and goes through the same validation as JSONL, so
an error names the file, the row and the field (the column it came from).

Example mapping (YAML or JSON)::

    id: ticket_id                # optional; default: the row number
    state: body                  # one column, or a list of columns → an object state
    group: customer_id           # the group (user) key for splitting
    family_column: null          # optional column overriding the family of every question
    questions:
      queue:
        type: choice
        instructions: Which queue handles this ticket?
        options: [billing, shipping, account]   # or options_column: a column with a JSON list/object
        label: queue_label                      # the label column
      refund: {type: noul, instructions: Does the customer ask for a refund?, label: refund}
      priority: {type: score, instructions: How urgent is it?, options: [low, normal, high], label: prio}
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import pyarrow as pa

from envloop_pipelines.core.data.errors import DataValidationError, FieldError
from envloop_pipelines.core.data.records import (
    DEFAULT_GROUP_KEY,
    DEFAULT_TOKEN_BUDGET,
    QUESTION_TYPES,
    LoadReport,
    records_from_objects,
)

_TRUE = {"true", "1", "yes", "y", "t"}
_FALSE = {"false", "0", "no", "n", "f"}


@dataclass(frozen=True)
class QuestionColumns:
    """How one question is read from a row."""

    type: str
    instructions: str
    label: str
    options: tuple[Any, ...] | Mapping[str, Any] | None = None
    options_column: str | None = None
    soft_label_column: str | None = None


@dataclass(frozen=True)
class ColumnMapping:
    """Columns → decision records (see the module docstring for the format)."""

    state: str | tuple[str, ...]
    questions: Mapping[str, QuestionColumns]
    id: str | None = None
    group: str | None = None
    meta_columns: tuple[str, ...] = field(default_factory=tuple)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], source: str = "<mapping>") -> "ColumnMapping":
        """Build and validate a mapping; errors name the mapping field."""
        errors: list[FieldError] = []

        def err(fld: str, msg: str) -> None:
            errors.append(FieldError(source, None, fld, msg))

        allowed = {"id", "state", "group", "questions", "meta_columns"}
        for key in raw:
            if key not in allowed:
                err(key, f"unknown mapping key; allowed: {', '.join(sorted(allowed))}")
        state = raw.get("state")
        if isinstance(state, list) and state and all(isinstance(s, str) for s in state):
            state = tuple(state)
        elif not isinstance(state, str):
            err("state", "must name a column or a list of columns")
        questions: dict[str, QuestionColumns] = {}
        qraw = raw.get("questions")
        if not isinstance(qraw, dict) or not qraw:
            err("questions", "must map question id → {type, instructions, label, options|options_column}")
            qraw = {}
        q_allowed = {"type", "instructions", "label", "options", "options_column", "soft_label_column"}
        for qid, spec in qraw.items():
            prefix = f"questions.{qid}"
            if not isinstance(spec, dict):
                err(prefix, "must be an object")
                continue
            for key in spec:
                if key not in q_allowed:
                    err(f"{prefix}.{key}", f"unknown key; allowed: {', '.join(sorted(q_allowed))}")
            if spec.get("type") not in QUESTION_TYPES:
                err(f"{prefix}.type", f"must be one of {', '.join(QUESTION_TYPES)}, got {spec.get('type')!r}")
                continue
            if not isinstance(spec.get("instructions"), str):
                err(f"{prefix}.instructions", "must be a string")
            if not isinstance(spec.get("label"), str):
                err(f"{prefix}.label", "must name the label column")
            if spec["type"] != "noul" and spec.get("options") is None and spec.get("options_column") is None:
                err(f"{prefix}.options", "choice and score questions need options or options_column")
            options = spec.get("options")
            questions[qid] = QuestionColumns(
                type=spec["type"],
                instructions=str(spec.get("instructions")),
                label=str(spec.get("label")),
                options=tuple(options) if isinstance(options, list) else options,
                options_column=spec.get("options_column"),
                soft_label_column=spec.get("soft_label_column"),
            )
        if errors:
            raise DataValidationError(errors)
        return cls(
            state=state,  # type: ignore[arg-type]
            questions=questions,
            id=raw.get("id"),
            group=raw.get("group"),
            meta_columns=tuple(raw.get("meta_columns") or ()),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> "ColumnMapping":
        import yaml

        text = Path(path).read_text(encoding="utf-8")
        try:
            raw = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise DataValidationError([FieldError(str(path), None, "<yaml>", f"invalid YAML: {exc}")]) from None
        if not isinstance(raw, dict):
            raise DataValidationError([FieldError(str(path), None, "<mapping>", "must be a YAML/JSON object")])
        return cls.from_dict(raw, source=str(path))

    def columns(self) -> list[str]:
        """Every column the mapping reads."""
        cols = list(self.state) if isinstance(self.state, tuple) else [self.state]
        cols += [c for c in (self.id, self.group) if c]
        for q in self.questions.values():
            cols += [c for c in (q.label, q.options_column, q.soft_label_column) if c]
        return cols + list(self.meta_columns)


def _is_missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _coerce_label(qtype: str, value: Any) -> Any:
    """CSV cells are strings: turn them into the label shape of the record format."""
    if qtype == "noul" and isinstance(value, str):
        low = value.strip().lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        return value
    if qtype == "noul" and isinstance(value, (int,)) and not isinstance(value, bool) and value in (0, 1):
        return bool(value)
    if qtype == "score" and isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    if qtype == "score" and isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _json_cell(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def row_to_object(row: Mapping[str, Any], mapping: ColumnMapping, row_number: int) -> dict[str, Any]:
    """One table row as a record object in the JSONL shape."""
    if isinstance(mapping.state, tuple):
        state: Any = {c: row.get(c) for c in mapping.state}
    else:
        state = row.get(mapping.state)
    questions: dict[str, Any] = {}
    for qid, q in mapping.questions.items():
        body: dict[str, Any] = {"type": q.type, "instructions": q.instructions}
        if q.options_column:
            options = _json_cell(row.get(q.options_column))
        else:
            options = list(q.options) if isinstance(q.options, tuple) else q.options
        if options is not None:
            body["criteria"] = options if q.type == "score" or not isinstance(options, list) else {str(o): None for o in options}
        label = row.get(q.label)
        if not _is_missing(label):
            body["label"] = _coerce_label(q.type, label)
        if q.soft_label_column and not _is_missing(row.get(q.soft_label_column)):
            body["soft_label"] = _json_cell(row.get(q.soft_label_column))
        questions[qid] = body
    rid = row.get(mapping.id) if mapping.id else f"row-{row_number}"
    meta: dict[str, Any] = {c: row.get(c) for c in mapping.meta_columns}
    if mapping.group:
        group = row.get(mapping.group)
        meta[DEFAULT_GROUP_KEY] = None if _is_missing(group) else group
    return {"id": None if _is_missing(rid) else str(rid), "state": state, "questions": questions, "meta": meta}


def read_table_file(path: str | Path) -> pa.Table:
    """Read a CSV or Parquet file as an Arrow table (strings kept as strings in CSV)."""
    path = Path(path)
    suffix = path.suffix.lower()
    try:
        if suffix == ".parquet":
            import pyarrow.parquet as pq

            return pq.read_table(path)
        if suffix in (".csv", ".tsv"):
            import pyarrow.csv as pacsv

            raw = path.read_bytes()
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                line = raw[: exc.start].count(b"\n") + 1
                raise DataValidationError(
                    [FieldError(str(path), line, "<encoding>", f"not UTF-8: byte 0x{raw[exc.start]:02x} at offset {exc.start}")]
                ) from None
            delimiter = "\t" if suffix == ".tsv" else ","
            # Read every column as a string so ids like "007" keep their zeros.
            header = pacsv.read_csv(path, parse_options=pacsv.ParseOptions(delimiter=delimiter),
                                    read_options=pacsv.ReadOptions(skip_rows_after_names=10**9)).column_names
            return pacsv.read_csv(
                path,
                parse_options=pacsv.ParseOptions(delimiter=delimiter, newlines_in_values=True),
                convert_options=pacsv.ConvertOptions(column_types={c: pa.string() for c in header}, strings_can_be_null=True),
            )
    except pa.ArrowInvalid as exc:
        raise DataValidationError([FieldError(str(path), None, "<file>", f"cannot read {suffix[1:]}: {exc}")]) from None
    raise DataValidationError([FieldError(str(path), None, "<file>", f"unsupported file type {suffix!r}; use .jsonl, .csv, .tsv or .parquet")])


def load_tabular(
    path: str | Path,
    mapping: ColumnMapping,
    *,
    require_group: bool = False,
    require_labels: bool = True,
    token_budget: int | None = DEFAULT_TOKEN_BUDGET,
) -> LoadReport:
    """Load a CSV/Parquet file through ``mapping``; every error names the row and field.

    Rows are numbered from 1 for the first data row (a CSV's header is row 0).
    """
    file = str(path)
    table = read_table_file(path)
    if table.num_rows == 0:
        raise DataValidationError([FieldError(file, None, "<file>", "empty file: no rows")])
    missing = [c for c in mapping.columns() if c not in table.column_names]
    if missing:
        raise DataValidationError(
            [FieldError(file, None, f"column {c!r}", f"named by the mapping but not in the file (columns: {', '.join(table.column_names)})") for c in missing]
        )
    objects: list[tuple[Any, int | None]] = [
        (row_to_object(row, mapping, number), number) for number, row in enumerate(table.to_pylist(), start=1)
    ]
    records = records_from_objects(
        objects, file=file, require_group=require_group, require_labels=require_labels, token_budget=token_budget
    )
    return LoadReport(records=records, source=file, n_lines=table.num_rows)


def load_records(
    path: str | Path,
    *,
    mapping: ColumnMapping | None = None,
    require_group: bool = False,
    require_labels: bool = True,
    token_budget: int | None = DEFAULT_TOKEN_BUDGET,
) -> LoadReport:
    """Load decision records from JSONL, or CSV/Parquet with a column mapping."""
    from envloop_pipelines.core.data.jsonl import load_jsonl

    suffix = Path(path).suffix.lower()
    if suffix in (".jsonl", ".json", ".ndjson"):
        return load_jsonl(path, require_group=require_group, require_labels=require_labels, token_budget=token_budget)
    if mapping is None:
        raise DataValidationError(
            [FieldError(str(path), None, "<mapping>", f"a {suffix[1:] or 'tabular'} file needs a column mapping (--mapping FILE)")]
        )
    return load_tabular(path, mapping, require_group=require_group, require_labels=require_labels, token_budget=token_budget)


def records_to_rows(records: Sequence[Any], mapping: ColumnMapping) -> list[dict[str, Any]]:
    """The inverse of :func:`row_to_object` for a mapping with literal options (used in round-trip tests and export)."""
    from envloop_pipelines.core.data.records import Record

    rows: list[dict[str, Any]] = []
    for record in records:
        assert isinstance(record, Record)
        row: dict[str, Any] = {}
        if mapping.id:
            row[mapping.id] = record.id
        if isinstance(mapping.state, tuple):
            for c in mapping.state:
                row[c] = record.state.get(c)
        else:
            row[mapping.state] = record.state
        if mapping.group:
            row[mapping.group] = record.group
        for q in record.questions:
            spec = mapping.questions[q.id]
            row[spec.label] = q.label_value()
            if spec.soft_label_column:
                row[spec.soft_label_column] = (
                    None if q.soft_label is None else json.dumps({k: p for k, p in zip(q.option_keys, q.soft_label) if p > 0})
                )
        for c in mapping.meta_columns:
            row[c] = record.meta.get(c)
        rows.append(row)
    return rows
