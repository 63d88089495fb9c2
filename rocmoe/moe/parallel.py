"""Expert parallelism: experts split over ranks, tokens travel to their expert and back.

Where each (token, slot) pair goes is the layer's *dispatcher*'s decision (dispatch.py): a
destination rank and a group (weight copy) there. Under the static placement rank r owns
global experts ``[r * E_local, (r + 1) * E_local)`` and group g is its local expert g;
vExpert placement (vexpert_routing.py) spreads replicated experts over slots of several
ranks. Everything below is the same for both. A forward:

1. route locally; ask the dispatcher for each pair's (rank, group) and sort the pairs by it;
2. exchange the per-(rank, group) counts (``[world, G]`` each way; skipped when the
   dispatcher already knows what every rank receives);
3. dispatch: all-to-all of the sorted rows;
4. run the local groups on what arrived (rows arrive grouped by source rank, then by
   group; the group of each row comes from the counts by a device-side searchsorted);
5. combine: all-to-all back, unsort, weight by the gates and sum the k slots.

With a rocmoe Context the layer's combine is ``rocmoe.ops.gemm_all_to_all`` (``combine=
"gemm_all_to_all"``, the default there for float32/bfloat16/float16): per group g,
the rows that arrived for g go through act(x W1[g]) (times x W3[g] with GLU), and one call
of the fused op with grouped weights (W2 [G, F, H]) computes every group's
product with its W2[g] and puts each finished slice straight into its source rank's heap,
so the last GEMM and the return trip are one collective per layer instead of a GEMM and
then an all-to-all. The op's own backward returns the gradients. A
communicator-only context (MPI) and float64 use the block-sparse FFN and the transport's
all-to-all (``combine="all_to_all"``).

The transport sits behind :class:`ExpertTransport` so the layer does not care how rows move:
``transport_for(ctx)`` picks the symmetric heap (one-sided puts) for a rocmoe Context and
MPI Alltoallv for a bare communicator context (anything with ``comm``, ``rank``,
``world_size``).
"""

from __future__ import annotations

import abc

import numpy as np
import torch

from ..errors import CollectiveMismatchError, ConfigurationError, InvalidArgumentError
from .activations import ACTIVATIONS
from .grouped_ffn import source_major_ffn


class ExpertTransport(abc.ABC):
    """What expert parallelism needs from the communication layer."""

    rank: int
    world_size: int

    @abc.abstractmethod
    def exchange_counts(self, send_counts: torch.Tensor) -> torch.Tensor:
        """[world, G] counts this rank sends -> [world, G] counts it receives."""

    @abc.abstractmethod
    def all_to_all(self, rows: torch.Tensor, send_splits: list[int],
                   recv_splits: list[int]) -> torch.Tensor:
        """Rows [sum(send_splits), H] -> [sum(recv_splits), H], like all_to_all_single."""


class MPITransport(ExpertTransport):
    """Alltoall(v) over the context's mpi4py communicator (host backend, CPU tensors).

    Row counts are read on the host here: MPI needs the byte counts on the host, and on the
    host backend the tensors are host memory anyway, so this costs no device sync.
    """

    def __init__(self, comm):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.world_size = comm.Get_size()

    def exchange_counts(self, send_counts):
        send = np.ascontiguousarray(send_counts.detach().to("cpu", torch.int64).numpy())
        recv = np.empty_like(send)
        self.comm.Alltoall(send, recv)
        return torch.from_numpy(recv).to(send_counts.device, send_counts.dtype)

    def all_to_all(self, rows, send_splits, recv_splits):
        from mpi4py import MPI
        device = rows.device
        src = rows.detach().to("cpu").contiguous()
        width = src.shape[1]
        out = torch.empty(sum(recv_splits), width, dtype=src.dtype)
        row_bytes = width * src.element_size()
        # Move raw bytes: works for every dtype (bf16 has no MPI datatype).
        send_buf = src.view(torch.uint8).numpy().reshape(-1) if src.numel() else \
            np.empty(0, np.uint8)
        recv_buf = out.view(torch.uint8).numpy().reshape(-1) if out.numel() else \
            np.empty(0, np.uint8)
        send_counts = [c * row_bytes for c in send_splits]
        recv_counts = [c * row_bytes for c in recv_splits]
        send_displs = np.concatenate([[0], np.cumsum(send_counts)[:-1]]).tolist()
        recv_displs = np.concatenate([[0], np.cumsum(recv_counts)[:-1]]).tolist()
        self.comm.Alltoallv([send_buf, send_counts, send_displs, MPI.BYTE],
                            [recv_buf, recv_counts, recv_displs, MPI.BYTE])
        return out.to(device)


