"""Loads the cffi binding of librocmoe and turns its status codes into exceptions.

Python reaches native code through this module only (DESIGN.md, layer 2).
"""

from __future__ import annotations

from . import errors

try:
    from ._rocmoe_cffi import ffi, lib  # built by CMake from hip/include/rocmoe/rocmoe.h
except ImportError as exc:  # pragma: no cover - exercised only on broken installs
    raise errors.NativeLibraryError(
        f"rocmoe's native module could not be loaded ({exc}); build it with `pip install -e .` "
        "(or `make build`) in the source tree"
    ) from exc

BACKENDS = {"host": lib.ROCMOE_BACKEND_HOST, "ipc": lib.ROCMOE_BACKEND_IPC,
            "rocshmem": lib.ROCMOE_BACKEND_ROCSHMEM, "nvshmem": lib.ROCMOE_BACKEND_NVSHMEM}
BACKEND_NAMES = {v: k for k, v in BACKENDS.items()}
PLATFORMS = {lib.ROCMOE_PLATFORM_NONE: "none", lib.ROCMOE_PLATFORM_HIP: "hip",
             lib.ROCMOE_PLATFORM_CUDA: "cuda"}
COMPARISONS = {"==": lib.ROCMOE_CMP_EQ, "!=": lib.ROCMOE_CMP_NE, ">": lib.ROCMOE_CMP_GT,
               ">=": lib.ROCMOE_CMP_GE, "<": lib.ROCMOE_CMP_LT, "<=": lib.ROCMOE_CMP_LE}

_ERRORS = {
    lib.ROCMOE_ERR_INVALID: errors.InvalidArgumentError,
    lib.ROCMOE_ERR_NOMEM: errors.HeapExhaustedError,
    lib.ROCMOE_ERR_TIMEOUT: errors.CommTimeoutError,
    lib.ROCMOE_ERR_PEER_DEAD: errors.PeerDeadError,
    lib.ROCMOE_ERR_BACKEND: errors.BackendUnavailableError,
    lib.ROCMOE_ERR_SYSTEM: errors.SystemCallError,
    lib.ROCMOE_ERR_STATE: errors.ContextError,
    lib.ROCMOE_ERR_UNREACHABLE: errors.PeerUnreachableError,
}


def last_error() -> str:
    return ffi.string(lib.rocmoe_last_error()).decode(errors="replace")


def check(rc: int, what: str = "") -> None:
    """Raise the RocmoeError subclass for a non-zero librocmoe status."""
    if rc == lib.ROCMOE_OK:
        return
    cls = _ERRORS.get(rc, errors.RocmoeError)
    text = last_error() or f"status {rc}"
    raise cls(f"{what}: {text}" if what else text)


def version() -> str:
    return ffi.string(lib.rocmoe_version()).decode()


def backends_compiled() -> list[str]:
    mask = lib.rocmoe_backends_compiled()
    return [name for name, bit in BACKENDS.items() if mask & (1 << bit)]


def gpu_platform() -> str:
    return PLATFORMS.get(lib.rocmoe_gpu_platform(), "unknown")


def gpu_device_count() -> int:
    count = ffi.new("int *")
    check(lib.rocmoe_gpu_device_count(count), "counting GPUs")
    return int(count[0])
