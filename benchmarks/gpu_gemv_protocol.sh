#!/usr/bin/env bash
# Where the fused GEMV + AllReduce loses time at world size > 1: the same bench cases
# (rocmoe bench multi_gpu --ops gemv: idle-start, queued, CUDA-graph replay against torch.mv +
# NCCL all_reduce) under the GEMV kernel's knobs (hip/src/gpu/fused_gemv.hip), at RANKS ranks
# (one a GPU) and at one rank, where ROCMOE_GEMV_DIRECT=0 runs the protocol kernel with no
# peer: its cost without any cross-GPU wait.
#
#   OUT=/some/dir RANKS=2 bash benchmarks/gpu_gemv_protocol.sh     (repo root, GPU machine)
#
# Every run appends its JSON lines, tagged with the knobs ("variant"), to $OUT/gemv_protocol.jsonl.
# VARIANTS / SOLO_VARIANTS: space-separated knob sets, commas between knobs, "default" none.
set -u -o pipefail
OUT=${OUT:-device_out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
RANKS=${RANKS:-2}
DTYPES=${DTYPES:-bfloat16,float32}
VARIANTS=${VARIANTS:-"default ROCMOE_GEMV_ROWS_PER_WARP=1 ROCMOE_GEMV_PER_CU=2 ROCMOE_GEMV_ROWS=1024"}
SOLO_VARIANTS=${SOLO_VARIANTS:-"default ROCMOE_GEMV_DIRECT=0 ROCMOE_GEMV_DIRECT=0,ROCMOE_GEMV_ROWS_PER_WARP=1"}
source benchmarks/device_env.sh
if [[ -z ${SKIP_BUILD:-} ]]; then
  build_cuda "$OUT/build_gemv.log" || exit 4
fi
JSONL="$OUT/gemv_protocol.jsonl"
: > "$JSONL"
LAUNCH=(mpirun --oversubscribe --bind-to none)
command -v mpirun >/dev/null || LAUNCH=(mpiexec)

# one_run RANKS VARIANT: the bench's GEMV cases with the variant's knobs in the environment
one_run() {
  local ranks=$1 variant=$2 knobs=()
  [[ $variant != default ]] && IFS=, read -r -a knobs <<< "$variant"
  local tmp="$OUT/.run.jsonl"
  : > "$tmp"
  echo "=== ranks=$ranks $variant"
  env "${knobs[@]}" timeout -k 5 120 "${LAUNCH[@]}" -n "$ranks" python3 -m rocmoe.bench.multi_gpu \
    --backend ipc --heap 2G --ops gemv --dtype "$DTYPES" --reps 5 --iters 10 --warmup 2 \
    --output "$tmp" 2>&1 | grep -vE '^\{|Warning|warn\(' | tail -n 8
  python3 - "$tmp" "$variant" "$ranks" >> "$JSONL" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    if line.startswith("{"):
        rec = json.loads(line)
        rec.update(variant=sys.argv[2], launched_ranks=int(sys.argv[3]))
        print(json.dumps(rec))
PY
}

for v in $VARIANTS; do one_run "$RANKS" "$v"; done
for v in $SOLO_VARIANTS; do one_run 1 "$v"; done
python3 - "$JSONL" <<'PY'
import json, sys
print(f"{'variant':48s} {'n':>2s} {'dtype':9s} {'N':>6s} {'idle':>6s} {'queued':>6s} "
      f"{'graph':>6s} {'fusedG':>8s} {'baseG':>8s}")
for line in open(sys.argv[1]):
    r = json.loads(line)
    if "fused_ms" not in r:
        print(r.get("variant"), r.get("error") or r.get("skipped"))
        continue
    print(f"{r['variant'][:48]:48s} {r['ranks']:2d} {r['dtype']:9s} {r['shape']['n']:6d} "
          f"{r['speedup']:6.3f} {r.get('loop_speedup', 0):6.3f} {r.get('graph_speedup', 0):6.3f} "
          f"{r.get('fused_graph_ms', 0) * 1e3:8.1f} {r.get('baseline_graph_ms', 0) * 1e3:8.1f}")
PY
