#!/usr/bin/env bash
# One GPU session for vExpert scheduling (ranks share the GPU): build librocmoe for CUDA, the
# GPU tests (routing without host syncs; replicas equal static; primitives, training, bad
# input; host syncs vs the static layer and the scheduler's share), then the measured bench.
# Usage (repo root, on the GPU machine):  OUT=/some/dir bash benchmarks/gpu_vexpert.sh
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
source benchmarks/device_env.sh
t0=$(date +%s); stamp() { echo "=== [$(( $(date +%s) - t0 ))s] $*"; }
stamp build
build_cuda "$OUT/vexpert_build.log" || exit 4
stamp "GPU tests"
timeout 600 python3 -m pytest -q -p no:cacheprovider -o addopts="" -rs \
  tests/moe/test_vexpert_gpu.py 2>&1 | tee "$OUT/vexpert_gpu_tests.log" | tail -25
stamp "measured bench, 2 ranks sharing the GPU"
timeout 600 python3 -m rocmoe.bench.vexpert --part measured --device cuda \
  --output "$OUT/vexpert_h200.json" 2>&1 | tail -8
stamp done
