"""gpu.grouped_local, the expert-parallel step's grouped products, on a real GPU (skipped on
CPU-only machines): after a shape's first call, both of its kernels launch through the
driver (native_launch) with the JIT's bits, also for other counts and another X, and so
does gpu.grouped_weight_grad (the step's dW); calls captured in a CUDA graph replay what
eager calls compute; calls make no host sync. The products themselves, on CPU:
test_grouped_tiles_interpret.py, test_grouped_weight_grad_interpret.py."""

import pytest
import torch

from gpu_testing import require_gpu_build

pytestmark = pytest.mark.gpu

SOURCES, GROUPS, K, N, ROWS = 2, 8, 512, 384, 3000
TOL = {torch.bfloat16: 2e-2, torch.float32: 1e-4}


def _counts(seed: int, device) -> torch.Tensor:
    """[SOURCES, GROUPS] int64 counts, some empty, that sum to fewer rows than ROWS (each
    below ROWS / segments: more would be a bad count, which computes nothing)."""
    g = torch.Generator().manual_seed(seed)
    c = torch.randint(0, ROWS // (SOURCES * GROUPS), (SOURCES, GROUPS), generator=g)
    c[0, 3] = 0
    return c.to(device)


def _weights(dtype, transposed: bool, device) -> torch.Tensor:
    """W [G, K, N]: as stored, or (the backward's) a transposed view of a [G, N, K]."""
    g = torch.Generator().manual_seed(1)
    if transposed:
        return (torch.randn(GROUPS, N, K, generator=g) / K ** 0.5).to(device, dtype).transpose(1, 2)
    return (torch.randn(GROUPS, K, N, generator=g) / K ** 0.5).to(device, dtype)


def _reference(x, w, counts) -> torch.Tensor:
    out = torch.zeros(x.shape[0], w.shape[-1], dtype=torch.float64, device=x.device)
    row = 0
    for s in range(counts.shape[0]):
        for e in range(counts.shape[1]):
            c = int(counts[s, e])
            out[row:row + c] = x[row:row + c].double() @ w[e].double()
            row += c
    return out


def _rel_err(got, want) -> float:
    return float((got.double() - want).norm() / want.norm().clamp_min(1e-30))


def _x(seed: int, dtype, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(ROWS, K, generator=g).to(device, dtype)


@pytest.mark.parametrize("dtype,transposed", [(torch.bfloat16, False), (torch.bfloat16, True),
                                              (torch.float32, False)],
                         ids=["bf16", "bf16-transposed-w", "fp32"])
def test_grouped_local_launches_natively_after_its_first_call_with_the_jits_results(
        dtype, transposed):
    require_gpu_build()
    from rocmoe import native_launch
    from rocmoe.ops import gpu
    dev = torch.device("cuda")
    w, x = _weights(dtype, transposed, dev), _x(2, dtype, dev)
    counts = _counts(3, dev)
    status = torch.zeros(64, dtype=torch.int32, device=dev)
    first = gpu.grouped_local(x, w, counts, status.data_ptr())  # the JIT compiles both
    before = dict(native_launch.stats)
    again = gpu.grouped_local(x, w, counts, status.data_ptr())
    assert torch.equal(first, again), "the native launch differs from the JIT's"
    other_counts, other_x = _counts(4, dev), _x(5, dtype, dev)
    got = gpu.grouped_local(other_x, w, other_counts, status.data_ptr())
    torch.cuda.synchronize()
    launched = {k: native_launch.stats[k] - before[k] for k in before}
    if native_launch.enabled() and not torch.version.hip:
        assert launched == {"native": 4, "fallback": 0}, (launched, native_launch.last_refusal)
    assert _rel_err(first, _reference(x, w, counts)) < TOL[dtype]
    assert _rel_err(got, _reference(other_x, w, other_counts)) < TOL[dtype]
    used = int(other_counts.sum())
    assert int(got[used:].abs().sum()) == 0, "rows past the segments were not zeroed"
    assert int(status.abs().sum()) == 0, status.tolist()


def test_grouped_weight_grad_launches_natively_after_its_first_call_with_the_jits_results():
    require_gpu_build()
    from rocmoe import native_launch
    from rocmoe.ops import gpu
    dev, dtype = torch.device("cuda"), torch.bfloat16
    x, counts = _x(12, dtype, dev), _counts(13, dev)
    gy = torch.randn(ROWS, N, generator=torch.Generator().manual_seed(14)).to(dev, dtype)
    first = gpu.grouped_weight_grad(x, gy, counts, GROUPS, dtype)  # the JIT compiles it
    before = dict(native_launch.stats)
    again = gpu.grouped_weight_grad(x, gy, counts, GROUPS, dtype)
    other = _counts(15, dev)
    got = gpu.grouped_weight_grad(x, gy, other, GROUPS, dtype)
    torch.cuda.synchronize()
    launched = {k: native_launch.stats[k] - before[k] for k in before}
    if native_launch.enabled() and not torch.version.hip:
        assert launched == {"native": 2, "fallback": 0}, (launched, native_launch.last_refusal)
    assert torch.equal(first, again), "the native launch differs from the JIT's"
    want = torch.zeros(GROUPS, K, N, dtype=torch.float64, device=dev)
    row = 0
    for s in range(SOURCES):
        for e in range(GROUPS):
            c = int(other[s, e])
            want[e] += x[row:row + c].double().t() @ gy[row:row + c].double()
            row += c
    assert _rel_err(got, want) < TOL[dtype]


def test_grouped_local_calls_captured_in_a_cuda_graph_replay_what_eager_calls_compute():
    require_gpu_build()
    from rocmoe.ops import gpu
    dev, dtype = torch.device("cuda"), torch.bfloat16
    w, wt = _weights(dtype, False, dev), _weights(dtype, True, dev)
    x, counts = _x(6, dtype, dev), _counts(7, dev)
    status = torch.zeros(64, dtype=torch.int32, device=dev)
    out = torch.empty(ROWS, N, dtype=dtype, device=dev)
    out_t = torch.empty(ROWS, N, dtype=dtype, device=dev)

    def calls():
        gpu.grouped_local(x, w, counts, status.data_ptr(), out=out)
        gpu.grouped_local(x, wt, counts, status.data_ptr(), out=out_t)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        calls()  # compiled and made native before capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls()
    for seed in (8, 9):  # new counts and rows in place, then a replay
        counts.copy_(_counts(seed, dev))
        x.copy_(_x(seed, dtype, dev))
        graph.replay()
        torch.cuda.synchronize()
        replayed = (out.clone(), out_t.clone())
        calls()
        torch.cuda.synchronize()
        assert torch.equal(replayed[0], out) and torch.equal(replayed[1], out_t), seed
        assert _rel_err(out, _reference(x, w, counts)) < TOL[dtype]
        assert _rel_err(out_t, _reference(x, wt, counts)) < TOL[dtype]


def test_grouped_local_and_weight_grad_calls_make_no_host_sync():
    require_gpu_build()
    from rocmoe.ops import gpu
    dev, dtype = torch.device("cuda"), torch.bfloat16
    w, x, counts = _weights(dtype, True, dev), _x(10, dtype, dev), _counts(11, dev)
    status = torch.zeros(64, dtype=torch.int32, device=dev)
    gpu.grouped_local(x, w, counts, status.data_ptr())  # the JIT's first calls may sync
    gpu.grouped_weight_grad(x, x, counts, GROUPS, dtype)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            y = gpu.grouped_local(x, w, counts, status.data_ptr())
            gpu.grouped_weight_grad(x, x, counts, GROUPS, dtype)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert _rel_err(y, _reference(x, w, counts)) < TOL[dtype]
