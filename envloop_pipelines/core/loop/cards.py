"""Release cards as Markdown: holdout first, then test beside the parent and the classical baseline.

The card's JSON is written by the ledger (write-once, errata beside); this is its rendering.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from envloop_pipelines.core.data.snapshots import TaskSnapshot

#: Splits a checkpoint trains or is selected on, and the ones it is judged on.
_SEEN_SPLITS = ("train", "val", "dev")
_JUDGED_SPLITS = ("test", "holdout")


def benchmark_limitations(snapshot: "TaskSnapshot") -> list[str]:
    """What a release card must say about the data it was judged on, true for this task's snapshot.

    Read from the snapshot itself, not assumed: where the benchmark comes from (the built-in
    generator, or an imported file), what the test and holdout splits are disjoint on, and
    whether they hold surface forms (``meta.renderer``) that training never saw, with the share.
    """
    manifest = snapshot.manifest
    generator = manifest.extra.get("generator")
    lines = []
    if generator:
        hidden = (f"; test and holdout {generator['hidden_users']} users each" if generator.get("hidden_users")
                  else "")
        lines.append(f"The benchmark is the built-in synthetic generator ({generator.get('name', 'personal_agent')}: "
                     f"{generator.get('n_users')} users x {generator.get('records_per_user')} records{hidden}, seed "
                     f"{generator.get('seed')}), not data from real use.")
        groups = "users"
    else:
        source = manifest.source
        name = Path(str(source.get("path", "?"))).name
        digest = str(source.get("sha256") or "")[:12]
        lines.append(f"The benchmark is imported data ({name}" + (f", sha256 {digest}" if digest else "") +
                     "); the results hold for data like that file, no further.")
        groups = f"groups (meta.{manifest.group_key})"
    seen = {r for s in _SEEN_SPLITS for r in snapshot.table(s).column("renderer").to_pylist() if r}
    judged = Counter(r for s in _JUDGED_SPLITS for r in snapshot.table(s).column("renderer").to_pylist())
    total = sum(judged.values())
    unseen = sorted(r for r in judged if r and r not in seen)
    line = f"Test and holdout {groups} are unseen during training (the splits are disjoint on meta.{manifest.group_key})"
    if unseen and total:
        share = sum(judged[r] for r in unseen) / total
        amount = "half" if abs(share - 0.5) < 0.05 else f"{share:.0%}"
        names = ", ".join(f"'{r}'" for r in unseen)
        line += (f"; {amount} of their questions use a second renderer ({names}) that training never saw "
                 f"({sum(judged[r] for r in unseen)} of {total}).")
    else:
        line += "."
    lines.append(line)
    return lines


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


__all__ = ["benchmark_limitations", "render_card"]
