"""Spearman's rank correlation as the layout benchmark computes it (``harness.spearman``)."""

import math

from harness.spearman import ranks, spearman


def test_tied_values_share_the_mean_of_their_ranks() -> None:
    assert ranks([10.0, 30.0, 20.0, 30.0]) == [1.0, 3.5, 2.0, 3.5]


def test_the_same_order_is_one_and_the_reverse_minus_one() -> None:
    assert math.isclose(spearman([1, 2, 3, 4], [10, 20, 30, 400]), 1.0)  # to float rounding
    assert math.isclose(spearman([1, 2, 3, 4], [4, 3, 2, 1]), -1.0)


def test_one_swap_of_five_is_point_nine() -> None:
    # 1 - 6 * sum(d^2) / (n (n^2 - 1)) with d = (1, -1, 0, 0, 0): 1 - 12 / 120
    assert math.isclose(spearman([1, 2, 3, 4, 5], [2, 1, 3, 4, 5]), 0.9)


def test_fewer_than_two_values_have_no_correlation() -> None:
    assert math.isnan(spearman([1.0], [2.0]))
