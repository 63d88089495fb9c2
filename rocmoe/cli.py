"""The `rocmoe` command: `info`, `doctor`, `bench` and `plot`.

    rocmoe info [--json]           what this build and this machine offer
    rocmoe doctor [--clean]        checks before a job; removes crashed jobs' shm segments
    rocmoe bench NAME [ARGS...]    runs rocmoe.bench.NAME.main(ARGS) (heap, fused, moe, ipc, vexpert)
    rocmoe plot RUN.jsonl [--out DIR]   PNGs of a training run's JSON lines (matplotlib)
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import sys
from typing import Optional

from . import __version__, errors

BENCHMARKS = ("heap", "fused", "fused_gpu", "moe", "moe_kernels", "ipc", "multi_gpu", "vexpert")

# The environment knobs rocmoe reads, with their defaults (as a user would write them) and why
# one would set them. `rocmoe info` shows the current value next to the default.
ENV_KNOBS = (
    ("ROCMOE_HEAP_SIZE", "1G", "symmetric heap bytes per rank (K/M/G suffixes)"),
    ("ROCMOE_TIMEOUT_S", "60", "bound in seconds for every wait and control collective"),
    ("ROCMOE_FIRST_CALL_TIMEOUT_S", "300", "bound of the device waits in a handle's first "
                                           "call (a GEMM plan's first launch), which peers "
                                           "may spend in the JIT and the tuner (at least "
                                           "ROCMOE_TIMEOUT_S)"),
    ("ROCMOE_HOST_WORKERS", "auto", "worker threads per rank for the host backend's fused ops"),
    ("ROCMOE_MOE_BACKEND", "auto", "block-sparse MoE kernels: auto, triton or torch"),
    ("ROCMOE_REPLICA_SUM_BYTES", str(256 << 20), "heap bytes per rank for vExpert's replica "
                                                 "gradient sums (more goes in rounds)"),
    ("ROCMOE_REQUIRE_ALL", "0", "tests: 1 turns a missing tool (mpiexec, hipcc, slurm) into a "
                                "failure instead of a skip"),
    ("ROCMOE_SLURM_DIR", "/tmp/rocmoe-slurm", "config and logs of slurm/local-cluster.sh"),
    # tuning knobs (benchmarks/gpu_sweep.sh sweeps them; the defaults are the measured best)
    ("ROCMOE_MOE_KERNEL_CONFIG", "", "JSON overrides of the block-sparse kernel tiles, e.g. "
                                     '{"tma": false, "dstd": {"block_n": 256, "num_warps": 8}}'),
    ("ROCMOE_GEMM_CONFIG", "", "JSON overrides of the GEMM+A2A tile config, e.g. "
                               '{"BLOCK_N": 128, "USE_TMA": false, "PROGRAMS_PER_SM": 1}'),
    ("ROCMOE_GEMM_TUNE", "1", "GEMM+A2A on a GPU (CUDA or ROCm): 0 skips the first call's "
                              "timing of the platform's tile candidates (gpu.tune_candidates) "
                              "and runs the default tile; ROCMOE_GEMM_CONFIG skips it too"),
    ("ROCMOE_GROUPED_CONFIG", "", "JSON overrides of the expert-parallel grouped products' "
                                  'tiles (gpu.grouped_local), e.g. {"BLOCK_N": 128, '
                                  '"FLATTEN": false}'),
    ("ROCMOE_DW_CONFIG", "", "JSON overrides of the grouped weight gradient's tiles, e.g. "
                             '{"BLOCK_K": 64, "TILES_FIRST": false}'),
    ("ROCMOE_GPU_WORKGROUPS", "0", "workgroups of the HIP fused kernels (0: per the GPU)"),
    ("ROCMOE_EMBEDDING_DIRECT", "1", "Embedding+A2A at world size 1: 1 a plain gather "
                                     "kernel, 0 the protocol kernel"),
    ("ROCMOE_REPEAT_CALLS", "1", "rocmoe.ops functions at world size 1 on a GPU: 1 runs a "
                                 "call its last call's handle takes (the same shapes, dtype "
                                 "and, for the embedding, mode and batch) by that handle's "
                                 "own checks and launch instead of the general path (checks, "
                                 "agreement, handle lookup); 0 always takes the general path"),
    # GEMV+AllReduce (hip/src/gpu/fused_gemv.hip; benchmarks/gemv_variants.py sweeps them)
    ("ROCMOE_GEMV_DIRECT", "1", "GEMV at world size 1: 1 a plain GEMV kernel, 0 the protocol "
                                "kernel"),
    ("ROCMOE_GEMV_ROWS_PER_WARP", "", "GEMV: rows a wave computes at once (1, 2 or 4; "
                                      "unset: 1 at world size 1, 2 in the protocol kernel)"),
    ("ROCMOE_GEMV_STAGES", "0", "GEMV at world size 1 on NVIDIA: cp.async ring depth "
                                "(0: loads into registers)"),
    ("ROCMOE_GEMV_UNROLL", "4", "GEMV register kernels: 16-byte loads in flight per row and "
                                "lane"),
    ("ROCMOE_GEMV_LOAD", "", "GEMV register kernel on NVIDIA: W's loads 0 ld.global.nc, "
                             "1 + L1::no_allocate, 2 + L2::256B prefetch (unset: 1 on an "
                             "H100, 0 elsewhere)"),
    ("ROCMOE_GEMV_ROWS", "0", "GEMV protocol kernel: rows per phase-1 task (0: about N / "
                              "workgroups)"),
    ("ROCMOE_GEMV_PER_CU", "4", "GEMV: workgroups per compute unit (at most what fits)"),
    ("ROCMOE_GEMV_ONE_SHOT", "1", "GEMV at world size > 1: 1 the one-hop kernel, 0 the "
                                  "two-phase protocol kernel (every rank alike)"),
    ("ROCMOE_GEMV_BALANCE", "0", "GEMV at world size 1, one row a wave: 1 splits W's chunks "
                                 "evenly over the waves (rows cut between two waves) instead "
                                 "of whole rows; off: it lost on 3 of 4 H200 shapes"),
)


# -- info ----------------------------------------------------------------------------------
def _native_info() -> dict:
    try:
        from . import _native
    except errors.RocmoeError as exc:
        return {"error": str(exc)}
    info = {"version": _native.version(), "backends_compiled": _native.backends_compiled(),
            "gpu_platform": _native.gpu_platform()}
    try:
        info["gpu_device_count"] = _native.gpu_device_count()
    except errors.RocmoeError as exc:
        info["gpu_device_count"] = None
        info["gpu_device_error"] = str(exc)
    return info


def _torch_info() -> dict:
    try:
        import torch
    except ImportError as exc:
        return {"error": str(exc)}
    info = {"version": torch.__version__, "hip": getattr(torch.version, "hip", None),
            "cuda": getattr(torch.version, "cuda", None),
            "gpu_available": bool(torch.cuda.is_available())}
    info["device_count"] = torch.cuda.device_count() if info["gpu_available"] else 0
    info["devices"] = [torch.cuda.get_device_name(i) for i in range(info["device_count"])]
    return info


def _mpi_info() -> dict:
    info: dict = {"mpiexec": shutil.which("mpiexec")}
    try:
        import mpi4py
        # A plain import (MPI_Init as a singleton), as rocmoe.init() does: switching mpi4py's
        # auto-initialisation off would leave MPI unusable for the rest of the process.
        from mpi4py import MPI
    except ImportError as exc:
        info["error"] = str(exc)
        return info
    info["mpi4py"] = mpi4py.__version__
    # mpi4py may hand back the C string with its terminating NUL
    info["library"] = MPI.Get_library_version().replace("\x00", "").strip().splitlines()[0].strip()
    info["standard"] = "%d.%d" % MPI.Get_version()
    return info


def _env_info() -> dict:
    out = {}
    for name, default, what in ENV_KNOBS:
        out[name] = {"value": os.environ.get(name), "default": default, "meaning": what}
    try:
        # (rocmoe.env loads no native library: info works where librocmoe is not built)
        from .env import first_call_timeout_from_env, heap_size_from_env, timeout_from_env
        out["ROCMOE_HEAP_SIZE"]["effective_bytes"] = heap_size_from_env()
        out["ROCMOE_TIMEOUT_S"]["effective"] = timeout_from_env()
        out["ROCMOE_FIRST_CALL_TIMEOUT_S"]["effective"] = first_call_timeout_from_env()
    except errors.RocmoeError as exc:
        out["error"] = str(exc)
    return out


def collect_info() -> dict:
    known = {name for name, _, _ in ENV_KNOBS}
    return {
        "rocmoe": __version__,
        "python": sys.version.split()[0],
        "native": _native_info(),
        "torch": _torch_info(),
        "mpi": _mpi_info(),
        "env": _env_info(),
        # A ROCMOE_* variable rocmoe does not know is usually a typo of one it does.
        "unknown_env": sorted(k for k in os.environ if k.startswith("ROCMOE_") and k not in known),
    }


def _print_info(info: dict) -> None:
    native, torch_, mpi = info["native"], info["torch"], info["mpi"]
    print(f"rocmoe {info['rocmoe']} (python {info['python']})")
    if "error" in native:
        print(f"  native library: NOT LOADED: {native['error']}")
    else:
        print(f"  librocmoe:        {native['version']}")
        print(f"  backends:         {', '.join(native['backends_compiled'])}")
        print(f"  GPU platform:     {native['gpu_platform']}")
        print(f"  GPUs (librocmoe): {native['gpu_device_count']}")
    if "error" in torch_:
        print(f"  torch:            not importable: {torch_['error']}")
    else:
        flavour = (f"HIP {torch_['hip']}" if torch_["hip"] else
                   f"CUDA {torch_['cuda']}" if torch_["cuda"] else "CPU only")
        print(f"  torch:            {torch_['version']} ({flavour}); GPUs visible: "
              f"{torch_['device_count']}{' ' + str(torch_['devices']) if torch_['devices'] else ''}")
    if "library" in mpi:
        print(f"  MPI:              {mpi['library']} (MPI {mpi['standard']}, mpi4py {mpi['mpi4py']})")
    else:
        print(f"  MPI:              mpi4py not importable: {mpi.get('error')}")
    print(f"  mpiexec:          {mpi['mpiexec'] or 'not on PATH'}")
    print("  environment:")
    for name, knob in info["env"].items():
        if name == "error":
            continue
        current = knob["value"] if knob["value"] is not None else f"(default {knob['default']})"
        extra = ""
        if "effective_bytes" in knob:
            extra = f" = {knob['effective_bytes']} bytes"
        print(f"    {name:<20} {current}{extra}  # {knob['meaning']}")
    if "error" in info["env"]:
        print(f"    problem: {info['env']['error']}")
    for name in info["unknown_env"]:
        print(f"    {name:<20} {os.environ[name]}  # not a rocmoe setting: a typo?")


def cmd_info(args) -> int:
    info = collect_info()
    if args.json:
        print(json.dumps(info, indent=2, sort_keys=True))
    else:
        _print_info(info)
    return 1 if "error" in info["native"] else 0


# -- doctor --------------------------------------------------------------------------------
def cmd_doctor(args) -> int:
    from . import doctor
    findings = doctor.run_checks(clean=args.clean, mpi=not args.no_mpi,
                                 mpi_timeout_s=args.mpi_timeout, min_age_s=args.min_age)
    for finding in findings:
        print(finding.line(), flush=True)
    counts = {s: sum(f.status == s for f in findings) for s in (doctor.OK, doctor.WARN, doctor.FAIL)}
    print(f"doctor: {counts['OK']} ok, {counts['WARN']} warnings, {counts['FAIL']} failures")
    return 1 if counts["FAIL"] else 0


# -- bench ---------------------------------------------------------------------------------
def available_benchmarks() -> list[str]:
    """The planned benchmarks plus every public module found in rocmoe.bench."""
    import pkgutil
    from . import bench
    found = {m.name for m in pkgutil.iter_modules(bench.__path__) if not m.name.startswith("_")}
    return list(BENCHMARKS) + sorted(found - set(BENCHMARKS))


def load_benchmark(name: str):
    """The `main(argv)` of rocmoe.bench.<name>, or a RocmoeError saying why not."""
    names = available_benchmarks()
    if name not in names:
        raise errors.InvalidArgumentError(
            f"unknown benchmark {name!r}; choose one of {', '.join(names)}")
    module_name = f"rocmoe.bench.{name}"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:  # the benchmark exists but one of its imports is missing
            raise
        raise errors.ConfigurationError(
            f"benchmark {name!r} is not part of this installation ({module_name} is missing)"
        ) from None
    main = getattr(module, "main", None)
    if not callable(main):
        raise errors.ConfigurationError(f"{module_name} has no main(argv) function")
    return main


def cmd_bench(args) -> int:
    main = load_benchmark(args.name)
    rc = main(list(args.args))
    return int(rc or 0)


# -- plot ----------------------------------------------------------------------------------
def cmd_plot(args) -> int:
    from .plot import plot_run
    for run in args.runs:
        if not os.path.isfile(run):
            raise errors.InvalidArgumentError(f"{run} is not a file (a run's JSON lines)")
    for run in args.runs:
        for png in plot_run(run, args.out):
            print(png)
    return 0


# -- entry point -------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rocmoe", description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"rocmoe {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("info", help="build, devices, MPI and settings")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("doctor", help="check this machine for a rocmoe job")
    p.add_argument("--clean", action="store_true",
                   help="remove /dev/shm segments of crashed rocmoe jobs (never a live job's)")
    p.add_argument("--min-age", type=float, default=60.0, metavar="S",
                   help="a segment whose owner is gone counts as stale once this old (default 60: "
                        "running jobs unlink theirs within seconds)")
    p.add_argument("--no-mpi", action="store_true", help="skip the mpiexec launch check")
    p.add_argument("--mpi-timeout", type=float, default=60.0, metavar="S",
                   help="seconds allowed for the mpiexec launch check (default 60)")
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("bench", help="run a benchmark: " + ", ".join(BENCHMARKS),
                       description="Runs rocmoe.bench.NAME.main(ARGS); `rocmoe bench NAME --help` "
                                   "lists a benchmark's options.")
    p.add_argument("name", metavar="NAME", help=", ".join(BENCHMARKS))
    p.add_argument("args", nargs=argparse.REMAINDER, help="passed to the benchmark")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("plot", help="PNG pictures of a training run's JSON lines",
                       description="Loss curves, tokens per expert / per rank with the balance "
                                   "ratio, and step-time parts of examples/moe_train.py and "
                                   "examples/dlrm_train.py runs (needs matplotlib).")
    p.add_argument("runs", nargs="+", metavar="RUN.jsonl")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="where the PNGs go (default: beside each file)")
    p.set_defaults(func=cmd_plot)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except errors.RocmoeError as exc:
        print(f"rocmoe {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # `rocmoe info --json | head`: the reader left; that is not an error of ours.
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
