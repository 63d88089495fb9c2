"""The GPU probes' CPU dry runs: the same script, tiny shapes, the host backend (no GPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from rocmoe_testing import REPO


def _interpreter_env() -> dict:
    """This process's environment with Triton's interpreter on and the repository importable."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def _dry_run(script, *args):
    """The JSON records of benchmarks/`script` run on CPU under Triton's interpreter."""
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), "--device", "cpu",
                           "--reps", "1", *args], env=_interpreter_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_ep_ffn_probe_dry_run_reports_every_path_equal_to_the_block_sparse_ffn():
    # benchmarks/probe_ep_ffn.py times the expert-parallel step's local FFN four ways; each
    # path's output and gradients (dX, dW1, dW2) are checked against the block-sparse FFN's
    records = _dry_run("probe_ep_ffn.py", "--shapes", "64,32,48,8")
    paths = {r["path"]: r for r in records if r.get("probe") == "ep_ffn"}
    assert len(paths) == 4, sorted(paths)
    for name, r in paths.items():
        assert r["rel_err_vs_block_sparse"] < 1e-2, (name, r)
        grads = r["grad_rel_err_vs_block_sparse"]
        assert sorted(grads) == ["w1", "w2", "x"], (name, grads)
        assert max(grads.values()) < 2e-2, (name, grads)
        assert r["fwd_bwd_ms"] > 0, (name, r)


def test_grouped_products_probe_dry_run_reports_every_case_equal_to_the_reference():
    # benchmarks/probe_grouped_persistent.py times gpu.grouped_local and the probe's own
    # table kernel on four products and two row layouts; each case's result is checked
    # against the segment products in fp32
    records = _dry_run("probe_grouped_persistent.py", "--shapes", "64,32,40,8")
    cases = {(r["product"], r["rows"], r["case"]) for r in records}
    assert len(cases) == 4 * 2 * 4, sorted(cases)
    for r in records:
        assert isinstance(r["rel_err"], float) and r["rel_err"] < 1e-3, r


def test_glu_ffn_probe_dry_run_reports_every_case_equal_to_the_baseline_layer():
    # benchmarks/probe_glu_ffn.py times the layer's GLU experts three ways (block-sparse,
    # gpu.grouped_local on the padded rows, the torch._grouped_mm layer); each case's output
    # and dX are checked against the baseline's
    records = _dry_run("probe_glu_ffn.py")
    assert len(records) == 3, records
    for r in records:
        assert r["rel_err_out"] < 1e-4 and r["rel_err_dx"] < 1e-4, r
        assert r["fwd_bwd_ms"] > 0, r


def test_combine_product_probe_dry_run_reports_the_handle_equal_to_the_segment_products():
    # benchmarks/probe_combine_product.py times the grouped GemmAllToAll handle (the
    # expert-parallel combine's product, local mode) against gpu.grouped_local; each case's
    # result is checked against the segment products in fp32
    records = _dry_run("probe_combine_product.py", "--shapes", "64,32,48,8")
    cases = {(r["product"], r["case"]) for r in records}
    assert cases == {(p, c) for p in ("W1", "W2")
                     for c in ("GemmAllToAll handle", "gpu.grouped_local")}, sorted(cases)
    for r in records:
        assert r["rel_err"] < 1e-5, r


def test_gemv_address_probe_dry_run_reports_every_placement_of_w_equal_to_float64():
    # benchmarks/probe_gemv_address.py times the GEMV handle against torch.mv on copies of
    # one W at other addresses (fresh allocations, offsets into a slab); each copy's y is
    # checked against float64, and every placement is at an address of its own. The slab's
    # views overlap (16 bytes apart): each must hold W when it is timed
    records = _dry_run("probe_gemv_address.py", "--shape", "64x32",
                       "--fresh", "2", "--offsets", "0,16")
    placed = [r for r in records if not r.get("summary")]
    assert [r["placement"] for r in placed] == ["first", "fresh0", "fresh1", "slab+0",
                                                "slab+16"], placed
    assert len({r["address"] for r in placed}) == len(placed), placed
    assert int(placed[4]["address"], 16) - int(placed[3]["address"], 16) == 16, placed
    for r in placed:
        assert r["rel_err"] < 1e-2 and r["ratio_graph"] > 0 and r["ratio_queued"] > 0, r
    summary = [r for r in records if r.get("summary")]
    assert len(summary) == 1 and summary[0]["placements"] == 5, summary


