// CUDA driver entry points for launching compiled Triton kernels from Python without
// Triton's launcher (rocmoe/native_launch.py). libcuda.so.1 is opened on first use, so every
// build has these functions; where there is no NVIDIA driver they return ROCMOE_ERR_BACKEND.
// Through cffi a launch costs about a microsecond of host time, against ~7 us through ctypes
// (benchmarks/results/probe_native_launch_h200.log).
#include <dlfcn.h>

#include <mutex>

#include "internal.hpp"

namespace {

// The driver's own signatures, with its handles as opaque pointers (no CUDA headers needed).
using LaunchFn = int (*)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                         unsigned, void *, void **, void **);
using ParamInfoFn = int (*)(void *, size_t, size_t *, size_t *);
using EncodeFn = int (*)(void *, int, uint32_t, void *, const uint64_t *, const uint64_t *,
                         const uint32_t *, const uint32_t *, int, int, int, int);

// cuLaunchKernelEx's configuration, laid out as cuda.h (CUDA 12 and 13) declares
// CUlaunchAttribute and CUlaunchConfig: an attribute is its 4-byte id padded to 8, then a
// 64-byte value union (pointers inside it make it 8-byte aligned)
struct LaunchAttribute {
    int32_t id;
    char pad[4];
    union {
        char raw[64];
        int32_t value;
        void *align;
    } value;
};
static_assert(sizeof(LaunchAttribute) == 72, "CUlaunchAttribute is 72 bytes");
struct LaunchConfig {
    unsigned grid_x, grid_y, grid_z, block_x, block_y, block_z, shared_bytes;
    void *stream;
    LaunchAttribute *attrs;
    unsigned num_attrs;
};
// CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
constexpr int32_t kProgrammaticStreamSerialization = 6;
using LaunchExFn = int (*)(const LaunchConfig *, void *, void **, void **);

struct Driver {
    LaunchFn launch = nullptr;
    ParamInfoFn param_info = nullptr;
    EncodeFn encode = nullptr;
    LaunchExFn launch_ex = nullptr;  // optional: only PDL launches need it
    const char *problem = nullptr;
};

const Driver &driver() {
    static Driver d;
    static std::once_flag once;
    std::call_once(once, [] {
        void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
        if (lib == nullptr) {
            d.problem = "libcuda.so.1 could not be opened (no NVIDIA driver)";
            return;
        }
        d.launch = reinterpret_cast<LaunchFn>(dlsym(lib, "cuLaunchKernel"));
        d.param_info = reinterpret_cast<ParamInfoFn>(dlsym(lib, "cuFuncGetParamInfo"));
        d.encode = reinterpret_cast<EncodeFn>(dlsym(lib, "cuTensorMapEncodeTiled"));
        d.launch_ex = reinterpret_cast<LaunchExFn>(dlsym(lib, "cuLaunchKernelEx"));
        if (d.launch == nullptr || d.param_info == nullptr || d.encode == nullptr)
            d.problem = "libcuda.so.1 lacks cuLaunchKernel, cuFuncGetParamInfo or "
                        "cuTensorMapEncodeTiled (a driver older than CUDA 12.4)";
    });
    return d;
}

}  // namespace

extern "C" int rocmoe_cu_available(void) { return driver().problem == nullptr ? 1 : 0; }

extern "C" int rocmoe_cu_launch(uint64_t function, uint32_t grid_x, uint32_t grid_y,
                                uint32_t grid_z, uint32_t block_x, uint32_t shared_bytes,
                                uint64_t stream, void **params) {
    const Driver &d = driver();
    if (d.problem != nullptr) return rocmoe::fail(ROCMOE_ERR_BACKEND, "%s", d.problem);
    const int rc = d.launch(reinterpret_cast<void *>(function), grid_x, grid_y, grid_z, block_x,
                            1, 1, shared_bytes, reinterpret_cast<void *>(stream), params, nullptr);
    if (rc != 0)
        return rocmoe::fail(ROCMOE_ERR_BACKEND, "cuLaunchKernel returned CUDA error %d", rc);
    return ROCMOE_OK;
}

extern "C" int rocmoe_cu_pdl_available(void) {
    return driver().problem == nullptr && driver().launch_ex != nullptr ? 1 : 0;
}

extern "C" int rocmoe_cu_launch_pdl(uint64_t function, uint32_t grid_x, uint32_t grid_y,
                                    uint32_t grid_z, uint32_t block_x, uint32_t shared_bytes,
                                    uint64_t stream, void **params) {
    const Driver &d = driver();
    if (d.problem != nullptr) return rocmoe::fail(ROCMOE_ERR_BACKEND, "%s", d.problem);
    if (d.launch_ex == nullptr)
        return rocmoe::fail(ROCMOE_ERR_BACKEND, "libcuda.so.1 lacks cuLaunchKernelEx");
    LaunchAttribute attr{};
    attr.id = kProgrammaticStreamSerialization;
    attr.value.value = 1;
    LaunchConfig config{grid_x, grid_y, grid_z, block_x, 1, 1, shared_bytes,
                        reinterpret_cast<void *>(stream), &attr, 1};
    const int rc = d.launch_ex(&config, reinterpret_cast<void *>(function), params, nullptr);
    if (rc != 0)
        return rocmoe::fail(ROCMOE_ERR_BACKEND, "cuLaunchKernelEx returned CUDA error %d", rc);
    return ROCMOE_OK;
}

extern "C" int rocmoe_cu_param_info(uint64_t function, uint64_t index, uint64_t *offset,
                                    uint64_t *size) {
    const Driver &d = driver();
    if (d.problem != nullptr) return rocmoe::fail(ROCMOE_ERR_BACKEND, "%s", d.problem);
    if (offset == nullptr || size == nullptr)
        return rocmoe::fail(ROCMOE_ERR_INVALID, "rocmoe_cu_param_info: NULL output");
    size_t off = 0, sz = 0;
    // past the last parameter the driver answers CUDA_ERROR_INVALID_VALUE
    if (d.param_info(reinterpret_cast<void *>(function), size_t(index), &off, &sz) != 0)
        return rocmoe::fail(ROCMOE_ERR_INVALID, "kernel has no parameter %llu",
                            (unsigned long long)index);
    *offset = off;
    *size = sz;
    return ROCMOE_OK;
}

extern "C" int rocmoe_cu_encode_tiled(void *map, int data_type, uint32_t rank, uint64_t address,
                                      const uint64_t *dims, const uint64_t *byte_strides,
                                      const uint32_t *box, const uint32_t *element_strides,
                                      int interleave, int swizzle, int l2_promotion,
                                      int oob_fill) {
    const Driver &d = driver();
    if (d.problem != nullptr) return rocmoe::fail(ROCMOE_ERR_BACKEND, "%s", d.problem);
    if (map == nullptr || (reinterpret_cast<uintptr_t>(map) & 63u) != 0)
        return rocmoe::fail(ROCMOE_ERR_INVALID, "a tensor map needs 64-byte aligned memory");
    const int rc = d.encode(map, data_type, rank, reinterpret_cast<void *>(address), dims,
                            byte_strides, box, element_strides, interleave, swizzle,
                            l2_promotion, oob_fill);
    if (rc != 0)
        return rocmoe::fail(ROCMOE_ERR_INVALID, "cuTensorMapEncodeTiled returned CUDA error %d",
                            rc);
    return ROCMOE_OK;
}
