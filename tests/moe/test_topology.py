import torch

from rocmoe.moe import build_topology, plan_routing


def _topo(t=30, k=2, e=5, block=16, ffn=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(torch.int32)
    return build_topology(plan_routing(ids, e, block), ffn)


def test_all_indices_are_int32():
    topo = _topo()
    for name in ("row_offsets", "column_indices", "row_indices", "column_offsets",
                 "transpose_blocks", "block_expert", "num_valid_blocks"):
        assert getattr(topo, name).dtype == torch.int32, name


def test_ffn_size_not_a_multiple_of_the_block_is_padded_up():
    topo = _topo(ffn=40, block=16)
    assert topo.blocks_per_expert == 3 and topo.ffn_padded == 48


def test_bcsr_rows_hold_exactly_the_column_blocks_of_their_expert():
    topo = _topo()
    nb = topo.blocks_per_expert
    for r in range(topo.num_row_blocks):
        lo, hi = int(topo.row_offsets[r]), int(topo.row_offsets[r + 1])
        cols = topo.column_indices[lo:hi].tolist()
        e = int(topo.block_expert[r])
        assert cols == ([e * nb + j for j in range(nb)] if e >= 0 else [-1] * nb)
        assert topo.row_indices[lo:hi].tolist() == [r] * nb


def test_transpose_lists_each_columns_valid_blocks_in_increasing_row_order():
    topo = _topo()
    for c in range(topo.num_column_blocks):
        lo, hi = int(topo.column_offsets[c]), int(topo.column_offsets[c + 1])
        blocks = topo.transpose_blocks[lo:hi].long()
        expect = [n for n in range(topo.nnz) if int(topo.column_indices[n]) == c]
        assert blocks.tolist() == expect
    # every block is listed once; empty ones are parked after the last column
    assert sorted(topo.transpose_blocks.tolist()) == list(range(topo.nnz))
    tail = topo.transpose_blocks[int(topo.column_offsets[-1]):].long()
    assert (topo.column_indices[tail] == -1).all()


def test_expert_with_no_tokens_has_empty_columns():
    ids = torch.tensor([[0], [0], [2]], dtype=torch.int32)
    topo = build_topology(plan_routing(ids, 3, 16), 16)
    assert int(topo.column_offsets[2] - topo.column_offsets[1]) == 0
