"""Packing rows into micro-batches by token budget, padding, and the staleness gate."""

import itertools
import random

import numpy as np
import pyarrow as pa
import pytest
import torch

from consumers.batching import check_trainable_rows, drop_stale, micro_batches, pack_by_token_budget, pad_rows


def test_pack_greedily_in_order_within_budget():
    # budget 10: rows 0-2 (3 tokens each) pad to 3 x 3 = 9; adding row 3 (5) would pad to 4 x 5 = 20.
    # row 3 + row 4 (10) would be 2 x 10 = 20 -> row 4 alone (exactly 10); row 5 + row 4 = 2 x 10 -> alone.
    assert pack_by_token_budget([3, 3, 3, 5, 10, 2], 10) == [[0, 1, 2], [3], [4], [5]]
    # 2 + 4 pads to 2 x 4 = 8 <= 8; then a third row would be 3 x 4 = 12
    assert pack_by_token_budget([2, 4, 1, 1], 8) == [[0, 1], [2, 3]]


def test_row_longer_than_budget_travels_alone():
    assert pack_by_token_budget([2, 12, 2], 8) == [[0], [1], [2]]
    assert pack_by_token_budget([12], 8) == [[0]]
    assert pack_by_token_budget([], 8) == []


def test_pack_invariants_on_random_lengths():
    rng = random.Random(0)
    for _ in range(200):
        lengths = [rng.randint(1, 40) for _ in range(rng.randint(1, 30))]
        budget = rng.randint(16, 100)
        groups = pack_by_token_budget(lengths, budget)
        assert [i for group in groups for i in group] == list(range(len(lengths)))  # every row, in order
        for group in groups:
            padded = len(group) * max(lengths[i] for i in group)
            assert padded <= budget or len(group) == 1
        for first, second in itertools.pairwise(groups):  # greedy: the next row did not fit
            merged = [*first, second[0]]
            assert len(merged) * max(lengths[i] for i in merged) > budget


def test_pad_rows_values_and_padding():
    batch = pad_rows(
        tokens_R=[[5, 6, 7], [8, 9]],
        loss_mask_R=[[0, 1, 1], [0, 1]],
        logprobs_R=[[0.0, -0.5, -1.5], [0.0, -2.0]],
        advantages_R=[1.0, -1.0],
        token_weights_R=[[1.0, 1.0, 0.5], [1.0, 2.0]],
    )
    assert batch.tokens_BT.dtype == torch.int64
    assert batch.tokens_BT.tolist() == [[5, 6, 7], [8, 9, 0]]
    assert batch.loss_mask_BT.tolist() == [[0, 1, 1], [0, 1, 0]]
    assert batch.sampler_logprobs_BT.tolist() == [[0.0, -0.5, -1.5], [0.0, -2.0, 0.0]]
    assert batch.advantages_B.tolist() == [1.0, -1.0]
    assert batch.weights_B.tolist() == [1.0, 1.0]  # default weight 1
    assert batch.token_weights_BT.tolist() == [[1.0, 1.0, 0.5], [1.0, 2.0, 0.0]]


def test_pad_rows_refuses_inconsistent_rows():
    with pytest.raises(ValueError, match="same non-zero length"):
        pad_rows([[1, 2, 3]], [[0, 1]], [[0.0, 0.0, 0.0]], [1.0])
    with pytest.raises(ValueError, match="loss_mask\\[0\\]"):
        pad_rows([[1, 2]], [[1, 1]], [[0.0, 0.0]], [1.0])
    with pytest.raises(ValueError, match="one entry per row"):
        pad_rows([[1, 2]], [[0, 1]], [[0.0, 0.0]], [1.0, 2.0])


def test_micro_batches_keep_rows_and_their_values():
    tokens = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10, 11], [12, 13]]
    masks = [[0, 1, 1], [0, 1], [0, 0, 1, 1, 1, 1], [0, 1]]
    logprobs = [[0.0, -0.1, -0.2], [0.0, -0.3], [0.0, 0.0, -1, -1, -1, -1], [0.0, -0.4]]
    batches = micro_batches(tokens, masks, logprobs, [1.0, 2.0, 3.0, 4.0], 6, weights_R=[0.1, 0.2, 0.3, 0.4])
    # 3 + 2 pads to 2 x 3 = 6; the 6-token row alone; then the last row
    assert [b.tokens_BT.shape for b in batches] == [(2, 3), (1, 6), (1, 2)]
    assert torch.cat([b.advantages_B for b in batches]).tolist() == [1.0, 2.0, 3.0, 4.0]
    assert torch.cat([b.weights_B for b in batches]).tolist() == pytest.approx([0.1, 0.2, 0.3, 0.4])
    assert batches[1].tokens_BT.tolist() == [tokens[2]]
    assert all(b.temperatures_B is None for b in batches)  # not given: temperature 1
    tempered = micro_batches(tokens, masks, logprobs, [1.0, 2.0, 3.0, 4.0], 6, temperatures_R=[0.5, 0.7, 1.0, 0.0])
    assert torch.cat([b.temperatures_B for b in tempered]).tolist() == pytest.approx([0.5, 0.7, 1.0, 0.0])


def test_drop_stale_keeps_fresh_rows_and_counts_the_rest():
    # current version 5, max staleness 2: staleness 0, 1, 2, 3, 0, 4, -1 -> rows with 3 and 4 are dropped.
    # A row from version 6 (staleness -1, newer than the learner) is kept and shows in the histogram.
    keep, dropped, histogram = drop_stale([5, 4, 3, 2, 5, 1, 6], current_version=5, max_staleness=2)
    np.testing.assert_array_equal(keep, [True, True, True, False, True, False, True])
    assert dropped == 2
    assert histogram == {-1: 1, 0: 2, 1: 1, 2: 1, 3: 1, 4: 1}
    assert list(histogram) == sorted(histogram)


def test_drop_stale_with_zero_staleness_keeps_only_the_current_version():
    keep, dropped, histogram = drop_stale(np.array([3, 3, 2]), current_version=3, max_staleness=0)
    assert keep.tolist() == [True, True, False] and dropped == 1 and histogram == {0: 2, 1: 1}
    keep, dropped, histogram = drop_stale([], current_version=3, max_staleness=1)
    assert keep.shape == (0,) and dropped == 0 and histogram == {}
    with pytest.raises(ValueError, match="max_staleness"):
        drop_stale([1], current_version=1, max_staleness=-1)


@pytest.mark.parametrize("mask_value", [2, -1])
def test_trainable_rows_refuse_a_loss_mask_that_is_not_0_or_1(mask_value):
    """A loss mask of 2 would train its token twice over (every loss multiplies by it), and -1 would leave it out
    while the statistics count it; the trajectory contract says 0 or 1, and a table written as a table is not
    validated row by row, so the learner refuses it at ingest."""
    def table(mask):
        return pa.table({"tokens": pa.array([[1, 2, 3], [1, 2, 3]], pa.list_(pa.int32())),
                         "loss_mask": pa.array([[0, 1, 1], mask], pa.list_(pa.int8())),
                         "logprobs": pa.array([[0.0, -1.0, -1.0], [0.0, -1.0, -1.0]], pa.list_(pa.float32()))})

    check_trainable_rows(table([0, 1, 1]), vocab_size=10)
    with pytest.raises(ValueError, match=f"row 1: loss_mask holds {mask_value}; .*0 .*or 1"):
        check_trainable_rows(table([0, 1, mask_value]), vocab_size=10)
