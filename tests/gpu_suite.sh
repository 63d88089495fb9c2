#!/bin/bash
# Every GPU test, on a GPU machine, from the repo root:
#
#   bash tests/gpu_suite.sh [PYTEST_ARGS...]              # all of them (about 26 min)
#   GPU_SUITE_PART=1 bash tests/gpu_suite.sh              # the ipc backend, expert parallelism,
#                                                          #   vExpert (about 6 min)
#   GPU_SUITE_PART=2 bash tests/gpu_suite.sh              # the MoE layer (about 5 min)
#   GPU_SUITE_PART=3 bash tests/gpu_suite.sh              # the fused ops' handles against
#                                                          #   the references, split-K and
#                                                          #   graph replays (about 5 min)
#   GPU_SUITE_PART=4 bash tests/gpu_suite.sh              # the public ops forward and
#                                                          #   backward (about 3 min)
#   GPU_SUITE_PART=5 bash tests/gpu_suite.sh              # the fused ops' native and lean
#                                                          #   launches, the GEMM function's
#                                                          #   exact-rows outputs, no-sync,
#                                                          #   failure paths, grouped_local's
#                                                          #   native launches, pack_lookups
#                                                          #   (about 4 min)
#   GPU_SUITE_PART=6 bash tests/gpu_suite.sh              # the nvshmem facade at one PE:
#                                                          #   builds librocmoe with
#                                                          #   -DROCMOE_SHMEM=nvshmem too
#                                                          #   (about 4 min)
#
# The parts exist because a device command may run for 10 minutes at most: run the six
# parts as six commands; each prints its own pytest summary line. (Two parts were too few:
# on 2026-12-02 the second took 527 s of pytest, 561 s with the build, close to the limit;
# on 2026-12-04 the fused ops' part, then 19 tests, took 451 s, and its last test did not
# finish inside a 470 s limit: the public ops became a part of their own; in the nineteenth
# session that part's 16 tests took 482 s, so it is two parts, of two files, now.)
# Builds librocmoe for CUDA in place (benchmarks/device_env.sh: build_cuda; ROCMOE_GPU_BUILD=skip
# keeps the build there is), then runs `pytest -m gpu`: the ipc backend, the fused ops' GPU
# kernels (gemm, gemm_grouped, embedding, gemv) and the public ops forward and backward at 1,
# 2 and 4 ranks sharing the GPU, the dropless MoE on the GPU, expert parallelism at 2 and 4
# ranks, vExpert. Exits non-zero if the build or any test fails; the log is
# $OUT/gpu_tests[_partN].log.
set -o pipefail
OUT=${OUT:-device_out}; mkdir -p "$OUT"
case "${GPU_SUITE_PART:-all}" in
  all) FILES=(tests); LOG=gpu_tests.log ;;
  1) FILES=(tests/gpu/test_ipc.py tests/moe/test_expert_parallel_gpu.py tests/moe/test_vexpert_gpu.py)
     LOG=gpu_tests_part1.log ;;
  2) FILES=(tests/moe/test_gpu.py); LOG=gpu_tests_part2.log ;;
  3) FILES=(tests/ops_gpu/test_fused_gpu.py); LOG=gpu_tests_part3.log ;;
  4) FILES=(tests/ops_gpu/test_public_ops_gpu.py); LOG=gpu_tests_part4.log ;;
  5) FILES=(tests/ops_gpu/test_fused_launch_and_failures_gpu.py tests/ops_gpu/test_grouped_local_gpu.py
             tests/ops_gpu/test_pack_lookups_gpu.py)
     LOG=gpu_tests_part5.log ;;
  6) FILES=(tests/gpu/test_nvshmem.py); LOG=gpu_tests_part6.log ;;
  *) echo "GPU_SUITE_PART must be 1 to 6 or unset (all), got '$GPU_SUITE_PART'" >&2
     exit 2 ;;
esac
source benchmarks/device_env.sh || exit 3
if [ "${ROCMOE_GPU_BUILD:-cuda}" = cuda ]; then
  build_cuda "$OUT/build.log" || exit 4
fi
# the nvshmem facade's own build, staged beside the package (tests/gpu/test_nvshmem.py runs it)
case "${GPU_SUITE_PART:-all}" in
  all|6) build_nvshmem "$OUT/build_nvshmem.log" || exit 5 ;;
esac
python3 -m pytest -m gpu -rs -p no:cacheprovider "${FILES[@]}" "$@" 2>&1 | tee "$OUT/$LOG"
