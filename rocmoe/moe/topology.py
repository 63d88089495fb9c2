"""Block-sparse topology of the expert FFN's hidden activations.

The sparse matrix is ``S [num_rows, E * ffn_padded]``: row block r (``block_size`` padded
token rows, all routed to one expert e) has non-zero blocks exactly in the ``nb`` column
blocks of expert e. It is stored BCSR with int32 indices:

* ``row_offsets [R + 1]``   blocks of row r are ``row_offsets[r] : row_offsets[r+1]``
* ``column_indices [nnz]``  global column block of each block (-1 for empty row blocks)
* ``row_indices [nnz]``     the COO view: row block of each block
* ``column_offsets [C + 1]``, ``transpose_blocks [nnz]``: the transpose (CSC) view; the
  valid blocks of column c are ``transpose_blocks[column_offsets[c] : column_offsets[c+1]]``
  in increasing row order. Blocks of empty row blocks are parked after ``column_offsets[C]``.

Every row block carries ``nb`` blocks, also the ones past the real token count, so every
size is static; those blocks are empty and the kernels skip them (``block_valid``). Values
are stored as ``[nnz, block, block]``, or, in a compact topology (``block_first_row`` set),
as ``[pairs, nb * block]`` rows without the padding rows: row i of row block r is row
``block_first_row[r] + i`` for ``i < block_rows[r]`` (an expert's rows are consecutive,
sorted like its padded rows). That is the memory of a grouped GEMM's [pairs, ffn]
activations, where the blocks take up to ``E * (block - 1)`` rows more. ``ffn_hidden_size``
need not be a multiple of the block size: it is padded up, and the padding columns hold
zeros.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .permute import RoutingPlan


@dataclass
class Topology:
    block_size: int
    num_experts: int
    ffn_size: int            # logical ffn width per expert (F)
    blocks_per_expert: int   # nb = ceil(F / block)
    num_row_blocks: int      # R
    row_offsets: torch.Tensor
    column_indices: torch.Tensor
    row_indices: torch.Tensor
    column_offsets: torch.Tensor
    transpose_blocks: torch.Tensor
    block_expert: torch.Tensor     # [R] int32, -1 past the end
    num_valid_blocks: torch.Tensor  # [1] int32 (row blocks in use)
    # Real (token, slot) rows, when the routing is known (every topology this package
    # builds): per row block [R] and per expert [E], int32. The kernels then skip padding:
    # the empty lower half of an expert's nearly empty last block, and DSᵀD's K past the
    # expert's rows (padding rows are zero in every operand the layer passes, so this
    # changes no result). None (a topology built by hand) runs the kernels over whole blocks.
    block_rows: torch.Tensor | None = None
    expert_rows: torch.Tensor | None = None
    # Compact values (see the module docstring): [R] int32, and the number of pairs.
    block_first_row: torch.Tensor | None = None
    num_pairs: int = 0

    @property
    def compact(self) -> bool:
        return self.block_first_row is not None

    def values_shape(self) -> tuple[int, ...]:
        """The shape of this topology's sparse values."""
        if self.compact:
            return self.num_pairs, self.ffn_padded
        return self.nnz, self.block_size, self.block_size

    @property
    def nnz(self) -> int:
        return self.num_row_blocks * self.blocks_per_expert

    @property
    def num_rows(self) -> int:
        return self.num_row_blocks * self.block_size

    @property
    def num_column_blocks(self) -> int:
        return self.num_experts * self.blocks_per_expert

    @property
    def ffn_padded(self) -> int:
        return self.blocks_per_expert * self.block_size

    def block_valid(self) -> torch.Tensor:
        return self.column_indices >= 0

    def dense_shape(self) -> tuple[int, int]:
        return self.num_rows, self.num_column_blocks * self.block_size


def build_topology(plan: RoutingPlan, ffn_size: int, compact: bool = False) -> Topology:
    """Build the BCSR/COO/CSC indices of the routed tokens' sparse matrix on the device
    (compact: its values without padding rows)."""
    block = plan.block_size
    nb = -(-ffn_size // block)
    num_rb = plan.num_row_blocks
    num_cols = plan.num_experts * nb
    device = plan.block_expert.device
    rows = torch.arange(num_rb, device=device, dtype=torch.int32)
    # expand + reshape, not repeat_interleave: the output size is static, no device read
    row_indices = rows.view(-1, 1).expand(num_rb, nb).reshape(-1)
    row_offsets = torch.arange(num_rb + 1, device=device, dtype=torch.int32) * nb
    within = torch.arange(nb, device=device, dtype=torch.int32).repeat(num_rb)
    expert_of_block = plan.block_expert.view(-1, 1).expand(num_rb, nb).reshape(-1)
    valid = expert_of_block >= 0
    column_indices = torch.where(valid, expert_of_block * nb + within,
                                 torch.full_like(within, -1))
    # Transpose: order blocks by column; a stable sort keeps increasing rows inside a column.
    # Empty blocks get the key num_cols so they land after every real column.
    key = torch.where(valid, column_indices, torch.full_like(column_indices, num_cols))
    sorted_key, transpose_blocks = torch.sort(key, stable=True)
    column_offsets = torch.searchsorted(
        sorted_key, torch.arange(num_cols + 1, device=device, dtype=torch.int32))
    return Topology(block_size=block, num_experts=plan.num_experts, ffn_size=ffn_size,
                    blocks_per_expert=nb, num_row_blocks=num_rb, row_offsets=row_offsets,
                    column_indices=column_indices, row_indices=row_indices,
                    column_offsets=column_offsets.to(torch.int32),
                    transpose_blocks=transpose_blocks.to(torch.int32),
                    block_expert=plan.block_expert, num_valid_blocks=plan.num_valid_blocks,
                    block_rows=plan.block_rows,
                    expert_rows=plan.tokens_per_expert.to(torch.int32),
                    block_first_row=plan.block_first_row if compact else None,
                    num_pairs=plan.num_tokens * plan.top_k)