class HeapTransport(ExpertTransport):
    """Rows and counts travel through the symmetric heap with one-sided puts (rocmoe Context).

    Every call: (1) each rank puts its send splits into every peer's split matrix, so all
    ranks know the whole [src, dst] matrix and hence where their rows land in each peer's
    receive buffer, and all of them agree on the buffer size without another exchange;
    (2) each rank puts its rows for peer p at that offset of p's buffer; (3) barrier, and
    the received rows are copied out. The barrier that opens step (1) keeps a fast rank from
    writing into a buffer that a slow peer is still copying out.

    The split sizes are read on the host (puts need byte counts), so on GPUs this transport
    synchronises once per call; the single-rank layer has no such sync.
    """

    def __init__(self, ctx):
        self.ctx = ctx
        self.rank = int(ctx.rank)
        self.world_size = int(ctx.world_size)
        self._splits = None     # symmetric int64 [world, world]: row (src) -> dst counts
        self._counts = None     # symmetric int64 [world, world, E_local]
        self._buffer = None     # symmetric uint8 receive buffer
        self._capacity = 0

    def _sync_device(self, t: torch.Tensor) -> None:
        if t.is_cuda:  # puts read device memory outside torch's stream order
            torch.cuda.current_stream(t.device).synchronize()

    def _put_to_all(self, table: torch.Tensor, row: torch.Tensor) -> None:
        self.ctx.barrier()  # every peer has finished reading the previous contents
        self._sync_device(row)
        for peer in range(self.world_size):
            self.ctx.put(table[self.rank], row, peer)
        self.ctx.quiet()
        self.ctx.barrier()  # every row of every peer has landed

    def exchange_counts(self, send_counts):
        world, e_local = send_counts.shape
        if self._counts is None or tuple(self._counts.shape) != (world, world, e_local):
            if self._counts is not None:
                self.ctx.free(self._counts)
            self._counts = self.ctx.empty((world, world, e_local), torch.int64)
        row = send_counts.to(device=self._counts.device, dtype=torch.int64).contiguous()
        self._put_to_all(self._counts, row)
        return self._counts[:, self.rank].clone().to(send_counts.device, send_counts.dtype)

    def all_to_all(self, rows, send_splits, recv_splits):
        world = self.world_size
        if self._splits is None:
            self._splits = self.ctx.empty((world, world), torch.int64)
        mine = torch.tensor(send_splits, dtype=torch.int64, device=self._splits.device)
        self._put_to_all(self._splits, mine)
        matrix = self._splits.cpu().tolist()  # [src][dst] rows; the same on every rank
        if [matrix[s][self.rank] for s in range(world)] != list(recv_splits):
            raise CollectiveMismatchError(
                f"rank {self.rank} expected {list(recv_splits)} rows from the ranks but they "
                f"send {[matrix[s][self.rank] for s in range(world)]}")
        width = rows.shape[1]
        row_bytes = width * rows.element_size()
        need = max(sum(matrix[s][d] for s in range(world)) for d in range(world)) * row_bytes
        if need > self._capacity:  # every rank computes the same need: a collective decision
            if self._buffer is not None:
                self.ctx.free(self._buffer)
            self._capacity = max(need, 2 * self._capacity, 1 << 16)
            self._buffer = self.ctx.empty((self._capacity,), torch.uint8)
        src = rows.detach().contiguous().to(self._buffer.device)
        # No barrier needed here: the first barrier of _put_to_all above already ordered
        # every peer's copy-out of the previous call's rows before these puts.
        self._sync_device(src)
        start = 0
        for peer in range(world):
            count = send_splits[peer]
            if count:
                offset = sum(matrix[s][peer] for s in range(self.rank)) * row_bytes
                payload = src[start:start + count].reshape(-1).view(torch.uint8)
                self.ctx.put(self._buffer[offset:offset + payload.numel()], payload, peer)
            start += count
        self.ctx.quiet()
        self.ctx.barrier()
        total = sum(recv_splits)
        out = self._buffer[:total * row_bytes].view(rows.dtype).view(total, width).clone()
        return out.to(rows.device)


