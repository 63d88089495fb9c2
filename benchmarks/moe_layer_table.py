"""Tables of `rocmoe bench moe --layer` JSON lines.

    python benchmarks/moe_layer_table.py FILE.jsonl [FILE.jsonl ...]

First a markdown table, one row per shape and routing: the whole layer's fwd+bwd and forward
ratios to the grouped-GEMM layer (idle-start / queued / CUDA graphs; above 1 rocmoe is
faster), the peak-memory ratio (rocmoe / baseline: below 1 rocmoe needs less), host ms per
step and kernel launches (rocmoe vs baseline). Then one line per fused-FFN variant with the
range and geometric mean of its queued fwd+bwd ratio and its largest memory ratio over the
cases, so that one run tells which default to keep; and the goals, judged on the default.
"""

import json
import math
import sys

KEYS = ("act_fusion", "gather_rows", "compact_values")


def case_key(r):
    return (r["model"], r["tokens"], r["hidden"], r["ffn"], r["experts"], r["top_k"],
            r["routing"])


def ratios(r):
    parts = [f"{r['ratio']:.2f}", f"{r['ratio_queued']:.2f}"]
    parts.append(f"{r['ratio_graphs']:.2f}" if "ratio_graphs" in r else "-")
    return "/".join(parts)


def geomean(values):
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def main(paths):
    records = [json.loads(line) for path in paths for line in open(path) if line.strip()]
    cases, variants = {}, {}
    for r in records:
        if "tokens" not in r or "error" in r:
            continue
        cases.setdefault(case_key(r), {})[r["metric"]] = r
        if r["metric"] == "layer_fwdbwd_vs_grouped_mm":
            variants.setdefault(tuple(r[k] for k in KEYS) + ("default",), []).append(
                (r["ratio_queued"], None))
        if r["metric"] == "layer_variant":
            variants.setdefault(tuple(r[k] for k in KEYS), []).append(
                (r["ratio_queued"], r["memory_ratio"]))
    print("| model, T x H x F, E, k, routing | fwd+bwd (idle/queued/graphs) | fwd alone "
          "(idle/queued/graphs) | peak memory | host ms (ours/base) | launches (ours/base) |")
    print("|---|---|---|---|---|---|")
    goals = dict(memory=[], fwdbwd=[], small=[], fwd=[])
    for key, m in cases.items():
        model, tokens, hidden, ffn, experts, top_k, routing = key
        fb, fw = m.get("layer_fwdbwd_vs_grouped_mm"), m.get("layer_fwd_vs_grouped_mm")
        mem, host = m.get("layer_peak_memory_vs_grouped_mm"), m.get("layer_host")
        print(f"| {model}, {tokens} x {hidden} x {ffn}, {experts}, {top_k}, {routing} | "
              f"{ratios(fb) if fb else '-'} | {ratios(fw) if fw else '-'} | "
              f"{mem['ratio']:.2f} | " if mem else "- | ", end="")
        print(f"{host['ours_host_ms']:.2f}/{host['baseline_host_ms']:.2f} | "
              f"{host['ours_launches']}/{host['baseline_launches']} |" if host else "- | - |")
        if mem:
            goals["memory"].append(mem["ratio"])
        if fb and tokens >= 8192:
            goals["fwdbwd"].append(fb["ratio"])
        if fb and experts >= 64 and ffn <= 1408:
            goals["small"].append(fb["ratio"])
        if fw:
            goals["fwd"].append(fw["ratio"])
    print()
    for variant, rows in sorted(variants.items(), key=lambda kv: -geomean([r[0] for r in kv[1]])):
        queued = [r[0] for r in rows]
        memory = [r[1] for r in rows if r[1] is not None]
        print(f"variant {dict(zip(KEYS, variant))}{' (default)' if 'default' in variant else ''}:"
              f" fwd+bwd queued {min(queued):.2f}-{max(queued):.2f} (geomean "
              f"{geomean(queued):.3f})"
              + (f", memory up to {max(memory):.2f}" if memory else "") + f", {len(rows)} cases")
    print()
    for name, values, bar in (("peak memory <= 1.0 on every case", goals["memory"], None),
                              ("fwd+bwd >= 1.0 at >= 8192 tokens", goals["fwdbwd"], 1.0),
                              ("fwd+bwd >= 1.3 on small experts", goals["small"], 1.3),
                              ("forward alone >= 1.0", goals["fwd"], 1.0)):
        if not values:
            continue
        met = [v <= 1.0 for v in values] if bar is None else [v >= bar for v in values]
        print(f"goal {name}: {sum(met)} of {len(met)} (range {min(values):.2f}-{max(values):.2f})")


if __name__ == "__main__":
    main(sys.argv[1:])
