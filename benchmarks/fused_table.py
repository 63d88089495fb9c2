"""Print `rocmoe bench fused_gpu` JSON lines as a table (one row per op, api and shape).

    python benchmarks/fused_table.py FILE [FILE ...]
"""

import json
import sys


def shape_text(rec) -> str:
    s = rec.get("shape") or {}
    if rec["op"] == "embedding_all_to_all":
        return (f"{s['tables']}x{s['rows']:.0e}x{s['dim']} B{s['batch']} L{s['lookups']} "
                f"{s['mode']}")
    if rec["op"] == "gemv_all_reduce":
        return f"{s['n']}x{s['k']}"
    if rec["op"] == "gemm_all_to_all":
        return f"{s['m']}x{s['k']}x{s['n']}"
    return ""


def main(paths) -> None:
    rows = [json.loads(line) for p in paths for line in open(p) if line.strip()]
    print(f"{'op':22s} {'api':8s} {'shape':30s} {'dt':4s} {'idle':>6s} {'queued':>6s} "
          f"{'graph':>6s} {'host_us':>8s} {'torch_us':>8s} {'syncs':>5s}  extra")
    for r in rows:
        if r.get("op") == "copy_bandwidth":
            print(f"copy bandwidth {r['tbps']} TB/s on {r.get('device')}")
            continue
        if r.get("op") == "overlap":
            print(f"overlap: returned while matmuls ran {r['returned_while_matmuls_ran']} "
                  f"(call us {r['call_us']})")
            continue
        if "error" in r:
            print(f"{r['op']:22s} ERROR {r['error'][:150]}")
            continue
        extra = ""
        if "tbps" in r:
            extra += f"{r['tbps']} TB/s"
            if "fraction_of_copy" in r:
                extra += f" ({r['fraction_of_copy']} of copy)"
        if "tflops" in r:
            extra += f"{r['tflops']} vs {r['baseline_tflops']} TF/s"
        if r.get("config"):
            extra += f" cfg {r['config'].get('config')}"
        if r.get("graph_error"):
            extra += f" graph: {r['graph_error'][:60]}"
        print(f"{r['op']:22s} {r['api']:8s} {shape_text(r):30s} {r['dtype']:4s} "
              f"{r.get('ratio_idle', float('nan')):6.3f} {r.get('ratio_queued', float('nan')):6.3f} "
              f"{r.get('ratio_graph', float('nan')):6.3f} {r['rocmoe_host_us']:8.1f} "
              f"{r['baseline_host_us']:8.1f} {r['syncs_per_call']:5.1f}  {extra}  "
              f"err {r.get('rel_err', 0):.1e}")


if __name__ == "__main__":
    main(sys.argv[1:])
