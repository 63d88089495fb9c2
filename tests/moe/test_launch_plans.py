"""The block-sparse launchers' cached plans (blocksparse._PLANS) launch exactly what deciding
afresh at every call launches (PLAN_CACHE False): the same kernel, grid, constexprs and
launch options, and the same arguments (which tensor, or a descriptor of which tensor with
what shape, strides and box). On CPU tensors with every launch recorded instead of run,
over several topologies, operand dtypes, layouts and alignments, epilogue options,
KERNEL_CONFIG settings, with and without the interpreter and its descriptor variants."""

import dataclasses
import gc
import weakref

import pytest
import torch

from rocmoe_testing import require_module

require_module("triton", "the GPU launchers' plans (their kernels are not run here)")

from rocmoe.moe import blocksparse as bs  # noqa: E402
from rocmoe.moe import build_topology, plan_routing  # noqa: E402

# operand dtypes and devices (meta: no address is read, as for a CPU tensor compiled for)
CASES = [(torch.bfloat16, "cpu"), (torch.float16, "cpu"), (torch.float32, "cpu"),
         (torch.bfloat16, "meta")]
CONFIGS = [{}, dict(tma_store=True), dict(persistent=2, tma_store=True),
           dict(block_n=64, block_k=32), dict(tail=False),
           dict(group_m=4, sdd=dict(block_n=256, num_warps=8), dstd=dict(persistent=0)),
           dict(tma=False, num_stages=5)]
# (TRITON_INTERPRET, TMA_IN_INTERPRETER): compiled, interpreted with and without descriptors
MODES = [(False, False), (True, True), (True, False)]


def _topologies():
    g = torch.Generator().manual_seed(0)

    def make(block, ffn, e, t, compact, idle=()):
        ids = torch.stack([torch.randperm(e, generator=g)[:2] for _ in range(t)])
        for x in idle:  # an expert nobody is routed to
            ids[ids == x] = (x + 1) % e
        return build_topology(plan_routing(ids.to(torch.int32), e, block), ffn, compact=compact)

    blocks = make(32, 96, 4, 50, False)
    return [blocks, make(32, 80, 4, 50, True), make(64, 128, 3, 40, True, idle=(1,)),
            make(32, 128, 4, 60, False), make(16, 48, 4, 30, False),
            # built by hand: no real-row counts (whole blocks, no trimmed K), or one of them
            dataclasses.replace(blocks, block_rows=None, expert_rows=None),
            dataclasses.replace(blocks, block_rows=None),
            dataclasses.replace(blocks, expert_rows=None),
            build_topology(plan_routing(torch.zeros(0, 2, dtype=torch.int32), 4, 32), 64)]


class _Recorder:
    """kernels.launch's stand-in: records (kernel, grid, arguments, keyword arguments)."""

    def __init__(self, roles):
        self.calls, self.roles = [], roles

    def __call__(self, name):
        rec = self

        class Grid:
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    rec.calls.append((name, tuple(grid), tuple(rec.summary(a) for a in args),
                                      tuple(kwargs.items())))
                return launch
        return Grid()

    def summary(self, a):
        if isinstance(a, torch.Tensor):
            return ("tensor", self.roles.get(id(a), "new"), tuple(a.shape), a.stride(), a.dtype)
        if hasattr(a, "block_shape"):  # a tensor descriptor
            fields = {k: v for k, v in vars(a).items() if k != "base"}
            return ("desc", type(a).__name__, self.summary(a.base), repr(fields))
        return (type(a).__name__, a)


def _sequence(rec, monkeypatch):
    """Every launcher's calls over the topologies, dtypes, configs and modes, in one order:
    the same shapes one after another in each dtype, layout and mode (and within the cache's
    bound), so that a plan kept under too coarse a key is reused where it does not apply."""
    topos = _topologies()
    before = {k: bs.KERNEL_CONFIG[k] for k in ("tma_store", "persistent", "block_n", "block_k",
                                              "tail", "group_m", "sdd", "dstd", "tma",
                                              "num_stages")}
    keep = []  # inputs stay alive for the pass (their ids name them in the record)
    rec.roles.clear()

    def named(name, t):
        keep.append(t)
        rec.roles[id(t)] = name
        return t

    for ti, topo in enumerate(topos):
        for field in dataclasses.fields(topo):
            value = getattr(topo, field.name)
            if isinstance(value, torch.Tensor):
                named(f"topology {ti}: {field.name}", value)

    try:
        for cfg in CONFIGS:
            bs.set_kernel_config(**{**before, **cfg})
            for topo in topos:
                for hidden in (64, 40):
                    for long in (False, True):  # "_long" / "sdd_deep" tiles forced on
                        monkeypatch.setattr(bs, "LONG_EXPERT_ROWS", 1 if long else 2048)
                        monkeypatch.setattr(bs, "DEEP_K", 64 if long else 2048)
                        for interp, tma in MODES:
                            monkeypatch.setenv("TRITON_INTERPRET", "1" if interp else "0")
                            monkeypatch.setattr(bs, "TMA_IN_INTERPRETER", tma)
                            for dtype, device in CASES:
                                _calls(topo, hidden, dtype, device, named)
    finally:
        bs.set_kernel_config(**before)


