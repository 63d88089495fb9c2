"""Every native source compiles for every GPU target rocmoe supports, without a GPU.

One test per (source, toolchain), so a failure names the file and the compiler:
  hipcc    HIP_PLATFORM=amd hipcc -x hip --offload-arch=gfx90a --offload-arch=gfx940 -c
           (MI250X and MI300's first ISA; the HIP 5.2 of CI does not know gfx942)
  clang19  clang-19 -x hip --offload-arch=gfx942 -nogpulib --cuda-device-only -S
           (MI300X device ISA, with the HIP headers of the Debian package)
  nvcc     nvcc -x cu -arch=sm_90 -c   (H100/H200; rocmoe/platform.h maps the hip* names)
Sources: each .hip and .cpp under hip/, and each header through a tiny translation unit; the
device facade rocmoe/shmem.h is compiled as a kernel that calls every function of it, once
per variant (ipc everywhere, NVSHMEM with nvcc -rdc=true, rocSHMEM with the HIP compilers).
Then the full CMake builds of librocmoe for HIP and for CUDA must link.

Compiles run in a thread pool sized to the machine's cores, started by the first test, so the
whole file stays within a few minutes on CI's two cores. A missing tool skips its tests
(fails under ROCMOE_REQUIRE_ALL=1), except rocSHMEM, which cannot be installed here: its
variant is skipped with the reason whenever its header is absent.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

import amd_isa
from rocmoe_testing import REPO, REQUIRE_ALL, require_tool

pytestmark = pytest.mark.compile

HIP_DIR = REPO / "hip"
INCLUDE = HIP_DIR / "include"
SRC = HIP_DIR / "src"
HIPCC_ARCHS = ("gfx90a", "gfx940")
CLANG_ARCH = "gfx942"
CUDA_ARCH = "sm_90"
TIMEOUT_S = 600
TOOLCHAINS = ("hipcc", "clang19", "nvcc")
TOOL_BINARIES = {"hipcc": "hipcc", "clang19": "clang-19", "nvcc": "nvcc"}

# -- translation units -----------------------------------------------------------------

FACADE_PROBE = r"""
#include "rocmoe/shmem.h"
// Calls every function of the device facade so that each one is compiled to device code.
namespace sh = rocmoe::shmem;
__global__ void rocmoe_facade_probe(sh::Team team, char *dst, const char *src, size_t n,
                                    uint64_t *sig, int pe, int *status) {
    sh::put_nbi_wg(team, dst, src, n, pe);
    sh::put_signal_nbi_wg(team, dst, src, n, sig, 1, pe);
    if (threadIdx.x == 0) {
        sh::put_u64(team, sig + 1, 7, pe);
        sh::fence(team);
        sh::signal_set(team, sig, 2, pe);
        sh::signal_add(team, sig, 1, pe);
        sh::quiet(team);
        uint64_t seen = 0;
        status[0] = sh::wait_until(team, sig, sh::kCmpGe, 3, 1000000, &seen);
        status[1] = sh::peer_ptr(team, dst, pe) != nullptr;
        status[2] = static_cast<int>(sh::signal_fetch(team, sig) + seen);
    }
}
"""

PLATFORM_PROBE = r"""
#include "rocmoe/platform.h"
// Every hip* name rocmoe relies on, and the device helpers, must exist on both platforms.
#if defined(ROCMOE_PLATFORM_AMD)
static_assert(ROCMOE_WAVE_SIZE == 64, "CDNA wavefronts are 64 wide");
#else
static_assert(ROCMOE_WAVE_SIZE == 32, "NVIDIA warps are 32 wide");
#endif
__global__ void rocmoe_platform_probe(uint64_t *p, uint64_t *t) {
    rocmoe::platform::store_release_system(p, 1);
    uint64_t v = rocmoe::platform::load_acquire_system(p + 1);
    v += rocmoe::platform::fetch_add_release_system(p + 2, 1);
    __threadfence_system();
    rocmoe::platform::relax();
    t[threadIdx.x] = rocmoe::platform::device_time_ns() + v + atomicAdd(reinterpret_cast<unsigned *>(t), 1u);
}
int rocmoe_platform_host_probe(void *peer_handle_out) {
    int n = 0;
    void *p = nullptr, *q = nullptr;
    hipStream_t s;
    hipIpcMemHandle_t h;
    if (hipGetDeviceCount(&n) != hipSuccess || hipSetDevice(0) != hipSuccess) return 1;
    if (hipExtMallocWithFlags(&p, 64, hipDeviceMallocFinegrained) != hipSuccess) return 2;
    if (hipMalloc(&q, 64) != hipSuccess || hipMemset(q, 0, 64) != hipSuccess) return 3;
    if (hipStreamCreateWithFlags(&s, hipStreamNonBlocking) != hipSuccess) return 4;
    if (hipMemcpyAsync(q, p, 64, hipMemcpyDeviceToDevice, s) != hipSuccess) return 5;
    if (hipMemcpy(q, p, 64, hipMemcpyDefault) != hipSuccess) return 6;
    hipLaunchKernelGGL(rocmoe_platform_probe, dim3(1), dim3(ROCMOE_WAVE_SIZE), 0, s,
                       static_cast<uint64_t *>(p), static_cast<uint64_t *>(q));
    if (hipGetLastError() != hipSuccess || hipStreamSynchronize(s) != hipSuccess) return 7;
    if (hipIpcGetMemHandle(&h, p) != hipSuccess) return 8;
    if (hipIpcOpenMemHandle(&peer_handle_out, h, hipIpcMemLazyEnablePeerAccess) != hipSuccess)
        return 9;
    if (hipIpcCloseMemHandle(peer_handle_out) != hipSuccess) return 10;
    if (hipDeviceSynchronize() != hipSuccess) return 11;
    if (hipStreamDestroy(s) != hipSuccess || hipFree(q) != hipSuccess) return 12;
    hipError_t err = hipFree(p);
    return err == hipSuccess ? 0 : (hipGetErrorString(err)[0] != '\0' ? 13 : 14);
}
"""


def _include_tu(header: str) -> str:
    return f'#include "{header}"\n'


def _sources() -> list[tuple[str, str]]:
    """(test id, how to get the source) for every file under hip/, found at collection time."""
    items = []
    for path in sorted(HIP_DIR.rglob("*")):
        rel = path.relative_to(REPO).as_posix()
        if path.suffix in (".hip", ".cpp"):
            items.append((rel, "file"))
        elif path.suffix in (".h", ".hpp"):
            if path.name.startswith("shmem_"):
                continue  # the facade's variants: compiled through rocmoe/shmem.h below
            items.append((rel, "header"))
    items += [("shmem.h[ipc]", "facade"), ("shmem.h[nvshmem]", "facade"),
              ("shmem.h[rocshmem]", "facade"), ("platform.h[probe]", "platform")]
    return items


SOURCES = _sources()


def _nvshmem_include() -> Path | None:
    home = os.environ.get("NVSHMEM_HOME")
    if home and (Path(home) / "include" / "nvshmem.h").exists():
        return Path(home) / "include"
    try:
        import nvidia.nvshmem as m  # the pip wheel nvidia-nvshmem-cu13
        for root in m.__path__:
            if (Path(root) / "include" / "nvshmem.h").exists():
                return Path(root) / "include"
    except ImportError:
        pass
    return None


def _rocshmem_include() -> Path | None:
    for root in filter(None, [os.environ.get("ROCSHMEM_HOME"), os.environ.get("ROCM_PATH"),
                              "/opt/rocm", "/usr"]):
        if (Path(root) / "include" / "rocshmem" / "rocshmem.hpp").exists():
            return Path(root) / "include"
    return None


class Skip(Exception):
    """A (source, toolchain) pair that does not apply here; the message says why."""


def _command(source_id: str, kind: str, toolchain: str, workdir: Path) -> tuple[list, dict]:
    env = dict(os.environ)
    includes = [f"-I{INCLUDE}", f"-I{SRC}"]
    defines = ["-DROCMOE_HAVE_GPU"]
    rdc = []
    if kind == "file":
        src = REPO / source_id
    else:
        name = source_id.replace("/", "_").replace("[", "_").replace("]", "")
        src = workdir / f"{name}.{toolchain}.hip"
        if kind == "header":
            header = Path(source_id)
            # include it the way the sources do: from hip/include, or from hip/src (which
            # is on the include path), so headers in hip/src/gpu/ are found too
            base = "hip/include" if source_id.startswith("hip/include/") else "hip/src"
            rel = header.relative_to(base).as_posix()
            src.write_text(_include_tu(rel))
        elif kind == "platform":
            src.write_text(PLATFORM_PROBE)
        else:
            src.write_text(FACADE_PROBE)
            variant = source_id.split("[")[1].rstrip("]")
            if variant == "nvshmem":
                inc = _nvshmem_include()
                if inc is None:
                    message = "NVSHMEM headers not found: pip install nvidia-nvshmem-cu13"
                    if REQUIRE_ALL:
                        pytest.fail(message + " (ROCMOE_REQUIRE_ALL=1)")
                    raise Skip(message)
                includes.append(f"-I{inc}")
                defines.append("-DROCMOE_SHMEM_NVSHMEM")
                rdc = ["-rdc=true"]  # NVSHMEM device code is a static, relocatable library
            elif variant == "rocshmem":
                inc = _rocshmem_include()
                if inc is None:
                    # Not installable here (needs ROCm >= 6.4): skipped even under
                    # ROCMOE_REQUIRE_ALL (marked rocshmem, tests/skip_policy.py), with the
                    # reason in the report.
                    raise Skip("rocSHMEM headers (rocshmem/rocshmem.hpp) are not installed; "
                               "they need ROCm >= 6.4 and cannot be installed on this machine")
                includes.append(f"-I{inc}")
                defines.append("-DROCMOE_SHMEM_ROCSHMEM")
                rdc = ["-fgpu-rdc"]
    out = workdir / f"{src.stem}.{toolchain}.{'s' if toolchain == 'clang19' else 'o'}"
    if toolchain == "hipcc":
        env["HIP_PLATFORM"] = "amd"  # else hipcc calls nvcc when it finds one
        cmd = ["hipcc", "-std=c++17", "-x", "hip", *[f"--offload-arch={a}" for a in HIPCC_ARCHS],
               "-O1", "-Werror=return-type", *includes, *defines, "-DROCMOE_PLATFORM_IS_HIP",
               "-D__HIP_PLATFORM_AMD__", *rdc, "-c", str(src), "-o", str(out)]
    elif toolchain == "clang19":
        cmd = ["clang-19", "-std=c++17", "-x", "hip", f"--offload-arch={CLANG_ARCH}", "-nogpulib",
               "--cuda-device-only", "-S", "-O1", "-D__HIP_PLATFORM_AMD__", *includes, *defines,
               "-DROCMOE_PLATFORM_IS_HIP", *rdc, str(src), "-o", str(out)]
    else:
        cmd = ["nvcc", "-std=c++17", "-x", "cu", f"-arch={CUDA_ARCH}", "-O1", *includes, *defines,
               "-DROCMOE_PLATFORM_IS_CUDA", *rdc, "-c", str(src), "-o", str(out)]
    return cmd, env


class CompilePool:
    """Starts every compile at once on first use; each test then waits for its own."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.pool = ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2))
        self.jobs: dict[tuple[str, str], Future] = {}

    def _run(self, source_id: str, kind: str, toolchain: str):
        try:
            cmd, env = _command(source_id, kind, toolchain, self.workdir)
        except Skip as why:
            return "skip", str(why), []
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=env, timeout=TIMEOUT_S)
        return proc.returncode, proc.stdout, cmd

    def start(self, wanted: set):
        """Submit the compiles of the collected tests only (`-k` selects fewer)."""
        if self.jobs:
            return
        kinds = dict(SOURCES)
        for source_id, toolchain in sorted(wanted, key=lambda w: (w[1] != "nvcc", w)):
            if shutil.which(TOOL_BINARIES[toolchain]) is not None:
                self.jobs[(source_id, toolchain)] = self.pool.submit(
                    self._run, source_id, kinds[source_id], toolchain)

    def result(self, source_id: str, toolchain: str):
        return self.jobs[(source_id, toolchain)].result()


