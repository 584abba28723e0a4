"""The noise floor and the promotion decision.

A difference smaller than the measured floor is not a result, however it
looks. The floor is the spread (max − min) of the primary metric over K null
arms identical to the control but for the seed; each family gets its own
floor. A candidate is promoted only when its paired delta against the
champion clears the registered gate *and* the floor *and* the seed bound, its
CI is above zero, and every guard holds. No gate can waive the floor, the
seed bound or the CI (rule 2).

The **seed bound** is the arms' one-sided 95% upper prediction bound, ``mean
+ t(0.95, K−1) · sd · sqrt(1 + 1/K)``: the score a fresh seed of the control
recipe stays under 95 times in 100 (exact for normally distributed arm
scores). The bar is at least this bound minus the champion's score. The
spread alone is not enough: the paired CI counts only the test questions'
sampling noise, not the seed's, and when the champion is itself a low seed
draw (release 1 is the control arm), a candidate that differs only in its
seed clears "champion + spread" far more often than 1 in 20 (measured: 3 of
20 in ``bench/bench_aa.py`` at 8 steps, floor 0.0847, champion the lowest but
one of the three arms). With the bound, a null candidate clears the bar at
most 5% of the time whatever the champion drew; once a champion is well above
the arms (a real promotion), the bound adds nothing and the spread decides.

The family and safety guards are tests, not point comparisons: a family guard
trips when the upper end of the paired 95% CI of the family's accuracy change
is below minus its allowance (the drop is significantly larger than the
family's noise); the safety guard trips when the one-sided 95% lower bound of
the FNR change (the lower end of the paired 90% CI) is above
``max_safety_fnr_increase``. Both CIs come from the verifier's record-clustered
bootstrap (``core/verify/compare.py``). Where a re-evaluation carries no CI
for a family (one scored before the verifier computed them), the guard falls
back to the stricter point comparison, and says so.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Mapping, Sequence

from scipy import stats

from envloop_pipelines.core.ledger.hypothesis import GUARD_FIELDS, MIN_FLOOR_MULTIPLIER, Gate, metric_direction
from envloop_pipelines.core.metrics.paired import DEFAULT_POWER, minimum_detectable_effect
from envloop_pipelines.core.storage import canonical_json, sha256_bytes


#: Confidence of the seed bound: a null candidate clears it at most 1 − this often (the A/A target: 1 in 20).
SEED_BOUND_LEVEL = 0.95


class ArmIdentityError(ValueError):
    """Null arms differ in something other than the seed."""


def arm_identity(recipe: Mapping[str, Any], data_hash: str) -> str:
    """What must be equal across null arms: the recipe without its seed, and the data."""
    body = {k: v for k, v in recipe.items() if k != "seed"}
    return sha256_bytes(canonical_json({"recipe": body, "data": data_hash}))


def check_arm_identity(arms: Sequence[tuple[Mapping[str, Any], str]]) -> str:
    """Raise unless every arm has the same identity; return it. Runs before any compute."""
    identities = {arm_identity(recipe, data) for recipe, data in arms}
    if len(identities) != 1:
        raise ArmIdentityError(f"null arms must be identical to the control but for the seed; got {len(identities)} configs")
    seeds = [recipe.get("seed") for recipe, _ in arms]
    if len(set(seeds)) != len(seeds):
        raise ArmIdentityError(f"null arms need distinct seeds, got {seeds}")
    return identities.pop()


@dataclass(frozen=True)
class NoiseFloor:
    """Spread of the metrics over K null arms."""

    key: str
    metric: str
    values: tuple[float, ...]
    floor: float
    family_floors: Mapping[str, float]
    arms: tuple[Mapping[str, Any], ...] = ()

    def seed_bound(self, direction: str = "increase", level: float = SEED_BOUND_LEVEL) -> float:
        """The one-sided upper (``"increase"``) or lower (``"decrease"``) prediction bound of a new arm.

        ``mean ± t(level, K−1) · sd · sqrt(1 + 1/K)`` over the arms' values of :attr:`metric`, the
        sample ``sd`` with ``K − 1`` degrees of freedom: a fresh seed of the control recipe scores
        beyond it with probability ``1 − level`` when arm scores are normal.
        """
        k = len(self.values)
        mean = statistics.fmean(self.values)
        half = float(stats.t.ppf(level, k - 1)) * statistics.stdev(self.values) * (1 + 1 / k) ** 0.5
        return mean + half if direction == "increase" else mean - half

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["values"] = list(self.values)
        d["arms"] = [dict(a) for a in self.arms]
        d["family_floors"] = dict(self.family_floors)
        return d

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "NoiseFloor":
        return cls(key=raw["key"], metric=raw["metric"], values=tuple(raw["values"]), floor=raw["floor"],
                   family_floors=dict(raw["family_floors"]), arms=tuple(raw.get("arms", ())))


def noise_floor_from_arms(key: str, metric: str, arm_metrics: Sequence[Mapping[str, float]],
                          arms: Sequence[Mapping[str, Any]] = ()) -> NoiseFloor:
    """The floor of ``metric`` and of each family's accuracy from null-arm metrics."""
    if len(arm_metrics) < 2:
        raise ValueError(f"a noise floor needs at least 2 null arms, got {len(arm_metrics)}")
    values = tuple(float(m[metric]) for m in arm_metrics)
    families = sorted({k.split("/", 1)[1] for m in arm_metrics for k in m if k.startswith("acc/")})
    family_floors = {}
    for fam in families:
        vals = [float(m[f"acc/{fam}"]) for m in arm_metrics if m.get(f"acc/{fam}") is not None]
        family_floors[fam] = max(vals) - min(vals) if vals else 0.0
    return NoiseFloor(key=key, metric=metric, values=values, floor=max(values) - min(values),
                      family_floors=family_floors, arms=tuple(arms))