def _calls(topo, hidden, dtype, device, named):
    e, f, rows = topo.num_experts, topo.ffn_size, topo.num_rows
    z = lambda *shape: torch.zeros(*shape, dtype=dtype, device=device)  # noqa: E731
    a = named("a", z(rows, hidden))
    flat = z(rows * hidden + 8)
    a_off = named("a_off", flat[1:1 + rows * hidden].view(rows, hidden))  # not 16-byte aligned
    w1 = named("w1", z(e, hidden, f))
    w2 = named("w2", z(e, f, hidden))
    w1t = named("w1t", w1.transpose(1, 2))  # (the backward's W1ᵀ: unit stride along F)
    w2t = named("w2t", w2.transpose(1, 2))
    s = named("s", z(*topo.values_shape()))
    h = named("h", z(*topo.values_shape()))
    act_out = named("act_out", z(*topo.values_shape()))
    rows_map = None
    if topo.block_rows is not None and topo.num_row_blocks:
        ids_rows = torch.full((rows,), -1, dtype=torch.int32)
        rows_map = named("a_rows", ids_rows)
        tokens = named("tokens", z(max(rows // 2, 1), hidden))
    for src in (a, a_off):
        bs._sdd_triton(src, w1, topo)
        bs._sdd_triton(src, w1, topo, act="gelu", act_out=act_out)
        bs._sdd_triton(src, w1, topo, act="silu", act_out=act_out, keep_product=True)
        bs._sdd_triton(src, w1, topo, act="gelu", act_only=True)
    bs._sdd_triton(a, w2t, topo)
    bs._sdd_triton(a, w2t, topo, act_grad_of=h, act="gelu", rewrite_act=True)
    bs._sdd_triton(a, w2t, topo, act_grad_of=h, act="relu")
    bs._sdd_triton(a, w2t, topo, scale_by=h)
    if rows_map is not None:
        bs._sdd_triton(tokens, w1, topo, act="gelu", act_out=act_out, a_rows=rows_map)
    bs._dsd_triton(s, w2, topo)
    bs._dsd_triton(s, w2, topo, act="gelu")
    bs._dsd_triton(s, w1t, topo)
    bs._dstd_triton(s, a, topo)
    bs._dstd_triton(s, a_off, topo, act="gelu")
    bs._dstd_triton(s, a, topo, out=named("dw2", z(e, f, hidden)))
    bs._dstd_triton(s, a, topo, out=named("dw1t", z(e, hidden, f).transpose(1, 2)))
    if rows_map is not None:
        bs._dstd_triton(s, tokens, topo, out=named("dw1g", z(e, hidden, f).transpose(1, 2)),
                        b_rows=rows_map)


@pytest.fixture
def recorded(monkeypatch):
    kernels = bs._kernels()

    def run(cache: bool, passes: int = 1):
        rec = _Recorder({})
        monkeypatch.setattr(kernels, "launch", rec)
        monkeypatch.setattr(bs, "PLAN_CACHE", cache)
        # (unbounded here: any two calls whose keys a mutation of the key merges must meet)
        monkeypatch.setattr(bs, "_MAX_PLANS", 1 << 20)
        bs._PLANS.clear()
        for _ in range(passes):
            _sequence(rec, monkeypatch)
        monkeypatch.undo()
        bs._PLANS.clear()
        return rec.calls
    return run


def test_cached_plans_launch_what_deciding_afresh_launches(recorded):
    fresh = recorded(cache=False)
    cached = recorded(cache=True, passes=2)  # (the second pass takes every plan from the cache)
    assert len(cached) == 2 * len(fresh)
    for i, (got, want) in enumerate(zip(cached, fresh + fresh)):
        assert got == want, f"launch {i} differs:\n{got}\n{want}"
    # the sequence reached every kernel and the descriptor, store and pointer variants
    names = {c[0] for c in fresh}
    assert names == {"sdd_kernel", "sdd_persistent_kernel", "dsd_kernel", "dstd_kernel",
                     "dstd_persistent_kernel"}
    kinds = {a[0] for c in fresh for a in c[2]}
    assert kinds >= {"desc", "tensor"}
    kw = [dict(c[3]) for c in fresh]
    assert any(k.get("TMA_STORE") for k in kw) and any(k.get("OUT_T") for k in kw)
    assert any(k.get("USE_TMA") for k in kw) and any(k.get("USE_TMA") is False for k in kw)
    assert {k.get("num_stages") for k in kw} >= {None, 2, 3, 4, 5}


def test_plans_keep_no_tensor_alive(monkeypatch):
    kernels = bs._kernels()
    monkeypatch.setattr(kernels, "launch", _Recorder({}))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(bs, "TMA_IN_INTERPRETER", True)  # (descriptors of a and w1 made)
    topo = _topologies()[0]
    a = torch.zeros(topo.num_rows, 64, dtype=torch.bfloat16)
    w1 = torch.zeros(topo.num_experts, 64, topo.ffn_size, dtype=torch.bfloat16)
    bs._PLANS.clear()
    s = bs._sdd_triton(a, w1, topo)
    out = bs._dstd_triton(s, a, topo)
    assert len(bs._PLANS) == 2
    refs = [weakref.ref(t) for t in (a, w1, s, out)]
    del a, w1, s, out
    gc.collect()
    assert all(r() is None for r in refs)
    bs._PLANS.clear()


def test_plans_are_bounded_and_cleared_by_set_kernel_config(monkeypatch):
    kernels = bs._kernels()
    monkeypatch.setattr(kernels, "launch", _Recorder({}))
    monkeypatch.setattr(bs, "_MAX_PLANS", 3)
    topo = _topologies()[0]
    bs._PLANS.clear()
    for hidden in (16, 32, 48, 64, 80):
        bs._dsd_triton(torch.zeros(topo.values_shape()),
                       torch.zeros(topo.num_experts, topo.ffn_size, hidden), topo)
        assert len(bs._PLANS) <= 3
    before = bs.KERNEL_CONFIG["block_n"]
    try:
        bs.set_kernel_config(block_n=before)
        assert not bs._PLANS
    finally:
        bs.set_kernel_config(block_n=before)
