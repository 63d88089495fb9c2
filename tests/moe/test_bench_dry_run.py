"""`rocmoe bench moe --device cpu` runs every code path of the benchmark (a dry run)."""

import json

import torch

from rocmoe.bench import moe as bench_moe


def test_benchmark_dry_run_reports_every_metric_with_its_baseline(capsys):
    rc = bench_moe.main(["--device", "cpu", "--shapes", "64,32,48,4", "--routing", "uniform",
                         "--reps", "1", "--block-size", "16"])
    assert rc == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()
               if line.startswith("{")]
    metrics = {r["metric"] for r in records}
    assert {"ffn_fwd_vs_dense_matmul", "ffn_fwdbwd_vs_grouped_mm",
            "layer_fwdbwd_vs_capacity_padded", "layer_fwdbwd_vs_max_padded",
            "layer_fwdbwd_vs_capacity_padded_cuda_graphs",
            "permute_topology_share", "permute_topology_share_device_time"} <= metrics
    for r in records:
        if "ratio" in r:
            unit = "ms" if "ours_ms" in r else "bytes"  # peak memory is in bytes
            assert r["baseline"] and r[f"ours_{unit}"] > 0 and r[f"baseline_{unit}"] > 0


def test_benchmark_reports_the_balanced_bmm_ceiling_next_to_dense(capsys):
    bench_moe.main(["--device", "cpu", "--shapes", "64,32,48,4", "--routing", "uniform",
                    "--reps", "1", "--block-size", "16"])
    (rec,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()
              if '"metric": "dense_parity_ceiling"' in line]
    assert rec["ceiling_ms"] > 0 and rec["baseline_ms"] > 0
    # both ratios are FLOP rates: consistent with the times and the shape's useful FLOPs
    flops = 3 * 4.0 * 64 * 2 * 32 * 48
    # (the times are rounded to 0.1 us in the record)
    ratio = rec["baseline_ms"] / rec["ceiling_ms"]
    assert abs(rec["ceiling_over_dense"] - ratio) < 0.02 * ratio
    assert abs(rec["baseline_tflops"] - flops / rec["baseline_ms"] / 1e9) < 0.02 * rec[
        "baseline_tflops"] + 0.1
    assert rec["ours_over_ceiling"] > 0


def test_benchmark_breakdown_times_the_kernels_of_the_configured_fusion(capsys):
    bench_moe.main(["--device", "cpu", "--shapes", "64,32,48,4", "--routing", "uniform",
                    "--reps", "1", "--block-size", "16"])
    kernels = {json.loads(line)["kernel"] for line in capsys.readouterr().out.splitlines()
               if '"metric": "kernel"' in line}
    # act_fusion="recompute" with gather_rows (the defaults): the forward SDD reads the
    # tokens and writes h and GELU(h), the backward SDD turns h into GELU(h), dW1 reads the
    # tokens, DSD/DSᵀD run plain
    assert {"sdd_fwd_gathered_store_pre_gelu", "dsd_fwd", "dstd_dw2", "sdd_bwd_rewrite_act",
            "dsd_dx", "dstd_dw1_gathered"} == kernels


def test_interleaved_timing_samples_every_case_each_round_after_its_setup():
    log = []
    cases = {name: (lambda name=name: log.append(("setup", name)),
                    lambda name=name: log.append(("call", name))) for name in ("a", "b")}
    from rocmoe.bench.timing import interleaved_ms
    times = interleaved_ms(cases, rounds=3, calls=2)
    assert set(times) == {"a", "b"} and all(t >= 0 for t in times.values())
    one_round = [("setup", "a"), ("call", "a"), ("call", "a"),
                 ("setup", "b"), ("call", "b"), ("call", "b")]
    assert log == one_round * 3


def test_sweep_entries_replace_the_per_kernel_overrides_they_name():
    from rocmoe.bench.moe_kernels import DEFAULT_CONFIGS, sweep_config
    from rocmoe.moe import blocksparse as bs
    start = dict(bs.KERNEL_CONFIG)
    plain = sweep_config(start, dict(block_n=256), bs.OPS)
    assert plain["block_n"] == 256 and all(plain[op] == {} for op in bs.OPS)
    shipped = sweep_config(start, dict(dsd=dict(block_n=256)), bs.OPS)
    assert shipped["dsd"] == dict(block_n=256) and shipped["block_n"] == start["block_n"]
    for entry in DEFAULT_CONFIGS:  # every built-in entry is a valid config
        bs.set_kernel_config(**sweep_config(start, entry, bs.OPS))
    bs.set_kernel_config(**start)
    assert bs.KERNEL_CONFIG == start


