"""Persistent fused-op handles: create once (collective, checked), call many times.

    gemm = rocmoe.ops.GemmAllToAll(ctx, max_rows=4096, K=1024, N=1024, dtype=torch.bfloat16)
    out, recv_counts = gemm(X, W, send_counts)       # no MPI, no host sync, graph-capturable

The DeepEP `Buffer` / MORI `EpDispatchCombineOp` pattern (DESIGN.md, "Two paths for every
fused op"). Creating a handle agrees on everything that shapes the symmetric workspace
(capacities, widths, dtype, layout) across the ranks, once, and allocates the workspace at
its upper bound. A call then runs the protocol of rocmoe.h ("fused ops: one protocol for
every backend"): the epoch and every count travel on the device with the data, and results
come back as the upper-bound buffer plus a device tensor of counts (DeepEP's
`num_worst_tokens`).

Errors without a sync per call:

* an input this rank can reject on its own (shape, dtype or device against the handle, a
  count above the capacity) raises here before anything is launched, after this rank has
  taken part in the call without data (the op's abort: its peers' count slots say so, and
  they raise InvalidArgumentError naming it at their next call or `synchronize()`);
* what only the device can see (a timed-out wait, an index out of range, counts that exceed
  the rows) is recorded in the handle's status words, host-mapped memory the host reads
  without a copy, and raised at the next call, at `handle.synchronize()` or at
  `ctx.barrier()`.

On the host backend a call is synchronous, so everything raises at once.

The package has a module per handle: base (FusedHandle, what they all share), rows
(AllToAllRows, GemmAllToAll), embedding (EmbeddingAllToAll and the packing of its lookups)
and gemv (GemvAllReduce). Their public names are importable from here; a private one is its
module's.
"""

from __future__ import annotations

from .base import FusedHandle, host_mode  # noqa: F401
from .rows import (AllToAllRows, GemmAllToAll, release_rows_handles, rows_handle)  # noqa: F401
from .embedding import EmbeddingAllToAll, pack_lookups, pack_tables  # noqa: F401
from .gemv import GemvAllReduce  # noqa: F401

__all__ = ["GemmAllToAll", "AllToAllRows", "EmbeddingAllToAll", "GemvAllReduce", "pack_tables",
           "pack_lookups"]
