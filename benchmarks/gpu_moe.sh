#!/usr/bin/env bash
# One GPU session for the dropless MoE: GPU correctness + zero-sync tests, then the benchmark.
# Usage (repo root, on a GPU machine):  OUT=/some/dir bash benchmarks/gpu_moe.sh
# Writes moe_gpu_tests.log, moe_bench.log and moe_h200.json (JSON lines) under $OUT.
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export TRITON_DEFAULT_FP_FUSION=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.used,memory.total \
  --format=csv 2>&1 | tee "$OUT/moe_env.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" 2>&1 | tee -a "$OUT/moe_env.txt"
t0=$(date +%s)
timeout "${MOE_TEST_TIMEOUT:-150}" python3 -m pytest -q -p no:cacheprovider -o addopts="" \
  tests/moe/test_gpu.py 2>&1 | tee "$OUT/moe_gpu_tests.log"
echo "tests took $(( $(date +%s) - t0 )) s"
t1=$(date +%s)
timeout "${MOE_BENCH_TIMEOUT:-270}" python3 -m rocmoe.bench.moe ${MOE_BENCH_ARGS:---reps 7} \
  --output "$OUT/moe_h200.json" > "$OUT/moe_bench.log" 2>&1
echo "bench rc=$? took $(( $(date +%s) - t1 )) s"
# small-batch shapes again with 64-row blocks (less static padding: E*(B-1) rows)
timeout "${MOE_BENCH64_TIMEOUT:-60}" python3 -m rocmoe.bench.moe --block-size 64 --reps 7 \
  --shapes "8192,1024,4096,64;8192,4096,1408,64" --routing uniform,zipf \
  --output "$OUT/moe_h200_block64.json" >> "$OUT/moe_bench.log" 2>&1
echo "bench block64 rc=$?"
python3 - "$OUT/moe_h200.json" "$OUT/moe_h200_block64.json" <<'PY'
import json, os, sys
rows = [json.loads(l) for f in sys.argv[1:] if os.path.exists(f) for l in open(f) if l.strip()]
for r in rows:
    if r.get("metric") in ("tune", "tune_choice", "kernel_config"):
        print(r); continue
    if r.get("metric") == "kernel":
        print(f"{r['tokens']},{r['hidden']},{r['ffn']},{r['experts']} b{r['block_size']} kernel {r['kernel']:18s} {r['ms']} ms {r['useful_tflops']} TF")
        continue
    shape = f"{r.get('tokens')},{r.get('hidden')},{r.get('ffn')},{r.get('experts')}"
    extra = r.get("error") or r.get("reason") or ""
    tf = f" {r['ours_tflops']}TF vs {r['baseline_tflops']}TF" if "ours_tflops" in r else ""
    drop = f" drop={r['baseline_dropped_fraction']}" if "baseline_dropped_fraction" in r else ""
    print(f"{shape:20s} b{r.get('block_size')} {r.get('routing','')[:4]:4s} {r['metric']:34s} ratio={r.get('ratio')}"
          f" ours={r.get('ours_ms', r.get('ours_bytes'))} base={r.get('baseline_ms', r.get('baseline_bytes'))}{tf}{drop} {extra}")
PY
