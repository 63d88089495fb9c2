#!/usr/bin/env bash
# Issue 5 on one node of several GPUs, one rank per GPU: fused ops vs torch + NCCL, and the
# expert-parallel DroplessMoE step (rocmoe heap transport vs torch all_to_all_single), for the
# ipc backend and the nvshmem backend.
#
#   OUT=/some/dir RANKS=2 bash benchmarks/gpu_multi.sh        (repo root, on the GPU machine)
#
# Builds librocmoe twice, at the same time, with benchmarks/device_env.sh's functions: ipc
# (build_cuda: build/cuda, in place) and nvshmem (stage_nvshmem: build/nvshmem, staged as a
# copy of the package in /tmp/nvpkg). Then
# four time-boxed runs; each appends its JSON lines to $OUT/multi_gpu.jsonl as they come, so
# a stage that fails or runs out of time loses only itself. DEADLINE_S (default 400) bounds
# the whole script; BACKENDS (default "ipc nvshmem") picks the backends, FUSED_BOX_S and
# MOE_BOX_S (default 90 and 80) the seconds each fused-op and MoE stage may take, DTYPES
# (default float32) the fused ops' dtypes, MOE_OPS (default moe) the MoE comparisons. The
# cffi + pycparser wheels come from .whl/ (carried; not on the machine).
set -u -o pipefail
OUT=${OUT:-device_out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
RANKS=${RANKS:-2}
DEADLINE_S=${DEADLINE_S:-400}
BACKENDS=${BACKENDS:-ipc nvshmem}
FUSED_BOX_S=${FUSED_BOX_S:-90}
MOE_BOX_S=${MOE_BOX_S:-80}
DTYPES=${DTYPES:-float32}
MOE_OPS=${MOE_OPS:-moe}
want_backend() { [[ " $BACKENDS " == *" $1 "* ]]; }
REPO=$(pwd)
# the MPI-as-root settings, no NVLink multicast, cffi from .whl/, the build functions
source benchmarks/device_env.sh || exit 3
JSONL="$OUT/multi_gpu.jsonl"
: > "$JSONL"
t0=$(date +%s)
elapsed() { echo $(( $(date +%s) - t0 )); }
stamp() { echo "=== [$(elapsed)s] $*"; }

SITE=${PYTHONPATH:-}

{
  nvidia-smi -L
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.used --format=csv
  nvidia-smi topo -m
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count(), 'nccl', torch.cuda.nccl.version() if torch.cuda.is_available() else None)"
  env | grep -E '^(NCCL_NVLS_ENABLE|NVSHMEM_DISABLE_NVLS|TORCH_SYMM_MEM_DISABLE_MULTICAST)='
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

if [[ -z ${SKIP_BUILD:-} ]]; then
  stamp "build: ipc and nvshmem, concurrently"
  # (exported, so that `timeout` can run them in a child bash without sourcing again)
  export -f build_cuda stage_nvshmem
  timeout 300 bash -c 'build_cuda "$1"' _ "$OUT/build_ipc.log" >/dev/null &
  pid_ipc=$!
  if want_backend nvshmem; then
    timeout 300 bash -c 'stage_nvshmem "$1"' _ "$OUT/build_nvshmem.log" >/dev/null &
  else
    ( exit 9 ) &  # not wanted: a finished stand-in for the build
  fi
  pid_nv=$!
  wait $pid_ipc; ipc_ok=$?
else  # SKIP_BUILD=1: use the modules already in ./rocmoe (a CPU dry run of this script)
  ipc_ok=0
  ( exit 9 ) & pid_nv=$!
fi
stamp "ipc build rc=$ipc_ok"
[[ $ipc_ok != 0 ]] && tail -30 "$OUT/build_ipc.log"
# let the nvshmem build finish before timing (its compilers would share the CPUs with the
# ranks' launches), but never wait more than a minute for it
for _ in $(seq 60); do kill -0 $pid_nv 2>/dev/null || break; sleep 1; done
kill -0 $pid_nv 2>/dev/null && stamp "nvshmem build still running: the ipc runs overlap it"

LAUNCH=(mpirun -n "$RANKS")
command -v mpirun >/dev/null || LAUNCH=(mpiexec -n "$RANKS")
# Open MPI: allow more ranks than slots, and leave threads unbound (it pins 2 ranks to cores)
"${LAUNCH[0]}" --version 2>&1 | grep -q "Open MPI" && LAUNCH+=(--oversubscribe --bind-to none)

# run LABEL SECONDS PACKAGE_DIR ARGS...: one mpirun, time-boxed; JSON lines -> $JSONL
run() {
  local label=$1 want=$2 pkg=$3; shift 3
  local left=$(( DEADLINE_S - $(elapsed) - 5 ))
  local box=$(( want < left ? want : left ))
  if (( box < 25 )); then
    stamp "$label: skipped, ${left}s left"
    echo "{\"bench\": \"multi_gpu\", \"stage\": \"$label\", \"skipped\": \"device time box spent\"}" >> "$JSONL"
    return
  fi
  stamp "$label (box ${box}s)"
  # the Python budget stops new cases early enough for the summary to print
  ( cd "$pkg" && PYTHONPATH="$pkg${SITE:+:$SITE}" timeout -k 5 "$box" \
      "${LAUNCH[@]}" python3 -m rocmoe.bench.multi_gpu \
      --time-budget-s $(( box * 2 / 3 )) --output "$JSONL" "$@" ${BENCH_EXTRA:-} ) > "$OUT/$label.log" 2>&1
  local rc=$?
  stamp "$label rc=$rc"
  grep -v '^{' "$OUT/$label.log" | grep -vE 'Warning|warn\(' | tail -n 14
}

COMMON=(--reps 5 --iters 10 --warmup 2)
if ! want_backend ipc; then
  stamp "ipc: not in BACKENDS"
elif [[ $ipc_ok == 0 ]]; then
  run ipc_fused "$FUSED_BOX_S" "$REPO" --backend ipc --heap 8G --ops embedding,gemv,gemm \
    --dtype "${DTYPES// /,}" "${COMMON[@]}"
  run ipc_moe "$MOE_BOX_S" "$REPO" --backend ipc --heap 4G --ops "$MOE_OPS" "${COMMON[@]}"
else
  echo '{"bench": "multi_gpu", "stage": "ipc", "error": "ipc build failed (build_ipc.log)"}' >> "$JSONL"
fi

wait $pid_nv; nv_ok=$?
stamp "nvshmem build rc=$nv_ok"
if ! want_backend nvshmem; then
  stamp "nvshmem: not in BACKENDS"
elif [[ $nv_ok == 0 ]]; then
  use_nvshmem  # the staged copy of the package, NVSHMEM's libraries on LD_LIBRARY_PATH
  # the symmetric heap comes from nvshmem_malloc: NVSHMEM's reservation must hold it
  export NVSHMEM_SYMMETRIC_SIZE=${NVSHMEM_SYMMETRIC_SIZE:-10G}
  run nvshmem_fused "$FUSED_BOX_S" "$ROCMOE_NVSHMEM_PACKAGE" --backend nvshmem --heap 8G \
    --ops embedding,gemv,gemm --dtype "${DTYPES// /,}" "${COMMON[@]}"
  run nvshmem_moe "$MOE_BOX_S" "$ROCMOE_NVSHMEM_PACKAGE" --backend nvshmem --heap 4G \
    --ops "$MOE_OPS" "${COMMON[@]}"
else
  tail -30 "$OUT/build_nvshmem.log"
  echo '{"bench": "multi_gpu", "stage": "nvshmem", "error": "nvshmem build failed or unfinished (build_nvshmem.log)"}' >> "$JSONL"
fi

stamp "summary"
python3 - "$JSONL" <<'PY'
import json, sys
sys.path.insert(0, ".")
from rocmoe.bench.multi_gpu import summary_table
rows = []
for line in open(sys.argv[1]):
    line = line.strip()
    if line.startswith("{"):
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass
print(summary_table(rows))
for r in rows:
    if r.get("stage"):
        print(r)
    elif r.get("op") == "dropless_moe_step" and "fused_ms" in r:
        print("moe", r["backend"], r["shape"], "load", r.get("rank_load_fraction"),
              "err", r.get("rel_err_vs_baseline"), r.get("grad_w1_rel_err_vs_baseline"))
PY
stamp done