@pytest.fixture(scope="module")
def compile_pool(tmp_path_factory, request):
    pool = CompilePool(tmp_path_factory.mktemp("compile"))
    pool.start({(item.callspec.params["source_id"], item.callspec.params["toolchain"])
                for item in request.session.items
                if getattr(item, "originalname", "") == "test_source_compiles"})
    yield pool
    pool.pool.shutdown(wait=True, cancel_futures=True)


# The facade's shmem variants exist for one vendor each: NVSHMEM for nvcc, rocSHMEM for the
# HIP compilers; the rocSHMEM pairs are the one compile allowed to skip in CI.
ONLY_FOR = {"shmem.h[nvshmem]": ("nvcc",), "shmem.h[rocshmem]": ("hipcc", "clang19")}


def _compile_cases():
    cases = []
    for source_id, _ in SOURCES:
        for toolchain in ONLY_FOR.get(source_id, TOOLCHAINS):
            marks = [pytest.mark.rocshmem] if source_id == "shmem.h[rocshmem]" else []
            cases.append(pytest.param(source_id, toolchain, marks=marks,
                                      id=f"{source_id}-{toolchain}"))
    return cases


@pytest.mark.parametrize("source_id,toolchain", _compile_cases())
def test_source_compiles(compile_pool, source_id, toolchain):
    require_tool(TOOL_BINARIES[toolchain], "GPU compile checks")
    status, output, cmd = compile_pool.result(source_id, toolchain)
    if status == "skip":
        pytest.skip(output)
    assert status == 0, f"{source_id} does not compile with {toolchain}:\n{' '.join(cmd)}\n{output}"


