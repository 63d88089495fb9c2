"""Triton persistent kernel of the fused GEMM + All-to-All (AMD and NVIDIA).

The kernel runs the schedule of ``hip/include/rocmoe/schedule.h``:

* slices: one per destination rank (this rank's rows of ``Y = X @ W`` bound for it,
  ``send_counts[d]`` rows starting at ``row_start[d]``); an empty slice still has one task,
  so its signal is still raised;
* tasks: the ``BLOCK_M x BLOCK_N`` output tiles of a slice; task numbers follow the
  remote-first slice order given by ``order`` / ``task_prefix`` (computed on the host from
  the same closed form as ``sched::slice_at``), and a program takes the next number from an
  atomic counter until none are left;
* every tile is stored straight into the destination's receive buffer (scale-up: the
  destination's heap base comes from the ``peer_bases`` int64 tensor and is cast to a
  pointer), then the program bumps the slice's done counter; the program whose bump
  completes the slice re-zeroes it and stores the epoch into the destination's signal slot
  for this rank with release semantics at system scope.

Counters (``next_task``, ``exited``, ``slice_done[world]``) are self-resetting exactly as in
schedule.h, so they live in device memory across launches without a memset.

The buffer protocol's two waits run inside the kernel (each was a separate launch, and
host launch work was a visible share of a 0.2 ms GEMM): every program first polls the ack
slots of its destinations (their buffer of this parity is free once they acknowledged call
``epoch - 2``), and the last program out polls this rank's signal slots until every source's
slice has arrived. Both polls are bounded by an iteration budget and record a timeout in
``status`` (acks at ``[0, world)``, data at ``[world, 2 world)``), so a missing peer becomes
an error on the host instead of a hung stream.

As in ``rocmoe.moe.kernels``, the bodies are plain functions wrapped by ``triton.jit`` on
first use, so ``TRITON_INTERPRET=1`` set by a test before the first call runs this very
code on CPU tensors (with the host backend's shared-memory heap as the "peers").
"""

from __future__ import annotations

import triton
import triton.language as tl

from .._triton import KernelRegistry

_REGISTRY = KernelRegistry()
_kernel, get, names = _REGISTRY.kernel, _REGISTRY.get, _REGISTRY.names


@triton.jit
def _poll_slots(slot_ptrs, status_ptrs, mask, target, budget):
    # Acquire-poll the masked slots until every one holds >= target or `budget` rounds
    # pass; a slot still short is recorded as 1 in its status word. Returns the ready mask.
    seen = tl.where(mask, tl.atomic_add(slot_ptrs, 0, mask=mask, sem="acquire", scope="sys"),
                    target)
    spins = 0
    while (tl.min(seen, axis=0) < target) & (spins < budget):
        seen = tl.where(mask, tl.atomic_add(slot_ptrs, 0, mask=mask, sem="acquire",
                                            scope="sys"), target)
        spins += 1
    tl.store(status_ptrs, tl.full(seen.shape, 1, tl.int32), mask=mask & (seen < target))
    return mask & (seen >= target)