def applied_gate(gate: Gate) -> Gate:
    """The gate as a decision applies it: never looser than the default, whatever was registered.

    Defence in depth for gates written before every door checked them (rule 2): the direction is the
    primary metric's own (:func:`~envloop_pipelines.core.ledger.hypothesis.metric_direction`), each guard
    tolerance at most its default, a NaN ``min_delta`` 0. The floor multiplier and the CI are applied
    by the decision itself.
    """
    own = metric_direction(gate.primary_metric) or gate.direction
    defaults = Gate()
    caps = {name: min(getattr(gate, name), getattr(defaults, name)) if getattr(gate, name) == getattr(gate, name)
            else getattr(defaults, name) for name in GUARD_FIELDS}  # NaN (x != x): the default
    min_delta = gate.min_delta if gate.min_delta == gate.min_delta else 0.0
    return replace(gate, direction=own, min_delta=min_delta, **caps)


def gate_bar(gate: Gate, floor: NoiseFloor, champion_score: float | None = None) -> dict[str, Any]:
    """The bar of :func:`decide_promotion` for ``gate`` over ``floor``, known before a candidate exists.

    ``max(min_delta, floor_multiplier · floor, seed bound − champion_score)``: the seed part where the
    champion's score on the floor's metric is known and the gate is on that metric. Returns the bar and
    its parts (``{"bar", "min_delta", "noise_floor", "floor_multiplier", "seed_gap"}``).
    """
    gate = applied_gate(gate)
    sign = 1.0 if gate.direction == "increase" else -1.0
    multiplier = gate.floor_multiplier if gate.floor_multiplier >= MIN_FLOOR_MULTIPLIER else MIN_FLOOR_MULTIPLIER
    seed_gap = None
    if champion_score is not None and floor.metric == gate.primary_metric and len(floor.values) >= 2:
        seed_gap = sign * (floor.seed_bound(gate.direction) - float(champion_score))
    bar = max(gate.min_delta, multiplier * floor.floor, seed_gap if seed_gap is not None else 0.0)
    return {"bar": bar, "min_delta": gate.min_delta, "noise_floor": floor.floor, "floor_multiplier": multiplier,
            "seed_gap": seed_gap}


