"""benchmarks.support.timing.paired_ratio_interval: the interval ``make bench-peers`` prints for
each ratio."""

from __future__ import annotations

import random
import statistics

import pytest

from benchmarks.support.timing import paired_ratio_interval


def test_fifteen_rounds_give_the_fourth_ratio_from_each_end() -> None:
    # Binomial(15, 1/2): P(X <= 3) = 576 / 32768, so ranks 4 and 12 cover >= 96.5%; ranks 5
    # and 11 would cover only 88%.
    den = [1.0] * 15
    num = [1.0 + i / 100 for i in range(15)]
    random.Random(3).shuffle(num)
    assert paired_ratio_interval(num, den) == pytest.approx((1.03, 1.07, 1.11))


def test_too_few_rounds_give_the_whole_range() -> None:
    assert paired_ratio_interval([2.0, 3.0, 5.0], [1.0, 1.0, 1.0]) == (2.0, 3.0, 5.0)


def test_drift_shared_by_a_round_cancels_out() -> None:
    # Each round runs ten times slower or faster than the last; both ops feel it alike.
    rng = random.Random(7)
    drift = [10.0 ** rng.uniform(-1, 1) for _ in range(15)]
    assert len(set(drift)) == 15
    num = list(drift)
    den = [d * 1.25 for d in drift]
    low, mid, high = paired_ratio_interval(num, den)
    assert (low, mid, high) == pytest.approx((0.8, 0.8, 0.8))


def test_the_interval_holds_the_true_median_ratio_as_often_as_it_says() -> None:
    rng = random.Random(11)
    trials, held = 2000, 0
    for _ in range(trials):
        # Ratios spread log-normally around 1.1 (their median), with the rounds' drift.
        drift = [rng.uniform(0.5, 2.0) for _ in range(15)]
        den = list(drift)
        num = [d * 1.1 * rng.lognormvariate(0, 0.2) for d in drift]
        low, _, high = paired_ratio_interval(num, den)
        held += low <= 1.1 <= high
    assert held / trials >= 0.95
    assert held / trials <= 0.99  # not the whole range: the interval is as tight as it may be


def test_the_middle_is_the_median_of_the_ratios_not_of_the_times() -> None:
    num, den = [1.0, 4.0, 9.0], [2.0, 1.0, 3.0]
    assert paired_ratio_interval(num, den)[1] == statistics.median([0.5, 4.0, 3.0])


@pytest.mark.parametrize(
    ("num", "den", "message"),
    [
        ([1.0, 2.0], [1.0], "do not pair up"),
        ([], [], "do not pair up"),
        ([1.0, 0.0], [1.0, 1.0], "not a positive time"),
        ([1.0, 1.0], [1.0, -1.0], "not a positive time"),
    ],
)
def test_samples_that_cannot_be_paired_are_refused(
    num: list[float], den: list[float], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        paired_ratio_interval(num, den)
