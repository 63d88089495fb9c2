"""DroplessMoE on a GPU: Triton kernels equal the CPU reference, and zero host syncs.

Skipped without a CUDA/ROCm device (run on the GPU machine: benchmarks/gpu_moe.sh).
"""

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")]

import contextlib  # noqa: E402

from rocmoe.bench.moe_layer import VARIANT_KEYS, VARIANTS  # noqa: E402
from rocmoe.moe import DroplessMoE  # noqa: E402
from rocmoe.moe import blocksparse as bs  # noqa: E402


@contextlib.contextmanager
def _variant(variant):
    """The fused FFN's memory variant (act_fusion, gather_rows, compact_values) in force."""
    before = {k: bs.KERNEL_CONFIG[k] for k in VARIANT_KEYS}
    bs.set_kernel_config(**dict(zip(VARIANT_KEYS, variant)))
    try:
        yield
    finally:
        bs.set_kernel_config(**before)


def _pair(dtype, block, glu=False, hidden=256, ffn=320, experts=8, top_k=2, act="gelu"):
    """The same layer on CPU (fp64, torch path) and on the GPU (dtype, Triton kernels)."""
    torch.manual_seed(0)
    cpu = DroplessMoE(hidden, ffn, experts, top_k, block_size=block, glu=glu,
                      activation=act).double()
    gpu = DroplessMoE(hidden, ffn, experts, top_k, block_size=block, glu=glu,
                      activation=act).to("cuda", dtype)
    with torch.no_grad():
        for p_cpu, p_gpu in zip(cpu.parameters(), gpu.parameters()):
            p_gpu.copy_(p_cpu.to(dtype))   # round once, then copy back the rounded values
            p_cpu.copy_(p_gpu.double().cpu())
    return cpu, gpu


