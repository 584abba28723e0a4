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


def _safety_section(card: Mapping[str, Any]) -> list[str]:
    """Each safety family's false-negative rate beside TF-IDF's, with what deferral changes (test split).

    ``fnr`` is the argmax answer's; ``fnr_automated`` counts only the misses answered automatically
    (the answers under the family's threshold go to a person) and ``defer_rate`` is their share.
    """
    columns = [("release", card.get("test") or {}), ("parent", card.get("parent_test") or {}),
               ("TF-IDF + LR", card.get("tfidf_baseline_test") or {})]
    families = sorted({k.split("/", 1)[1] for _, m in columns for k in m if k.startswith("fnr/")})
    if not families:
        return []
    lines = ["", "## Safety families (test)", "",
             "Answers under a family's threshold (fitted on val for its FNR target) defer to a person; "
             "the automated FNR counts the misses no person sees.", "",
             "| family | model | FNR (argmax) | FNR automated | deferral rate |", "|---|---|---|---|---|"]
    for fam in families:
        for name, m in columns:
            if f"fnr/{fam}" in m or f"defer_rate/{fam}" in m:
                lines.append(f"| {fam} | {name} | {_fmt(m.get(f'fnr/{fam}'))} | {_fmt(m.get(f'fnr_automated/{fam}'))} | "
                             f"{_fmt(m.get(f'defer_rate/{fam}'))} |")
    return lines


def _floor_source_text(source: Any) -> str:
    """Which floor gated the round, after its value on the card's gate line (issue 45): the control recipe's null
    arms, or the parent's lineage floor (its making repeated with fresh seeds beside it)."""
    if not isinstance(source, Mapping):
        return ""
    values = ", ".join(_fmt(v) for v in source.get("values") or [])
    if source.get("source") == "lineage":
        making = source.get("making") or {}
        return (f" (the lineage floor of release {making.get('release')}: its test score and its making, round "
                f"{making.get('round')}, repeated with fresh seeds: {values}; key {source.get('key')})")
    return f" (the control recipe's null arms: {values}; key {source.get('key')})"


def _gain_section(card: Mapping[str, Any]) -> list[str]:
    """Where the gain came from: each family's test accuracy, release beside its parent and TF-IDF, and the change.

    Cards without a parent (release 1) show the release beside TF-IDF only."""
    test, parent, tfidf = card.get("test") or {}, card.get("parent_test") or {}, card.get("tfidf_baseline_test") or {}
    families = sorted(k.split("/", 1)[1] for k in test if k.startswith("acc/"))
    if not families:
        return []
    lines = ["", "## Where the gain came from (test accuracy by family)", ""]
    change = card.get("change") or {}
    if change.get("clusters"):
        lines += [f"The round's change ({change.get('kind')}): {change.get('n_new_examples')} new examples aimed at "
                  f"the champion's failure clusters on dev: " + ", ".join(f"`{c}`" for c in change["clusters"]) + ".",
                  ""]
    lines += ["| family | release | parent | release − parent | TF-IDF + LR |", "|---|---|---|---|---|"]
    for fam in families:
        now, before = test.get(f"acc/{fam}"), parent.get(f"acc/{fam}")
        gain = now - before if isinstance(now, float) and isinstance(before, float) else None
        lines.append(f"| {fam} | {_fmt(now)} | {_fmt(before)} | {'—' if gain is None else f'{gain:+.4f}'} | "
                     f"{_fmt(tfidf.get(f'acc/{fam}'))} |")
    return lines


def _readout_section(card: Mapping[str, Any]) -> list[str]:
    """The hybrid's make-up: the lexical weight chosen on val and the head's share of the fused logits."""
    readout = card.get("readout")
    if not readout:
        return []
    if not readout.get("hybrid"):
        return ["", "## Readout", "", "The encoder's head alone (no lexical part)."]
    share = readout.get("head_share")
    return ["", "## Readout", "",
            f"Hybrid: the head's logits + {_fmt(readout.get('lexical_weight'))} x TF-IDF + LR log-probabilities "
            f"(weight chosen on val: calibrated NLL {_fmt(readout.get('val_nll'))}, head alone "
            f"{_fmt(readout.get('val_nll_head_alone'))}). The head's share of the fused logits on val: "
            + ("—" if share is None else f"{share:.0%}") + " (0% is TF-IDF + LR under another name)."]


def paired_text(d: Mapping[str, Any] | None) -> str | None:
    """A paired delta with its CI as ``+0.0300 [+0.0110, +0.0490]``; None when a part is missing."""
    if not d or not all(isinstance(d.get(x), float) for x in ("delta", "ci_low", "ci_high")):
        return None
    return f"{d['delta']:+.4f} [{d['ci_low']:+.4f}, {d['ci_high']:+.4f}]"


def coverage_of(metrics: Mapping[str, Any] | None) -> tuple[float | None, float | None]:
    """The error budget and the coverage at it in a split's metrics (``coverage_at_5pct`` -> ``(0.05, value)``);
    ``(None, None)`` when the metrics have no coverage."""
    for key, value in (metrics or {}).items():
        if key.startswith("coverage_at_") and key.endswith("pct") and isinstance(value, (int, float)):
            try:
                return float(key[len("coverage_at_"):-len("pct")]) / 100, float(value)
            except ValueError:
                continue
    return None, None


