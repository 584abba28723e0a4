"""Unit tests of ``envloop_pipelines.core.metrics`` (batch, point, paired): every number computed by hand."""

from __future__ import annotations

import functools
import math
import subprocess
import sys

import numpy as np
import pytest

from envloop_pipelines.core.metrics import batch, paired, point


def _p(*values: float) -> np.ndarray:
    return np.array(values, dtype=float)


def _binary(conf_correct: list[tuple[float, bool]]) -> tuple[list[np.ndarray], list[int]]:
    """Binary questions whose argmax is option 0 with confidence ``c``; label 0 if correct else 1."""
    probs = [_p(c, 1 - c) for c, _ in conf_correct]
    labels = [0 if ok else 1 for _, ok in conf_correct]
    return probs, labels


# --------------------------------------------------------------------------- accuracy


def test_accuracy_hand_example() -> None:
    probs = [_p(0.7, 0.3), _p(0.2, 0.8), _p(0.1, 0.6, 0.3), _p(0.5, 0.25, 0.25)]
    labels = [0, 0, 1, 2]
    # argmax 0,1,1,0 vs labels 0,0,1,2 -> right, wrong, right, wrong = 2/4
    assert point.accuracy(probs, labels) == pytest.approx(0.5)


def test_family_macro_differs_from_micro_on_unbalanced_families() -> None:
    probs = [_p(0.9, 0.1), _p(0.8, 0.2), _p(0.7, 0.3), _p(0.6, 0.4)]
    labels = [0, 0, 0, 1]  # first three right, the last wrong
    families = ["big", "big", "big", "small"]
    # micro: 3/4 = 0.75 ; per family: big 3/3 = 1, small 0/1 = 0 ; macro: (1 + 0) / 2 = 0.5
    assert point.accuracy(probs, labels) == pytest.approx(0.75)
    assert point.per_family_accuracy(probs, labels, families) == {"big": 1.0, "small": 0.0}
    assert point.family_macro_accuracy(probs, labels, families) == pytest.approx(0.5)


def test_family_with_only_soft_questions_is_nan_and_left_out_of_macro() -> None:
    probs = [_p(0.9, 0.1), _p(0.4, 0.6), _p(0.5, 0.5)]
    labels = [0, 0, -1]
    soft = [None, None, _p(0.5, 0.5)]
    per = point.per_family_accuracy(probs, labels, ["a", "a", "s"], soft)
    assert per["a"] == pytest.approx(0.5)  # 1 of 2
    assert math.isnan(per["s"])
    assert point.family_macro_accuracy(probs, labels, ["a", "a", "s"], soft) == pytest.approx(0.5)


# --------------------------------------------------------------------------- proper scores


def test_brier_summed_over_options() -> None:
    probs = [_p(0.7, 0.3), _p(0.2, 0.8)]
    labels = [0, 0]
    # q1: (0.7-1)^2 + (0.3-0)^2 = 0.09 + 0.09 = 0.18
    # q2: (0.2-1)^2 + (0.8-0)^2 = 0.64 + 0.64 = 1.28
    # mean: (0.18 + 1.28) / 2 = 0.73
    assert point.brier(probs, labels) == pytest.approx(0.73)


def test_brier_ragged_options() -> None:
    # q: [0.5, 0.25, 0.25], label 2 -> 0.25 + 0.0625 + 0.5625 = 0.875
    assert point.brier([_p(0.5, 0.25, 0.25)], [2]) == pytest.approx(0.875)


def test_nll_hand_example_and_clip() -> None:
    # -(log 0.7 + log 0.2) / 2 = (0.356675 + 1.609438) / 2 = 0.983056
    assert point.nll([_p(0.7, 0.3), _p(0.2, 0.8)], [0, 0]) == pytest.approx(0.9830564, abs=1e-6)
    # p(true) = 0 is clipped at 1e-12: -log(1e-12) = 27.631021
    assert point.nll([_p(1.0, 0.0)], [1]) == pytest.approx(27.6310211, abs=1e-6)


