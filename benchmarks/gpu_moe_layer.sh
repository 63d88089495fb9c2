#!/usr/bin/env bash
# One GPU session for the whole MoE layer (issue 17): the MoE GPU tests (the Triton kernels
# equal the torch path, zero host syncs, the lean variants equal the previous layer bitwise,
# peak memory at most the grouped-GEMM layer's), then `rocmoe bench moe --layer`.
# Usage (repo root, on a GPU machine):  OUT=/some/dir bash benchmarks/gpu_moe_layer.sh
# Writes moe_layer_env.txt, moe_layer_gpu_tests.log, moe_layer_bench.log and
# moe_layer_h200.jsonl (JSON lines) under $OUT, and prints the tables at the end.
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export TRITON_DEFAULT_FP_FUSION=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.used,memory.total \
  --format=csv 2>&1 | tee "$OUT/moe_layer_env.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" 2>&1 | tee -a "$OUT/moe_layer_env.txt"
t0=$(date +%s)
timeout "${MOE_TEST_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider -o addopts="" \
  tests/moe/test_gpu.py 2>&1 | tee "$OUT/moe_layer_gpu_tests.log" | tail -25
echo "tests took $(( $(date +%s) - t0 )) s"
t1=$(date +%s)
timeout "${MOE_LAYER_BENCH_TIMEOUT:-420}" python3 -m rocmoe.bench.moe --layer \
  ${MOE_LAYER_BENCH_ARGS:-} --output "$OUT/moe_layer_h200.jsonl" > "$OUT/moe_layer_bench.log" 2>&1
echo "bench rc=$? took $(( $(date +%s) - t1 )) s"
grep '^#' "$OUT/moe_layer_bench.log" | tail -3
python3 benchmarks/moe_layer_table.py "$OUT/moe_layer_h200.jsonl"
