"""Triton kernels of the block-sparse products (AMD and NVIDIA).

Each program computes one output tile with ``tl.dot`` over a K loop, which the compilers
lower to MFMA (CDNA) and wgmma (Hopper). The kernels read the topology's int32 indices from
device memory; programs whose blocks are empty (row blocks past the real token count) run a
zero-trip loop and store zeros, so the launch grid is static and the host never needs the
real count.

They rely on two properties of every topology ``build_topology`` makes (block-diagonal by
expert): the blocks of a row are consecutive column blocks of one expert, stored
consecutively; and the valid blocks of a column are consecutive row blocks. So after reading
the first block's indices, the K loops walk memory linearly, with no index loads inside
the loop (which would stall the software pipeline).

Activations can be fused: DSD and DSᵀD apply ``ACT`` to the sparse operand as they load it
(so the forward never writes act(h)), and SDD can multiply its result by ``act'(h)`` in the
epilogue (which turns dL/d act(h) into dL/dh in the same pass).

The kernels are wrapped by ``triton.jit`` on first use (``get``). ``TRITON_INTERPRET=1``
must be set before triton is imported for the interpreter to run them on CPU tensors.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

_RAW = {}
_JITTED = {}

# Activation codes shared with blocksparse.py (constexpr ACT).
ACT_NONE, ACT_GELU_TANH, ACT_RELU, ACT_SILU = 0, 1, 2, 3


def _kernel(fn):
    _RAW[fn.__name__] = fn
    return fn


def get(name: str):
    interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    key = (name, interpret)
    if key not in _JITTED:
        _JITTED[key] = triton.jit(_RAW[name])
    return _JITTED[key]


def names() -> list[str]:
    return sorted(_RAW)


@triton.jit
def _activate(x, ACT: tl.constexpr):
    if ACT == 1:  # gelu, tanh form: x * sigmoid(2 * sqrt(2/pi) * (x + 0.044715 x^3))
        x = x * tl.sigmoid(1.5957691216057308 * (x + 0.044715 * x * x * x))
    elif ACT == 2:
        x = tl.maximum(x, 0.0)
    elif ACT == 3:
        x = x * tl.sigmoid(x)
    return x


@triton.jit
def _activate_grad(x, ACT: tl.constexpr):
    if ACT == 1:
        s = tl.sigmoid(1.5957691216057308 * (x + 0.044715 * x * x * x))
        d = s + x * s * (1.0 - s) * 1.5957691216057308 * (1.0 + 0.134145 * x * x)
    elif ACT == 2:
        d = tl.where(x > 0.0, 1.0, 0.0)
    elif ACT == 3:
        s = tl.sigmoid(x)
        d = s * (1.0 + x * (1.0 - s))
    else:
        d = tl.full(x.shape, 1.0, tl.float32)
    return d


@_kernel
def sdd_kernel(a_ptr, w_ptr, out_ptr, h_ptr, row_off_ptr, col_idx_ptr,
               K, F, nb, num_n,
               stride_am, stride_ak,
               stride_we, stride_wk, stride_wf,
               BLOCK: tl.constexpr, SPLIT: tl.constexpr, BLOCK_K: tl.constexpr,
               EVEN_K: tl.constexpr, EVEN_F: tl.constexpr, EPILOGUE_ACT_GRAD: tl.constexpr):
    # out[blk] = a[rows of row block r] @ w[e, :, cols of blk] for SPLIT consecutive blocks blk
    # of row r (a B x SPLIT*B tile per program: wider tiles feed the matrix units better).
    # With EPILOGUE_ACT_GRAD: out[blk] *= act'(h[blk]).
    pid = tl.program_id(0)
    row_block = pid // num_n
    first = tl.load(row_off_ptr + row_block) + (pid % num_n) * SPLIT
    end = tl.load(row_off_ptr + row_block + 1)
    col = tl.load(col_idx_ptr + first)
    valid = col >= 0
    col = tl.where(valid, col, 0)
    expert = col // nb
    f0 = (col % nb) * BLOCK
    k_end = tl.where(valid, K, 0)
    rm = tl.arange(0, BLOCK)
    rn = tl.arange(0, SPLIT * BLOCK)
    rk = tl.arange(0, BLOCK_K)
    a_rows = (row_block * BLOCK + rm).to(tl.int64)
    f_cols = f0 + rn
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + rk[None, :] * stride_ak
    w_ptrs = (w_ptr + expert.to(tl.int64) * stride_we + rk[:, None] * stride_wk
              + f_cols[None, :] * stride_wf)
    acc = tl.zeros((BLOCK, SPLIT * BLOCK), dtype=tl.float32)
    for k in range(0, k_end, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            if EVEN_F:
                w = tl.load(w_ptrs)
            else:
                w = tl.load(w_ptrs, mask=f_cols[None, :] < F, other=0.0)
        else:
            k_ok = (k + rk) < K
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None] & (f_cols[None, :] < F), other=0.0)
        acc += tl.dot(a, w)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk
    # tile column c lives in block first + c // B at column c % B
    offs = ((first + rn // BLOCK).to(tl.int64) * (BLOCK * BLOCK))[None, :] \
        + rm[:, None] * BLOCK + (rn % BLOCK)[None, :]
    in_row = (first + rn // BLOCK) < end  # a row whose block count is not a multiple of SPLIT
    if EPILOGUE_ACT_GRAD != 0:
        h = tl.load(h_ptr + offs, mask=in_row[None, :], other=0.0).to(tl.float32)
        acc = acc * _activate_grad(h, EPILOGUE_ACT_GRAD)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=in_row[None, :])


@_kernel
def dsd_kernel(s_ptr, w_ptr, out_ptr, row_off_ptr, col_idx_ptr,
               N, F, nb, num_n,
               stride_we, stride_wf, stride_wn,
               stride_om, stride_on,
               BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               EVEN_F: tl.constexpr, EVEN_N: tl.constexpr, ACT: tl.constexpr):
    # out[rows of row block r, tile] = sum over blocks of r: act(s[blk]) @ w[e, cols of blk, tile]
    # Output tiles of one row block are neighbours in launch order, so the row block's
    # sparse values are read from HBM once and hit L2 for the other N tiles.
    pid = tl.program_id(0)
    row_block = pid // num_n
    pid_n = pid % num_n
    start = tl.load(row_off_ptr + row_block)
    end = tl.load(row_off_ptr + row_block + 1)
    first_col = tl.load(col_idx_ptr + start, mask=start < end, other=-1)
    # An empty row block (past the real token count) gets a zero-trip loop and stores zeros.
    num_blocks = tl.where(first_col >= 0, end - start, 0)
    first_col = tl.where(first_col >= 0, first_col, 0)
    expert = first_col // nb
    f_first = (first_col % nb) * BLOCK
    rm = tl.arange(0, BLOCK)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    # The blocks of a row are stored one after another and cover consecutive ffn columns,
    # so the K loop is linear in the ffn index; the sparse operand jumps by one B x B block
    # each time kk crosses a block boundary. A flat loop (not blocks x static sub-steps)
    # keeps one BLOCK_K slice per pipeline stage, so 3-4 stages fit in shared memory.
    s_blk = s_ptr + start.to(tl.int64) * BLOCK * BLOCK
    s_offs = rm[:, None] * BLOCK + rk[None, :]
    w_ptrs = (w_ptr + expert.to(tl.int64) * stride_we + (f_first + rk)[:, None] * stride_wf
              + rn[None, :] * stride_wn)
    acc = tl.zeros((BLOCK, BLOCK_N), dtype=tl.float32)
    for kk in range(0, num_blocks * BLOCK, BLOCK_K):
        k_in_block = kk % BLOCK
        s = tl.load(s_blk + s_offs + k_in_block)
        if ACT != 0:
            s = _activate(s.to(tl.float32), ACT).to(w_ptr.dtype.element_ty)
        if EVEN_F and EVEN_N:
            w = tl.load(w_ptrs)
        else:
            w = tl.load(w_ptrs, mask=((f_first + kk + rk)[:, None] < F) & n_ok[None, :],
                        other=0.0)
        acc += tl.dot(s, w)
        w_ptrs += BLOCK_K * stride_wf
        s_blk += tl.where(k_in_block == BLOCK - BLOCK_K, BLOCK * BLOCK, 0)
    rows = (row_block * BLOCK + rm).to(tl.int64)
    out_ptrs = out_ptr + rows[:, None] * stride_om + rn[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=n_ok[None, :])


@_kernel
def dstd_kernel(s_ptr, b_ptr, out_ptr, col_off_ptr, t_blocks_ptr, row_idx_ptr,
                N, F, nb, num_n,
                stride_bm, stride_bn,
                stride_oe, stride_of, stride_on,
                BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                EVEN_N: tl.constexpr, ACT: tl.constexpr):
    # out[e, cols of column block c, tile] = sum over blocks of c: act(s[blk])^T @ b[rows of blk]
    pid = tl.program_id(0)
    c = pid // num_n      # N tiles of one column block run side by side (L2 reuse of s)
    pid_n = pid % num_n
    start = tl.load(col_off_ptr + c)
    end = tl.load(col_off_ptr + c + 1)
    first = tl.load(t_blocks_ptr + start, mask=start < end, other=0)
    first_row = tl.load(row_idx_ptr + first, mask=start < end, other=0)
    num_blocks = end - start
    expert = c // nb
    f0 = (c % nb) * BLOCK
    rm = tl.arange(0, BLOCK)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    # Valid blocks of a column are consecutive row blocks: block ids step by nb, rows by B.
    # act(s[blk])^T tile: element (m, k) is s[blk, kk % B + k, m]
    s_blk = s_ptr + first.to(tl.int64) * BLOCK * BLOCK
    s_offs = rk[None, :] * BLOCK + rm[:, None]
    b_ptrs = (b_ptr + (first_row.to(tl.int64) * BLOCK + rk)[:, None] * stride_bm
              + rn[None, :] * stride_bn)
    acc = tl.zeros((BLOCK, BLOCK_N), dtype=tl.float32)
    for kk in range(0, num_blocks * BLOCK, BLOCK_K):
        k_in_block = kk % BLOCK
        s_t = tl.load(s_blk + s_offs + k_in_block * BLOCK)
        if ACT != 0:
            s_t = _activate(s_t.to(tl.float32), ACT).to(b_ptr.dtype.element_ty)
        if EVEN_N:
            b = tl.load(b_ptrs)
        else:
            b = tl.load(b_ptrs, mask=n_ok[None, :], other=0.0)
        acc += tl.dot(s_t, b)
        b_ptrs += BLOCK_K * stride_bm
        s_blk += tl.where(k_in_block == BLOCK - BLOCK_K, nb * BLOCK * BLOCK, 0)
    f = f0 + rm
    out_ptrs = (out_ptr + expert.to(tl.int64) * stride_oe + f[:, None] * stride_of
                + rn[None, :] * stride_on)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(f[:, None] < F) & n_ok[None, :])


_CONSTEXPR_DEFAULTS = dict(BLOCK=128, SPLIT=2, BLOCK_N=128, BLOCK_K=64, EVEN_K=True, EVEN_F=True,
                           EVEN_N=True, EPILOGUE_ACT_GRAD=ACT_NONE, ACT=ACT_NONE)


def aot_signatures(dtype: str = "bf16") -> dict[str, dict[str, str]]:
    """Argument types of every kernel for ahead-of-time ``triton.compile``."""
    p = "*" + dtype
    i = "*i32"
    c = "constexpr"
    return {
        "sdd_kernel": dict(a_ptr=p, w_ptr=p, out_ptr=p, h_ptr=p, row_off_ptr=i, col_idx_ptr=i,
                           K="i32", F="i32", nb="i32", num_n="i32", stride_am="i32",
                           stride_ak="i32", stride_we="i32", stride_wk="i32", stride_wf="i32",
                           BLOCK=c, SPLIT=c, BLOCK_K=c, EVEN_K=c, EVEN_F=c, EPILOGUE_ACT_GRAD=c),
        "dsd_kernel": dict(s_ptr=p, w_ptr=p, out_ptr=p, row_off_ptr=i, col_idx_ptr=i,
                           N="i32", F="i32", nb="i32", num_n="i32", stride_we="i32",
                           stride_wf="i32",
                           stride_wn="i32", stride_om="i32", stride_on="i32",
                           BLOCK=c, BLOCK_N=c, BLOCK_K=c, EVEN_F=c, EVEN_N=c, ACT=c),
        "dstd_kernel": dict(s_ptr=p, b_ptr=p, out_ptr=p, col_off_ptr=i, t_blocks_ptr=i,
                            row_idx_ptr=i, N="i32", F="i32", nb="i32", num_n="i32",
                            stride_bm="i32",
                            stride_bn="i32", stride_oe="i32", stride_of="i32",
                            stride_on="i32", BLOCK=c, BLOCK_N=c, BLOCK_K=c, EVEN_N=c, ACT=c),
    }


def aot_constexprs(name: str, **overrides) -> dict:
    sig = aot_signatures()[name]
    values = dict(_CONSTEXPR_DEFAULTS, **overrides)
    return {k: v for k, v in values.items() if sig.get(k) == "constexpr"}
