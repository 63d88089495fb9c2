#!/bin/bash
# Final GPU check on the device machine (repo root): build librocmoe for CUDA, run the public
# rocmoe.ops functions on a GPU context at 1, 2 and 4 ranks sharing the GPU against the
# CPU references, then the MoE GPU tests (SKIP_MOE=1 leaves them out). Logs under $OUT.
set -o pipefail
source benchmarks/device_env.sh
t0=$(date +%s); stamp() { echo "=== [$(( $(date +%s) - t0 ))s] $*"; }
stamp build
build_cuda "$OUT/build.log" || exit 4
for n in 1 2 4; do
  stamp "public ops, $n ranks on the GPU"
  ROCMOE_TIMEOUT_S=20 timeout 90 mpirun -n $n --oversubscribe python3 tests/ops_gpu/public_ops_script.py fp32,bf16 > $OUT/public_ops_$n.log 2>&1; echo "exit $?"
  grep -c " OK" $OUT/public_ops_$n.log; grep -E "FAIL|Error|DONE" $OUT/public_ops_$n.log | head -8
done
if [ -z "${SKIP_MOE:-}" ]; then
stamp "moe GPU tests"
timeout 150 python3 -m pytest -q -x tests/moe/test_gpu.py 2>&1 | tee $OUT/moe_gpu.log | tail -6
fi
stamp done