def answers_on_its_own(card: Mapping[str, Any]) -> str | None:
    """What the release can answer without a person, on test: ``release 2 answers 2.5% of the test questions on
    its own within a 5% error budget (its family-macro accuracy 0.5267); a person gets the other 97.5%``."""
    test = card.get("test") or {}
    budget, coverage = coverage_of(test)
    if coverage is None:
        return None
    acc = test.get("family_macro_accuracy")
    accuracy = f" (family-macro accuracy {acc:.4f} on all of them)" if isinstance(acc, float) else ""
    return (f"release {card['release']} answers {coverage:.1%} of the test questions on its own within a "
            f"{budget:.0%} error budget{accuracy}; a person gets the other {1 - coverage:.1%}")


def _holdout_table(card: Mapping[str, Any]) -> list[str]:
    """The holdout beside TF-IDF + LR scored in the same read, with the paired delta release − TF-IDF.

    Cards written before the classical column existed have the release's column only."""
    holdout, tfidf = card.get("holdout") or {}, card.get("holdout_tfidf")
    if tfidf is None:
        return ["| metric | value |", "|---|---|"] + [f"| {k} | {_fmt(v)} |" for k, v in holdout.items()
                                                      if not k.startswith("acc/")]
    deltas = card.get("holdout_vs_tfidf") or {}
    lines = ["| metric | release | TF-IDF + LR | release − TF-IDF (95% CI) |", "|---|---|---|---|"]
    for k, v in holdout.items():
        if k.startswith("acc/"):
            continue
        lines.append(f"| {k} | {_fmt(v)} | {_fmt(tfidf.get(k))} | {paired_text(deltas.get(k)) or '—'} |")
    return lines


def render_card(card: Mapping[str, Any]) -> str:
    """The release card as Markdown: holdout first, then test beside the parent and the classical baseline."""
    lines = [f"# Release {card['release']} — {card['task']}", "",
             f"- round: `{card['round']}`  parent release: {_fmt(card.get('parent_release'))}",
             f"- benchmark: `{card['benchmark_version']}`  data snapshot: `{str(card['data_snapshot'])[:16]}`",
             f"- recipe: `{str(card['recipe_hash'])[:16]}`  checkpoint: `{str(card['checkpoint_sha256'])[:16]}`"
             + (f"  inference: {card['inference_precision']} (verifier and `envloop serve` alike)"
                if card.get("inference_precision") else ""),
             f"- MLflow model version: {card.get('model_version')}"]
    on_its_own = answers_on_its_own(card)
    if on_its_own:
        lines.append(f"- on its own: {on_its_own} (coverage at the error budget, test)")
    lines += ["", "## Holdout (read once)", ""]
    lines += _holdout_table(card)
    lines += ["", "## Test", "", "| metric | release | parent | TF-IDF + LR |", "|---|---|---|---|"]
    parent, tfidf = card.get("parent_test") or {}, card.get("tfidf_baseline_test") or {}
    for k, v in (card.get("test") or {}).items():
        lines.append(f"| {k} | {_fmt(v)} | {_fmt(parent.get(k))} | {_fmt(tfidf.get(k))} |")
    lines += _gain_section(card)
    lines += _readout_section(card)
    lines += _safety_section(card)
    if card.get("paired_deltas"):
        lines += ["", "## Paired deltas vs parent (record-clustered bootstrap, 95%)", "",
                  "| metric | delta | CI |", "|---|---|---|"]
        for k, v in card["paired_deltas"].items():
            lines.append(f"| {k} | {_fmt(v['delta'])} | [{_fmt(v['ci_low'])}, {_fmt(v['ci_high'])}] |")
    lines += ["", "## Gate", "", f"- registered: `{json.dumps(card.get('gate'), default=str)}`",
              f"- noise floor: {_fmt(card.get('noise_floor'))}{_floor_source_text(card.get('noise_floor_source'))}"]
    guards = card.get("guards") or {}
    if guards.get("bar") is not None:
        bound = ("" if guards.get("seed_bound") is None else
                 f", the arms' {guards['seed_bound_level']:.0%} seed bound {_fmt(guards['seed_bound'])} "
                 f"minus the parent's score ({_fmt(guards.get('seed_gap'))})")
        lines.append(f"- bar: {_fmt(guards['bar'])}, the largest of min_delta {_fmt(guards.get('min_delta'))}, "
                     f"the floor x {guards.get('floor_multiplier', 1):g}{bound}; gain {_fmt(guards.get('gain'))}")
    power = card.get("power")
    if power and power.get("mde") is not None:
        lines.append(f"- power: predicted {_fmt(card.get('predicted_delta'))} on {power.get('metric')}; minimum "
                     f"detectable effect {_fmt(power['mde'])} at {power.get('power', 0.8):.0%} power (se "
                     f"{_fmt(power.get('se'))}" + (f", bar {_fmt(power['bar'])}" if power.get("bar") is not None
                                                   else "")
                     + ")" + ("; **underpowered**" if power.get("underpowered") else ""))
    if "gate_operating_point" in card:  # cards written before issue 45 carry no such key
        from envloop_pipelines.core.loop.operating_point import operating_point_text

        lines.append(f"- operating point: {operating_point_text(card['gate_operating_point'])}")
    for a in card.get("amendments") or []:
        lines.append(f"- amendment: `{json.dumps(a['amended_gate'])}` (original `{json.dumps(a['original_gate'])}`), reason: {a['reason']}")
    if card.get("guards"):
        lines += ["", "## Guards", "", f"```json\n{json.dumps(card['guards'], indent=2, default=str)}\n```"]
    lines += ["", "## Limitations", ""] + [f"- {x}" for x in card.get("limitations", [])]
    return "\n".join(lines) + "\n"


__all__ = ["answers_on_its_own", "benchmark_limitations", "coverage_of", "paired_text", "render_card"]