def hypothesis_power(noise: Mapping[str, Any] | None, gate: Gate, predicted_delta: float,
                     floor: NoiseFloor | None = None, champion_score: float | None = None) -> dict[str, Any]:
    """The test's power for a hypothesis: the MDE of its primary metric at the noise a candidate shows.

    ``MDE = max(bar, z_{1−α/2} · se) + z_{0.8} · se``
    (:func:`~envloop_pipelines.core.metrics.paired.minimum_detectable_effect`): the true effect a candidate needs
    to be promoted 80% of the time, clearing both the bar (:func:`gate_bar`, from ``floor`` and the
    champion's score) and its CI's lower end above zero. ``α`` is the verifier's CI level and ``se`` the
    standard error of a *candidate-vs-champion* paired delta on test (``noise["deltas"][metric]["se"]``,
    :func:`~envloop_pipelines.core.decision_loop.registered_hypothesis.paired_noise`: earlier rounds' candidates and continuation
    arms trained from the control arm, never null arms, whose seeds may nearly agree). The hypothesis is
    ``underpowered`` when its predicted effect, in the gate's direction, is below the MDE. The flag
    informs; it changes no rule of the gate.

    Args:
        noise: the paired noise (``steps.paired_noise``), or ``None`` when it could not be measured (then
            ``mde`` and ``underpowered`` are ``None`` and ``why_unmeasured`` says why).
        gate: the registered gate (its primary metric and direction).
        predicted_delta: the registered predicted delta.
        floor: the noise floor the decision will apply (for the bar); ``None``: the bar is ``min_delta``.
        champion_score: the champion's test score on the floor's metric (for the seed bound).
    """
    gate = applied_gate(gate)
    effect = float(predicted_delta) if gate.direction == "increase" else -float(predicted_delta)
    out: dict[str, Any] = {"metric": gate.primary_metric, "predicted_effect": effect, "power": DEFAULT_POWER,
                           "mde": None, "underpowered": None}
    d = (noise or {}).get("deltas", {}).get(gate.primary_metric)
    if d is None or d.get("se") is None:
        out["why_unmeasured"] = (f"no candidate-vs-champion paired se on test for {gate.primary_metric}" if noise
                                 else "no earlier round's candidate and no continuation arm of the floor has test "
                                      "predictions to pair with its champion")
        return out
    bar = gate_bar(gate, floor, champion_score) if floor is not None else {"bar": max(gate.min_delta, 0.0)}
    level = float(d.get("confidence_level", 0.95))
    se = float(d["se"])
    mde = minimum_detectable_effect(se, confidence_level=level, power=DEFAULT_POWER, bar=float(bar["bar"]))
    out.update(se=se, mde=mde, bar=bar["bar"], bar_parts=bar, confidence_level=level,
               ci_half_width=float(stats.norm.ppf(1 - (1 - level) / 2)) * se, underpowered=bool(effect < mde),
               formula="mde = max(bar, z_(1-alpha/2) * se) + z_power * se",
               n_questions=d.get("n_questions"), n_clusters=d.get("n_clusters"), n_pairs=d.get("n_pairs"),
               source=(noise or {}).get("source"))
    return out


@dataclass(frozen=True)
class PromotionDecision:
    promote: bool
    reasons: tuple[str, ...]
    checks: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"promote": self.promote, "reasons": list(self.reasons), "checks": dict(self.checks)}


def unreachable_bar(floor: NoiseFloor, champion_score: float, gate: Gate | None = None) -> str | None:
    """Why no candidate can be promoted over this champion with this floor, or ``None`` when one can.

    The bar (:func:`decide_promotion`: the largest of ``min_delta``, ``floor_multiplier`` × the floor and
    the seed bound minus the champion's score) is compared with the most the floor's metric, a fraction
    in [0, 1], can still move: ``1 − champion_score`` up (``direction`` increase), ``champion_score`` down.
    A bar at or above it is out of reach of any candidate (small benchmarks and K = 2 null arms give such
    floors: t(0.95, 1) = 6.31); the message says by how much and what lowers the bar.
    """
    gate = applied_gate(gate or Gate())
    if gate.primary_metric != floor.metric:
        return None
    bar = gate_bar(gate, floor, champion_score)["bar"]
    headroom = 1.0 - float(champion_score) if gate.direction == "increase" else float(champion_score)
    if bar < headroom:
        return None
    return (f"no candidate can be promoted: the bar {bar:.4f} (noise floor {floor.floor:.4f}, seed bound "
            f"{floor.seed_bound(gate.direction):.4f} from {len(floor.values)} null arms) is at or above the most "
            f"{floor.metric} can still gain over the champion's {float(champion_score):.4f} ({headroom:.4f}); "
            f"measure the floor with more null arms (noise_arms) on a larger benchmark (builtin_users) or with "
            f"more training steps")


