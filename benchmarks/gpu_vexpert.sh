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
# A GPU-sized layer by default: at the host bench's size (hidden 256, FFN 1024, 1024 tokens
# a rank) the H200 computes an expert's rows in less time than the transport's profiled
# latency, so the policy rightly moves nothing (2026-12-01: 0.92 x, no change). Ranks that
# share one GPU also share its compute: balancing them cannot shorten the step much, so the
# step-time goal (>= 1.3 x under skew) needs one GPU per rank; the cost-model error and the
# scheduler share are meaningful here.
timeout 600 python3 -m rocmoe.bench.vexpert --part measured --device cuda \
  ${VEXPERT_ARGS:---hidden 1024 --ffn 4096 --tokens 8192} \
  --output "$OUT/vexpert_h200.json" 2>&1 | tail -8
stamp done
