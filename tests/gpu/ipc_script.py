"""Rank program for tests/gpu/test_ipc.py: a GPU backend (argv[1]: ipc, the default, or
nvshmem) at 1, 2 or 4 ranks (which may share one GPU with ipc). Every check raises on
failure; the last line of each rank is "RANK r OK"."""

from __future__ import annotations

import sys

import torch

import rocmoe
from rocmoe import errors
from rocmoe._native import check, ffi, lib

BACKEND = sys.argv[1] if len(sys.argv) > 1 else "ipc"
ctx = rocmoe.init(backend=BACKEND, heap_size=64 << 20, timeout_s=30)
rank, world, dev = ctx.rank, ctx.world_size, ctx.device
right, left = (rank + 1) % world, (rank - 1) % world
handle = ctx._live()
stream = ffi.cast("void *", torch.cuda.current_stream(dev).cuda_stream)


def expect_error(cls, fn, what):
    try:
        fn()
    except cls:
        return
    raise AssertionError(f"rank {rank}: {what} did not raise {cls.__name__}")


assert ctx.backend == BACKEND and dev.type == "cuda", (ctx.backend, dev)

# -- host-initiated put + signal into the right neighbour ------------------------------
data = ctx.zeros((1024,), torch.float32)
sig = ctx.zeros((world,), torch.int64)
mine = torch.arange(1024, device=dev, dtype=torch.float32) + 1000 * rank
torch.cuda.synchronize(dev)
ctx.put_signal(data, mine, sig, rank, 1, peer=right)
ctx.wait_until(sig, left, 1, peer=left)
want = torch.arange(1024, device=dev, dtype=torch.float32) + 1000 * left
assert torch.equal(data, want), f"rank {rank}: put from rank {left} arrived wrong"

# -- peer views and the device-side table --------------------------------------------
assert torch.equal(ctx.peer(data, right), mine), "ctx.peer() does not see what we put"
table_addr = ctx.device_peer_table()
table = ctx.heap.tensor_at(table_addr, (world,), torch.int64, 8 * world)
off = ctx.heap.offset_of(data)
for r in range(world):
    assert int(table[r]) + off == ctx.peer(data, r).data_ptr(), f"peer table entry {r} is wrong"
assert int(table[rank]) == ctx.heap.base, "own table entry is not this rank's heap"
ctx.barrier()

# -- GPU kernel: store a slice into the right neighbour's heap, signal; verify on the GPU
n = 3 * 1024 * 1024 + 7          # not a multiple of 16: exercises the byte tail
recv = ctx.zeros((n,), torch.uint8)
ksig = ctx.zeros((2,), torch.int64)
idx = torch.arange(n, device=dev, dtype=torch.int32)
src = ((idx * 131 + rank * 17 + 5) & 255).to(torch.uint8)
expected = ((idx * 131 + left * 17 + 5) & 255).to(torch.uint8)
torch.cuda.synchronize(dev)
recv_off, sig_off = ctx.heap.offset_of(recv), ctx.heap.offset_of(ksig)
for epoch in (1, 2):              # epochs: the second call needs no re-zeroing
    check(lib.rocmoe_ipc_store_signal(handle, right, recv_off, ffi.cast("void *", src.data_ptr()),
                                      n, sig_off, epoch, stream), "store_signal")
    bad = ffi.new("uint64_t *")
    check(lib.rocmoe_ipc_wait_verify(handle, sig_off, epoch, 30.0, recv_off,
                                     ffi.cast("void *", expected.data_ptr()), n, stream, bad),
          "wait_verify")
    assert bad[0] == 0, f"rank {rank}: {bad[0]} bytes differ after epoch {epoch}"
assert torch.equal(recv, expected)
# the verifier must also see a wrong slice as wrong
wrong = expected.clone()
wrong[::4096] ^= 1
torch.cuda.synchronize(dev)
bad = ffi.new("uint64_t *")
check(lib.rocmoe_ipc_wait_verify(handle, sig_off, 2, 30.0, recv_off,
                                 ffi.cast("void *", wrong.data_ptr()), n, stream, bad), "verify")
assert bad[0] == (n + 4095) // 4096, f"verifier counted {bad[0]} differing bytes"

# an empty slice is still signalled (consumers never wait for data that will not come)
check(lib.rocmoe_ipc_store_signal(handle, right, recv_off, ffi.NULL, 0, sig_off + 8, 7, stream),
      "empty store_signal")
check(lib.rocmoe_ipc_wait_verify(handle, sig_off + 8, 7, 30.0, recv_off, ffi.NULL, 0, stream, bad),
      "empty wait")
ctx.barrier()

# -- bad input: an error on every rank, nothing written to the peer -------------------
before = recv.clone()
ctx.barrier()
expect_error(errors.InvalidArgumentError,
             lambda: check(lib.rocmoe_ipc_store_signal(handle, right, recv_off,
                                                       ffi.cast("void *", src.data_ptr()), n,
                                                       recv_off + 64, 9, stream)),
             "signal slot inside the destination")
expect_error(errors.InvalidArgumentError,
             lambda: check(lib.rocmoe_ipc_store_signal(handle, world, recv_off,
                                                       ffi.cast("void *", src.data_ptr()), n,
                                                       sig_off, 9, stream)),
             "peer out of range")
expect_error(errors.InvalidArgumentError,
             lambda: check(lib.rocmoe_ipc_store_signal(handle, right, ctx.heap.size - 8,
                                                       ffi.cast("void *", src.data_ptr()), n,
                                                       sig_off, 9, stream)),
             "range past the heap")
expect_error(errors.InvalidArgumentError,
             lambda: check(lib.rocmoe_ipc_store_signal(handle, right, recv_off,
                                                       ffi.cast("void *", src.data_ptr()), n,
                                                       sig_off + 4, 9, stream)),
             "unaligned signal slot")
host_src = src.cpu()  # a host pointer would fault the kernel: refused before the launch
expect_error(errors.InvalidArgumentError,
             lambda: check(lib.rocmoe_ipc_store_signal(handle, right, recv_off,
                                                       ffi.cast("void *", host_src.data_ptr()),
                                                       n, sig_off, 9, stream)),
             "host memory as the source")
torch.cuda.synchronize(dev)
ctx.barrier()
assert torch.equal(recv, before), "a rejected call changed a peer's heap"
got = ctx.wait_until(ksig, 0, 2, peer=left)
assert got == 2, f"a rejected call changed the signal slot ({got})"

# -- a signal that never comes: the GPU wait times out and says so --------------------
try:
    check(lib.rocmoe_ipc_wait_verify(handle, sig_off, 1 << 40, 0.3, recv_off,
                                     ffi.cast("void *", expected.data_ptr()), n, stream, bad),
          "wait_verify")
    raise AssertionError("a wait for a signal that never comes returned")
except errors.CommTimeoutError as exc:
    assert "timed out" in str(exc) and "holds 2" in str(exc), str(exc)

# -- host-initiated atomic adds from every rank --------------------------------------
counter = ctx.zeros((1,), torch.int64)
ctx.signal_add(counter, 0, 1, peer=0)
if rank == 0:
    assert ctx.wait_until(counter, 0, world, cmp="==", peer=None) == world
ctx.barrier()

for t in (counter, ksig, recv, sig, data):
    ctx.free(t)
ctx.finalize()
print(f"RANK {rank} OK", flush=True)
