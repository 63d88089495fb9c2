"""Expert parallelism on the persistent fused-op handles: every count on the device.

The transport of a rocmoe Context (DESIGN.md, "Expert parallelism: dispatch and combine over
the fused-op handles"). A step of an expert-parallel DroplessMoE then reads nothing back to
the host and synchronises with nothing:

1. the input check is agreed on the host (one bounded all-gather of each rank's verdict and
   token count, no device involved): a rank that rejects its input raises, the others raise
   InvalidArgumentError naming it, before anything moves; the agreed largest token count
   sizes the handles (the same on every rank);
2. the dispatcher's plan (destination rank and group of each (token, slot) pair, counts
   [world, G]) is device tensors; the counts go to their ranks through an AllToAllRows
   handle (as raw int64 bits) when the plan does not bring them;
3. dispatch: the pairs' rows, sorted by (rank, group), through an AllToAllRows handle with
   device counts: what arrives is packed from source 0 up, in an upper-bound buffer;
4. the first products per group, act(x W1[g]) (times x W3[g] with GLU), run on the device
   counts (rocmoe.ops' grouped products: the Triton kernel on GPUs);
5. combine: one grouped GemmAllToAll with W2 [G, F, H] and the device counts [world, G]
   computes every group's last product and puts the rows straight back into their source
   ranks' heaps (``combine="grouped_mm"``: the whole local FFN through torch._grouped_mm,
   grouped_ffn.py, then the row exchange;
   ``combine="all_to_all"``: the block-sparse FFN, then the row exchange).

Every exchange's backward is the reverse exchange on the shared row handle of its width,
with the same device counts. Buffers are sized at the upper bound (world x the agreed most
pairs a rank sends), like DeepEP's ``num_worst_tokens``: that is the memory cost of never
reading a count on the host.
"""

from __future__ import annotations

import torch

from .._triton import pow2_at_least as _round_up
from ..errors import InvalidArgumentError
from .activations import ACTIVATIONS
from .grouped_ffn import source_major_ffn


_HANDLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class HandleTransport:
    """Rows and counts through the fused-op handles of a rocmoe Context (see the module)."""

    device_counts = True  # parallel.py: the counts stay on the device, never on the host

    def __init__(self, ctx):
        self.ctx = ctx
        self.rank = int(ctx.rank)
        self.world_size = int(ctx.world_size)
        self._gemm = {}          # (F, H, G, dtype) -> GemmAllToAll
        self._capacity = 0       # the handles' rows per (source, destination) pair

    # -- the step's agreement (host only) -------------------------------------------------
    def begin_step(self, pairs: int, problem=None) -> int:
        """Agree on every rank's verdict and pair count; returns the capacity to use."""
        table = self.ctx.allgather_ints([int(problem is None), int(pairs)])
        if problem is not None:
            raise problem
        bad = [r for r in range(self.world_size) if not table[r, 0]]
        if bad:
            raise InvalidArgumentError(
                f"expert-parallel layer: rank(s) {bad} rejected their input (see the error "
                f"there); rank {self.rank} stops before exchanging rows")
        most = max(int(table[:, 1].max()), 1)
        if most > self._capacity:  # the same decision on every rank
            self._capacity = _round_up(most)
        return self._capacity

    def reject(self, error) -> None:
        """This rank's input was rejected: tell the peers through the agreement, raise."""
        self.begin_step(0, error)

    # -- the exchanges --------------------------------------------------------------------
    def _rows(self, width: int, dtype: torch.dtype):
        from ..ops.handles import rows_handle
        return rows_handle(self.ctx, self._capacity, width, dtype)

    def exchange_counts(self, send_counts: torch.Tensor) -> torch.Tensor:
        """[world, W] integer counts this rank sends (row d to rank d) -> [world, W] int64 it
        receives (row s from rank s), on the device: int64 rows travel as float32 bit pairs
        through the row exchange."""
        world, width = send_counts.shape
        rows = send_counts.to(torch.int64).contiguous().view(torch.float32)  # [world, 2W]
        handle = self._rows_counts(2 * width)
        with torch.no_grad():
            out, _ = handle(rows, [1] * world)
        return out[:world].contiguous().view(torch.int64).view(world, width)

    def _rows_counts(self, width: int):
        from ..ops.handles import rows_handle
        return rows_handle(self.ctx, 1, width, torch.float32)

    def all_to_all(self, rows: torch.Tensor, send_splits: list, recv_splits: list) -> torch.Tensor:
        """The ExpertTransport form with split sizes known on the host (the cost model's
        link profile): rows [sum(send_splits), H] -> [sum(recv_splits), H]."""
        if max(list(send_splits) + list(recv_splits) + [1]) > self._capacity:
            self._capacity = _round_up(max(list(send_splits) + list(recv_splits)))
        out, _ = self._rows(rows.shape[1], rows.dtype)(rows.contiguous(), list(send_splits))
        return out[:sum(recv_splits)]

    def dispatch(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows sorted by destination, counts [world] (device) -> what arrives, packed from
        source 0 up, in the [world * capacity, H] buffer (autograd: the reverse exchange)."""
        return self._exchange_rows(rows, counts)

    def _exchange_rows(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        # the row exchange moves bits: rows of a dtype the handles do not compute in (float64)
        # travel as float32 pairs
        moved = rows if rows.dtype in _HANDLE_DTYPES else _BitCast.apply(rows, torch.float32)
        out, _ = self._rows(moved.shape[1], moved.dtype)(moved, counts)
        return out if out.dtype == rows.dtype else _BitCast.apply(out, rows.dtype)

    def combine(self, h: torch.Tensor, w2: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Grouped h @ W2[g] per segment (source s, group g) of the arrived rows, each source's
        rows straight back to it: [world * capacity, H], this rank's pairs in the order they
        were sent (autograd: dX and dW per group, the reverse exchange)."""
        from ..ops import GemmAllToAll
        groups, f, hidden = w2.shape
        key = (f, hidden, groups, w2.dtype)
        handle = self._gemm.get(key)
        if handle is None or handle.max_rows < self._capacity or handle.workspace is None:
            if handle is not None and handle.workspace is not None:
                handle.close()
            handle = self._gemm[key] = GemmAllToAll(self.ctx, self._capacity, f, hidden,
                                                    w2.dtype, groups=groups)
        out, _ = handle(h, w2, counts)
        return out

    def close(self) -> None:
        """Collective: free the GEMM handles this transport made (the row handles are the
        context's, shared by every transport)."""
        for handle in self._gemm.values():
            if handle.workspace is not None:
                handle.close()
        self._gemm.clear()

    def return_rows(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The arrived rows' results back to their sources (the combine of "all_to_all")."""
        return self._exchange_rows(rows, counts)


class _BitCast(torch.autograd.Function):
    """x's bits as another dtype (rows keep their bytes; the last dimension scales), with the
    gradient cast back the same way (torch's view(dtype) does not carry gradients)."""

    @staticmethod
    def forward(ctx, x, dtype):
        ctx.dtype = x.dtype
        return x.contiguous().view(dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous().view(ctx.dtype), None


class _GroupedProducts(torch.autograd.Function):
    """Y = the grouped products of X's rows with device counts [sources, groups] (segment
    (s, g) through W[g], rows at their own positions), without a host read on a GPU."""

    @staticmethod
    def forward(ctx, x, w, counts, transport):
        from ..ops import gpu
        ctx.save_for_backward(x, w, counts)
        ctx.transport = transport
        if x.device.type == "cpu":
            from ..ops.products import grouped_products
            n = int(counts.sum())
            y = x.new_zeros(x.shape[0], w.shape[-1])
            y[:n] = grouped_products(x[:n], w, counts.tolist())
            return y
        team = gpu.team_for(transport.ctx)
        return gpu.grouped_local(x, w, counts, _scratch(team, x))

    @staticmethod
    def backward(ctx, gy):
        from ..ops import gpu
        x, w, counts = ctx.saved_tensors
        groups = w.shape[0]
        if x.device.type == "cpu":
            from ..ops.products import grouped_products, grouped_weight_grad
            n = int(counts.sum())
            dx = torch.zeros_like(x)
            dx[:n] = grouped_products(gy[:n], w.transpose(1, 2), counts.tolist())
            return dx, grouped_weight_grad(x[:n], gy[:n], counts.tolist()).to(w.dtype), \
                None, None
        team = gpu.team_for(ctx.transport.ctx)
        gy = gy.contiguous()
        dx = gpu.grouped_local(gy, w.transpose(1, 2), counts, _scratch(team, x),
                               out=torch.empty_like(x))
        dw = gpu.grouped_weight_grad(x, gy, counts, groups, w.dtype)
        return dx, dw, None, None


def _scratch(team, x) -> int:
    """Status words for the local products (they run no protocol; a bad count is counted
    here and never raised: the counts come from the exchange, whose handle checked them)."""
    buf = getattr(team, "_scratch_status", None)
    if buf is None:
        buf = team._scratch_status = torch.zeros(64, dtype=torch.int32, device=x.device)
    return buf.data_ptr()


def grouped_products(x, w, counts, transport):
    return _GroupedProducts.apply(x, w, counts, transport)


def handle_forward(layer, x, expert_ids, weights, transport: HandleTransport, combine: str):
    """One expert-parallel forward with every count on the device (see the module)."""
    num_tokens, top_k = expert_ids.shape
    world = transport.world_size
    transport.begin_step(num_tokens * top_k)  # the handles' capacity, agreed by every rank
    # 1. each pair's (rank, group); sorted by it (stable: token order within a group)
    plan = layer.dispatcher.plan(expert_ids, transport)
    groups = plan.num_groups
    order = torch.sort(plan.sort_key(), stable=True).indices
    send = plan.send_counts.to(torch.int64)
    # 2. what each source sends here, per group
    recv = plan.recv_counts if plan.recv_counts is not None else transport.exchange_counts(send)
    recv = recv.to(torch.int64).reshape(world, groups)
    # 3. dispatch
    sent = x.index_select(0, order // top_k)
    received = transport.dispatch(sent, send.sum(dim=1))
    if received.device.type == "cpu":
        # host memory: the count is free to read, and the rows past it need no work at all
        received = received[:int(recv.sum())]
    if combine == "gemm_all_to_all":
        # 4 and 5: the first products on the device counts, the last one fused into the
        # trip back
        act = ACTIVATIONS[layer.activation]
        h = act(grouped_products(received, layer.w1, recv, transport))
        if layer.w3 is not None:
            h = h * grouped_products(received, layer.w3, recv, transport)
        back = transport.combine(h, layer.w2, recv)
    elif combine == "grouped_mm":
        # 4. the local FFN on grouped products of the arrivals (device counts); 5. back by
        # the row exchange
        y_recv = source_major_ffn(received, recv, layer.w1, layer.w2, layer.w3,
                                  ACTIVATIONS[layer.activation])
        back = transport.return_rows(y_recv, recv.sum(dim=1))
    else:
        # 4. the block-sparse FFN over every arrived row (rows past the arrivals are zeroed
        # and routed to group 0: computed, never sent); 5. back by the row exchange
        seg_ends = torch.cumsum(recv.reshape(-1), 0)
        rows = torch.arange(received.shape[0], device=x.device)
        valid = rows < seg_ends[-1]
        local_ids = torch.where(valid, torch.searchsorted(seg_ends, rows, right=True) % groups, 0)
        received = torch.where(valid[:, None], received, received.new_zeros(()))
        ones = torch.ones(received.shape[0], 1, dtype=x.dtype, device=x.device)
        y_recv = layer._local_experts(received, local_ids.to(torch.int32).view(-1, 1), ones)
        back = transport.return_rows(y_recv, recv.sum(dim=1))
    # unsort, weight and sum the k slots
    y_sorted = back[:num_tokens * top_k]
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(),
                                                                         device=order.device))
    y_pairs = y_sorted.index_select(0, inverse).view(num_tokens, top_k, -1)
    return (y_pairs * weights.to(y_pairs.dtype).unsqueeze(-1)).sum(dim=1)


__all__ = ["HandleTransport", "handle_forward", "grouped_products"]