def _rel(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("dtype,block,tol", [(torch.bfloat16, 128, 2e-2),
                                             (torch.float16, 64, 5e-3),
                                             (torch.float32, 16, 5e-3)])
def test_gpu_layer_and_gradients_equal_cpu_reference(dtype, block, tol):
    bs.set_backend("auto")
    cpu, gpu = _pair(dtype, block)
    # Round the input to the GPU dtype first so both sides route the very same numbers.
    x = torch.randn(1000, 256, dtype=torch.float64).to(dtype).double()
    g = torch.randn(1000, 256, dtype=torch.float64).to(dtype).double()
    xc = x.clone().requires_grad_(True)
    xg = x.to("cuda", dtype).requires_grad_(True)
    yc, yg = cpu(xc), gpu(xg)
    (yc * g).sum().backward()
    (yg * g.to("cuda", dtype)).sum().backward()
    # Routing is computed in fp32 on the GPU: compare only where both picked the same experts.
    assert torch.equal(cpu.tokens_per_expert.cpu(), gpu.tokens_per_expert.cpu())
    assert _rel(yg, yc) < tol
    assert _rel(xg.grad, xc.grad) < tol
    assert _rel(gpu.w1.grad, cpu.w1.grad) < tol
    assert _rel(gpu.w2.grad, cpu.w2.grad) < tol


def test_gpu_float64_layer_runs_the_torch_path_and_equals_cpu_reference():
    # the Triton kernels accumulate in fp32: a float64 layer on the GPU takes the torch path
    # (exact), where it used to fail to compile
    bs.set_backend("auto")
    cpu, gpu = _pair(torch.float64, 16)
    x = torch.randn(300, 256, dtype=torch.float64)
    xc, xg = x.clone().requires_grad_(True), x.cuda().requires_grad_(True)
    yc, yg = cpu(xc), gpu(xg)
    yc.sum().backward()
    yg.sum().backward()
    assert _rel(yg, yc) < 1e-12 and _rel(xg.grad, xc.grad) < 1e-12
    assert _rel(gpu.w2.grad, cpu.w2.grad) < 1e-12


def test_gpu_glu_layer_and_gradients_equal_cpu_reference():
    # the gated FFN (act(x W1) * (x W3)) W2: output and every gradient, W3's included,
    # against the fp64 torch path on the same (rounded) weights and inputs
    bs.set_backend("auto")
    cpu, gpu = _pair(torch.bfloat16, 128, glu=True, act="silu")
    x = torch.randn(700, 256, dtype=torch.float64).to(torch.bfloat16).double()
    g = torch.randn(700, 256, dtype=torch.float64).to(torch.bfloat16).double()
    xc = x.clone().requires_grad_(True)
    xg = x.to("cuda", torch.bfloat16).requires_grad_(True)
    yc, yg = cpu(xc), gpu(xg)
    (yc * g).sum().backward()
    (yg * g.to("cuda", torch.bfloat16)).sum().backward()
    assert torch.equal(cpu.tokens_per_expert.cpu(), gpu.tokens_per_expert.cpu())
    assert _rel(yg, yc) < 2e-2
    assert _rel(xg.grad, xc.grad) < 2e-2
    for name in ("w1", "w2", "w3"):
        assert _rel(getattr(gpu, name).grad, getattr(cpu, name).grad) < 2e-2, name


def test_gpu_extreme_routing_single_expert_and_single_token():
    cpu, gpu = _pair(torch.float32, 128, top_k=1)
    with torch.no_grad():
        for layer in (cpu, gpu):
            layer.router.weight.zero_()
            layer.router.weight[5] = 1.0
    x = torch.rand(300, 256, dtype=torch.float64) + 0.1
    assert _rel(gpu(x.to("cuda", torch.float32)), cpu(x)) < 5e-3
    assert gpu.tokens_per_expert.tolist() == [0, 0, 0, 0, 0, 300, 0, 0]
    assert _rel(gpu(x[:1].to("cuda", torch.float32)), cpu(x[:1])) < 5e-3


@pytest.mark.parametrize("experts,top_k,block", [(64, 2, 128), (6, 3, 16), (4, 1, 64)])
def test_gpu_routing_kernels_equal_torch_ops(experts, top_k, block):
    from rocmoe.moe import route_and_permute
    x = torch.randn(5000, 64, device="cuda", dtype=torch.bfloat16)
    probs = 1.0 / torch.arange(1, experts + 1, device="cuda", dtype=torch.float32)  # skewed
    ids = torch.multinomial(probs.expand(5000, experts).contiguous(), top_k).to(torch.int32)
    bs.set_backend("torch")
    ref = route_and_permute(x, ids, experts, block, 200)
    bs.set_backend("auto")
    got = route_and_permute(x, ids, experts, block, 200)
    for name in ("tokens_per_expert", "dest_row", "block_expert", "num_valid_blocks",
                 "block_rows", "row_token", "block_first_row"):
        assert torch.equal(getattr(ref[0], name).long(), getattr(got[0], name).long()), name
    for name in ("row_offsets", "column_indices", "row_indices", "column_offsets",
                 "transpose_blocks"):
        assert torch.equal(getattr(ref[1], name), getattr(got[1], name)), name
    assert torch.equal(ref[2], got[2])


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(map(str, v)))
def test_gpu_forward_and_backward_make_no_host_sync(variant):
    _, gpu = _pair(torch.bfloat16, 128)
    with _variant(variant):
        _no_sync_steps(gpu)


def _no_sync_steps(gpu):
    x = torch.randn(4096, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(4096, 256, device="cuda", dtype=torch.bfloat16)
    y = gpu(x)                       # warm-up: compiles the Triton kernels
    torch.autograd.backward(y, g)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):
            y = gpu(x)
            torch.autograd.backward([y, gpu.aux_loss], [g, torch.ones_like(gpu.aux_loss)])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.isfinite(x.grad.float()).all()


@pytest.mark.parametrize("variant", [dict(tma_store=True), dict(persistent=1),
                                     dict(persistent=2, tma_store=True)],
                         ids=["tma_store", "persistent1", "persistent2_tma_store"])