# -- the release sequence of a HIP signal on CDNA ---------------------------------------------

SIGNAL_PROBE = r"""
#include "rocmoe/shmem.h"
// A data store, then the facade's signal to a peer: what every HIP kernel of rocmoe does at
// the end of a slice. The data are 32-bit, so the 64-bit stores are the flags.
namespace sh = rocmoe::shmem;
__global__ void rocmoe_signal_set_probe(sh::Team team, uint32_t *data, uint64_t *sig, int pe) {
    data[threadIdx.x] = threadIdx.x;
    if (threadIdx.x == 0) sh::signal_set(team, sig, 1, pe);
}
__global__ void rocmoe_signal_add_probe(sh::Team team, uint32_t *data, uint64_t *sig, int pe) {
    data[threadIdx.x] = threadIdx.x;
    if (threadIdx.x == 0) sh::signal_add(team, sig, 1, pe);
}
"""
HIP_FLAG_STORE = r"^(global|flat)_(store_dwordx2|atomic_add_x2) "


@pytest.fixture(scope="module")
def signal_probe_isa(tmp_path_factory):
    """clang-19's gfx942 and gfx90a assembly of SIGNAL_PROBE."""
    clang = require_tool("clang-19", "AMD device ISA")
    work = tmp_path_factory.mktemp("signal_probe")
    src = work / "signal_probe.hip"
    src.write_text(SIGNAL_PROBE)
    listings = {}
    for arch in ("gfx942", "gfx90a"):
        out = work / f"signal_probe.{arch}.s"
        subprocess.run([clang, "-std=c++17", "-x", "hip", f"--offload-arch={arch}", "-nogpulib",
                        "--cuda-device-only", "-S", "-O1", "-D__HIP_PLATFORM_AMD__",
                        f"-I{INCLUDE}", f"-I{SRC}", "-DROCMOE_HAVE_GPU", "-DROCMOE_PLATFORM_IS_HIP",
                        str(src), "-o", str(out)], check=True, timeout=TIMEOUT_S)
        listings[arch] = out.read_text()
    return listings


