"""The gate's measured operating point at a loop's design: how much a promotion there means.

``bench/bench_gate_evidence.py`` measures, at one design (a benchmark version, the loop's recipe hash, K null
arms, the registered gate), how often the gate promotes a candidate no better than its champion (false
promotions k/n over disjoint replicates, with the exact Clopper-Pearson interval) and how often it promotes a
candidate with a real gain (the budget lever's, its gain measured over the replicates), and the seed spread at
the champion's lineage beside the control recipe's. ``--record`` writes that figure here, in
:data:`OPERATING_POINTS_FILE` (packaged, so a released card and ``envloop ledger`` on any machine read it).

A round's card and the ledger's calibration table show the point whose design is the round's own; a loop
at another design (another task, recipe, K or gate) gets "not measured at this design", never another
design's figure.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

#: The measured operating points on record, one per design (written by ``bench_gate_evidence.py --record``).
OPERATING_POINTS_FILE = Path(__file__).with_name("gate_operating_points.json")
BENCH = "bench/bench_gate_evidence.py"


def design_of(benchmark_version: str, recipe_hash: str, noise_arms: int, gate: Mapping[str, Any]) -> dict[str, Any]:
    """The fields that name a design: what the gate's statistics depend on."""
    return {"benchmark_version": str(benchmark_version), "recipe_hash": str(recipe_hash), "noise_arms": int(noise_arms),
            "gate": {k: gate[k] for k in sorted(gate)}}


def _same_design(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    return design_of(**{k: a[k] for k in ("benchmark_version", "recipe_hash", "noise_arms", "gate")}) == \
        design_of(**{k: b[k] for k in ("benchmark_version", "recipe_hash", "noise_arms", "gate")})


def recorded_points(path: Path = OPERATING_POINTS_FILE) -> list[dict[str, Any]]:
    """Every operating point on record (``[]`` when none is)."""
    if not path.is_file():
        return []
    raw = json.loads(path.read_text(encoding="utf-8"))
    points = raw.get("points") if isinstance(raw, dict) else None
    if not isinstance(points, list):
        raise ValueError(f"{path}: expected {{\"points\": [...]}}, got {type(raw).__name__}")
    return points


def measured_operating_point(benchmark_version: str, recipe_hash: str, noise_arms: int, gate: Mapping[str, Any],
                             *, path: Path = OPERATING_POINTS_FILE) -> dict[str, Any] | None:
    """The operating point measured at exactly this design, or ``None``."""
    want = design_of(benchmark_version, recipe_hash, noise_arms, gate)
    for point in recorded_points(path):
        if _same_design(point.get("design") or {}, want):
            return point
    return None


def record_operating_point(point: Mapping[str, Any], *, path: Path = OPERATING_POINTS_FILE) -> None:
    """Put ``point`` on record, replacing the one of the same design."""
    from envloop_pipelines.core.storage import atomic_write_json

    kept = [p for p in recorded_points(path) if not _same_design(p.get("design") or {}, point["design"])]
    atomic_write_json(path, {"points": [*kept, dict(point)]}, overwrite=True)


def operating_point_text(point: Mapping[str, Any] | None) -> str:
    """One line: the false-promotion rate with its interval and the power, or why there is none."""
    if point is None:
        return f"the gate's operating point is not measured at this design ({BENCH} measures it)"
    parts = []
    null = point.get("null") or {}
    if null.get("n"):
        parts.append(f"false promotions {null['promoted']}/{null['n']} null candidates (95% Clopper-Pearson "
                     f"[{null['cp95'][0]:.3f}, {null['cp95'][1]:.3f}])")
    for name, p in sorted((point.get("power") or {}).items()):
        if p.get("n"):
            parts.append(f"power {p['promoted']}/{p['n']} for {name} (measured gain {p['mean_gain']:+.4f}, the MDE "
                         f"formula's power there {p['formula_power']:.2f})")
    spread = point.get("lineage_spread")
    if spread:
        parts.append(f"seed sd {spread['control_sd']:.4f} at the control recipe, {spread['lineage_sd']:.4f} at the "
                     f"{spread['lineage_steps']}-step lineage: the control floor "
                     f"{'bounds' if spread['bounded'] else 'does not bound'} it")
    registered = point.get("registered") or {}
    planned = sum(n for kind, n in registered.items() if kind.startswith("null"))
    if planned and null.get("n", 0) < planned:  # a partial measurement says so: its interval narrows as it goes on
        parts.append(f"under way: {null.get('n', 0)} of the {planned} registered null candidates on record")
    source = f"{BENCH}, {point.get('measured', 'undated')}"
    return "the gate's operating point at this design: " + "; ".join(parts or ["no replicate on record"]) + f" ({source})"


def design_from_events(events: Iterable[Mapping[str, Any]]) -> dict[str, Any] | None:
    """The design of a ledger's latest round: its hypothesis's benchmark, recipe and gate, and its floor's K arms."""
    from envloop_pipelines.core.ledger.event_log import EVENT_HYPOTHESIS_REGISTERED, EVENT_NULL_ARM

    events = list(events)
    hypotheses = [e for e in events if e.get("kind") == EVENT_HYPOTHESIS_REGISTERED and e.get("recipe_hash")]
    arms = [e for e in events if e.get("kind") == EVENT_NULL_ARM]
    if not hypotheses or not arms:
        return None
    last, key = hypotheses[-1], arms[-1].get("noise_key")
    n_arms = sum(1 for e in arms if e.get("noise_key") == key)
    if not last.get("benchmark_version") or not isinstance(last.get("gate"), Mapping):
        return None
    return design_of(last["benchmark_version"], last["recipe_hash"], n_arms, last["gate"])


__all__ = ["OPERATING_POINTS_FILE", "design_from_events", "design_of", "measured_operating_point",
           "operating_point_text", "record_operating_point", "recorded_points"]