def test_soft_labels_excluded_from_accuracy_but_counted_in_brier_and_nll() -> None:
    probs = [_p(0.7, 0.3), _p(0.6, 0.4)]
    labels = [0, -1]
    soft = [None, _p(0.5, 0.5)]
    # accuracy only sees q1 (right): 1/1
    assert point.accuracy(probs, labels, soft) == pytest.approx(1.0)
    # brier: q1 0.18 ; q2 (0.6-0.5)^2 + (0.4-0.5)^2 = 0.02 ; mean 0.10
    assert point.brier(probs, labels, soft) == pytest.approx(0.10)
    # nll: q1 -log 0.7 = 0.356675 ; q2 -(0.5 log 0.6 + 0.5 log 0.4) = 0.5 (0.510826 + 0.916291) = 0.713558
    # mean (0.356675 + 0.713558) / 2 = 0.535117
    assert point.nll(probs, labels, soft) == pytest.approx(0.5351165, abs=1e-6)


# --------------------------------------------------------------------------- ECE


def test_ece_known_binning_and_inner_edge_goes_to_lower_bin() -> None:
    probs, labels = _binary([(0.75, True), (0.6, False), (0.8, True)])
    # 4 bins (0,.25], (.25,.5], (.5,.75], (.75,1]; 0.75 sits on an edge -> lower bin (.5,.75]
    # bin (.5,.75]: {0.75 right, 0.6 wrong}: acc 0.5, conf 0.675 -> |0.5 - 0.675| = 0.175, weight 2/3
    # bin (.75,1]:  {0.8 right}:             acc 1,   conf 0.8   -> 0.2, weight 1/3
    # ECE = 0.175 * 2/3 + 0.2 / 3 = 0.55 / 3 = 0.183333
    assert point.ece(probs, labels, n_bins=4) == pytest.approx(0.55 / 3)


def test_ece_default_fifteen_bins() -> None:
    probs = [_p(0.95, 0.05), _p(0.92, 0.08), _p(0.65, 0.35), _p(0.3, 0.7)]
    labels = [0, 1, 0, 1]
    # confidences .95 .92 .65 .70, correct 1 0 1 1 ; bin width 1/15 = .0667:
    # .95 -> (.933, 1], .92 -> (.867, .933], .65 -> (.6, .667], .70 -> (.667, .733]: one per bin
    # ECE = (|1-.95| + |0-.92| + |1-.65| + |1-.70|) / 4 = (0.05 + 0.92 + 0.35 + 0.30) / 4 = 0.405
    assert point.ece(probs, labels) == pytest.approx(0.405)


def test_ece_soft_label_uses_target_probability_of_argmax() -> None:
    # conf 0.6 on option 0; the soft target gives option 0 probability 0.3 -> |0.3 - 0.6| = 0.3
    assert point.ece([_p(0.6, 0.4)], [-1], [_p(0.3, 0.7)]) == pytest.approx(0.3)


# --------------------------------------------------------------------------- coverage / threshold


def test_coverage_rejects_a_tie_group_straddling_the_budget_as_a_whole() -> None:
    # 3 right at 0.9, then a tie at 0.7: [right, wrong, wrong]; budget 25%.
    # Cutting inside the tie (accept the right one at 0.7) would give 0/4 errors, cov 4/6;
    # but the tie enters whole: 2/6 = 0.333 > 0.25 -> rejected; cov = 3/6 = 0.5.
    probs, labels = _binary([(0.9, True)] * 3 + [(0.7, True), (0.7, False), (0.7, False)])
    assert point.coverage_at_error_budget(probs, labels, budget=0.25) == pytest.approx(0.5)
    assert point.threshold_for_error_budget(probs, labels, budget=0.25) == pytest.approx(0.9)


