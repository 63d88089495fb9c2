"""The four block-sparse products against an oracle built per expert from the token counts
alone: a dense matmul over each expert's rows. Nothing here reads the topology the code under
test builds (its masks, indices or to_dense), so a topology that sends a row block to the
wrong expert, or a block to the wrong place, fails these tests even where the code and a
mask built from the same topology would agree.

The layout the oracle assumes is the documented one (rocmoe/moe/permute.py, topology.py):
experts in order, expert e's rows padded to a multiple of the block size, and block j of
row block r stored at index r * nb + j, nb = ceil(F / block)."""

import pytest
import torch

from rocmoe.moe import blocksparse as bs
from rocmoe.moe import build_topology, plan_routing

BLOCK = 16


@pytest.fixture(autouse=True)
def torch_backend():
    bs.set_backend("torch")
    yield
    bs.set_backend("auto")


def _routing(counts, top_k=1, seed=0):
    """Expert ids [T, top_k] giving each expert exactly counts[e] (token, slot) pairs."""
    g = torch.Generator().manual_seed(seed)
    if top_k == 1:
        ids = torch.cat([torch.full((c,), e) for e, c in enumerate(counts)])
        return ids[torch.randperm(ids.numel(), generator=g)].view(-1, 1).to(torch.int32)
    tokens = 25
    ids = torch.stack([torch.randperm(len(counts), generator=g)[:top_k] for _ in range(tokens)])
    return ids.to(torch.int32)


def _expert_rows(counts, block=BLOCK):
    """(expert, first row, real rows, padded rows) of every expert, from its count alone."""
    rows, start = [], 0
    for e, c in enumerate(counts):
        padded = -(-c // block) * block
        rows.append((e, start, c, padded))
        start += padded
    return rows


def _case(counts_or_topk, ffn=40, experts=5):
    """A topology from a routing, and the routing's per-expert counts (counted here)."""
    if isinstance(counts_or_topk, list):
        ids = _routing(counts_or_topk)
    else:
        ids = _routing([0] * experts, top_k=counts_or_topk)
    counts = torch.bincount(ids.reshape(-1).long(), minlength=experts).tolist()
    topo = build_topology(plan_routing(ids, experts, BLOCK), ffn)
    return topo, counts


CASES = {
    # an idle expert, a partly filled last block, an expert of several blocks, one exact block
    "uneven": [21, 0, 16, 3, 40],
    "top2_random": 2,
}


def _real_rows_mask(num_rows, counts):
    real = torch.zeros(num_rows, dtype=torch.bool)
    for _, first, n, _ in _expert_rows(counts):
        real[first:first + n] = True
    return real


def _random_blocks(topo, counts, g):
    """Block values as the layer would pass them: padding rows of each expert zero."""
    nb = -(-topo.ffn_size // BLOCK)
    s = torch.zeros(topo.num_rows // BLOCK * nb, BLOCK, BLOCK, dtype=torch.float64)
    for _, first, n, padded in _expert_rows(counts):
        for rb in range(first // BLOCK, (first + padded) // BLOCK):
            real = min(BLOCK, first + n - rb * BLOCK)
            s[rb * nb:(rb + 1) * nb, :real] = torch.randn(nb, real, BLOCK, generator=g,
                                                          dtype=torch.float64)
    return s


def _sparse_case(case, seed):
    """A topology of CASES[case], its counts, a generator and block values for it."""
    topo, counts = _case(CASES[case])
    g = torch.Generator().manual_seed(seed)
    return topo, counts, g, _random_blocks(topo, counts, g)


def _expert_dense(s, first, padded, nb, ffn):
    """Expert's [padded, ffn] part of S, assembled from its row blocks by the layout rule."""
    parts = []
    for rb in range(first // BLOCK, (first + padded) // BLOCK):
        parts.append(torch.cat(list(s[rb * nb:(rb + 1) * nb]), dim=1))
    return torch.cat(parts)[:, :ffn] if parts else s.new_zeros(0, ffn)


@pytest.mark.parametrize("case", sorted(CASES))
def test_sdd_blocks_of_each_expert_are_its_rows_times_its_weight(case):
    topo, counts = _case(CASES[case])
    g = torch.Generator().manual_seed(1)
    k, f, nb = 12, topo.ffn_size, topo.blocks_per_expert
    a = torch.randn(topo.num_rows, k, generator=g, dtype=torch.float64)
    a[~_real_rows_mask(topo.num_rows, counts)] = 0  # padding rows are zero, as in the layer
    w = torch.randn(len(counts), k, f, generator=g, dtype=torch.float64)
    s = bs.sdd(a, w, topo)
    for e, first, n, padded in _expert_rows(counts):
        want = torch.zeros(padded, nb * BLOCK, dtype=torch.float64)
        want[:, :f] = a[first:first + padded] @ w[e]
        torch.testing.assert_close(_expert_dense(s, first, padded, nb, nb * BLOCK), want)


@pytest.mark.parametrize("case", sorted(CASES))
def test_dsd_rows_of_each_expert_are_its_block_rows_times_its_weight(case):
    topo, counts, g, s = _sparse_case(case, seed=2)
    f, nb = topo.ffn_size, topo.blocks_per_expert
    w = torch.randn(len(counts), f, 9, generator=g, dtype=torch.float64)
    out = bs.dsd(s, w, topo)
    assert out.shape == (topo.num_rows, 9)
    for e, first, n, padded in _expert_rows(counts):
        want = _expert_dense(s, first, padded, nb, f) @ w[e]
        torch.testing.assert_close(out[first:first + padded], want)


@pytest.mark.parametrize("case", sorted(CASES))
def test_dstd_of_each_expert_is_its_block_rows_transposed_times_its_rows(case):
    topo, counts, g, s = _sparse_case(case, seed=3)
    f, nb = topo.ffn_size, topo.blocks_per_expert
    b = torch.randn(topo.num_rows, 7, generator=g, dtype=torch.float64)
    b[~_real_rows_mask(topo.num_rows, counts)] = 0
    out = bs.dstd(s, b, topo)
    assert out.shape == (len(counts), f, 7)
    for e, first, n, padded in _expert_rows(counts):
        want = _expert_dense(s, first, padded, nb, f).t() @ b[first:first + padded]
        torch.testing.assert_close(out[e], want)  # an idle expert: all zeros


@pytest.mark.parametrize("case", sorted(CASES))
def test_ddst_columns_of_each_expert_are_its_weight_times_its_block_rows_transposed(case):
    topo, counts, g, s = _sparse_case(case, seed=4)
    f, nb = topo.ffn_size, topo.blocks_per_expert
    w = torch.randn(len(counts), 5, f, generator=g, dtype=torch.float64)
    out = bs.ddst(w, s, topo)
    assert out.shape == (5, topo.num_rows)
    for e, first, n, padded in _expert_rows(counts):
        want = w[e] @ _expert_dense(s, first, padded, nb, f).t()
        torch.testing.assert_close(out[:, first:first + padded], want)


def test_the_oracle_covers_an_idle_expert_a_partial_block_and_a_multi_block_expert():
    rows = _expert_rows(CASES["uneven"])
    assert [padded for *_, padded in rows] == [32, 0, 16, 16, 48]
    assert any(0 < n < padded for _, _, n, padded in rows)
