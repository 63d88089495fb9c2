"""Device-side token permutation: sort by expert, histogram, pad to the block size, and back.

The padded buffer has a *static* number of rows, an upper bound that depends only on the
number of (token, slot) pairs, the number of experts and the block size. Its real occupancy
(which rows belong to which expert) lives in device tensors, so nothing here reads a value
back to the host: no ``.item()``, ``.cpu()``, ``.tolist()`` and no Python branch on data.
Rows past the real count, and the tail of each expert's last block, are zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ConfigurationError, InvalidArgumentError
from .backend import use_triton
from .router import expert_histogram

SUPPORTED_BLOCK_SIZES = (16, 32, 64, 128)


def check_block_size(block_size: int) -> None:
    if block_size not in SUPPORTED_BLOCK_SIZES:
        raise ConfigurationError(
            f"block_size must be one of {SUPPORTED_BLOCK_SIZES} (the matrix units need tiles "
            f"of at least 16), got {block_size!r}")


def padded_rows_bound(num_assignments: int, num_experts: int, block_size: int) -> int:
    """Static upper bound on the rows of the padded, expert-sorted buffer.

    Each expert with tokens wastes at most ``block_size - 1`` rows of padding, and at most
    ``min(E, T*k)`` experts have tokens, so this bound holds for every routing.
    """
    busy = min(num_experts, num_assignments)
    rows = num_assignments + busy * (block_size - 1)
    return -(-rows // block_size) * block_size


@dataclass
class RoutingPlan:
    """Where every (token, slot) pair goes in the padded buffer. All tensors on device."""

    num_tokens: int
    top_k: int
    num_experts: int
    block_size: int
    num_rows: int                   # static padded row count (multiple of block_size)
    tokens_per_expert: torch.Tensor  # [E] int32
    dest_row: torch.Tensor          # [T, k] int64: padded row of each pair
    block_expert: torch.Tensor      # [num_rows // block] int32, -1 for blocks past the end
    num_valid_blocks: torch.Tensor  # [1] int32
    block_rows: torch.Tensor        # [num_rows // block] int32: real (pair) rows of each
                                    # row block, 0 past the end; the rest is padding
    row_token: torch.Tensor         # [num_rows] int32: the token of each padded row, -1
                                    # for padding (what a product reads to gather the rows)
    block_first_row: torch.Tensor   # [num_rows // block] int32: the row of each row block's
                                    # first row among the pairs sorted by expert without
                                    # padding (compact values); the pair count past the end

    @property
    def num_row_blocks(self) -> int:
        return self.num_rows // self.block_size


def plan_routing(expert_ids: torch.Tensor, num_experts: int, block_size: int,
                 tokens_per_expert: torch.Tensor | None = None) -> RoutingPlan:
    """Sort pairs by expert and assign each a padded row; all on the ids' device."""
    check_block_size(block_size)
    if expert_ids.dim() != 2:
        raise InvalidArgumentError(
            f"expert_ids must be [tokens, top_k], got shape {tuple(expert_ids.shape)}")
    num_tokens, top_k = expert_ids.shape
    device = expert_ids.device
    flat = expert_ids.reshape(-1).long()
    n = flat.numel()
    counts = (expert_histogram(expert_ids, num_experts) if tokens_per_expert is None
              else tokens_per_expert.to(torch.int32))
    counts64 = counts.long()
    # A stable sort keeps tokens of one expert in token order: the layout is deterministic,
    # which makes results reproducible run to run (and equal across block sizes).
    sorted_expert, order = torch.sort(flat, stable=True)
    starts = torch.cumsum(counts64, 0) - counts64
    padded = (counts64 + block_size - 1) // block_size * block_size
    padded_starts = torch.cumsum(padded, 0) - padded
    rank_in_expert = torch.arange(n, device=device) - starts[sorted_expert]
    dest_sorted = padded_starts[sorted_expert] + rank_in_expert
    dest = torch.empty_like(dest_sorted).scatter_(0, order, dest_sorted)

    num_rows = padded_rows_bound(n, num_experts, block_size)
    num_blocks = num_rows // block_size
    block_ends = torch.cumsum(padded // block_size, 0)
    block_ids = torch.arange(num_blocks, device=device)
    owner = torch.searchsorted(block_ends, block_ids, right=True)
    block_expert = torch.where(owner < num_experts, owner, torch.full_like(owner, -1))
    # real rows of each block: its expert's count less the rows of the expert's earlier blocks
    owner_safe = owner.clamp(max=max(num_experts - 1, 0))
    real = counts64[owner_safe] - (block_ids * block_size - padded_starts[owner_safe]) \
        if num_experts > 0 else torch.zeros_like(block_ids)
    block_rows = torch.where(owner < num_experts, real.clamp(0, block_size),
                             torch.zeros_like(real))
    num_valid = block_ends[-1:].to(torch.int32) if num_experts > 0 else \
        torch.zeros(1, dtype=torch.int32, device=device)
    row_token = torch.full((num_rows,), -1, dtype=torch.int32, device=device).scatter_(
        0, dest, (torch.arange(n, device=device) // max(top_k, 1)).to(torch.int32))
    first_row = torch.where(owner < num_experts,
                            starts[owner_safe] + block_ids * block_size
                            - padded_starts[owner_safe], torch.full_like(block_ids, n)) \
        if num_experts > 0 else torch.full_like(block_ids, n)
    return RoutingPlan(num_tokens=num_tokens, top_k=top_k, num_experts=num_experts,
                       block_size=block_size, num_rows=num_rows, tokens_per_expert=counts,
                       dest_row=dest.view(num_tokens, top_k),
                       block_expert=block_expert.to(torch.int32),
                       num_valid_blocks=num_valid,
                       block_rows=block_rows.to(torch.int32), row_token=row_token,
                       block_first_row=first_row.to(torch.int32))


class _PermutePad(torch.autograd.Function):
    """x [T, H] -> padded [num_rows, H]; row dest_row[t, j] holds x[t], the rest are zero.

    Written as k index_copy passes (k is a static Python int) instead of materialising
    ``x.repeat_interleave(k)``, so the only large temporary is the output itself.
    """

    @staticmethod
    def forward(ctx, x, dest_row, num_rows):
        out = x.new_zeros(num_rows, x.shape[1])
        for slot in range(dest_row.shape[1]):
            out.index_copy_(0, dest_row[:, slot], x)
        ctx.save_for_backward(dest_row)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (dest_row,) = ctx.saved_tensors
        grad_x = sum_pair_rows(grad_out, dest_row) if ctx.needs_input_grad[0] else None
        return grad_x, None, None


def permute_pad(x: torch.Tensor, plan: RoutingPlan) -> torch.Tensor:
    """Expert-sorted, block-padded copy of the tokens (one row per (token, slot) pair)."""
    return _PermutePad.apply(x, plan.dest_row, plan.num_rows)


def sum_pair_rows(rows: torch.Tensor, dest: torch.Tensor) -> torch.Tensor:
    """out[t] = sum_j rows[dest[t, j]] for dest [T, k]: each token's gradient from the
    gradients of its k permuted rows (one Triton launch on a GPU, k index_selects else)."""
    if use_triton(rows) and dest.numel() > 0:
        return gather_sum_rows(rows, dest)
    out = rows.index_select(0, dest[:, 0])
    for slot in range(1, dest.shape[1]):
        out = out + rows.index_select(0, dest[:, slot])
    return out


def gather_sum_rows(rows: torch.Tensor, dest: torch.Tensor) -> torch.Tensor:
    """out[t] = sum_j rows[dest[t, j]] for dest [T, k] int64 (GPU, one Triton launch)."""
    from . import kernels
    rows = rows if rows.stride(1) == 1 else rows.contiguous()
    dest = dest.contiguous()
    t, k = dest.shape
    h = rows.shape[1]
    out = rows.new_empty(t, h)
    if t == 0 or h == 0:
        return out
    block_h = min(128, 1 << max(0, (h - 1).bit_length()))
    kernels.launch("combine_kernel")[(-(-t // 32), -(-h // block_h))](
        rows, rows, dest, out, t, h, k, rows.stride(0), out.stride(0),
        BLOCK_T=32, BLOCK_H=block_h, WEIGHTED=False)
    return out


class _CombineTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, weights, dest, plan):
        from . import kernels
        t, k = dest.shape
        h = y.shape[1]
        out = y.new_empty(t, h)
        block_h = min(128, 1 << max(0, (h - 1).bit_length()))
        kernels.launch("combine_kernel")[(-(-t // 32), -(-h // block_h))](
            y, weights, dest, out, t, h, k, y.stride(0), out.stride(0),
            BLOCK_T=32, BLOCK_H=block_h)
        ctx.save_for_backward(y, weights, dest)
        ctx.plan = plan
        return out

    @staticmethod
    def backward(ctx, grad_out):
        from . import kernels
        y, weights, dest = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        t, k = dest.shape
        h = y.shape[1]
        # rows no pair maps to (padding) must hold zeros, as the FFN backward reads them:
        # the kernel's programs past the tokens' write them
        plan = ctx.plan
        grad_y = torch.empty_like(y)
        grad_w = torch.empty_like(weights)
        block_h = min(128, 1 << max(0, (h - 1).bit_length()))
        num_t = -(-t // 32)
        kernels.launch("combine_backward_kernel")[(num_t + plan.num_row_blocks,)](
            grad_out, y, weights, dest, grad_y, grad_w, plan.block_rows, t, h, k,
            grad_out.stride(0), y.stride(0), grad_y.stride(0), num_t, BLOCK_T=32,
            BLOCK_H=block_h, BLOCK=plan.block_size)
        return grad_y, grad_w, None, None


def unpermute_combine(y: torch.Tensor, weights: torch.Tensor, plan: RoutingPlan) -> torch.Tensor:
    """Inverse of permute_pad with the gate weights: out[t] = sum_j w[t, j] * y[dest[t, j]]."""
    if use_triton(y) and plan.num_tokens > 0 and y.stride(1) == 1:
        return _CombineTriton.apply(y, weights.to(y.dtype).contiguous(),
                                    plan.dest_row.contiguous(), plan)
    out = None
    for slot in range(plan.top_k):
        term = y.index_select(0, plan.dest_row[:, slot]) * weights[:, slot:slot + 1].to(y.dtype)
        out = term if out is None else out + term
    if out is None:  # top_k >= 1 is enforced by the layer; keep the shape right anyway
        out = y.new_zeros(plan.num_tokens, y.shape[1])
    return out