@_kernel
def gemm_a2a_kernel(x_ptr, w_ptr, peer_bases_ptr,
                    row_start_ptr, send_counts_ptr, dest_row_ptr,
                    order_ptr, task_prefix_ptr, counters_ptr, slots_ptr, status_ptr,
                    seg_prefix_ptr, seg_row0_ptr, seg_rows_ptr, seg_out_ptr,
                    recv_offset, signal_offset, epoch, rank, world, total_tasks, num_programs,
                    N, K, G,
                    stride_xm, stride_xk, stride_wg, stride_wk, stride_wn, wait_budget,
                    WORLD_P2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, SIGNAL: tl.constexpr,
                    FP32_IEEE: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
                    USE_TMA: tl.constexpr = False, GROUPS_P2: tl.constexpr = 0):
    # USE_TMA (Hopper): x_ptr / w_ptr are tensor descriptors of X [M, K] and W [K, N] with
    # [BLOCK_M, BLOCK_K] / [BLOCK_K, BLOCK_N] blocks; the copy engine fetches the tiles
    # (zero-filled past the edges) instead of every thread computing addresses for cp.async.
    # GROUPS_P2 > 0 (grouped products, a power of two > G): W is [G, K, N] (with USE_TMA, a
    # descriptor of it as [G*K, N]; K is then a multiple of BLOCK_K) and a destination's
    # slice is G segments, segment g's rows multiplied by W[g]. seg_prefix [world, G + 1]:
    # the slice's tile numbers where each segment starts; seg_row0 / seg_rows / seg_out
    # [world, G]: each segment's first row of X, its rows, and its first row inside this
    # rank's part of the destination's buffer. The slice keeps one task when every segment
    # is empty (its signal is still raised).
    if USE_TMA:
        out_ty = x_ptr.dtype
    else:
        out_ty = x_ptr.dtype.element_ty
    n_tiles_n = tl.cdiv(N, BLOCK_N)
    positions = tl.arange(0, WORLD_P2)
    # prefix[p + 1] for every order position; past-the-end lanes never count
    next_prefix = tl.load(task_prefix_ptr + 1 + positions, mask=positions < world,
                          other=2147483647)
    rm = tl.arange(0, BLOCK_M)
    rn = tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    in_world = positions < world

    # Producer side of the buffer protocol, in the kernel (it was a separate wait launch):
    # destination d's receive buffer of this call's parity is free once d acknowledged call
    # epoch - 2 (ack slots: this rank's slots[world + d]). A destination that never does is
    # recorded in status[d], and nothing is written to it.
    dest_free = in_world
    if SIGNAL:
        if epoch > 2:
            dest_free = _poll_slots(slots_ptr + world + positions, status_ptr + positions,
                                    in_world, epoch - 2, wait_budget)

    task = tl.atomic_add(counters_ptr, 1)
    while task < total_tasks:
        # locate(): the slice is the number of slices that end at or before this task
        pos = tl.sum((next_prefix <= task).to(tl.int32), axis=0)
        dest = tl.load(order_ptr + pos)
        first = tl.load(task_prefix_ptr + pos)
        tiles = tl.load(task_prefix_ptr + pos + 1) - first
        tile = task - first
        out_row0 = tl.load(dest_row_ptr + dest)
        w_row0 = 0  # with TMA: W's first row for this tile's group
        w_group = w_ptr  # without TMA: this tile's group of W
        if GROUPS_P2 > 0:
            segs = tl.arange(0, GROUPS_P2)
            seg_ends = tl.load(seg_prefix_ptr + dest * (G + 1) + 1 + segs, mask=segs < G,
                               other=2147483647)
            g = tl.minimum(tl.sum((seg_ends <= tile).to(tl.int32), axis=0), G - 1)
            in_seg = tile - tl.load(seg_prefix_ptr + dest * (G + 1) + g)
            seg = dest * G + g
            # past the last segment (a slice whose segments are all empty): nothing to do
            rows = tl.where(in_seg < tl.load(seg_prefix_ptr + dest * (G + 1) + g + 1) -
                            tl.load(seg_prefix_ptr + dest * (G + 1) + g),
                            tl.load(seg_rows_ptr + seg), 0)
            row0 = tl.load(seg_row0_ptr + seg)
            out_row0 += tl.load(seg_out_ptr + seg)
            if USE_TMA:
                w_row0 = g * K
            else:
                w_group = w_ptr + g.to(tl.int64) * stride_wg
            tile = in_seg
        else:
            rows = tl.load(send_counts_ptr + dest)
            row0 = tl.load(row_start_ptr + dest)
        free = tl.sum((dest_free & (positions == dest)).to(tl.int32), axis=0) > 0
        if (rows > 0) & free:
            # grouped tile order inside the slice: GROUP_M row tiles share W's columns in L2
            m_tiles = tl.cdiv(rows, BLOCK_M)
            in_group = GROUP_M * n_tiles_n
            group_first = (tile // in_group) * GROUP_M
            group_rows = tl.minimum(m_tiles - group_first, GROUP_M)
            m_tile = group_first + (tile % in_group) % group_rows
            n_tile = (tile % in_group) // group_rows

            local_rows = m_tile * BLOCK_M + rm
            cols = n_tile * BLOCK_N + rn
            row_ok = local_rows < rows
            col_ok = cols < N
            x_rows = (row0 + tl.where(row_ok, local_rows, 0)).to(tl.int64)
            if EVEN_N:
                # no clamp: W's columns stay provably contiguous, so the loads are 16-byte
                # vectors that the pipeliner turns into asynchronous copies
                w_cols = cols.to(tl.int64)
            else:
                w_cols = tl.where(col_ok, cols, 0).to(tl.int64)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + rk
                if USE_TMA:
                    # rows past the slice (other slices' rows, or past M: zeros) are computed
                    # and never stored
                    a = x_ptr.load([(row0 + m_tile * BLOCK_M).to(tl.int32), k0])
                    b = w_ptr.load([w_row0 + k0, (n_tile * BLOCK_N).to(tl.int32)])
                elif EVEN_K:
                    a = tl.load(x_ptr + x_rows[:, None] * stride_xm + ks[None, :] * stride_xk)
                    b = tl.load(w_group + ks[:, None].to(tl.int64) * stride_wk
                                + w_cols[None, :] * stride_wn)
                else:
                    k_ok = ks < K
                    a = tl.load(x_ptr + x_rows[:, None] * stride_xm + ks[None, :] * stride_xk,
                                mask=k_ok[None, :], other=0.0)
                    b = tl.load(w_group + ks[:, None].to(tl.int64) * stride_wk
                                + w_cols[None, :] * stride_wn,
                                mask=k_ok[:, None], other=0.0)
                if FP32_IEEE:  # float32 inputs: full-precision products, like the host path
                    acc = tl.dot(a, b, acc, input_precision="ieee")
                else:
                    acc = tl.dot(a, b, acc)

            # scale-up: the tile goes straight into the destination's receive buffer
            # heap bases and receive offsets are 256-byte aligned (rocmoe.heap.ALIGNMENT,
            # gpu.ALIGN): saying so lets the tile go out as 16-byte stores, not 2-byte ones
            # (the hint must sit on the pointer: the integer's is lost in the cast)
            dest_base = tl.load(peer_bases_ptr + dest) + recv_offset
            out_ptr = tl.multiple_of(dest_base.to(tl.pointer_type(out_ty)), 16)
            out_rows = (out_row0 + local_rows).to(tl.int64)
            tl.store(out_ptr + out_rows[:, None] * N + cols[None, :].to(tl.int64),
                     acc.to(out_ty), mask=row_ok[:, None] & col_ok[None, :])
        if SIGNAL:
            if free:
                # every thread's stores are issued before the one lane that bumps the counter
                tl.debug_barrier()
                done = tl.atomic_add(counters_ptr + 2 + dest, 1, sem="acq_rel", scope="gpu")
                if done + 1 == tiles:
                    tl.atomic_xchg(counters_ptr + 2 + dest, 0, sem="relaxed", scope="gpu")
                    sig_addr = tl.load(peer_bases_ptr + dest) + signal_offset + rank * 8
                    tl.atomic_xchg(sig_addr.to(tl.pointer_type(tl.int64)), epoch,
                                   sem="release", scope="sys")
        task = tl.atomic_add(counters_ptr, 1)

    # exit_worker(): the last program out re-zeroes the task and exit counters
    exited = tl.atomic_add(counters_ptr + 1, 1)
    if exited + 1 == num_programs:
        tl.atomic_xchg(counters_ptr, 0)
        tl.atomic_xchg(counters_ptr + 1, 0)
        if SIGNAL:
            # Consumer side, by the last program out (it was a separate wait launch): every
            # source's slice of this call has arrived (signals: this rank's slots[s]); a
            # source that never signals is recorded in status[world + s].
            _poll_slots(slots_ptr + positions, status_ptr + world + positions, in_world, epoch,
                        wait_budget)


@_kernel
def signal_peers_kernel(peer_bases_ptr, slot_offset, rank, value):
    # one program per peer: store `value` into the peer's slot for this rank (release, system)
    peer = tl.program_id(0)
    addr = tl.load(peer_bases_ptr + peer) + slot_offset + rank * 8
    tl.atomic_xchg(addr.to(tl.pointer_type(tl.int64)), value, sem="release", scope="sys")


def aot_signatures(dtype: str = "bf16") -> dict[str, dict[str, str]]:
    """Argument types of every kernel for ahead-of-time ``triton.compile``."""
    p = "*" + dtype
    i64 = "*i64"
    i32 = "*i32"
    return {
        "gemm_a2a_kernel": dict(
            x_ptr=p, w_ptr=p, peer_bases_ptr=i64, row_start_ptr=i64, send_counts_ptr=i64,
            dest_row_ptr=i64, order_ptr=i32, task_prefix_ptr=i32, counters_ptr=i32,
            slots_ptr=i64, status_ptr=i32,
            seg_prefix_ptr=i32, seg_row0_ptr=i64, seg_rows_ptr=i64, seg_out_ptr=i64,
            recv_offset="i64", signal_offset="i64", epoch="i64", rank="i32", world="i32",
            total_tasks="i32", num_programs="i32", N="i32", K="i32", G="i32",
            stride_xm="i32", stride_xk="i32", stride_wg="i32", stride_wk="i32",
            stride_wn="i32", wait_budget="i32",
            WORLD_P2="constexpr", BLOCK_M="constexpr", BLOCK_N="constexpr",
            BLOCK_K="constexpr", GROUP_M="constexpr", SIGNAL="constexpr",
            FP32_IEEE="constexpr", EVEN_N="constexpr", EVEN_K="constexpr",
            USE_TMA="constexpr", GROUPS_P2="constexpr"),
        "signal_peers_kernel": dict(peer_bases_ptr=i64, slot_offset="i64", rank="i32",
                                    value="i64"),
    }


def default_config(platform: str, fp32: bool = False) -> dict:
    """Tile shape and launch options per platform (Hopper wgmma / CDNA MFMA). float32 tiles
    are 4 bytes an element: a shorter K step keeps the pipeline inside shared memory."""
    if fp32:
        return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, GROUP_M=8, num_warps=8, num_stages=2)
    if platform == "hip":
        return dict(BLOCK_M=256, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=2)
    # USE_TMA: on an H200 the copy-engine loads took the 4096^3 GEMM from 0.75 to 0.85 of
    # torch.matmul and 8192^3 from 0.85 to 0.96 (benchmarks/results/gemm_tma_h200.json);
    # gemm_operands() falls back to plain loads before Hopper and for unaligned operands.
    return dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3,
                USE_TMA=True)
