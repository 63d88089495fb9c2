"""Registers and spills of the Triton kernels for Hopper (sm_90a), read from ptxas' own log:
no GPU needed. A kernel at 255 registers that spills pays local-memory traffic wherever the
spill code runs; this lists where that is, so a kernel change can be checked before device
time is spent on it (the GEMM+A2A epilogue spilled 580-640 bytes a thread until fc95868).

    python3 benchmarks/ptxas_spills.py [--output FILE]

One JSON line per build: kernel, what was built (tile, stages, mode / fused epilogue),
registers, spill store and load bytes. Covers gemm_a2a_kernel at the CUDA default tile
(direct, local and exchange mode) and at every tuner candidate (direct, or local for split
K; TMA loads, as the tuner runs them), and the MoE kernels at the constexprs of their
ahead-of-time test (plain and with the fused activation epilogues). Triton's cache is
pointed at a fresh directory: a cached build runs no ptxas and logs nothing."""
import argparse
import contextlib
import io
import json
import os
import re
import sys
import tempfile

os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="ptxas_spills_")
os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from rocmoe.moe import kernels as moe_kernels  # noqa: E402
from rocmoe.ops import gpu as gpu_ops  # noqa: E402
from rocmoe.ops import triton_aot as aot  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)


def ptxas_report(src, options) -> dict:
    """Registers and spill bytes of one build, from the log ptxas printed while building."""
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        triton.compile(src, target=TARGET, options=options)
    text = log.getvalue()
    regs = [int(v) for v in re.findall(r"Used (\d+) registers", text)]
    stores = [int(v) for v in re.findall(r"(\d+) bytes spill stores", text)]
    loads = [int(v) for v in re.findall(r"(\d+) bytes spill loads", text)]
    if not regs:
        raise RuntimeError(f"no ptxas log (is TRITON_DUMP_PTXAS_LOG honoured?):\n{text}")
    return dict(registers=max(regs), spill_store_bytes=sum(stores), spill_load_bytes=sum(loads))


def _key(constexprs: dict, options: dict) -> str:
    return json.dumps([sorted(constexprs.items()), sorted(options.items())], default=str)


def gemm_builds():
    tiles = [("default", {}, mode) for mode in ("direct", "local", "exchange")]
    tiles += [("tuner", extra, "direct" if extra.get("SPLIT_K", 1) == 1 else "local")
              for extra in gpu_ops.tune_candidates("cuda", rows=1)]
    for kind, extra, mode in tiles:
        b = aot.gemm_source("cuda", "bf16", mode, extra, tma=True, even=True)
        what = dict(tile=b.tile(), split_k=b.constexprs["SPLIT_K"], mode=mode, origin=kind,
                    **b.options)
        yield "gemm_a2a_kernel", what, b.source, b.options, _key(b.constexprs, b.options)


# (kernel, fused): "all" is the GELU prologue (DSD, DSᵀD) or the act' and store-act
# epilogues at once (SDD), as tests/moe/test_aot_compile.py builds them; "store_act" /
# "act_grad" one SDD epilogue alone
MOE_BUILDS = [("sdd_kernel", "none"), ("sdd_kernel", "all"), ("sdd_kernel", "store_act"),
              ("sdd_kernel", "act_grad"), ("dsd_kernel", "none"), ("dsd_kernel", "all"),
              ("dstd_kernel", "all"), ("dstd_persistent_kernel", "none"),
              ("sdd_persistent_kernel", "none"), ("sdd_persistent_kernel", "all"),
              ("sdd_persistent_kernel", "store_act"), ("sdd_persistent_kernel", "act_grad")]


def moe_builds():
    gelu = moe_kernels.ACT_GELU_TANH
    for name, fused in MOE_BUILDS:
        act = {"none": {}, "all": dict(ACT=gelu, EPILOGUE_ACT_GRAD=gelu, EPILOGUE_STORE_ACT=gelu),
               "store_act": dict(EPILOGUE_STORE_ACT=gelu),
               "act_grad": dict(EPILOGUE_ACT_GRAD=gelu)}[fused]
        constexprs = moe_kernels.aot_constexprs(name, **act)
        src = ASTSource(fn=moe_kernels.get(name),
                        signature=moe_kernels.aot_signatures("bf16")[name],
                        constexprs=constexprs)
        options = {"num_warps": 8, "num_stages": 3}
        yield name, dict(fused_activation=fused, origin="aot test constexprs", **options), \
            src, options, _key(constexprs, options)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--output", default=None, help="also write the JSON lines here")
    args = ap.parse_args()
    out = open(args.output, "w") if args.output else None
    reports = {}  # a build Triton has made once comes from its cache, without a ptxas log
    for kernel, what, src, options, build in list(gemm_builds()) + list(moe_builds()):
        key = (kernel, build)
        if key not in reports:
            reports[key] = ptxas_report(src, options)
        rec = dict(bench="ptxas_spills", target="sm_90a", triton=triton.__version__,
                   kernel=kernel, **what, **reports[key])
        line = json.dumps(rec)
        print(line, flush=True)
        if out:
            out.write(line + "\n")
    if out:
        out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