@pytest.mark.parametrize("arch", ["gfx942", "gfx90a"])
def test_hip_signal_writes_back_l2_at_system_scope_right_before_the_flag(signal_probe_isa, arch):
    # signal_set and signal_add (platform.h's system-scope release): the system-scope L2
    # write-back, then the flag, nothing stored in between (tests/amd_isa.py)
    problems = amd_isa.release_problems(signal_probe_isa[arch], arch, HIP_FLAG_STORE,
                                        wait=False)
    assert not problems, "\n".join(problems)
    assert len(amd_isa.flag_stores(signal_probe_isa[arch], HIP_FLAG_STORE)) == 2


# platform.h writes the wait after the write-back itself (amd_isa.WAIT_DROPPED_BY: clang-19
# drops the one its own release lowering should emit)
@pytest.mark.parametrize("arch", ["gfx942", "gfx90a"])
def test_hip_signal_waits_for_the_write_back_before_the_flag(signal_probe_isa, arch):
    problems = amd_isa.release_problems(signal_probe_isa[arch], arch, HIP_FLAG_STORE)
    assert not problems, "\n".join(problems)


# -- full CMake builds ---------------------------------------------------------------------

def _cmake_build(build_dir: Path, *options: str, env: dict | None = None) -> Path:
    cmake = require_tool("cmake", "pip install cmake")
    require_tool("ninja", "pip install ninja")
    env = dict(os.environ if env is None else env)
    configure = [cmake, "-S", str(REPO), "-B", str(build_dir), "-G", "Ninja",
                 f"-DPython_EXECUTABLE={sys.executable}", *options]
    for cmd in (configure, [cmake, "--build", str(build_dir)]):
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=env, timeout=TIMEOUT_S)
        assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-6000:]}"
    lib = build_dir / "librocmoe.so"
    assert lib.exists(), f"{lib} was not built"
    return lib


