"""Unit tests of ``envloop_pipelines.core.model.calibration``."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from envloop_pipelines.core.metrics import point
from envloop_pipelines.core.model.calibration import (
    Calibration,
    fit_calibration,
    fit_temperature,
    softmax,
)


def _synthetic(
    n: int, n_options: int, scale: float, seed: int
) -> tuple[list[np.ndarray], list[int], list[np.ndarray]]:
    """Labels drawn from softmax(true logits); the model reports ``scale * true logits``.

    ``scale > 1`` is an over-confident model (the right temperature is ``scale``),
    ``scale < 1`` an under-confident one.
    """
    rng = np.random.default_rng(seed)
    true_logits = rng.normal(0.0, 1.5, size=(n, n_options))
    true_probs = softmax(true_logits)
    labels = [int(rng.choice(n_options, p=p)) for p in true_probs]
    return [scale * z for z in true_logits], labels, list(true_probs)


def _nll_at(logits: list[np.ndarray], labels: list[int], temperature: float) -> float:
    return point.nll([softmax(z, temperature) for z in logits], labels)


# --------------------------------------------------------------------------- softmax


def test_softmax_values_and_stability() -> None:
    # softmax([0, ln 3]) = [1/4, 3/4]
    assert softmax(np.array([0.0, math.log(3.0)])) == pytest.approx([0.25, 0.75])
    # temperature 2 halves the logits: softmax([0, 2 ln 3] / 2) = [1/4, 3/4]
    assert softmax(np.array([0.0, 2 * math.log(3.0)]), 2.0) == pytest.approx([0.25, 0.75])
    # no overflow: exp(1000) would be inf without subtracting the max
    big = softmax(np.array([1000.0, 0.0, -1000.0]))
    assert np.all(np.isfinite(big)) and big == pytest.approx([1.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="temperature"):
        softmax(np.array([0.0, 1.0]), 0.0)


# --------------------------------------------------------------------------- temperature


def test_overconfident_logits_get_temperature_above_one_and_nll_drops() -> None:
    logits, labels, _ = _synthetic(3000, 3, scale=3.0, seed=0)
    temperature = fit_temperature(logits, labels)
    assert temperature > 1.0
    assert temperature == pytest.approx(3.0, rel=0.15)  # recovers the over-confidence factor
    assert _nll_at(logits, labels, temperature) < _nll_at(logits, labels, 1.0) - 0.1


def test_underconfident_logits_get_temperature_below_one() -> None:
    logits, labels, _ = _synthetic(3000, 4, scale=0.5, seed=1)
    temperature = fit_temperature(logits, labels)
    assert temperature == pytest.approx(0.5, rel=0.15)
    assert _nll_at(logits, labels, temperature) < _nll_at(logits, labels, 1.0)


def test_fitted_temperature_is_the_nll_minimum() -> None:
    logits, labels, _ = _synthetic(500, 2, scale=2.0, seed=2)
    temperature = fit_temperature(logits, labels)
    best = _nll_at(logits, labels, temperature)
    for nearby in (temperature * 0.97, temperature * 1.03):
        assert best <= _nll_at(logits, labels, nearby)


def test_soft_labels_fit_the_same_temperature() -> None:
    # the true probabilities as soft targets: cross-entropy is minimised at T = scale exactly
    logits, labels, true_probs = _synthetic(500, 3, scale=2.5, seed=3)
    temperature = fit_temperature(logits, [-1] * len(labels), true_probs)
    assert temperature == pytest.approx(2.5, rel=1e-3)


def test_ragged_logits() -> None:
    two, labels_two, _ = _synthetic(800, 2, scale=2.0, seed=4)
    five, labels_five, _ = _synthetic(800, 5, scale=2.0, seed=5)
    assert fit_temperature(two + five, labels_two + labels_five) == pytest.approx(2.0, rel=0.2)


def test_separable_data_stops_at_the_lower_bound() -> None:
    # every label is the argmax by a wide margin: NLL keeps falling as T -> 0, so
    # only the bound stops it (below T ≈ 0.12 the NLL, ~exp(-5/T), is 0 in float64:
    # any T there is a minimiser).
    logits = [np.array([5.0, 0.0]), np.array([0.0, 5.0])] * 10
    labels = [0, 1] * 10
    temperature = fit_temperature(logits, labels)
    assert 0.05 <= temperature < 0.2
    assert fit_temperature(logits, labels, bounds=(0.5, 20.0)) == pytest.approx(0.5, rel=1e-3)


@pytest.mark.parametrize(
    ("logits", "labels", "message"),
    [
        ([], [], "empty"),
        ([np.array([0.0, 1.0])], [0, 1], "length mismatch"),
        ([np.array([0.0, 1.0])], [2], "labels"),
        ([np.array([0.0, np.inf])], [0], "non-finite"),
    ],
)
def test_fit_temperature_validation(logits, labels, message) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=message):
        fit_temperature(logits, labels)


# --------------------------------------------------------------------------- calibration


def _mixed_val() -> tuple[list[np.ndarray], list[int], list[str]]:
    noul, noul_labels, _ = _synthetic(1500, 2, scale=3.0, seed=10)  # over-confident
    choice, choice_labels, _ = _synthetic(1500, 4, scale=1.0, seed=11)  # already calibrated
    return noul + choice, noul_labels + choice_labels, ["noul"] * 1500 + ["choice"] * 1500


def test_fit_calibration_per_type_temperatures() -> None:
    logits, labels, qtypes = _mixed_val()
    calibration = fit_calibration(logits, labels, qtypes)
    assert calibration.temperatures["noul"] == pytest.approx(3.0, rel=0.15)
    assert calibration.temperatures["choice"] == pytest.approx(1.0, rel=0.15)
    assert calibration.temperatures["score"] == 1.0  # absent from val
    assert calibration.error_budget == 0.05
    probs = calibration.apply_all(logits, qtypes)
    raw = [softmax(z) for z in logits]
    assert point.nll(probs, labels) < point.nll(raw, labels)


def test_threshold_meets_the_budget_on_the_fitting_data() -> None:
    logits, labels, qtypes = _mixed_val()
    for budget in (0.05, 0.1):
        calibration = fit_calibration(logits, labels, qtypes, error_budget=budget)
        probs = calibration.apply_all(logits, qtypes)
        conf = np.array([p.max() for p in probs])
        wrong = np.array([int(np.argmax(p)) != y for p, y in zip(probs, labels)])
        automated = conf >= calibration.automation_threshold
        assert automated.any() and math.isfinite(calibration.automation_threshold)
        assert wrong[automated].mean() <= budget
        assert automated.mean() == pytest.approx(point.coverage_at_error_budget(probs, labels, budget=budget))
        assert calibration.automate(probs[int(np.argmax(conf))])


def test_threshold_is_inf_when_no_prefix_meets_the_budget() -> None:
    # the model is confidently wrong everywhere
    logits = [np.array([3.0, 0.0]), np.array([0.0, 3.0])]
    calibration = fit_calibration(logits, [1, 0], ["noul", "noul"])
    assert calibration.automation_threshold == math.inf
    assert not calibration.automate(np.array([1.0, 0.0]))


def test_apply_uses_the_type_temperature() -> None:
    calibration = Calibration(temperatures={"noul": 2.0}, automation_threshold=0.9)
    z = np.array([0.0, 2 * math.log(3.0)])
    assert calibration.apply(z, "noul") == pytest.approx([0.25, 0.75])  # T = 2
    assert calibration.apply(z, "score") == pytest.approx(softmax(z))  # default T = 1
    with pytest.raises(ValueError, match="question type"):
        calibration.apply(z, "essay")


def test_to_dict_from_dict_round_trip_is_strict_json() -> None:
    fitted = fit_calibration(*_mixed_val())
    for calibration in (fitted, Calibration(temperatures={"choice": 1.7}, automation_threshold=math.inf)):
        text = json.dumps(calibration.to_dict(), allow_nan=False)  # no Infinity / NaN tokens
        assert Calibration.from_dict(json.loads(text)) == calibration
    assert Calibration(automation_threshold=math.inf).to_dict()["automation_threshold"] is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperatures": {"essay": 1.0}}, "unknown question types"),
        ({"temperatures": {"noul": 0.0}}, "finite positive"),
        ({"automation_threshold": math.nan}, "nan"),
        ({"error_budget": 1.5}, "error_budget"),
    ],
)
def test_calibration_validation(kwargs, message) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=message):
        Calibration(**kwargs)


def test_fit_calibration_validation() -> None:
    with pytest.raises(ValueError, match="qtypes must be one of"):
        fit_calibration([np.array([0.0, 1.0])], [0], ["essay"])
    with pytest.raises(ValueError, match="length mismatch"):
        fit_calibration([np.array([0.0, 1.0])], [0], ["noul", "noul"])
    with pytest.raises(ValueError, match="unknown keys"):
        Calibration.from_dict({"temperatures": {}, "threshold": 0.9})


# --------------------------------------------------------------------------- safety families defer


def test_safety_threshold_on_scores_where_the_answer_is_known() -> None:
    from envloop_pipelines.core.model.calibration import safety_threshold

    # Ten positives with P("false") 0.05 .. 0.95 and ten negatives: a 10% FNR target lets one positive
    # (the 0.95) be answered automatically, so the threshold sits just above the second largest, 0.85.
    pos = [0.05 + 0.1 * i for i in range(10)]
    neg = [0.5 + 0.05 * i for i in range(10)]
    p, positive = pos + neg, [True] * 10 + [False] * 10
    t = safety_threshold(p, positive, 0.10)
    assert 0.85 < t <= 0.8500001
    fnr = sum(1 for x, y in zip(p, positive) if y and x >= t) / 10
    assert fnr == 0.1
    assert sum(1 for x in neg if x >= t) == 2  # the 0.9 and 0.95 negatives are automated
    # 0%: no positive may pass; a target under one positive in ten rounds down to zero as well.
    assert safety_threshold(p, positive, 0.0) > 0.95 and safety_threshold(p, positive, 0.09) > 0.95
    # Ties go together: two positives at 0.9 with room for one -> both defer.
    tied = [0.9, 0.9] + [0.1] * 8
    assert safety_threshold(tied, [True] * 10, 0.10) > 0.9
    assert math.isinf(safety_threshold([0.2, 0.7], [False, False], 0.1))  # nothing to fit on: defer all
    with pytest.raises(ValueError, match="fnr_target"):
        safety_threshold(p, positive, 1.0)


def test_fit_calibration_fits_the_safety_family_to_its_fnr_target_on_val() -> None:
    rng = np.random.default_rng(11)
    n = 400
    families = ["needs_approval" if i % 2 else "other" for i in range(n)]
    labels = rng.integers(0, 2, n).tolist()
    # A noisy but informative model: the logit of "true" is higher for positives.
    logits = [np.array([1.2 * (1 if y == 0 else -1) + rng.normal(0, 1.5), 0.0]) for y in labels]
    cal = fit_calibration(logits, labels, ["noul"] * n, families=families, safety_families=["needs_approval"],
                          safety_fnr_target=0.10)
    assert set(cal.safety_thresholds) == {"needs_approval"} and cal.safety_fnr_target == 0.10
    t = cal.safety_thresholds["needs_approval"]
    probs = cal.apply_all(logits, ["noul"] * n)
    rows = [i for i in range(n) if families[i] == "needs_approval"]
    pos = [i for i in rows if labels[i] == 0]
    p_false = np.array([probs[i][1] for i in pos])
    assert (p_false >= t).sum() / len(pos) <= 0.10  # the target holds on val ...
    below = p_false[p_false < t].max()
    assert (p_false >= below).sum() / len(pos) > 0.10  # ... and the next lower threshold would break it
    # argmax alone would miss far more positives: that is what deferral buys
    assert (p_false > 0.5).mean() > 0.2
    # stored with the calibration: JSON round trip, +inf as null, old calibrations unchanged
    again = Calibration.from_dict(json.loads(json.dumps(cal.to_dict())))
    assert again == cal
    inf = Calibration(safety_thresholds={"needs_approval": math.inf})
    assert inf.to_dict()["safety_thresholds"] == {"needs_approval": None}
    assert Calibration.from_dict(inf.to_dict()) == inf
    assert set(Calibration().to_dict()) == {"temperatures", "automation_threshold", "error_budget"}
    with pytest.raises(ValueError, match="must hold only noul"):
        fit_calibration([np.zeros(3), np.zeros(2)], [0, 0], ["choice", "noul"], families=["needs_approval"] * 2,
                        safety_families=["needs_approval"])
    with pytest.raises(ValueError, match="families"):
        fit_calibration(logits, labels, ["noul"] * n, safety_families=["needs_approval"])


def test_a_safety_question_defers_below_its_threshold() -> None:
    cal = Calibration(automation_threshold=0.6, safety_thresholds={"needs_approval": 0.9})
    assert cal.deferral([0.05, 0.95], "needs_approval") is None  # confidently "no approval needed"
    assert cal.deferral([0.2, 0.8], "needs_approval") == "safety"  # under its threshold: a person decides
    assert cal.deferral([0.95, 0.05], "needs_approval") == "safety"  # "approval needed": a person decides
    assert cal.deferral([0.2, 0.8], "other") is None  # not a safety family: the general threshold only
    assert cal.deferral([0.45, 0.55], "other") == "confidence"
    assert cal.deferral([0.45, 0.55]) == "confidence"
    assert Calibration(safety_thresholds={"needs_approval": math.inf}).deferral([0.0, 1.0], "needs_approval") == "safety"
    with pytest.raises(ValueError, match="must be noul"):
        cal.deferral([0.1, 0.1, 0.8], "needs_approval")


def test_the_safety_threshold_never_automates_a_true_answer() -> None:
    from envloop_pipelines.core.model.calibration import safety_threshold

    # A good model: every positive has P("false") under 0.3. The FNR target alone would allow 0.2, but an
    # answer "true" is a person's call, so the threshold stays above 0.5.
    t = safety_threshold([0.1, 0.2, 0.25, 0.05, 0.9, 0.8], [True, True, True, True, False, False], 0.25)
    assert 0.5 < t < 0.5 + 1e-12
