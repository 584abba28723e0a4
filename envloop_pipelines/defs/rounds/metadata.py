"""Turning core results into the metadata a person reads in the Dagster UI."""

from __future__ import annotations

from typing import Any, Mapping

import dagster as dg


def metrics_table(columns: Mapping[str, Mapping[str, Any]]) -> dg.MetadataValue:
    """A Markdown table: one row per metric, one column per model."""
    names = list(columns)
    keys: list[str] = []
    for values in columns.values():
        keys += [k for k in values if k not in keys and isinstance(values[k], (int, float, type(None)))]
    lines = ["| metric | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for k in keys:
        cells = []
        for n in names:
            v = columns[n].get(k)
            cells.append(f"{v:.4f}" if isinstance(v, float) else ("—" if v is None else str(v)))
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return dg.MetadataValue.md("\n".join(lines))


def mlflow_link(result: Any) -> dict[str, dg.MetadataValue]:
    """The MLflow run of a step's record (its ``mlflow_url`` and ``mlflow_run_id``), when it has one."""
    url, run_id = getattr(result, "mlflow_url", None), getattr(result, "mlflow_run_id", None)
    if url:
        return {"mlflow_run": dg.MetadataValue.url(url) if str(url).startswith("http") else dg.MetadataValue.text(url),
                "mlflow_run_id": dg.MetadataValue.text(str(run_id))}
    return {}


def run_tags(context: dg.AssetExecutionContext) -> dict[str, str]:
    """Tags linking MLflow runs back to the Dagster run and partition."""
    tags = {"dagster.run_id": context.run.run_id}
    if context.has_partition_key:
        tags["dagster.partition"] = context.partition_key
    return tags