def test_expert_ceiling_dry_run_gives_every_product_three_ways_and_a_consistent_total(capsys):
    # benchmarks/expert_ceiling.py (a script, not a module of the package), on CPU ranks
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "expert_ceiling.py"
    spec = importlib.util.spec_from_file_location("expert_ceiling", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--device", "cpu", "--shapes", "64,32,48,4", "--reps", "1",
                        "--block-size", "16"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()
               if line.startswith("{")]
    products = {r["product"]: r for r in records}
    assert set(script.OURS) <= set(products) and len(products) == 7
    total = products["total (fwd+bwd, no activation)"]
    for who in ("dense", "bmm", "ours"):
        parts = sum(products[name][f"{who}_ms"] for name in script.OURS)
        assert abs(total[f"{who}_ms"] - parts) < 1e-3 + 1e-3 * parts
    ratio = total["dense_ms"] / total["bmm_ms"]  # (from times rounded to 0.1 us)
    assert abs(total["bmm_over_dense"] - ratio) < 0.02 * ratio


def test_layer_benchmark_dry_run_times_memory_and_variants_against_the_grouped_mm_layer(capsys):
    # `rocmoe bench moe --layer`: the whole layer (router included) against the grouped-GEMM
    # layer on the same routing; forward + backward, forward alone, peak memory, and every
    # other memory variant of the fused FFN, each as a ratio to the baseline measured in the
    # same run
    rc = bench_moe.main(["--layer", "--device", "cpu", "--shapes", "48,32,32,4,2",
                         "--routing", "zipf", "--reps", "1", "--variants", "all"])
    assert rc == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()
               if line.startswith("{")]
    by_metric = {}
    for r in records:
        by_metric.setdefault(r["metric"], []).append(r)
    for metric in ("layer_fwdbwd_vs_grouped_mm", "layer_fwd_vs_grouped_mm"):
        (r,) = by_metric[metric]
        assert "_grouped_mm" in r["baseline"] and r["routing_match"] == 1.0
        assert r["output_rel_diff_vs_baseline"] < 2e-2  # the two layers compute the same
        for suffix in ("", "_queued", "_graphs"):
            ratio = r[f"baseline_ms{suffix}"] / r[f"ours_ms{suffix}"]
            assert abs(r["ratio" + suffix] - ratio) <= 1e-3 * ratio + 1e-3
    (mem,) = by_metric["layer_peak_memory_vs_grouped_mm"]
    assert mem["ours_bytes"] > 0 and mem["baseline_bytes"] > 0
    assert abs(mem["ratio"] - mem["ours_bytes"] / mem["baseline_bytes"]) < 1e-3
    from rocmoe.bench.moe_layer import VARIANT_KEYS, VARIANTS
    variants = {tuple(r[k] for k in VARIANT_KEYS) for r in by_metric["layer_variant"]}
    default = tuple(by_metric["layer_fwdbwd_vs_grouped_mm"][0][k] for k in VARIANT_KEYS)
    assert default in VARIANTS and variants == set(VARIANTS) - {default}
    for r in by_metric["layer_variant"]:
        assert r["ours_bytes"] > 0 and r["baseline"] == mem["baseline"]
        ratio = r["baseline_ms_queued"] / r["ours_ms_queued"]
        assert abs(r["ratio_queued"] - ratio) <= 1e-3 * ratio + 1e-3


def test_router_inputs_make_the_router_pick_the_drawn_experts():
    from rocmoe.bench.draws import router_inputs
    from rocmoe.moe import Router
    torch.manual_seed(0)
    router = Router(64, 16, 2)
    for kind in ("uniform", "zipf"):
        x, drawn = router_inputs(router.weight, 2000, 2, kind, torch.Generator().manual_seed(1))
        ids, _ = router.route(x)
        assert torch.equal(ids.sort(1).values.long(), drawn.sort(1).values)
        counts = torch.bincount(ids.reshape(-1).long(), minlength=16).float()
        skew = counts[:4].sum() / counts[-4:].sum()
        assert (skew > 3) == (kind == "zipf"), (kind, skew)


def test_layer_benchmark_starts_no_case_past_its_budget_and_says_which(capsys):
    rc = bench_moe.main(["--layer", "--device", "cpu", "--shapes", "48,32,32,4,2;40,32,32,4,2",
                         "--routing", "uniform", "--reps", "1", "--variants", "none",
                         "--budget-s", "0"])
    assert rc == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()
               if line.startswith("{")]
    assert not [r for r in records if r["metric"] == "layer_fwdbwd_vs_grouped_mm"]
    (skipped,) = [r for r in records if r["metric"] == "layer_case"]
    assert [c["shape"] for c in skipped["cases"]] == [[48, 32, 32, 4, 2], [40, 32, 32, 4, 2]]