def _dynamic_symbols(lib: Path) -> str:
    nm = require_tool("nm", "binutils")
    return subprocess.run([nm, "-D", "--defined-only", str(lib)], stdout=subprocess.PIPE,
                          text=True, check=True).stdout


def _needed(lib: Path) -> str:
    return subprocess.run(["ldd", str(lib)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True).stdout


def test_cmake_hip_build_links_against_amdhip64(tmp_path):
    require_tool("hipcc", "CMake HIP build")
    env = dict(os.environ, HIP_PLATFORM="amd")
    lib = _cmake_build(tmp_path / "hip", "-DROCMOE_GPU=hip", "-DCMAKE_CXX_COMPILER=hipcc",
                       f"-DROCMOE_HIP_ARCHS={';'.join(HIPCC_ARCHS)}", env=env)
    assert "rocmoe_ipc_store_signal" in _dynamic_symbols(lib)
    assert "libamdhip64" in _needed(lib)
    assert list((tmp_path / "hip").glob("_rocmoe_cffi*.so")), "the cffi module was not built"
    # the table-records writer is host C++ even when hipcc compiles it (CMakeLists.txt)
    assert list((tmp_path / "hip").glob("_rocmoe_records*.so")), \
        "_rocmoe_records was not built with hipcc as the C++ compiler"


def test_cmake_cuda_build_links_against_cudart(tmp_path):
    require_tool("nvcc", "CMake CUDA build")
    lib = _cmake_build(tmp_path / "cuda", "-DROCMOE_GPU=cuda")
    assert "rocmoe_ipc_store_signal" in _dynamic_symbols(lib)
    assert "libcudart" in _needed(lib)
    cuobjdump = shutil.which("cuobjdump")
    if cuobjdump:
        listing = subprocess.run([cuobjdump, "--list-elf", str(lib)], stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True).stdout
        assert "sm_90" in listing, f"no sm_90 code in {lib}:\n{listing}"


def test_cmake_cuda_nvshmem_build_links_the_device_library(tmp_path):
    require_tool("nvcc", "CMake CUDA build")
    include = _nvshmem_include()
    if include is None:
        message = "NVSHMEM not found: pip install nvidia-nvshmem-cu13"
        if REQUIRE_ALL:
            pytest.fail(message + " (ROCMOE_REQUIRE_ALL=1)")
        pytest.skip(message)
    lib = _cmake_build(tmp_path / "nvshmem", "-DROCMOE_GPU=cuda", "-DROCMOE_SHMEM=nvshmem",
                       f"-DROCMOE_NVSHMEM_HOME={include.parent}")
    symbols = _dynamic_symbols(lib)
    assert "rocmoe_ipc_store_signal" in symbols
    assert "libnvshmem_host" in _needed(lib)
    # NVSHMEM's init and device state come from libnvshmem_device.a, device-linked in.
    local = subprocess.run(["nm", "-C", str(lib)], stdout=subprocess.PIPE, text=True).stdout
    assert "nvshmemi_device_state_d" in local and "nvshmemi_init_thread" in local


def _ptxas_usage(source: Path) -> dict:
    """{kernel's mangled name: (registers, spill store bytes)} of `source` built for sm_90
    with the Release build's flags (CMakeLists.txt: -O3), from ptxas' verbose report."""
    nvcc = require_tool("nvcc", "the CUDA toolkit")
    cmd = [nvcc, "-O3", "-DNDEBUG", "-std=c++17", f"-arch={CUDA_ARCH}", "-x", "cu",
           "--expt-relaxed-constexpr", "-DROCMOE_HAVE_GPU", "-DROCMOE_PLATFORM_IS_CUDA",
           f"-I{REPO / 'hip' / 'include'}", f"-I{REPO / 'hip' / 'src'}", "-Xptxas", "-v",
           "-c", str(source), "-o", os.devnull]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-4000:]
    usage, name, spill = {}, None, None
    for line in proc.stdout.splitlines():
        if "Compiling entry function '" in line:
            name = line.split("'")[1]
        elif name and "bytes spill stores" in line:
            spill = int(line.split("bytes stack frame,")[1].split("bytes spill stores")[0])
        elif name and "Used " in line and " registers" in line:
            usage[name] = (int(line.split("Used ")[1].split(" registers")[0]), spill)
            name = None
    return usage


