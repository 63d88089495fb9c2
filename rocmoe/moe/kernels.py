"""Triton kernels of the block-sparse products (AMD and NVIDIA).

Each program computes one output tile with ``tl.dot`` over a K loop, which the compilers
lower to MFMA (CDNA) and wgmma (Hopper). The kernels read the topology's int32 indices from
device memory; programs whose blocks are empty (row blocks past the real token count) run a
zero-trip loop and store zeros, so the launch grid is static and the host never needs the
real count.

They rely on the layout of every topology ``build_topology`` and the routing kernels make
(block-diagonal by expert): row block r holds blocks r*nb ... r*nb + nb - 1, consecutive
column blocks of one expert; the valid blocks of a column are consecutive row blocks; and the
CSC view is expert-major, column-major inside an expert. So a program finds its first block
with at most one index load, and the K loops walk memory linearly, with no index loads
inside the loop (which would stall the software pipeline).

Padding rows (past a row block's real token rows, ``Topology.block_rows``) are zero in every
operand the layer passes, so the kernels may skip them: SDD and DSD compute a row block with
at most B/2 real rows as its top half (``TAIL``), DSᵀD reduces over an expert's real rows
(``TRIM_K``). DSᵀD runs persistent by default (``dstd_persistent_kernel``): one flat,
software-pipelined loop over the k steps of all of a program's tiles.

Activations can be fused: DSD and DSᵀD apply ``ACT`` to the sparse operand as they load it
(so the forward never writes act(h)), and SDD can multiply its result by ``act'(h)`` in the
epilogue (which turns dL/d act(h) into dL/dh in the same pass).

The kernels are wrapped by ``triton.jit`` on first use (``get``). ``TRITON_INTERPRET=1``
must be set before triton is imported for the interpreter to run them on CPU tensors.
"""

from __future__ import annotations


import triton
import triton.language as tl

from .._triton import KernelRegistry, interpreting
from ..native_launch import FastKernel

_REGISTRY = KernelRegistry()
_kernel, get, names = _REGISTRY.kernel, _REGISTRY.get, _REGISTRY.names
_FAST: dict = {}


def launch(name: str):
    """What the layer launches kernel `name` through: `launch(name)[grid](*args, **kw)`.
    On a GPU a FastKernel (rocmoe/native_launch.py: after the first call of a
    specialisation, one driver call instead of the JIT's ~50-100 us of host work, which
    made small layers launch-bound); under the interpreter the JITFunction (`get`). Whether
    Triton interprets is read at a kernel's first launch in the process."""
    fast = _FAST.get(name)  # (first: the environment lookup costs about a microsecond)
    if fast is not None:
        return fast
    if interpreting():
        return get(name)
    fast = _FAST[name] = FastKernel(get(name))
    return fast

# Activation codes shared with blocksparse.py (constexpr ACT).
ACT_NONE, ACT_GELU_TANH, ACT_RELU, ACT_SILU = 0, 1, 2, 3


@triton.jit
def _tanh_approx(x):
    # One MUFU instruction (sm_75+), max relative error ~2^-11: below bf16/fp16 resolution.
    return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                     is_pure=True, pack=1)


@triton.jit
def _sigmoid(x, FAST: tl.constexpr):
    # FAST (NVIDIA only): sigmoid(x) = (1 + tanh(x/2)) / 2 costs one special-function op
    # where exp + reciprocal cost two; the SDD epilogue that writes GELU and GELU' of a
    # 128x256 tile is bound by them (they issue at 1/8 of the FMA rate).
    if FAST:
        s = 0.5 + 0.5 * _tanh_approx(0.5 * x)
    else:
        s = tl.sigmoid(x)
    return s


@triton.jit
def _activate(x, ACT: tl.constexpr, FAST: tl.constexpr = False):
    if ACT == 1:  # gelu, tanh form: x * sigmoid(2 * sqrt(2/pi) * (x + 0.044715 x^3))
        x = x * _sigmoid(1.5957691216057308 * (x + 0.044715 * x * x * x), FAST)
    elif ACT == 2:
        x = tl.maximum(x, 0.0)
    elif ACT == 3:
        x = x * _sigmoid(x, FAST)
    return x


@triton.jit
def _activate_grad(x, ACT: tl.constexpr, FAST: tl.constexpr = False):
    if ACT == 1:
        s = _sigmoid(1.5957691216057308 * (x + 0.044715 * x * x * x), FAST)
        d = s + x * s * (1.0 - s) * 1.5957691216057308 * (1.0 + 0.134145 * x * x)
    elif ACT == 2:
        d = tl.where(x > 0.0, 1.0, 0.0)
    elif ACT == 3:
        s = _sigmoid(x, FAST)
        d = s * (1.0 + x * (1.0 - s))
    else:
        d = tl.full(x.shape, 1.0, tl.float32)
    return d


@triton.jit
def _activate_with_grad(x, ACT: tl.constexpr, FAST: tl.constexpr = False):
    """(act(x), act'(x)) from one sigmoid: the epilogues that need both."""
    if ACT == 1:
        s = _sigmoid(1.5957691216057308 * (x + 0.044715 * x * x * x), FAST)
        a = x * s
        d = s + x * s * (1.0 - s) * 1.5957691216057308 * (1.0 + 0.134145 * x * x)
    elif ACT == 2:
        a = tl.maximum(x, 0.0)
        d = tl.where(x > 0.0, 1.0, 0.0)
    elif ACT == 3:
        s = _sigmoid(x, FAST)
        a = x * s
        d = s * (1.0 + x * (1.0 - s))
    else:
        a = x
        d = tl.full(x.shape, 1.0, tl.float32)
    return a, d


