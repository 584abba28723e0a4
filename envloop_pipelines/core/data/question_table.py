"""The flattened per-question table: one row per question, what training and metrics read.

Hidden splits drop the label columns (:data:`LABEL_COLUMNS`), leaving
:data:`INPUT_SCHEMA`.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import pyarrow as pa

from envloop_pipelines.core.data.json_text import render_value
from envloop_pipelines.core.data.records import Record

#: One row per question. Training and metrics read this; hidden splits drop the label columns.
QUESTION_SCHEMA = pa.schema(
    [
        pa.field("record_id", pa.string(), nullable=False),
        pa.field("question_id", pa.string(), nullable=False),
        pa.field("family", pa.string(), nullable=False),
        pa.field("type", pa.string(), nullable=False),
        pa.field("group", pa.string()),
        pa.field("state_text", pa.string(), nullable=False),
        pa.field("instructions_text", pa.string(), nullable=False),
        pa.field("option_keys", pa.list_(pa.string()), nullable=False),
        pa.field("option_texts", pa.list_(pa.string()), nullable=False),
        pa.field("variant", pa.string()),
        pa.field("renderer", pa.string()),
        pa.field("label", pa.int32()),
        pa.field("soft_label", pa.list_(pa.float64())),
    ]
)
LABEL_COLUMNS: tuple[str, ...] = ("label", "soft_label")
INPUT_SCHEMA = pa.schema([f for f in QUESTION_SCHEMA if f.name not in LABEL_COLUMNS])


def questions_table(records: Iterable[Record]) -> pa.Table:
    """Flatten records into one row per question (:data:`QUESTION_SCHEMA`)."""
    columns: dict[str, list[Any]] = {f.name: [] for f in QUESTION_SCHEMA}
    for record in records:
        state_text = render_value(record.state)
        for q in record.questions:
            columns["record_id"].append(record.id)
            columns["question_id"].append(q.id)
            columns["family"].append(q.family)
            columns["type"].append(q.type)
            columns["group"].append(record.group)
            columns["state_text"].append(state_text)
            columns["instructions_text"].append(render_value(q.instructions))
            columns["option_keys"].append(list(q.option_keys))
            columns["option_texts"].append(list(q.option_texts))
            columns["variant"].append(_meta_str(record.meta, "variant"))
            columns["renderer"].append(_meta_str(record.meta, "renderer"))
            columns["label"].append(q.label)
            columns["soft_label"].append(None if q.soft_label is None else list(q.soft_label))
    return pa.table(columns, schema=QUESTION_SCHEMA)


def _meta_str(meta: Mapping[str, Any], key: str) -> str | None:
    value = meta.get(key)
    return None if value is None else str(value)
