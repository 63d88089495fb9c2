import pytest
import torch

from rocmoe.errors import ConfigurationError
from rocmoe.moe import padded_rows_bound, permute_pad, plan_routing, unpermute_combine


def _ids(t, k, e, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(torch.int32)


@pytest.mark.parametrize("block", [16, 32, 64, 128])
def test_padded_row_bound_holds_for_random_and_adversarial_routing(block):
    e = 8
    cases = [_ids(50, 2, e), torch.zeros(50, 1, dtype=torch.int32),
             torch.arange(e, dtype=torch.int32).view(-1, 1)]  # every expert one token
    for ids in cases:
        plan = plan_routing(ids, e, block)
        used = int(((plan.tokens_per_expert.long() + block - 1) // block * block).sum())
        assert used <= plan.num_rows == padded_rows_bound(ids.numel(), e, block)
        assert plan.num_rows % block == 0


def test_each_experts_rows_are_contiguous_block_aligned_and_in_token_order():
    ids = _ids(40, 2, 5)
    plan = plan_routing(ids, 5, 16)
    dest = plan.dest_row
    for e in range(5):
        rows = dest[ids == e]
        assert rows.numel() == int(plan.tokens_per_expert[e])
        if rows.numel():
            assert rows[0] % 16 == 0
            assert torch.equal(rows, torch.arange(int(rows[0]), int(rows[0]) + rows.numel()))
            assert int(plan.block_expert[int(rows[0]) // 16]) == e


def test_blocks_past_the_real_count_are_marked_empty():
    ids = torch.zeros(3, 1, dtype=torch.int32)  # one block used out of the static bound
    plan = plan_routing(ids, 4, 16)
    assert int(plan.num_valid_blocks) == 1
    assert plan.block_expert.tolist() == [0] + [-1] * (plan.num_row_blocks - 1)


def test_permute_pad_puts_each_token_at_its_rows_and_zeros_elsewhere():
    ids = _ids(20, 3, 6)
    x = torch.randn(20, 8)
    plan = plan_routing(ids, 6, 16)
    xp = permute_pad(x, plan)
    for j in range(3):
        assert torch.equal(xp[plan.dest_row[:, j]], x)
    used = torch.zeros(plan.num_rows, dtype=torch.bool)
    used[plan.dest_row.reshape(-1)] = True
    assert torch.count_nonzero(xp[~used]) == 0


def test_unpermute_combine_is_the_gate_weighted_sum_of_the_slots():
    ids = _ids(15, 2, 4)
    x = torch.randn(15, 8, dtype=torch.float64, requires_grad=True)
    w = torch.rand(15, 2, dtype=torch.float64)
    plan = plan_routing(ids, 4, 16)
    out = unpermute_combine(permute_pad(x, plan) * 3.0, w, plan)
    torch.testing.assert_close(out, 3.0 * x * w.sum(-1, keepdim=True))
    out.sum().backward()
    torch.testing.assert_close(x.grad, 3.0 * w.sum(-1, keepdim=True).expand(15, 8))


def test_unsupported_block_size_is_a_configuration_error():
    with pytest.raises(ConfigurationError, match="block_size must be one of"):
        plan_routing(torch.zeros(2, 1, dtype=torch.int32), 2, 48)
