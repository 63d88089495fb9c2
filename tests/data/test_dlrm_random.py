"""dlrm's random data: its bag-size rule, index range, targets, and batches reproducible by
index (what a resumed run needs)."""

from __future__ import annotations

import torch

from rocmoe.data.dlrm_random import random_batch


def bag_sizes(offsets, indices):
    ends = torch.cat([offsets[1:], torch.tensor([indices.numel()])])
    return (ends - offsets).tolist()


def test_fixed_bags_have_n_unique_indices_at_most_and_variable_ones_one_to_min_rows_n():
    dense, idx, off, targets = random_batch(0, 64, 4, [1000, 3], 5, fixed=True,
                                            round_targets=False, seed=1)
    sizes = bag_sizes(off[0], idx[0])
    assert max(sizes) == 5 and min(sizes) >= 4  # np.unique can only remove a rare duplicate
    assert max(bag_sizes(off[1], idx[1])) <= 3   # only 3 distinct rows exist
    _, idx, off, _ = random_batch(0, 256, 4, [1000, 3], 5, fixed=False, round_targets=False,
                                  seed=1)
    sizes = bag_sizes(off[0], idx[0])
    assert min(sizes) == 1 and max(sizes) == 5 and len(set(sizes)) == 5
    # a table of 4 rows caps the drawn size at 4, so size 4 needs u >= 7/8: rare
    _, idx, off, _ = random_batch(0, 2000, 4, [4], 10, fixed=False, round_targets=False, seed=1)
    assert bag_sizes(off[0], idx[0]).count(4) / 2000 < 0.2


def test_indices_stay_in_their_table_and_dense_and_targets_are_uniform():
    dense, idx, off, targets = random_batch(3, 128, 6, [7, 50], 4, fixed=False,
                                            round_targets=False, seed=2)
    assert dense.shape == (128, 6) and 0 <= dense.min() and dense.max() < 1
    assert idx[0].max() < 7 and idx[1].max() < 50 and idx[1].min() >= 0
    assert 0 <= targets.min() and targets.max() < 1 and len(set(targets.tolist())) > 100
    rounded = random_batch(3, 128, 6, [7, 50], 4, fixed=False, round_targets=True, seed=2)[3]
    assert set(rounded.tolist()) == {0.0, 1.0}


def test_batch_j_is_the_same_whenever_it_is_made():
    a = random_batch(9, 16, 3, [100], 3, False, False, seed=4)
    b = random_batch(9, 16, 3, [100], 3, False, False, seed=4)
    c = random_batch(10, 16, 3, [100], 3, False, False, seed=4)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1][0], b[1][0])
    assert not torch.equal(a[0], c[0])
