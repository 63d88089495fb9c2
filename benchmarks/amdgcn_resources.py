"""What rocmoe's kernels hold of a CDNA compute unit (the Triton kernels at the tiles they run
on AMD GPUs, and the HIP sources' kernels): registers, spills, scratch, LDS and occupancy,
read from the AMDGPU listing (no GPU needed).
The AMD counterpart of ptxas_spills.py. On CDNA a workgroup of 8 waves leaves each wave 256
VGPRs and no AGPRs; what does not fit spills to scratch memory, inside the K loop where the
tile's accumulator lives. tests/test_triton_compile.py and tests/moe/test_aot_compile.py
keep every build listed here spill-free; this prints the figures.

    python3 benchmarks/amdgcn_resources.py [--arch gfx942 gfx90a] [--output FILE]
        [--gemm-tile '{"BLOCK_M": 256, "BLOCK_N": 256}'] [--kernels triton hip]

One JSON line per build: arch, kernel, what was built (tile, mode, dtype), VGPRs, AGPRs,
SGPRs, VGPR and SGPR spills, scratch bytes a lane, waves a SIMD, LDS bytes. --gemm-tile
adds builds of gemm_a2a_kernel at another tile (a candidate before it joins the tuner, or
the 256 x 256 tile that was the default until the twenty-third session). --kernels hip gives
one line per kernel of the HIP sources (hip/src/gpu/*.hip, clang-19 -O3, as tests/test_compile.py
builds them): VGPRs, AGPRs, VGPR spills, scratch bytes a lane, LDS bytes."""
import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="amdgcn_resources_")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import amd_isa  # noqa: E402  (tests' AMD listing reader)

from rocmoe.moe import blocksparse  # noqa: E402
from rocmoe.moe import kernels as moe_kernels  # noqa: E402
from rocmoe.ops import gpu as gpu_ops  # noqa: E402
from rocmoe.ops import triton_aot as aot  # noqa: E402


def builds(extra_tiles):
    for dtype in ("bf16", "fp32"):
        tiles = [("default", {})] + [("tuner", c) for c in
                                     gpu_ops.tune_candidates("hip", 1, dtype == "fp32") if c]
        tiles += [("asked", t) for t in extra_tiles]
        for origin, extra in tiles:
            for mode in aot.UNSPLIT_MODES:  # (no CDNA tile splits K)
                b = aot.gemm_source("hip", dtype, mode, extra)
                yield "gemm_a2a_kernel", b.source, b.options, dict(
                    tile=b.tile(), mode=mode, dtype=dtype, extra=extra, origin=origin)
        b = aot.grouped_tiles_source("hip", dtype)
        yield "grouped_tiles_kernel", b.source, b.options, dict(dtype=dtype, origin="default")
        b = aot.weight_grad_source("hip", dtype)
        yield "grouped_weight_grad_kernel", b.source, b.options, dict(dtype=dtype,
                                                                      origin="default")
    gelu = moe_kernels.ACT_GELU_TANH
    options = {k: blocksparse.CDNA_OVERRIDES[k] for k in ("num_warps", "num_stages")}
    for name in ("sdd_kernel", "dsd_kernel", "dstd_kernel"):
        for fused in (False, True):
            act = dict(ACT=gelu, EPILOGUE_ACT_GRAD=gelu, EPILOGUE_STORE_ACT=gelu) if fused else {}
            src = ASTSource(fn=moe_kernels.get(name),
                            signature=moe_kernels.aot_signatures("bf16")[name],
                            constexprs=moe_kernels.aot_constexprs(name, **act))
            yield name, src, options, dict(dtype="bf16", fused_activation=fused,
                                           origin="CDNA_OVERRIDES")


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def hip_kernels(arch: str):
    """(source, kernel symbol, code object metadata) of every kernel of hip/src/gpu/*.hip
    built for `arch` with the Release build's optimisation."""
    clang = shutil.which("clang-19")
    if clang is None:
        raise SystemExit("--kernels hip needs clang-19 (apt-get install clang-19)")
    with tempfile.TemporaryDirectory() as tmp:
        for source in sorted(glob.glob(os.path.join(REPO, "hip", "src", "gpu", "*.hip"))):
            if "nvshmem" in source:
                continue  # NVIDIA only
            out = os.path.join(tmp, os.path.basename(source) + ".s")
            subprocess.run([clang, "-std=c++17", "-x", "hip", f"--offload-arch={arch}",
                            "-nogpulib", "--cuda-device-only", "-S", "-O3", "-DNDEBUG",
                            "-D__HIP_PLATFORM_AMD__", f"-I{REPO}/hip/include", f"-I{REPO}/hip/src",
                            "-DROCMOE_HAVE_GPU", "-DROCMOE_PLATFORM_IS_HIP", source, "-o", out],
                           check=True)
            with open(out) as f:
                for name, meta in amd_isa.kernel_metadata(f.read()).items():
                    yield os.path.basename(source), name, meta


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", nargs="+", default=["gfx942", "gfx90a"])
    ap.add_argument("--gemm-tile", action="append", default=[], type=json.loads,
                    help="JSON overrides of CDNA's default GEMM tile to build as well")
    ap.add_argument("--kernels", nargs="+", choices=("triton", "hip"), default=["triton"],
                    help="the Triton kernels (default) and/or the HIP sources' kernels")
    ap.add_argument("--output", default=None, help="also write the JSON lines here")
    args = ap.parse_args()
    out = open(args.output, "w") if args.output else None
    for arch in args.arch if "hip" in args.kernels else ():
        for source, name, meta in hip_kernels(arch):
            rec = dict(bench="amdgcn_resources", arch=arch, compiler="clang-19 -O3",
                       source=source, kernel=name, vgprs=meta[".vgpr_count"],
                       agprs=meta[".agpr_count"], vgpr_spills=meta[".vgpr_spill_count"],
                       scratch_bytes=meta[".private_segment_fixed_size"],
                       lds_bytes=meta[".group_segment_fixed_size"])
            print(json.dumps(rec), flush=True)
            if out:
                out.write(json.dumps(rec) + "\n")
    for arch in args.arch if "triton" in args.kernels else ():
        target = GPUTarget("hip", arch, 64)
        for kernel, src, options, what in builds(args.gemm_tile):
            compiled = triton.compile(src, target=target, options=options)
            rec = dict(bench="amdgcn_resources", arch=arch, triton=triton.__version__,
                       kernel=kernel, **what, **options,
                       **amd_isa.resources(compiled.asm["amdgcn"]),
                       lds_bytes=compiled.metadata.shared)
            line = json.dumps(rec)
            print(line, flush=True)
            if out:
                out.write(line + "\n")
    if out:
        out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
