"""Table of a `rocmoe bench moe_kernels` JSONL file: one row per (shape, kernel), one column
per config (its index in the sweep's --configs list), in TFLOP/s; the configs are listed
first.  python benchmarks/sweep_table.py FILE.jsonl"""

import json
import sys

rows, configs = {}, []
for line in open(sys.argv[1]):
    rec = json.loads(line)
    if "kernel" not in rec:
        print("(skipped)", line.strip()[:200])
        continue
    cfg = json.dumps(rec["config"], sort_keys=True)
    if cfg not in configs:
        configs.append(cfg)
    rows.setdefault((tuple(rec["shape"]), rec["kernel"]), {})[configs.index(cfg)] = rec["tflops"]
for i, cfg in enumerate(configs):
    print(f"[{i}] {cfg}")
print(f"{'shape':<24} {'kernel':<22}" + "".join(f"{f'[{i}]':>9}" for i in range(len(configs))))
for (shape, kernel), vals in rows.items():
    print(f"{','.join(map(str, shape)):<24} {kernel:<22}"
          + "".join(f"{vals.get(i, float('nan')):>9.1f}" for i in range(len(configs))))
