"""Markdown table of `rocmoe bench moe` JSON lines: one row per shape and routing, the ratio
of each metric (and, for the FFN, the queued ratio and then the CUDA-graph ratio after
slashes, where the run has them); several files (repeat
runs) give "a | b" per cell.  python benchmarks/moe_table.py FILE.json [FILE.json ...]"""

import json
import sys

COLUMNS = [("ffn_fwd_vs_dense_matmul", "FFN fwd / dense"),
           ("ffn_fwdbwd_vs_dense_matmul", "FFN fwd+bwd / dense"),
           ("dense_parity_ceiling", "balanced bmm / dense (ceiling)"),
           ("dense_parity_ceiling:ours", "FFN fwd+bwd / ceiling"),
           ("ffn_fwd_vs_grouped_mm", "FFN fwd / grouped_mm"),
           ("ffn_fwdbwd_vs_grouped_mm", "FFN fwd+bwd / grouped_mm"),
           ("layer_fwdbwd_vs_capacity_padded", "layer / CF 1.0"),
           ("layer_fwdbwd_vs_capacity_padded_cuda_graphs", "layer / CF 1.0 (graphs)"),
           ("layer_fwdbwd_vs_max_padded", "layer / max-pad"),
           ("permute_topology_share_device_time", "routing share (device)"),
           ("layer_host_time_share", "host / layer"),
           ("peak_memory_vs_capacity_padded", "memory / CF 1.0")]


def cell(rec, metric=""):
    if rec is not None and metric.endswith(":ours"):
        text = f"{rec['ours_over_ceiling']:.2f}"
        if "ours_over_ceiling_graphs" in rec:
            text += f"/{rec['ours_over_ceiling_graphs']:.2f}"
        return text
    if rec is not None and "ceiling_over_dense" in rec:
        text = f"{rec['ceiling_over_dense']:.2f}"
        if "ceiling_over_dense_graphs" in rec:
            text += f"/{rec['ceiling_over_dense_graphs']:.2f}"
        return text
    if rec is None or "ratio" not in rec:
        return "-"
    text = f"{rec['ratio']:.2f}"
    if "ratio_queued" in rec:
        text += f"/{rec['ratio_queued']:.2f}"
    if "ratio_graphs" in rec:
        text += f"/{rec['ratio_graphs']:.2f}"
    if "baseline_dropped_fraction" in rec:
        text += f" ({100 * rec['baseline_dropped_fraction']:.0f} % dropped)"
    return text


runs = []
for path in sys.argv[1:]:
    table = {}
    for line in open(path):
        rec = json.loads(line)
        if "tokens" not in rec or rec.get("metric") == "kernel":
            continue
        key = (rec["tokens"], rec["hidden"], rec["ffn"], rec["experts"], rec["routing"])
        table.setdefault(key, {})[rec["metric"]] = rec
    runs.append(table)
print("| shape (T, H, F, E), routing | " + " | ".join(name for _, name in COLUMNS) + " |")
print("|---" * (len(COLUMNS) + 1) + "|")
for key in runs[0]:
    cells = [" \\| ".join(cell(run.get(key, {}).get(metric.split(":")[0]), metric)
                           for run in runs)
             for metric, _ in COLUMNS]
    print(f"| {key[0]}, {key[1]}, {key[2]}, {key[3]}, {key[4]} | " + " | ".join(cells) + " |")