def test_gpu_dstd_variants_equal_torch_path(variant):
    # DSᵀD's output-store and persistent variants on real hardware: both weight-gradient
    # layouts, an idle expert, bf16, K trimmed to each expert's real rows.
    from rocmoe.moe import build_topology, plan_routing
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 8, (3000, 2), generator=g, dtype=torch.int32)
    ids[ids == 5] = 6  # expert 5 idle
    topo = build_topology(plan_routing(ids.cuda(), 8, 128), 512)
    # padding rows (past each row block's real rows) are zero, as in the layer
    real = (torch.arange(128, device="cuda").view(1, -1) < topo.block_rows.view(-1, 1)).cpu()
    s = torch.randn(topo.nnz, 128, 128, generator=g) \
        * real[topo.row_indices.long().cpu()].unsqueeze(-1)
    b = torch.randn(topo.num_rows, 384, generator=g) * real.reshape(-1, 1)
    s, b = s.to("cuda", torch.bfloat16), b.to("cuda", torch.bfloat16)
    before = dict(bs.KERNEL_CONFIG["dstd"])
    try:
        bs.set_kernel_config(dstd=dict(before, **variant))
        bs.set_backend("torch")
        ref = bs._dstd(s.float(), b.float(), topo)
        ref_t = torch.empty(8, 384, 512, device="cuda")
        bs._dstd(s.float(), b.float(), topo, out=ref_t.transpose(1, 2))
        bs.set_backend("auto")
        got = bs._dstd(s, b, topo)
        got_t = torch.full((8, 384, 512), float("nan"), device="cuda", dtype=torch.bfloat16)
        bs._dstd(s, b, topo, out=got_t.transpose(1, 2))
        torch.cuda.synchronize()
    finally:
        bs.set_kernel_config(dstd=before)
        bs.set_backend("auto")
    assert _rel(got, ref) < 1e-2 and _rel(got_t, ref_t) < 1e-2
    assert got[5].abs().max().item() == 0 and got_t[5].abs().max().item() == 0


def _ffn_vs_torch_path(topo, x, w1, w2, gy):
    """Output and gradients of the fused FFN: the torch path (fp32) and the GPU kernels."""
    results = []
    try:
        for backend in ("torch", "auto"):
            bs.set_backend(backend)
            args = [t.float() if backend == "torch" else t for t in (x, w1, w2)]
            args = [t.clone().requires_grad_(True) for t in args]
            y = bs.fused_expert_ffn(*args, topo, "gelu")
            grads = torch.autograd.grad(y, args, gy.float() if backend == "torch" else gy)
            results.append((y,) + grads)
    finally:
        bs.set_backend("auto")
    return results


def test_gpu_tail_blocks_equal_torch_path():
    # Nearly empty last blocks (at most 64 real rows of 128) run as half blocks: the fused
    # FFN's output and gradients on the GPU equal the torch path on the same topology.
    from rocmoe.moe import build_topology, plan_routing
    g = torch.Generator().manual_seed(1)
    counts = [2 * 128 + 9, 64, 65, 0, 300]
    ids = torch.cat([torch.full((c,), e) for e, c in enumerate(counts)]).to(torch.int32)
    ids = ids[torch.randperm(ids.numel(), generator=g)].view(-1, 1)
    topo = build_topology(plan_routing(ids.cuda(), 5, 128), 384)
    assert int(((topo.block_rows > 0) & (topo.block_rows <= 64)).sum()) == 3
    real = (torch.arange(128, device="cuda").view(1, -1) < topo.block_rows.view(-1, 1))
    x = (torch.randn(topo.num_rows, 256, generator=g).cuda() * real.reshape(-1, 1)).bfloat16()
    w1 = (torch.randn(5, 256, 384, generator=g) / 16).cuda().bfloat16()
    w2 = (torch.randn(5, 384, 256, generator=g) / 20).cuda().bfloat16()
    gy = (torch.randn(topo.num_rows, 256, generator=g).cuda() * real.reshape(-1, 1)).bfloat16()
    for ref, got in zip(*_ffn_vs_torch_path(topo, x, w1, w2, gy)):
        assert _rel(got, ref) < 2e-2


