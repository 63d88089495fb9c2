#!/usr/bin/env bash
# One GPU command for the host-time work of issues 14 and 17 (the native launch of every
# Triton kernel, the lean handle calls, the GEMV kernel): build librocmoe for CUDA, run the
# GPU tests those changes touch, then the benchmarks against the torch ops and the
# grouped-GEMM layer. Stages run in order, each bounded by its own timeout, so one command
# fits the device's 10-minute limit; what ran is in $OUT/session.log.
#
#   OUT=/some/dir bash benchmarks/gpu_host_time.sh [STAGES]
#
# STAGES (comma list; default build,fused_tests,fused_bench,layer_bench):
#   build        librocmoe for CUDA in place (benchmarks/device_env.sh: build_cuda)
#   fused_tests  pytest -m gpu on the fused handles: native launch, lean calls, graphs,
#                no syncs, bad input (tests/ops_gpu/test_fused*_gpu.py)
#   moe_tests    pytest -m gpu tests/moe/test_gpu.py (the layer's kernels, syncs, memory)
#   ep_tests     pytest -m gpu on expert parallelism (tests/moe/test_expert_parallel_gpu.py)
#   vexpert_tests  pytest -m gpu tests/moe/test_vexpert_gpu.py
#   fused_script tests/ops_gpu/fused_gpu_script.py $SCRIPT_OPS (default embedding) at each of
#                $SCRIPT_RANKS ranks (default 1,2), dtypes $SCRIPT_DTYPES (default fp32,bf16):
#                a few checks without the pytest stage's whole-suite jobs
#   ipc_tests    pytest -m gpu tests/gpu (the ipc backend: heap, signals, puts between ranks)
#   (each test stage takes a -k expression from $FUSED_TESTS_K, $MOE_TESTS_K, $EP_TESTS_K,
#   $VEXPERT_TESTS_K, $IPC_TESTS_K, and a timeout in seconds from $..._S)
#   fused_bench  rocmoe bench fused_gpu --only gemm,gemv,embedding,overlap
#   vexpert_bench  rocmoe bench vexpert --part measured on the GPU (2 ranks sharing it,
#                $VEXPERT_ARGS, default the GPU-sized layer), to vexpert.json
#   layer_bench  rocmoe bench moe --layer on $LAYER_SHAPES (default: the losing shapes;
#                all: the bench's 24 cases)
#   profile      benchmarks/profile_moe_host.py on 8192,1024,4096,64 (host functions)
#   probe        benchmarks/probe_layer_host.py on $PROBE_SHAPES (host us a step, by stage)
#   idle_probe   benchmarks/probe_idle_gap.py (idle-start time against host + kernel, traced)
#   emb_probe    benchmarks/probe_embedding_host.py (the batched embedding call's host time,
#                layer by layer)
#   gemv         benchmarks/gemv_variants.py (the GEMV kernel's variants against torch.mv)
#   gemv_ab      the GEMV's balanced split against its row split: gemv_variants.py
#                --variants default,balance on the bf16 shapes (the edge shapes checked
#                first; $GEMV_AB_ARGS adds or overrides), then benchmarks/probe_gemv_address.py
#                (W moved between addresses in one process) with the row split and with
#                ROCMOE_GEMV_BALANCE=1
# Files under $OUT (at most eight come back): session.log, build.log, fused.jsonl,
# layer.jsonl, gemv.jsonl (gemv and gemv_ab), vexpert.json, probe_embedding_host.json,
# gemv_address.jsonl. Exits 1 when a stage failed (after running the others), 4 when the
# build failed.
set -u
OUT=${OUT:-device_out}; mkdir -p "$OUT"
STAGES=${1:-build,fused_tests,fused_bench,layer_bench}
source benchmarks/device_env.sh || exit 3
export TRITON_DEFAULT_FP_FUSION=1
LOG="$OUT/session.log"
has() { [[ ",$STAGES," == *",$1,"* ]]; }
t0=$(date +%s); stamp() { echo "=== [$(( $(date +%s) - t0 ))s] $*" | tee -a "$LOG"; }
failed=0
run() {
  "$@" 2>&1 | tee -a "$LOG" | tail -${TAIL:-15}
  local rc=${PIPESTATUS[0]}
  echo "rc=$rc" | tee -a "$LOG"
  [ "$rc" = 0 ] || failed=1
}
set -o pipefail
stamp "stages $STAGES"
if has build; then
  stamp build
  build_cuda "$OUT/build.log" || exit 4
  python3 -c "import rocmoe._native as n, torch, triton; print('platform', n.gpu_platform(), torch.__version__, triton.__version__, torch.cuda.get_device_name())" 2>&1 | tee -a "$LOG"
fi
PYTEST="python3 -m pytest -m gpu -rs -q -p no:cacheprovider"
if has fused_tests; then
  stamp fused_tests
  run timeout ${FUSED_TESTS_S:-240} $PYTEST tests/ops_gpu/test_fused_gpu.py \
    tests/ops_gpu/test_fused_launch_and_failures_gpu.py \
    -k "${FUSED_TESTS_K:-native or lean or graph or sync or bad}"
