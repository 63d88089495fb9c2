"""Triton kernels of the block-sparse products (AMD and NVIDIA).

Each program computes one output tile with ``tl.dot`` over a K loop, which is what the
compilers lower to MFMA (CDNA) and wgmma (Hopper). The kernels read the topology's int32
indices from device memory; programs whose blocks are empty (row blocks past the real
token count) run a zero-trip loop and store zeros, so the launch grid is static and the
host never needs the real count.

The kernel bodies are plain functions wrapped by ``triton.jit`` on first use (``get``):
``TRITON_INTERPRET=1`` is read at wrap time, so tests can switch to the interpreter
in-process and check the very same code on CPU tensors.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

_RAW = {}
_JITTED = {}


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


@_kernel
def sdd_kernel(a_ptr, w_ptr, out_ptr, row_idx_ptr, col_idx_ptr,
               K, F, nb,
               stride_am, stride_ak,
               stride_we, stride_wk, stride_wf,
               BLOCK: tl.constexpr, BLOCK_K: tl.constexpr):
    # out[n] = a[rows of block n] @ w[e, :, cols of block n]   (one B x B block per program)
    n = tl.program_id(0)
    row_block = tl.load(row_idx_ptr + n)
    col = tl.load(col_idx_ptr + n)
    valid = col >= 0
    col = tl.where(valid, col, 0)
    expert = col // nb
    f0 = (col % nb) * BLOCK
    k_end = tl.where(valid, K, 0)
    rm = tl.arange(0, BLOCK)
    rn = tl.arange(0, BLOCK)
    rk = tl.arange(0, BLOCK_K)
    a_rows = (row_block * BLOCK + rm).to(tl.int64)
    f_cols = f0 + rn
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + rk[None, :] * stride_ak
    w_ptrs = (w_ptr + expert.to(tl.int64) * stride_we + rk[:, None] * stride_wk
              + f_cols[None, :] * stride_wf)
    acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    for k in range(0, k_end, BLOCK_K):
        k_ok = (k + rk) < K
        a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & (f_cols[None, :] < F), other=0.0)
        acc += tl.dot(a, w)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk
    out_ptrs = out_ptr + n.to(tl.int64) * BLOCK * BLOCK + rm[:, None] * BLOCK + rn[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty))


@_kernel
def dsd_kernel(s_ptr, w_ptr, out_ptr, row_off_ptr, col_idx_ptr,
               N, F, nb,
               stride_we, stride_wf, stride_wn,
               stride_om, stride_on,
               BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # out[rows of row block r, tile] = sum over blocks n of r: s[n] @ w[e, cols of n, tile]
    row_block = tl.program_id(0)
    pid_n = tl.program_id(1)
    start = tl.load(row_off_ptr + row_block)
    end = tl.load(row_off_ptr + row_block + 1)
    first_col = tl.load(col_idx_ptr + start, mask=start < end, other=-1)
    # An empty row block (past the real token count) gets a zero-trip loop and stores zeros.
    end = tl.where(first_col >= 0, end, start)
    steps_per_block: tl.constexpr = BLOCK // BLOCK_K
    num_steps = (end - start) * steps_per_block
    rm = tl.arange(0, BLOCK)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    acc = tl.zeros((BLOCK, BLOCK_N), dtype=tl.float32)
    for step in range(0, num_steps):
        n = start + step // steps_per_block
        kk = (step % steps_per_block) * BLOCK_K
        col = tl.load(col_idx_ptr + n)
        expert = col // nb
        f = (col % nb) * BLOCK + kk + rk
        s = tl.load(s_ptr + n.to(tl.int64) * BLOCK * BLOCK + rm[:, None] * BLOCK
                    + (kk + rk)[None, :])
        w = tl.load(w_ptr + expert.to(tl.int64) * stride_we + f[:, None] * stride_wf
                    + rn[None, :] * stride_wn,
                    mask=(f[:, None] < F) & n_ok[None, :], other=0.0)
        acc += tl.dot(s, w)
    rows = (row_block * BLOCK + rm).to(tl.int64)
    out_ptrs = out_ptr + rows[:, None] * stride_om + rn[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=n_ok[None, :])


@_kernel
def dstd_kernel(s_ptr, b_ptr, out_ptr, col_off_ptr, t_blocks_ptr, row_idx_ptr,
                N, F, nb,
                stride_bm, stride_bn,
                stride_oe, stride_of, stride_on,
                BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # out[e, cols of column block c, tile] = sum over blocks n of column c: s[n]^T @ b[rows of n]
    c = tl.program_id(0)
    pid_n = tl.program_id(1)
    start = tl.load(col_off_ptr + c)
    end = tl.load(col_off_ptr + c + 1)
    expert = c // nb
    f0 = (c % nb) * BLOCK
    steps_per_block: tl.constexpr = BLOCK // BLOCK_K
    num_steps = (end - start) * steps_per_block
    rm = tl.arange(0, BLOCK)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    acc = tl.zeros((BLOCK, BLOCK_N), dtype=tl.float32)
    for step in range(0, num_steps):
        blk = tl.load(t_blocks_ptr + start + step // steps_per_block)
        kk = (step % steps_per_block) * BLOCK_K
        row_block = tl.load(row_idx_ptr + blk)
        # s[n]^T tile: element (m, k) is s[n, kk + k, m]
        s_t = tl.load(s_ptr + blk.to(tl.int64) * BLOCK * BLOCK + (kk + rk)[None, :] * BLOCK
                      + rm[:, None])
        b_rows = (row_block * BLOCK + kk + rk).to(tl.int64)
        b = tl.load(b_ptr + b_rows[:, None] * stride_bm + rn[None, :] * stride_bn,
                    mask=n_ok[None, :], other=0.0)
        acc += tl.dot(s_t, b)
    f = f0 + rm
    out_ptrs = (out_ptr + expert.to(tl.int64) * stride_oe + f[:, None] * stride_of
                + rn[None, :] * stride_on)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(f[:, None] < F) & n_ok[None, :])


def aot_signatures(dtype: str = "bf16") -> dict[str, dict[str, str]]:
    """Argument types of every kernel for ahead-of-time ``triton.compile``."""
    p = "*" + dtype
    i = "*i32"
    return {
        "sdd_kernel": dict(a_ptr=p, w_ptr=p, out_ptr=p, row_idx_ptr=i, col_idx_ptr=i,
                           K="i32", F="i32", nb="i32", stride_am="i32", stride_ak="i32",
                           stride_we="i32", stride_wk="i32", stride_wf="i32",
                           BLOCK="constexpr", BLOCK_K="constexpr"),
        "dsd_kernel": dict(s_ptr=p, w_ptr=p, out_ptr=p, row_off_ptr=i, col_idx_ptr=i,
                           N="i32", F="i32", nb="i32", stride_we="i32", stride_wf="i32",
                           stride_wn="i32", stride_om="i32", stride_on="i32",
                           BLOCK="constexpr", BLOCK_N="constexpr", BLOCK_K="constexpr"),
        "dstd_kernel": dict(s_ptr=p, b_ptr=p, out_ptr=p, col_off_ptr=i, t_blocks_ptr=i,
                            row_idx_ptr=i, N="i32", F="i32", nb="i32", stride_bm="i32",
                            stride_bn="i32", stride_oe="i32", stride_of="i32",
                            stride_on="i32", BLOCK="constexpr", BLOCK_N="constexpr",
                            BLOCK_K="constexpr"),
    }
