#!/bin/bash
# Every GPU test in one command, on a GPU machine, from the repo root:
#
#   bash tests/gpu_suite.sh [PYTEST_ARGS...]
#
# Builds librocmoe for CUDA in place (benchmarks/device_env.sh: build_cuda; ROCMOE_GPU_BUILD=skip
# keeps the build there is), then runs `pytest -m gpu` over tests/: the ipc backend, the fused
# ops' GPU kernels (gemm, gemm_grouped, embedding, gemv) and the public ops forward and backward
# at 1, 2 and 4 ranks sharing the GPU, the dropless MoE on the GPU, expert parallelism at 2 and
# 4 ranks. Exits non-zero if the build or any test fails; the log is $OUT/gpu_tests.log.
set -o pipefail
OUT=${OUT:-device_out}; mkdir -p "$OUT"
source benchmarks/device_env.sh || exit 3
if [ "${ROCMOE_GPU_BUILD:-cuda}" = cuda ]; then
  build_cuda "$OUT/build.log" || exit 4
fi
python3 -m pytest -m gpu -rs -p no:cacheprovider tests "$@" 2>&1 | tee "$OUT/gpu_tests.log"