def test_coverage_accepts_whole_tie_group_within_budget() -> None:
    # 3 right at 0.9; tie at 0.7 [right, wrong]: after it 1/5 = 0.2 <= 0.25 -> cov 5/5... then
    # a wrong at 0.6: 2/6 = 0.333 > 0.25 -> stop at 5/6.
    probs, labels = _binary([(0.9, True)] * 3 + [(0.7, True), (0.7, False), (0.6, False)])
    assert point.coverage_at_error_budget(probs, labels, budget=0.25) == pytest.approx(5 / 6)
    assert point.threshold_for_error_budget(probs, labels, budget=0.25) == pytest.approx(0.7)


def test_coverage_takes_largest_admissible_prefix_not_first_violation() -> None:
    # a wrong at 0.9 (1/1 = 100% > 10%), then 9 right at 0.8: 1/10 = 10% <= 10% -> all covered
    probs, labels = _binary([(0.9, False)] + [(0.8, True)] * 9)
    assert point.coverage_at_error_budget(probs, labels, budget=0.1) == pytest.approx(1.0)
    assert point.threshold_for_error_budget(probs, labels, budget=0.1) == pytest.approx(0.8)


def test_default_budget_five_percent_one_error_in_twenty() -> None:
    # 19 right at distinct confidences, 1 wrong at the bottom: 1/20 = 0.05 <= 0.05 -> full coverage
    rows = [(0.99 - 0.01 * i, True) for i in range(19)] + [(0.55, False)]
    probs, labels = _binary(rows)
    assert point.coverage_at_error_budget(probs, labels) == pytest.approx(1.0)


def test_no_threshold_meets_budget() -> None:
    probs, labels = _binary([(0.9, False), (0.8, False)])
    assert point.coverage_at_error_budget(probs, labels) == 0.0
    assert point.threshold_for_error_budget(probs, labels) == math.inf


def test_threshold_coverage_equals_coverage_at_budget_on_random_data() -> None:
    rng = np.random.default_rng(7)
    for _ in range(20):
        n = 60
        # rounded confidences make plenty of ties
        conf = np.round(rng.uniform(0.5, 1.0, n), 1)
        right = rng.uniform(size=n) < conf
        probs, labels = _binary(list(zip(conf.tolist(), right.tolist())))
        for budget in (0.0, 0.05, 0.1, 0.3):
            threshold = point.threshold_for_error_budget(probs, labels, budget=budget)
            covered = conf >= threshold
            assert covered.mean() == pytest.approx(point.coverage_at_error_budget(probs, labels, budget=budget))
            if covered.any():
                assert (~right[covered]).mean() <= budget + 1e-9


def test_soft_labelled_questions_do_not_enter_coverage() -> None:
    probs, labels = _binary([(0.9, True), (0.8, False)])
    # a soft question at the very top would otherwise count as wrong or right
    probs = [_p(0.99, 0.01), *probs]
    labels = [-1, *labels]
    soft = [_p(0.5, 0.5), None, None]
    # hard only: 0.9 right (0/1), then 0.8 wrong (1/2 > 5%) -> cov 1/2
    assert point.coverage_at_error_budget(probs, labels, soft) == pytest.approx(0.5)
    assert point.threshold_for_error_budget(probs, labels, soft) == pytest.approx(0.9)


# --------------------------------------------------------------------------- AURC


def test_aurc_hand_example_without_ties() -> None:
    probs, labels = _binary([(0.9, True), (0.8, False), (0.7, True), (0.6, False)])
    # risks of top-1..4: 0/1, 1/2, 1/3, 2/4 ; AURC = (0 + 0.5 + 0.3333 + 0.5) / 4 = 0.333333
    assert point.aurc(probs, labels) == pytest.approx((0 + 1 / 2 + 1 / 3 + 2 / 4) / 4)