def champion_out_of_reach(task: str, home: Any, floor: NoiseFloor, gate: Gate | None = None) -> str | None:
    """:func:`unreachable_bar` for the task's champion (its release card's test score); ``None`` without one."""
    from envloop_pipelines.core.ledger.ledger import Ledger

    releases = Ledger(task, home).releases()
    score = (releases[-1].get("test") or {}).get(floor.metric) if releases else None
    return unreachable_bar(floor, float(score), gate) if isinstance(score, (int, float)) else None


#: Why a candidate that answers every test question as its champion does is not promoted.
IDENTICAL_PREDICTIONS = ("the candidate answers every test question exactly as the champion does (identical "
                         "predictions): the change moved nothing the test sees")


def decide_promotion(
    gate: Gate,
    delta: Mapping[str, float],
    floor: NoiseFloor,
    candidate: Mapping[str, Any],
    champion: Mapping[str, Any],
    safety_families: Sequence[str] = (),
    paired: Mapping[str, Any] | None = None,
    *,
    apply_seed_bound: bool = True,
    calibrated: bool = True,
    answers_as_champion: bool = False,
) -> PromotionDecision:
    """Apply the registered gate, the noise floor and the guards: the promotion rule, all of it.

    Args:
        gate: the (possibly amended) gate registered with the hypothesis; a ``floor_multiplier``
            under 1 or ``require_ci_above_zero=False`` (only in gates registered before rule 2 was
            enforced) is applied as 1 and True.
        delta: the paired delta of the primary metric, candidate − champion:
            ``{"delta", "ci_low", "ci_high"}``.
        floor: the noise floor for this benchmark version and recipe.
        candidate: the candidate's test metrics (``metrics.summarize`` keys).
        champion: the champion's test metrics on the same questions.
        safety_families: families whose false-negative rate is guarded.
        paired: the verifier's paired comparison (``Reevaluation.paired``): its ``families`` (each
            family's accuracy delta with a 95% CI) and ``safety`` (each safety family's FNR delta with
            a 90% CI) decide the guards; without them the guards compare point values.
        apply_seed_bound: apply the seed bound (the bar is at least the arms' upper prediction bound minus
            the champion's score). It holds where the arms are seeds of the recipe the champion
            descends from (the loop's floor: release 1 is its control arm); a floor whose arms are
            seeds of the *candidate's* recipe (the RL round's) passes ``False``: a bound on the
            candidate's own seeds says nothing about where the parent sits.
        calibrated: the candidate answers with probabilities, so its ECE is guarded and a missing or NaN
            ECE refuses the decision (:func:`missing_value_reasons`); the RL round's pass@1 passes ``False``.
        answers_as_champion: the verifier found the candidate's test predictions identical to the champion's
            (``Ledger.candidate_answers_as_champion``): the change moved nothing the test sees, so it is never
            promoted, whatever the delta's noise says.

    The metric decides the direction, not the gate: a gate whose ``direction`` reverses its metric's
    own (one registered before every door refused it) is never promoted, and every guard is applied at
    most at its default (:func:`applied_gate`).
    """
    unmeasured = missing_value_reasons(floor, candidate if calibrated else {**candidate, "ece": 0.0}, champion,
                                       safety_families, (paired or {}).get("safety"))
    if any(r.startswith("noise_floor.") for r in unmeasured):  # no bar can be computed from it
        return PromotionDecision(promote=False, reasons=tuple(unmeasured), checks={"noise_floor": floor.floor})
    registered_direction = gate.direction
    gate = applied_gate(gate)
    sign = 1.0 if gate.direction == "increase" else -1.0
    gain = sign * float(delta["delta"])
    ci_low = sign * float(delta["ci_low"]) if sign > 0 else -float(delta["ci_high"])
    # The bar is gate_bar's, the one the hypothesis's MDE was registered with. Rule 2 holds there too, for a
    # gate written before it was enforced at registration: the bar is never under the floor itself. The seed
    # bound applies where the champion's score on the arms' metric is known (and the arms are the champion's
    # recipe's seeds); a gate on another metric is refused below.
    held = champion.get(gate.primary_metric)
    parts = gate_bar(gate, floor, held if apply_seed_bound else None)
    bar, multiplier, seed_gap = parts["bar"], parts["floor_multiplier"], parts["seed_gap"]
    seed_bound = floor.seed_bound(gate.direction) if seed_gap is not None else None
    checks: dict[str, Any] = {"gain": gain, "bar": bar, "noise_floor": floor.floor, "min_delta": gate.min_delta,
                              "floor_multiplier": multiplier, "seed_bound": seed_bound, "seed_gap": seed_gap,
                              "seed_bound_level": SEED_BOUND_LEVEL, "ci_low": ci_low}
    reasons: list[str] = unmeasured
    if registered_direction != gate.direction:
        reasons.append(f"gate.direction {registered_direction!r} reverses {gate.primary_metric}'s own direction "
                       f"({gate.direction}); the gain is measured in the metric's direction and no reversed gate "
                       f"promotes")
    if floor.metric != gate.primary_metric:
        # The floor is in another metric's units: no bar in this one was measured, so nothing clears it.
        reasons.append(f"no noise floor on {gate.primary_metric}: the null arms measured {floor.metric}")
    if not gain > bar:
        bound = ("" if seed_bound is None else
                 f", and the arms' {SEED_BOUND_LEVEL:.0%} seed bound {seed_bound:.4f} minus the champion's "
                 f"{float(held):.4f}")
        reasons.append(f"gain {gain:+.4f} on {gate.primary_metric} does not exceed the bar {bar:.4f} "
                       f"(max of gate {gate.min_delta:.4f}, noise floor {floor.floor:.4f} x {multiplier:g}{bound})")
    if not ci_low > 0:
        reasons.append(f"the {gate.primary_metric} CI lower end {ci_low:+.4f} is not above zero")
    ece = candidate.get("ece")
    checks["ece"] = ece
    if _finite(ece) and ece > gate.max_ece:
        reasons.append(f"calibration guard: ECE {ece:.4f} > {gate.max_ece:.4f}")
    family_cis = (paired or {}).get("families")
    safety_cis = (paired or {}).get("safety")
    limit = gate.max_safety_fnr_increase
    for fam in safety_families:
        key = f"fnr/{fam}"
        new, old = candidate.get(key), champion.get(key)
        ci = (safety_cis or {}).get(fam)
        check: dict[str, Any] = {"candidate": new, "champion": old, "limit": limit}
        if ci is not None and ci.get("ci_low") is not None:
            check.update(test="paired", rise=ci["delta"], lower_bound=ci["ci_low"],
                         confidence_level=ci.get("confidence_level"))
            if ci["ci_low"] > limit:
                reasons.append(f"safety guard: {key} rose {ci['delta']:+.4f} ({_fmt(old)} -> {_fmt(new)}); its "
                               f"one-sided {_one_sided(ci)} lower bound {ci['ci_low']:+.4f} is above the limit "
                               f"+{limit:.4f}")
        elif not (_finite(new) and _finite(old)):
            check["test"] = "none: refused (missing_value_reasons)"
        else:
            check["test"] = "point: no paired CI for this family"
            if new is not None and old is not None and new - old > limit:
                reasons.append(f"safety guard: {key} rose {old:.4f} -> {new:.4f} (limit +{limit:.4f}; "
                               f"point comparison, no paired CI)")
        checks[key] = check
    drops: dict[str, float] = {}
    family_checks: dict[str, Any] = {}
    for key, old in champion.items():
        if not key.startswith("acc/") or old is None or candidate.get(key) is None:
            continue
        fam = key.split("/", 1)[1]
        allowed = max(floor.family_floors.get(fam, 0.0), gate.family_drop_tolerance)
        drop = old - candidate[key]
        drops[fam] = drop
        ci = (family_cis or {}).get(fam)
        if ci is not None and ci.get("ci_high") is not None:
            family_checks[fam] = {"test": "paired", "drop": drop, "allowed": allowed, "ci_low": ci["ci_low"],
                                  "ci_high": ci["ci_high"], "confidence_level": ci.get("confidence_level")}
            if ci["ci_high"] < -allowed:
                reasons.append(f"family guard: {fam} accuracy fell {drop:.4f}, significantly more than its noise "
                               f"{allowed:.4f} (paired {_level(ci)} CI of the change [{ci['ci_low']:+.4f}, "
                               f"{ci['ci_high']:+.4f}], upper end below -{allowed:.4f})")
        else:
            family_checks[fam] = {"test": "point: no paired CI for this family", "drop": drop,
                                  "allowed": allowed}
            if drop > allowed:
                reasons.append(f"family guard: {fam} accuracy fell {drop:.4f} (> its noise {allowed:.4f}; "
                               f"point comparison, no paired CI)")
    checks["family_drops"] = drops
    checks["family_guards"] = family_checks
    if answers_as_champion:
        reasons.append(IDENTICAL_PREDICTIONS)
    return PromotionDecision(promote=not reasons, reasons=tuple(reasons) or ("cleared the gate, the floor and every guard",),
                             checks=checks)


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def missing_value_reasons(floor: NoiseFloor, candidate: Mapping[str, Any], champion: Mapping[str, Any],
                          safety_families: Sequence[str], safety_cis: Mapping[str, Any] | None) -> list[str]:
    """Why a missing or NaN value would have skipped a part of the gate, one refusal per field (issue 34).

    No guard is skipped by a missing value: the noise floor (``noise_floor.floor``, its arms' values and
    its per-family floors) must be finite numbers (a NaN floor gave a bar of 0: ``max`` drops a NaN), the
    candidate's ECE must be a finite number, and each declared safety family with questions on test needs its
    paired CI or both point FNRs (a family with questions but no positive among them cannot be guarded, so
    nothing promotes; a family with no question on test at all, no ``acc/<family>``, has nothing to guard there).
    """
    reasons = []
    if not _finite(floor.floor):
        reasons.append(f"noise_floor.floor: must be a finite number (the null arms' spread), got {floor.floor!r}; "
                       f"no bar is measured, so nothing clears it")
    bad_values = [v for v in floor.values if not _finite(v)]
    if bad_values:
        reasons.append(f"noise_floor.values: every null arm's {floor.metric} must be a finite number, got "
                       f"{list(floor.values)!r}")
    bad_families = sorted(f for f, v in floor.family_floors.items() if not _finite(v))
    if bad_families:
        reasons.append(f"noise_floor.family_floors: {', '.join(bad_families)} must be finite numbers; their family "
                       f"guard would be skipped")
    ece = candidate.get("ece")
    if not _finite(ece):
        reasons.append(f"ece: the candidate's calibration guard needs its ECE, a finite number, got {ece!r}")
    for fam in safety_families:
        key = f"fnr/{fam}"
        ci = (safety_cis or {}).get(fam)
        if ci is not None and _finite(ci.get("ci_low")):
            continue
        if f"acc/{fam}" not in candidate and f"acc/{fam}" not in champion:
            continue  # the family has no question on test at all (the verifier's metrics, bound by result_sha256)
        new, old = candidate.get(key), champion.get(key)
        if not (_finite(new) and _finite(old)):
            reasons.append(f"safety guard: {key}: no paired CI for this family and no point FNR for both "
                           f"(candidate {new!r}, champion {old!r}; no positive of {fam} among the test questions?); "
                           f"a declared safety family is never skipped")
    return reasons


def _fmt(value: Any) -> str:
    return "n/a" if value is None else f"{float(value):.4f}"


def _level(ci: Mapping[str, Any]) -> str:
    level = ci.get("confidence_level")
    return "" if level is None else f"{level:.0%}"


def _one_sided(ci: Mapping[str, Any]) -> str:
    level = ci.get("confidence_level")
    return "" if level is None else f"{1 - (1 - level) / 2:.0%}"
