#!/usr/bin/env bash
# GPT-MoE at a GPU size on one GPU: examples/moe_train.py with world size 1, bf16 and the
# Triton block-sparse kernels (no rocmoe context: --backend none needs neither cffi nor the
# native library, nor mpi4py). Prints its tokens/s.
# Usage (repo root, on a CUDA or ROCm machine):  OUT=/some/dir bash benchmarks/gpu_moe_train.sh
# Writes moe_train_gpu.jsonl (the run's JSON lines), moe_train_gpu.log (stdout+stderr) and
# moe_train_env.txt under $OUT, and prints a one-line JSON summary.
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" \
  2>&1 | tee "$OUT/moe_train_env.txt"
# 8 layers of hidden 1024 (16 heads), every FFN a dropless MoE of 64 experts (FFN 1024, top-2):
# 1.1 B parameters, ~70 M active per token; 16 sequences of 1024 bytes = 16384 tokens a step.
t0=$(date +%s)
timeout "${MOE_TRAIN_TIMEOUT:-420}" python3 examples/moe_train.py --backend none --device cuda \
  --dtype bfloat16 --layers 8 --hidden 1024 --heads 16 --ffn 1024 --experts 64 --top-k 2 \
  --moe-every 1 --block-size 128 --seq-len 1024 --batch-size 16 --steps "${MOE_TRAIN_STEPS:-60}" \
  --warmup 10 --lr 1e-3 --min-lr 1e-4 --eval-every 30 --eval-batches 2 --no-progress \
  --jsonl "$OUT/moe_train_gpu.jsonl" > "$OUT/moe_train_gpu.log" 2>&1
echo "moe_train rc=$? took $(( $(date +%s) - t0 )) s"
tail -3 "$OUT/moe_train_gpu.log"
python3 - "$OUT/moe_train_gpu.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
train = [r for r in rows if r["event"] == "train"]
summary = next((r for r in rows if r["event"] == "summary"), {})
steady = train[3:] or train
parts = {k: round(1000 * statistics.median(r["time_parts"][k] for r in steady), 2)
         for k in steady[0]["time_parts"]} if steady else {}
print(json.dumps({"metric": "moe_train_tokens_per_s", "tokens_per_s": summary.get("tokens_per_s"),
                  "median_step_ms": round(1000 * statistics.median(r["step_s"] for r in steady), 2)
                  if steady else None, "median_part_ms": parts,
                  "balance_ratio_max_last": max(train[-1]["balance_ratio"]) if train else None,
                  "val_bpb": summary.get("val_bpb"), "unigram_entropy_bits": summary.get("unigram_entropy_bits"),
                  "learned": summary.get("learned"), "steps": summary.get("steps")}))
PY