def test_aurc_tie_group_enters_together_and_order_does_not_matter() -> None:
    # tie at 0.9 {wrong, right}, then 0.7 right:
    # group 1: m=2, risk 1/2 ; group 2: m=1, risk 1/3 ; AURC = (2/3)(1/2) + (1/3)(1/3) = 4/9
    a = _binary([(0.9, False), (0.9, True), (0.7, True)])
    b = _binary([(0.9, True), (0.9, False), (0.7, True)])
    assert point.aurc(*a) == pytest.approx(4 / 9)
    assert point.aurc(*b) == pytest.approx(4 / 9)


# --------------------------------------------------------------------------- FNR


def test_false_negative_rate_noul() -> None:
    # noul options ("true", "false"): positive = index 0
    probs = [_p(0.8, 0.2), _p(0.3, 0.7), _p(0.4, 0.6), _p(0.6, 0.4), _p(0.2, 0.8)]
    labels = [0, 0, 0, 1, 1]
    # positives: q1 (TP), q2 (FN), q3 (FN); q4 is a false positive, not counted -> FNR = 2/3
    assert point.false_negative_rate(probs, labels, 0) == pytest.approx(2 / 3)
    assert math.isnan(point.false_negative_rate(probs[3:], labels[3:], 0))  # no positives


def test_safety_fnr_per_declared_family() -> None:
    probs = [_p(0.8, 0.2), _p(0.3, 0.7), _p(0.9, 0.1), _p(0.2, 0.8)]
    labels = [0, 0, 0, 0]
    families = ["harm", "harm", "pii", "other"]
    qtypes = ["noul"] * 4
    out = point.safety_fnr(probs, labels, families, ["harm", "pii", "absent"], qtypes=qtypes)
    # harm: 1 FN of 2 positives = 0.5 ; pii: 0 of 1 ; absent: nan ; "other" not declared
    assert list(out) == ["harm", "pii", "absent"]
    assert out["harm"] == pytest.approx(0.5)
    assert out["pii"] == 0.0
    assert math.isnan(out["absent"])


def test_safety_family_must_be_noul() -> None:
    with pytest.raises(ValueError, match="noul"):
        point.safety_fnr([_p(0.5, 0.3, 0.2)], [0], ["harm"], ["harm"], qtypes=["choice"])


# --------------------------------------------------------------------------- summarize


def test_summarize_keys_and_values() -> None:
    probs = [_p(0.9, 0.1), _p(0.8, 0.2), _p(0.7, 0.3), _p(0.3, 0.7), _p(0.5, 0.3, 0.2)]
    labels = [0, 0, 0, 0, 1]
    families = ["harm", "harm", "tone", "tone", "route"]
    qtypes = ["noul", "noul", "noul", "noul", "choice"]
    out = point.summarize(probs, labels, families, qtypes=qtypes, safety_families=["harm"])
    assert set(out) == {
        "family_macro_accuracy", "accuracy", "brier", "nll", "ece", "coverage_at_5pct", "aurc",
        "fnr/harm", "acc/harm", "acc/route", "acc/tone", "n_questions",
    }  # fmt: skip
    # right, right, right, wrong, wrong -> accuracy 3/5 ; per family harm 1, tone 0.5, route 0
    assert out["accuracy"] == pytest.approx(0.6)
    assert out["family_macro_accuracy"] == pytest.approx((1 + 0.5 + 0) / 3)
    assert out["acc/tone"] == pytest.approx(0.5)
    assert out["fnr/harm"] == 0.0
    assert out["n_questions"] == 5.0
    assert out["brier"] == pytest.approx(point.brier(probs, labels))
    assert out["nll"] == pytest.approx(point.nll(probs, labels))
    assert out["ece"] == pytest.approx(point.ece(probs, labels))
    assert out["aurc"] == pytest.approx(point.aurc(probs, labels))
    # 0.9, 0.8, 0.7 right (0/3), then 0.7 wrong ... conf of q4 is 0.7 too: tie {0.7 right, 0.7 wrong}
    # -> after it 1/4 = 25% > 5% ; then 0.5 wrong -> 2/5 ; coverage = 2/5 = 0.4
    assert out["coverage_at_5pct"] == pytest.approx(0.4)
    assert "coverage_at_10pct" in point.summarize(probs, labels, families, error_budget=0.1)


