"""GPU launchers of the fused-op handles (rocmoe/ops/handles/): Triton for the GEMM and the
row exchange, librocmoe's HIP kernels for the embedding and the GEMV.

A call enqueues its kernels on the current stream and returns: nothing is read back, nothing
synchronises, no host collective runs, so calls overlap with the work around them and can be
captured in a CUDA/HIP graph. What can go wrong on the device (a wait that runs out, a count
or an index out of range, a peer's abort) is written into the handle's status words
(host-mapped memory) and raised by the handle at its next call, at `synchronize()` or at
`ctx.barrier()`.

The peers are reached through the rocmoe context's symmetric heap: `peer_bases` is every
rank's heap base as seen by this process (ipc backend: IPC-mapped device memory; the host
backend's shared memory too, which lets the Triton kernels run under TRITON_INTERPRET=1 on
CPU processes in the tests).

The package has a module per concept: team (the peer table, the slice order and the wait
budgets), triton_launcher, gemm_plans (GemmAllToAll's plans, tuner and lean call), grouped
(the expert-parallel grouped products), abort, hip_args (the HIP kernels' argument
structs), embedding_launch and gemv_launch. Their public names are importable from here;
a private one is its module's (tests that patch one patch it there).
"""

from __future__ import annotations

from ... import errors, native_launch  # noqa: F401  (re-exported)

from .team import (Team, first_call_timeout_s, slice_at, slice_order, task_prefix,
                   team_for)  # noqa: F401
from .gemm_plans import (class_rows, copy_config, direct_tasks, gemm_config, gemm_operands,
                         launch_options, lean_gemm_call, rows_class, rows_exchange,
                         tma_operands_fit, tune_candidates)  # noqa: F401
from .grouped import (even_block_n, grouped_backward, grouped_config, grouped_local,
                      grouped_operands, grouped_weight_grad, weight_grad_config)  # noqa: F401
from .abort import abort  # noqa: F401
from .embedding_launch import (PackedEmbeddingLaunch, TableEmbeddingLaunch, embedding,
                               inline_tables)  # noqa: F401
from .gemv_launch import GemvLaunch, gemv  # noqa: F401

__all__ = ["Team", "team_for", "rows_exchange", "grouped_backward", "abort", "embedding",
           "PackedEmbeddingLaunch", "TableEmbeddingLaunch", "GemvLaunch", "gemv", "gemm_config",
           "gemm_operands", "tma_operands_fit", "slice_order", "task_prefix", "errors"]
