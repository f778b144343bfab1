"""memory/fastest_first: every combination of per-stage options exactly once, in order of summed time."""

import itertools
import random

import pytest

from pipeckpt.memory.fastest_first import fastest_first


@pytest.mark.parametrize("seed", range(5))
def test_every_combination_comes_once_in_order_of_its_summed_time(seed: int) -> None:
    rng = random.Random(seed)
    times = [sorted(rng.choice([1.0, 2.0, 2.5, 4.0]) for _ in range(rng.randint(1, 4))) for _ in range(4)]
    got = list(fastest_first(times))
    assert sorted(index for _, index in got) == list(itertools.product(*[range(len(t)) for t in times]))
    totals = [total for total, _ in got]
    assert totals == sorted(totals)
    assert all(total == sum(t[i] for t, i in zip(times, index)) for total, index in got)


def test_the_first_combination_is_every_stages_fastest_and_none_come_without_options() -> None:
    assert next(fastest_first([[1.0, 3.0], [0.5, 0.7]])) == (1.5, (0, 0))
    assert list(fastest_first([[1.0], []])) == []
