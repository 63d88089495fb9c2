"""rocmoe.bench.multi_gpu on CPU: argument parsing, case lists, records and their ratios, the
Zipf routing bias, the torch.distributed transport, and a 2-rank dry run (host backend + gloo).
The GPU numbers come from benchmarks/gpu_multi.sh on a GPU machine; nothing here needs one."""

from __future__ import annotations

import json
import sys

import pytest
import torch

import rocmoe_testing as helpers
from rocmoe.bench import fused as bench_fused
from rocmoe.bench import multi_gpu as mg


def test_parse_args_defaults_measure_every_op_at_the_large_shapes():
    args = mg.parse_args([])
    assert args.graph  # the graph-replay timing runs wherever there is a GPU
    assert args.ops == ["embedding", "gemv", "gemm", "moe", "moe_combine", "moe_handles"]
    assert args.dtypes == ["float32"]
    assert args.moe_shapes == mg.MOE_EP_LARGE
    assert args.moe_dtype == "bfloat16"
    assert not args.small and args.ranks == 0


def test_parse_args_cpu_dry_run_uses_float32_layers():
    args = mg.parse_args(["--device", "cpu", "--small", "--ops", "moe,gemm",
                          "--dtype", "float32,bfloat16", "--heap", "512M"])
    assert args.ops == ["moe", "gemm"]
    assert args.dtypes == ["float32", "bfloat16"]
    assert args.moe_dtype == "float32"
    assert args.moe_shapes == mg.MOE_EP_SMALL
    assert args.heap == 512 << 20


@pytest.mark.parametrize("argv", [["--ops", "embedding,allgather"], ["--dtype", "int8"],
                                  ["--iters", "0"], ["--moe-shapes", "1,2,3"]])
def test_parse_args_rejects_bad_input(argv, capsys):
    with pytest.raises(SystemExit):
        mg.parse_args(argv)


def test_parse_size_and_moe_shapes():
    assert mg.parse_size("8G") == 8 << 30
    assert mg.parse_size("4096") == 4096
    assert mg.parse_size("1.5k") == 1536
    assert mg.parse_moe_shapes("8192,1024,4096,64; 16,8,8,4") == [(8192, 1024, 4096, 64),
                                                                  (16, 8, 8, 4)]


def test_fused_cases_are_the_shapes_of_rocmoe_bench_fused():
    args = mg.parse_args(["--dtype", "float32,bfloat16"])
    cases = mg.fused_cases(args, world=2)
    per_dtype = len(bench_fused.DLRM_LARGE) + len(bench_fused.GEMV_LARGE) + len(bench_fused.MOE_LARGE)
    assert len(cases) == 2 * per_dtype
    emb = [s for op, s, d in cases if op == "embedding" and d == "float32"]
    assert sorted(map(json.dumps, emb)) == sorted(map(json.dumps, bench_fused.DLRM_LARGE))
    # receive buffers only grow: embedding shapes run from the least work to the most
    work = [s["batch"] * s["pooling"] * s["dim"] for s in emb]
    assert work == sorted(work)
    small = mg.fused_cases(mg.parse_args(["--small", "--ops", "gemv"]), world=4)
    assert small == [("gemv", bench_fused.GEMV_SMALL[0], "float32")]


def test_make_record_names_the_baseline_and_computes_the_ratios():
    rec = mg.make_record("gemm", "ipc", 2, "float32", {"tokens": 4096, "hidden": 1024},
                         {"ms": 1.0, "loop_ms": 0.5}, {"ms": 2.0, "loop_ms": 0.8},
                         rel_err_vs_baseline=1e-7)
    assert rec["baseline"] == mg.BASELINES["gemm"]
    assert rec["speedup"] == 2.0 and rec["latency_reduction"] == 0.5
    assert rec["loop_speedup"] == 1.6 and rec["loop_latency_reduction"] == 0.375
    assert rec["goal_reduction"] == 0.15 and rec["meets_goal"] is True
    assert rec["rel_err_vs_baseline"] == 1e-7


def test_make_record_gives_graph_replay_ratios_or_the_capture_error():
    rec = mg.make_record("gemv", "ipc", 2, "bfloat16", {"n": 8192, "k": 8192},
                         {"ms": 1.0, "graph_ms": 0.04}, {"ms": 1.0, "graph_ms": 0.05})
    assert rec["fused_graph_ms"] == 0.04 and rec["baseline_graph_ms"] == 0.05
    assert rec["graph_speedup"] == 1.25 and rec["graph_latency_reduction"] == 0.2
    failed = mg.make_record("gemv", "ipc", 2, "bfloat16", {}, {"ms": 1.0, "graph_ms": 0.04},
                            {"ms": 1.0, "graph_ms": "RuntimeError: capture"})
    assert "graph_speedup" not in failed
    assert failed["graph_error"] == {"fused": 0.04, "baseline": "RuntimeError: capture"}


def test_env_closes_every_handle_of_a_case():
    closed = []

    class Handle:
        def __init__(self, name):
            self.name = name

        def close(self):
            closed.append(self.name)

    env = mg.Env.__new__(mg.Env)  # no context needed for the bookkeeping
    env.handles = []
    a, b = env.handle(Handle("a")), env.handle(Handle("b"))
    assert (a.name, b.name) == ("a", "b")
    env.close_handles()
    assert sorted(closed) == ["a", "b"] and env.handles == []


