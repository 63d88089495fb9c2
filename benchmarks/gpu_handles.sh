#!/usr/bin/env bash
# One GPU session for the fused-op handles (issue 14): build librocmoe for CUDA, check every
# handle's device kernels at 1 and 2 ranks (ranks share the GPU), CUDA-graph replay, the
# failure cases, then the benchmark against the torch ops.
# Usage (repo root, on a GPU machine): OUT=/some/dir bash benchmarks/gpu_handles.sh [STAGES]
#   STAGES: comma list of build,check,graph,fail,drift,bench (default: all)
set -u
OUT=${OUT:-device_out}; mkdir -p "$OUT"
STAGES=${1:-build,check,graph,fail,drift,bench}
source benchmarks/device_env.sh
export TRITON_DEFAULT_FP_FUSION=1
has() { [[ ",$STAGES," == *",$1,"* ]]; }
t0=$(date +%s); stamp() { echo "=== [$(( $(date +%s) - t0 ))s] $*"; }
SCRIPT=tests/ops_gpu/fused_gpu_script.py
if has build; then
  stamp build
  build_cuda "$OUT/build.log" || exit 4
  python3 -c "import rocmoe._native as n, torch, triton; print('platform', n.gpu_platform(), n.backends_compiled(), torch.__version__, triton.__version__, torch.cuda.get_device_name())"
fi
if has check; then
  for n in 1 2; do
    stamp "check: $n rank(s)"
    ROCMOE_TIMEOUT_S=20 timeout 400 mpirun -n $n --oversubscribe python3 $SCRIPT \
      gemm,gemm_grouped,rows,embedding,gemv,nosync --calls 3 --dtype fp32,bf16 > "$OUT/check_$n.log" 2>&1
    echo "rc=$?"; grep -E "RANK .* (OK|FAIL)|Error" "$OUT/check_$n.log" | sort | uniq -c | head -24
  done
fi
if has graph; then
  stamp "graph: 1 and 2 ranks"
  for n in 1 2; do
    ROCMOE_TIMEOUT_S=20 timeout 90 mpirun -n $n --oversubscribe python3 $SCRIPT graph \
      --dtype bf16 > "$OUT/graph_$n.log" 2>&1
    echo "rc=$?"; grep -E "RANK .* (OK|FAIL)|Error" "$OUT/graph_$n.log" | head -8
  done
fi
if has fail; then
  stamp "failure cases: 2 ranks"
  ROCMOE_TIMEOUT_S=10 timeout 90 mpirun -n 2 --oversubscribe python3 $SCRIPT \
    bad_counts,abort,gemv_mismatch --dtype bf16 > "$OUT/fail.log" 2>&1
  echo "rc=$?"; grep -E "RANK .* (OK|FAIL|REJECTED)|Error" "$OUT/fail.log" | cut -c1-200 | head -12
  ROCMOE_TIMEOUT_S=3 timeout 60 mpirun -n 2 --oversubscribe python3 $SCRIPT gemm_timeout \
    --dtype bf16 > "$OUT/timeout.log" 2>&1
  echo "rc=$?"; grep -E "TIMEOUT|FAIL" "$OUT/timeout.log" | cut -c1-200 | head -4
fi
if has drift; then
  # rank 0 reaches each handle's first call 2 x ROCMOE_TIMEOUT_S late: it must complete
  # (ROCMOE_FIRST_CALL_TIMEOUT_S); with that at 0 the GEMM's first call must time out.
  # Each output line is stamped with the seconds since the job started.
  for first in 300 0; do
    stamp "drift: 2 ranks, ROCMOE_FIRST_CALL_TIMEOUT_S=$first"
    s=$(date +%s)
    ROCMOE_TIMEOUT_S=3 ROCMOE_FIRST_CALL_TIMEOUT_S=$first timeout 240 mpirun -n 2 \
      --oversubscribe python3 $SCRIPT first_call_drift --dtype bf16,fp32 2>&1 |
      while IFS= read -r l; do echo "[$(( $(date +%s) - s ))s] $l"; done > "$OUT/drift_$first.log"
    echo "rc=${PIPESTATUS[0]} after $(( $(date +%s) - s )) s"
    grep -E "RANK .* (OK|FAIL)|Error" "$OUT/drift_$first.log" | cut -c1-220 | head -8
  done
fi
if has bench; then
  stamp bench
  timeout ${BENCH_TIMEOUT:-330} python3 -m rocmoe.bench.fused_gpu ${BENCH_ARGS:-} \
    --output "$OUT/fused_gpu_h200.jsonl" > "$OUT/bench.log" 2>&1
  echo "bench rc=$?"; tail -3 "$OUT/bench.log"
  python3 benchmarks/fused_table.py "$OUT/fused_gpu_h200.jsonl"
fi
stamp done
