#!/bin/bash
# One GPU session of tuning sweeps (repo root, on a GPU machine):
#   OUT=/some/dir bash benchmarks/gpu_sweep.sh [STAGES]
# STAGES (comma list, default all): build, check (GEMV correctness at 1 and 2 ranks after
# the one-launch epilogue), gemv (benchmarks/gemv_variants.py: the kernel's variants),
# gemm (GEMM+A2A tiles and grid size), moe (block-sparse kernels per tile config, both
# activation fusions, compiled IR dumped to $OUT/moe_ir.tar.gz); and the reported runs:
# moetest (tests/moe/test_gpu.py), ep (expert-parallel layer at 2 and 4 ranks sharing the
# GPU, fused gemm_all_to_all combine and all-to-all, vs the one-rank layer), fused (rocmoe
# bench fused_gpu -> $OUT/fused_h200.json), moebench (rocmoe bench moe, all six shapes -> $OUT/moe_h200.json).
# Everything prints JSON lines; every record carries the baseline measured in the same run.
# Exits 1 if a check stage (check, moetest, ep) failed; tests/gpu_suite.sh runs every check.
set -o pipefail
failed=0
expect() { if [ "$2" -ne 0 ]; then echo "FAILED: $1 (exit $2)"; failed=1; fi; }
OUT=${OUT:-device_out}; mkdir -p "$OUT"
STAGES=${1:-build,check,gemv,gemm,moe}
source benchmarks/device_env.sh
export TRITON_DEFAULT_FP_FUSION=1
has() { [[ ",$STAGES," == *",$1,"* ]]; }
t0=$(date +%s); stamp() { echo "=== [$(( $(date +%s) - t0 ))s] $*"; }
if has build; then
  stamp build
  build_cuda "$OUT/build.log" || exit 4
fi
if has check; then
  stamp "check: the fused ops at 1, 2 and 4 ranks (ranks share the GPU), then a timeout"
  for n in 1 2 4; do
    ROCMOE_TIMEOUT_S=10 timeout 90 mpirun -n $n --oversubscribe python3 tests/ops_gpu/fused_gpu_script.py \
      gemv,embedding,gemm,gemm_grouped,rows --calls 4 --dtype fp32,bf16,fp16 > "$OUT/check_$n.log" 2>&1
    rc=$?
    expect "check at $n ranks" $rc
    echo "ranks=$n rc=$rc $(grep -cE 'RANK .* OK' "$OUT/check_$n.log") OK lines," \
      "$(grep -cE 'FAIL|Error' "$OUT/check_$n.log") failure lines"
  done
  ROCMOE_TIMEOUT_S=3 timeout 30 mpirun -n 2 --oversubscribe python3 tests/ops_gpu/fused_gpu_script.py \
    gemm_timeout > "$OUT/timeout_check.log" 2>&1
  expect "timeout check" $?
  grep -q "RANK 0 TIMEOUT" "$OUT/timeout_check.log"
  expect "timeout check: rank 0 reported the timeout" $?
  grep -E "RANK|Error" "$OUT/timeout_check.log" | head -4
fi
if has gemv; then
  # the GEMV kernel's variants (rows a wave, cp.async stages or register loads, the
  # protocol kernel at world size 1, the kernel as it was) against torch.mv
  stamp "gemv sweep"
  timeout 200 python3 benchmarks/gemv_variants.py --out "$OUT/gemv_variants.jsonl" 2>&1 |
    tail -40
fi
if has gemm; then
  stamp "gemm sweep"
  CFGS='[{"BLOCK_M":128,"BLOCK_N":256,"BLOCK_K":64,"GROUP_M":8,"num_warps":8,"num_stages":3},
{"BLOCK_M":128,"BLOCK_N":256,"BLOCK_K":64,"GROUP_M":8,"num_warps":8,"num_stages":3,"PROGRAMS_PER_SM":0},
{"BLOCK_M":128,"BLOCK_N":256,"BLOCK_K":64,"GROUP_M":8,"num_warps":8,"num_stages":4},
{"BLOCK_M":128,"BLOCK_N":256,"BLOCK_K":64,"GROUP_M":16,"num_warps":8,"num_stages":4,"PROGRAMS_PER_SM":0},
{"BLOCK_M":256,"BLOCK_N":128,"BLOCK_K":64,"GROUP_M":8,"num_warps":8,"num_stages":3},
{"BLOCK_M":128,"BLOCK_N":128,"BLOCK_K":64,"GROUP_M":8,"num_warps":4,"num_stages":4,"PROGRAMS_PER_SM":2},
{"BLOCK_M":128,"BLOCK_N":128,"BLOCK_K":64,"GROUP_M":8,"num_warps":8,"num_stages":3,"PROGRAMS_PER_SM":0},
{"BLOCK_M":128,"BLOCK_N":128,"BLOCK_K":64,"GROUP_M":8,"num_warps":4,"num_stages":4,"PROGRAMS_PER_SM":0}]'
  timeout 200 python3 -m rocmoe.bench.fused_gpu --only gemm --gemm-configs "$CFGS" \
    --output "$OUT/gemm_sweep.json" 2>&1 | tee "$OUT/gemm_sweep.log" | python3 -c "