def _ffn_many_row_blocks(hidden, seed=2):
    """A topology with experts of many row blocks, a partly filled one and an idle one, with
    bf16 inputs, weights and output gradient (padding rows zero, as in the layer)."""
    from rocmoe.moe import build_topology, plan_routing
    g = torch.Generator().manual_seed(seed)
    counts = [11 * 128 + 5, 3 * 128, 0, 700]
    ids = torch.cat([torch.full((c,), e) for e, c in enumerate(counts)]).to(torch.int32)
    ids = ids[torch.randperm(ids.numel(), generator=g)].view(-1, 1)
    topo = build_topology(plan_routing(ids.cuda(), 4, 128), 512)
    real = (torch.arange(128, device="cuda").view(1, -1) < topo.block_rows.view(-1, 1))
    x = (torch.randn(topo.num_rows, hidden, generator=g).cuda() * real.reshape(-1, 1)).bfloat16()
    w1 = (torch.randn(4, hidden, 512, generator=g) / hidden ** 0.5).cuda().bfloat16()
    w2 = (torch.randn(4, 512, hidden, generator=g) / 22).cuda().bfloat16()
    gy = (torch.randn(topo.num_rows, hidden, generator=g).cuda() * real.reshape(-1, 1)).bfloat16()
    return topo, x, w1, w2, gy


def test_gpu_long_expert_configs_equal_torch_path(monkeypatch):
    # The "_long" / "sdd_deep" tiles (grouped order, 128x256 SDD and DSD with Wᵀ, DSᵀD a
    # program per tile), here forced on a small topology with a hidden size of DEEP_K.
    monkeypatch.setattr(bs, "LONG_EXPERT_ROWS", 1)
    topo, x, w1, w2, gy = _ffn_many_row_blocks(bs.DEEP_K)
    assert bs.op_config("sdd", topo, bs.DEEP_K) == bs.op_config("sdd_deep")
    results = _ffn_vs_torch_path(topo, x, w1, w2, gy)
    for ref, got in zip(*results):
        assert _rel(got, ref) < 2e-2


@pytest.mark.parametrize("group_m", [4, 8])
def test_gpu_grouped_tile_order_equals_torch_path(group_m):
    # group_m reorders SDD's and DSD's tiles (row blocks of one expert take each weight tile
    # in turn): experts of many row blocks, a group that straddles experts, an idle expert;
    # the fused FFN's output and gradients equal the torch path.
    topo, x, w1, w2, gy = _ffn_many_row_blocks(256)
    before = bs.KERNEL_CONFIG["group_m"]
    try:
        bs.set_kernel_config(group_m=group_m)
        results = _ffn_vs_torch_path(topo, x, w1, w2, gy)
    finally:
        bs.set_kernel_config(group_m=before)
        bs.set_backend("auto")
    for ref, got in zip(*results):
        assert _rel(got, ref) < 2e-2


def test_gpu_backward_on_two_streams_equals_one_stream_bitwise():
    # backward_streams=2 runs the weight gradients on a side stream beside dh and dx: the
    # same kernels on the same inputs, so the gradients are identical, not just close; and
    # the backward stays free of host syncs and capturable in a CUDA graph.
    topo, x, w1, w2, gy = _ffn_many_row_blocks(256)
    before = bs.KERNEL_CONFIG["backward_streams"]

    def grads():
        args = [t.clone().requires_grad_(True) for t in (x, w1, w2)]
        y = bs.fused_expert_ffn(*args, topo, "gelu")
        return torch.autograd.grad(y, args, gy)

    try:
        bs.set_kernel_config(backward_streams=1)
        one = grads()
        bs.set_kernel_config(backward_streams=2)
        two = grads()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            again = grads()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        args = [t.clone().requires_grad_(True) for t in (x, w1, w2)]
        out = {}

        def step():
            y = bs.fused_expert_ffn(*args, topo, "gelu")
            out["grads"] = torch.autograd.grad(y, args, gy)

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        graph.replay()
        torch.cuda.synchronize()
        captured = out["grads"]
    finally:
        bs.set_kernel_config(backward_streams=before)
    for a, b, c, d in zip(one, two, again, captured):
        assert torch.equal(a, b) and torch.equal(a, c) and torch.equal(a, d)