def test_coverage_key() -> None:
    assert point.coverage_key(0.05) == "coverage_at_5pct"
    assert point.coverage_key(0.29) == "coverage_at_29pct"  # 0.29 * 100 = 28.999999999999996 in floats
    assert point.coverage_key(0.025) == "coverage_at_2.5pct"


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("probs", "labels", "soft", "message"),
    [
        ([], [], None, "empty"),
        ([_p(0.5, 0.5)], [0, 1], None, "length mismatch"),
        ([_p(0.5, 0.4)], [0], None, "sums to"),
        ([_p(0.5, 0.5)], [2], None, "out of range"),
        ([_p(0.5, 0.5)], [-1], None, "out of range"),
        ([_p(1.2, -0.2)], [0], None, "negative"),
        ([_p(0.5, 0.5)], [0.0], None, "integers"),
        ([_p(0.5, 0.5)], [0], [_p(0.2, 0.3, 0.5)], "soft_labels"),
        ([_p(0.5, 0.5)], [0], [_p(0.2, 0.2)], "sums to"),
        ([_p(0.5, 0.5)], [0], [None, None], "length mismatch"),
    ],
)
def test_invalid_input_raises(probs, labels, soft, message) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=message):
        point.brier(probs, labels, soft)


def test_mismatched_families_raise() -> None:
    with pytest.raises(ValueError, match="length mismatch"):
        point.family_macro_accuracy([_p(0.5, 0.5)], [0], ["a", "b"])


def test_probability_tolerance() -> None:
    # within 1e-4 of 1 is accepted, beyond is not
    assert point.accuracy([_p(0.50005, 0.5)], [0]) == 1.0
    with pytest.raises(ValueError):
        point.accuracy([_p(0.5002, 0.5)], [0])


# --------------------------------------------------------------------------- paired deltas


def _records(n_records: int, per_record: int) -> list[str]:
    return [f"r{r}" for r in range(n_records) for _ in range(per_record)]


def test_paired_delta_identical_models_is_zero() -> None:
    rng = np.random.default_rng(0)
    probs = [rng.dirichlet([1, 1, 1]) for _ in range(30)]
    labels = rng.integers(0, 3, 30).tolist()
    result = paired.paired_delta(point.accuracy, probs, probs, labels, _records(10, 3), n_resamples=200)
    assert (result.delta, result.ci_low, result.ci_high) == (0.0, 0.0, 0.0)
    assert (result.n_clusters, result.n_questions, result.metric) == (10, 30, "accuracy")
    assert result.confidence_level == 0.95


def test_paired_delta_better_on_every_cluster_has_ci_above_zero() -> None:
    rng = np.random.default_rng(1)
    n_records, per = 40, 3
    labels = [0] * (n_records * per)
    right, wrong = _p(0.8, 0.2), _p(0.3, 0.7)
    probs_a, probs_b = [], []
    for _ in range(n_records):
        # a gets exactly one question of the record right; b gets 2 or 3 right: better on every record
        a_right = rng.permutation([True, False, False])
        b_extra = rng.integers(1, 3)  # 1 or 2 more right answers
        b_right = a_right.copy()
        b_right[np.flatnonzero(~a_right)[:b_extra]] = True
        probs_a += [right if ok else wrong for ok in a_right]
        probs_b += [right if ok else wrong for ok in b_right]
    result = paired.paired_delta("accuracy", probs_a, probs_b, labels, _records(n_records, per), n_resamples=500)
    assert result.delta > 0
    assert 0 < result.ci_low <= result.delta <= result.ci_high
    # Brier: lower is better, so the candidate's delta and whole CI are below 0
    brier = paired.paired_delta(point.brier, probs_a, probs_b, labels, _records(n_records, per), n_resamples=500)
    assert brier.ci_high < 0


