"""CSV and Parquet through a column mapping."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from envloop_pipelines.core.data.errors import DataValidationError
from envloop_pipelines.core.data.jsonl import load_jsonl
from envloop_pipelines.core.data.tabular import ColumnMapping, load_records, records_to_rows

from .test_records import good_record, write_lines

MAPPING = {
    "id": "ticket_id",
    "state": "body",
    "group": "customer",
    "questions": {
        "queue": {"type": "choice", "instructions": "Which queue handles this ticket?",
                  "options": ["billing", "shipping", "account"], "label": "queue_label"},
        "refund": {"type": "noul", "instructions": "Does the customer ask for a refund?", "label": "refund"},
        "priority": {"type": "score", "instructions": "How urgent is it?",
                     "options": ["low", "normal", "high", "critical"], "label": "prio", "soft_label_column": "prio_soft"},
    },
}


def reference_records(tmp_path: Path):
    recs = []
    for i in range(6):
        rec = good_record(f"t{i:03d}", user=f"c{i % 3}")
        rec["questions"]["queue"]["criteria"] = {"billing": None, "shipping": None, "account": None}
        rec["questions"]["queue"]["label"] = ["billing", "shipping", "account"][i % 3]
        rec["questions"]["refund"]["label"] = i % 2 == 0
        rec["state"] = f"Ticket {i}: ünïcode ✓, a comma, and a \"quote\"\nsecond line"
        if i % 2:
            del rec["questions"]["priority"]["soft_label"]
        rec["meta"] = {"user_id": f"c{i % 3}"}
        recs.append(rec)
    return load_jsonl(write_lines(tmp_path / "ref.jsonl", recs)).records


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_mapping_round_trip(tmp_path: Path, fmt: str) -> None:
    mapping = ColumnMapping.from_dict(MAPPING)
    expected = reference_records(tmp_path)
    rows = records_to_rows(expected, mapping)
    table = pa.Table.from_pylist(rows)
    path = tmp_path / f"data.{fmt}"
    if fmt == "csv":
        pacsv.write_csv(table, path)
    else:
        pq.write_table(table, path)
    loaded = load_records(path, mapping=mapping).records
    assert [r.id for r in loaded] == [r.id for r in expected]
    for got, want in zip(loaded, expected):
        assert got.state == want.state and got.group == want.group
        for gq, wq in zip(got.questions, want.questions):
            assert (gq.id, gq.type, gq.option_keys, gq.label, gq.soft_label) == (
                wq.id, wq.type, wq.option_keys, wq.label, wq.soft_label)


def test_csv_errors_name_row_and_field(tmp_path: Path) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(
        "ticket_id,body,customer,queue_label,refund,prio,prio_soft\n"
        "t1,hello,c1,billing,true,1,\n"
        "t2,hello,c1,nowhere,maybe,9,\n"
        "t1,hello,,billing,false,0,\n",
        encoding="utf-8",
    )
    with pytest.raises(DataValidationError) as info:
        load_records(path, mapping=ColumnMapping.from_dict(MAPPING), require_group=True)
    got = {(e.line, e.field) for e in info.value.errors}
    assert got == {(2, "questions.queue.label"), (2, "questions.refund.label"), (2, "questions.priority.label"),
                   (3, "meta.user_id"), (3, "id")}


def test_mapping_names_missing_columns_and_bad_keys(tmp_path: Path) -> None:
    with pytest.raises(DataValidationError) as info:
        ColumnMapping.from_dict({"state": "body", "questions": {"q": {"type": "rank", "label": "l"}}, "colour": 1})
    fields = {e.field for e in info.value.errors}
    assert {"colour", "questions.q.type"} <= fields
    path = tmp_path / "d.csv"
    path.write_text("ticket_id,body\nt1,x\n", encoding="utf-8")
    with pytest.raises(DataValidationError) as info:
        load_records(path, mapping=ColumnMapping.from_dict(MAPPING))
    assert "column 'queue_label'" in {e.field for e in info.value.errors}


def test_tabular_needs_a_mapping(tmp_path: Path) -> None:
    path = tmp_path / "d.csv"
    path.write_text("a\n1\n", encoding="utf-8")
    with pytest.raises(DataValidationError, match="column mapping"):
        load_records(path)
