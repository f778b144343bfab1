"""memory/made_bytes.MadeBytes: the bytes of the storages made under it still alive, and their most
since a mark, on real and fake tensors."""

import torch

from pipeckpt.memory.made_bytes import MadeBytes
from pipeckpt.memory.profile import fake_mode

FOUR_BY_EIGHT = 4 * 8 * 4  # float32


def test_it_counts_each_new_storage_until_it_is_freed() -> None:
    x = torch.randn(4, 8)
    with MadeBytes() as live:
        y = x * 2
        z = y + 1
        assert live.live == 2 * FOUR_BY_EIGHT
        del y
        assert live.live == FOUR_BY_EIGHT
    assert live.peak == 2 * FOUR_BY_EIGHT and z.shape == (4, 8)


def test_views_and_in_place_ops_bring_no_new_storage() -> None:
    x = torch.randn(4, 8)
    with MadeBytes() as live:
        x.add_(1)
        v = x.view(32)
        y = x * 2
        w = y.view(8, 4)
    assert live.peak == FOUR_BY_EIGHT and v.numel() == w.numel() == 32


def test_mark_restarts_the_peak_from_what_is_alive() -> None:
    x = torch.randn(4, 8)
    with MadeBytes() as live:
        y, z = x * 2, x * 3
        del y, z
        assert live.mark() == 0
        kept = x * 4
    assert live.peak == FOUR_BY_EIGHT and kept.shape == (4, 8)


def test_fake_tensors_count_as_real_ones() -> None:
    with fake_mode():
        x = torch.empty(1024, 1024)
        with MadeBytes() as live:
            y = x + 1
            z = y * 2
            del y
    assert live.peak == 2 * 1024 * 1024 * 4 and live.live == 1024 * 1024 * 4 and z.shape == x.shape