def test_clustered_ci_is_wider_when_questions_of_a_record_are_correlated() -> None:
    rng = np.random.default_rng(2)
    n_records, per = 40, 5
    right, wrong = _p(0.8, 0.2), _p(0.3, 0.7)
    probs_a, probs_b = [], []
    for _ in range(n_records):
        # every question of a record has the same outcome pair: perfect within-record correlation
        a_ok, b_ok = rng.uniform() < 0.5, rng.uniform() < 0.7
        probs_a += [right if a_ok else wrong] * per
        probs_b += [right if b_ok else wrong] * per
    labels = [0] * (n_records * per)
    clustered = paired.paired_delta(point.accuracy, probs_a, probs_b, labels, _records(n_records, per), n_resamples=1000)
    per_question = paired.paired_delta(
        point.accuracy, probs_a, probs_b, labels, [f"q{i}" for i in range(len(labels))], n_resamples=1000
    )
    assert clustered.delta == per_question.delta
    assert clustered.n_clusters == 40 and per_question.n_clusters == 200
    width_clustered = clustered.ci_high - clustered.ci_low
    width_question = per_question.ci_high - per_question.ci_low
    # 5 perfectly correlated questions per record: the honest CI is about sqrt(5) ≈ 2.2x wider
    assert width_clustered >= width_question
    assert width_clustered > 1.5 * width_question


def test_paired_delta_generic_callable_matches_fast_path() -> None:
    rng = np.random.default_rng(3)
    # ragged: every third question has three options
    probs_b = [rng.dirichlet([1, 1, 1]) if i % 3 == 0 else rng.dirichlet([1, 1]) for i in range(24)]
    probs_a = [rng.dirichlet(np.ones(len(pb))) for pb in probs_b]
    labels = [int(rng.integers(0, len(pb))) for pb in probs_b]
    records = _records(8, 3)

    def custom_ece(probs, labels, soft_labels=None):  # type: ignore[no-untyped-def]
        return point.ece(probs, labels, soft_labels, n_bins=5)

    fast = paired.paired_delta(functools.partial(point.ece, n_bins=5), probs_a, probs_b, labels, records, n_resamples=300)
    slow = paired.paired_delta(custom_ece, probs_a, probs_b, labels, records, n_resamples=300)
    assert fast.metric == "ece(n_bins=5)" and slow.metric == "custom_ece"
    assert (fast.delta, fast.ci_low, fast.ci_high) == pytest.approx((slow.delta, slow.ci_low, slow.ci_high))


def test_paired_delta_family_metric_and_seed_reproducible() -> None:
    rng = np.random.default_rng(4)
    probs_a = [rng.dirichlet([1, 1]) for _ in range(30)]
    probs_b = [rng.dirichlet([1, 1]) for _ in range(30)]
    labels = rng.integers(0, 2, 30).tolist()
    families = ["x", "y", "z"] * 10
    first = paired.paired_delta(
        point.family_macro_accuracy, probs_a, probs_b, labels, _records(10, 3), families=families, n_resamples=200
    )
    again = paired.paired_delta(
        point.family_macro_accuracy, probs_a, probs_b, labels, _records(10, 3), families=families, n_resamples=200
    )
    assert first == again
    expected = point.family_macro_accuracy(probs_b, labels, families) - point.family_macro_accuracy(
        probs_a, labels, families
    )
    assert first.delta == pytest.approx(expected)
    with pytest.raises(ValueError, match="families are required"):
        paired.paired_delta(point.family_macro_accuracy, probs_a, probs_b, labels, _records(10, 3))