def transport_for(ctx) -> ExpertTransport:
    """The fused-op handles for a rocmoe Context (handle_transport.HandleTransport: every
    count stays on the device); MPI for anything with only a communicator. A context's
    ``moe_transport`` attribute overrides the choice (HeapTransport: the earlier transport,
    which reads the split sizes on the host)."""
    transport = getattr(ctx, "moe_transport", None)
    if transport is not None:
        return transport
    if is_runtime_context(ctx):
        from .handle_transport import HandleTransport
        transport = HandleTransport(ctx)
        try:
            ctx.moe_transport = transport  # keep its buffers across layers and steps
        except AttributeError:
            pass
        return transport
    comm = getattr(ctx, "comm", None)
    if comm is None:
        raise ConfigurationError(
            "expert parallelism needs a context with an mpi4py communicator (ctx.comm); "
            "create it with rocmoe.init()")
    return MPITransport(comm)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, transport, send_splits, recv_splits):
        ctx.transport = transport
        ctx.splits = (send_splits, recv_splits)
        return transport.all_to_all(rows, send_splits, recv_splits)

    @staticmethod
    def backward(ctx, grad):
        send_splits, recv_splits = ctx.splits
        grad_rows = ctx.transport.all_to_all(grad.contiguous(), recv_splits, send_splits)
        return grad_rows, None, None, None


def all_to_all(rows, transport, send_splits, recv_splits):
    return _AllToAll.apply(rows, transport, list(send_splits), list(recv_splits))


def _layer_transport(layer) -> ExpertTransport:
    transport = transport_for(layer.ctx)
    if transport.world_size != layer.world_size:
        raise ConfigurationError(f"the layer was built for {layer.world_size} ranks but the "
                                 f"context's communicator has {transport.world_size}")
    return transport


def reject_input(layer, error: Exception) -> None:
    """This rank's input was rejected (`error`): take part in the count exchange with counts
    of -1 (or, on the handle transport, in the step's agreement), so that the peers raise too
    instead of waiting in the exchange, then raise."""
    transport = _layer_transport(layer)
    if getattr(transport, "device_counts", False):
        transport.reject(error)
    width = layer.dispatcher.exchange_width  # the peers wait in the step's first exchange
    transport.exchange_counts(torch.full((transport.world_size, width), -1, dtype=torch.int64))
    raise error


# dtypes rocmoe.ops.gemm_all_to_all takes
FUSED_COMBINE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
COMBINES = ("auto", "gemm_all_to_all", "grouped_mm", "all_to_all")


def is_runtime_context(ctx) -> bool:
    """A rocmoe Context (symmetric heap: the fused ops run on it), not a bare communicator."""
    return all(hasattr(ctx, name) for name in ("empty", "put", "quiet", "barrier", "free"))


def check_combine(combine: str, ctx) -> None:
    """Construction-time check of DroplessMoE's `combine` (the same on every rank)."""
    if combine not in COMBINES:
        raise ConfigurationError(f"combine must be one of {list(COMBINES)}, got {combine!r}")
    if combine == "gemm_all_to_all" and ctx is not None and not is_runtime_context(ctx):
        raise ConfigurationError(
            "combine='gemm_all_to_all' needs a rocmoe Context (rocmoe.init()): the fused op "
            "puts rows into the peers' symmetric heaps; a communicator-only context can use "
            "combine='all_to_all'")


def combine_kind(layer) -> str:
    """Which combine the layer runs. Decided from the layer's configuration and parameter
    dtype only, so that every rank (same layer, same parameters) takes the same path.
    "auto": the fused combine on a rocmoe Context with 16/32-bit weights, else the
    block-sparse FFN and the exchange; "grouped_mm" is taken only when asked for (on one
    H200 its FFN ran slower than both the block-sparse FFN and the fused combine's:
    grouped_ffn.py)."""
    fits = layer.w2.dtype in FUSED_COMBINE_DTYPES
    if layer.combine == "gemm_all_to_all":
        if not fits:
            raise ConfigurationError(
                f"combine='gemm_all_to_all' takes float32, bfloat16 or float16 weights, the "
                f"layer's are {layer.w2.dtype}; use combine='all_to_all' (or 'auto')")
        return "gemm_all_to_all"
    if layer.combine == "grouped_mm":
        return "grouped_mm"
    if layer.combine == "auto" and fits and is_runtime_context(layer.ctx):
        return "gemm_all_to_all"
    return "all_to_all"