def _amdgpu_kernels(source: Path, arch: str, tmp_path: Path) -> dict:
    """amd_isa.kernel_metadata of `source` built for `arch` by clang-19 with the Release
    build's optimisation (-O3; the per-source compiles above use -O1 to stay quick)."""
    clang = require_tool("clang-19", "clang-19 builds the AMD device code")
    out = tmp_path / f"{source.stem}.{arch}.s"
    cmd = [clang, "-std=c++17", "-x", "hip", f"--offload-arch={arch}", "-nogpulib",
           "--cuda-device-only", "-S", "-O3", "-DNDEBUG", "-D__HIP_PLATFORM_AMD__",
           f"-I{INCLUDE}", f"-I{SRC}", "-DROCMOE_HAVE_GPU", "-DROCMOE_PLATFORM_IS_HIP",
           str(source), "-o", str(out)]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return amd_isa.kernel_metadata(out.read_text())


# the GEMV kernels that need no scratch on CDNA: what a call launches by default (world size
# 1: one row a wave, four loads in flight, plain loads; the one-shot kernel above it; the
# balanced split). The protocol kernel (gemv_all_reduce_kernel: ROCMOE_GEMV_ONE_SHOT=0 or more
# than 64 ranks) spills on CDNA and on sm_90 alike, as do some ROCMOE_GEMV_ROWS_PER_WARP /
# ROCMOE_GEMV_UNROLL instantiations
DEFAULT_GEMV_KERNELS = ("gemv_direct_kernel", "gemv_one_shot_kernel", "gemv_balanced_kernel")


@pytest.mark.parametrize("arch", ["gfx942", "gfx90a"])
@pytest.mark.parametrize("source", ["fused_embedding.hip", "fused_gemv.hip", "fused_common.hip",
                                    "ipc_backend.hip"])
def test_hip_kernels_use_no_scratch_memory_on_cdna(source, arch, tmp_path):
    # Scratch is per-lane memory reached through the vector memory path. The embedding
    # kernels read their table records from the launch's arguments at a table index known
    # only at run time; while one pointer could point either there or to the device array of
    # records, the compiler copied all of the arguments (1.6 KB of inline records) into
    # scratch in every lane before the kernel began (1664-1696 bytes a lane, every embedding
    # kernel, clang-19 -O3 for gfx942)
    kernels = _amdgpu_kernels(SRC / "gpu" / source, arch, tmp_path)
    checked = {name: meta for name, meta in kernels.items()
               if source != "fused_gemv.hip"
               or (any(k in name for k in DEFAULT_GEMV_KERNELS) and "Li1ELi4E" in name)
               or "gemv_balanced_kernel" in name}
    assert checked, sorted(kernels)
    scratch = {name: meta[".private_segment_fixed_size"] for name, meta in checked.items()
               if meta[".private_segment_fixed_size"]}
    assert not scratch, scratch


def test_amdgcn_resources_tool_reports_every_kernel_of_the_hip_sources():
    # benchmarks/amdgcn_resources.py --kernels hip: the figures behind the check above, one
    # JSON line a kernel, read from the same metadata
    require_tool("clang-19", "clang-19 builds the AMD device code")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO),
                                                                    os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "amdgcn_resources.py"),
                           "--kernels", "hip", "--arch", "gfx942"], env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-4000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    sources = {r["source"] for r in rows}
    assert sources == {"fused_common.hip", "fused_embedding.hip", "fused_gemv.hip",
                       "ipc_backend.hip"}, sources
    embedding = [r for r in rows if r["source"] == "fused_embedding.hip"]
    assert len(embedding) == 12  # direct and a2a kernels, three types, vector path or not
    assert all(r["scratch_bytes"] == 0 and r["vgprs"] > 0 for r in embedding), embedding


def test_embedding_protocol_kernels_vector_path_keeps_four_workgroups_an_sm_on_sm90():
    # the protocol kernel (world size > 1) gathered 17-42 % slower than the direct kernel at
    # world size 1 while it held 80-98 registers a thread (three workgroups of 256 an SM
    # against four to five); its launch bound keeps the vector path at <= 64, with no spill
    # (timed on the H200 in the sixteenth session: 7-25 % faster, results/
    # fused_gpu_h200_sixteenth_session_embedding_protocol.jsonl)
    usage = _ptxas_usage(REPO / "hip" / "src" / "gpu" / "fused_embedding.hip")
    vector = {k: v for k, v in usage.items() if "embedding_a2a_kernel" in k and "Lb1E" in k}
    assert len(vector) == 3, sorted(usage)  # fp32, bf16, fp16
    for kernel, (registers, spilled) in vector.items():
        assert registers <= 64 and spilled == 0, (kernel, registers, spilled)