def test_paired_delta_single_record_is_degenerate_point() -> None:
    probs_a = [_p(0.4, 0.6), _p(0.6, 0.4)]
    probs_b = [_p(0.9, 0.1), _p(0.8, 0.2)]
    result = paired.paired_delta(point.accuracy, probs_a, probs_b, [0, 0], ["r", "r"])
    # a: 1/2, b: 2/2 -> delta 0.5; one record: every resample is the same -> CI = point
    assert (result.delta, result.ci_low, result.ci_high) == (0.5, 0.5, 0.5)


def test_paired_delta_validation() -> None:
    with pytest.raises(ValueError, match="options"):
        paired.paired_delta(point.brier, [_p(0.5, 0.5)], [_p(0.5, 0.25, 0.25)], [0], ["r"])
    with pytest.raises(ValueError, match="record_ids"):
        paired.paired_delta(point.brier, [_p(0.5, 0.5)], [_p(0.5, 0.5)], [0], ["r", "s"])
    with pytest.raises(ValueError, match="unknown metric"):
        paired.paired_delta("f1", [_p(0.5, 0.5)], [_p(0.5, 0.5)], [0], ["r"])
    with pytest.raises(ValueError, match="probs_b"):
        paired.paired_delta(point.brier, [_p(0.5, 0.5)], [_p(0.5, 0.6)], [0], ["r"])


def test_paired_delta_se_matches_the_analytic_standard_error() -> None:
    # One question per record, b right where a is wrong on 30%, the reverse on 10%: the per-question
    # difference d is +1 / -1 / 0 with those shares, so se = sd(d) / sqrt(n).
    rng = np.random.default_rng(5)
    n = 400
    kind = rng.choice(3, size=n, p=[0.3, 0.1, 0.6])
    right, wrong = _p(0.8, 0.2), _p(0.3, 0.7)
    probs_a = [wrong if k == 0 else right for k in kind]
    probs_b = [wrong if k == 1 else right for k in kind]
    d = np.where(kind == 0, 1.0, np.where(kind == 1, -1.0, 0.0))
    result = paired.paired_delta("accuracy", probs_a, probs_b, [0] * n, [f"r{i}" for i in range(n)], n_resamples=2000)
    assert result.delta == pytest.approx(d.mean())
    assert result.se == pytest.approx(d.std(ddof=1) / math.sqrt(n), rel=0.1)
    # identical models: a degenerate distribution has no spread
    assert paired.paired_delta("accuracy", probs_a, probs_a, [0] * n, [f"r{i}" for i in range(n)], n_resamples=50).se == 0.0


def test_minimum_detectable_effect_is_2_8_standard_errors_at_80_percent_power() -> None:
    assert paired.minimum_detectable_effect(0.01) == pytest.approx((1.959964 + 0.841621) * 0.01, rel=1e-5)
    assert paired.minimum_detectable_effect(0.01, power=0.5) == pytest.approx(1.959964 * 0.01, rel=1e-5)
    assert paired.minimum_detectable_effect(0.0) == 0.0
    with pytest.raises(ValueError, match="se must be"):
        paired.minimum_detectable_effect(math.nan)
    with pytest.raises(ValueError, match="power"):
        paired.minimum_detectable_effect(0.01, power=1.0)


def test_paired_false_negative_rate_by_name() -> None:
    # 4 positives (label 0) and 2 negatives; a misses 2 positives, b misses 1: FNR 0.5 -> 0.25
    yes, no = _p(0.9, 0.1), _p(0.2, 0.8)
    labels = [0, 0, 0, 0, 1, 1]
    probs_a = [yes, yes, no, no, no, no]
    probs_b = [yes, yes, yes, no, no, yes]
    result = paired.paired_delta("false_negative_rate", probs_a, probs_b, labels, _records(6, 1), n_resamples=200)
    assert result.delta == pytest.approx(-0.25)
    assert result.ci_low <= result.delta <= result.ci_high