def _layer_step(layer, x, g):
    xg = x.clone().requires_grad_(True)
    y = layer(xg)
    grads = torch.autograd.grad(y, [xg, layer.router.weight, layer.w1, layer.w2], g)
    with torch.no_grad():
        inference = layer(x)
    return (y, inference) + grads


@pytest.mark.parametrize("block", [128, 64])
def test_gpu_memory_variants_equal_the_previous_layer_bitwise(block):
    # The lean layer (act_fusion="recompute", gather_rows, compact_values) and each of its
    # keys flipped alone run the same products on the same values as the layer before them
    # (store, a permuted copy, block values): output, inference output and every gradient
    # are identical, on experts of several row blocks, half blocks and an idle expert.
    torch.manual_seed(0)
    layer = DroplessMoE(512, 1024, 16, 2, block_size=block).to("cuda", torch.bfloat16)
    with torch.no_grad():
        layer.router.weight[3] = -1.0  # with positive tokens expert 3 stays idle
    x = torch.rand(3000, 512, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(3000, 512, device="cuda", dtype=torch.bfloat16)
    results = {}
    for variant in VARIANTS:
        with _variant(variant):
            results[variant] = _layer_step(layer, x, g)
    assert int(layer.tokens_per_expert[3]) == 0
    previous = results[("store", False, False)]
    for variant, got in results.items():
        for name, a, b in zip(("y", "inference", "dx", "drouter", "dw1", "dw2"), previous, got):
            assert torch.equal(a, b), (variant, name, (a.float() - b.float()).abs().max().item())


def test_gpu_lean_layer_equals_cpu_reference_under_each_variant():
    # every variant also equals the fp64 CPU reference (the default is checked above)
    cpu, gpu = _pair(torch.bfloat16, 64)
    x = torch.randn(700, 256, dtype=torch.float64).to(torch.bfloat16).double()
    g = torch.randn(700, 256, dtype=torch.float64).to(torch.bfloat16).double()
    xc = x.clone().requires_grad_(True)
    yc = cpu(xc)
    (yc * g).sum().backward()
    for variant in VARIANTS:
        with _variant(variant):
            xg = x.to("cuda", torch.bfloat16).requires_grad_(True)
            gpu.zero_grad()
            yg = gpu(xg)
            (yg * g.to("cuda", torch.bfloat16)).sum().backward()
        assert _rel(yg, yc) < 2e-2 and _rel(xg.grad, xc.grad) < 2e-2, variant
        assert _rel(gpu.w1.grad, cpu.w1.grad) < 2e-2 and _rel(gpu.w2.grad, cpu.w2.grad) < 2e-2


@pytest.mark.parametrize("shape", [(8192, 1024, 4096, 64, 2), (8192, 4096, 1408, 64, 2),
                                   (4096, 2048, 768, 128, 8)], ids=lambda s: "x".join(map(str, s)))
def test_gpu_peak_memory_is_at_most_the_grouped_gemm_layers_and_as_counted_on_cpu(shape):
    # The caching allocator's peak of one forward + backward: the layer needs no more than
    # the grouped-GEMM layer on the same router, and what the meta-device accounting
    # (rocmoe.bench.moe_memory, no GPU) predicted, within what the libraries' workspaces
    # (cuBLAS, CUB's sort) take on top.
    from rocmoe.bench.memory import peak_bytes
    from rocmoe.bench.moe_memory import layer_memory
    from rocmoe.moe.reference import grouped_gemm_moe, uses_grouped_mm
    tokens, hidden, ffn, experts, top_k = shape
    torch.manual_seed(0)
    layer = DroplessMoE(hidden, ffn, experts, top_k).to("cuda", torch.bfloat16)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    params = [x, layer.router.weight, layer.w1, layer.w2]
    assert uses_grouped_mm(x), "torch._grouped_mm does not run here: no baseline"

    def ours():
        torch.autograd.grad(layer(x), params, gy)

    def theirs():
        ids, weights = layer.router.route_reference(x)
        torch.autograd.grad(grouped_gemm_moe(x, ids, weights, layer.w1, layer.w2), params, gy)

    for fn in (ours, theirs):  # warm-up: compiles, and cuBLAS / CUB workspaces exist
        fn()
    mine, base = peak_bytes(ours), peak_bytes(theirs)
    counted = layer_memory(shape, tuple(bs.KERNEL_CONFIG[k] for k in VARIANT_KEYS))
    assert mine <= base, (mine / base, mine, base)
    for measured, predicted in ((mine, counted[0].peak), (base, counted[1].peak)):
        assert abs(measured - predicted) <= 0.03 * predicted, (measured, predicted)


@pytest.mark.parametrize("tokens,experts,top_k,renorm", [(8192, 64, 6, True), (4096, 128, 8, True),
                                                         (4096, 8, 2, True), (3000, 60, 4, False),
                                                         (1, 16, 2, True)])
def test_gpu_fused_router_equals_torch_router_without_host_syncs(tokens, experts, top_k, renorm):
    # rocmoe/moe/router_fused.py against Router.route_reference on the same GPU tensors:
    # the same picks and tokens per expert, the weights, aux loss and both gradients within
    # fp32 rounding; its forward and backward never synchronise with the host
    from rocmoe.moe import Router
    bs.set_backend("auto")
    torch.manual_seed(0)
    r = Router(1024, experts, top_k, renormalize=renorm).to("cuda", torch.bfloat16)
    x = torch.randn(tokens, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g_w = torch.randn(tokens, top_k, device="cuda")
    got = []
    for route in (r.route_reference, r.route):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error" if route == r.route else "default")
        try:
            ids, w = route(x)
            loss = (w.float() * g_w).sum() + 3.0 * r.aux_loss
            grads = torch.autograd.grad(loss, [x, r.weight])
        finally:
            torch.cuda.set_sync_debug_mode("default")
        got.append((ids, w, r.tokens_per_expert, r.aux_loss) + grads)
    (ids0, w0, c0, a0, gx0, gw0), (ids1, w1, c1, a1, gx1, gw1) = got
    assert torch.equal(ids1, ids0)
    assert torch.equal(c1, c0)
    torch.testing.assert_close(w1, w0, rtol=1e-2, atol=1e-2)  # bf16 of fp32 within an ulp
    torch.testing.assert_close(a1, a0, rtol=1e-4, atol=1e-6)
    assert _rel(gx1, gx0) < 1e-2 and _rel(gw1, gw0) < 1e-3, (_rel(gx1, gx0), _rel(gw1, gw0))


@pytest.mark.skipif(bool(torch.version.hip), reason="native launches are CUDA only")
def test_gpu_fused_router_launches_its_kernels_natively_after_the_first_call():
    # after the JIT's first launch of each, the router's two forward kernels go straight to
    # the driver (rocmoe/native_launch.py): a call through the JIT, or a refused native
    # launch, costs tens of microseconds of host time a kernel
    from rocmoe import native_launch
    from rocmoe.moe import Router
    if not native_launch.enabled():
        pytest.skip("ROCMOE_NATIVE_LAUNCH=0: every launch goes through the JIT")
    bs.set_backend("auto")
    r = Router(1024, 64, 2).to("cuda", torch.bfloat16)
    x = torch.randn(8192, 1024, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        r.route(x)
        before = dict(native_launch.stats)
        for _ in range(3):
            r.route(x)
    torch.cuda.synchronize()
    launched = {k: native_launch.stats[k] - before[k] for k in before}
    assert launched == {"native": 6, "fallback": 0}, (launched, native_launch.last_refusal)