import json,sys
for l in sys.stdin:
    try: d=json.loads(l)
    except Exception: print(l.rstrip()); continue
    if d.get('bench')=='gemm_a2a_candidate': print(d['m'],json.dumps(d['config']),'op_ratio',round(d['op_ratio'],3),round(d['op_tflops']))
    elif d.get('bench')=='gemm_a2a': print('BEST',d['m'],d['config'],'ratio',round(d['ratio'],3),'ovh',round(d['overhead'],3),'mm TF',round(d['baseline_tflops']))
    else: print(str(d)[:300])"
fi
if has moe; then
  stamp "moe kernel sweep"
  timeout ${MOE_SWEEP_TIMEOUT:-240} python3 -m rocmoe.bench.moe_kernels --dump /tmp/moe_ir \
    --output "$OUT/moe_kernels.jsonl" ${MOE_SWEEP_ARGS:-} 2>&1 | python3 -c "
import json,sys
for l in sys.stdin:
    try: d=json.loads(l)
    except Exception: print(l.rstrip()); continue
    c=d.get('config',{})
    if 'kernel' in d: print(d['shape'][:3],c.get('block_n'),c.get('block_k'),c.get('num_warps'),c.get('num_stages'),'tma' if c.get('tma') else 'ptr','%-22s'%d['kernel'],d['tflops'],'/',d['baseline_tflops'])
    else: print(str(d)[:300])"
  tar czf "$OUT/moe_ir.tar.gz" -C /tmp moe_ir 2>/dev/null
fi
if has moetest; then
  stamp "moe GPU tests"
  timeout 240 python3 -m pytest -q -rs -p no:cacheprovider -o addopts="" tests/moe/test_gpu.py \
    tests/ops_gpu/test_fused_gpu.py tests/ops_gpu/test_fused_launch_and_failures_gpu.py \
    > "$OUT/gpu_tests.log" 2>&1
  expect "moe GPU tests" $?
  tail -5 "$OUT/gpu_tests.log"
fi
if has ep; then
  stamp "expert-parallel DroplessMoE at 2 and 4 ranks sharing the GPU (ipc heap) vs one rank"
  for v in "2 --dtype float32" "2 --dtype float32 --combine all_to_all" "2 --dtype float64" \
           "4 --dtype float32 --glu --top-k 3 --block-size 32" \
           "4 --dtype float32 --experts 16 --tokens 1 --top-k 1"; do
    set -- $v; n=$1; shift
    ROCMOE_TIMEOUT_S=20 timeout 150 mpirun -n $n --oversubscribe python3 tests/moe/ep_script.py \
      --ctx runtime --device cuda "$@" > "$OUT/ep.log" 2>&1
    rc=$?
    expect "ep at $n ranks $*" $rc
    [ "$(grep -c EP_OK "$OUT/ep.log")" -eq "$n" ]
    expect "ep at $n ranks $*: every rank printed EP_OK" $?
    { echo "ranks=$n $* rc=$rc $(grep -c EP_OK "$OUT/ep.log") EP_OK," \
        "$(grep -o 'combine=[a-z_]*' "$OUT/ep.log" | sort | uniq -c | tr -s ' ')," \
        "$(grep -o 'max_err=[0-9.e+-]*' "$OUT/ep.log" | sort | tail -1)"
      grep -E "EP_FAIL|Error" "$OUT/ep.log" | head -3; } | tee -a "$OUT/ep_checks.log"
  done
fi
if has fused; then
  stamp "fused ops benchmark"
  timeout 150 python3 -m rocmoe.bench.fused_gpu --output "$OUT/fused_h200.json" 2>&1 | python3 -c "
import json,sys
for l in sys.stdin:
    try: d=json.loads(l)
    except Exception: print(l.rstrip()); continue
    keep=('bench','dtype','m','ratio','op_ratio','overhead','ms','signal_off_ms','torch_matvec_ms','kernel_tflops','baseline_tflops','op_tflops','error')
    print({k: (round(v,4) if isinstance(v,float) else v) for k,v in d.items() if k in keep})"
fi
if has moebench; then
  stamp "moe benchmark"
  timeout ${MOE_BENCH_TIMEOUT:-300} python3 -m rocmoe.bench.moe --reps 7 ${MOE_BENCH_ARGS:-} \
    --output "$OUT/moe_h200.json" 2>&1 | python3 -c "
import json,sys
for l in sys.stdin:
    try: r=json.loads(l)
    except Exception: print(l.rstrip()); continue
    if r.get('metric') == 'kernel':
        print(r['tokens'],r['hidden'],r['ffn'],r['experts'],'kernel',r['kernel'],r['ms'],'ms',r['useful_tflops'],'TF'); continue
    if 'ratio' in r:
        print(r.get('tokens'),r.get('hidden'),r.get('ffn'),r.get('experts'),r.get('routing','')[:4],r['metric'],'ratio',r['ratio'],'ours',r.get('ours_ms'),'base',r.get('baseline_ms'))
    else: print(str(r)[:200])"
fi
stamp done
exit $failed
