"""Release cards as Markdown: holdout first, then test beside the parent and the classical baseline.

The card's JSON is written by the ledger (write-once, errata beside); this is its rendering.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any


def _fmt(x: Any) -> str:
    if isinstance(x, float):
        return f"{x:.4f}"
    return "—" if x is None else str(x)


def render_card(card: Mapping[str, Any]) -> str:
    """The release card as Markdown: holdout first, then test beside the parent and the classical baseline."""
    lines = [f"# Release {card['release']} — {card['task']}", "",
             f"- round: `{card['round']}`  parent release: {_fmt(card.get('parent_release'))}",
             f"- benchmark: `{card['benchmark_version']}`  data snapshot: `{str(card['data_snapshot'])[:16]}`",
             f"- recipe: `{str(card['recipe_hash'])[:16]}`  checkpoint: `{str(card['checkpoint_sha256'])[:16]}`",
             f"- MLflow model version: {card.get('model_version')}", "", "## Holdout (read once)", "",
             "| metric | value |", "|---|---|"]
    for k, v in (card.get("holdout") or {}).items():
        if not k.startswith("acc/"):
            lines.append(f"| {k} | {_fmt(v)} |")
    lines += ["", "## Test", "", "| metric | release | parent | TF-IDF + LR |", "|---|---|---|---|"]
    parent, tfidf = card.get("parent_test") or {}, card.get("tfidf_baseline_test") or {}
    for k, v in (card.get("test") or {}).items():
        lines.append(f"| {k} | {_fmt(v)} | {_fmt(parent.get(k))} | {_fmt(tfidf.get(k))} |")
    if card.get("paired_deltas"):
        lines += ["", "## Paired deltas vs parent (record-clustered bootstrap, 95%)", "",
                  "| metric | delta | CI |", "|---|---|---|"]
        for k, v in card["paired_deltas"].items():
            lines.append(f"| {k} | {_fmt(v['delta'])} | [{_fmt(v['ci_low'])}, {_fmt(v['ci_high'])}] |")
    lines += ["", "## Gate", "", f"- registered: `{json.dumps(card.get('gate'), default=str)}`",
              f"- noise floor: {_fmt(card.get('noise_floor'))}"]
    for a in card.get("amendments") or []:
        lines.append(f"- amendment: `{json.dumps(a['amended_gate'])}` (original `{json.dumps(a['original_gate'])}`), reason: {a['reason']}")
    if card.get("guards"):
        lines += ["", "## Guards", "", f"```json\n{json.dumps(card['guards'], indent=2, default=str)}\n```"]
    lines += ["", "## Limitations", ""] + [f"- {x}" for x in card.get("limitations", [])]
    return "\n".join(lines) + "\n"


__all__ = ["render_card"]
