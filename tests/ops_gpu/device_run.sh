#!/bin/bash
# One device-machine job for the GPU path of the fused ops: build librocmoe for CUDA, check
# every op at 1 rank, benchmark on one GPU, then the multi-rank checks (ranks share the GPU).
# Usage (on the device machine, repo root): bash tests/ops_gpu/device_run.sh STAGES
#   STAGES: comma list of build,check1,bench,multi,pytest (default: all)
# Logs and JSON go to $OUT (or ./device_out). Exits 1 if any check failed (the bench is a
# measurement, not a check). Every check here is also a pytest GPU test: tests/gpu_suite.sh.
set -o pipefail
failed=0
# `expect NAME STATUS`: a check's outcome; a failed one is named and fails the whole run
expect() { if [ "$2" -ne 0 ]; then echo "FAILED: $1 (exit $2)"; failed=1; fi; }
OUT=${OUT:-device_out}; mkdir -p "$OUT"
STAGES=${1:-build,check1,bench,multi}
source benchmarks/device_env.sh
has() { [[ ",$STAGES," == *",$1,"* ]]; }
t0=$(date +%s); stamp() { echo "=== [$(( $(date +%s) - t0 ))s] $*"; }
if has build; then
  stamp build
  nvidia-smi -L
  build_cuda "$OUT/build.log" || exit 4
  python3 -c "import rocmoe._native as n; print('platform', n.gpu_platform(), n.backends_compiled())"
fi
if has check1; then
  stamp "check: 1 rank, every op and dtype"
  ROCMOE_TIMEOUT_S=10 timeout 60 mpirun -n 1 --oversubscribe python3 tests/ops_gpu/fused_gpu_script.py \
    gemm,gemm_grouped,rows,embedding,gemv --calls 3 --dtype fp32,bf16,fp16 > "$OUT/check1.log" 2>&1
  expect "check1" $?
  grep -E "RANK .* (OK|FAIL)|Error" "$OUT/check1.log" | head -20
fi
if has bench; then
  stamp bench
  timeout ${BENCH_TIMEOUT:-70} python3 -m rocmoe.bench.fused_gpu ${BENCH_ARGS:-} --output "$OUT/fused_h200.json" 2>&1 | tee "$OUT/bench.log" | tail -40
fi
if has multi; then
  for n in 2 4; do
    stamp "check: $n ranks on one GPU"
    ROCMOE_TIMEOUT_S=15 timeout 60 mpirun -n $n --oversubscribe python3 tests/ops_gpu/fused_gpu_script.py \
      gemm,gemm_grouped,rows,embedding,gemv --calls 3 --dtype fp32,bf16 > "$OUT/multi_${n}.log" 2>&1
    expect "multi $n ranks" $?
    grep -E "RANK .* (OK|FAIL)|Error" "$OUT/multi_${n}.log" | sort | uniq -c | head -20
  done
  stamp "timeout check"
  ROCMOE_TIMEOUT_S=3 timeout 25 mpirun -n 2 --oversubscribe python3 tests/ops_gpu/fused_gpu_script.py \
    gemm_timeout > "$OUT/timeout_check.log" 2>&1
  expect "timeout check" $?
  grep -q "RANK 0 TIMEOUT" "$OUT/timeout_check.log"
  expect "timeout check: rank 0 reported the timeout" $?
  grep -E "RANK|Error" "$OUT/timeout_check.log" | head -5
fi
if has pytest; then
  stamp pytest
  timeout 500 python3 -m pytest -q -rs tests/ops_gpu > "$OUT/pytest.log" 2>&1
  expect pytest $?
  tail -20 "$OUT/pytest.log"
fi
stamp done
exit $failed