def _fused_combine(layer, received, received_from):
    """Steps 4 and 5 with the last GEMM fused into the return trip (gemm_all_to_all).

    received: the rows that arrived, in segments (source s, group g), source-major;
    received_from[s][g]: rows of each segment. That is the grouped op's layout for the way
    back (destination s, group g): one grouped gemm_all_to_all with W2 [G, F, H]
    computes every group's last product and puts each finished slice straight into
    its source rank's heap, in one collective for all groups. What comes back is, from
    each rank r in turn, this rank's rows for r's groups in group order: the (rank, group)
    order the rows were sent in."""
    from .. import ops
    from ..ops.products import group_major
    act = ACTIVATIONS[layer.activation]
    # the first product per group: its rows from every source together
    perm, sizes = group_major(received_from)
    index = torch.from_numpy(perm).to(received.device)
    by_expert = received.index_select(0, index)
    hidden = []
    for e, x_e in enumerate(by_expert.split(sizes)):
        h = act(x_e @ layer.w1[e])
        if layer.w3 is not None:
            h = h * (x_e @ layer.w3[e])
        hidden.append(h)
    # back to the arrival order (source-major), which the grouped op sends back by
    h = torch.cat(hidden).index_select(0, torch.argsort(index))
    return ops.gemm_all_to_all(h, layer.w2, received_from, ctx=layer.ctx)


def expert_parallel_forward(layer, x, expert_ids, weights):
    transport = _layer_transport(layer)
    try:
        combine = combine_kind(layer)
    except ConfigurationError as exc:  # the peers must learn of it, or they wait for counts
        reject_input(layer, exc)
    if getattr(transport, "device_counts", False):  # the fused-op handles: no host reads
        from .handle_transport import handle_forward
        return handle_forward(layer, x, expert_ids, weights, transport, combine)
    num_tokens, top_k = expert_ids.shape
    # 1. each pair's (rank, group); sort by it (stable: token order within a group)
    plan = layer.dispatcher.plan(expert_ids, transport)
    groups = plan.num_groups
    order = torch.sort(plan.sort_key(), stable=True).indices
    counts = plan.send_counts
    # 2. counts each way; the split sizes go to the host for the transport's buffers
    recv_counts = (plan.recv_counts if plan.recv_counts is not None
                   else transport.exchange_counts(counts))
    received_from = recv_counts.tolist()
    rejected = [r for r, row in enumerate(received_from) if min(row, default=0) < 0]
    if rejected:  # a peer's input failed its checks (reject_input): nobody exchanges rows
        raise InvalidArgumentError(
            f"expert-parallel layer: rank(s) {rejected} rejected their input (see the error "
            f"there); rank {transport.rank} stops before exchanging rows")
    send_splits = counts.sum(dim=1).tolist()
    recv_splits = [sum(row) for row in received_from]
    # 3. dispatch
    token_of_pair = order // top_k
    sent = x.index_select(0, token_of_pair)
    received = all_to_all(sent, transport, send_splits, recv_splits)
    if combine == "gemm_all_to_all":
        y_sorted = _fused_combine(layer, received, received_from)
    elif combine == "grouped_mm":
        # 4. the local FFN on grouped products of the arrivals; 5. back to the source ranks
        y_recv = source_major_ffn(received, recv_counts, layer.w1, layer.w2, layer.w3,
                                  ACTIVATIONS[layer.activation])
        y_sorted = all_to_all(y_recv, transport, recv_splits, send_splits)
    else:
        # 4. local groups; row i belongs to segment searchsorted(ends, i) = (source, group)
        seg_ends = torch.cumsum(recv_counts.reshape(-1).long(), 0)
        rows = torch.arange(received.shape[0], device=x.device)
        local_ids = (torch.searchsorted(seg_ends, rows, right=True) % groups).to(torch.int32)
        ones = torch.ones(received.shape[0], 1, dtype=x.dtype, device=x.device)
        y_recv = layer._local_experts(received, local_ids.view(-1, 1), ones)
        # 5. combine: back to the source rank
        y_sorted = all_to_all(y_recv, transport, recv_splits, send_splits)
    # unsort, weight and sum the k slots
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(),
                                                                         device=order.device))
    y_pairs = y_sorted.index_select(0, inverse).view(num_tokens, top_k, -1)
    return (y_pairs * weights.to(y_pairs.dtype).unsqueeze(-1)).sum(dim=1)


__all__ = ["ExpertTransport", "MPITransport", "HeapTransport", "transport_for", "all_to_all",
           "expert_parallel_forward", "reject_input", "combine_kind", "check_combine"]
