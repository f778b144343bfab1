"""Checkpoint modes are objects: which micro-batches recompute, which offload."""

import pytest

from pipeckpt import ALWAYS, EXCEPT_LAST, NEVER, OFFLOAD, PipeckptConfigError
from pipeckpt.checkpointing.modes import parse_modes


@pytest.mark.parametrize(
    "mode, expected",
    [
        (NEVER, [False, False, False, False]),
        (EXCEPT_LAST, [True, True, True, False]),
        (ALWAYS, [True, True, True, True]),
        (OFFLOAD, [True, True, True, True]),
    ],
)
def test_mode_recomputes_exactly_the_expected_microbatches(mode, expected):
    assert [mode.recomputes(i, 4) for i in range(4)] == expected


def test_except_last_with_one_microbatch_recomputes_nothing():
    assert EXCEPT_LAST.recomputes(0, 1) is False


def test_only_offload_moves_kept_inputs_to_host():
    assert [m.offloads for m in (NEVER, EXCEPT_LAST, ALWAYS, OFFLOAD)] == [False, False, False, True]


def test_one_mode_name_applies_to_every_stage():
    assert parse_modes("always", 3) == (ALWAYS, ALWAYS, ALWAYS)


def test_per_stage_list_keeps_its_order():
    assert parse_modes(["always", "never", OFFLOAD], 3) == (ALWAYS, NEVER, OFFLOAD)


def test_unknown_mode_names_value_rule_and_fix():
    with pytest.raises(
        PipeckptConfigError,
        match=r"'sometimes'.*not one of never, except_last, always, offload.*HINT: write <base>.*'always:1'.*"
        r"`ckpt=<name>`",
    ):
        parse_modes("sometimes", 2)


def test_per_stage_list_of_wrong_length_names_both_counts():
    with pytest.raises(PipeckptConfigError, match=r"\(2 modes\).*there are 3 stages.*HINT: give 3 modes"):
        parse_modes(["always", "never"], 3)