def test_gemv_variants_host_smoke_reports_each_named_variant_checked_and_timed():
    # benchmarks/gemv_variants.py runs each variant in a child with its knobs; on the host
    # backend (--host-smoke) the same records: right against float64, eager and replayed,
    # with the timing fields of time_against_mv, which probe_gemv_address.py shares
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gemv_variants.py"), "--host-smoke",
         "--variants", "default,balance", "--shapes", "64x32", "--dtypes", "bf16,fp32",
         "--no-edge", "--reps", "1", "--calls", "1"],
        env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    timed = [r for r in records if r.get("kind") == "timed"]
    assert sorted((r["variant"], r["dtype"]) for r in timed) == [
        ("balance", "bf16"), ("balance", "fp32"), ("default", "bf16"), ("default", "fp32")]
    for r in timed:
        assert r["ok"] and r["ratio_graph"] > 0 and r["ratio_queued"] > 0, r
    assert [r["env"] for r in timed if r["variant"] == "balance"] == [
        {"ROCMOE_GEMV_BALANCE": "1"}] * 2


def test_functional_host_probe_reports_each_path_of_each_op_with_equal_results():
    # benchmarks/probe_functional_host.py times a functional op call three ways (the direct
    # path with grad off, the custom op with grad off, the function with grad on); every
    # path gives the first path's result
    records = _dry_run("probe_functional_host.py", "--calls", "20")
    paths = {(r["op"], r["path"]) for r in records}
    assert len(paths) == len(records) == 3 * 3 + 2, records  # + the checks at 4 / 26 tables
    for r in records:
        assert r["equal_to_first_path"] and r["host_us"] > 0, r


def test_function_layers_cpu_probe_times_every_layer_for_both_output_capacities():
    # benchmarks/probe_function_layers_cpu.py: the GEMM function's Python layers above a
    # stand-in lean call, with an exact-rows output and a larger one
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "probe_function_layers_cpu.py"),
                           "--calls", "20"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert {(r["capacity"], r["layer"]) for r in records} == {
        (c, layer) for c in (512, 4096)
        for layer in ("lean", "repeat", "rows_exchange", "function")}
    assert all(r["host_us"] > 0 for r in records), records


def test_lean_call_cpu_probe_times_both_outputs_with_one_launch_a_call():
    # benchmarks/probe_lean_call_cpu.py times the lean GEMM call's own Python against the
    # stand-ins its tests use: every timed call must have been taken and launched
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "probe_lean_call_cpu.py"),
                           "--calls", "20", "--rows", "64"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["exact"] for r in records] == [False, True]
    # 3 warm-up calls and 5 repeats of 20 per case, each launched once
    assert [r["launches"] for r in records] == [103, 206]
    assert all(r["host_us"] > 0 for r in records)


def _synthetic_trace(rounds, calls):
    """Chrome-trace events as torch.profiler exports them for probe_idle_gap.traced: per
    round and call, the iteration's range, its start event's record, its launch and the
    kernel the launch's correlation id names. `calls`: name -> (record to launch, launch to
    kernel start, kernel us)."""
    events, t, corr = [], 0.0, 0
    for i in range(rounds):
        for name, (to_launch, to_gpu, kernel) in calls.items():
            corr += 1
            launch_at = t + 1 + to_launch
            events += [
                dict(ph="X", name=f"probe_iter_{i}:{name}", ts=t, dur=100, cat="user_annotation"),
                dict(ph="X", name="cudaEventRecordWithFlags", ts=t + 1, dur=0.5,
                     cat="cuda_runtime"),
                dict(ph="X", name="cuLaunchKernel", ts=launch_at, dur=3, cat="cuda_driver",
                     args=dict(correlation=corr)),
                dict(ph="X", name=f"{name}_kernel", ts=launch_at + to_gpu, dur=kernel,
                     cat="kernel", args=dict(correlation=corr)),
            ]
            t += 200
    return events


