"""Abort: this rank rejected its input; the peers must finish the call without it.
"""

from __future__ import annotations

from .hip_args import _fill
from .team import _clock, _wait_budget, team_for
from .triton_launcher import _LAUNCHERS


def abort(handle) -> None:
    """Take part in the handle's call without data (see rocmoe.h, "abort")."""
    if handle.op == "gemm_all_to_all":
        if handle.world == 1:
            return  # nobody waits for anything at world size 1 (no protocol)
        team = team_for(handle.ctx)
        layout = handle.layout
        args = (team.peer_bases, handle.status_address, handle.workspace_offset,
                layout.data_signals, layout.acks, layout.phase2_signals, layout.counts,
                layout.local, team.rank, team.world, _wait_budget(handle.ctx.timeout_s))
        _LAUNCHERS["abort_kernel"]((1,), args, dict(WORLD_P2=team.world_p2, CLOCK=_clock()), {},
                                   ("abort",))
        return
    from ..._native import check, ffi, lib
    team = team_for(handle.ctx)
    if handle.op == "embedding_all_to_all":
        args = ffi.new("rocmoe_gpu_embedding_args *")
        _fill(ffi, args, team, handle, first_call=False)  # as the Triton abort: the timeout
        check(lib.rocmoe_gpu_embedding_a2a(args, 1), "EmbeddingAllToAll abort (GPU)")
    else:
        args = ffi.new("rocmoe_gpu_gemv_args *")
        _fill(ffi, args, team, handle, first_call=False)
        check(lib.rocmoe_gpu_gemv_allreduce(args, 1), "GemvAllReduce abort (GPU)")
