"""Turning core results into the metadata a person reads in the Dagster UI (and a client reads over GraphQL).

Three entries are also the remote read path of the SDK (``envloop_pipelines/sdk``), which
never reads the EnvLoop home of a deployment: :data:`DECISION` (the round's typed decision,
``RoundDecision.to_dict()``), :data:`RELEASE_CARD` (the card a step published) and
:data:`LEDGER_EVENTS` (the ledger events about the step's round, noise floor and release).
"""

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


#: Metadata labels a client reads back (``docs/http-api.md``); JSON values.
DECISION = "decision"
RELEASE_CARD = "release_card"
LEDGER_EVENTS = "ledger_events"
#: Text, on ``noise_floor`` when its floor puts promotion out of reach of any candidate (``unreachable_bar``).
PROMOTION_WARNING = "promotion_warning"


def ledger_metadata(task: str, home: str | None, *, round_key: str | None = None, noise_key: str | None = None,
                    release: int | None = None) -> dict[str, dg.MetadataValue]:
    """The ledger's events about this step (its round, its noise floor, its release) and its release card, as JSON."""
    from envloop_pipelines.core.ledger.ledger import Ledger

    ledger = Ledger(task, home)

    def about(event: Mapping[str, Any]) -> bool:
        return ((round_key is not None and event.get("round") == round_key)
                or (noise_key is not None and event.get("noise_key") == noise_key)
                or (release is not None and event.get("release") == release))

    out = {LEDGER_EVENTS: dg.MetadataValue.json([e for e in ledger.events() if about(e)])}
    card = next((c for c in ledger.releases() if release is not None and c.get("release") == release), None)
    if card is not None:
        out[RELEASE_CARD] = dg.MetadataValue.json(card)
    return out


#: Decimal places of a decision's numbers in the UI (a delta of 0.0040000000000000036 reads 0.004).
DIGITS = 6


def decision_numbers(decision: Any) -> dict[str, dg.MetadataValue]:
    """The decision's numbers as numeric (float) metadata, so the Dagster UI's Plots tab draws them over rounds:
    predicted and observed delta, its CI ends, the bar, the MDE and the CI's half-width, the noise floor, and the
    gate's metric for champion and candidate on test. A number the decision lacks is left out, not zero."""
    checks = decision.checks or {}
    values = {"predicted_delta": decision.predicted_delta, "delta": decision.delta.get("delta"),
              "ci_low": decision.delta.get("ci_low"), "ci_high": decision.delta.get("ci_high"),
              "bar": checks.get("bar"), "mde": checks.get("mde"), "ci_half_width": checks.get("ci_half_width"),
              "noise_floor": decision.noise_floor, "champion_score": checks.get("champion_score"),
              "candidate_score": checks.get("candidate_score")}
    return {k: dg.MetadataValue.float(round(float(v), DIGITS)) for k, v in values.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v}


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