fi
if has fused_script; then
  # (device_env.sh exported the MPI-as-root settings and PYTHONPATH)
  ranks=${SCRIPT_RANKS:-1,2}
  for n in ${ranks//,/ }; do
    stamp "fused_script at $n ranks"
    run timeout ${SCRIPT_S:-200} mpiexec -n "$n" --oversubscribe python3 \
      tests/ops_gpu/fused_gpu_script.py "${SCRIPT_OPS:-embedding}" --dtype "${SCRIPT_DTYPES:-fp32,bf16}"
  done
fi
if has moe_tests; then
  stamp moe_tests
  run timeout ${MOE_TESTS_S:-330} $PYTEST tests/moe/test_gpu.py -k "${MOE_TESTS_K:-}"
fi
if has ep_tests; then
  stamp ep_tests
  run timeout ${EP_TESTS_S:-200} $PYTEST tests/moe/test_expert_parallel_gpu.py -k "${EP_TESTS_K:-}"
fi
if has vexpert_tests; then
  stamp vexpert_tests
  run timeout ${VEXPERT_TESTS_S:-200} $PYTEST tests/moe/test_vexpert_gpu.py -k "${VEXPERT_TESTS_K:-}"
fi
if has fused_bench; then
  stamp fused_bench
  TAIL=40 run timeout ${FUSED_BENCH_S:-200} python3 -m rocmoe.bench.fused_gpu \
    --only ${FUSED_ONLY:-gemm,gemv,embedding,overlap} --reps ${FUSED_REPS:-9} --output "$OUT/fused.jsonl"
  python3 benchmarks/fused_table.py "$OUT/fused.jsonl" 2>&1 | tee -a "$LOG" | tail -30
fi
if has ipc_tests; then
  stamp ipc_tests
  run timeout ${IPC_TESTS_S:-200} $PYTEST tests/gpu -k "${IPC_TESTS_K:-}"
fi
if has vexpert_bench; then
  stamp vexpert_bench
  run timeout ${VEXPERT_BENCH_S:-240} python3 -m rocmoe.bench.vexpert --part measured --device cuda \
    ${VEXPERT_ARGS:---hidden 1024 --ffn 4096 --tokens 8192} --output "$OUT/vexpert.json"
fi
if has layer_bench; then
  stamp layer_bench
  shapes=${LAYER_SHAPES:-8192,1024,4096,64;32768,768,3072,64;4096,2048,1408,64}
  # LAYER_SHAPES=all: the bench's 24 default cases (12 shapes, uniform and Zipf)
  [ "$shapes" = all ] && shape_args=() || shape_args=(--shapes "$shapes")
  run timeout ${LAYER_BENCH_S:-200} python3 -m rocmoe.bench.moe --layer --variants none \
    ${shape_args[@]+"${shape_args[@]}"} --budget-s ${LAYER_BUDGET_S:-150} --output "$OUT/layer.jsonl"
  python3 benchmarks/moe_layer_table.py "$OUT/layer.jsonl" 2>&1 | tee -a "$LOG" | tail -30
fi
if has profile; then
  stamp profile
  TAIL=60 run timeout 120 python3 benchmarks/profile_moe_host.py 8192,1024,4096,64
fi
if has probe; then
  stamp probe
  for shape in ${PROBE_SHAPES:-8192,1024,4096,64 4096,2048,1408,64}; do
    TAIL=5 run timeout 120 python3 benchmarks/probe_layer_host.py "$shape"
  done
fi
if has idle_probe; then
  stamp idle_probe
  TAIL=40 run timeout ${IDLE_PROBE_S:-180} python3 benchmarks/probe_idle_gap.py
fi
if has emb_probe; then
  stamp emb_probe
  TAIL=40 run timeout ${EMB_PROBE_S:-120} python3 benchmarks/probe_embedding_host.py
fi
if has gemv; then
  stamp gemv
  TAIL=40 run timeout ${GEMV_S:-200} python3 benchmarks/gemv_variants.py --out "$OUT/gemv.jsonl"
fi
if has gemv_ab; then
  stamp gemv_ab
  TAIL=30 run timeout ${GEMV_AB_S:-300} python3 benchmarks/gemv_variants.py \
    --variants default,balance --shapes 16384x16384,28672x8192,8192x8192,8192x28672 \
    --dtypes bf16 ${GEMV_AB_ARGS:-} --out "$OUT/gemv.jsonl"
  for balance in 0 1; do
    TAIL=3 run env ROCMOE_GEMV_BALANCE=$balance timeout ${GEMV_ADDRESS_S:-150} \
      python3 benchmarks/probe_gemv_address.py >> "$OUT/gemv_address.jsonl"
  done
fi
stamp "done (failed=$failed)"
exit $failed