def test_make_record_judges_a_goal_only_at_its_world_size():
    fast = ({"ms": 1.0}, {"ms": 2.0})
    slow = ({"ms": 1.0}, {"ms": 1.1})
    assert mg.make_record("embedding", "ipc", 2, "float32", {}, *fast)["meets_goal"] is None
    assert mg.make_record("embedding", "ipc", 8, "float32", {}, *fast)["meets_goal"] is True
    assert mg.make_record("embedding", "ipc", 8, "float32", {}, *slow)["meets_goal"] is False
    assert mg.make_record("gemv", "nvshmem", 4, "float32", {}, *slow)["meets_goal"] is False
    moe = mg.make_record("moe", "ipc", 2, "bfloat16", {}, *fast)
    assert "meets_goal" not in moe and moe["speedup"] == 2.0


def test_failed_case_record_has_no_times_and_shows_in_the_table():
    bad = mg.make_record("gemv", "ipc", 2, "float32", {"n": 4096, "k": 4096}, None, None,
                         error="CommTimeoutError: late")
    assert "fused_ms" not in bad and bad["meets_goal"] is None
    good = mg.make_record("gemv", "ipc", 2, "float32", {"n": 8192, "k": 8192},
                          {"ms": 0.05}, {"ms": 0.08})
    stage = {"bench": "multi_gpu", "stage": "nvshmem", "error": "build failed"}
    table = mg.summary_table([bad, good, stage]).splitlines()
    assert len(table) == 3  # header + the two op records; stage notes are not op rows
    assert "CommTimeoutError" in table[1]
    assert "0.0500" in table[2] and "1.600" in table[2]


def test_zipf_tokens_make_the_router_route_zipf():
    from rocmoe.bench.draws import router_inputs
    from rocmoe.moe.router import Router
    tokens, experts, hidden = 40000, 8, 64
    g = torch.Generator().manual_seed(3)
    router = Router(hidden, experts, 2)
    p = mg.zipf_probabilities(experts, 1.0)
    x, drawn = router_inputs(router.weight, tokens, 2, p, g)
    ids, weights = router.route(x)
    # the router picks the draw (as a set per token) for all but a few near-ties
    same = (ids.long().sort(1).values == drawn.sort(1).values).all(1).float().mean()
    assert same > 0.99, same
    # the first pick of the draw without replacement is a sample of p
    first = torch.bincount(drawn[:, 0], minlength=experts).double() / tokens
    assert torch.allclose(first, p, atol=0.01), (first, p)
    # still a router: its weight gets a gradient
    (weights * torch.randn(weights.shape, generator=g)).sum().backward()
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def test_dist_transport_is_all_to_all_single_at_world_size_one():
    import torch.distributed as dist
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        t = mg.DistTransport(0, 1)
        rows = torch.randn(5, 3)
        assert torch.equal(t.all_to_all(rows, [5], [5]), rows)
        counts = torch.tensor([[2, 3]], dtype=torch.int32)
        got = t.exchange_counts(counts)
        assert got.dtype == torch.int32 and torch.equal(got, counts)
    finally:
        dist.destroy_process_group()


@pytest.mark.mpi
def test_two_rank_cpu_dry_run_prints_records_with_matching_results(tmp_path):
    out = tmp_path / "multi.jsonl"
    proc = helpers.run_mpi("-m", 2, "rocmoe.bench.multi_gpu", "--device", "cpu", "--small",
                           "--ops", "gemm,moe,moe_combine", "--reps", "1", "--iters", "2",
                           "--warmup", "0",
                           "--output", str(out), timeout=240)
    assert proc.returncode == 0, proc.stdout
    printed = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert printed == written
    assert [r["op"] for r in written] == ["gemm_all_to_all", "dropless_moe_step",
                                          "dropless_moe_step_fused_combine"]
    for r in written:
        assert "error" not in r, r
        assert r["ranks"] == 2 and r["backend"] == "host" and r["torch_distributed"] is True
        assert r["fused_ms"] > 0 and r["baseline_ms"] > 0
        assert r["speedup"] == pytest.approx(r["baseline_ms"] / r["fused_ms"], rel=2e-3)
        # both paths compute the same function
        assert r["rel_err_vs_baseline"] < 1e-5
    moe = written[1]
    # rocmoe's step combined through gemm_all_to_all, the baseline by all_to_all_single
    assert moe["combine"] == "gemm_all_to_all" and moe["baseline_combine"] == "all_to_all"
    assert moe["grad_w1_rel_err_vs_baseline"] < 1e-5
    assert moe["routing_match"] > 0.95
    # Zipf(1.0) over 8 experts: rank 0 owns experts 0-3, most of the load
    assert moe["rank_load_fraction"][0] > 0.6
    assert sum(moe["rank_load_fraction"]) == pytest.approx(1.0, abs=1e-3)
    # the fused combine against the all-to-all combine on the same heap transport
    fused = written[2]
    assert fused["combine"] == "gemm_all_to_all" and fused["baseline_combine"] == "all_to_all"
    assert "all_to_all" in fused["baseline"] and fused["grad_w1_rel_err_vs_baseline"] < 1e-5



@pytest.mark.mpi
def test_heap_only_steps_run_without_torch_distributed(tmp_path):
    # moe_handles compares two rocmoe transports: no NCCL (gloo) group, which on a GPU could
    # not take two ranks sharing one device
    out = tmp_path / "multi.jsonl"
    proc = helpers.run_mpi("-m", 2, "rocmoe.bench.multi_gpu", "--device", "cpu", "--small",
                           "--ops", "moe_handles", "--reps", "1", "--iters", "1",
                           "--warmup", "0", "--output", str(out), timeout=240)
    assert proc.returncode == 0, proc.stdout
    (rec,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert rec["op"] == "dropless_moe_step_on_handles" and "error" not in rec, rec
    assert rec["torch_distributed"] is False
    assert rec["rel_err_vs_baseline"] < 1e-5 and rec["grad_w1_rel_err_vs_baseline"] < 1e-5


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
