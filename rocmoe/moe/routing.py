"""Routing plan + topology + permuted rows in one step, on the device.

On GPU tensors three Triton launches do what ``plan_routing``, ``build_topology`` and
``permute_pad`` do with ~50 small torch ops (which cost about a millisecond of launch
overhead per layer, more than the work itself): a per-chunk expert histogram, a single
program that scans it and writes the whole topology, and a per-chunk stable counting-sort
scatter that writes each pair's padded row and copies its token there (fused permute + pad).
Elsewhere the torch ops run; both give identical plans, topologies and rows.
"""

from __future__ import annotations

import torch

from .._triton import pow2_at_least, sm_count
from .backend import use_triton
from .permute import (RoutingPlan, check_block_size, padded_rows_bound, permute_pad,
                      plan_routing, sum_pair_rows)
from .topology import Topology, build_topology


class _ScatterRows(torch.autograd.Function):
    """Forward: the counting-sort scatter kernel (writes dest rows, the permuted copy and
    zeros in the padding rows). Backward: each token's gradient is the sum of its k rows'
    gradients (one gather-sum launch)."""

    @staticmethod
    def forward(ctx, x, launch, dest, plan):
        out = x.new_empty(plan.num_rows, x.shape[1])
        launch(x, out)
        ctx.save_for_backward(dest)
        ctx.top_k = plan.top_k
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (dest,) = ctx.saved_tensors
        return sum_pair_rows(grad_out, dest.view(-1, ctx.top_k)), None, None, None


def _route_triton(x, expert_ids, num_experts, block, ffn_size, copy_rows, compact):
    from . import kernels
    device = expert_ids.device
    num_tokens, top_k = expert_ids.shape
    flat = expert_ids.reshape(-1).to(torch.int32).contiguous()
    n = flat.numel()
    e, e_pow2 = num_experts, pow2_at_least(num_experts)
    # a chunk's one-hot [chunk, E] matrix stays at 16K elements (registers of one program)
    chunk = min(1024, max(16, 16384 // e_pow2))
    num_chunks = max(1, -(-n // chunk))
    num_rows = padded_rows_bound(n, e, block)
    num_rb = num_rows // block
    nb = -(-ffn_size // block)
    nnz, num_cols = num_rb * nb, e * nb

    def i32(*shape):
        return torch.empty(*shape, dtype=torch.int32, device=device)

    hist = i32(num_chunks, e)
    chunk_base, counts, row_start, scratch = i32(num_chunks, e), i32(e), i32(e), i32(3 * e)
    block_expert, num_valid, row_offsets = i32(num_rb), i32(1), i32(num_rb + 1)
    column_indices, row_indices, transpose_blocks = i32(nnz), i32(nnz), i32(nnz)
    column_offsets, block_rows, first_row = i32(num_cols + 1), i32(num_rb), i32(num_rb)
    kernels.launch("chunk_histogram_kernel")[(num_chunks,)](
        flat, hist, n, e, CHUNK=chunk, E_POW2=e_pow2)
    kernels.launch("routing_scan_kernel")[(1,)](
        hist, chunk_base, counts, row_start, scratch, block_expert, num_valid, row_offsets,
        column_indices, row_indices, column_offsets, transpose_blocks, block_rows, first_row,
        num_chunks, e, num_rb, nb,
        BLOCK=block, E_POW2=e_pow2, CHUNK_TILE=max(1, min(64, 4096 // e_pow2)), TILE=1024,
        num_warps=8)
    dest = torch.empty(n, dtype=torch.int64, device=device)
    row_token = i32(num_rows)
    hidden = x.shape[1]
    block_h = min(256, pow2_at_least(hidden), max(16, 16384 // chunk))

    # split the columns so that the copy has about four programs per SM
    col_blocks = max(1, -(-hidden // block_h))
    splits = max(1, min(col_blocks, -(-4 * sm_count(device) // num_chunks)))
    cols_per_program = -(-col_blocks // splits) * block_h

    def launch(src, out):
        # programs past the chunks mark (and with a copy zero) the padding rows, one program
        # per row block; without a copy, one program per chunk places its pairs
        grid = (num_chunks + num_rb, -(-hidden // cols_per_program) if out is not None else 1)
        kernels.launch("scatter_rows_kernel")[grid](
            flat, chunk_base, row_start, dest, src, src if out is None else out, block_rows,
            row_token, n, e, hidden, top_k, src.stride(0),
            src.stride(0) if out is None else out.stride(0), cols_per_program, num_chunks,
            CHUNK=chunk, E_POW2=e_pow2, BLOCK_H=block_h, COPY=out is not None, BLOCK=block)

    x = x if x.stride(1) == 1 else x.contiguous()
    plan = RoutingPlan(num_tokens=num_tokens, top_k=top_k, num_experts=e, block_size=block,
                       num_rows=num_rows, tokens_per_expert=counts,
                       dest_row=dest.view(num_tokens, top_k), block_expert=block_expert,
                       num_valid_blocks=num_valid, block_rows=block_rows, row_token=row_token,
                       block_first_row=first_row)
    if copy_rows:
        x_perm = _ScatterRows.apply(x, launch, dest, plan)
    else:
        x_perm = None
        launch(x, None)
    topo = Topology(block_size=block, num_experts=e, ffn_size=ffn_size, blocks_per_expert=nb,
                    num_row_blocks=num_rb, row_offsets=row_offsets,
                    column_indices=column_indices, row_indices=row_indices,
                    column_offsets=column_offsets, transpose_blocks=transpose_blocks,
                    block_expert=block_expert, num_valid_blocks=num_valid,
                    block_rows=block_rows, expert_rows=counts,
                    block_first_row=first_row if compact else None, num_pairs=n)
    return plan, topo, x_perm


def route_and_permute(x: torch.Tensor, expert_ids: torch.Tensor, num_experts: int,
                      block_size: int, ffn_size: int, copy_rows: bool = True,
                      compact_values: bool = False
                      ) -> tuple[RoutingPlan, Topology, torch.Tensor | None]:
    """(plan, topology, padded expert-sorted rows) for tokens x [T, H] routed by expert_ids.

    copy_rows=False: no permuted copy (None in its place): for products that read the rows
    from x themselves, through ``plan.row_token``. compact_values: the topology's sparse
    values are stored without their padding rows (see Topology)."""
    check_block_size(block_size)
    if use_triton(x) and expert_ids.numel() > 0:
        return _route_triton(x, expert_ids, num_experts, block_size, ffn_size, copy_rows,
                             compact_values)
    plan = plan_routing(expert_ids, num_experts, block_size)
    topo = build_topology(plan, ffn_size, compact_values)
    return plan, topo, permute_pad(x, plan) if copy_rows else None
