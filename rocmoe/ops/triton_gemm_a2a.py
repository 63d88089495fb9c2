"""Triton kernels of the fused GEMM + All-to-All and of the plain row exchange (AMD and
NVIDIA), for the persistent handles of rocmoe/ops/handles/.

Every call of a handle is one or two launches with no host work between them and nothing
read back: the row counts are a device tensor, the epoch lives in the workspace, so a call
can be replayed from a CUDA/HIP graph.

``gemm_a2a_kernel`` runs the schedule of ``hip/include/rocmoe/schedule.h``:

* slices: one per destination rank d (this rank's rows for d, ``counts[d]`` of them, or the
  G segments ``counts[d, g]`` of grouped products); an empty slice still has one task, so
  its signal is still raised;
* tasks: the ``BLOCK_M x BLOCK_N`` output tiles of a slice, numbered in the remote-first
  slice order ``order`` (the closed form of ``sched::slice_at``, computed once per handle);
  a program takes the next number from an atomic counter until none are left. The plan
  (rows, tiles and prefix sums per slice and segment) is computed by every program from the
  counts, in registers;
* every tile is stored straight into the destination's receive buffer (its heap base from
  ``peer_bases``, plus the workspace offset, buffer ``epoch % 2``, this rank's fixed-stride
  region), then the program bumps the slice's done counter; the program whose bump completes
  the slice writes this rank's count into the destination's count slot and stores the epoch
  into its data signal for this rank (release, system scope).

The buffer protocol's waits run inside the kernel: every program first polls the ack slots
of the destinations (their buffer of this parity is free once they acknowledged call
``epoch - 2``), and the last program out polls this rank's data signals until every source
has delivered. Both polls are bounded in time (``wait_budget`` microseconds of the device's
real-time clock, see ``_elapsed_us``) and record a timeout in the status words (host-mapped memory: rocmoe.ops raises it at the next call); counts that do not
fit (negative, above the capacity, more rows than X has) make every slice signal-only with
``ROCMOE_COUNT_BAD_INPUT`` and set this rank's own status word, so no peer waits and no
wrong row lands anywhere.

``collect_kernel`` then copies what arrived out of the heap (packed, sources in rank order),
turns each source's count into a status word where it is not a row count, writes the device
``recv_counts`` and acknowledges every source.

MODE_LOCAL runs the same tiles with no protocol at all, storing into the output at the rows'
own positions: world size 1 (the output is then the product itself, no heap, no copy). The
grouped products with no exchange (gpu.grouped_local: the expert-parallel step's first
product and every dX) run ``grouped_tiles_kernel`` instead: ``grouped_plan_kernel`` writes
a table of their tiles on the device, and persistent programs read one record a tile
instead of recomputing the plan, their task loop flattened into the K loop.

As in ``rocmoe.moe.kernels``, the bodies are plain functions wrapped by ``triton.jit`` on
first use, so ``TRITON_INTERPRET=1`` set by a test before the first call runs this very
code on CPU tensors (with the host backend's shared-memory heap as the "peers").
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import cuda as _cuda_extra
from triton.language.extra import hip as _hip_extra

from .._triton import KernelRegistry

_REGISTRY = KernelRegistry()
_kernel, get, names = _REGISTRY.kernel, _REGISTRY.get, _REGISTRY.names

MODE_LOCAL, MODE_EXCHANGE = 0, 1

# ROCMOE_STATUS_* / ROCMOE_COUNT_* of rocmoe.h (checked against the C ABI by the tests);
# kernels may read globals only when they are constexprs
STATUS_TIMEOUT = tl.constexpr(1)
STATUS_PEER_ABORTED = tl.constexpr(2)
STATUS_PEER_BAD_INPUT = tl.constexpr(3)
STATUS_BAD_COUNT = tl.constexpr(4)
STATUS_BAD_INPUT = tl.constexpr(6)
COUNT_ABORTED = tl.constexpr(-1)
COUNT_BAD_INPUT = tl.constexpr(-2)


# CLOCK of the kernels with waits: what bounds a wait. A count of polls was the bound once
# (a system-scope atomic "takes about a microsecond"), but a poll's cost depends on where the
# slot lives and on who else runs on the GPU, so "30 s" was not 30 s. The device clocks run in
# real time whatever the shader clock does, like platform.h's device_time_ns() of the HIP
# kernels; the interpreter (CPU tensors) has none and keeps counting polls.
CLOCK_POLLS, CLOCK_CUDA, CLOCK_HIP = 0, 1, 2
# s_memrealtime's rate on gfx90a / gfx94x (ROCMOE_AMD_REALTIME_HZ of platform.h)
_AMD_REALTIME_TICKS_PER_US = tl.constexpr(100)


def device_clock(platform: str, interpreting: bool = False) -> int:
    """CLOCK for kernels built for `platform` ("cuda" or "hip")."""
    if interpreting:
        return CLOCK_POLLS
    return CLOCK_HIP if platform == "hip" else CLOCK_CUDA


@triton.jit
def _clock_now(CLOCK: tl.constexpr):
    # the device's real-time clock in its own unit (0 where it has none)
    if CLOCK == 1:
        now = _cuda_extra.globaltimer()
    elif CLOCK == 2:
        now = _hip_extra.memrealtime()
    else:
        now = tl.full((), 0, tl.int64)
    return now


@triton.jit
def _elapsed_us(start, polls, CLOCK: tl.constexpr):
    # microseconds since `start` (_clock_now); without a clock, the number of polls so far
    if CLOCK == 1:
        spent = (_cuda_extra.globaltimer() - start) // 1000
    elif CLOCK == 2:
        spent = (_hip_extra.memrealtime() - start) // _AMD_REALTIME_TICKS_PER_US
    else:
        spent = polls.to(tl.int64)
    return spent


@triton.jit
def _poll_slots(slot_ptrs, status_ptrs, mask, target, budget, code, CLOCK: tl.constexpr):
    # Acquire-poll the masked slots until every one holds >= target or `budget` microseconds
    # pass (polls, for CLOCK_POLLS); a slot still short gets `code` in its status word.
    # Returns the ready mask.
    seen = tl.where(mask, tl.atomic_add(slot_ptrs, 0, mask=mask, sem="acquire", scope="sys"),
                    target)
    start = _clock_now(CLOCK)
    spins = 0
    spent = tl.full((), 0, tl.int64)
    while (tl.min(seen, axis=0) < target) & (spent < budget):
        seen = tl.where(mask, tl.atomic_add(slot_ptrs, 0, mask=mask, sem="acquire",
                                            scope="sys"), target)
        spins += 1
        spent = _elapsed_us(start, spins, CLOCK)
    tl.store(status_ptrs, tl.full(seen.shape, code, tl.int32), mask=mask & (seen < target))
    return mask & (seen >= target)


@triton.jit
def _split_join(acc, split_addr, split_tiles, tile_task, part, has_rows, free,
                SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # One K range of a split tile: its fp32 partial goes to the tile's slot `part`, then the
    # tile's semaphore counts it (plus 1 << 16 when this task found its destination not
    # free, so the tile is neither stored nor counted done: the destination never gets a
    # partial sum). The last task in sums the partials in K order, re-zeroes the semaphore
    # and returns (sum, store it, count the tile done); every other task (_, False, False).
    sems = split_addr.to(tl.pointer_type(tl.int32))
    parts = (split_addr + tl.cdiv(split_tiles * 4, 256) * 256).to(tl.pointer_type(tl.float32))
    elems = BLOCK_M * BLOCK_N
    offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    tile_parts = parts + tile_task.to(tl.int64) * (SPLIT_K * elems)
    if has_rows & free:
        tl.store(tile_parts + part * elems + offs, acc)
    # every thread's partial is written before the one lane that counts it (release)
    tl.debug_barrier()
    mark = tl.where(free, 1, 1 + (1 << 16))
    arrived = tl.atomic_add(sems + tile_task, mark, sem="acq_rel", scope="gpu") + mark
    last = (arrived & 0xFFFF) == SPLIT_K
    all_free = (arrived >> 16) == 0
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if last:
        tl.atomic_xchg(sems + tile_task, 0, sem="relaxed", scope="gpu")
        if has_rows & all_free:
            for s in tl.static_range(SPLIT_K):
                total += tl.load(tile_parts + s * elems + offs, cache_modifier=".cg")
    return total, last & all_free & has_rows, last & all_free


@triton.jit
def _split_part_store(acc, split_addr, split_tiles, n_tiles_n, m_tile, n_tile, part, N,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr):
    # One K range of a split tile with SPLIT_SUM: its fp32 partial goes to part `part` of
    # the scratch, laid out as the output is ([SPLIT_K, rows, N] with rows the scratch's
    # row tiles times BLOCK_M: split_tiles / n_tiles_n of them), so that split_sum_kernel
    # sums flat ranges of it. Every row of the tile is stored (rows past X's are zeros or
    # never read); columns past N are not.
    rows = (split_tiles // n_tiles_n) * BLOCK_M
    base = (split_addr.to(tl.pointer_type(tl.float32)) + part.to(tl.int64) * rows * N
            + (m_tile * BLOCK_M).to(tl.int64) * N + n_tile * BLOCK_N)
    e_r = tl.arange(0, BLOCK_M)
    e_c = tl.arange(0, BLOCK_N)
    ptrs = base + (e_r[:, None].to(tl.int64) * N + e_c[None, :])
    if EVEN_N:
        # N a multiple of BLOCK_N: every row of the tile starts 16-byte aligned (the
        # scratch's allocation is, and the compiler cannot see it through the integer
        # address): 16-byte stores, no column mask
        tl.store(tl.multiple_of(ptrs, [16, 16]), acc)
    else:
        tl.store(ptrs, acc, mask=e_c[None, :] < N - n_tile * BLOCK_N)


@_kernel(do_not_specialize=("M",))
def split_sum_kernel(out_ptr, counts_ptr, M, split_addr, split_tiles, N, capacity,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr,
                     BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    # The second launch of a SPLIT_SUM call (gemm_a2a_kernel's DIRECT path, world size 1):
    # out[:rows_taken] = the sum of the SPLIT_K partials in K order (the same result
    # whatever order the product's programs ran in), BLOCK elements a program. Why not the
    # product's own join at a semaphore per tile (_split_join): its last task in reads the
    # partials back after the others' stores and one atomic, a chain of L2 round trips at
    # the end of the kernel; on an H100 a 16 x 4096^2 product split 4 ran 12.1 us so
    # joined against 7.2 bare, and 9.15 us graph-replayed with this sum launched for PDL
    # (10.12 launched plainly; the unsplit tile 10.9, torch.matmul 9.58:
    # results/probe_tiny_graph_pdl_h100_fortythird_session.jsonl).
    # PDL: launched for programmatic dependent launch, this grid starts while the product
    # runs and waits here for all of it (its stores visible); without PDL the wait returns
    # at once (the stream ordered the two). Calls of more tiles than the scratch holds ran
    # unsplit and stored their own rows: nothing to do. The count, recv and the status word
    # are the product's (it read the count with _direct_count, as here).
    # The count is read before the wait: it was written before the product was launched
    # (stream order), so it is there while the product runs, and the partials' loads after
    # the wait do not wait for it too (one L2 round trip less at the end of the call: on an
    # H100 the sum read it after the wait and ended 1.3 us after the product where the
    # probe's sum, with no count, ended 0.45 us after)
    rows_taken, _ = _direct_count(counts_ptr, capacity, M)
    n_tiles_n = tl.cdiv(N, BLOCK_N)
    split = tl.cdiv(tl.minimum(M, capacity), BLOCK_M) * n_tiles_n <= split_tiles
    part_elems = ((split_tiles // n_tiles_n) * BLOCK_M).to(tl.int64) * N
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < tl.where(split, rows_taken, 0).to(tl.int64) * N
    if PDL:
        _cuda_extra.gdc_wait()
    if split:
        parts = split_addr.to(tl.pointer_type(tl.float32))
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):
            # unmasked, so 16-byte loads: the scratch has room for the last program's whole
            # block past the last part (_GemmLaunch._split_scratch), and an element past the
            # rows stored this call is summed from stale partials and not stored
            # (the scratch's address is an integer, so the compiler cannot know the 16-byte
            # alignment its allocation has and every part keeps: said here, or every load
            # is a 4-byte one)
            acc += tl.load(tl.multiple_of(parts + s * part_elems + offs, 16),
                           cache_modifier=".cg")
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _pick(values, index, positions):
    # values[index] of a register vector (the masked sum of a one-hot)
    return tl.sum(tl.where(positions == index, values, 0), axis=0)


@triton.jit
def _tile_product(x_ptr, w_ptr, row_first, rows_left, n_tile, g, k_lo, k_hi, N, K,
                  stride_xm, stride_xk, stride_wg, stride_wk, stride_wn,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  COPY: tl.constexpr, FP32_IEEE: tl.constexpr, EVEN_N: tl.constexpr,
                  EVEN_K: tl.constexpr, USE_TMA: tl.constexpr, TRANS_W: tl.constexpr = False):
    # One output tile in fp32: X's rows [row_first, row_first + BLOCK_M) (those at or past
    # `rows_left` are not read: the pointer path reads row_first again in their place, TMA
    # zero-fills past X's end; either way they are computed and never stored) times W[g]'s
    # columns of tile n_tile, over K range [k_lo, k_hi). COPY: the tile of X itself.
    # USE_TMA: w_ptr is a descriptor of W as [G * K, N]; with TRANS_W (grouped_tiles_kernel)
    # of W^T's storage as [G * N, K], its boxes turned in registers.
    rm = tl.arange(0, BLOCK_M)
    rn = tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    row_ok = rm < rows_left
    cols = n_tile * BLOCK_N + rn
    col_ok = cols < N
    x_rows = (row_first + tl.where(row_ok, rm, 0)).to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if COPY:
        acc = tl.load(x_ptr + x_rows[:, None] * stride_xm + cols[None, :] * stride_xk,
                      mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    else:
        if EVEN_N:
            # no clamp: W's columns stay provably contiguous (16-byte vector loads)
            w_cols = cols.to(tl.int64)
        else:
            w_cols = tl.where(col_ok, cols, 0).to(tl.int64)
        w_group = w_ptr if USE_TMA else w_ptr + tl.cast(g, tl.int64) * stride_wg
        for k0 in range(k_lo, k_hi, BLOCK_K):
            ks = k0 + rk
            if USE_TMA:
                # rows past the segment (other segments', or past M: zeros) are computed
                # and never stored
                a = x_ptr.load([row_first.to(tl.int32), k0])
                if TRANS_W:
                    b = w_ptr.load([tl.cast(g * N + n_tile * BLOCK_N, tl.int32), k0]).T
                else:
                    b = w_ptr.load([tl.cast(g * K + k0, tl.int32),
                                    (n_tile * BLOCK_N).to(tl.int32)])
            elif EVEN_K:
                a = tl.load(x_ptr + x_rows[:, None] * stride_xm + ks[None, :] * stride_xk)
                b = tl.load(w_group + ks[:, None].to(tl.int64) * stride_wk
                            + w_cols[None, :] * stride_wn)
            else:
                k_ok = ks < K
                a = tl.load(x_ptr + x_rows[:, None] * stride_xm + ks[None, :] * stride_xk,
                            mask=k_ok[None, :], other=0.0)
                b = tl.load(w_group + ks[:, None].to(tl.int64) * stride_wk
                            + w_cols[None, :] * stride_wn, mask=k_ok[:, None], other=0.0)
            if FP32_IEEE:  # float32 inputs: full-precision products, like the host
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _store_tile(out, first_row, m_tile, n_tile, acc, rows, N, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr = False):
    # The tile's first element as one scalar pointer, then offsets and a mask inside the
    # tile, made here from scalars. Rows, columns and mask made before the K loop stayed
    # live through it, and ptxas spilled 570-700 bytes a thread at 128 x 128 and 128 x 256
    # tiles (Triton 3.6 and 3.9, sm_90a: 255 registers); this way none, 186-204 registers.
    # `rows`: the rows of the segment the tile is in (those past it are not stored).
    # EVEN_N (N a multiple of BLOCK_N): no column mask, which every column is inside. With
    # it the stores were 16-byte vectors all the same (N is specialised divisible by 16),
    # but each carried a column predicate too: 928 against 864 SASS instructions a thread
    # for the whole direct-path kernel at 128 x 256 (local sm_90a build, Triton 3.9).
    # tests/test_triton_compile.py checks the stores stay 16-byte vectors.
    tile_out = out + (first_row + m_tile * BLOCK_M).to(tl.int64) * N + n_tile * BLOCK_N
    e_r = tl.arange(0, BLOCK_M)
    e_c = tl.arange(0, BLOCK_N)
    row_ok = e_r[:, None] < rows - m_tile * BLOCK_M
    if EVEN_N:
        mask = row_ok
    else:
        mask = row_ok & (e_c[None, :] < N - n_tile * BLOCK_N)
    tl.store(tile_out + (e_r[:, None].to(tl.int64) * N + e_c[None, :]),
             acc.to(out.dtype.element_ty), mask=mask)


@triton.jit
def _direct_count(counts_ptr, capacity, M):
    # (rows the DIRECT path stores, whether the count is bad): the count of counts_ptr[0]
    # unless it is negative or above the capacity or X's rows, then 0
    count = tl.load(counts_ptr)
    bad = (count < 0) | (count > capacity) | (count > M)
    return tl.where(bad, 0, count), bad


@triton.jit
def _grouped_tile(t, m_tiles, n_tiles, GROUP_M: tl.constexpr):
    # (row tile, column tile) of task t of a segment with m_tiles x n_tiles tiles, in
    # grouped order: GROUP_M row tiles share W's columns in L2
    in_group = GROUP_M * n_tiles
    group_first = (t // in_group) * GROUP_M
    group_rows = tl.maximum(tl.minimum(m_tiles - group_first, GROUP_M), 1)
    return group_first + (t % in_group) % group_rows, (t % in_group) // group_rows


@_kernel(do_not_specialize=("M",))
def gemm_a2a_kernel(x_ptr, w_ptr, out_ptr, counts_ptr, order_ptr, peer_bases_ptr, recv_ptr,
                    status_addr, ws_offset, signal_off, ack_off, count_off, epoch_off,
                    counters_off, recv_off, parity_bytes, source_bytes,
                    rank, world, M, N, K, G, capacity, num_programs,
                    stride_xm, stride_xk, stride_wg, stride_wk, stride_wn, wait_budget,
                    split_addr, split_tiles,
                    WORLD_P2: tl.constexpr, GROUPS_P2: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                    MODE: tl.constexpr, COPY: tl.constexpr, FP32_IEEE: tl.constexpr,
                    EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, USE_TMA: tl.constexpr = False,
                    SPLIT_K: tl.constexpr = 1, DIRECT: tl.constexpr = False,
                    CLOCK: tl.constexpr = 0, SPLIT_SUM: tl.constexpr = False,
                    PDL: tl.constexpr = False):
    # counts [world, G] int64 (G = 1 for one W): rows of X, destination-major then group.
    # COPY: no W, the "product" is X itself (the row exchange; N = K). USE_TMA (Hopper):
    # x_ptr / w_ptr are tensor descriptors of X [M, K] and W [G*K, N] with [BLOCK_M, BLOCK_K]
    # / [BLOCK_K, BLOCK_N] blocks (zero-filled past the edges). recv_ptr: with MODE_LOCAL,
    # where the rows taken go ([0], int64), or the kernel's own scratch word.
    # SPLIT_K > 1 (skinny X: too few tiles to fill the GPU): each tile is SPLIT_K tasks, one
    # per K range; each writes its fp32 partial into the split scratch at split_addr (a
    # semaphore per tile, then SPLIT_K partials per tile, for up to split_tiles tiles) and
    # the last of the tile's tasks to arrive sums the partials in K order (the same result
    # whatever the arrival order), stores the tile and counts it done. A call with more tiles
    # than the scratch holds, or bad counts, runs unsplit.
    # DIRECT (MODE_LOCAL with G = 1, counts [1]): no plan, see below.
    # SPLIT_SUM (DIRECT with SPLIT_K > 1 only): no join here; each task stores its fp32
    # partial and split_sum_kernel, the next launch, sums them (see there). PDL (with
    # SPLIT_SUM, Hopper, the sum launched for programmatic dependent launch): this grid
    # lets the sum's programs launch at once; they wait for its stores at griddepcontrol.wait
    if PDL:
        _cuda_extra.gdc_launch_dependents()
    if USE_TMA:
        out_ty = x_ptr.dtype
    else:
        out_ty = x_ptr.dtype.element_ty
    status = status_addr.to(tl.pointer_type(tl.int32))
    n_tiles_n = tl.cdiv(N, BLOCK_N)
    if DIRECT:
        # world size 1 with one W: the tiles are X's own, so the K loop's
        # loads depend on nothing read from memory: the plan below puts a chain of dependent
        # loads (counts, order) and reductions before the first tile load of every program,
        # which cost 1-2 us of a 25 us GEMM on an H200 (probe_gemm_gap_h200.jsonl). The
        # count is read after the tile's K loop, for the store's mask only (rows past it, or
        # every row when it is bad, are computed and not stored): read before the loop, its
        # latency held up every program's first TMA load (ptxas waits for it where the mask
        # is made), and the kernel ran 6-11 % behind the same tile without a count at
        # 256-512 x 4096^2 (probe_skinny_gemm_h200.jsonl)
        # (rows past the capacity are never stored: a count above it is bad)
        # SPLIT_K > 1 (tiny X: 16 x 4096 times 4096 x 4096 makes 32 tiles 128 wide): a tile
        # is SPLIT_K tasks as on the plan's path below, joined at the tile's semaphore; the
        # count is read by the task that stores. Fewer tiles than the grid's split ones
        # (a call of fewer rows) split the same; more than the scratch holds run unsplit.
        m_tiles = tl.cdiv(tl.minimum(M, capacity), BLOCK_M)
        d_tiles = m_tiles * n_tiles_n
        if SPLIT_K > 1:
            d_splits = tl.where(d_tiles > split_tiles, 1, SPLIT_K)
        else:
            d_splits = 1
        d_k_per = tl.cdiv(tl.cdiv(K, BLOCK_K), d_splits) * BLOCK_K
        task = tl.program_id(0)
        while task < d_tiles * d_splits:
            tile_task = task // d_splits
            m_tile, n_tile = _grouped_tile(tile_task, m_tiles, n_tiles_n, GROUP_M)
            d_lo = (task % d_splits) * d_k_per
            acc = _tile_product(x_ptr, w_ptr, m_tile * BLOCK_M, M - m_tile * BLOCK_M, n_tile,
                                0, d_lo, tl.minimum(d_lo + d_k_per, K), N, K, stride_xm,
                                stride_xk, stride_wg, stride_wk, stride_wn, BLOCK_M, BLOCK_N,
                                BLOCK_K, COPY, FP32_IEEE, EVEN_N, EVEN_K, USE_TMA)
            d_store = True
            if SPLIT_K > 1:
                if d_splits > 1:
                    if SPLIT_SUM:
                        _split_part_store(acc, split_addr, split_tiles, n_tiles_n, m_tile,
                                          n_tile, task % d_splits, N, BLOCK_M, BLOCK_N,
                                          EVEN_N)
                        d_store = False
                    else:
                        acc, d_store, _ = _split_join(acc, split_addr, split_tiles,
                                                      tile_task, task % d_splits, True, True,
                                                      SPLIT_K, BLOCK_M, BLOCK_N)
            if d_store:
                rows_taken, _ = _direct_count(counts_ptr, capacity, M)
                _store_tile(out_ptr, 0, m_tile, n_tile, acc, rows_taken, N, BLOCK_M, BLOCK_N,
                            EVEN_N)
            task += num_programs
        if tl.program_id(0) == 0:
            rows_taken, bad_count = _direct_count(counts_ptr, capacity, M)
            tl.store(recv_ptr, rows_taken)
            if bad_count:
                tl.store(status + 3 * world, STATUS_BAD_INPUT)
    else:
        positions = tl.arange(0, WORLD_P2)
        in_world = positions < world
        segs = tl.arange(0, GROUPS_P2)

        # ---- the plan, from the counts (every program computes the same) ----------------
        counts = tl.load(counts_ptr + positions[:, None] * G + segs[None, :],
                         mask=in_world[:, None] & (segs[None, :] < G), other=0)
        dest_rows = tl.sum(counts, axis=1)                           # [WORLD_P2], by rank
        row_start = tl.cumsum(dest_rows, axis=0) - dest_rows         # first row of X for d
        seg_tiles = tl.cdiv(counts, BLOCK_M) * n_tiles_n              # [WORLD_P2, GROUPS_P2]
        seg_end = tl.cumsum(seg_tiles, axis=1)                        # tile numbers in a slice
        seg_row = tl.cumsum(counts, axis=1) - counts                  # first row of segment
        dest_tiles = tl.maximum(tl.sum(seg_tiles, axis=1), 1)        # an empty slice: 1 task
        order = tl.load(order_ptr + positions, mask=in_world, other=0)
        # tiles in order position p = dest_tiles[order[p]]
        tiles_in_order = tl.sum(tl.where(order[:, None] == positions[None, :],
                                         dest_tiles[None, :], 0), axis=1)
        tiles_in_order = tl.where(in_world, tiles_in_order, 0)
        next_prefix = tl.cumsum(tiles_in_order, axis=0)
        total_tasks = tl.sum(tiles_in_order, axis=0)
        # counts this rank could not have meant: nothing is computed, every slice is signalled
        # with COUNT_BAD_INPUT, and the host raises for this rank
        bad = (tl.min(tl.min(counts, axis=1), axis=0) < 0) | \
            (tl.max(tl.where(in_world, dest_rows, 0), axis=0) > capacity) | \
            (tl.sum(dest_rows, axis=0) > M)

        if MODE == 1:
            my_base = tl.load(peer_bases_ptr + rank) + ws_offset
            epoch = tl.load((my_base + epoch_off).to(tl.pointer_type(tl.int64)), volatile=True) + 1
            counters = (my_base + counters_off).to(tl.pointer_type(tl.int32))
            # destination d's buffer of this parity is free once d acknowledged call epoch - 2
            # (d stores that into this rank's ack slot d)
            dest_free = in_world
            if epoch > 2:
                dest_free = _poll_slots((my_base + ack_off + positions * 8).to(
                    tl.pointer_type(tl.int64)), status + world + positions, in_world, epoch - 2,
                    wait_budget, STATUS_TIMEOUT, CLOCK)
            parity_off = recv_off + (epoch % 2) * parity_bytes + rank * source_bytes
            if bad:
                if tl.program_id(0) == 0:
                    tl.store(status + 3 * world, STATUS_BAD_INPUT)
                    tl.store(status + 3 * world + 1, epoch.to(tl.int32))
        else:
            dest_free = in_world
            if bad:
                if tl.program_id(0) == 0:
                    tl.store(status + 3 * world, STATUS_BAD_INPUT)

        if SPLIT_K > 1:
            splits = tl.where(bad | (total_tasks > split_tiles), 1, SPLIT_K)
        else:
            splits = 1
        k_per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), splits) * BLOCK_K
        if MODE == 1:
            task = tl.atomic_add(counters, 1)
        else:
            task = tl.program_id(0)
        while task < total_tasks * splits:
            tile_task = task // splits
            if SPLIT_K > 1:
                k_lo = (task % splits) * k_per_split
                k_hi = tl.minimum(k_lo + k_per_split, K)
            else:
                k_lo = 0
                k_hi = K
            # locate(): the slice is the number of slices that end at or before this task
            pos = tl.sum((next_prefix <= tile_task).to(tl.int32), axis=0)
            dest = _pick(order, pos, positions)
            first = _pick(next_prefix - tiles_in_order, pos, positions)
            tiles = _pick(tiles_in_order, pos, positions)
            tile = tile_task - first
            # the segment of this tile inside the slice
            seg_end_d = tl.sum(tl.where(positions[:, None] == dest, seg_end, 0), axis=0)
            g = tl.minimum(tl.sum((seg_end_d <= tile).to(tl.int32), axis=0), G - 1)
            counts_d = tl.sum(tl.where(positions[:, None] == dest, counts, 0), axis=0)
            seg_row_d = tl.sum(tl.where(positions[:, None] == dest, seg_row, 0), axis=0)
            seg_tiles_d = tl.sum(tl.where(positions[:, None] == dest, seg_tiles, 0), axis=0)
            seg_first = _pick(seg_end_d - seg_tiles_d, g, segs)
            rows = _pick(counts_d, g, segs)
            in_seg = tile - seg_first
            rows = tl.where((in_seg < _pick(seg_tiles_d, g, segs)) & (bad == 0), rows, 0)
            row0 = _pick(row_start, dest, positions) + _pick(seg_row_d, g, segs)
            out_row0 = _pick(seg_row_d, g, segs)  # inside this rank's region at the destination
            free = _pick(dest_free.to(tl.int32), dest, positions) > 0
            store = (rows > 0) & free
            # grouped tile order inside the segment (computed for every task: a task with no
            # rows stores nothing)
            m_tile, n_tile = _grouped_tile(tl.where(store, in_seg, 0), tl.cdiv(rows, BLOCK_M),
                                           n_tiles_n, GROUP_M)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            if store:
                acc = _tile_product(x_ptr, w_ptr, row0 + m_tile * BLOCK_M, rows - m_tile * BLOCK_M,
                                    n_tile, g, k_lo, k_hi, N, K, stride_xm, stride_xk, stride_wg,
                                    stride_wk, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K, COPY,
                                    FP32_IEEE, EVEN_N, EVEN_K, USE_TMA)
            if SPLIT_K > 1:
                if splits > 1:
                    acc, store, free = _split_join(acc, split_addr, split_tiles, tile_task,
                                                   task % splits, rows > 0, free, SPLIT_K,
                                                   BLOCK_M, BLOCK_N)
            if store:
                if MODE == 1:
                    # scale-up: the tile goes straight into the destination's receive buffer; heap
                    # bases and region offsets are 256-byte aligned (the hint must sit on the
                    # pointer: the integer's is lost in the cast)
                    dest_base = tl.load(peer_bases_ptr + dest) + ws_offset + parity_off
                    out = tl.multiple_of(dest_base.to(tl.pointer_type(out_ty)), 16)
                    first_row = out_row0
                else:
                    out = out_ptr
                    first_row = row0
                _store_tile(out, first_row, m_tile, n_tile, acc, rows, N, BLOCK_M, BLOCK_N,
                            EVEN_N)
            if MODE == 1:
                if free:
                    # every thread's stores are issued before the one lane that bumps the counter
                    tl.debug_barrier()
                    done = tl.atomic_add(counters + 2 + dest, 1, sem="acq_rel", scope="gpu")
                    if done + 1 == tiles:
                        tl.atomic_xchg(counters + 2 + dest, 0, sem="relaxed", scope="gpu")
                        dest_ws = tl.load(peer_bases_ptr + dest) + ws_offset
                        sent = tl.where(bad, COUNT_BAD_INPUT, _pick(dest_rows, dest, positions))
                        # the count travels with the data: a plain store, published with the
                        # tiles by the signal's release
                        tl.store((dest_ws + count_off + ((epoch % 2) * world + rank) * 8).to(
                            tl.pointer_type(tl.int64)), sent.to(tl.int64))
                        tl.debug_barrier()
                        tl.atomic_xchg((dest_ws + signal_off + rank * 8).to(tl.pointer_type(tl.int64)),
                                       epoch, sem="release", scope="sys")
                task = tl.atomic_add(counters, 1)
            else:
                task += num_programs

        if MODE == 1:
            # exit_worker(): the last program out re-zeroes the counters, advances the epoch and
            # waits until every source's slice of this call has arrived (the consumer side; a
            # source that never signals is recorded in its status word)
            exited = tl.atomic_add(counters + 1, 1)
            if exited + 1 == num_programs:
                tl.atomic_xchg(counters, 0)
                tl.atomic_xchg(counters + 1, 0)
                tl.store((my_base + epoch_off).to(tl.pointer_type(tl.int64)), epoch)
                ready = _poll_slots((my_base + signal_off + positions * 8).to(
                    tl.pointer_type(tl.int64)), status + positions, in_world, epoch, wait_budget,
                    STATUS_TIMEOUT, CLOCK)
                if tl.min(tl.where(in_world, ready.to(tl.int32), 1), axis=0) == 0:
                    tl.store(status + 3 * world + 1, epoch.to(tl.int32))
        else:
            if tl.program_id(0) == 0:
                tl.store(recv_ptr, tl.where(bad, 0, tl.sum(dest_rows, axis=0)))


@_kernel
def collect_kernel(out_ptr, peer_bases_ptr, recv_ptr, status_addr, ws_offset, ack_off,
                   count_off, epoch_off, counters_off, recv_off, parity_bytes, source_bytes,
                   rank, world, N, capacity, num_programs,
                   WORLD_P2: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    # Program (source s, row block b): copies rows [b * ROWS, (b + 1) * ROWS) of what s sent
    # (its region of this call's buffer) to the packed output; the last program out writes
    # nothing more but the acks. Runs after gemm_a2a_kernel on the same stream, so the epoch
    # word already holds this call's number.
    s = tl.program_id(0)
    block = tl.program_id(1)
    status = status_addr.to(tl.pointer_type(tl.int32))
    positions = tl.arange(0, WORLD_P2)
    in_world = positions < world
    my_base = tl.load(peer_bases_ptr + rank) + ws_offset
    epoch = tl.load((my_base + epoch_off).to(tl.pointer_type(tl.int64)), volatile=True)
    counts = tl.load((my_base + count_off + ((epoch % 2) * world + positions) * 8).to(
        tl.pointer_type(tl.int64)), mask=in_world, other=0, volatile=True)
    usable = (counts >= 0) & (counts <= capacity)
    rows_from = tl.where(usable, counts, 0)
    start = tl.cumsum(rows_from, axis=0) - rows_from
    count_s = _pick(rows_from, s, positions)
    start_s = _pick(start, s, positions)
    if block == 0:
        raw = _pick(counts, s, positions)
        code = tl.where(raw == COUNT_ABORTED, STATUS_PEER_ABORTED,
                        tl.where(raw == COUNT_BAD_INPUT, STATUS_PEER_BAD_INPUT, STATUS_BAD_COUNT))
        if (raw < 0) | (raw > capacity):
            tl.store(status + s, code)
            tl.store(status + 3 * world + 1, epoch.to(tl.int32))
        tl.store(recv_ptr + s, count_s)
    src = (my_base + recv_off + (epoch % 2) * parity_bytes + s * source_bytes).to(
        out_ptr.dtype)
    src = tl.multiple_of(src, 16)
    rr = block * ROWS + tl.arange(0, ROWS)
    row_ok = rr < count_s
    for c0 in range(0, N, BLOCK_N):
        cols = c0 + tl.arange(0, BLOCK_N)
        mask = row_ok[:, None] & (cols[None, :] < N)
        v = tl.load(src + rr[:, None].to(tl.int64) * N + cols[None, :], mask=mask)
        tl.store(out_ptr + (start_s + rr[:, None]).to(tl.int64) * N + cols[None, :], v,
                 mask=mask)
    # every read of this buffer is done once every program passed here: acknowledge
    tl.debug_barrier()
    counters = (my_base + counters_off).to(tl.pointer_type(tl.int32))
    finished = tl.atomic_add(counters + 1, 1, sem="acq_rel", scope="gpu")
    if finished + 1 == num_programs:
        tl.atomic_xchg(counters + 1, 0)
        peer = tl.load(peer_bases_ptr + positions, mask=in_world, other=0) + ws_offset
        tl.atomic_xchg((peer + ack_off + rank * 8).to(tl.pointer_type(tl.int64)),
                       tl.full((WORLD_P2,), 0, tl.int64) + epoch, mask=in_world,
                       sem="release", scope="sys")


@_kernel
def abort_kernel(peer_bases_ptr, status_addr, ws_offset, signal_off, ack_off, phase2_off,
                 count_off, epoch_off, rank, world, wait_budget, WORLD_P2: tl.constexpr,
                 CLOCK: tl.constexpr = 0):
    # This rank rejected its input: take part in the call without data. After each
    # destination released its buffer of this parity (call epoch - 2), write COUNT_ABORTED
    # into its count slot and raise its data (and phase-2) signal; advance the epoch; then
    # acknowledge every source at once (nothing of this call will be read here).
    status = status_addr.to(tl.pointer_type(tl.int32))
    positions = tl.arange(0, WORLD_P2)
    in_world = positions < world
    my_base = tl.load(peer_bases_ptr + rank) + ws_offset
    epoch = tl.load((my_base + epoch_off).to(tl.pointer_type(tl.int64)), volatile=True) + 1
    free = in_world
    if epoch > 2:
        free = _poll_slots((my_base + ack_off + positions * 8).to(tl.pointer_type(tl.int64)),
                           status + world + positions, in_world, epoch - 2, wait_budget, 1,
                           CLOCK)
    peer = tl.load(peer_bases_ptr + positions, mask=in_world, other=0) + ws_offset
    tl.store((peer + count_off + ((epoch % 2) * world + rank) * 8).to(
        tl.pointer_type(tl.int64)), tl.full((WORLD_P2,), COUNT_ABORTED, tl.int64), mask=free)
    tl.debug_barrier()
    value = tl.full((WORLD_P2,), 0, tl.int64) + epoch
    tl.atomic_xchg((peer + signal_off + rank * 8).to(tl.pointer_type(tl.int64)), value,
                   mask=free, sem="release", scope="sys")
    tl.atomic_xchg((peer + phase2_off + rank * 8).to(tl.pointer_type(tl.int64)), value,
                   mask=free, sem="release", scope="sys")
    tl.store((my_base + epoch_off).to(tl.pointer_type(tl.int64)), epoch)
    tl.atomic_xchg((peer + ack_off + rank * 8).to(tl.pointer_type(tl.int64)), value,
                   mask=in_world, sem="release", scope="sys")


@_kernel
def grouped_weight_grad_kernel(x_ptr, gy_ptr, dw_ptr, counts_ptr, world, G, K, N,
                               stride_xm, stride_gm, rows_bound, WORLD_P2: tl.constexpr,
                               GROUPS_P2: tl.constexpr, BLOCK_K: tl.constexpr,
                               BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                               TILES_FIRST: tl.constexpr = False):
    # dW[g] = sum over destinations d of X[segment (d, g)]^T @ dY[segment (d, g)], fp32
    # accumulation. Segments come from the device counts [world, G] (rows destination-major,
    # then group), like gemm_a2a_kernel's. TILES_FIRST: program (tile, g), a group's tiles
    # consecutive (k tile major), so the programs running together read the same group's
    # rows of X and dY and share them in L2; else program (g, k tile, n tile).
    if TILES_FIRST:
        n_tiles = tl.cdiv(N, BLOCK_N)
        kt = tl.program_id(0) // n_tiles
        nt = tl.program_id(0) % n_tiles
        g = tl.program_id(1)
    else:
        g = tl.program_id(0)
        kt = tl.program_id(1)
        nt = tl.program_id(2)
    positions = tl.arange(0, WORLD_P2)
    segs = tl.arange(0, GROUPS_P2)
    in_world = positions < world
    counts = tl.load(counts_ptr + positions[:, None] * G + segs[None, :],
                     mask=in_world[:, None] & (segs[None, :] < G), other=0)
    # counts the caller cannot have meant (negative, or more rows than X and dY hold:
    # rows_bound) read nothing and give dW = 0, as grouped_local computes nothing for them;
    # each count is checked against the bound before the sum, which then cannot overflow
    bad = (tl.min(tl.min(counts, axis=1), axis=0) < 0) | \
        (tl.max(tl.max(counts, axis=1), axis=0) > rows_bound)
    bad = bad | (tl.sum(tl.sum(tl.where(bad, 0, counts), axis=1), axis=0) > rows_bound)
    counts = tl.where(bad, 0, counts)
    flat_start = tl.cumsum(tl.sum(counts, axis=1), axis=0) - tl.sum(counts, axis=1)
    seg_row = tl.cumsum(counts, axis=1) - counts
    ks = kt * BLOCK_K + tl.arange(0, BLOCK_K)
    ns = nt * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for d in range(0, world):
        count = tl.sum(tl.where((positions[:, None] == d) & (segs[None, :] == g), counts, 0))
        row0 = _pick(flat_start, d, positions) + tl.sum(
            tl.where((positions[:, None] == d) & (segs[None, :] == g), seg_row, 0))
        for m0 in range(0, count, BLOCK_M):
            rows = m0 + tl.arange(0, BLOCK_M)
            ok = rows < count
            r = (row0 + rows).to(tl.int64)
            xt = tl.load(x_ptr + r[None, :] * stride_xm + ks[:, None],
                         mask=ok[None, :] & (ks[:, None] < K), other=0.0)
            gy = tl.load(gy_ptr + r[:, None] * stride_gm + ns[None, :],
                         mask=ok[:, None] & (ns[None, :] < N), other=0.0)
            acc = tl.dot(xt, gy, acc)
    tl.store(dw_ptr + (g * K + ks[:, None]).to(tl.int64) * N + ns[None, :],
             acc.to(dw_ptr.dtype.element_ty), mask=(ks[:, None] < K) & (ns[None, :] < N))


@_kernel
def grouped_plan_kernel(counts_ptr, table_ptr, out_ptr, status_addr, rows_bound, out_rows, N,
                        max_tasks, segments, groups, n_tiles, SEGS_P2: tl.constexpr,
                        BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr, GROUP_M: tl.constexpr,
                        ZERO_ROWS: tl.constexpr, ZERO_COLS: tl.constexpr):
    # grouped_tiles_kernel's task table, from the device counts [segments] int64 (segment
    # s = source * groups + group; their rows one after another from row 0). Task t's
    # record is four int32 words: (first row of X, rows of the tile that are the segment's,
    # group, column tile); word 4 * max_tasks holds the number of tasks. Tasks go segment by
    # segment, inside one GROUP_M row tiles per column tile (they share W's columns in L2).
    # The rows of out [out_rows, N] past the segments are set to zero here (what a memset
    # of all of out did, at a fraction of the traffic). Counts the caller cannot have meant
    # (negative, or more rows than rows_bound) make no task at all (out is all zeros), and
    # program 0 records STATUS_BAD_INPUT in the int32 at status_addr. Each program writes
    # the records of BLOCK_T tasks and zeroes ZERO_ROWS rows; every program recomputes the
    # segments' prefix sums (a few hundred integers) rather than wait for another's.
    segs = tl.arange(0, SEGS_P2)
    wide = tl.load(counts_ptr + segs, mask=segs < segments, other=0)
    bad = ((tl.min(wide, axis=0) < 0) | (tl.max(wide, axis=0) > rows_bound)
           | (tl.sum(wide, axis=0) > rows_bound))  # each <= rows_bound first: no overflow
    c = tl.where(bad, 0, wide).to(tl.int32)
    tiles = tl.cdiv(c, BLOCK_M) * n_tiles
    tile_end = tl.cumsum(tiles, axis=0)
    total = tl.minimum(tl.sum(tiles, axis=0), max_tasks)
    pid = tl.program_id(0)
    if pid == 0:
        tl.store(table_ptr + 4 * max_tasks, total)
        if bad:
            tl.store(status_addr.to(tl.pointer_type(tl.int32)), STATUS_BAD_INPUT)
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    if pid * BLOCK_T < total:
        seg = tl.sum((tile_end[None, :] <= t[:, None]).to(tl.int32), axis=1)
        hot = seg[:, None] == segs[None, :]
        in_seg = t - tl.sum(tl.where(hot, (tile_end - tiles)[None, :], 0), axis=1)
        rows = tl.sum(tl.where(hot, c[None, :], 0), axis=1)
        row_first = tl.sum(tl.where(hot, (tl.cumsum(c, axis=0) - c)[None, :], 0), axis=1)
        m_tile, n_tile = _grouped_tile(in_seg, tl.cdiv(rows, BLOCK_M), n_tiles, GROUP_M)
        ok = t < total
        record = table_ptr + t * 4
        tl.store(record, row_first + m_tile * BLOCK_M, mask=ok)
        tl.store(record + 1, tl.minimum(rows - m_tile * BLOCK_M, BLOCK_M), mask=ok)
        tl.store(record + 2, seg % groups, mask=ok)
        tl.store(record + 3, n_tile, mask=ok)
    zr = pid * ZERO_ROWS + tl.arange(0, ZERO_ROWS)
    rows_taken = tl.sum(c, axis=0)
    if pid * ZERO_ROWS + ZERO_ROWS > rows_taken:
        zero_ok = (zr >= rows_taken) & (zr < out_rows)
        zc = tl.arange(0, ZERO_COLS)
        zeros = tl.zeros((ZERO_ROWS, ZERO_COLS), dtype=out_ptr.dtype.element_ty)
        for c0 in range(0, N, ZERO_COLS):
            tl.store(out_ptr + zr[:, None].to(tl.int64) * N + (c0 + zc)[None, :], zeros,
                     mask=zero_ok[:, None] & ((c0 + zc) < N)[None, :])


@_kernel
def grouped_tiles_kernel(x_ptr, w_ptr, out_ptr, table_ptr, max_tasks, N, K, num_programs,
                         stride_xm, stride_wg, stride_wk, stride_wn,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         USE_TMA: tl.constexpr, TRANS_W: tl.constexpr, EVEN_N: tl.constexpr,
                         EVEN_K: tl.constexpr, FP32_IEEE: tl.constexpr,
                         FLATTEN: tl.constexpr):
    # The grouped products of gpu.grouped_local: the tasks grouped_plan_kernel wrote into
    # table_ptr, each out[rows of its tile, its column tile] = X[those rows] @ W[g] (fp32
    # accumulation; _tile_product, _store_tile), persistent programs taking every
    # num_programs-th task. X is [M, K] with unit column stride, out [M, N] contiguous;
    # rows of a tile past its own are computed (from other segments' rows, or zeros past X)
    # and never stored.
    # USE_TMA (Hopper): X and W come as tensor descriptors: W [G, K, N] contiguous as
    # [G * K, N] (K a multiple of BLOCK_K: no box reaches into the next group), or with
    # TRANS_W, W^T's storage [G, N, K] contiguous as [G * N, K] (a box past N reads the next
    # group's rows, which only columns past N see, and those are not stored). Otherwise
    # pointer loads with W's strides. FLATTEN (with TMA only): the task loop and the K loop
    # are one software-pipelined loop, so the next task's first loads are in flight while
    # this one stores its tile: on an H200, in one run, the expert-parallel step's four
    # products ran 5-36 % behind torch._grouped_mm on the old kernel (gemm_a2a_kernel in
    # local mode) and -8 .. +5 % from it on this one (benchmarks/probe_grouped_persistent.py,
    # results/probe_grouped_persistent_h200_nineteenth_session.jsonl). With pointer loads
    # the flattened loop ran 3-7 x slower than the old kernel's (1.74 against 0.61 ms;
    # probe_ep_ffn_h200_nineteenth_session_products.jsonl, "default no TMA"), so
    # gpu.grouped_local flattens only TMA loops.
    total = tl.load(table_ptr + 4 * max_tasks)
    for task in tl.range(tl.program_id(0), total, num_programs, flatten=FLATTEN):
        record = table_ptr + task * 4
        row0 = tl.load(record)
        rows = tl.load(record + 1)
        g = tl.load(record + 2)
        n_tile = tl.load(record + 3)
        acc = _tile_product(x_ptr, w_ptr, row0, rows, n_tile, g, 0, K, N, K, stride_xm, 1,
                            stride_wg, stride_wk, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K, False,
                            FP32_IEEE, EVEN_N, EVEN_K, USE_TMA, TRANS_W)
        _store_tile(out_ptr, row0, 0, n_tile, acc, rows, N, BLOCK_M, BLOCK_N, EVEN_N)


def aot_signatures(dtype: str = "bf16") -> dict[str, dict[str, str]]:
    """Argument types of every kernel for ahead-of-time ``triton.compile``."""
    p = "*" + dtype
    i64 = "*i64"
    i32 = "*i32"
    offsets = dict(ws_offset="i64", signal_off="i64", ack_off="i64", count_off="i64",
                   epoch_off="i64", counters_off="i64", recv_off="i64", parity_bytes="i64",
                   source_bytes="i64")
    return {
        "gemm_a2a_kernel": dict(
            x_ptr=p, w_ptr=p, out_ptr=p, counts_ptr=i64, order_ptr=i32, peer_bases_ptr=i64,
            recv_ptr=i64, status_addr="i64", **offsets,
            rank="i32", world="i32", M="i32", N="i32", K="i32", G="i32", capacity="i64",
            num_programs="i32", stride_xm="i32", stride_xk="i32", stride_wg="i32",
            stride_wk="i32", stride_wn="i32", wait_budget="i32", split_addr="i64",
            split_tiles="i32", WORLD_P2="constexpr", GROUPS_P2="constexpr", BLOCK_M="constexpr",
            BLOCK_N="constexpr", BLOCK_K="constexpr", GROUP_M="constexpr", MODE="constexpr",
            COPY="constexpr", FP32_IEEE="constexpr", EVEN_N="constexpr", EVEN_K="constexpr",
            USE_TMA="constexpr", SPLIT_K="constexpr", DIRECT="constexpr", CLOCK="constexpr",
            SPLIT_SUM="constexpr", PDL="constexpr"),
        "split_sum_kernel": dict(
            out_ptr=p, counts_ptr=i64, M="i32", split_addr="i64", split_tiles="i32", N="i32",
            capacity="i64", BLOCK_M="constexpr", BLOCK_N="constexpr", SPLIT_K="constexpr",
            BLOCK="constexpr", PDL="constexpr"),
        "collect_kernel": dict(
            out_ptr=p, peer_bases_ptr=i64, recv_ptr=i64, status_addr="i64", ws_offset="i64",
            ack_off="i64", count_off="i64", epoch_off="i64", counters_off="i64",
            recv_off="i64", parity_bytes="i64", source_bytes="i64", rank="i32", world="i32",
            N="i32", capacity="i64", num_programs="i32", WORLD_P2="constexpr",
            ROWS="constexpr", BLOCK_N="constexpr"),
        "abort_kernel": dict(
            peer_bases_ptr=i64, status_addr="i64", ws_offset="i64", signal_off="i64",
            ack_off="i64", phase2_off="i64", count_off="i64", epoch_off="i64", rank="i32",
            world="i32", wait_budget="i32", WORLD_P2="constexpr", CLOCK="constexpr"),
        "grouped_plan_kernel": dict(
            counts_ptr=i64, table_ptr=i32, out_ptr=p, status_addr="i64", rows_bound="i64",
            out_rows="i32", N="i32", max_tasks="i32", segments="i32", groups="i32",
            n_tiles="i32", SEGS_P2="constexpr", BLOCK_T="constexpr", BLOCK_M="constexpr",
            GROUP_M="constexpr", ZERO_ROWS="constexpr", ZERO_COLS="constexpr"),
        "grouped_tiles_kernel": dict(
            x_ptr=p, w_ptr=p, out_ptr=p, table_ptr=i32, max_tasks="i32", N="i32", K="i32",
            num_programs="i32", stride_xm="i32", stride_wg="i32",
            stride_wk="i32", stride_wn="i32", BLOCK_M="constexpr", BLOCK_N="constexpr",
            BLOCK_K="constexpr", USE_TMA="constexpr", TRANS_W="constexpr",
            EVEN_N="constexpr", EVEN_K="constexpr", FP32_IEEE="constexpr",
            FLATTEN="constexpr"),
        "grouped_weight_grad_kernel": dict(
            x_ptr=p, gy_ptr=p, dw_ptr=p, counts_ptr=i64, world="i32", G="i32", K="i32",
            N="i32", stride_xm="i32", stride_gm="i32", rows_bound="i32",
            WORLD_P2="constexpr",
            GROUPS_P2="constexpr", BLOCK_K="constexpr", BLOCK_N="constexpr",
            BLOCK_M="constexpr", TILES_FIRST="constexpr"),
    }


def weight_grad_config(platform: str, fp32: bool = False) -> dict:
    """Tiles of grouped_weight_grad_kernel per platform: BLOCK_K x BLOCK_N of dW, BLOCK_M
    rows a step, a group's tiles consecutive (TILES_FIRST), launch options.

    Hopper (an H200, bf16, the expert-parallel step's 32 local experts of 1024 x 4096 and
    4096 x 1408 with rows from two sources; benchmarks/probe_ep_ffn.py --weight-grad,
    results/probe_ep_ffn_h200_eighteenth_session.jsonl): 128 x 128 tiles, 4 warps, tiles
    first ran 0.50 / 0.72 ms against 1.05 / 1.46 for 64 x 64 tiles groups first
    (torch._grouped_mm's weight-gradient form on group-major rows: 0.42 / 0.67); the grid
    order alone took the 64 x 64 tiles from 1.05 / 1.47 to 0.83 / 1.24 ms (the programs
    running together share a group's rows of X and dY in L2). At 4 warps the 128 x 128
    accumulator leaves ptxas short of registers (Triton 3.9 here: 255 and 572 bytes of spill
    a thread); 8 warps spill nothing and ran 0.69 / 0.97 ms, so the spilling tile stays.
    float32 steps 32 rows at a time (three stages of 64 would take 192 KB of shared
    memory). CDNA keeps the 64 x 64 tiles it had (three stages of 128 x 128 x 64 would not
    fit a CU's 64 KB of LDS; not measured on AMD hardware), in the tiles-first order."""
    if platform == "hip":
        return dict(BLOCK_K=64, BLOCK_N=64, BLOCK_M=32 if fp32 else 64, TILES_FIRST=True,
                    num_warps=4)
    return dict(BLOCK_K=128, BLOCK_N=128, BLOCK_M=32 if fp32 else 64, TILES_FIRST=True,
                num_warps=4, num_stages=3)


def grouped_config(platform: str, fp32: bool = False, block_n: int = 0) -> dict:
    """Tiles of grouped_tiles_kernel per platform, for a product whose column tile is
    `block_n` wide (0: the widest, which gpu.grouped_config narrows to one that divides N).

    Hopper (an H200, bf16, the expert-parallel step's products of 28,015 rows over 32 local
    experts, group-major and from two sources; benchmarks/probe_grouped_persistent.py,
    results/probe_grouped_persistent_h200_nineteenth_session.jsonl): 128 x 256 x 64, 8 warps,
    4 stages, flattened (0.36-0.55 ms against torch._grouped_mm's 0.39-0.58 on the same
    rows; 3 stages within 1 %); where N needs a 128-wide tile (1408) 4 warps, 4 stages
    (0.55 ms, 8 warps 0.58-0.60). float32 as the GEMM's own tile, not flattened (not timed).
    CDNA: the GEMM's default tile, not flattened (nothing here is measured on AMD)."""
    if fp32:  # pointer loads: not flattened (see grouped_tiles_kernel)
        cfg = dict(default_config(platform, True), FLATTEN=False)
    elif platform == "hip":
        cfg = dict(default_config(platform), FLATTEN=False)
    else:
        cfg = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8,
                   num_stages=4, USE_TMA=True, FLATTEN=True)
        if block_n and block_n < 256:
            cfg.update(BLOCK_N=block_n, num_warps=4)
    if block_n:
        cfg["BLOCK_N"] = block_n
    return cfg


def default_config(platform: str, fp32: bool = False) -> dict:
    """Tile shape and launch options per platform (Hopper wgmma / CDNA MFMA). float32 tiles
    are 4 bytes an element: a shorter K step keeps the pipeline inside shared memory.

    CDNA (gfx942, gfx90a): 128 x 128 tiles, BLOCK_K 64 (float32: 16), 8 waves, 2 stages, the
    largest tile the kernel keeps in registers in every mode. Two waves share a SIMD at 8
    waves a workgroup, so each has 256 VGPRs and no AGPRs; the 256 x 256 tile this replaced
    needed more and spilled to scratch inside its K loop: 85 VGPRs (344 bytes a lane) at
    world size 1, 186-194 (748-780 bytes) with the exchange epilogue on gfx942, 70-181 on
    gfx90a; 128 x 256 spilled 48-69 (gfx942) and 26-42 (gfx90a) outside the direct path, and
    float32's 128 x 128 x 32 9-27 on gfx942 (Triton 3.9's builds: benchmarks/
    amdgcn_resources.py, results/amdgcn_resources_twentythird_session.jsonl;
    tests/test_triton_compile.py keeps the tiles here spill-free). Not timed on AMD hardware:
    the GEMM tuner (gpu.gemm_plans._tuned_launch) times these and its CDNA candidates on the
    first call of a shape."""
    if platform == "hip":
        return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=16 if fp32 else 64, GROUP_M=8,
                    num_warps=8, num_stages=2)
    if fp32:
        return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, GROUP_M=8, num_warps=8, num_stages=2)
    # USE_TMA: on an H200 the copy-engine loads took the 4096^3 GEMM from 0.75 to 0.85 of
    # torch.matmul and 8192^3 from 0.85 to 0.96 (benchmarks/results/gemm_tma_h200.json);
    # gemm_operands() falls back to plain loads before Hopper and for unaligned operands.
    return dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3,
                USE_TMA=True)