@triton.jit
def _grouped_tile(t, num_rows, num_n, GROUP_M: tl.constexpr):
    """(row block, column tile) of output tile t in launch order. GROUP_M = 1: a row block's
    column tiles one after another. GROUP_M > 1: GROUP_M row blocks take each column tile in
    turn, so the programs running side by side share a weight tile (one HBM read, L2 hits
    for the others) where a row-major order streams every weight tile once per row block:
    an expert of many row blocks with a long K (the 4-expert shape's SDD) is bound by that
    weight traffic."""
    if GROUP_M == 1:
        row, n = t // num_n, t % num_n
    else:
        per_group = GROUP_M * num_n
        first = (t // per_group) * GROUP_M
        size = tl.minimum(num_rows - first, GROUP_M)
        r = t % per_group
        row, n = first + r % size, r // size
    return row, n


@_kernel
def sdd_kernel(a_ptr, a_half_ptr, w_ptr, out_ptr, h_ptr, act_out_ptr, col_idx_ptr,
               block_rows_ptr, a_rows_ptr, first_row_ptr, K, F, nb, num_n,
               stride_am, stride_ak,
               stride_we, stride_wk, stride_wf,
               BLOCK: tl.constexpr, SPLIT: tl.constexpr, BLOCK_K: tl.constexpr,
               EVEN_K: tl.constexpr, EVEN_F: tl.constexpr, EPILOGUE_ACT_GRAD: tl.constexpr,
               EPILOGUE_STORE_ACT: tl.constexpr, EPILOGUE_SCALE: tl.constexpr,
               USE_TMA: tl.constexpr = False, W_T: tl.constexpr = False,
               FAST_ACT: tl.constexpr = False, PRELOAD_SCALE: tl.constexpr = False,
               EPILOGUE_ACT: tl.constexpr = 0, TAIL: tl.constexpr = False,
               GROUP_M: tl.constexpr = 1, STORE_PRE: tl.constexpr = False,
               REWRITE_ACT: tl.constexpr = False, GATHER_A: tl.constexpr = False,
               COMPACT: tl.constexpr = False):
    # out[blk] = a[rows of row block r] @ w[e, :, cols of blk] for SPLIT consecutive blocks blk
    # of row r (a B x SPLIT*B tile per program: wider tiles feed the matrix units better).
    # With EPILOGUE_ACT_GRAD: out[blk] *= act'(h[blk]).
    # With EPILOGUE_SCALE: out[blk] *= h[blk] (h holds act'(.) already: no transcendental).
    # With EPILOGUE_STORE_ACT: act_out[blk] = act(p) and out[blk] = act'(p) for the product p
    # (the forward of act_fusion="store": the backward then only multiplies by act'(p)).
    # With EPILOGUE_ACT: out[blk] = act(p) (a forward that no backward will follow).
    # STORE_PRE (with EPILOGUE_STORE_ACT): out[blk] = p itself, act_out[blk] = act(p): the
    # forward of act_fusion="recompute", which keeps p alone for the backward.
    # REWRITE_ACT (with EPILOGUE_ACT_GRAD; act_out_ptr is h_ptr): out[blk] *= act'(h[blk])
    # rounded to the storage type, and h[blk] is overwritten with act(h[blk]) in place (each
    # program reads and writes its own tile only): the backward of "recompute", which then
    # needs act(h) but never h again. Rounding act' makes the gradient bitwise that of
    # act_fusion="store", whose forward stored act'(h) in the storage type.
    # USE_TMA (Hopper; the launcher checks alignment, EVEN_K and EVEN_F): a_ptr describes
    # A [P, K] in [BLOCK, BLOCK_K] boxes (a_half_ptr is A itself, for TAIL); w_ptr
    # describes W as [E*K, F] in [BLOCK_K, SPLIT*B] boxes, or with W_T (W is the transpose of
    # a contiguous [E, F, K], as in the backward's W2ᵀ) that tensor as [E*F, K] in
    # [SPLIT*B, BLOCK_K] boxes, transposed in shared memory.
    # FAST_ACT (NVIDIA): the epilogue's sigmoids use tanh.approx. PRELOAD_SCALE: with
    # EPILOGUE_SCALE, the scale tile is loaded before the K loop, so its latency hides behind
    # the products instead of stalling the epilogue.
    # TAIL: a row block with at most B/2 real rows (block_rows_ptr: real rows per row block),
    # typically an expert's last, is computed as its top half only, with zeros stored below:
    # with 128-row blocks and ~256 tokens per expert that is a tenth of all the rows.
    # GROUP_M: the launch order of the tiles (see _grouped_tile).
    # GATHER_A: A is the unpermuted tokens [T, K]; row p of the padded rows is token
    # a_rows[p] (-1: padding, read as zeros), loaded by pointer (TMA cannot gather rows on
    # Hopper): no permuted copy of the tokens exists (act_fusion's "gather_rows").
    # COMPACT: the values (out, h, act_out) are stored without their padding rows, as
    # [pairs, nb * B] rows (see _value_offsets); padding rows are neither computed into
    # memory nor stored.
    row_block, n_idx = _grouped_tile(tl.program_id(0), tl.num_programs(0) // num_n, num_n,
                                     GROUP_M)
    first, end, valid, expert, f0 = _sdd_tile(row_block, n_idx, col_idx_ptr, nb, BLOCK, SPLIT)
    half = tl.constexpr(False)  # (a constexpr: without TAIL the half branch is not built)
    if TAIL:
        half = valid & (tl.load(block_rows_ptr + row_block) <= BLOCK // 2)
    if half:
        _sdd_rows(BLOCK // 2, row_block, first, end, valid, expert, f0, a_half_ptr, w_ptr,
                  out_ptr, h_ptr, act_out_ptr, K, F, stride_am, stride_ak, stride_we,
                  stride_wk, stride_wf, BLOCK, SPLIT, BLOCK_K, EVEN_K, EVEN_F,
                  EPILOGUE_ACT_GRAD, EPILOGUE_STORE_ACT, EPILOGUE_SCALE, USE_TMA, W_T,
                  FAST_ACT, PRELOAD_SCALE, EPILOGUE_ACT, False, STORE_PRE, REWRITE_ACT,
                  GATHER_A, a_rows_ptr, nb, block_rows_ptr, first_row_ptr, COMPACT)
    else:
        _sdd_rows(BLOCK, row_block, first, end, valid, expert, f0, a_ptr, w_ptr,
                  out_ptr, h_ptr, act_out_ptr, K, F, stride_am, stride_ak, stride_we,
                  stride_wk, stride_wf, BLOCK, SPLIT, BLOCK_K, EVEN_K, EVEN_F,
                  EPILOGUE_ACT_GRAD, EPILOGUE_STORE_ACT, EPILOGUE_SCALE, USE_TMA, W_T,
                  FAST_ACT, PRELOAD_SCALE, EPILOGUE_ACT, USE_TMA and not GATHER_A, STORE_PRE,
                  REWRITE_ACT, GATHER_A, a_rows_ptr, nb, block_rows_ptr, first_row_ptr,
                  COMPACT)


@triton.jit
def _sdd_rows(BM: tl.constexpr, row_block, first, end, valid, expert, f0, a_ptr, w_ptr,
              out_ptr, h_ptr, act_out_ptr, K, F, stride_am, stride_ak, stride_we, stride_wk,
              stride_wf, BLOCK: tl.constexpr, SPLIT: tl.constexpr, BLOCK_K: tl.constexpr,
              EVEN_K: tl.constexpr, EVEN_F: tl.constexpr, EPILOGUE_ACT_GRAD: tl.constexpr,
              EPILOGUE_STORE_ACT: tl.constexpr, EPILOGUE_SCALE: tl.constexpr,
              USE_TMA: tl.constexpr, W_T: tl.constexpr, FAST_ACT: tl.constexpr,
              PRELOAD_SCALE: tl.constexpr, EPILOGUE_ACT: tl.constexpr, A_DESC: tl.constexpr,
              STORE_PRE: tl.constexpr, REWRITE_ACT: tl.constexpr, GATHER_A: tl.constexpr,
              a_rows_ptr, nb, block_rows_ptr, first_row_ptr, COMPACT: tl.constexpr):
    """sdd_kernel's tile on the top BM rows of its row block (zeros stored below them).
    With USE_TMA, A comes through a descriptor when A_DESC, else (the half blocks: one more
    descriptor per launch cost more host time than their few loads gain) by pointer."""
    k_end = tl.where(valid, K, 0)
    rm = tl.arange(0, BM)
    rn = tl.arange(0, SPLIT * BLOCK)
    rk = tl.arange(0, BLOCK_K)
    offs, in_row = _value_offsets(first, end, f0, row_block, nb, block_rows_ptr,
                                  first_row_ptr, BLOCK, SPLIT, BM, 0, COMPACT)
    if EPILOGUE_SCALE and PRELOAD_SCALE:
        scale = tl.load(h_ptr + offs, mask=in_row, other=0.0)
    else:
        scale = 0.0
    acc = tl.zeros((BM, SPLIT * BLOCK), dtype=tl.float32)
    # a_ok: the rows A has (every row unless GATHER_A, where padding rows have no token)
    if GATHER_A:
        src = tl.load(a_rows_ptr + row_block * BLOCK + rm)
        a_ok = src >= 0
        a_ptrs = a_ptr + tl.maximum(src, 0).to(tl.int64)[:, None] * stride_am \
            + rk[None, :] * stride_ak
    else:
        a_ok = rm >= 0
        if not (USE_TMA and A_DESC):
            a_ptrs = a_ptr + (row_block * BLOCK + rm).to(tl.int64)[:, None] * stride_am \
                + rk[None, :] * stride_ak
    if USE_TMA:
        for k in range(0, k_end, BLOCK_K):
            if A_DESC:
                a = a_ptr.load([row_block * BLOCK, k])
            else:
                # (TMA implies EVEN_K)
                if GATHER_A:
                    a = tl.load(a_ptrs, mask=a_ok[:, None], other=0.0)
                else:
                    a = tl.load(a_ptrs)
                a_ptrs += BLOCK_K * stride_ak
            if W_T:
                w = tl.trans(w_ptr.load([expert * F + f0, k]))
            else:
                w = w_ptr.load([expert * K + k, f0])
            acc += tl.dot(a, w)
    else:
        f_cols = f0 + rn
        w_ptrs = (w_ptr + expert.to(tl.int64) * stride_we + rk[:, None] * stride_wk
                  + f_cols[None, :] * stride_wf)
        for k in range(0, k_end, BLOCK_K):
            if EVEN_K:
                if GATHER_A:
                    a = tl.load(a_ptrs, mask=a_ok[:, None], other=0.0)
                else:
                    a = tl.load(a_ptrs)
                if EVEN_F:
                    w = tl.load(w_ptrs)
                else:
                    w = tl.load(w_ptrs, mask=f_cols[None, :] < F, other=0.0)
            else:
                k_ok = (k + rk) < K
                a = tl.load(a_ptrs, mask=a_ok[:, None] & k_ok[None, :], other=0.0)
                w = tl.load(w_ptrs, mask=k_ok[:, None] & (f_cols[None, :] < F), other=0.0)
            acc += tl.dot(a, w)
            a_ptrs += BLOCK_K * stride_ak
            w_ptrs += BLOCK_K * stride_wk
    _sdd_finish(acc, scale, offs, in_row, out_ptr, h_ptr, act_out_ptr, EPILOGUE_ACT_GRAD,
                EPILOGUE_STORE_ACT, EPILOGUE_SCALE, FAST_ACT, PRELOAD_SCALE, EPILOGUE_ACT,
                STORE_PRE, REWRITE_ACT)
    if BM < BLOCK and not COMPACT:  # (compact values keep no padding rows)
        # the lower rows are padding (zero in A): what the epilogue makes of a zero product
        z_offs, z_in_row = _value_offsets(first, end, f0, row_block, nb, block_rows_ptr,
                                          first_row_ptr, BLOCK, SPLIT, BLOCK - BM, BM, False)
        zero = tl.zeros((BLOCK - BM, SPLIT * BLOCK), dtype=tl.float32)
        # (REWRITE_ACT: h is zero there, and act(0) = 0, so h needs no store)
        if EPILOGUE_STORE_ACT != 0:
            # act(0) = 0; act'(0) is 1/2 for GELU and SiLU
            tl.store(act_out_ptr + z_offs, zero.to(out_ptr.dtype.element_ty), mask=z_in_row)
            if not STORE_PRE:
                zero = _activate_grad(zero, EPILOGUE_STORE_ACT, FAST_ACT)
        tl.store(out_ptr + z_offs, zero.to(out_ptr.dtype.element_ty), mask=z_in_row)


@triton.jit
def _sdd_tile(row_block, n_idx, col_idx_ptr, nb, BLOCK: tl.constexpr, SPLIT: tl.constexpr):
    """SDD output tile (row block, column tile n_idx): (first block, end of its row's blocks,
    whether it holds real rows, expert, first ffn column)."""
    # row r's blocks are r*nb ... r*nb + nb - 1 (row_offsets = r * nb): no index load
    first = row_block * nb + n_idx * SPLIT
    end = (row_block + 1) * nb
    col = tl.load(col_idx_ptr + first)
    valid = col >= 0
    col = tl.where(valid, col, 0)
    return first, end, valid, col // nb, (col % nb) * BLOCK


@triton.jit
def _value_offsets(first, end, f0, row_block, nb, block_rows_ptr, first_row_ptr,
                   BLOCK: tl.constexpr, SPLIT: tl.constexpr, ROWS: tl.constexpr,
                   ROW0: tl.constexpr, COMPACT: tl.constexpr):
    """Element offsets of rows ROW0 ... ROW0 + ROWS - 1 of row block `row_block`'s
    B x SPLIT*B tile whose first block is `first` (ffn column f0) in the sparse values, and
    the [ROWS, SPLIT*B] mask of the elements that exist: its columns (a row whose block
    count is not a multiple of SPLIT) and, with COMPACT, its real rows only.

    Values are [nnz, B, B] blocks, or with COMPACT [pairs, nb * B] rows without padding:
    row i of row block r is row first_row[r] + i, for i < block_rows[r] (an expert's rows
    are consecutive, in the order of its padded rows)."""
    rm = ROW0 + tl.arange(0, ROWS)
    rn = tl.arange(0, SPLIT * BLOCK)
    cols = (first + rn // BLOCK) < end
    if COMPACT:
        row0 = tl.load(first_row_ptr + row_block)
        real = tl.load(block_rows_ptr + row_block)
        offs = (row0 + rm).to(tl.int64)[:, None] * (nb * BLOCK) + (f0 + rn)[None, :]
        ok = (rm < real)[:, None] & cols[None, :]
    else:
        # tile column c lives in block first + c // B at column c % B
        offs = ((first + rn // BLOCK).to(tl.int64) * (BLOCK * BLOCK))[None, :] \
            + rm[:, None] * BLOCK + (rn % BLOCK)[None, :]
        ok = (rm >= 0)[:, None] & cols[None, :]
    return offs, ok


@triton.jit
def _sdd_finish(acc, scale, offs, in_row, out_ptr, h_ptr, act_out_ptr,
                EPILOGUE_ACT_GRAD: tl.constexpr, EPILOGUE_STORE_ACT: tl.constexpr,
                EPILOGUE_SCALE: tl.constexpr, FAST_ACT: tl.constexpr,
                PRELOAD_SCALE: tl.constexpr, EPILOGUE_ACT: tl.constexpr,
                STORE_PRE: tl.constexpr = False, REWRITE_ACT: tl.constexpr = False):
    """SDD's epilogue (see sdd_kernel) and store; `scale` is the preloaded tile when
    PRELOAD_SCALE."""
    if EPILOGUE_ACT_GRAD != 0:
        h = tl.load(h_ptr + offs, mask=in_row, other=0.0).to(tl.float32)
        if REWRITE_ACT:
            act, d = _activate_with_grad(h, EPILOGUE_ACT_GRAD, FAST_ACT)
            tl.store(act_out_ptr + offs, act.to(out_ptr.dtype.element_ty), mask=in_row)
            acc = acc * d.to(out_ptr.dtype.element_ty).to(tl.float32)
        else:
            acc = acc * _activate_grad(h, EPILOGUE_ACT_GRAD, FAST_ACT)
    if EPILOGUE_SCALE:
        if not PRELOAD_SCALE:
            scale = tl.load(h_ptr + offs, mask=in_row, other=0.0)
        acc = acc * scale.to(tl.float32)
    if EPILOGUE_STORE_ACT != 0:
        # act and act' of the rounded value, as the unfused reference computes both from a
        # stored h
        hr = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
        act, d = _activate_with_grad(hr, EPILOGUE_STORE_ACT, FAST_ACT)
        tl.store(act_out_ptr + offs, act.to(out_ptr.dtype.element_ty), mask=in_row)
        if not STORE_PRE:
            acc = d
    if EPILOGUE_ACT != 0:
        acc = _activate(acc.to(out_ptr.dtype.element_ty).to(tl.float32), EPILOGUE_ACT, FAST_ACT)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=in_row)


@_kernel
def sdd_persistent_kernel(a_ptr, w_ptr, out_ptr, h_ptr, act_out_ptr, col_idx_ptr,
                          block_rows_ptr, first_row_ptr, K, F, nb, num_n, num_tiles,
                          BLOCK: tl.constexpr, SPLIT: tl.constexpr, BLOCK_K: tl.constexpr,
                          EPILOGUE_ACT_GRAD: tl.constexpr, EPILOGUE_STORE_ACT: tl.constexpr,
                          EPILOGUE_SCALE: tl.constexpr, W_T: tl.constexpr = False,
                          FAST_ACT: tl.constexpr = False, EPILOGUE_ACT: tl.constexpr = 0,
                          COUNT_TILE: tl.constexpr = 64, GROUP_M: tl.constexpr = 1,
                          STORE_PRE: tl.constexpr = False, REWRITE_ACT: tl.constexpr = False,
                          COMPACT: tl.constexpr = False):
    # SDD as sdd_kernel computes it (tensor-descriptor operands, K a multiple of BLOCK_K),
    # by a few programs per SM that take the tiles pid, pid + grid, ... in one flat loop over
    # all their k steps, as dstd_persistent_kernel does: SDD's K is the hidden size, 8-16
    # steps on the small-hidden shapes, so a tile's first loads and its two-tile epilogue
    # are a large share of a program per tile. A tile of padding rows (past the real token
    # count) takes one step whose product is discarded and stores zeros.
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    k_full = K // BLOCK_K
    total = 0
    for t0 in range(pid, num_tiles, grid * COUNT_TILE):
        t = t0 + tl.arange(0, COUNT_TILE) * grid
        ok = t < num_tiles
        t_row, t_n = _grouped_tile(t, num_tiles // num_n, num_n, GROUP_M)
        first = t_row * nb + t_n * SPLIT
        col = tl.load(col_idx_ptr + first, mask=ok, other=-1)
        total += tl.sum(tl.where(ok, tl.where(col >= 0, k_full, 1), 0))
    tile = pid - grid
    row_block = 0
    ki = -1
    k_steps = 0
    first = 0
    end = 0
    valid = False
    expert = 0
    f0 = 0
    acc = tl.zeros((BLOCK, SPLIT * BLOCK), dtype=tl.float32)
    for _ in range(0, total):
        ki = tl.where(ki == k_steps - 1, 0, ki + 1)
        if ki == 0:
            tile += grid
            row_block, n_idx = _grouped_tile(tile, num_tiles // num_n, num_n, GROUP_M)
            first, end, valid, expert, f0 = _sdd_tile(row_block, n_idx, col_idx_ptr, nb,
                                                      BLOCK, SPLIT)
            k_steps = tl.where(valid, k_full, 1)
        k = ki * BLOCK_K
        a = a_ptr.load([row_block * BLOCK, k])
        if W_T:
            w = tl.trans(w_ptr.load([expert * F + f0, k]))
        else:
            w = w_ptr.load([expert * K + k, f0])
        acc = tl.dot(a, w, acc)
        if ki == k_steps - 1:
            acc = tl.where(valid, acc, 0.0)
            offs, in_row = _value_offsets(first, end, f0, row_block, nb, block_rows_ptr,
                                          first_row_ptr, BLOCK, SPLIT, BLOCK, 0, COMPACT)
            # (the scale tile is read here: carried across the loop from a load at the
            # tile's first step, it made the backward SDD 5x slower on the H200)
            _sdd_finish(acc, 0.0, offs, in_row, out_ptr, h_ptr, act_out_ptr,
                        EPILOGUE_ACT_GRAD, EPILOGUE_STORE_ACT, EPILOGUE_SCALE, FAST_ACT,
                        False, EPILOGUE_ACT, STORE_PRE, REWRITE_ACT)
            acc = tl.zeros((BLOCK, SPLIT * BLOCK), dtype=tl.float32)


@_kernel
def dsd_kernel(s_ptr, s_half_ptr, w_ptr, out_ptr, col_idx_ptr, block_rows_ptr, first_row_ptr,
               N, F, nb, num_n,
               stride_we, stride_wf, stride_wn,
               stride_om, stride_on,
               BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               EVEN_F: tl.constexpr, EVEN_N: tl.constexpr, ACT: tl.constexpr,
               USE_TMA: tl.constexpr = False, W_T: tl.constexpr = False,
               TAIL: tl.constexpr = False, GROUP_M: tl.constexpr = 1,
               COMPACT: tl.constexpr = False):
    # out[rows of row block r, tile] = sum over blocks of r: act(s[blk]) @ w[e, cols of blk, tile]
    # USE_TMA (Hopper; the launcher checks alignment and EVEN_F): s_ptr describes the values
    # as [nnz*B, B] in [B, BLOCK_K] boxes (s_half_ptr is the values, for TAIL); w_ptr
    # describes W as [E*F, N] in [BLOCK_K, BLOCK_N] boxes, or with W_T (W is the transpose of
    # a contiguous [E, N, F], as W1ᵀ in the backward) that tensor as [E*N, F] in
    # [BLOCK_N, BLOCK_K] boxes (rows past N belong to the next expert: they only reach output
    # columns the store masks off).
    # Output tiles of one row block are neighbours in launch order, so the row block's
    # sparse values are read from HBM once and hit L2 for the other N tiles; with
    # GROUP_M > 1, GROUP_M row blocks share each W tile too (see _grouped_tile).
    # TAIL: as in sdd_kernel, a row block with at most B/2 real rows computes its top half.
    # COMPACT: the values are [pairs, nb * B] rows (see _value_offsets); with USE_TMA s_ptr
    # describes them in [B, BLOCK_K] boxes. Rows of a box past the row block's real ones
    # belong to the next expert (or lie past the end: zeros), so the tile's output rows
    # there are stored as zeros, as padding rows always are.
    row_block, pid_n = _grouped_tile(tl.program_id(0), tl.num_programs(0) // num_n, num_n,
                                     GROUP_M)
    start = row_block * nb  # row_offsets[r] = r * nb (see the module docstring)
    end = start + nb
    first_col = tl.load(col_idx_ptr + start, mask=start < end, other=-1)
    # An empty row block (past the real token count) gets a zero-trip loop and stores zeros.
    num_blocks = tl.where(first_col >= 0, end - start, 0)
    first_col = tl.where(first_col >= 0, first_col, 0)
    expert = first_col // nb
    f_first = (first_col % nb) * BLOCK
    half = tl.constexpr(False)  # (a constexpr: without TAIL the half branch is not built)
    if TAIL:
        half = (num_blocks > 0) & (tl.load(block_rows_ptr + row_block) <= BLOCK // 2)
    if COMPACT:
        row0 = tl.load(first_row_ptr + row_block)
        real = tl.load(block_rows_ptr + row_block)
    else:
        row0 = 0
        real = BLOCK
    if half:
        _dsd_rows(BLOCK // 2, row_block, pid_n, start, num_blocks, expert, f_first,
                  s_half_ptr, w_ptr, out_ptr, N, F, stride_we, stride_wf, stride_wn,
                  stride_om, stride_on, BLOCK, BLOCK_N, BLOCK_K, EVEN_F, EVEN_N, ACT,
                  USE_TMA, W_T, False, row0, real, nb, COMPACT)
    else:
        _dsd_rows(BLOCK, row_block, pid_n, start, num_blocks, expert, f_first,
                  s_ptr, w_ptr, out_ptr, N, F, stride_we, stride_wf, stride_wn,
                  stride_om, stride_on, BLOCK, BLOCK_N, BLOCK_K, EVEN_F, EVEN_N, ACT,
                  USE_TMA, W_T, USE_TMA, row0, real, nb, COMPACT)


@triton.jit
def _dsd_rows(BM: tl.constexpr, row_block, pid_n, start, num_blocks, expert, f_first,
              s_ptr, w_ptr, out_ptr, N, F, stride_we, stride_wf, stride_wn, stride_om,
              stride_on, BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              EVEN_F: tl.constexpr, EVEN_N: tl.constexpr, ACT: tl.constexpr,
              USE_TMA: tl.constexpr, W_T: tl.constexpr, S_DESC: tl.constexpr, row0, real,
              nb, COMPACT: tl.constexpr):
    """dsd_kernel's tile on the top BM rows of its row block (zeros stored below them).
    With USE_TMA, the sparse operand comes through a descriptor when S_DESC, else by
    pointer (the half blocks, as in _sdd_rows). COMPACT: the row block's values are rows
    row0 ... of [pairs, nb * B] values, `real` of them its own."""
    rm = tl.arange(0, BM)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    # The blocks of a row are stored one after another and cover consecutive ffn columns,
    # so the K loop is linear in the ffn index; the sparse operand jumps by one B x B block
    # each time kk crosses a block boundary. A flat loop (not blocks x static sub-steps)
    # keeps one BLOCK_K slice per pipeline stage, so 3-4 stages fit in shared memory.
    acc = tl.zeros((BM, BLOCK_N), dtype=tl.float32)
    s_offs = rm[:, None] * BLOCK + rk[None, :]
    row_ok = rm < real
    if COMPACT and not (USE_TMA and S_DESC):
        s_rows = s_ptr + (row0 + rm).to(tl.int64)[:, None] * (nb * BLOCK) + rk[None, :]
    elif not (USE_TMA and S_DESC):
        s_base = s_ptr + start.to(tl.int64) * BLOCK * BLOCK
    if USE_TMA:
        n0 = pid_n * BLOCK_N
        for kk in range(0, num_blocks * BLOCK, BLOCK_K):
            if S_DESC and COMPACT:
                s = s_ptr.load([row0, kk])
            elif S_DESC:
                s = s_ptr.load([(start + kk // BLOCK) * BLOCK, kk % BLOCK])
            elif COMPACT:
                s = tl.load(s_rows + kk, mask=row_ok[:, None], other=0.0)
            else:
                blk_off = tl.multiple_of((kk // BLOCK) * (BLOCK * BLOCK), BLOCK * BLOCK)
                s = tl.load(s_base + blk_off + tl.multiple_of(kk % BLOCK, BLOCK_K) + s_offs)
            if ACT != 0:
                s = _activate(s.to(tl.float32), ACT).to(s.dtype)
            if W_T:
                w = tl.trans(w_ptr.load([expert * N + n0, f_first + kk]))
            else:
                w = w_ptr.load([expert * F + f_first + kk, n0])
            acc += tl.dot(s, w)
    else:
        w_ptrs = (w_ptr + expert.to(tl.int64) * stride_we + (f_first + rk)[:, None] * stride_wf
                  + rn[None, :] * stride_wn)
        for kk in range(0, num_blocks * BLOCK, BLOCK_K):
            # The sparse operand's offset is recomputed from kk with explicit multiple-of hints
            # (not carried as a pointer bumped by a tl.where): Triton 3.6 could not prove the
            # carried form 16-byte aligned, loaded the tile with 2-byte scalar loads outside the
            # software pipeline, and DSD ran at 260-280 TFLOP/s on an H200 against SDD's 600.
            if COMPACT:
                s = tl.load(s_rows + tl.multiple_of(kk, BLOCK_K), mask=row_ok[:, None],
                            other=0.0)
            else:
                k_in_block = tl.multiple_of(kk % BLOCK, BLOCK_K)
                # (int32 is enough: a row holds ffn / BLOCK blocks, far below 2^31 / B^2)
                blk_off = tl.multiple_of((kk // BLOCK) * (BLOCK * BLOCK), BLOCK * BLOCK)
                s = tl.load(s_base + blk_off + k_in_block + s_offs)
            if ACT != 0:
                s = _activate(s.to(tl.float32), ACT).to(w_ptr.dtype.element_ty)
            if EVEN_F and EVEN_N:
                w = tl.load(w_ptrs)
            else:
                w = tl.load(w_ptrs, mask=((f_first + kk + rk)[:, None] < F) & n_ok[None, :],
                            other=0.0)
            acc += tl.dot(s, w)
            w_ptrs += BLOCK_K * stride_wf
    if COMPACT and S_DESC:  # (the box's rows past the real ones are the next expert's)
        acc = tl.where(row_ok[:, None], acc, 0.0)
    rows = (row_block * BLOCK + rm).to(tl.int64)
    out_ptrs = out_ptr + rows[:, None] * stride_om + rn[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=n_ok[None, :])
    if BM < BLOCK:
        z_rows = (row_block * BLOCK + BM + tl.arange(0, BLOCK - BM)).to(tl.int64)
        tl.store(out_ptr + z_rows[:, None] * stride_om + rn[None, :] * stride_on,
                 tl.zeros((BLOCK - BM, BLOCK_N), dtype=out_ptr.dtype.element_ty),
                 mask=n_ok[None, :])


@triton.jit
def _dstd_column(c, col_off_ptr, expert_rows_ptr, nb, BLOCK: tl.constexpr,
                 BLOCK_K: tl.constexpr, TRIM_K: tl.constexpr):
    """(first row block, first block, rows to reduce over) of column block c in the CSC
    view: its valid blocks' rows or, with TRIM_K, the expert's real rows rounded up to
    BLOCK_K (the rest of its last block is padding, zero in both operands)."""
    start = tl.load(col_off_ptr + c)
    num_blocks = tl.load(col_off_ptr + c + 1) - start
    k_len = num_blocks * BLOCK
    if TRIM_K:
        real = tl.load(expert_rows_ptr + c // nb)
        k_len = tl.minimum(k_len, (real + BLOCK_K - 1) // BLOCK_K * BLOCK_K)
    j = c % nb
    # The CSC view is expert-major and column-major inside an expert: column j of expert e
    # starts at start_e * nb + j * blocks_e, start_e being e's first row block. So the first
    # row block follows from the two offsets alone, where reading transpose_blocks and then
    # row_indices cost two more dependent loads per program (a third of a program's time for
    # experts of 2-3 row blocks).
    first_row = (start - j * num_blocks) // nb
    return first_row, first_row * nb + j, k_len


@triton.jit
def _dstd_store(acc, out_ptr, expert, f0, n0, N, F, stride_oe, stride_of, stride_on,
                BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, TMA_STORE: tl.constexpr,
                OUT_T: tl.constexpr):
    if TMA_STORE:
        # out_ptr describes the output as [E*F, N] in [BLOCK, BLOCK_N] boxes, or with OUT_T
        # (the output is the transpose of a contiguous [E, N, F], as dW1) that tensor as
        # [E*N, F] in [BLOCK_N, BLOCK] boxes; the launcher checks that no box crosses into
        # the next expert. The copy engine writes the tile from shared memory, in bulk.
        val = acc.to(out_ptr.dtype)
        if OUT_T:
            out_ptr.store([expert * N + n0, f0], tl.trans(val))
        else:
            out_ptr.store([expert * F + f0, n0], val)
    else:
        f = f0 + tl.arange(0, BLOCK)
        rn = n0 + tl.arange(0, BLOCK_N)
        out_ptrs = (out_ptr + expert.to(tl.int64) * stride_oe + f[:, None] * stride_of
                    + rn[None, :] * stride_on)
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty),
                 mask=(f[:, None] < F) & (rn < N)[None, :])


@triton.jit
def _load_gathered(b_ptr, rows_ptr, row0, rn, n_ok, stride_bm, stride_bn,
                   BLOCK_K: tl.constexpr, live):
    """The [BLOCK_K, BLOCK_N] tile at padded rows row0 ... of a dense operand that is not
    materialised: padded row p is row rows_ptr[p] of b (-1: a padding row, zeros). Not
    `live` (the discarded step of an empty column, whose rows may lie past the end): zeros,
    nothing read."""
    rk = tl.arange(0, BLOCK_K)
    src = tl.load(rows_ptr + row0 + rk, mask=rk < tl.where(live, BLOCK_K, 0), other=-1)
    ptrs = b_ptr + tl.maximum(src, 0).to(tl.int64)[:, None] * stride_bm \
        + rn[None, :] * stride_bn
    return tl.load(ptrs, mask=(src >= 0)[:, None] & n_ok[None, :], other=0.0)


@_kernel
def dstd_kernel(s_ptr, b_ptr, out_ptr, col_off_ptr, expert_rows_ptr, b_rows_ptr,
                first_row_ptr, N, F, nb, num_n,
                stride_bm, stride_bn,
                stride_oe, stride_of, stride_on,
                BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                EVEN_N: tl.constexpr, ACT: tl.constexpr, USE_TMA: tl.constexpr = False,
                TMA_STORE: tl.constexpr = False, OUT_T: tl.constexpr = False,
                TRIM_K: tl.constexpr = False, GATHER_B: tl.constexpr = False,
                COMPACT: tl.constexpr = False):
    # out[e, cols of column block c, tile] = sum over blocks of c: act(s[blk])^T @ b[rows of blk]
    # USE_TMA (Hopper; the launcher checks alignment): s_ptr describes the values as
    # [nnz*B, B] in [BLOCK_K, B] boxes (transposed in shared memory), b_ptr describes B [P, N]
    # in [BLOCK_K, BLOCK_N] boxes. TMA_STORE: see _dstd_store.
    # GATHER_B: b_ptr is the unpermuted tokens, padded row p being token b_rows[p] (the
    # weight gradient dW1 without a permuted copy of the tokens), read by pointer.
    # COMPACT: the values are [pairs, nb * B] rows (see _value_offsets), an expert's rows
    # consecutive from first_row[its first row block]; with USE_TMA s_ptr describes them in
    # [BLOCK_K, B] boxes. A box's rows past the expert's (expert_rows: its real count) are
    # the next expert's, finite, and meet padding rows of B, which are zero (the contract
    # of every dense operand): they add nothing. The pointer loads mask them.
    pid = tl.program_id(0)
    c = pid // num_n      # N tiles of one column block run side by side (L2 reuse of s)
    pid_n = pid % num_n
    first_row, first, k_len = _dstd_column(c, col_off_ptr, expert_rows_ptr, nb, BLOCK,
                                           BLOCK_K, TRIM_K)
    expert = c // nb
    f0 = (c % nb) * BLOCK
    n0 = pid_n * BLOCK_N
    rm = tl.arange(0, BLOCK)
    rn = n0 + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    # Valid blocks of a column are consecutive row blocks: block ids step by nb, rows by B.
    # act(s[blk])^T tile: element (m, k) is s[blk, kk % B + k, m]
    acc = tl.zeros((BLOCK, BLOCK_N), dtype=tl.float32)
    if COMPACT:
        # (an idle expert's column may point one row block past the end: nothing to read)
        row0 = tl.load(first_row_ptr + first_row, mask=k_len > 0, other=0)
        count = tl.load(expert_rows_ptr + expert)
    else:
        row0 = 0
        count = k_len
    if USE_TMA:
        for kk in range(0, k_len, BLOCK_K):
            if COMPACT:
                s_t = tl.trans(s_ptr.load([row0 + kk, f0]))
            else:
                blk = first + (kk // BLOCK) * nb
                s_t = tl.trans(s_ptr.load([blk * BLOCK + kk % BLOCK, 0]))
            if ACT != 0:
                s_t = _activate(s_t.to(tl.float32), ACT).to(s_t.dtype)
            if GATHER_B:
                b = _load_gathered(b_ptr, b_rows_ptr, first_row * BLOCK + kk, rn, n_ok,
                                   stride_bm, stride_bn, BLOCK_K, k_len > 0)
            else:
                b = b_ptr.load([first_row * BLOCK + kk, n0])
            acc += tl.dot(s_t, b)
    else:
        s_blk = s_ptr + first.to(tl.int64) * BLOCK * BLOCK
        s_offs = rk[None, :] * BLOCK + rm[:, None]
        s_cols = s_ptr + (row0 + rk).to(tl.int64)[None, :] * (nb * BLOCK) + (f0 + rm)[:, None]
        b_ptrs = (b_ptr + (first_row.to(tl.int64) * BLOCK + rk)[:, None] * stride_bm
                  + rn[None, :] * stride_bn)
        for kk in range(0, k_len, BLOCK_K):
            k_in_block = kk % BLOCK
            if COMPACT:
                s_t = tl.load(s_cols, mask=(kk + rk < count)[None, :], other=0.0)
                s_cols += BLOCK_K * (nb * BLOCK)
            else:
                s_t = tl.load(s_blk + s_offs + k_in_block * BLOCK)
            if ACT != 0:
                s_t = _activate(s_t.to(tl.float32), ACT).to(b_ptr.dtype.element_ty)
            if GATHER_B:
                b = _load_gathered(b_ptr, b_rows_ptr, first_row * BLOCK + kk, rn, n_ok,
                                   stride_bm, stride_bn, BLOCK_K, k_len > 0)
            elif EVEN_N:
                b = tl.load(b_ptrs)
            else:
                b = tl.load(b_ptrs, mask=n_ok[None, :], other=0.0)
            acc += tl.dot(s_t, b)
            b_ptrs += BLOCK_K * stride_bm
            s_blk += tl.where(k_in_block == BLOCK - BLOCK_K, nb * BLOCK * BLOCK, 0)
    _dstd_store(acc, out_ptr, expert, f0, n0, N, F, stride_oe, stride_of, stride_on,
                BLOCK, BLOCK_N, TMA_STORE, OUT_T)


@_kernel
def dstd_persistent_kernel(s_ptr, b_ptr, out_ptr, col_off_ptr, expert_rows_ptr, b_rows_ptr,
                           first_row_ptr, N, F, nb, num_n, num_tiles, stride_bm, stride_bn,
                           stride_oe, stride_of, stride_on,
                           BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           ACT: tl.constexpr, TMA_STORE: tl.constexpr = False,
                           OUT_T: tl.constexpr = False, TRIM_K: tl.constexpr = False,
                           COUNT_TILE: tl.constexpr = 64, GATHER_B: tl.constexpr = False,
                           COMPACT: tl.constexpr = False):
    # DSᵀD as dstd_kernel computes it, by a grid of a few programs per SM that each take the
    # tiles pid, pid + grid, ... (tensor-descriptor operands only). Its K, an expert's rows,
    # is often 2-3 steps of BLOCK_K: one program per tile then spends most of its time
    # waiting for its first loads and writing its tile. Here one flat loop runs over the k
    # steps of all of the program's tiles, so the software pipeline keeps loading across tile
    # boundaries: the next tile's first operands arrive while this one finishes and is stored.
    # (Triton's flatten=True cannot fuse the nested form: the inner trip count is loaded.)
    # An empty column (an expert with no tokens) takes one step whose product is discarded,
    # so that its zero tile is still written. GATHER_B: as in dstd_kernel (b_ptr is then a
    # pointer; stride_bm / stride_bn are used only then). COMPACT: as in dstd_kernel.
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    total = 0
    for t0 in range(pid, num_tiles, grid * COUNT_TILE):
        t = t0 + tl.arange(0, COUNT_TILE) * grid
        ok = t < num_tiles
        c = t // num_n
        k_len = (tl.load(col_off_ptr + c + 1, mask=ok, other=0)
                 - tl.load(col_off_ptr + c, mask=ok, other=0)) * BLOCK
        if TRIM_K:
            real = tl.load(expert_rows_ptr + c // nb, mask=ok, other=0)
            k_len = tl.minimum(k_len, (real + BLOCK_K - 1) // BLOCK_K * BLOCK_K)
        total += tl.sum(tl.where(ok, tl.maximum(k_len // BLOCK_K, 1), 0))
    tile = pid - grid
    ki = -1
    k_steps = 0
    first_row = 0
    first = 0
    k_len = 0
    row0 = 0
    acc = tl.zeros((BLOCK, BLOCK_N), dtype=tl.float32)
    for _ in range(0, total):
        ki = tl.where(ki == k_steps - 1, 0, ki + 1)
        if ki == 0:
            tile += grid
            first_row, first, k_len = _dstd_column(tile // num_n, col_off_ptr, expert_rows_ptr,
                                                   nb, BLOCK, BLOCK_K, TRIM_K)
            k_steps = tl.maximum(k_len // BLOCK_K, 1)
            if COMPACT:
                row0 = tl.load(first_row_ptr + first_row, mask=k_len > 0, other=0)
        kk = ki * BLOCK_K
        if COMPACT:
            s_t = tl.trans(s_ptr.load([row0 + kk, ((tile // num_n) % nb) * BLOCK]))
        else:
            s_t = tl.trans(s_ptr.load([(first + (kk // BLOCK) * nb) * BLOCK + kk % BLOCK, 0]))
        if ACT != 0:
            s_t = _activate(s_t.to(tl.float32), ACT).to(s_t.dtype)
        if GATHER_B:
            rn = (tile % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
            b = _load_gathered(b_ptr, b_rows_ptr, first_row * BLOCK + kk, rn, rn < N,
                               stride_bm, stride_bn, BLOCK_K, k_len > 0)
        else:
            b = b_ptr.load([first_row * BLOCK + kk, (tile % num_n) * BLOCK_N])
        acc = tl.dot(s_t, b, acc)
        if ki == k_steps - 1:
            c = tile // num_n
            acc = tl.where(k_len > 0, acc, 0.0)
            _dstd_store(acc, out_ptr, c // nb, (c % nb) * BLOCK, (tile % num_n) * BLOCK_N, N, F,
                        stride_oe, stride_of, stride_on, BLOCK, BLOCK_N, TMA_STORE, OUT_T)
            acc = tl.zeros((BLOCK, BLOCK_N), dtype=tl.float32)


_CONSTEXPR_DEFAULTS = dict(BLOCK=128, SPLIT=2, BLOCK_N=128, BLOCK_K=64, EVEN_K=True, EVEN_F=True,
                           EVEN_N=True, EPILOGUE_ACT_GRAD=ACT_NONE, EPILOGUE_STORE_ACT=ACT_NONE,
                           EPILOGUE_SCALE=False, ACT=ACT_NONE, USE_TMA=False, W_T=False,
                           FAST_ACT=False, PRELOAD_SCALE=False, EPILOGUE_ACT=ACT_NONE,
                           TMA_STORE=False, OUT_T=False, COUNT_TILE=64,
                           TAIL=False, TRIM_K=False, GROUP_M=1, STORE_PRE=False,
                           REWRITE_ACT=False, GATHER_A=False, GATHER_B=False, COMPACT=False)


def aot_signatures(dtype: str = "bf16") -> dict[str, dict[str, str]]:
    """Argument types of every kernel for ahead-of-time ``triton.compile``."""
    p = "*" + dtype
    i = "*i32"
    c = "constexpr"
    return {
        "sdd_kernel": dict(a_ptr=p, a_half_ptr=p, w_ptr=p, out_ptr=p, h_ptr=p, act_out_ptr=p,
                           col_idx_ptr=i, block_rows_ptr=i, a_rows_ptr=i, first_row_ptr=i,
                           K="i32", F="i32",
                           nb="i32", num_n="i32", stride_am="i32", stride_ak="i32",
                           stride_we="i32", stride_wk="i32", stride_wf="i32",
                           BLOCK=c, SPLIT=c, BLOCK_K=c, EVEN_K=c, EVEN_F=c, EPILOGUE_ACT_GRAD=c,
                           EPILOGUE_STORE_ACT=c, EPILOGUE_SCALE=c, USE_TMA=c, W_T=c,
                           FAST_ACT=c, PRELOAD_SCALE=c, EPILOGUE_ACT=c, TAIL=c, GROUP_M=c,
                           STORE_PRE=c, REWRITE_ACT=c, GATHER_A=c, COMPACT=c),
        "sdd_persistent_kernel": dict(a_ptr="tensordesc<%s[128, 64]>" % dtype,
                                      w_ptr="tensordesc<%s[64, 256]>" % dtype, out_ptr=p,
                                      h_ptr=p, act_out_ptr=p, col_idx_ptr=i,
                                      block_rows_ptr=i, first_row_ptr=i, K="i32",
                                      F="i32", nb="i32", num_n="i32", num_tiles="i32",
                                      BLOCK=c, SPLIT=c, BLOCK_K=c, EPILOGUE_ACT_GRAD=c,
                                      EPILOGUE_STORE_ACT=c, EPILOGUE_SCALE=c, W_T=c,
                                      FAST_ACT=c, EPILOGUE_ACT=c, COUNT_TILE=c,
                                      GROUP_M=c, STORE_PRE=c, REWRITE_ACT=c, COMPACT=c),
        "dsd_kernel": dict(s_ptr=p, s_half_ptr=p, w_ptr=p, out_ptr=p, col_idx_ptr=i,
                           block_rows_ptr=i, first_row_ptr=i, N="i32", F="i32", nb="i32", num_n="i32",
                           stride_we="i32", stride_wf="i32", stride_wn="i32", stride_om="i32",
                           stride_on="i32",
                           BLOCK=c, BLOCK_N=c, BLOCK_K=c, EVEN_F=c, EVEN_N=c, ACT=c,
                           USE_TMA=c, W_T=c, TAIL=c, GROUP_M=c, COMPACT=c),
        "dstd_kernel": dict(s_ptr=p, b_ptr=p, out_ptr=p, col_off_ptr=i, expert_rows_ptr=i,
                            b_rows_ptr=i, first_row_ptr=i, N="i32", F="i32", nb="i32",
                            num_n="i32",
                            stride_bm="i32", stride_bn="i32",
                            stride_oe="i32", stride_of="i32", stride_on="i32", BLOCK=c,
                            BLOCK_N=c, BLOCK_K=c, EVEN_N=c, ACT=c, USE_TMA=c, TMA_STORE=c,
                            OUT_T=c, TRIM_K=c, GATHER_B=c, COMPACT=c),
        "dstd_persistent_kernel": dict(s_ptr="tensordesc<%s[64, 128]>" % dtype,
                                       b_ptr="tensordesc<%s[64, 128]>" % dtype, out_ptr=p,
                                       col_off_ptr=i, expert_rows_ptr=i, b_rows_ptr=i,
                                       first_row_ptr=i, N="i32", F="i32", nb="i32", num_n="i32",
                                       num_tiles="i32", stride_bm="i32", stride_bn="i32",
                                       stride_oe="i32",
                                       stride_of="i32", stride_on="i32", BLOCK=c, BLOCK_N=c,
                                       BLOCK_K=c, ACT=c, TMA_STORE=c, OUT_T=c, TRIM_K=c,
                                       COUNT_TILE=c, GATHER_B=c, COMPACT=c),
    }


def aot_routing_signatures() -> dict[str, dict[str, str]]:
    """Argument types of the routing and router kernels (int32 ids/indices, bf16 rows)."""
    i, c = "*i32", "constexpr"
    return {
        "chunk_histogram_kernel": dict(ids_ptr=i, hist_ptr=i, N="i32", E="i32",
                                       CHUNK=c, E_POW2=c),
        "routing_scan_kernel": dict(hist_ptr=i, chunk_base_ptr=i, counts_ptr=i,
                                    row_start_ptr=i, scratch_ptr=i, block_expert_ptr=i,
                                    num_valid_ptr=i, row_off_ptr=i, col_idx_ptr=i,
                                    row_idx_ptr=i, col_off_ptr=i, t_blocks_ptr=i,
                                    block_rows_ptr=i, first_row_ptr=i, num_chunks="i32", E="i32", R="i32",
                                    nb="i32", BLOCK=c, E_POW2=c, CHUNK_TILE=c, TILE=c),
        "combine_kernel": dict(y_ptr="*bf16", w_ptr="*bf16", dest_ptr="*i64", out_ptr="*bf16",
                               T="i32", H="i32", top_k="i32", stride_y="i32", stride_o="i32",
                               BLOCK_T=c, BLOCK_H=c, WEIGHTED=c),
        "combine_backward_kernel": dict(g_ptr="*bf16", y_ptr="*bf16", w_ptr="*bf16",
                                        dest_ptr="*i64", grad_y_ptr="*bf16",
                                        grad_w_ptr="*bf16", block_rows_ptr=i, T="i32",
                                        H="i32", top_k="i32",
                                        stride_g="i32", stride_y="i32", stride_gy="i32",
                                        num_t="i32", BLOCK_T=c, BLOCK_H=c, BLOCK=c),
        "scatter_rows_kernel": dict(ids_ptr=i, chunk_base_ptr=i, row_start_ptr=i,
                                    dest_ptr="*i64", x_ptr="*bf16", out_ptr="*bf16",
                                    block_rows_ptr=i, row_token_ptr=i, N="i32", E="i32",
                                    H="i32", top_k="i32", stride_x="i32", stride_o="i32",
                                    cols_per_program="i32", num_chunks="i32", CHUNK=c,
                                    E_POW2=c, BLOCK_H=c, COPY=c, BLOCK=c),
        "router_topk_kernel": dict(logits_ptr="*fp32", ids_ptr=i, w_ptr="*bf16",
                                   lse_ptr="*fp32", part_counts_ptr=i, part_ptr="*fp32",
                                   T="i32", E="i32", stride_l="i32", nprog="i32", TOP_K=c,
                                   K_POW2=c, E_POW2=c, BLOCK_T=c, RENORM=c),
        "router_aux_kernel": dict(part_counts_ptr=i, part_ptr="*fp32", counts_ptr=i,
                                  aux_ptr="*fp32", T="i32", E="i32", nprog="i32", TOP_K=c,
                                  E_POW2=c, BLOCK_P=c, LB_COEF=c, Z_COEF=c),
        "router_backward_kernel": dict(logits_ptr="*fp32", lse_ptr="*fp32", ids_ptr=i,
                                       gw_ptr="*bf16", gaux_ptr="*fp32", counts_ptr=i,
                                       dl_ptr="*fp32", T="i32", E="i32", stride_l="i32",
                                       stride_d="i32", TOP_K=c, K_POW2=c, E_POW2=c,
                                       BLOCK_T=c, RENORM=c, LB_COEF=c, Z_COEF=c),
    }


ROUTING_AOT_CONSTEXPRS = {
    "combine_kernel": dict(BLOCK_T=32, BLOCK_H=128, WEIGHTED=True),
    "combine_backward_kernel": dict(BLOCK_T=32, BLOCK_H=128, BLOCK=128),
    "chunk_histogram_kernel": dict(CHUNK=256, E_POW2=64),
    "routing_scan_kernel": dict(BLOCK=128, E_POW2=64, CHUNK_TILE=64, TILE=1024),
    "scatter_rows_kernel": dict(CHUNK=256, E_POW2=64, BLOCK_H=64, COPY=True, BLOCK=128),
    # DeepSeek-V2-Lite-like: 64 experts, top-6
    "router_topk_kernel": dict(TOP_K=6, K_POW2=8, E_POW2=64, BLOCK_T=64, RENORM=True),
    "router_aux_kernel": dict(TOP_K=6, E_POW2=64, BLOCK_P=64, LB_COEF=0.01, Z_COEF=0.001),
    "router_backward_kernel": dict(TOP_K=6, K_POW2=8, E_POW2=64, BLOCK_T=64, RENORM=True,
                                   LB_COEF=0.01, Z_COEF=0.001),
}


def aot_constexprs(name: str, **overrides) -> dict:
    sig = aot_signatures()[name]
    values = dict(_CONSTEXPR_DEFAULTS, **overrides)
    return {k: v for k, v in values.items() if sig.get(k) == "constexpr"}


# ------------------------------------------------------------------ routing (permutation)
# Three launches replace ~50 small torch ops (which cost ~1 ms of launch overhead per
# layer): a per-chunk histogram, one program that scans it and writes the whole topology,
# and a per-chunk stable counting-sort scatter that also copies the token rows (fused
# permute + pad). Nothing is read back to the host.

@_kernel
def chunk_histogram_kernel(ids_ptr, hist_ptr, N, E,
                           CHUNK: tl.constexpr, E_POW2: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + offs, mask=offs < N, other=-1)
    experts = tl.arange(0, E_POW2)
    onehot = (ids[:, None] == experts[None, :]).to(tl.int32)
    tl.store(hist_ptr + pid * E + experts, tl.sum(onehot, axis=0), mask=experts < E)


@_kernel
def routing_scan_kernel(hist_ptr, chunk_base_ptr, counts_ptr, row_start_ptr, scratch_ptr,
                        block_expert_ptr, num_valid_ptr, row_off_ptr, col_idx_ptr,
                        row_idx_ptr, col_off_ptr, t_blocks_ptr, block_rows_ptr, first_row_ptr,
                        num_chunks, E, R, nb,
                        BLOCK: tl.constexpr, E_POW2: tl.constexpr, CHUNK_TILE: tl.constexpr,
                        TILE: tl.constexpr):
    # One program: everything here is O(chunks * E + R * nb) small vector work.
    experts = tl.arange(0, E_POW2)
    e_ok = experts < E
    # 1. exclusive prefix of the chunk histograms over chunks: where each chunk's pairs of
    #    expert e start inside e's rows (a stable counting sort).
    running = tl.zeros((E_POW2,), dtype=tl.int32)
    for c0 in range(0, num_chunks, CHUNK_TILE):
        chunks = c0 + tl.arange(0, CHUNK_TILE)
        mask = (chunks < num_chunks)[:, None] & e_ok[None, :]
        h = tl.load(hist_ptr + chunks[:, None] * E + experts[None, :], mask=mask, other=0)
        excl = tl.cumsum(h, axis=0) - h + running[None, :]
        tl.store(chunk_base_ptr + chunks[:, None] * E + experts[None, :], excl, mask=mask)
        running += tl.sum(h, axis=0)
    # 2. per expert: count, padded blocks, first row of its padded range
    blocks = (running + BLOCK - 1) // BLOCK
    block_start = tl.cumsum(blocks, axis=0) - blocks
    num_valid = tl.sum(blocks, axis=0)
    tl.store(counts_ptr + experts, running, mask=e_ok)
    tl.store(row_start_ptr + experts, block_start * BLOCK, mask=e_ok)
    tl.store(scratch_ptr + experts, block_start, mask=e_ok)
    tl.store(scratch_ptr + E + experts, blocks, mask=e_ok)
    # first row of each expert's pairs without padding (the compact values' rows)
    tl.store(scratch_ptr + 2 * E + experts, tl.cumsum(running, axis=0) - running, mask=e_ok)
    pairs = tl.sum(running, axis=0)
    tl.store(num_valid_ptr, num_valid)
    tl.debug_barrier()  # scratch is read back below by other threads of this program
    # 3. row blocks: owning expert (-1 past the real count) and BCSR row offsets
    for r0 in range(0, R + 1, TILE):
        rb = r0 + tl.arange(0, TILE)
        tl.store(block_expert_ptr + rb, tl.full((TILE,), -1, tl.int32),
                 mask=(rb < R) & (rb >= num_valid))
        tl.store(row_off_ptr + rb, rb * nb, mask=rb <= R)
    for e in range(0, E):
        start_e = tl.load(scratch_ptr + e)
        nblk = tl.load(scratch_ptr + E + e)
        for l0 in range(0, nblk, TILE):
            local = l0 + tl.arange(0, TILE)
            tl.store(block_expert_ptr + start_e + local, tl.full((TILE,), 0, tl.int32) + e,
                     mask=local < nblk)
    tl.debug_barrier()  # block_expert is gathered below
    # 3b. real rows per row block (the rest of an expert's last block is padding), and the
    #     compact row of its first row (the pair count past the end)
    for r0 in range(0, R, TILE):
        rb = r0 + tl.arange(0, TILE)
        owner = tl.load(block_expert_ptr + rb, mask=rb < R, other=-1)
        o = tl.maximum(owner, 0)
        within = rb * BLOCK - tl.load(row_start_ptr + o, mask=rb < R, other=0)
        real = tl.load(counts_ptr + o, mask=rb < R, other=0) - within
        real = tl.where(owner >= 0, tl.minimum(tl.maximum(real, 0), BLOCK), 0)
        tl.store(block_rows_ptr + rb, real, mask=rb < R)
        first = tl.load(scratch_ptr + 2 * E + o, mask=rb < R, other=0) + within
        tl.store(first_row_ptr + rb, tl.where(owner >= 0, first, pairs), mask=rb < R)
    # 4. blocks in BCSR order: row and global column (-1 in empty row blocks)
    nnz = R * nb
    valid_nnz = num_valid * nb
    for t0 in range(0, nnz, TILE):
        t = t0 + tl.arange(0, TILE)
        t_ok = t < nnz
        row = t // nb
        owner = tl.load(block_expert_ptr + row, mask=t_ok, other=-1)
        tl.store(row_idx_ptr + t, row, mask=t_ok)
        tl.store(col_idx_ptr + t, tl.where(owner >= 0, owner * nb + t % nb, -1), mask=t_ok)
        # empty blocks are parked after every column, in block order
        tl.store(t_blocks_ptr + t, t, mask=t_ok & (t >= valid_nnz))
    # 5. CSC view: expert e's blocks occupy positions [nb*start_e, nb*end_e), column-major
    for e in range(0, E):
        start_e = tl.load(scratch_ptr + e)
        nblk = tl.load(scratch_ptr + E + e)
        for l0 in range(0, nblk * nb, TILE):
            local = l0 + tl.arange(0, TILE)
            nblk_safe = tl.maximum(nblk, 1)
            blk = (start_e + local % nblk_safe) * nb + local // nblk_safe
            tl.store(t_blocks_ptr + start_e * nb + local, blk, mask=local < nblk * nb)
    num_cols = E * nb
    for c0 in range(0, num_cols + 1, TILE):
        c = c0 + tl.arange(0, TILE)
        e_c = tl.minimum(c // nb, E - 1)
        start_e = tl.load(scratch_ptr + e_c, mask=c < num_cols, other=0)
        nblk_e = tl.load(scratch_ptr + E + e_c, mask=c < num_cols, other=0)
        off = tl.where(c < num_cols, start_e * nb + (c % nb) * nblk_e, valid_nnz)
        tl.store(col_off_ptr + c, off, mask=c <= num_cols)


@_kernel
def scatter_rows_kernel(ids_ptr, chunk_base_ptr, row_start_ptr, dest_ptr, x_ptr, out_ptr,
                        block_rows_ptr, row_token_ptr,
                        N, E, H, top_k, stride_x, stride_o, cols_per_program, num_chunks,
                        CHUNK: tl.constexpr, E_POW2: tl.constexpr, BLOCK_H: tl.constexpr,
                        COPY: tl.constexpr, BLOCK: tl.constexpr):
    # Program (chunk, j) places the chunk's pairs and copies columns [j * cols_per_program,
    # (j + 1) * cols_per_program) of their tokens: with one program per chunk, the 64 chunks
    # of 8192 tokens (E = 64) left half of an H200's SMs idle and the copy ran at ~2 TB/s.
    # Programs num_chunks + rb write -1 as the token of row block rb's padding rows and,
    # with COPY, zero those rows of the copy. Every padded row gets its token (row_token):
    # the kernels that gather the rows from the tokens themselves (no copy) read it.
    pid = tl.program_id(0)
    pid_h = tl.program_id(1)
    if pid >= num_chunks:
        rb = pid - num_chunks
        if pid_h == 0:
            rows = tl.arange(0, BLOCK)
            tl.store(row_token_ptr + rb * BLOCK + rows, tl.full((BLOCK,), -1, tl.int32),
                     mask=rows >= tl.load(block_rows_ptr + rb))
        if COPY:
            h_start = pid_h * cols_per_program
            _zero_padding_block(out_ptr, rb, h_start, tl.minimum(h_start + cols_per_program, H),
                                block_rows_ptr, stride_o, BLOCK, BLOCK_H)
    else:
        offs = pid * CHUNK + tl.arange(0, CHUNK)
        ok = offs < N
        ids = tl.load(ids_ptr + offs, mask=ok, other=-1)
        experts = tl.arange(0, E_POW2)
        onehot = (ids[:, None] == experts[None, :]).to(tl.int32)
        # rank among this chunk's pairs of the same expert, in pair order (stable)
        rank = tl.sum(onehot * (tl.cumsum(onehot, axis=0) - 1), axis=1)
        e_safe = tl.maximum(ids, 0)
        base = tl.load(chunk_base_ptr + pid * E + e_safe, mask=ok, other=0) \
            + tl.load(row_start_ptr + e_safe, mask=ok, other=0)
        dest = (base + rank).to(tl.int64)
        token = (offs // top_k).to(tl.int64)
        if pid_h == 0:
            tl.store(dest_ptr + offs, dest, mask=ok)
            tl.store(row_token_ptr + dest, token.to(tl.int32), mask=ok)
        if COPY:
            h_start = pid_h * cols_per_program
            h_end = tl.minimum(h_start + cols_per_program, H)
            for h0 in range(h_start, h_end, BLOCK_H):
                cols = h0 + tl.arange(0, BLOCK_H)
                m = ok[:, None] & (cols < h_end)[None, :]
                v = tl.load(x_ptr + token[:, None] * stride_x + cols[None, :], mask=m)
                tl.store(out_ptr + dest[:, None] * stride_o + cols[None, :], v, mask=m)


# ------------------------------------------------------------------ combine (un-permute)
# out[t] = sum_j w[t, j] * y[dest[t, j]]. Its backward scatters w[t, j] * g[t] to row
# dest[t, j]: every padded row has at most one source, so plain stores do it; torch's
# index_add (the autograd of index_select) would use atomics, slow for bf16.

@_kernel
def combine_kernel(y_ptr, w_ptr, dest_ptr, out_ptr, T, H, top_k,
                   stride_y, stride_o,
                   BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, WEIGHTED: tl.constexpr = True):
    # WEIGHTED=False: out[t] = sum_j y[dest[t, j]] (w_ptr unused), the backward of the
    # permutation (a token's gradient is the sum of its k rows'); torch's index_select + add
    # for it ran at a third of HBM bandwidth on an H200.
    pid_t = tl.program_id(0)
    pid_h = tl.program_id(1)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    t_ok = t < T
    m = t_ok[:, None] & (h < H)[None, :]
    acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    for j in range(0, top_k):
        row = tl.load(dest_ptr + t * top_k + j, mask=t_ok, other=0)
        y = tl.load(y_ptr + row[:, None] * stride_y + h[None, :], mask=m, other=0.0)
        if WEIGHTED:
            w = tl.load(w_ptr + t * top_k + j, mask=t_ok, other=0.0).to(tl.float32)
            acc += w[:, None] * y.to(tl.float32)
        else:
            acc += y.to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64)[:, None] * stride_o + h[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=m)


@_kernel
def combine_backward_kernel(g_ptr, y_ptr, w_ptr, dest_ptr, grad_y_ptr, grad_w_ptr,
                            block_rows_ptr, T, H, top_k, stride_g, stride_y, stride_gy, num_t,
                            BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK: tl.constexpr):
    # programs num_t + rb zero the padding rows of row block rb of grad_y (the FFN backward
    # reads them)
    pid_t = tl.program_id(0)
    if pid_t >= num_t:
        _zero_padding_block(grad_y_ptr, pid_t - num_t, 0, H, block_rows_ptr, stride_gy,
                            BLOCK, BLOCK_H)
    else:
        t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
        t_ok = t < T
        g_rows = t.to(tl.int64)[:, None] * stride_g
        for j in range(0, top_k):
            row = tl.load(dest_ptr + t * top_k + j, mask=t_ok, other=0)
            w = tl.load(w_ptr + t * top_k + j, mask=t_ok, other=0.0).to(tl.float32)
            dot = tl.zeros((BLOCK_T,), dtype=tl.float32)
            for h0 in range(0, H, BLOCK_H):
                h = h0 + tl.arange(0, BLOCK_H)
                m = t_ok[:, None] & (h < H)[None, :]
                g = tl.load(g_ptr + g_rows + h[None, :], mask=m, other=0.0).to(tl.float32)
                y = tl.load(y_ptr + row[:, None] * stride_y + h[None, :], mask=m,
                            other=0.0).to(tl.float32)
                dot += tl.sum(g * y, axis=1)
                tl.store(grad_y_ptr + row[:, None] * stride_gy + h[None, :],
                         (w[:, None] * g).to(grad_y_ptr.dtype.element_ty), mask=m)
            tl.store(grad_w_ptr + t * top_k + j, dot.to(grad_w_ptr.dtype.element_ty), mask=t_ok)


@triton.jit
def _zero_padding_block(out_ptr, rb, h_start, h_end, block_rows_ptr, stride_o,
                        BLOCK: tl.constexpr, BLOCK_H: tl.constexpr):
    """Zero columns [h_start, h_end) of the rows of row block rb that no (token, slot) pair
    maps to (from its real rows, block_rows[rb]): the tail of an expert's last block, and
    whole blocks past the real count. The padded buffers are written by the pairs' kernels,
    which run extra programs that call this, so a buffer costs no zero fill of its own (a
    third of the rows are padding on the 8192-token benchmark shapes) and no launch of its
    own (the small layers are launch-bound)."""
    real = tl.load(block_rows_ptr + rb)
    rows = tl.arange(0, BLOCK)
    row_ptrs = out_ptr + (rb.to(tl.int64) * BLOCK + rows)[:, None] * stride_o
    zero = tl.zeros((BLOCK, BLOCK_H), dtype=out_ptr.dtype.element_ty)
    for h0 in range(h_start, h_end, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        tl.store(row_ptrs + cols[None, :], zero,
                 mask=(rows >= real)[:, None] & (cols < h_end)[None, :])


# ------------------------------------------------------------------ the router
# softmax + top-k + renormalise + histogram + the aux losses' sums in one pass over the gate
# logits, the aux loss from the per-program partial sums in a second (one program), and the
# whole backward (top-k, renormalisation, load-balancing and z-loss terms, softmax) in a
# third: the torch router was ~30 small ops with autograd, ~0.7 ms of host time a forward
# on an H200's host, a quarter of a small layer's step (benchmarks/probe_layer_host.py).
# Partial sums, not atomics, so the losses are deterministic for a given grid.

@triton.jit
def _router_rows(logits_ptr, rows, row_ok, cols, col_ok, stride_l):
    """The rows' logits (-inf outside [T, E]), their max-shifted exponentials' log-sum
    (lse) and probabilities."""
    ok = row_ok[:, None] & col_ok[None, :]
    lg = tl.load(logits_ptr + rows.to(tl.int64)[:, None] * stride_l + cols[None, :], mask=ok,
                 other=-float("inf"))
    m = tl.where(row_ok, tl.max(lg, axis=1), 0.0)
    e = tl.exp(lg - m[:, None])
    s = tl.where(row_ok, tl.sum(e, axis=1), 1.0)
    return lg, m + tl.log(s), e / s[:, None]


@_kernel
def router_topk_kernel(logits_ptr, ids_ptr, w_ptr, lse_ptr, part_counts_ptr, part_ptr,
                       T, E, stride_l, nprog,
                       TOP_K: tl.constexpr, K_POW2: tl.constexpr, E_POW2: tl.constexpr,
                       BLOCK_T: tl.constexpr, RENORM: tl.constexpr):
    # Persistent over row blocks; program p ends by writing its partial sums: tokens per
    # expert (part_counts[p, :]), probabilities summed over its tokens (part[p, :E_POW2])
    # and lse^2 summed (part[p, E_POW2]). The k experts are picked on the logits (the
    # softmax is monotone, so these are the k largest probabilities without the rounding
    # ties of probabilities), largest first, the lowest index first among equal logits.
    pid = tl.program_id(0)
    cols = tl.arange(0, E_POW2)
    col_ok = cols < E
    ks = tl.arange(0, K_POW2)
    hist = tl.zeros((E_POW2,), dtype=tl.int32)
    psum = tl.zeros((E_POW2,), dtype=tl.float32)
    zsum = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for blk in range(pid, tl.cdiv(T, BLOCK_T), nprog):
        rows = blk * BLOCK_T + tl.arange(0, BLOCK_T)
        row_ok = rows < T
        lg, lse, p = _router_rows(logits_ptr, rows, row_ok, cols, col_ok, stride_l)
        tl.store(lse_ptr + rows, lse, mask=row_ok)
        zsum += tl.where(row_ok, lse * lse, 0.0)
        psum += tl.sum(p, axis=0)
        free = row_ok[:, None] & col_ok[None, :]
        picked = tl.zeros((BLOCK_T, K_POW2), dtype=tl.int32)
        top = tl.zeros((BLOCK_T, K_POW2), dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            cand = tl.where(free, lg, -float("inf"))
            best = tl.max(cand, axis=1)
            idx = tl.min(tl.where(free & (cand == best[:, None]), cols[None, :], E_POW2), axis=1)
            hit = cols[None, :] == idx[:, None]
            free = free & ~hit
            picked = tl.where(ks[None, :] == j, idx[:, None], picked)
            top = tl.where(ks[None, :] == j, tl.sum(tl.where(hit, p, 0.0), axis=1)[:, None], top)
        chosen = row_ok[:, None] & col_ok[None, :] & ~free
        hist += tl.sum(chosen.to(tl.int32), axis=0)
        if RENORM:
            top = top / tl.where(row_ok, tl.sum(top, axis=1), 1.0)[:, None]
        out = rows.to(tl.int64)[:, None] * TOP_K + ks[None, :]
        ok = row_ok[:, None] & (ks < TOP_K)[None, :]
        tl.store(ids_ptr + out, picked, mask=ok)
        tl.store(w_ptr + out, top.to(w_ptr.dtype.element_ty), mask=ok)
    tl.store(part_counts_ptr + pid * E_POW2 + cols, hist)
    tl.store(part_ptr + pid * (E_POW2 + 1) + cols, psum)
    tl.store(part_ptr + pid * (E_POW2 + 1) + E_POW2, tl.sum(zsum, axis=0))


@_kernel
def router_aux_kernel(part_counts_ptr, part_ptr, counts_ptr, aux_ptr, T, E, nprog,
                      TOP_K: tl.constexpr, E_POW2: tl.constexpr, BLOCK_P: tl.constexpr,
                      LB_COEF: tl.constexpr, Z_COEF: tl.constexpr):
    # One program: tokens per expert, and aux = LB_COEF * E * sum_e f_e P_e + Z_COEF *
    # mean(lse^2), f_e = counts_e / (T k), P_e = mean probability of e (the torch router's
    # load_balancing_loss and z_loss), summed over the partials in program order.
    cols = tl.arange(0, E_POW2)
    hist = tl.zeros((E_POW2,), dtype=tl.int32)
    psum = tl.zeros((E_POW2,), dtype=tl.float32)
    zsum = tl.zeros((BLOCK_P,), dtype=tl.float32)
    for p0 in range(0, nprog, BLOCK_P):
        prog = p0 + tl.arange(0, BLOCK_P)
        ok = prog < nprog
        hist += tl.sum(tl.load(part_counts_ptr + prog[:, None] * E_POW2 + cols[None, :],
                               mask=ok[:, None], other=0), axis=0)
        row = part_ptr + prog * (E_POW2 + 1)
        psum += tl.sum(tl.load(row[:, None] + cols[None, :], mask=ok[:, None], other=0.0),
                       axis=0)
        zsum += tl.load(row + E_POW2, mask=ok, other=0.0)
    tl.store(counts_ptr + cols, hist, mask=cols < E)
    t = T * 1.0  # (T may be the constant 1)
    lb = E * tl.sum(hist.to(tl.float32) / (t * TOP_K) * (psum / t), axis=0)
    tl.store(aux_ptr, LB_COEF * lb + Z_COEF * (tl.sum(zsum, axis=0) / t))


@_kernel
def router_backward_kernel(logits_ptr, lse_ptr, ids_ptr, gw_ptr, gaux_ptr, counts_ptr,
                           dl_ptr, T, E, stride_l, stride_d,
                           TOP_K: tl.constexpr, K_POW2: tl.constexpr, E_POW2: tl.constexpr,
                           BLOCK_T: tl.constexpr, RENORM: tl.constexpr,
                           LB_COEF: tl.constexpr, Z_COEF: tl.constexpr):
    # dL/dlogits of router_topk_kernel + router_aux_kernel: with g_j the gradient of the
    # k (renormalised) weights, dp = the weights' gradient scattered to their experts (
    # through the renormalisation w_j = p_j / s: (g_j - sum_i g_i w_i) / s) plus the
    # load-balancing term g_aux LB_COEF E f_e / T; then the softmax's backward
    # p (dp - <p, dp>), plus the z-loss term g_aux Z_COEF 2 lse p / T.
    pid = tl.program_id(0)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    cols = tl.arange(0, E_POW2)
    col_ok = cols < E
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    lg = tl.load(logits_ptr + rows.to(tl.int64)[:, None] * stride_l + cols[None, :],
                 mask=row_ok[:, None] & col_ok[None, :], other=-float("inf"))
    p = tl.exp(lg - lse[:, None])
    ks = tl.arange(0, K_POW2)
    kok = row_ok[:, None] & (ks < TOP_K)[None, :]
    at = rows.to(tl.int64)[:, None] * TOP_K + ks[None, :]
    ids = tl.load(ids_ptr + at, mask=kok, other=-1)
    g = tl.load(gw_ptr + at, mask=kok, other=0.0).to(tl.float32)
    t = T * 1.0  # (T may be the constant 1)
    gaux = tl.load(gaux_ptr).to(tl.float32)
    counts = tl.load(counts_ptr + cols, mask=col_ok, other=0).to(tl.float32)
    dp = tl.where(col_ok, gaux * LB_COEF * E * counts / (t * TOP_K) / t, 0.0)[None, :] \
        + tl.zeros((BLOCK_T, E_POW2), dtype=tl.float32)
    s = tl.full((BLOCK_T,), 1.0, dtype=tl.float32)
    mean_g = tl.zeros((BLOCK_T,), dtype=tl.float32)
    if RENORM:
        s = tl.zeros((BLOCK_T,), dtype=tl.float32)
        sg = tl.zeros((BLOCK_T,), dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            idj = tl.sum(tl.where(ks[None, :] == j, ids, 0), axis=1)
            gj = tl.sum(tl.where(ks[None, :] == j, g, 0.0), axis=1)
            pj = tl.sum(tl.where(cols[None, :] == idj[:, None], p, 0.0), axis=1)
            s += pj
            sg += gj * pj
        s = tl.where(row_ok, s, 1.0)
        mean_g = sg / s
    for j in tl.static_range(TOP_K):
        idj = tl.sum(tl.where(ks[None, :] == j, ids, 0), axis=1)
        gj = tl.sum(tl.where(ks[None, :] == j, g, 0.0), axis=1)
        if RENORM:
            gj = (gj - mean_g) / s
        dp += tl.where(cols[None, :] == idj[:, None], gj[:, None], 0.0)
    dl = p * (dp - tl.sum(p * dp, axis=1)[:, None]) + (gaux * Z_COEF * 2.0 / t) * lse[:, None] * p
    tl.store(dl_ptr + rows.to(tl.int64)[:, None] * stride_d + cols[None, :], dl,
             mask=row_ok[:, None] & col_ok[None, :])
