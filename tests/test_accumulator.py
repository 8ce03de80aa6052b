"""Windowed attention sums against brute force."""

import numpy as np
import pytest
import torch

from alisa.kv.accumulator import AttentionAccumulator


def brute_force(rows: list[torch.Tensor], window: int) -> torch.Tensor:
    return torch.stack(rows[-window:]).sum(0)


@pytest.mark.parametrize("window", [1, 3, 8])
def test_small_windows_are_exact(window):
    torch.manual_seed(0)
    acc = AttentionAccumulator(2, 1, 16, torch.device("cpu"), windowed=True, blocks=8)
    rows = []
    windows = np.full(2, window)
    for _ in range(30):
        row = torch.rand(2, 1, 16)
        rows.append(row)
        acc.add(row, windows)
        assert torch.allclose(acc.window_sum(windows, 16), brute_force(rows, window), atol=1e-5)


def test_large_windows_round_up_to_a_snapshot_interval():
    torch.manual_seed(1)
    window, blocks = 40, 8
    acc = AttentionAccumulator(1, 1, 4, torch.device("cpu"), windowed=True, blocks=blocks)
    rows = []
    windows = np.array([window])
    for _ in range(200):
        row = torch.rand(1, 1, 4)
        rows.append(row)
        acc.add(row, windows)
    got = acc.window_sum(windows, 4)
    interval = -(-window // blocks)
    candidates = [brute_force(rows, w) for w in range(window, window + interval)]
    assert any(torch.allclose(got, c, atol=1e-4) for c in candidates)


def test_whole_history_when_not_windowed():
    acc = AttentionAccumulator(1, 2, 5, torch.device("cpu"), windowed=False)
    total = torch.zeros(1, 2, 5)
    for _ in range(10):
        row = torch.rand(1, 2, 5)
        total += row
        acc.add(row, None)
    assert torch.allclose(acc.window_sum(None, 5), total)


def test_seeding_rows_equals_adding_them_one_by_one():
    torch.manual_seed(2)
    rows = torch.rand(2, 1, 12, 10)  # (B, Hs, R, S)
    windows = np.array([5, 9])
    one = AttentionAccumulator(2, 1, 10, torch.device("cpu"), windowed=True, blocks=8)
    many = AttentionAccumulator(2, 1, 10, torch.device("cpu"), windowed=True, blocks=8)
    for index in range(12):
        one.add(rows[:, :, index], windows)
    many.add_rows(rows, windows)
    assert torch.allclose(one.window_sum(windows, 10), many.window_sum(windows, 10), atol=1e-5)


def test_sequences_have_their_own_windows():
    acc = AttentionAccumulator(2, 1, 3, torch.device("cpu"), windowed=True, blocks=8)
    rows = [torch.full((2, 1, 3), float(step)) for step in range(1, 7)]
    windows = np.array([2, 4])
    for row in rows:
        acc.add(row, windows)
    got = acc.window_sum(windows, 3)
    assert torch.allclose(got[0], torch.full((1, 3), 5.0 + 6.0))
    assert torch.allclose(got[1], torch.full((1, 3), 3.0 + 4.0 + 5.0 + 6.0))


def test_cleared_slots_start_from_zero():
    acc = AttentionAccumulator(1, 1, 4, torch.device("cpu"), windowed=True, blocks=8)
    windows = np.array([3])
    for _ in range(5):
        acc.add(torch.ones(1, 1, 4), windows)
    acc.clear_slots(torch.tensor([[[1, 3]]]), torch.tensor([[[True, False]]]))
    acc.add(torch.ones(1, 1, 4), windows)
    got = acc.window_sum(windows, 4)[0, 0]
    assert got[1] == 1.0  # only the step after the slot was cleared
    assert got[0] == got[2] == 3.0


def test_decayed_sums_fade_each_row_by_one_minus_one_over_w_per_step():
    torch.manual_seed(3)
    windows = np.array([1, 4])  # w = 1 keeps only the last row, as a window of one step
    acc = AttentionAccumulator(2, 1, 6, torch.device("cpu"), windowed=False, decayed=True)
    rows = [torch.rand(2, 1, 6) for _ in range(12)]
    for row in rows:
        acc.add(row, windows)
    got = acc.window_sum(windows, 6)
    assert torch.allclose(got[0], rows[-1][0])
    expected = sum(row[1] * 0.75 ** (len(rows) - 1 - age) for age, row in enumerate(rows))
    assert torch.allclose(got[1], expected, atol=1e-5)
    assert not acc.windowed and acc.nbytes() == acc.total.nbytes  # no snapshots


def test_decayed_seeding_rows_equals_adding_them_one_by_one():
    torch.manual_seed(4)
    rows = torch.rand(2, 2, 7, 9)  # (B, Hs, R, S)
    windows = np.array([3, 10])
    one = AttentionAccumulator(2, 2, 9, torch.device("cpu"), windowed=False, decayed=True)
    many = AttentionAccumulator(2, 2, 9, torch.device("cpu"), windowed=False, decayed=True)
    first = torch.rand(2, 2, 9)
    for acc in (one, many):
        acc.add(first, windows)
    for index in range(7):
        one.add(rows[:, :, index], windows)
    many.add_rows(rows, windows)
    assert torch.allclose(one.window_sum(windows, 9), many.window_sum(windows, 9), atol=1e-5)


def test_an_accumulator_is_not_both_windowed_and_decayed():
    with pytest.raises(ValueError, match="not both"):
        AttentionAccumulator(1, 1, 2, torch.device("cpu"), windowed=True, decayed=True)