def test_idle_gap_trace_results_split_interleaved_calls_by_name_from_their_start_event():
    # benchmarks/probe_idle_gap.py (used by probe_prelaunch.py --trace) reads the launch to
    # kernel start and the kernel's time of each call kind out of one interleaved trace,
    # host time counted from the start event's record, the first two rounds left out
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from probe_idle_gap import trace_results
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    events = _synthetic_trace(6, {"handle": (5.0, 7.0, 26.0), "torch": (9.0, 8.0, 23.0)})
    # the warm-up rounds are slower: left out, they change no median
    for e in events:
        if e["name"].endswith("_kernel") and e["ts"] < 2 * 400:
            e["dur"] = 90.0
    got = trace_results(events, ["handle", "torch"])
    for name, (to_launch, to_gpu, kernel) in {"handle": (5.0, 7.0, 26.0),
                                              "torch": (9.0, 8.0, 23.0)}.items():
        r = got[name]
        assert r["samples"] == 4, r
        assert (r["host_to_launch"], r["launch_to_gpu"], r["gpu_busy"]) == (
            to_launch, to_gpu, kernel), r
        assert r["ops"] == [f"{name}_kernel"] and r["gpu_ops"] == 1


def test_tiny_gemm_ncu_summary_names_the_split_k_reduce_by_its_call_and_reads_ncu_units(
        capsys):
    # benchmarks/ncu_tiny_gemm.py --summarize: a row per kernel of ncu's raw CSV, named from
    # the "launch N: label" lines before it (cuBLAS's split-K reduce, a second kernel of one
    # call, by that call's label), values scaled from the unit in ncu's units row (ns to us,
    # sectors of 32 bytes to MB)
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from ncu_tiny_gemm import summarize
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    summarize(str(REPO / "benchmarks" / "results" /
                  "ncu_tiny_gemm_h100_fortysecond_session_app_replay_16.csv"))
    # (label: 30 columns, kernel: 28, then the values)
    rows = [(line[:30].strip(), line[30:58].strip(), line[58:].split())
            for line in capsys.readouterr().out.splitlines()[1:]]
    shape = "16x4096x4096"
    assert [(label, kernel[:14]) for label, kernel, _ in rows] == [
        (f"handle {shape} (first)", "gemm_a2a_kerne"), (f"handle {shape}", "gemm_a2a_kerne"),
        (f"torch {shape} (first)", "nvjet_sm90_tst"), (f"torch {shape} (first)", "void cublasLt:"),
        (f"torch {shape}", "nvjet_sm90_tst"), (f"torch {shape}", "void cublasLt:")], rows
    # the warm handle call: 11044 ns, 1.4 MB from DRAM, 1.23e6 sectors (39.25 MB) to the SMs,
    # 128 programs
    us, dram_mb, to_sm_mb, *_, grid, _ = rows[1][2]
    assert (us, dram_mb, to_sm_mb, grid) == ("11.04", "1.40", "39.25", "128.00"), rows[1]


def test_tiny_graph_probe_bare_kernels_match_float64_in_the_interpreter():
    # benchmarks/probe_tiny_graph.py's bare kernels, as its variants name them: the plain
    # tile, the count read after the loop (c), each program's K loop started at its own step
    # (z), and split K summed by torch or by the probe's sum kernel (r); fp32 operands, as
    # the interpreter computes bf16 dots wrongly on CPU
    script = (
        "import sys, torch\n"
        f"sys.path.insert(0, {str(REPO / 'benchmarks')!r})\n"
        "import probe_tiny_graph as p\n"
        "g = torch.Generator().manual_seed(0)\n"
        "x = torch.randn(64, 1024, generator=g)\n"
        "w = torch.randn(1024, 128, generator=g) / 32\n"
        "ref = x.double() @ w.double()\n"
        "for name in ('o64x32x256w4s4k1', 'oc64x32x256w4s4k1', 'oz64x32x256w4s4k1',\n"
        "             'ocz64x32x128w4s6k1', 'o64x32x128w4s4k4', 'oz64x32x128w4s4k2r'):\n"
        "    got = p.bare_call(p.parse_variant(name), x, w)().double()\n"
        "    print(name, float((got - ref).norm() / ref.norm()))\n")
    proc = subprocess.run([sys.executable, "-c", script], env=_interpreter_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    errors = dict(line.split() for line in proc.stdout.splitlines())
    assert len(errors) == 6, proc.stdout
    for name, err in errors.items():
        assert float(err) < 1e-5, (name, err)