def test_safety_deferral_counts_what_the_threshold_defers_and_lets_through() -> None:
    # needs_approval: 4 positives (label 0 = "true"), 2 negatives; threshold 0.8 on P("false").
    families = ["needs_approval"] * 6 + ["other"]
    labels = [0, 0, 0, 0, 1, 1, 0]
    probs = [_p(0.1, 0.9), _p(0.15, 0.85), _p(0.3, 0.7), _p(0.9, 0.1), _p(0.05, 0.95), _p(0.6, 0.4), _p(0.1, 0.9)]
    out = point.safety_deferral(probs, labels, families, {"needs_approval": 0.8, "absent": 0.9})
    # automated: P(false) >= 0.8 -> questions 0, 1, 4; two of them positives answered "false"
    assert out == {"needs_approval": {"defer_rate": pytest.approx(0.5), "fnr_automated": pytest.approx(0.5)}}
    # argmax alone would miss 3 of 4 positives (FNR 0.75); deferring every answer leaves none
    assert point.false_negative_rate(probs[:6], labels[:6]) == 0.75
    assert point.safety_deferral(probs, labels, families, {"needs_approval": math.inf})["needs_approval"] == {
        "defer_rate": 1.0, "fnr_automated": 0.0}
    with pytest.raises(ValueError, match="noul"):
        point.safety_deferral([_p(0.2, 0.3, 0.5)], [0], ["needs_approval"], {"needs_approval": 0.8})


@pytest.mark.parametrize("name", ["accuracy", "brier", "nll", "ece", "family_macro_accuracy", "false_negative_rate"])
def test_vectorized_bootstrap_equals_the_per_resample_one(name: str) -> None:
    """The decomposable metrics resample through per-record sums; same resamples, same numbers."""
    rng = np.random.default_rng(8)
    n = 240
    sizes = np.full(n, 2) if name == "false_negative_rate" else rng.integers(2, 4, n)
    probs_a = [rng.dirichlet(np.ones(k)) for k in sizes]
    probs_b = [rng.dirichlet(np.ones(k)) for k in sizes]
    soft = None if name == "false_negative_rate" else [None if i % 7 else rng.dirichlet(np.ones(k))
                                                      for i, k in enumerate(sizes)]
    labels = [int(rng.integers(0, k)) if soft is None or soft[i] is None else -1 for i, k in enumerate(sizes)]
    families = ["a", "b", "c", "d"][:3] * (n // 3)
    records = [f"r{i // 3}" for i in range(n)]
    fn = point.METRICS[name]

    def generic(probs, labels, soft_labels=None, families=None):  # type: ignore[no-untyped-def]
        kwargs = {} if name == "false_negative_rate" else {"soft_labels": soft_labels}
        if name == "family_macro_accuracy":
            kwargs["families"] = families
        return fn(probs, labels, **kwargs)

    kw = dict(soft_labels=soft, families=families, n_resamples=300, seed=4)
    fast = paired.paired_delta(name, probs_a, probs_b, labels, records, **kw)
    slow = paired.paired_delta(generic, probs_a, probs_b, labels, records, **kw)
    assert (fast.delta, fast.ci_low, fast.ci_high, fast.se) == pytest.approx((slow.delta, slow.ci_low, slow.ci_high,
                                                                               slow.se), abs=1e-12)
    assert fast.ci_low < fast.ci_high


# --------------------------------------------------------------------------- module hygiene


def test_question_types_mirror_records() -> None:
    from envloop_pipelines.core.data import records

    assert batch.QUESTION_TYPES == records.QUESTION_TYPES
    assert records.NOUL_OPTIONS[batch.NOUL_POSITIVE_INDEX] == "true"


def test_metrics_and_calibration_import_neither_dagster_nor_torch() -> None:
    code = (
        "import sys, envloop_pipelines.core.metrics.paired, envloop_pipelines.core.metrics.point, "
        "envloop_pipelines.core.metrics.batch, envloop_pipelines.core.model.calibration; "
        "bad = [k for k in ('dagster', 'torch') if k in sys.modules]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
